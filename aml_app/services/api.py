"""HTTP APIs of services B (relations) and C (aggregates), on aiohttp.

Routes (every response is JSON; every fault is 4xx/5xx with {"error": "<sentence>"}):
- relations:  GET /relations/{account}?hops=2   hops is a whole number 1..3 (default 2); `parts=out,cycle`
              answers only those parts (of out, in, neighbourhood, cycle; default all)
- aggregates: GET /aggregates/{account}?at=ISO  at is an ISO-8601 instant with a timezone (default now);
              'Z' is accepted, and a '+' that the query string decoded to a space is put back
- batches:    POST /relations  {"queries": [{"account": "a", "hops": 3, "parts": "out,cycle"}, ...]}
              POST /aggregates {"queries": [{"account": "a", "at": "ISO"}, ...]}
              -> {"answers": [...]} in the order asked, every answer as its GET would give it, all from
              ONE read snapshot (one as_of); at most MAX_BATCH queries
- both:       GET /health

Account ids are path segments (percent-encode '/', '%', '?', '#'), at most 128 characters. Store reads
are blocking SQLite, run in a worker thread with a fresh read-only connection per request, so they
never block the event loop or the pipeline that writes the file. The service starts without the store
file and answers empty (as_of {}) until the pipeline creates it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from aml_app.contract import MAX_ID_LENGTH
from aml_app.services.aggregates import AggregatesStore
from aml_app.services.relations import MAX_HOPS, PARTS, RelationsStore

log = logging.getLogger(__name__)

KINDS = ("relations", "aggregates")
DEFAULT_HOPS = 2
MAX_BATCH = 1000
RELATIONS_STORE = web.AppKey("relations_store", RelationsStore)
AGGREGATES_STORE = web.AppKey("aggregates_store", AggregatesStore)
SERVICE = web.AppKey("service", str)
ROUTES = web.AppKey("routes", list)
# "...T10:00:00 01:00": a '+01:00' offset whose '+' the query string decoded to a space.
_DECODED_PLUS = re.compile(r"^(.*T[0-9:.,]+) ([0-9]{2}(:?[0-9]{2})?)$")


class BadRequest(ValueError):
    """A request a person has to fix; the message is the 400 answer."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return _error(400, str(exc))
    except web.HTTPNotFound:
        routes = ", ".join(sorted(request.app[ROUTES]))
        return _error(404, f"There is no resource at {request.path}; this service answers {routes}.")
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return _error(405, f"Method {request.method} is not allowed here; use {allowed}.")
    except web.HTTPException as exc:
        return _error(exc.status, exc.reason)
    except sqlite3.Error as exc:
        log.warning("store read failed for %s: %s", request.path, exc)
        return _error(503, f"The store could not be read right now ({exc}); try again shortly.")
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


async def _queries(request: web.Request) -> list[dict[str, Any]]:
    """The `queries` list of a batch request body, each an object (checked further by the caller)."""
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest('The request body must be JSON: {"queries": [...]}.') from None
    queries = body.get("queries") if isinstance(body, dict) else None
    if not isinstance(queries, list) or not all(isinstance(q, dict) for q in queries):
        raise BadRequest('The request body must be {"queries": [...]} with one object per query.')
    if len(queries) > MAX_BATCH:
        raise BadRequest(f"A batch holds at most {MAX_BATCH} queries; this one has {len(queries)}.")
    return queries


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
    if name == "hops" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise BadRequest(f"queries[{i}].{name} must be a string, got {type(value).__name__}.")


def parse_parts(raw: str | None) -> tuple[str, ...]:
    if raw is None:
        return PARTS
    parts = tuple(p.strip() for p in raw.split(","))
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise BadRequest(f"parts must be a comma-separated list of {', '.join(PARTS)}, got {raw[:60]!r}.")
    return parts


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


def _app(service: str, routes: list[str]) -> web.Application:
    app = web.Application(middlewares=[_json_errors])
    app[SERVICE] = service
    app[ROUTES] = ["GET /health", *routes]
    return app


def relations_app(store: RelationsStore) -> web.Application:
    app = _app(
        "relations",
        ["GET /relations/{account}?hops=1..3&parts=out,in,neighbourhood,cycle", "POST /relations"],
    )
    app[RELATIONS_STORE] = store

    async def relations(request: web.Request) -> web.Response:
        account = _account(request)
        hops = parse_hops(_single(request, "hops"))
        parts = parse_parts(_single(request, "parts"))
        return web.json_response(await asyncio.to_thread(store.relations, account, hops, parts))

    async def health(request: web.Request) -> web.Response:
        status = await asyncio.to_thread(store.status)
        return web.json_response({"status": "ok", "service": "relations", "store": store.path, **status})

    async def relations_batch(request: web.Request) -> web.Response:
        queries = []
        for i, q in enumerate(await _queries(request)):
            hops = parse_hops(_text_or_none(q, "hops", i))
            queries.append((_batch_account(q, i), hops, parse_parts(_text_or_none(q, "parts", i))))
        return web.json_response({"answers": await asyncio.to_thread(store.relations_many, queries)})

    app.router.add_get("/relations/{account}", relations)
    app.router.add_post("/relations", relations_batch)
    app.router.add_get("/health", health)
    return app


def aggregates_app(store: AggregatesStore) -> web.Application:
    app = _app("aggregates", ["GET /aggregates/{account}?at=ISO-8601", "POST /aggregates"])
    app[AGGREGATES_STORE] = store

    async def aggregates(request: web.Request) -> web.Response:
        account = _account(request)
        at = parse_at(_single(request, "at"))
        return web.json_response(await asyncio.to_thread(store.aggregates, account, at))

    async def health(request: web.Request) -> web.Response:
        status = await asyncio.to_thread(store.status)
        return web.json_response({"status": "ok", "service": "aggregates", "store": store.path, **status})

    async def aggregates_batch(request: web.Request) -> web.Response:
        queries = [
            (_batch_account(q, i), parse_at(_text_or_none(q, "at", i)))
            for i, q in enumerate(await _queries(request))
        ]
        return web.json_response({"answers": await asyncio.to_thread(store.aggregates_many, queries)})

    app.router.add_get("/aggregates/{account}", aggregates)
    app.router.add_post("/aggregates", aggregates_batch)
    app.router.add_get("/health", health)
    return app


def build_app(kind: str, settings: Any) -> web.Application:
    """The application for `kind` ('relations' or 'aggregates'), its store built from `settings`.

    Building does not create the store file; the pipeline does.
    """
    if kind == "relations":
        return relations_app(RelationsStore(settings.relations_db))
    if kind == "aggregates":
        return aggregates_app(
            AggregatesStore(settings.aggregates_db, settings.reporting_threshold, settings.threshold_band)
        )
    raise ValueError(f"unknown service {kind!r}; expected one of {', '.join(KINDS)}")


def serve(kind: str, settings: Any) -> None:
    """Run the service's HTTP API until interrupted (blocks)."""
    app = build_app(kind, settings)
    port = settings.relations_port if kind == "relations" else settings.aggregates_port
    store = app[RELATIONS_STORE] if kind == "relations" else app[AGGREGATES_STORE]
    print(f"{kind} service: http://{settings.services_host}:{port} (store {store.path})", flush=True)
    web.run_app(app, host=settings.services_host, port=port, print=None)
