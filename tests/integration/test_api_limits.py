"""B's and C's APIs against a greedy or hostile client, on the real embedded PostgreSQL.

One store for the module, filled with the pipeline's own store writes: an account `busy` that pays 600
payees and is paid by 600 payers (one payee in two currencies, where a bound of 200 rows cuts), and a
few small accounts. The APIs run with a bound of 200 rows (`AML_API_MAX_ROWS`' least) beside an
unbounded twin. A statement that runs long is made so by a lock: a test holds `ACCESS EXCLUSIVE` on B's
edges, every statement that reads them waits, and `pg_stat_activity` shows which are still there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import string
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from aml_app.dependencies import aggregates, api, relations
from aml_app.dependencies.api import Limits, aggregates_app, build_app, relations_app
from aml_app.dependencies.client import PAYEE_PARTS, PAYER_PARTS, DependencyClient, evidence_for
from aml_app.dependencies.store import Reader, redacted
from aml_app.detection.evidence import Evidence
from aml_app.detection.fraud_rules import fraud_rules
from aml_app.detection.rules import aml_rules
from aml_app.harness.dependencies import ApiProcess
from aml_app.kafka.broker import EmbeddedBroker
from aml_app.settings import Settings
from tests.harness import Names
from tests.payments import PaymentRow
from tests.played_stores import api_settings, apply
from tests.stores import with_dependencies

T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)
ROWS = 200  # the bound of the bounded APIs: AML_API_MAX_ROWS' least
WIDE = 600  # busy's payees, and its payers
TWO_CURRENCIES = "payee-0199"  # its rows 199 and 200 in (payee, currency) order: a bound of 200 cuts there
LARGE = Decimal("9000")  # busy's payment to its last payee: a first payment this large is a fraud hit
SETTINGS = Settings()
API = "aml-app relations API"  # the application_name of B's API's query connections


def payments() -> list[list[PaymentRow]]:
    """The module's payments, as batches of partition 0 (each edge once per batch)."""
    offsets = itertools.count()

    def row(payer: str, payee: str, amount: str | Decimal, ts: datetime, currency: str = "EUR") -> PaymentRow:
        return PaymentRow(0, next(offsets), str(uuid.uuid4()), payer, payee, Decimal(amount), currency, ts)

    first = [
        *(row("busy", f"payee-{k:04}", "100", T0 - timedelta(minutes=WIDE - k)) for k in range(WIDE - 1)),
        row("busy", f"payee-{WIDE - 1:04}", LARGE, T0),
        *(row(f"payer-{k:04}", "busy", "80", T0 - timedelta(minutes=WIDE - k)) for k in range(WIDE)),
        row("s1", "s2", "5000", T0 - timedelta(hours=3)),
        row("s2", "s3", "4900", T0 - timedelta(hours=2)),
        row("s3", "s1", "4800", T0 - timedelta(hours=1)),
    ]
    second = [row("busy", TWO_CURRENCIES, "90", T0 - timedelta(minutes=30), "USD")]
    return [first, second]


@pytest.fixture(scope="module")
def busy(postgres: Any) -> str:
    """The URL of the module's store (both services), filled once."""
    url = postgres.create_database(f"limits_{uuid.uuid4().hex[:12]}")
    for batch in payments():
        for service in ("relations", "aggregates"):
            apply(url, service, batch, SETTINGS, "cluster:topic")
    return url


def bounded(url: str, rows: int = ROWS, answer_timeout: float = 30.0, **reader: Any) -> web.Application:
    return relations_app(Reader(url, relations.SCHEMA, **reader), limits=Limits(rows, answer_timeout))


def unbounded(url: str) -> web.Application:
    return relations_app(Reader(url, relations.SCHEMA), limits=Limits(10_000_000, 30.0))


def aggregates_api(url: str) -> web.Application:
    return aggregates_app(Reader(url, aggregates.SCHEMA), SETTINGS)


@asynccontextmanager
async def client_for(app: web.Application) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


@asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


JSON = {"Content-Type": "application/json"}


async def answer(client: TestClient, path: str, body: Any = None, status: int = 200) -> Any:
    async with asyncio.timeout(60):
        response = await (
            client.get(path) if body is None else client.post(path, data=_bytes(body), headers=JSON)
        )
        got = await response.json()
    assert response.status == status, got
    if status >= 400:
        assert set(got) == {"error"} and got["error"].endswith("."), got
    return got


def _bytes(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


async def until(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 30) -> Any:
    """`check()`'s first true value, looked for every 50 ms up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := await check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        await asyncio.sleep(0.05)
    return value


@contextmanager
def edges_locked(url: str) -> Iterator[None]:
    """B's edges locked against every reader until the block ends: any statement on them waits."""
    with psycopg.connect(url) as conn:
        conn.execute("LOCK TABLE relations.edges IN ACCESS EXCLUSIVE MODE")
        try:
            yield
        finally:
            conn.rollback()


async def statements(url: str, application: str = API) -> int:
    """How many statements connections named `application` are running (or waiting in) right now."""

    def count() -> int:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = %s AND state = 'active'",
                (application,),
            ).fetchone()
            return int(row[0]) if row else 0

    return await asyncio.to_thread(count)


# --- every list an answer holds is bounded, and a list cut short says so ----------------------------


async def test_answers_are_bounded_per_request_and_a_list_cut_short_says_so(busy: str) -> None:
    async with client_for(bounded(busy)) as capped, client_for(unbounded(busy)) as whole:
        full = await answer(whole, "/relations/busy?parts=out,in,neighbourhood&hops=1")
        assert len(full["out"]) == WIDE and len(full["in"]) == WIDE and "truncated" not in full
        one = await answer(capped, "/relations/busy?parts=out,in,neighbourhood&hops=1")
        # The cut falls inside payee-0199's two rows: the list holds whole counterparties only.
        assert one["truncated"] == {"out": 199, "in": ROWS, "neighbourhood": ROWS}
        assert one["out"] == full["out"][:199] and one["in"] == full["in"][:ROWS]
        assert one["neighbourhood"] == full["neighbourhood"][:ROWS]
        assert full["out"][199]["counterparty"] == TWO_CURRENCIES
        assert full["out"][199]["totals"] == {"EUR": "100.00", "USD": "90.00"}
        # The next page goes on after the last counterparty listed.
        page = await answer(capped, f"/relations/busy?parts=out&after={TWO_CURRENCIES[:-1]}8")
        assert page["out"] == full["out"][199:398] and page["truncated"] == {"out": 199}
        # A small account's answer is whole and says nothing.
        small = await answer(capped, "/relations/s1?parts=out,in,neighbourhood,cycle&hops=3")
        assert "truncated" not in small and small["cycle"]["path"] == ["s1", "s2", "s3", "s1"]

        # The attack: many questions about the busy account in one batch. Unbounded, it lists 20 times
        # its counterparties; bounded, the batch lists at most the bound per part, and says so.
        queries = {"queries": [{"account": "busy", "parts": "out,in"}] * 20 + [{"account": "s1"}]}
        attacked = await answer(whole, "/relations", queries)
        assert sum(len(a["out"]) + len(a["in"]) for a in attacked["answers"]) == 20 * 2 * WIDE + 2
        response = await capped.post("/relations", data=_bytes(queries), headers=JSON)
        text = await response.text()
        answers = json.loads(text)["answers"]
        assert sum(len(a["out"]) for a in answers) <= ROWS and sum(len(a["in"]) for a in answers) <= ROWS
        assert answers[0]["truncated"] == {"out": 199, "in": ROWS}
        assert all(a["truncated"] == {"out": 0, "in": 0} for a in answers[1:20])
        # s1 comes after the bound of out and in was taken; nobody else took the neighbourhood's.
        assert answers[20]["truncated"] == {"out": 0, "in": 0} and len(answers[20]["neighbourhood"]) == 2
        assert len(text) < 200 * 2 * ROWS, "the answer's size follows the bound, not the questions"


# --- the detectors' client makes the lists whole: no decision changes ------------------------------


async def test_the_client_makes_every_cut_list_whole_and_no_decision_changes(busy: str) -> None:
    paid = [("busy", f"payee-{WIDE - 1:04}", T0), ("payer-0007", "busy", T0), ("s3", "s1", T0)]
    async with (
        served(bounded(busy)) as capped_url,
        served(unbounded(busy)) as whole_url,
        served(aggregates_api(busy)) as aggregates_url,
    ):
        capped = DependencyClient(capped_url, aggregates_url, timeout=10)
        whole = DependencyClient(whole_url, aggregates_url, timeout=10)
        try:
            # What the detectors ask, payment by payment, and what they decide on it: busy's payment to
            # its last payee is its first one there, a fraud hit only if the payer's `out` is whole.
            evidence = await evidence_for(capped, paid)
            decided = [decide(p, e) for p, e in zip(paid, evidence, strict=True)]
            unbounded_evidence = await evidence_for(whole, paid)
            assert decided == [decide(p, e) for p, e in zip(paid, unbounded_evidence, strict=True)]
            assert "fraud.large_new_counterparty" in decided[0]
            assert evidence == unbounded_evidence

            accounts = ["busy", "s1", "busy", "payer-0003", "busy"]
            parts = ["out,in", "out,in,cycle", "in", "out", "out"]
            ats = [None, None, T0, None, T0 - timedelta(hours=2)]
            got = await capped.relations_many(accounts, parts=parts, ats=ats)
            assert got == await whole.relations_many(accounts, parts=parts, ats=ats)
            assert len(got[0]["out"]) == len(got[0]["in"]) == WIDE
            assert capped.stats.asked_again > 0 and capped.stats.truncated == 0
            single = await capped.relations("busy", parts="in,out")
            assert single == await whole.relations("busy", parts="in,out")

            # A neighbourhood longer than the bound cannot go on: it comes as B gives it, and says so.
            [near] = await capped.relations_many(["busy"], hops=1, parts="neighbourhood")
            assert near["truncated"] == {"neighbourhood": ROWS} and capped.stats.truncated == 1
        finally:
            await capped.close()
            await whole.close()


def decide(payment: tuple[str, str, datetime], answers: tuple[dict[str, Any], ...]) -> list[str]:
    """The rules the AML and fraud detectors would hit on a payment of LARGE with these answers."""
    payer, payee, at = payment
    facts = Evidence.parse(
        payment_id="p",
        payer=payer,
        payee=payee,
        amount=LARGE,
        currency="EUR",
        ts=at,
        payer_aggregates=answers[0],
        payee_aggregates=answers[1],
        payer_relations=answers[2],
        payee_relations=answers[3],
    )
    hits = [
        *aml_rules(facts, SETTINGS.detection.aml_thresholds),
        *fraud_rules(facts, SETTINGS.detection.fraud_thresholds),
    ]
    return sorted(hit.rule for hit in hits)


def test_the_detectors_parts_are_the_ones_the_client_pages() -> None:
    """The detectors read the payer's `out`, which the client makes whole; no part they ask about the
    payee can be cut short."""
    assert PAYER_PARTS == "out"
    assert not {"out", "in", "neighbourhood"} & set(PAYEE_PARTS.split(","))


# --- a statement that runs long is stopped, and so is one whose client left ------------------------


async def test_a_long_question_is_stopped_at_the_bound_with_its_statement(busy: str) -> None:
    settings = with_dependencies(SETTINGS, store_url=busy, api_timeout=0.5)
    async with client_for(build_app("relations", settings, check=False)) as client:
        with edges_locked(busy):
            body = await answer(client, "/relations/busy?hops=3&parts=chain", status=503)
            assert "took longer than 0.5 s, this service's bound" in body["error"]
            await until(lambda: running(busy, at_most=0), "the statement gone with its question", 10)
            assert (await answer(client, "/health"))["status"] == "ok"
        assert (await answer(client, "/relations/busy?hops=3&parts=chain"))["chain"] == ["payer-0000", "busy"]


async def test_the_server_stops_a_statement_at_the_bound_whoever_waits_for_it(busy: str) -> None:
    """The store's reader sets AML_API_TIMEOUT as every statement's timeout on the server: a statement is
    stopped there even when nothing in the API would cancel it."""
    settings = with_dependencies(SETTINGS, store_url=busy, api_timeout=0.5)
    reader = build_app("relations", settings, check=False)[api.READER]
    await reader.open()
    try:
        with edges_locked(busy):

            async def read() -> None:
                async with reader.snapshot() as snap:
                    await snap.cur.execute("SELECT count(*) FROM relations.edges")

            with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
                await asyncio.wait_for(read(), 30)
    finally:
        await reader.close()


async def test_a_client_that_leaves_takes_its_statement_with_it(
    busy: str, broker: EmbeddedBroker, names: Names, tmp_path: Path
) -> None:
    """`aml-app serve` with a bound of ten minutes: a question whose client goes away while its
    statement waits is cancelled, and its statement with it, while the lock still holds."""
    groups = {"relations": names.deps[0], "aggregates": names.deps[1]}
    settings = api_settings(broker.bootstrap, names, busy, groups)
    b = ApiProcess("relations", settings, tmp_path / "relations-api.log", AML_API_TIMEOUT="600")
    b.start()
    try:
        await until(b.health, "B's API answering")
        with edges_locked(busy):
            async with aiohttp.ClientSession() as session:
                asking = asyncio.ensure_future(session.get(f"{b.url}/relations/busy?hops=3&parts=chain"))
                await until(lambda: running(busy, at_least=1), "the question's statement on the server")
                asking.cancel()  # the client leaves: its connection closes
                with pytest.raises(asyncio.CancelledError):
                    await asking
            await until(lambda: running(busy, at_most=0), "its statement gone while the lock holds", 20)
            assert await b.health(), "B's API still answers"
    finally:
        await asyncio.to_thread(b.stop, 10)


async def running(url: str, at_least: int = 0, at_most: int = 1_000_000) -> bool:
    return at_least <= await statements(url) <= at_most


# --- /health has connections of its own --------------------------------------------------------------


async def test_questions_that_take_every_connection_leave_health_answering(busy: str) -> None:
    """Two connections for the questions, both taken by questions that wait: a third question gets a 503
    that says so, and /health, on connections of its own, answers 200."""
    app = bounded(busy, max_connections=2, timeout=0.5)
    async with client_for(app) as client:
        with edges_locked(busy):
            waiting = [asyncio.ensure_future(client.get("/relations/busy?parts=out")) for _ in range(2)]
            await until(lambda: running(busy, at_least=2), "two questions waiting on the store")
            response = await client.get("/relations/s1?parts=out")
            body = await response.json()
            assert response.status == 503 and response.headers["Retry-After"] == "1", body
            assert (
                body["error"] == "Every connection of this replica to the store is in use; try again shortly."
            )
            health = await answer(client, "/health")
            assert health["status"] == "ok" and health["as_of"] == {"0": 1204}
        for done in await asyncio.wait_for(asyncio.gather(*waiting), 60):
            assert done.status == 200 and len((await done.json())["out"]) == 199


# --- every malformed input is a 400 that names the field --------------------------------------------

LONG = "9" * 5000
CURRENCIES = ",".join(f"{''.join(c)}:1" for c in itertools.product(string.ascii_uppercase, repeat=3))


def batch(**query: Any) -> dict[str, Any]:
    return {"queries": [{"account": "busy", **query}]}


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/relations/a%00b", None, "The account id holds a NUL character"),
        ("/relations/busy?parts=out&at=2026-03-01T12:00:00Z%00", None, "'at' holds a NUL character"),
        ("/relations", batch(account="a\x00b"), "queries[0].account holds a NUL character"),
        ("/relations", b'{"queries": [{"account": "\\ud800"}]}', "queries[0].account holds an unpaired"),
        (
            "/aggregates",
            b'{"queries": [{"account": "a", "at": "\\udfff"}]}',
            "queries[0].at holds an unpaired",
        ),
        (f"/relations/busy?hops={LONG}", None, "hops must be a whole number from 1 to 3"),
        ("/relations", batch(hops=LONG), "hops must be a whole number from 1 to 3"),
        (
            "/relations",
            f'{{"queries": [{{"account": "a", "hops": {LONG}}}]}}'.encode(),
            "hops must be a whole",
        ),
        (
            "/relations",
            f'{{"queries": [{{"account": "a", "parts": "loop", "closing": "b", "at": "2026-03-01T12:00:00Z", '
            f'"loop_hops": {LONG}}}]}}'.encode(),
            "queries[0]: loop_hops must be a whole number from 2 to 16",
        ),
        ("/relations", {"queries": [], "need": {"as_of": {LONG: 1}}}, "need.as_of maps partitions"),
        (
            "/relations",
            f'{{"queries": [], "need": {{"as_of": {{"0": {LONG}}}}}}}'.encode(),
            "need.as_of maps",
        ),
        (
            "/relations",
            f'{{"queries": [], "need": {{"as_of": {{}}, "wait_ms": -{LONG}}}}}'.encode(),
            "wait_ms",
        ),
        (
            "/relations",
            {"queries": [], "need": {"as_of": {str(p): 1 for p in range(10_001)}}},
            "need.as_of names 10001 partitions; it may name at most 10000",
        ),
        (
            "/relations",
            b'{"queries": ' + b"[" * 1000 + b"]" * 1000 + b"}",
            "nests JSON arrays or objects too deep",
        ),
        ("/relations", batch(min_average=CURRENCIES), "min_average is 105455 characters long"),
        ("/relations", batch(min_average="USD:1,XXY:2"), "min_average names XXY, which is not an ISO 4217"),
        ("/relations/busy?parts=out,out", None, "parts must be a comma-separated list"),
        ("/relations", batch(parts=",".join(["out"] * 100_000)), "each at most once"),
        ("/relations/busy?parts=cycle&after=x", None, "after belongs to the parts out and in"),
        ("/relations", batch(parts="in", after=""), "queries[0]: after must be the last counterparty"),
    ],
)
async def test_malformed_input_is_a_400_naming_the_field(busy: str, path: str, body: Any, words: str) -> None:
    app = bounded(busy) if path.startswith("/relations") else aggregates_api(busy)
    async with client_for(app) as client:
        refused = await answer(client, path, body, status=400)
        assert words in refused["error"], refused


async def test_a_batch_as_large_as_the_bounds_allow_is_read_not_refused_for_its_size(busy: str) -> None:
    """The detector's largest batch, each query with a rate for every currency (the client repeats it in
    each): aiohttp's default body limit, 1 MiB, refused it with a 413 before any of it was read, which
    the detector takes for a bug of its own and retries for ever. Read, its last query is the 400."""
    from aml_app.contract import MAX_ID_LENGTH
    from aml_app.currencies import ISO_4217

    every_rate = ",".join(f"{currency}:1000000.00" for currency in sorted(ISO_4217))
    queries = [
        {"account": f"{i:04d}".ljust(MAX_ID_LENGTH, "a"), "parts": "out,in", "min_average": every_rate}
        for i in range(api.MAX_BATCH)
    ]
    queries[-1]["account"] = " "
    body = _bytes({"queries": queries})
    assert 2**20 < len(body) <= api.MAX_BODY
    async with client_for(bounded(busy)) as client:
        refused = await answer(client, "/relations", body, status=400)
    assert refused["error"].startswith(f"queries[{api.MAX_BATCH - 1}].account must be a non-blank string")


async def test_the_first_and_last_instants_there_are_answered_like_any_other(busy: str) -> None:
    """`at` in the first week of year 1: a loop's and a window's start lie before the first instant
    Python has; at the last instant of year 9999, after every payment. Answers, not errors."""
    async with client_for(bounded(busy)) as b, client_for(aggregates_api(busy)) as c:
        at = "0001-01-01T00:00:00Z"
        loop = await answer(b, f"/relations/busy?parts=loop,chain,out&closing=payer-0001&at={at}")
        assert loop["loop"] == {"found": False, "path": [], "complete": True} and loop["out"] == []
        window = await answer(c, f"/aggregates/busy?at={at}")
        assert window["at"] == "0001-01-01T00:00:00.000000Z" and window["windows"]["7d"]["sent_count"] == 0
        assert window["exact"] is True
        at = "9999-12-31T23:59:59.999999Z"
        last = await answer(b, f"/relations/s1?parts=loop,chain,out&closing=s3&at={at}")
        assert last["loop"]["found"] is False, "s3 paid s1 more than 14 days before"
        assert [e["counterparty"] for e in last["out"]] == ["s2"]
        window = await answer(c, f"/aggregates/busy?at={at}")
        assert window["at"] == "9999-12-31T23:59:59.999999Z" and window["windows"]["7d"]["sent_count"] == 0


# --- what the logs and /health show ---------------------------------------------------------------


async def test_the_log_escapes_what_a_client_sends(
    busy: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path holds what the client sent, a newline included: the API's log lines show it escaped, so no
    client writes a line of its own into the log."""
    caplog.set_level(logging.INFO, logger="aml_app.dependencies.api")
    forged = "/relations/x%0A2026-03-01 12:00:00 ERROR forged?parts=out"
    async with client_for(bounded(busy, answer_timeout=0.5)) as client:
        with edges_locked(busy):
            await answer(client, forged, status=503)

        async def broken(*_args: Any, **_kwargs: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(relations, "relations_many", broken)
        await answer(client, forged, status=500)
    lines = [r.getMessage() for r in caplog.records if r.name == "aml_app.dependencies.api"]
    assert len(lines) == 2, lines
    assert all("\n" not in line and "x\\n2026-03-01 12:00:00 ERROR forged" in line for line in lines), lines


async def test_the_access_log_says_who_asked_what_and_never_the_token(
    busy: str, broker: EmbeddedBroker, names: Names, tmp_path: Path
) -> None:
    """`aml-app serve` writes one line per request (caller, request line, status, seconds, client), a
    refused one included; the bearer token it was sent is never in its log; `AML_API_ACCESS_LOG=0`
    writes none."""
    token = "access-log-token-" + uuid.uuid4().hex
    groups = {"relations": names.deps[0], "aggregates": names.deps[1]}
    settings = with_dependencies(api_settings(broker.bootstrap, names, busy, groups), api_token=token)
    for logged in (True, False):
        log_path = tmp_path / f"relations-api-{logged}.log"
        env = {} if logged else {"AML_API_ACCESS_LOG": "0"}
        b = ApiProcess("relations", settings, log_path, **env)
        b.start()
        try:
            await until(b.health, "B's API answering")
            async with aiohttp.ClientSession(headers={"User-Agent": "audit-test/1"}) as session:
                async with session.get(f"{b.url}/relations/busy?hops=1", headers=b.headers) as response:
                    assert response.status == 200
                async with session.get(f"{b.url}/relations/busy?hops=2") as response:
                    assert response.status == 401
        finally:
            await asyncio.to_thread(b.stop, 10)
        text = log_path.read_text(errors="replace")
        assert token not in text
        lines = [line for line in text.splitlines() if line.startswith("relations access: ")]
        if not logged:
            assert lines == [], lines
            continue
        asked = [line for line in lines if "/relations/busy" in line]
        assert len(asked) == 2, lines
        assert '"GET /relations/busy?hops=1 HTTP/1.1" 200 ' in asked[0] and '"audit-test/1"' in asked[0]
        assert '"GET /relations/busy?hops=2 HTTP/1.1" 401 ' in asked[1], asked
        assert all(line.split()[2] == "127.0.0.1" for line in asked), asked


async def test_health_shows_where_the_store_is_and_no_secret(busy: str) -> None:
    secrets = "password=hunter2&sslpassword=swordfish&options=-csearch_path%3Dpublic&passfile=%2Fkeys"
    url = f"{busy}?{secrets}&sslmode=disable&connect_timeout=7"
    async with client_for(
        build_app("relations", with_dependencies(SETTINGS, store_url=url), check=False)
    ) as client:
        shown = (await answer(client, "/health"))["store"]
    assert shown == redacted(url)
    for secret in ("hunter2", "swordfish", "search_path", "keys"):
        assert secret not in shown
    for kept in (
        "host=127.0.0.1",
        "dbname=limits_",
        "user=",
        "port=",
        "sslmode=disable",
        "connect_timeout=7",
    ):
        assert kept in shown
    assert shown.count("***") == 4


# --- a connection left in pipeline mode is not handed out again ---------------------------------------


async def test_a_connection_left_in_pipeline_mode_is_replaced_not_used(busy: str) -> None:
    """One connection for the questions, left in libpq's pipeline mode as a snapshot cut short at the
    wrong moment can leave it (seen in a chaos soak: every later question on it failed with "cannot
    insert multiple commands into a prepared statement"): the pool replaces it, and every question is
    answered."""
    app = bounded(busy, max_connections=1)
    async with client_for(app) as client:
        assert (await answer(client, "/relations", batch(hops=3, parts="chain")))["answers"]
        reader = app[api.READER]
        conn = await reader.pool.getconn()
        async with contextlib.AsyncExitStack() as never_left:
            await never_left.enter_async_context(conn.pipeline())
            await reader.pool.putconn(conn)
            for _ in range(8):  # more than psycopg's prepare threshold
                got = await answer(client, "/relations", batch(hops=3, parts="chain"))
                assert got["answers"][0]["chain"] == ["payer-0000", "busy"], got
            never_left.pop_all()  # the connection is gone: nothing to leave


async def test_a_question_cancelled_as_its_snapshot_enters_pipeline_mode_closes_its_connection(
    busy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """psycopg's wait yields to the loop once more after a step that did not need the socket when the
    loop has been busy for `MAX_BUSY_TIME` (5 ms; 0 here, a loaded machine): a cancellation that lands
    there as the snapshot enters pipeline mode (a client leaving) ends `pipeline()`'s entry with the
    mode entered and no exit to come. The snapshot closes that connection, and the next is answered."""
    reader = Reader(busy, relations.SCHEMA, max_connections=1)
    await reader.open()
    entered: list[psycopg.AsyncConnection[Any]] = []
    enter = psycopg.AsyncPipeline._enter_gen

    def enter_then_cancelled(pipeline: Any) -> Any:
        result = yield from enter(pipeline)
        entered.append(pipeline._conn)
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        return result

    async def ask() -> list[Any]:
        async with reader.snapshot() as snap:
            await snap.cur.execute("SELECT count(*) FROM relations.edges")
            return await snap.cur.fetchall()

    try:
        with monkeypatch.context() as patched:
            patched.setattr(psycopg.waiting, "MAX_BUSY_TIME", 0.0)
            patched.setattr(psycopg.AsyncPipeline, "_enter_gen", enter_then_cancelled)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.ensure_future(ask()), 30)
        assert len(entered) == 1 and entered[0].closed, "the connection left in pipeline mode is closed"
        assert (await asyncio.wait_for(ask(), 30))[0][0] > 0
    finally:
        await reader.close()


async def test_a_question_cut_short_leaves_its_connection_fit_for_the_next(busy: str) -> None:
    """One connection for the questions: a question stopped at the bound, and one whose client leaves,
    while their statements wait in the snapshot's pipeline; every question after them is answered on
    that same connection."""
    app = bounded(busy, answer_timeout=0.5, max_connections=1)
    async with client_for(app) as client:
        with edges_locked(busy):
            body = await answer(client, "/relations", batch(hops=3, parts="chain"), status=503)
            assert "took longer than 0.5 s" in body["error"]
            asking = asyncio.ensure_future(client.post("/relations", data=_bytes(batch()), headers=JSON))
            await until(lambda: running(busy, at_least=1), "the second question's statement on the server")
            asking.cancel()  # the client leaves: the server cancels the question
            with pytest.raises(asyncio.CancelledError):
                await asking
            await until(lambda: running(busy, at_most=0), "its statement gone while the lock holds", 20)
        for _ in range(8):  # more than psycopg's prepare threshold, on the one connection
            got = await answer(client, "/relations", batch(hops=3, parts="chain"))
            assert got["answers"][0]["chain"] == ["payer-0000", "busy"], got
