"""HTTP APIs of services B (relations) and C (aggregates), on aiohttp, reading PostgreSQL only.

Routes (every response is JSON; every fault is 4xx/5xx with {"error": "<sentence>"}):
- relations:  GET /relations/{account}?hops=2   hops is a whole number 1..3 (default 2); `parts=out,cycle`
              answers only those parts (of out, in, neighbourhood, cycle, chain, sources, co_payees;
              default all but loop); `min_average=1000` is the average payment of a heavy edge
              (default 0), or one per currency (`USD:1000,EUR:853.4`), which chain, sources and
              co_payees look at; the part `loop` needs
              `closing=<payer>` and `at=ISO` (the payment into the account that would close it) and
              takes `loop_hops=2..16` (default 12); `chain` takes `closing` (its last edge); `at=ISO`
              answers every part as of that instant, from the payments made by then (default: all)
- aggregates: GET /aggregates/{account}?at=ISO  at is an ISO-8601 instant with a timezone (default now);
              'Z' is accepted, and a '+' that the query string decoded to a space is put back; each
              window's sums per currency and their totals in the AML rules' reporting currency
- batches:    POST /relations  {"queries": [{"account": "a", "hops": 3, "parts": "out,cycle",
                                "min_average": "1000", "closing": "b", "at": "ISO",
                                "loop_hops": 12}, ...]}
              POST /aggregates {"queries": [{"account": "a", "at": "ISO"}, ...]}
              -> {"answers": [...]} in the order asked, every answer as its GET would give it, all from
              ONE read snapshot (one as_of); at most MAX_BATCH queries. With
              "need": {"as_of": {"0": 42}, "log": "...", "wait_ms": 2000} the batch is answered from
              the first snapshot whose as_of has reached those next offsets (of that log), the service
              looking again for up to wait_ms; else {"not_yet": true, "as_of", "log", "waited_ms"}
- both:       GET /health   200 when the store answers and is not behind its consumer group, else 503

Account ids are path segments (percent-encode '/', '%', '?', '#'), at most 128 characters.

An API keeps no state of its own: every answer is read from the store in one REPEATABLE READ snapshot
together with its `as_of` and `log` (the identity of the Kafka log those offsets are of, as the store
recorded it, `aml_app.kafka.identity`; null for a store that records none), so any number of replicas on
any hosts give the same answers; /health reports both too. The service
starts without the store's tables and answers empty (as_of {}) until the pipeline creates them. Every
few seconds it checks the store against its consumer group's committed offsets (the store-loss guard,
`aml_app.dependencies.guard`); a store found behind makes /health and every query answer 503 with the
sentence that says what to do, rather than serve answers the gate would trust. So does a store at
another schema version than this program's (during an upgrade, until the new pipeline migrated it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import psycopg
import psycopg_pool
from aiohttp import web

from aml_app import dependency_services as registry
from aml_app.contract import MAX_ID_LENGTH
from aml_app.dependencies import aggregates, relations
from aml_app.dependencies.client import Need
from aml_app.dependencies.guard import behind
from aml_app.dependencies.relations import ALL_PARTS, LOOP_HOPS, LOOP_MAX_HOPS, MAX_HOPS, PARTS
from aml_app.dependencies.store import Reader, Snapshot, StoreVersionMismatch, redacted

log = logging.getLogger(__name__)

DEFAULT_HOPS = 2
MAX_BATCH = 1000
CHECK_EVERY = 2.0  # seconds between two checks of the store against its consumer group
MAX_WAIT_MS = 10_000  # the longest a batch may wait for the store to cover what it needs
POLL = (0.02, 0.25)  # seconds between two looks at the store while a batch waits: first, longest
SERVICE = web.AppKey("service", str)
ROUTES: web.AppKey[list[str]] = web.AppKey("routes", list)
# "...T10:00:00 01:00": a '+01:00' offset whose '+' the query string decoded to a space.
_DECODED_PLUS = re.compile(r"^(.*T[0-9:.,]+) ([0-9]{2}(:?[0-9]{2})?)$")


class BadRequest(ValueError):
    """A request a person has to fix; the message is the 400 answer."""


class StoreBehind(RuntimeError):
    """The store is behind its consumer group (the guard's sentence): answers would lack history."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return _error(400, str(exc))
    except web.HTTPNotFound:
        answered: list[str] = request.app[ROUTES]
        routes = ", ".join(sorted(answered))
        return _error(404, f"There is no resource at {request.path}; this service answers {routes}.")
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return _error(405, f"Method {request.method} is not allowed here; use {allowed}.")
    except web.HTTPException as exc:
        return _error(exc.status, exc.reason)
    except (StoreBehind, StoreVersionMismatch) as exc:
        return _error(503, f"{str(exc)[0].upper()}{str(exc)[1:]}")
    except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
        log.warning("store read failed for %s: %s", request.path, exc)
        return _error(503, "The store could not be read right now; try again shortly.")
    except Exception:
        log.exception("unexpected error for %s", request.path)
        return _error(500, "Internal error while answering this request; see the service log.")


def _account(request: web.Request) -> str:
    account = request.match_info["account"]
    if len(account) > MAX_ID_LENGTH:
        raise BadRequest(f"The account id is {len(account)} characters long; the limit is {MAX_ID_LENGTH}.")
    if not account.strip():
        raise BadRequest("The account id is blank.")
    return account


def _single(request: web.Request, name: str) -> str | None:
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise BadRequest(f"The query parameter {name!r} is given {len(values)} times; give it once.")
    return values[0] if values else None


def parse_hops(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_HOPS
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_HOPS:
        raise BadRequest(f"hops must be a whole number from 1 to {MAX_HOPS}, got {raw[:40]!r}.")
    return int(text)


def parse_need(raw: Any) -> Need | None:
    """A batch's `need`: {"as_of": {"<partition>": <next offset>, ...}, "log": "<identity>" or absent,
    "wait_ms": 0..MAX_WAIT_MS}; absent: answer at once from whatever the store holds."""
    if raw is None:
        return None
    example = 'such as {"as_of": {"0": 42}, "log": "...", "wait_ms": 2000}'
    if not isinstance(raw, dict) or not isinstance(raw.get("as_of"), dict):
        raise BadRequest(f"need must be an object with an as_of object, {example}.")
    as_of = {}
    for p, o in raw["as_of"].items():
        if not (isinstance(p, str) and p.isascii() and p.isdigit()) or not isinstance(o, int) or o < 0:
            raise BadRequest(f"need.as_of maps partitions to next offsets >= 0, {example}; got {p!r}: {o!r}.")
        as_of[int(p)] = o
    log_id, wait_ms = raw.get("log"), raw.get("wait_ms", 0)
    if log_id is not None and not isinstance(log_id, str):
        raise BadRequest(f"need.log must be a string, {example}.")
    if not isinstance(wait_ms, int) or isinstance(wait_ms, bool) or not 0 <= wait_ms <= MAX_WAIT_MS:
        raise BadRequest(f"need.wait_ms must be a whole number from 0 to {MAX_WAIT_MS}, got {wait_ms!r}.")
    return Need(as_of, log_id, wait_ms / 1000)


async def _body(request: web.Request) -> tuple[list[dict[str, Any]], Need | None]:
    """The `queries` of a batch request body, each an object (checked further by the caller), and its
    `need`."""
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest('The request body must be JSON: {"queries": [...]}.') from None
    queries = body.get("queries") if isinstance(body, dict) else None
    if not isinstance(queries, list) or not all(isinstance(q, dict) for q in queries):
        raise BadRequest('The request body must be {"queries": [...]} with one object per query.')
    if len(queries) > MAX_BATCH:
        raise BadRequest(f"A batch holds at most {MAX_BATCH} queries; this one has {len(queries)}.")
    return queries, parse_need(body.get("need"))


async def answered_when_covered(
    reader: Reader, need: Need | None, compute: Callable[[Snapshot], Awaitable[list[dict[str, Any]]]]
) -> dict[str, Any]:
    """`{"answers": compute(snapshot)}` from the first snapshot that meets `need`, looking again (from
    POLL[0] to POLL[1] apart) for at most `need.wait` seconds; then `{"not_yet": true, "as_of", "log",
    "waited_ms"}`: the store has not applied what the question needs, ask again (or another replica)."""
    started = time.monotonic()
    delay = POLL[0]
    while True:
        async with reader.snapshot() as snap:
            log_id = snap.meta.get("log")
            if need is None or need.met(snap.as_of, log_id):
                return {"answers": await compute(snap)}
            as_of = snap.as_of
        left = need.wait - (time.monotonic() - started)
        if left <= 0:
            return {
                "not_yet": True,
                "as_of": {str(p): o for p, o in sorted(as_of.items())},
                "log": log_id,
                "waited_ms": round(1000 * (time.monotonic() - started)),
            }
        await asyncio.sleep(min(delay, left))
        delay = min(delay * 2, POLL[1])


def _batch_account(query: dict[str, Any], i: int) -> str:
    account = query.get("account")
    if not isinstance(account, str) or not account.strip() or len(account) > MAX_ID_LENGTH:
        raise BadRequest(
            f"queries[{i}].account must be a non-blank string of at most {MAX_ID_LENGTH} characters."
        )
    return account


def _text_or_none(query: dict[str, Any], name: str, i: int) -> str | None:
    value = query.get(name)
    if value is None or isinstance(value, str):
        return value
    if name in ("hops", "loop_hops") and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise BadRequest(f"queries[{i}].{name} must be a string, got {type(value).__name__}.")


def parse_min_average(raw: str | None) -> relations.MinAverage:
    """The average payment from which an edge counts as heavy: a plain decimal >= 0 for every currency
    (default 0), or one per currency as `USD:1000,EUR:853.4` (a currency not named is never heavy)."""
    if raw is None:
        return Decimal(0)
    example = "such as 1000, or one per currency such as USD:1000,EUR:853.4"
    if ":" not in raw:
        value = _plain_decimal(raw)
        if value is None:
            raise BadRequest(f"min_average must be a plain decimal number >= 0 {example}, got {raw[:40]!r}.")
        return value
    per: dict[str, Decimal] = {}
    for item in raw.split(","):
        currency, _, text = item.strip().partition(":")
        value = _plain_decimal(text)
        if not re.fullmatch(r"[A-Z]{3}", currency) or value is None or currency in per:
            raise BadRequest(f"min_average must be a plain decimal number >= 0 {example}, got {raw[:60]!r}.")
        per[currency] = value
    return per


def _plain_decimal(raw: str) -> Decimal | None:
    text = raw.strip()
    if len(text) > 40 or not re.fullmatch(r"[0-9]+(\.[0-9]+)?", text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def parse_parts(raw: str | None) -> tuple[str, ...]:
    if raw is None:
        return PARTS
    parts = tuple(p.strip() for p in raw.split(","))
    unknown = [p for p in parts if p not in ALL_PARTS]
    if unknown or not parts:
        raise BadRequest(f"parts must be a comma-separated list of {', '.join(ALL_PARTS)}, got {raw[:60]!r}.")
    return parts


def parse_loop(
    parts: Sequence[str], closing: str | None, at: str | None, loop_hops: str | None, where: str = ""
) -> tuple[str | None, datetime | None, int]:
    """(closing, at, loop_hops) of a query: `closing` and `at` required with the part `loop`; `closing`
    taken by `chain` and refused where no part asked reads it; `at` (answer as of then) taken by every
    part."""
    if closing is not None and (not closing.strip() or len(closing) > MAX_ID_LENGTH):
        raise BadRequest(
            f"{where}closing must be the payer of the payment into the account, "
            f"a non-blank id of at most {MAX_ID_LENGTH} characters."
        )
    if "loop" not in parts:
        if loop_hops is not None:
            raise BadRequest(f"{where}loop_hops belongs to the part loop, which is not asked.")
        if closing is not None and "chain" not in parts:
            raise BadRequest(
                f"{where}closing belongs to the parts chain and loop, neither of which is asked."
            )
        return closing, None if at is None else parse_at(at), LOOP_HOPS
    if closing is None:
        raise BadRequest(
            f"{where}the part loop needs closing: the payer of the payment into the account, "
            f"a non-blank id of at most {MAX_ID_LENGTH} characters."
        )
    if at is None:
        raise BadRequest(f"{where}the part loop needs at: the time of the payment that would close it.")
    hops = LOOP_HOPS
    if loop_hops is not None:
        text = loop_hops.strip()
        if not (text.isascii() and text.isdigit()) or not 2 <= int(text) <= LOOP_MAX_HOPS:
            raise BadRequest(
                f"{where}loop_hops must be a whole number from 2 to {LOOP_MAX_HOPS}, got {loop_hops[:40]!r}."
            )
        hops = int(text)
    return closing, parse_at(at), hops


def parse_at(raw: str | None) -> datetime:
    """An aware UTC datetime from the `at` parameter (default: now)."""
    if raw is None:
        return datetime.now(UTC)
    text = raw.strip()
    fixed = _DECODED_PLUS.match(text)
    if fixed:
        text = f"{fixed.group(1)}+{fixed.group(2)}"
    example = "such as 2026-01-02T03:04:05Z"
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise BadRequest(f"at must be an ISO-8601 instant {example}, got {raw[:60]!r}.") from None
    if when.tzinfo is None or when.utcoffset() is None:
        raise BadRequest(f"at must include a timezone ('Z' or an offset), {example}; got {raw[:60]!r}.")
    try:
        return when.astimezone(UTC)
    except OverflowError:
        raise BadRequest(f"at is out of range: {raw[:60]!r}.") from None


class StoreCheck:
    """Compares the store with its consumer group's committed offsets, now and every CHECK_EVERY seconds.

    `state` is "unknown" until the first comparison, then "ok" or "behind" (with `problem`, the guard's
    sentence). While Kafka cannot be read, the last verdict stands and `error` says why.
    """

    def __init__(self, reader: Reader, service: str, settings: Any) -> None:
        from aml_app.kafka.offsets import DependencyOffsets

        self.reader = reader
        self.service = service
        self.group = registry.service(service).group(settings)
        self.offsets = DependencyOffsets(
            settings.bootstrap_servers,
            settings.payments_topic,
            [self.group],
            security=settings.kafka_security,
        )
        self.state = "unknown"
        self.problem: str | None = None
        self.error: str | None = None
        self.checked_at: float | None = None

    async def check(self) -> None:
        from aml_app.kafka.offsets import OffsetReadError

        unreadable = (
            OffsetReadError,
            StoreVersionMismatch,
            psycopg.OperationalError,
            psycopg_pool.PoolTimeout,
        )
        try:
            _partitions, committed = await self.offsets.read()
            # Committed first, then the store: see guard.behind.
            async with self.reader.snapshot() as snap:
                applied = snap.as_of
        except unreadable as exc:
            self.error = str(exc) or type(exc).__name__
            return
        self.error = None
        self.problem = behind(self.service, self.group, applied, committed[self.group])
        if self.problem and self.state != "behind":
            log.error("%s", self.problem)
        self.state = "behind" if self.problem else "ok"
        self.checked_at = time.time()

    def refuse_if_behind(self) -> None:
        if self.problem is not None:
            raise StoreBehind(self.problem)

    async def run(self) -> None:
        """Check every CHECK_EVERY seconds for the application's lifetime: a check that fails in a way
        `check` does not expect (a table dropped by hand, a bug) is logged once and retried, because a
        dead loop would leave the last verdict standing for good and the store-loss guard silently off."""
        while True:
            try:
                await self.check()
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                if error != self.error:
                    log.exception(
                        "the %s store check failed; trying again every %.0f s", self.service, CHECK_EVERY
                    )
                self.error = error
            await asyncio.sleep(CHECK_EVERY)

    def as_json(self) -> dict[str, Any]:
        return {"state": self.state, "group": self.group, "problem": self.problem, "error": self.error}

    async def close(self) -> None:
        await self.offsets.close()


def _app(service: str, routes: list[str], reader: Reader, check: StoreCheck | None) -> web.Application:
    """The parts both APIs share: errors as JSON, the store's pool and the check, opened and closed with
    the application."""
    app = web.Application(middlewares=[_json_errors])
    app[SERVICE] = service
    app[ROUTES] = ["GET /health", *routes]

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        await reader.open()
        task = asyncio.create_task(check.run()) if check is not None else None
        yield
        if task is not None:
            assert check is not None  # the task runs the check
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await check.close()
        await reader.close()

    app.cleanup_ctx.append(lifetime)

    async def health(request: web.Request) -> web.Response:
        async with reader.snapshot() as snap:
            meta = snap.meta
            body = {
                "status": "ok",
                "service": service,
                "store": redacted(reader.url),
                "store_exists": snap.schema is not None,
                "as_of": {str(p): o for p, o in sorted(snap.as_of.items())},
                "log": meta.get("log"),
            }
        body.update(registry.service(service).health(meta))
        if check is not None:
            body["store_check"] = check.as_json()
            if check.state == "behind":
                body["status"] = "behind"
                return web.json_response(body, status=503)
        return web.json_response(body)

    app.router.add_get("/health", health)
    return app


def relations_app(reader: Reader, settings: Any = None, check: StoreCheck | None = None) -> web.Application:
    """B's API (`settings` is not read: B's answers depend on its store only)."""
    app = _app(
        "relations",
        [
            "GET /relations/{account}?hops=1..3&parts=out,in,neighbourhood,cycle,chain,sources,co_payees"
            "&min_average=0&at=ISO",
            "GET /relations/{account}?parts=loop&closing=PAYER&at=ISO&loop_hops=2..16",
            "GET /relations/{account}?parts=chain&closing=PAYER&at=ISO",
            "POST /relations",
        ],
        reader,
        check,
    )

    async def answer(queries: list[relations.Query], need: Need | None = None) -> dict[str, Any]:
        if check is not None:
            check.refuse_if_behind()

        async def compute(snap: Snapshot) -> list[dict[str, Any]]:
            return await relations.relations_many(
                snap.cur, snap.schema, queries, snap.as_of, snap.meta.get("log")
            )

        return await answered_when_covered(reader, need, compute)

    async def single(request: web.Request) -> web.Response:
        parts = parse_parts(_single(request, "parts"))
        query = relations.Query(
            _account(request),
            parse_hops(_single(request, "hops")),
            parts,
            parse_min_average(_single(request, "min_average")),
            *parse_loop(
                parts, _single(request, "closing"), _single(request, "at"), _single(request, "loop_hops")
            ),
        )
        return web.json_response((await answer([query]))["answers"][0])

    async def batch(request: web.Request) -> web.Response:
        queries = []
        asked, need = await _body(request)
        for i, q in enumerate(asked):
            parts = parse_parts(_text_or_none(q, "parts", i))
            queries.append(
                relations.Query(
                    _batch_account(q, i),
                    parse_hops(_text_or_none(q, "hops", i)),
                    parts,
                    parse_min_average(_text_or_none(q, "min_average", i)),
                    *parse_loop(
                        parts,
                        _text_or_none(q, "closing", i),
                        _text_or_none(q, "at", i),
                        _text_or_none(q, "loop_hops", i),
                        where=f"queries[{i}]: ",
                    ),
                )
            )
        return web.json_response(await answer(queries, need))

    app.router.add_get("/relations/{account}", single)
    app.router.add_post("/relations", batch)
    return app


def aggregates_app(reader: Reader, settings: Any, check: StoreCheck | None = None) -> web.Application:
    """`settings` gives the near-threshold definition a store without one reports (the pipeline's), and
    the exchange rates of the AML rules (`AML_REPORTING_CURRENCY`, `AML_EXCHANGE_RATES`), in whose
    reporting currency every window is stated too."""
    app = _app("aggregates", ["GET /aggregates/{account}?at=ISO-8601", "POST /aggregates"], reader, check)
    defaults = (settings.reporting_threshold, settings.threshold_band)
    rates = settings.aml_thresholds.rates

    async def answer(queries: list[tuple[str, datetime]], need: Need | None = None) -> dict[str, Any]:
        if check is not None:
            check.refuse_if_behind()

        async def compute(snap: Snapshot) -> list[dict[str, Any]]:
            return await aggregates.aggregates_many(
                snap.cur, snap.schema, queries, snap.as_of, snap.meta, defaults, rates
            )

        return await answered_when_covered(reader, need, compute)

    async def single(request: web.Request) -> web.Response:
        account = _account(request)
        at = parse_at(_single(request, "at"))
        return web.json_response((await answer([(account, at)]))["answers"][0])

    async def batch(request: web.Request) -> web.Response:
        asked, need = await _body(request)
        queries = [(_batch_account(q, i), parse_at(_text_or_none(q, "at", i))) for i, q in enumerate(asked)]
        return web.json_response(await answer(queries, need))

    app.router.add_get("/aggregates/{account}", single)
    app.router.add_post("/aggregates", batch)
    return app


def build_app(kind: str, settings: Any, check: bool = True) -> web.Application:
    """The application for `kind` ('relations' or 'aggregates') on the store `settings` names, with the
    store check against the consumer group (unless `check` is False: tests of the queries alone)."""
    registered = registry.service(kind)
    reader = Reader(settings.store_url, registered.schema)
    guard = StoreCheck(reader, kind, settings) if check else None
    app: web.Application = registered.app(reader, settings, guard)
    return app


def serve(kind: str, settings: Any) -> None:
    """Run the service's HTTP API until interrupted (blocks)."""
    app = build_app(kind, settings)
    port = registry.service(kind).port(settings)
    print(
        f"{kind} service: http://{settings.services_host}:{port} (store {redacted(settings.store_url)})",
        flush=True,
    )
    web.run_app(app, host=settings.services_host, port=port, print=None)
