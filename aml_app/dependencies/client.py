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

A batch may say what it needs (`Need`: next offsets of one log): the service waits a bounded time for its
store to cover them, or answers "not yet" with its `as_of`; then the next replica is asked, and when
none has it, `NotYet` tells the caller to ask again later. The client remembers the highest `as_of` each
service has shown: an answer below it (a replica behind the others, a store restored from a backup) is
the named event "went back", counted and logged, and the question goes to another replica first.

Service B lists at most `AML_API_MAX_ROWS` entries per request in its `out` parts (and as many in `in`,
and in `neighbourhood`), taken by the queries in order; an answer it cut short names the parts in
`truncated`. The client makes every such list whole before it returns: an `out` or `in` list goes on
with the counterparties after the last one listed (`after`, a page), and a part that lists nothing yet
(the queries before it took the bound) is asked again alone, in requests of their own, until each list
is whole. So a batch answers as its queries asked one by one with no bound would, and the detectors
(which read the payer's `out`) decide as they would without the bound. Each page and each question
asked again is counted (`ClientStats.asked_again`). The follow-ups come from later snapshots of B's
store, each covering at least what the batch's `need` names; the detectors ask as of each payment's time
(`at`), which the event-time gate makes the same in each. A whole answer claims only what every
snapshot it was made of holds: the lowest `as_of`, and no `log` if theirs differ. Only a list that
cannot go on is returned as B gives it, the start of the list with its `truncated`, counted
(`ClientStats.truncated`) and logged: a `neighbourhood` longer than the bound (the detectors never ask
for one), or a counterparty paid in more currencies than the bound has rows (`AML_API_MAX_ROWS` is at
least 200; ISO 4217 has fewer codes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec
from yarl import URL

from aml_app.dependencies.relations import LOOP_HOPS, MinAverage
from aml_app.tokens import bearer

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


class NotYet(RuntimeError):
    """No replica's store covered what the question needs within the wait: ask again later."""


log = logging.getLogger(__name__)
#: The header of a request whose body is JSON.
JSON_BODY = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Need:
    """The next offsets (of the log `log`, None: any) a batch's answers must include, and how long the
    service may wait for its store to get there (`need` of the batch routes, aml_app.dependencies.api,
    which parses it into this class)."""

    as_of: Mapping[int, int]
    log: str | None = None
    wait: float = 2.0

    def met(self, as_of: Mapping[int, int], log: str | None) -> bool:
        """Whether a store at `as_of`, of the log `log`, has applied what is needed."""
        if self.log is not None and log != self.log:
            return False
        return all(as_of.get(p, 0) >= o for p, o in self.as_of.items())

    def as_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "as_of": {str(p): o for p, o in sorted(self.as_of.items())},
            "wait_ms": round(1000 * self.wait),
        }
        if self.log is not None:
            doc["log"] = self.log
        return doc


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
    not_yet: int = 0  # answers "not yet": the store had not applied what the question needed
    went_back: int = 0  # answers below an as_of the service had shown before
    asked_again: int = 0  # pages and questions asked again because B's bound per request cut a list short
    truncated: int = 0  # answers returned with a list cut short: longer than B lists for one request
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

    def order(self, route: int | None = None) -> list[URL]:
        """Every replica once, starting with the next in turn, or with replica `route` modulo their
        number; resting ones last."""
        if route is None:
            start = self._next
            self._next = (self._next + 1) % len(self.urls)
        else:
            start = route % len(self.urls)
        turn = [(start + k) % len(self.urls) for k in range(len(self.urls))]
        now = time.monotonic()
        awake = [i for i in turn if self._resting.get(i, 0) <= now]
        return [self.urls[i] for i in awake + [i for i in turn if i not in awake]]

    def failed(self, url: URL) -> None:
        """Asked last for RESTING seconds: down, or behind the others."""
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
        token: str = "",
    ) -> None:
        self.replicas = {"relations": Replicas(relations_urls), "aggregates": Replicas(aggregates_urls)}
        #: Sent with every request when the APIs want one (AML_API_TOKEN).
        self._headers = bearer(token) or None
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.max_connections = max_connections
        self.stats = ClientStats()
        self._session: aiohttp.ClientSession | None = None
        #: Per service, the log and the highest next offset per partition its answers have shown.
        self.highest: dict[str, tuple[str | None, dict[int, int]]] = {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self.timeout, headers=self._headers
            )
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
        at: datetime | None = None,
    ) -> dict[str, Any]:
        """One GET /relations; `loop` is the closing payer, the time and the longest loop of a `loop` part,
        `at` the instant to answer as of (None: from every payment B holds). A list B cut short is made
        whole as `relations_many` makes it."""
        query = {"hops": str(hops), "parts": parts, "min_average": min_average_text(min_average)}
        if at is not None:
            query["at"] = at.isoformat()
        if loop is not None:
            query.update(closing=loop[0], at=loop[1].isoformat(), loop_hops=str(loop[2]))
        answer = await self._send(
            "relations", lambda base: _resource(base, "relations", account).with_query(query), None
        )
        if not answer.get("truncated"):
            return answer
        [whole] = await self._whole([{"account": account, **query}], [answer], None)
        return whole

    async def aggregates_many(
        self, queries: Sequence[tuple[str, datetime]], need: Need | None = None, route: int | None = None
    ) -> list[dict[str, Any]]:
        """One POST /aggregates for several (account, at): one snapshot of C answers them all, or its answer
        cache in part. `route` picks the replica asked first (`Replicas.order`)."""
        body: dict[str, Any] = {"queries": [{"account": a, "at": at.isoformat()} for a, at in queries]}
        if need is not None:
            body["need"] = need.as_json()
        answer = await self._send("aggregates", lambda base: base / "aggregates", body, route, len(queries))
        return _answers(answer, len(queries), "aggregates")

    async def relations_many(
        self,
        accounts: Sequence[str],
        hops: int = CYCLE_HOPS,
        parts: str | Sequence[str] = RELATIONS_PARTS,
        min_average: MinAverage = Decimal(0),
        loops: Sequence[tuple[str, datetime, int] | None] | None = None,
        need: Need | None = None,
        ats: Sequence[datetime | None] | None = None,
        route: int | None = None,
    ) -> list[dict[str, Any]]:
        """One POST /relations for several accounts: one snapshot of B answers them all, or its answer
        cache in part. `parts` is one list for every account, or one per account; `loops` gives, per
        account, the closing payer, the time and the longest loop of a `loop` part (None where no loop is
        asked); `ats`, per account, the instant to answer as of (None: from every payment B holds);
        `route`, the replica asked first (`Replicas.order`)."""
        each = [parts] * len(accounts) if isinstance(parts, str) else list(parts)
        closing = [None] * len(accounts) if loops is None else list(loops)
        instants = [None] * len(accounts) if ats is None else list(ats)
        queries = []
        heavy = min_average_text(min_average)  # once: a per-currency list is long
        for account, asked, loop, at in zip(accounts, each, closing, instants, strict=True):
            query: dict[str, Any] = {"account": account, "hops": hops, "parts": asked, "min_average": heavy}
            if at is not None:
                query["at"] = at.isoformat()
            if loop is not None:
                query.update(closing=loop[0], at=loop[1].isoformat(), loop_hops=loop[2])
            queries.append(query)
        body: dict[str, Any] = {"queries": queries}
        if need is not None:
            body["need"] = need.as_json()
        answer = await self._send("relations", lambda base: base / "relations", body, route, len(accounts))
        return await self._whole(queries, _answers(answer, len(accounts), "relations"), need, route)

    async def _whole(
        self,
        queries: list[dict[str, Any]],
        answers: list[dict[str, Any]],
        need: Need | None,
        route: int | None = None,
    ) -> list[dict[str, Any]]:
        """`answers` (to `queries`, asked in one request) with every list that B's bound per request cut
        short made whole: an `out` or `in` part goes on with the counterparties after the last one it
        lists (`after`: a page), a part that lists nothing yet, or a `neighbourhood`, is asked again
        alone. A round's follow-ups go in one request, in order. The first query of a request has the
        whole bound to itself, so each round completes it or moves it on; what cannot move on (a
        `neighbourhood` longer than the bound) is used as B gives it, with its `truncated`, counted and
        logged."""
        # What a request asked: per query, the answer it completes, the part it asks again (None: the
        # whole query), and the query itself.
        asked: list[tuple[int, str | None, dict[str, Any]]] = [(i, None, q) for i, q in enumerate(queries)]
        got, answers = answers, list(answers)
        left_cut: dict[int, dict[str, int]] = {}
        while True:
            following: list[tuple[int, str | None, dict[str, Any]]] = []
            for k, ((i, part, query), answer) in enumerate(zip(asked, got, strict=True)):
                cut: dict[str, int] = answer.pop("truncated", None) or {}
                if part is None:
                    answers[i] = answer
                    new = {p: len(answer.get(p, [])) for p in cut}
                elif part == "neighbourhood":
                    _as_of_both(answers[i], answer)
                    answers[i][part] = answer.get(part, [])
                    new = {}
                else:  # the counterparties after `after` (an older B would list them all again)
                    _as_of_both(answers[i], answer)
                    after = query.get("after")
                    page = [e for e in answer.get(part, []) if after is None or e["counterparty"] > after]
                    answers[i][part] = [*answers[i][part], *page] if after is not None else page
                    new = {part: len(page)}
                for p in cut:
                    listed = answers[i].get(p, [])
                    alone: dict[str, Any] = {k: query[k] for k in ("account", "hops", "at") if k in query}
                    if k == 0 and not (p in ("out", "in") and new.get(p)):  # it had the whole bound
                        left_cut.setdefault(i, {})[p] = len(listed)
                    elif p in ("out", "in") and listed:
                        following.append((i, p, {**alone, "parts": p, "after": listed[-1]["counterparty"]}))
                    else:  # the queries before it took the bound
                        following.append((i, p, {**alone, "parts": p}))
            if not following:
                break
            asked = following
            self.stats.asked_again += len(asked)
            body: dict[str, Any] = {"queries": [q for _, _, q in asked]}
            if need is not None:
                body["need"] = need.as_json()
            again = await self._send("relations", lambda base: base / "relations", body, route, len(asked))
            got = _answers(again, len(asked), "relations")
        for i, cut in left_cut.items():
            answers[i]["truncated"] = cut
            self._truncated(answers[i])
        return answers

    def _truncated(self, answer: Mapping[str, Any]) -> None:
        self.stats.truncated += 1
        log.warning(
            "relations lists only the first %s of %r: more than it lists for one request "
            "(AML_API_MAX_ROWS), taken as it is",
            ", ".join(f"{n} entries of {part}" for part, n in answer.get("truncated", {}).items()),
            answer.get("account"),
        )

    async def _send(
        self,
        dependency: str,
        where: Callable[[URL], URL],
        body: Any,
        route: int | None = None,
        answers: int | None = None,
    ) -> dict[str, Any]:
        """The request on each replica in turn until one answers usefully; its JSON object (with
        `answers`, a batch of that many). An answer that cannot be read is that replica's failure, as
        one that is down; one that went back, or says "not yet", sends the question on to the next
        replica; the one that went back is kept in case no other replica answers."""
        replicas = self.replicas[dependency]
        failures, behind = [], []
        fallback: tuple[dict[str, Any], Progress] | None = None
        level = False  # whether a replica answered at or above what this service showed before
        for base in replicas.order(route):
            try:
                answer = await self._send_to(dependency, where(base), body)
                shown = self._readable(dependency, base, answer, answers)
            except DependencyUnavailable as exc:
                replicas.failed(base)
                failures.append(str(exc))
                continue
            replicas.answered(base)
            # A reply with kept answers shows the newest store this replica read, a bound below where
            # its store is: another replica's later read being above it says nothing of this one.
            went_back = "kept" not in answer and self._went_back(dependency, base, shown)
            level = level or not went_back
            if went_back:
                replicas.failed(base)
            if answer.get("not_yet"):
                self.stats.not_yet += 1
                behind.append(f"{base} has as_of {answer.get('as_of')}")
                continue
            if went_back:
                if fallback is None:  # kept in case no other replica answers
                    fallback = answer, shown
                continue
            self._saw(dependency, shown)
            return answer
        if fallback is not None:  # every replica that answered is below: the service itself went back
            self.highest.pop(dependency, None)
            answer, shown = fallback
            self._saw(dependency, shown)
            return answer
        if behind:
            if not level:  # every replica that answered is below, and behind: the service went back
                self.highest.pop(dependency, None)
            raise NotYet(f"{dependency} has not applied what the question needs yet: {'; '.join(behind)}")
        if len(failures) == 1:
            raise DependencyUnavailable(failures[0])
        raise DependencyUnavailable(f"every replica of {dependency} failed: {'; '.join(failures)}")

    def _readable(
        self, dependency: str, base: URL, answer: Mapping[str, Any], answers: int | None
    ) -> Progress:
        """The answer's progress (`_progress`), read once for every check of it; `DependencyUnavailable`
        for an answer whose progress (`as_of`) or batch cannot be read."""
        try:
            shown = _progress(answer)
            if answers is not None and not answer.get("not_yet"):
                _answers(answer, answers, dependency)
            return shown
        except (DependencyUnavailable, TypeError, ValueError, AttributeError) as exc:
            message = f"{dependency} at {base} answered what cannot be read: {exc}"
            self._failed(message)
            raise DependencyUnavailable(message) from exc

    def _went_back(self, dependency: str, base: URL, shown: Progress) -> bool:
        """Whether an answer's progress is below an as_of this service showed before, in the same log (the
        named event "went back": a replica behind the others, or a store restored); logged and counted."""
        if shown is None or dependency not in self.highest:
            return False
        log_id, as_of = shown
        seen_log, seen = self.highest[dependency]
        if log_id != seen_log:
            return False
        lower = {p: (as_of.get(p, 0), o) for p, o in seen.items() if as_of.get(p, 0) < o}
        if not lower:
            return False
        self.stats.went_back += 1
        log.warning(
            "%s at %s went back: as_of %s, below what it showed before (%s): a replica behind the "
            "others or a store restored; asking another replica first",
            dependency,
            base,
            ", ".join(f"{p}:{now}" for p, (now, _) in sorted(lower.items())),
            ", ".join(f"{p}:{before}" for p, (_, before) in sorted(lower.items())),
        )
        return True

    def _saw(self, dependency: str, shown: Progress) -> None:
        """Raise the highest `as_of` this service has shown (per log) to an answer's."""
        if shown is None:
            return
        log_id, as_of = shown
        seen_log, seen = self.highest.get(dependency, (log_id, {}))
        if log_id != seen_log:  # another log: its offsets start over
            seen = {}
        self.highest[dependency] = (log_id, {p: max(o, seen.get(p, 0)) for p, o in {**seen, **as_of}.items()})

    async def _send_to(self, dependency: str, url: URL, body: Any) -> dict[str, Any]:
        """GET `url` (no body) or POST `body` as JSON; the answer's JSON object."""
        started = time.monotonic()
        self.stats.requests += 1
        self.stats.by_dependency[dependency] = self.stats.by_dependency.get(dependency, 0) + 1
        client = self._client()
        try:
            # msgspec writes a batch's body in under a third of json.dumps's time (aiohttp's `json=`).
            request = (
                client.get(url)
                if body is None
                else client.post(url, data=msgspec.json.encode(body), headers=JSON_BODY)
            )
            async with request as response:
                if response.status >= 500:
                    raise DependencyUnavailable(f"{dependency} answered {response.status} for {url.path}")
                raw = await response.read()
                if response.status >= 400:  # refused, whatever the body is (a proxy's HTML page too)
                    try:
                        refused = msgspec.json.decode(raw)
                        message = refused.get("error") if isinstance(refused, dict) else refused
                    except ValueError:
                        message = raw[:200].decode("utf-8", "replace")
                    raise DependencyRequestError(f"{dependency} refused {url}: {response.status} {message}")
                # msgspec decodes in about half of json's time; its errors are ValueErrors, as json's are.
                body = msgspec.json.decode(raw)
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


#: (log, as_of) of an answer (`_progress`), None for an empty batch.
Progress = tuple[str | None, dict[int, int]] | None


def _progress(answer: Mapping[str, Any]) -> Progress:
    """(log, as_of) of an answer: a single answer's own, a "not yet"'s, or a batch's: its own `as_of`
    and `log` where some of its answers were kept ones (their `as_of` says where the store was when
    first asked, `aml_app.dependencies.answer_cache`), else its first answer's (one snapshot answers
    them all); None for an empty batch."""
    if "answers" in answer and "as_of" not in answer:
        answers = answer["answers"]
        if not isinstance(answers, list) or not answers or not isinstance(answers[0], Mapping):
            return None
        answer = answers[0]
    raw = answer.get("as_of")
    if not isinstance(raw, Mapping):
        return None
    return answer.get("log"), {int(p): int(o) for p, o in raw.items()}


def _as_of_both(whole: dict[str, Any], page: Mapping[str, Any]) -> None:
    """Make `whole`, an answer that `page` (from a later request, maybe of another snapshot) goes on,
    claim only what both hold: on each partition the lower `as_of`, no `log` where theirs differ (an
    answer of no log proves nothing, and the detector asks again), and not `exact` where the page is not
    (a later snapshot, taken after B folded payments: the decision says so)."""
    mine, theirs = whole.get("as_of") or {}, page.get("as_of") or {}
    whole["as_of"] = {p: min(int(mine.get(p, 0)), int(theirs.get(p, 0))) for p in {*mine, *theirs}}
    if whole.get("log") != page.get("log"):
        whole["log"] = None
    if page.get("exact") is False:
        whole["exact"] = False


def min_average_text(min_average: MinAverage) -> str:
    """B's `min_average` parameter: `1000`, or one per currency `EUR:853.4,USD:1000`."""
    if isinstance(min_average, Mapping):
        return ",".join(f"{c}:{format(a, 'f')}" for c, a in sorted(min_average.items()))
    return format(min_average, "f")


def _resource(base: URL, kind: str, account: str) -> URL:
    """`base/kind/<account>` with the account id as ONE path segment: a '/' in it is encoded, not a split."""
    path = f"{base.raw_path.rstrip('/')}/{kind}/{quote(account, safe='')}"
    return base.with_path(path, encoded=True)


def _answers(answer: Mapping[str, Any], expected: int, dependency: str) -> list[dict[str, Any]]:
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
    need: Need | None = None,
    route: int | None = None,
    needs: Mapping[str, Need | None] | None = None,
) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(payer aggregates, payee aggregates, payer relations, payee relations) for each (payer, payee, at):
    two requests in all, asked concurrently, whatever the number of payments. `min_average` is what a
    heavy edge is for B's layering parts (the detection thresholds' `graph_min_average`, in each
    currency), `loop_hops` the longest cycle the payment may close (their `cycle_max_hops`); `need`,
    what both must have applied, unless `needs` says otherwise for one (relations, aggregates: one that
    reads a topic derived from payments needs offsets on that topic). `route` (the payments' partition)
    picks the replica of each asked
    first: every detector asks a partition's questions of the same replica, whose answer cache then
    serves the second detector what the first one asked."""
    if not payments:
        return []
    asked = [
        asyncio.ensure_future(request)
        for request in (
            client.aggregates_many(
                [q for payer, payee, at in payments for q in ((payer, at), (payee, at))],
                need=(needs or {}).get("aggregates", need),
                route=route,
            ),
            client.relations_many(
                [account for payer, payee, _ in payments for account in (payer, payee)],
                parts=[parts for _ in payments for parts in (PAYER_PARTS, PAYEE_PARTS)],
                min_average=min_average,
                loops=[loop for payer, _, at in payments for loop in (None, (payer, at, loop_hops))],
                need=(needs or {}).get("relations", need),
                # Every answer as of the payment's time: what B applied later does not change the decision.
                ats=[at for _, _, at in payments for _ in range(2)],
                route=route,
            ),
        )
    ]
    try:
        aggregates, relations = await asyncio.gather(*asked)
    except BaseException:
        # One failed (or this round was cancelled): the other request, and the rounds it would go on
        # with, serve nobody; gather alone leaves it running beside the next round's.
        for request in asked:
            request.cancel()
        raise
    return [
        (aggregates[2 * i], aggregates[2 * i + 1], relations[2 * i], relations[2 * i + 1])
        for i in range(len(payments))
    ]
