"""HTTP APIs of services B (relations) and C (aggregates), on aiohttp, reading PostgreSQL only.

Routes (every response is JSON; every fault is 4xx/5xx with {"error": "<sentence>"}):
- relations:  GET /relations/{account}?hops=2   hops is a whole number 1..3 (default 2); `parts=out,cycle`
              answers only those parts (of out, in, neighbourhood, cycle, chain, sources, co_payees;
              default all but loop); `min_average=1000` is the average payment of a heavy edge
              (default 0), or one per currency (`USD:1000,EUR:853.4`), which chain, sources and
              co_payees look at; the part `loop` needs
              `closing=<payer>` and `at=ISO` (the payment into the account that would close it) and
              takes `loop_hops=2..16` (default 12); `chain` takes `closing` (its last edge); `at=ISO`
              answers every part as of that instant, from the payments made by then (default: all);
              `after=COUNTERPARTY` lists in out and in only the counterparties after it (the next page)
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

What one request may cost is bounded (`Limits`, docs/pipeline.md "What one request may cost"):
- B's `out` parts list at most `AML_API_MAX_ROWS` edge rows per request together, its `in` parts as many,
  its `neighbourhood` parts as many accounts, taken by the queries in order (`relations.relations_many`);
  a part cut short lists the start of its list and is named in the answer's `truncated` with the
  entries it lists, and `after` gives the next page of out and in;
- a request's answers get `AML_API_TIMEOUT` seconds, then 503 and the statement cancelled on the server;
  every statement has the same `statement_timeout` on the server; `serve` runs with
  `handler_cancellation`, so a request whose client leaves is cancelled, and its statement with it;
- what a client sends is bounded: a body of MAX_BODY, MAX_BATCH queries, each part and each ISO 4217
  currency of `min_average` once, MAX_NEED_PARTITIONS partitions in a `need`, integers of MAX_DIGITS
  digits; a NUL or an unpaired surrogate in any text, JSON nested too deep, each is a 400 that names the
  field;
- questions share a pool of connections (503 "every connection ... in use" when it stays full);
  /health and the store check have connections of their own (`Reader.health_snapshot`);
- log lines show a client's text escaped (%r), and the store's URL shows no secret (`redacted`).

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
import functools
import json
import logging
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import msgspec
import psycopg
import psycopg_pool
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from aml_app import dependency_services as registry
from aml_app.backoff import Backoff
from aml_app.collector import settle
from aml_app.contract import MAX_ID_LENGTH
from aml_app.currencies import ISO_4217
from aml_app.dependencies import aggregates, relations
from aml_app.dependencies.answer_cache import AnswerCache
from aml_app.dependencies.api_metrics import ApiMetrics
from aml_app.dependencies.client import Need
from aml_app.dependencies.guard import behind
from aml_app.dependencies.relations import ALL_PARTS, LOOP_HOPS, LOOP_MAX_HOPS, MAX_HOPS, PARTS
from aml_app.dependencies.store import HEALTH_TIMEOUT, Reader, Snapshot, StoreVersionMismatch, redacted
from aml_app.loopback import is_loopback, loopback_hosts_only
from aml_app.tokens import token_required

log = logging.getLogger(__name__)

DEFAULT_HOPS = 2
MAX_BATCH = registry.MAX_QUERIES
CHECK_EVERY = 2.0  # seconds between two checks of the store against its consumer group
MAX_WAIT_MS = 10_000  # the longest a batch may wait for the store to cover what it needs
POLL = (0.02, 0.25)  # seconds between two looks at the store while a batch waits: first, longest
#: `AML_API_TIMEOUT`'s default: seconds a request's answers may take to compute.
ANSWER_TIMEOUT = 10.0
#: The largest partition and next offset a `need` may name (Kafka's int32 and int64).
MAX_PARTITION = 2**31 - 1
MAX_OFFSET = 2**63 - 1
#: The most partitions a `need` may name (a topic of more is not one this service is built for).
MAX_NEED_PARTITIONS = 10_000
#: The most digits a JSON integer in a request body may have: no field takes more (an offset has 19).
MAX_DIGITS = 30
#: How the server runs (`serve`): a request whose client has gone is cancelled, and with it the
#: statement it runs on PostgreSQL (psycopg cancels it on the server when its task is cancelled).
#: aiohttp cancels no handler on a disconnect unless asked to.
SERVER_OPTIONS: dict[str, Any] = {"handler_cancellation": True}
# "...T10:00:00 01:00": a '+01:00' offset whose '+' the query string decoded to a space.
_DECODED_PLUS = re.compile(r"^(.*T[0-9:.,]+) ([0-9]{2}(:?[0-9]{2})?)$")


@dataclass(frozen=True)
class Limits:
    """What one request may cost the service: `max_rows`, the most entries its answers' `out` parts
    list together (and its `in` parts, and its `neighbourhood` parts; B only: `relations.relations_many`),
    and `timeout`, the seconds its answers may take to compute (then 503, and its statement is cancelled).
    The store's reader stops every statement after the same time on the server too."""

    max_rows: int = relations.MAX_ROWS
    timeout: float = ANSWER_TIMEOUT

    @classmethod
    def of(cls, settings: Any) -> Limits:
        """`AML_API_MAX_ROWS` and `AML_API_TIMEOUT` of `settings` (None: the defaults)."""
        if settings is None:
            return cls()
        return cls(settings.dependencies.api_max_rows, settings.dependencies.api_timeout)


SERVICE = web.AppKey("service", str)
ROUTES: web.AppKey[list[str]] = web.AppKey("routes", list)
LIMITS: web.AppKey[Limits] = web.AppKey("limits", Limits)
READER: web.AppKey[Reader] = web.AppKey("reader", Reader)
METRICS: web.AppKey[ApiMetrics] = web.AppKey("metrics", ApiMetrics)


class BadRequest(ValueError):
    """A request a person has to fix; the message is the 400 answer."""


class NotJson(BadRequest):
    """A body sent as another media type than JSON; the message is the 415 answer."""


class StoreBehind(RuntimeError):
    """The store is behind its consumer group (the guard's sentence): answers would lack history."""


class TooLong(RuntimeError):
    """A request's answers took longer than the service's bound (`Limits.timeout`) to compute."""


def _error(status: int, message: str, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response({"error": message}, status=status, headers=headers)


async def _batch_response(
    cache: AnswerCache,
    keys: Sequence[Hashable],
    need: Need | None,
    answer: Callable[[list[int]], Awaitable[dict[str, Any]]],
    metrics: ApiMetrics | None = None,
    timeout: float = ANSWER_TIMEOUT,
) -> web.Response:
    """A batch's JSON: each answer `cache` keeps for its key from a snapshot that meets `need`, or that
    another request is computing now and that comes from such a snapshot, the others from
    `answer(missing)` (the indexes of the queries to compute, in order), kept for the next asker.
    A "not yet" is the response as it is; `kept` lists the answers this request did not read, and
    `as_of` and `log` then say where the store is, as far as the replica knows. Written one answer at a
    time with a yield to the event loop between two, without holding the loop for a whole batch.

    A list cut short (`truncated`) is neither kept nor shared: its length depends on the queries asked
    beside it. `timeout` bounds the wait for another request's answers (that request's own bound)."""
    texts = cache.lookup(keys, need)
    missing = [i for i, text in enumerate(texts) if text is None]
    waits = {i: future for i in missing if (future := cache.in_flight(keys[i], need)) is not None}
    todo = [i for i in missing if i not in waits]
    computed = set(todo)
    if todo:
        body = await _computed(cache, keys, todo, texts, need, answer, metrics)
        if body is not None:
            return body
    if waits:
        assert need is not None  # only a gated read waits for another's answer
        try:
            async with asyncio.timeout(timeout + need.wait):
                landed = await asyncio.gather(*(asyncio.shield(f) for f in waits.values()))
        except TimeoutError:
            landed = [None] * len(waits)
        for i, their in zip(waits, landed, strict=True):
            texts[i] = cache.shared(their, need)
        again = [i for i in waits if texts[i] is None]
        computed.update(again)
        if again:
            body = await _computed(cache, keys, again, texts, need, answer, metrics)
            if body is not None:
                return body
    kept = [i for i in range(len(keys)) if i not in computed]
    whole = ", ".join(text for text in texts if text is not None)  # every one, by now
    # The kept answers' `as_of` says where the store was when first asked; where it is now, as far as
    # this replica knows, is the newest it read: what the client's "went back" check compares.
    tail = ""
    if kept and cache.newest is not None:
        log_id, as_of = cache.newest
        shown = {"kept": kept, "as_of": {str(p): o for p, o in sorted(as_of.items())}, "log": log_id}
        tail = ", " + json.dumps(shown)[1:-1]
    return web.Response(text='{"answers": [' + whole + "]" + tail + "}", content_type="application/json")


async def _computed(
    cache: AnswerCache,
    keys: Sequence[Hashable],
    todo: list[int],
    texts: list[str | None],
    need: Need | None,
    answer: Callable[[list[int]], Awaitable[dict[str, Any]]],
    metrics: ApiMetrics | None,
) -> web.Response | None:
    """Compute the answers `todo` (for `need`) into `texts`, sharing each with the requests that wait for
    it; the response to send as it is instead (a "not yet"), or None."""
    with cache.flight([keys[i] for i in todo], need) as flight:
        body = await answer(todo)
        if "answers" not in body:
            if metrics is not None and body.get("not_yet"):
                metrics.saw_not_yet()
            return web.json_response(body)
        for i, computed in zip(todo, body["answers"], strict=True):
            text = msgspec.json.encode(computed).decode()  # an eighth of json.dumps's time on C's answers
            flight.landed(keys[i], cache.put(keys[i], text, computed, keep="truncated" not in computed))
            texts[i] = text
            await asyncio.sleep(0)
    return None


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except NotJson as exc:
        return _error(415, str(exc))
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
    except (TooLong, psycopg.errors.QueryCanceled) as exc:  # the bound here, or the server's
        seconds = (
            request.app[LIMITS].timeout if isinstance(exc, TooLong) else request.app[READER].statement_timeout
        )
        log.warning("a request to %r ran past %g s and was stopped", request.path, seconds)
        return _error(
            503,
            f"Answering this request took longer than {seconds:g} s, this service's bound, and was stopped; "
            "ask fewer or smaller questions at once.",
        )
    except psycopg_pool.PoolTimeout as exc:
        if request.app[READER].busy():
            log.warning("no free connection to the store for %r: %s", request.path, exc)
            return _error(
                503,
                "Every connection of this replica to the store is in use; try again shortly.",
                retry_after=1,
            )
        log.warning("store read failed for %r: %s", request.path, exc)
        return _error(503, "The store could not be read right now; try again shortly.")
    except psycopg.OperationalError as exc:
        log.warning("store read failed for %r: %s", request.path, exc)
        return _error(503, "The store could not be read right now; try again shortly.")
    except Exception:
        # %r: a path holds what the client sent, newlines and NULs included.
        log.exception("unexpected error for %r", request.path)
        return _error(500, "Internal error while answering this request; see the service log.")


def _text(value: str, field: str) -> str:
    """`value`, if it is text PostgreSQL can take: no NUL character, and no unpaired UTF-16 surrogate
    (which a JSON escape or a decoded path can hold, and UTF-8 cannot encode)."""
    if "\x00" in value:
        raise BadRequest(f"{field} holds a NUL character, which no account id or parameter may hold.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{field} holds an unpaired UTF-16 surrogate, which is not text.") from None
    return value


def _account(request: web.Request) -> str:
    account = _text(request.match_info["account"], "The account id")
    if len(account) > MAX_ID_LENGTH:
        raise BadRequest(f"The account id is {len(account)} characters long; the limit is {MAX_ID_LENGTH}.")
    if not account.strip():
        raise BadRequest("The account id is blank.")
    return account


def _single(request: web.Request, name: str) -> str | None:
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise BadRequest(f"The query parameter {name!r} is given {len(values)} times; give it once.")
    return _text(values[0], f"The query parameter {name!r}") if values else None


def _whole_number(raw: str, low: int, high: int) -> int | None:
    """`raw` as a whole number from `low` to `high`, or None: ASCII digits only (leading zeros allowed),
    and never more of them converted than the bound has (Python refuses to convert 4,300 or more)."""
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(high)):
        return None
    value = int(digits)
    return value if low <= value <= high else None


def parse_hops(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_HOPS
    hops = _whole_number(raw, 1, MAX_HOPS)
    if hops is None:
        raise BadRequest(f"hops must be a whole number from 1 to {MAX_HOPS}, got {raw[:40]!r}.")
    return hops


def parse_need(raw: Any) -> Need | None:
    """A batch's `need`: {"as_of": {"<partition>": <next offset>, ...}, "log": "<identity>" or absent,
    "wait_ms": 0..MAX_WAIT_MS}; absent: answer at once from whatever the store holds."""
    if raw is None:
        return None
    example = 'such as {"as_of": {"0": 42}, "log": "...", "wait_ms": 2000}'
    if not isinstance(raw, dict) or not isinstance(raw.get("as_of"), dict):
        raise BadRequest(f"need must be an object with an as_of object, {example}.")
    if len(raw["as_of"]) > MAX_NEED_PARTITIONS:
        raise BadRequest(
            f"need.as_of names {len(raw['as_of'])} partitions; it may name at most {MAX_NEED_PARTITIONS}."
        )
    as_of = {}
    for p, o in raw["as_of"].items():
        partition = _whole_number(p, 0, MAX_PARTITION)
        if partition is None or isinstance(o, bool) or not isinstance(o, int) or not 0 <= o <= MAX_OFFSET:
            raise BadRequest(
                f"need.as_of maps partitions (0 to {MAX_PARTITION}) to next offsets (0 to {MAX_OFFSET}), "
                f"{example}; got {p[:40]!r}: {_shown(o)}."
            )
        as_of[partition] = o
    log_id, wait_ms = raw.get("log"), raw.get("wait_ms", 0)
    if log_id is not None and not isinstance(log_id, str):
        raise BadRequest(f"need.log must be a string, {example}.")
    if log_id is not None:
        _text(log_id, "need.log")
    if not isinstance(wait_ms, int) or isinstance(wait_ms, bool) or not 0 <= wait_ms <= MAX_WAIT_MS:
        raise BadRequest(
            f"need.wait_ms must be a whole number from 0 to {MAX_WAIT_MS}, got {_shown(wait_ms)}."
        )
    return Need(as_of, log_id, wait_ms / 1000)


class LongNumber:
    """A JSON integer of more than MAX_DIGITS digits in a request body: no field takes one, and Python
    refuses to convert one of 4,300 or more (a ValueError that would name no field)."""

    def __init__(self, digits: str) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"a number of {len(self.digits.lstrip('-'))} digits"


def _json_int(text: str) -> int | LongNumber:
    return int(text) if len(text) <= MAX_DIGITS else LongNumber(text)


def _shown(value: Any) -> str:
    """A value a client sent, for an error sentence: its JSON text, at most 40 characters of it."""
    if isinstance(value, LongNumber):
        return repr(value)
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:40] + "..."


async def _body(request: web.Request) -> tuple[list[dict[str, Any]], Need | None]:
    """The `queries` of a batch request body, each an object (checked further by the caller), and its
    `need`. Only a body sent as JSON is read: a web page can make a browser POST text/plain or a form to
    any address without asking it first (CORS), and so could have a victim's browser ask questions."""
    if request.content_type != "application/json":
        raise NotJson(
            "Send the batch as JSON with Content-Type: application/json (this one is "
            f"{request.content_type}); other media types are refused, so that no web page can make a "
            "browser ask."
        )
    try:
        body = json.loads(await request.text(), parse_int=_json_int)
    except ValueError:
        raise BadRequest('The request body must be JSON: {"queries": [...]}.') from None
    except RecursionError:
        raise BadRequest(
            'The request body nests JSON arrays or objects too deep; it must be {"queries": [...]} '
            "with one flat object per query."
        ) from None
    queries = body.get("queries") if isinstance(body, dict) else None
    if not isinstance(queries, list) or not all(isinstance(q, dict) for q in queries):
        raise BadRequest('The request body must be {"queries": [...]} with one object per query.')
    if len(queries) > MAX_BATCH:
        raise BadRequest(f"A batch holds at most {MAX_BATCH} queries; this one has {len(queries)}.")
    return queries, parse_need(body.get("need"))


async def answered_when_covered(
    reader: Reader,
    need: Need | None,
    compute: Callable[[Snapshot], Awaitable[list[dict[str, Any]]]],
    timeout: float = ANSWER_TIMEOUT,
) -> dict[str, Any]:
    """`{"answers": compute(snapshot)}` from the first snapshot that meets `need`, looking again (from
    POLL[0] to POLL[1] apart) for at most `need.wait` seconds; then `{"not_yet": true, "as_of", "log",
    "waited_ms"}`: the store has not applied what the question needs, ask again (or another replica).
    `compute` gets `timeout` seconds; then it is cancelled, its statement with it, and `TooLong` raised."""
    started = time.monotonic()
    poll = Backoff(*POLL)
    while True:
        async with reader.snapshot() as snap:
            log_id = snap.meta.get("log")
            if need is None or need.met(snap.as_of, log_id):
                try:
                    async with asyncio.timeout(timeout):
                        return {"answers": await compute(snap)}
                except TimeoutError:
                    raise TooLong(f"the answers took longer than {timeout:g} s") from None
            as_of = snap.as_of
        left = need.wait - (time.monotonic() - started)
        if left <= 0:
            return {
                "not_yet": True,
                "as_of": {str(p): o for p, o in sorted(as_of.items())},
                "log": log_id,
                "waited_ms": round(1000 * (time.monotonic() - started)),
            }
        await poll.sleep(at_most=left)


def _batch_account(query: dict[str, Any], i: int) -> str:
    account = query.get("account")
    if not isinstance(account, str) or not account.strip() or len(account) > MAX_ID_LENGTH:
        raise BadRequest(
            f"queries[{i}].account must be a non-blank string of at most {MAX_ID_LENGTH} characters."
        )
    return _text(account, f"queries[{i}].account")


def _text_or_none(query: dict[str, Any], name: str, i: int) -> str | None:
    value = query.get(name)
    if value is None:
        return value
    if isinstance(value, str):
        return _text(value, f"queries[{i}].{name}")
    if name in ("hops", "loop_hops") and isinstance(value, int | LongNumber) and not isinstance(value, bool):
        return str(value) if isinstance(value, int) else repr(value)
    raise BadRequest(f"queries[{i}].{name} must be a string, got {type(value).__name__}.")


#: The longest `min_average` there is room for: each ISO 4217 currency once, with an amount of 40 characters.
_MIN_AVERAGE_LENGTH = len(ISO_4217) * 46
#: The largest request body the bounds above let a client send: MAX_BATCH queries, each with the longest
#: `min_average` (the client repeats it in every query) and 4 KiB for the rest (ids escaped in JSON
#: take six characters each), and a `need` of MAX_NEED_PARTITIONS. aiohttp's default, 1 MiB, refused
#: batches those bounds accept with a 413, which the detector takes for a bug of its own.
MAX_BODY = MAX_BATCH * (_MIN_AVERAGE_LENGTH + 4096) + MAX_NEED_PARTITIONS * 64 + 4096


def parse_min_average(raw: str | None) -> relations.MinAverage:
    """The average payment from which an edge counts as heavy: a plain decimal >= 0 for every currency
    (default 0), or one per currency as `USD:1000,EUR:853.4` (a currency not named is never heavy). Each
    currency is an ISO 4217 code (as every payment's is), named once: the list is as short as that."""
    if raw is None:
        return Decimal(0)
    return _min_average(raw)


@functools.lru_cache(maxsize=256)
def _min_average(raw: str) -> relations.MinAverage:
    """`parse_min_average` of a text, kept: a detector sends the same per-currency list with every query
    of a batch, and parsing it each time cost a tenth of B's CPU. A list comes back read-only, since
    every query that asked it shares it."""
    example = "such as 1000, or one per currency such as USD:1000,EUR:853.4"
    if ":" not in raw:
        value = _plain_decimal(raw)
        if value is None:
            raise BadRequest(f"min_average must be a plain decimal number >= 0 {example}, got {raw[:40]!r}.")
        return value
    if len(raw) > _MIN_AVERAGE_LENGTH:
        raise BadRequest(
            f"min_average is {len(raw)} characters long: it names each ISO 4217 currency at most once, "
            f"{example}."
        )
    per: dict[str, Decimal] = {}
    for item in raw.split(","):
        currency, _, text = item.strip().partition(":")
        value = _plain_decimal(text)
        if not re.fullmatch(r"[A-Z]{3}", currency) or value is None or currency in per:
            raise BadRequest(f"min_average must be a plain decimal number >= 0 {example}, got {raw[:60]!r}.")
        if currency not in ISO_4217:
            raise BadRequest(f"min_average names {currency}, which is not an ISO 4217 currency code.")
        per[currency] = value
    return relations.CurrencyMinimums(per)


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
    parts = tuple(p.strip() for p in raw.split(",", len(ALL_PARTS)))
    unknown = [p for p in parts if p not in ALL_PARTS]
    if unknown or not parts or len(set(parts)) < len(parts):
        raise BadRequest(
            f"parts must be a comma-separated list of {', '.join(ALL_PARTS)}, each at most once, "
            f"got {raw[:60]!r}."
        )
    return parts


def parse_after(parts: Sequence[str], raw: str | None, where: str = "") -> str | None:
    """A query's `after`: the counterparty after which its `out` and `in` go on (the next page of a
    list cut short)."""
    if raw is None:
        return None
    if "out" not in parts and "in" not in parts:
        raise BadRequest(f"{where}after belongs to the parts out and in, neither of which is asked.")
    if not raw or len(raw) > MAX_ID_LENGTH:
        raise BadRequest(
            f"{where}after must be the last counterparty listed, an id of 1 to {MAX_ID_LENGTH} characters."
        )
    return raw


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
        parsed = _whole_number(loop_hops, 2, LOOP_MAX_HOPS)
        if parsed is None:
            raise BadRequest(
                f"{where}loop_hops must be a whole number from 2 to {LOOP_MAX_HOPS}, got {loop_hops[:40]!r}."
            )
        hops = parsed
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
        # The group's offsets on the topic the service reads (payments, or a topic derived from it).
        self.offsets = DependencyOffsets(
            settings.kafka.bootstrap_servers,
            registry.service(service).topic(settings),
            [self.group],
            security=settings.kafka.security,
        )
        self.state = "unknown"
        self.problem: str | None = None
        self.error: str | None = None
        self.checked_at: float | None = None
        #: The answer caches of the store's API, and the store as the last check read it: a store found
        #: behind that reading, or of another log, is another store (rebuilt), and the caches let go of
        #: what they kept from the old one (`AnswerCache.rebuilt`).
        self.caches: list[AnswerCache] = []
        self._read: tuple[str | None, dict[int, int]] | None = None

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
            # Committed first, then the store: see guard.behind. Through the connections of /health:
            # questions that take every other one do not blind the guard.
            async with self.reader.health_snapshot() as snap:
                applied, log_id = snap.as_of, snap.meta.get("log")
        except unreadable as exc:
            self.error = str(exc) or type(exc).__name__
            if isinstance(exc, StoreVersionMismatch):  # what was kept is of a store no longer there
                for cache in self.caches:
                    cache.clear()
            return
        last, self._read = self._read, (log_id, dict(applied))
        another = last is not None and (
            last[0] != log_id or any(applied.get(p, 0) < o for p, o in last[1].items())
        )
        for cache in self.caches:
            if another:
                cache.rebuilt(log_id, applied)
            else:
                cache.saw(log_id, applied)
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


def _app(
    service: str,
    routes: list[str],
    reader: Reader,
    check: StoreCheck | None,
    limits: Limits,
    cache: AnswerCache,
) -> web.Application:
    """The parts both APIs share: errors as JSON, the store's pools and the check, opened and closed with
    the application, /health (with what the answer cache served) and /metrics (Prometheus)."""
    metrics = ApiMetrics(service, cache, check)
    app = web.Application(middlewares=[metrics.middleware, _json_errors], client_max_size=MAX_BODY)
    app[SERVICE] = service
    app[ROUTES] = ["GET /health", "GET /metrics", *routes]
    app[LIMITS] = limits
    app[READER] = reader
    app[METRICS] = metrics

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
        # A connection of its own (`Reader.health_snapshot`): questions that take every connection of
        # the pool, or run long, do not make a load balancer take the replica out.
        try:
            async with reader.health_snapshot() as snap:
                meta = snap.meta
                body = {
                    "status": "ok",
                    "service": service,
                    "store": redacted(reader.url),
                    "store_exists": snap.schema is not None,
                    "as_of": {str(p): o for p, o in sorted(snap.as_of.items())},
                    "log": meta.get("log"),
                }
        except (psycopg_pool.PoolTimeout, psycopg.OperationalError) as exc:
            log.warning("health: the store could not be read: %s", exc)
            return _error(503, f"The store could not be read within {HEALTH_TIMEOUT:g} s; try again shortly.")
        body.update(registry.service(service).health(meta))
        body["answer_cache"] = cache.as_json()
        if check is not None:
            body["store_check"] = check.as_json()
            if check.state == "behind":
                body["status"] = "behind"
                return web.json_response(body, status=503)
        return web.json_response(body)

    async def metrics_text(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_text)
    return app


def relations_app(
    reader: Reader,
    settings: Any = None,
    check: StoreCheck | None = None,
    limits: Limits | None = None,
    cache: AnswerCache | None = None,
) -> web.Application:
    """B's API; its answers depend on its store only. `limits`, or else `settings`' (`Limits.of`), bound
    what a request may cost; `cache`, or else one of `settings`' `AML_API_CACHE_ANSWERS` (none without
    settings), keeps batch answers for the next asker."""
    limits = limits or Limits.of(settings)
    cache = cache or _cache_of(settings)
    if check is not None:
        check.caches.append(cache)
    app = _app(
        "relations",
        [
            "GET /relations/{account}?hops=1..3&parts=out,in,neighbourhood,cycle,chain,sources,co_payees"
            "&min_average=0&at=ISO",
            "GET /relations/{account}?parts=loop&closing=PAYER&at=ISO&loop_hops=2..16",
            "GET /relations/{account}?parts=chain&closing=PAYER&at=ISO",
            "GET /relations/{account}?parts=out,in&after=COUNTERPARTY",
            "POST /relations",
        ],
        reader,
        check,
        limits,
        cache,
    )

    async def answer(queries: list[relations.Query], need: Need | None = None) -> dict[str, Any]:
        if check is not None:
            check.refuse_if_behind()

        async def compute(snap: Snapshot) -> list[dict[str, Any]]:
            return await relations.relations_many(
                snap.cur,
                snap.schema,
                queries,
                snap.as_of,
                snap.meta.get("log"),
                limits.max_rows,
                relations.folded_before(snap.meta),
            )

        return await answered_when_covered(reader, need, compute, limits.timeout)

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
            parse_after(parts, _single(request, "after")),
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
                    parse_after(parts, _text_or_none(q, "after", i), where=f"queries[{i}]: "),
                )
            )
        if check is not None:
            check.refuse_if_behind()  # before the answer cache too: a store behind answers nothing
        return await _batch_response(
            cache,
            [q.key() for q in queries],
            need,
            lambda todo: answer([queries[i] for i in todo], need),
            app[METRICS],
            limits.timeout,
        )

    app.router.add_get("/relations/{account}", single)
    app.router.add_post("/relations", batch)
    return app


def aggregates_app(
    reader: Reader,
    settings: Any,
    check: StoreCheck | None = None,
    limits: Limits | None = None,
    cache: AnswerCache | None = None,
) -> web.Application:
    """`settings` gives the near-threshold definition a store without one reports (the pipeline's), and
    the exchange rates of the AML rules (`AML_REPORTING_CURRENCY`, `AML_EXCHANGE_RATES`), in whose
    reporting currency every window is stated too; `limits`, or else its own (`Limits.of`), what a
    request may cost; `cache`, or else one of `AML_API_CACHE_ANSWERS`, keeps batch answers for the next
    asker."""
    limits = limits or Limits.of(settings)
    cache = cache or _cache_of(settings)
    if check is not None:
        check.caches.append(cache)
    app = _app(
        "aggregates",
        ["GET /aggregates/{account}?at=ISO-8601", "POST /aggregates"],
        reader,
        check,
        limits,
        cache,
    )
    defaults = (settings.dependencies.reporting_threshold, settings.dependencies.threshold_band)
    rates = settings.detection.aml_thresholds.rates

    async def answer(queries: list[tuple[str, datetime]], need: Need | None = None) -> dict[str, Any]:
        if check is not None:
            check.refuse_if_behind()

        async def compute(snap: Snapshot) -> list[dict[str, Any]]:
            return await aggregates.aggregates_many(
                snap.cur, snap.schema, queries, snap.as_of, snap.meta, defaults, rates
            )

        return await answered_when_covered(reader, need, compute, limits.timeout)

    async def single(request: web.Request) -> web.Response:
        account = _account(request)
        at = parse_at(_single(request, "at"))
        return web.json_response((await answer([(account, at)]))["answers"][0])

    async def batch(request: web.Request) -> web.Response:
        asked, need = await _body(request)
        queries = [(_batch_account(q, i), parse_at(_text_or_none(q, "at", i))) for i, q in enumerate(asked)]
        if check is not None:
            check.refuse_if_behind()  # before the answer cache too: a store behind answers nothing
        return await _batch_response(
            cache,
            queries,
            need,
            lambda todo: answer([queries[i] for i in todo], need),
            app[METRICS],
            limits.timeout,
        )

    app.router.add_get("/aggregates/{account}", single)
    app.router.add_post("/aggregates", batch)
    return app


def _cache_of(settings: Any) -> AnswerCache:
    """The answer cache `AML_API_CACHE_ANSWERS` of `settings` asks for (no settings: none kept)."""
    return AnswerCache(0 if settings is None else settings.dependencies.api_cache_answers)


def build_app(kind: str, settings: Any, check: bool = True) -> web.Application:
    """The application for `kind` ('relations' or 'aggregates') on the store `settings` names, with the
    store check against the consumer group (unless `check` is False: tests of the queries alone). Bound
    to a loopback address, it answers only requests addressed to one (`loopback_hosts_only`)."""
    registered = registry.service(kind)
    reader = Reader(
        settings.dependencies.reader_url, registered.schema, statement_timeout=Limits.of(settings).timeout
    )
    guard = StoreCheck(reader, kind, settings) if check else None
    app: web.Application = registered.app(reader, settings, guard)
    if is_loopback(settings.dependencies.services_host):
        app.middlewares.insert(1, loopback_hosts_only)  # inside the metrics, which count the refusal
    if settings.dependencies.api_token:
        app.middlewares.insert(1, token_required(settings.dependencies.api_token, "AML_API_TOKEN"))
    return app


async def _settled(_app: web.Application) -> None:
    settle()  # the replica's start-up heap, out of the cycle collector's scans (aml_app.collector)


def serve(kind: str, settings: Any) -> None:
    """Run the service's HTTP API until interrupted (blocks)."""
    app = build_app(kind, settings)
    app.on_startup.append(_settled)  # after the store's pools opened (the application's cleanup context)
    port, deps = registry.service(kind).port(settings), settings.dependencies
    print(
        f"{kind} service: http://{deps.services_host}:{port} (store {redacted(deps.reader_url)})", flush=True
    )
    web.run_app(
        app,
        host=settings.dependencies.services_host,
        port=port,
        print=None,
        access_log=access_log(kind) if settings.dependencies.api_access_log else None,
        access_log_format=ACCESS_LOG_FORMAT,
        **SERVER_OPTIONS,
    )


#: Who asked what and how it went: the caller, the time, the request line, the status, the bytes sent,
#: the seconds taken and the client's name; no header that could hold a secret.
ACCESS_LOG_FORMAT = '%a %t "%r" %s %b %Tf "%{User-Agent}i"'


def access_log(kind: str) -> logging.Logger:
    """The replica's access log: one line per request on standard output, whatever else is configured."""
    logger = logging.getLogger(f"aml_app.api.access.{kind}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(f"{kind} access: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger
