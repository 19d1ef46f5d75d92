"""The detectors' HTTP client for Services B (relations) and C (aggregates).

One pooled `aiohttp.ClientSession` per worker, shared by every partition lane: keep-alive connections,
no per-payment connection set-up. Each request has a timeout.

Each service may run several replicas (stateless APIs over one store: any replica gives the same answer).
Requests take turns over them; a replica that does not answer usefully (down, timeout, 5xx) is skipped
for a few seconds and the request goes to the next one at once, so one replica going down costs no
decision. Only when every replica failed does the request raise `DependencyUnavailable`; the caller waits
and asks again (a payment is never skipped because a dependency was away). A 4xx means our request is
wrong, which retrying cannot fix: `DependencyRequestError`.

Every answer carries `as_of` = {partition: next offset applied} and `log`, the identity of the log those
offsets are of; `includes` says whether an answer proves that it already contains payment (p, o).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from aml_app.dependencies.relations import LOOP_HOPS, MinAverage

#: Service B parts the detectors use, about the payer and about the payee: the neighbourhood is never
#: needed and can be most of the graph.
RELATIONS_PARTS = "out,cycle"
PAYER_PARTS = "out"
#: `chain` and `loop` ask about the payment itself (B's `closing` is its payer): the flow it continues,
#: and the cycle it closes (the payee is where money that went around starts).
PAYEE_PARTS = "chain,sources,co_payees,loop"
CYCLE_HOPS = 3


class DependencyUnavailable(RuntimeError):
    """A dependency did not answer usefully (down, timeout, 5xx): wait and ask again."""


class DependencyRequestError(RuntimeError):
    """A dependency refused the request itself (4xx): a bug on our side, reported loudly."""


def includes(answer: Mapping[str, Any], partition: int, offset: int, log: str | None = None) -> bool:
    """Whether an answer's `as_of` proves it includes payment (partition, offset) of the log `log`.

    Offsets mean something only within one log (`aml_app.kafka.identity`): when the caller knows which
    log the payment is from, an answer built from another one (the topic deleted and created again, a
    store of another cluster) proves nothing, whatever its offsets."""
    if log is not None and answer.get("log") != log:
        return False
    return int(answer.get("as_of", {}).get(str(partition), 0)) > offset


@dataclass
class ClientStats:
    """What the client did, for logs, the web view and the benchmarks."""

    requests: int = 0
    failures: int = 0
    seconds: float = 0.0
    last_error: str | None = None
    by_dependency: dict[str, int] = field(default_factory=dict)


#: How long a replica that failed is left out before it is tried again.
RESTING = 5.0


class Replicas:
    """The base URLs of one service's API replicas, in turn, leaving out for a while those that failed."""

    def __init__(self, urls: str | Sequence[str]) -> None:
        listed = [urls] if isinstance(urls, str) else list(urls)
        if not listed:
            raise ValueError("a dependency needs at least one URL")
        self.urls = [URL(u) for u in listed]
        self._next = 0
        self._resting: dict[int, float] = {}

    def order(self) -> list[URL]:
        """Every replica once, starting with the next in turn; resting ones last."""
        start = self._next
        self._next = (self._next + 1) % len(self.urls)
        turn = [(start + k) % len(self.urls) for k in range(len(self.urls))]
        now = time.monotonic()
        awake = [i for i in turn if self._resting.get(i, 0) <= now]
        return [self.urls[i] for i in awake + [i for i in turn if i not in awake]]

    def failed(self, url: URL) -> None:
        self._resting[self.urls.index(url)] = time.monotonic() + RESTING

    def answered(self, url: URL) -> None:
        self._resting.pop(self.urls.index(url), None)


class DependencyClient:
    """GET /aggregates and /relations with pooling, timeouts and replicas; one instance per worker process."""

    def __init__(
        self,
        relations_urls: str | Sequence[str],
        aggregates_urls: str | Sequence[str],
        timeout: float = 5.0,
        max_connections: int = 64,
    ) -> None:
        self.replicas = {"relations": Replicas(relations_urls), "aggregates": Replicas(aggregates_urls)}
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.max_connections = max_connections
        self.stats = ClientStats()
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def aggregates(self, account: str, at: datetime) -> dict[str, Any]:
        return await self._send(
            "aggregates",
            lambda base: _resource(base, "aggregates", account).with_query(at=at.isoformat()),
            None,
        )

    async def relations(
        self,
        account: str,
        hops: int = CYCLE_HOPS,
        parts: str = RELATIONS_PARTS,
        min_average: MinAverage = Decimal(0),
        loop: tuple[str, datetime, int] | None = None,
    ) -> dict:
        """One GET /relations; `loop` is the closing payer, the time and the longest loop of a `loop` part."""
        query = {"hops": str(hops), "parts": parts, "min_average": min_average_text(min_average)}
        if loop is not None:
            query.update(closing=loop[0], at=loop[1].isoformat(), loop_hops=str(loop[2]))
        return await self._send(
            "relations", lambda base: _resource(base, "relations", account).with_query(query), None
        )

    async def aggregates_many(self, queries: Sequence[tuple[str, datetime]]) -> list[dict[str, Any]]:
        """One POST /aggregates for several (account, at): one snapshot of C answers them all."""
        body = {"queries": [{"account": a, "at": at.isoformat()} for a, at in queries]}
        answer = await self._send("aggregates", lambda base: base / "aggregates", body)
        return _answers(answer, len(queries), "aggregates")

    async def relations_many(
        self,
        accounts: Sequence[str],
        hops: int = CYCLE_HOPS,
        parts: str | Sequence[str] = RELATIONS_PARTS,
        min_average: MinAverage = Decimal(0),
        loops: Sequence[tuple[str, datetime, int] | None] | None = None,
    ) -> list[dict[str, Any]]:
        """One POST /relations for several accounts: one snapshot of B answers them all. `parts` is one
        list for every account, or one per account; `loops` gives, per account, the closing payer, the
        time and the longest loop of a `loop` part (None where no loop is asked)."""
        each = [parts] * len(accounts) if isinstance(parts, str) else list(parts)
        closing = [None] * len(accounts) if loops is None else list(loops)
        queries = []
        for account, asked, loop in zip(accounts, each, closing, strict=True):
            query: dict[str, Any] = {
                "account": account,
                "hops": hops,
                "parts": asked,
                "min_average": min_average_text(min_average),
            }
            if loop is not None:
                query.update(closing=loop[0], at=loop[1].isoformat(), loop_hops=loop[2])
            queries.append(query)
        body = {"queries": queries}
        answer = await self._send("relations", lambda base: base / "relations", body)
        return _answers(answer, len(accounts), "relations")

    async def _send(self, dependency: str, where: Callable[[URL], URL], body: Any) -> dict[str, Any]:
        """The request on each replica in turn until one answers usefully; its JSON object."""
        replicas = self.replicas[dependency]
        failures = []
        for base in replicas.order():
            try:
                answer = await self._send_to(dependency, where(base), body)
            except DependencyUnavailable as exc:
                replicas.failed(base)
                failures.append(str(exc))
                continue
            replicas.answered(base)
            return answer
        if len(failures) == 1:
            raise DependencyUnavailable(failures[0])
        raise DependencyUnavailable(f"every replica of {dependency} failed: {'; '.join(failures)}")

    async def _send_to(self, dependency: str, url: URL, body: Any) -> dict[str, Any]:
        """GET `url` (no body) or POST `body` as JSON; the answer's JSON object."""
        started = time.monotonic()
        self.stats.requests += 1
        self.stats.by_dependency[dependency] = self.stats.by_dependency.get(dependency, 0) + 1
        client = self._client()
        try:
            request = client.get(url) if body is None else client.post(url, json=body)
            async with request as response:
                if response.status >= 500:
                    raise DependencyUnavailable(f"{dependency} answered {response.status} for {url.path}")
                body = await response.json(content_type=None)
                if response.status >= 400:
                    message = body.get("error") if isinstance(body, dict) else body
                    raise DependencyRequestError(f"{dependency} refused {url}: {response.status} {message}")
                if not isinstance(body, dict):
                    raise DependencyUnavailable(f"{dependency} answered {type(body).__name__}, not an object")
                return body
        except DependencyRequestError:
            self._failed("request refused")
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError, DependencyUnavailable) as exc:
            message = str(exc) or type(exc).__name__
            self._failed(f"{dependency}: {message}")
            if isinstance(exc, DependencyUnavailable):
                raise
            raise DependencyUnavailable(f"{dependency} at {url.origin()} is unavailable: {message}") from exc
        finally:
            self.stats.seconds += time.monotonic() - started

    def _failed(self, message: str) -> None:
        self.stats.failures += 1
        self.stats.last_error = message


def min_average_text(min_average: MinAverage) -> str:
    """B's `min_average` parameter: `1000`, or one per currency `EUR:853.4,USD:1000`."""
    if isinstance(min_average, Mapping):
        return ",".join(f"{c}:{format(a, 'f')}" for c, a in sorted(min_average.items()))
    return format(min_average, "f")


def _resource(base: URL, kind: str, account: str) -> URL:
    """`base/kind/<account>` with the account id as ONE path segment: a '/' in it is encoded, not a split."""
    path = f"{base.raw_path.rstrip('/')}/{kind}/{quote(account, safe='')}"
    return base.with_path(path, encoded=True)


def _answers(answer: dict[str, Any], expected: int, dependency: str) -> list[dict[str, Any]]:
    answers = answer.get("answers")
    if (
        not isinstance(answers, list)
        or len(answers) != expected
        or not all(isinstance(a, dict) for a in answers)
    ):
        raise DependencyUnavailable(f"{dependency} answered a batch of {expected} without {expected} answers")
    return answers


async def evidence_for(
    client: DependencyClient,
    payments: Sequence[tuple[str, str, datetime]],
    min_average: MinAverage = Decimal(0),
    loop_hops: int = LOOP_HOPS,
) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(payer aggregates, payee aggregates, payer relations, payee relations) for each (payer, payee, at):
    two requests in all, asked concurrently, whatever the number of payments. `min_average` is what a
    heavy edge is for B's layering parts (the detection thresholds' `graph_min_average`, in each
    currency), `loop_hops` the
    longest cycle the payment may close (their `cycle_max_hops`)."""
    if not payments:
        return []
    aggregates, relations = await asyncio.gather(
        client.aggregates_many([q for payer, payee, at in payments for q in ((payer, at), (payee, at))]),
        client.relations_many(
            [account for payer, payee, _ in payments for account in (payer, payee)],
            parts=[parts for _ in payments for parts in (PAYER_PARTS, PAYEE_PARTS)],
            min_average=min_average,
            loops=[loop for payer, _, at in payments for loop in (None, (payer, at, loop_hops))],
        ),
    )
    return [
        (aggregates[2 * i], aggregates[2 * i + 1], relations[2 * i], relations[2 * i + 1])
        for i in range(len(payments))
    ]
