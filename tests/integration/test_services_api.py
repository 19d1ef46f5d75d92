"""The HTTP APIs of services B and C over real HTTP on loopback (aiohttp's TestServer and TestClient), on
a real PostgreSQL server, with stores built by the pipeline's own Spark transforms; the store check
against a real broker's committed offsets; and one smoke test of `serve` in a child process."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import aiohttp
import psycopg
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from aml_app.dependencies import aggregates, relations
from aml_app.dependencies.api import aggregates_app, build_app, relations_app
from aml_app.dependencies.client import DependencyClient, DependencyRequestError, Need
from aml_app.dependencies.store import Reader, drop, migrate, redacted
from aml_app.detection.exchange import ExchangeRates
from aml_app.kafka.broker import EmbeddedBroker, free_port
from aml_app.pipeline.progress import GroupProgress
from aml_app.settings import Settings
from aml_app.training.reference import reference_aggregates, reference_relations
from tests.harness import Names
from tests.payments import PaymentRow
from tests.stores import apply_payments, apply_records, with_dependencies, without_as_of

T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)
THRESHOLD = Decimal("10000")
BAND = Decimal("0.1")
SETTINGS = Settings()


@asynccontextmanager
async def client_for(app: web.Application) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


def relations_api(url: str) -> web.Application:
    return relations_app(Reader(url, relations.SCHEMA))


def aggregates_api(url: str, settings: Settings = SETTINGS) -> web.Application:
    return aggregates_app(Reader(url, aggregates.SCHEMA), settings)


async def get(client: TestClient, path: str, status: int = 200) -> dict[str, Any]:
    response = await client.get(path)
    assert response.content_type == "application/json", await response.text()
    body = await response.json()
    assert response.status == status, body
    if status >= 400:
        assert set(body) == {"error"} and body["error"].endswith("."), body
    return body


def payments() -> list[PaymentRow]:
    rows = [
        ("A", "B", "9500", T0 - timedelta(minutes=30)),
        ("B", "C", "12.5", T0 - timedelta(hours=3)),
        ("C", "A", "0.0001", T0 - timedelta(days=2)),
        ("A", "a/b ü", "1", T0),
    ]
    return [
        PaymentRow(i % 2, i // 2, f"pay-{i}", payer, payee, Decimal(amount), "EUR", ts)
        for i, (payer, payee, amount, ts) in enumerate(rows)
    ]


@pytest.fixture
def stores(spark: Any, store_url: str) -> str:
    """Both stores holding `payments()` (offsets 0 and 1 of partitions 0 and 1)."""
    apply_payments(spark, store_url, "relations", payments())
    apply_payments(spark, store_url, "aggregates", payments())
    return store_url


# --- relations -----------------------------------------------------------------------------------


async def test_relations_answers(stores: str) -> None:
    async with client_for(relations_api(stores)) as client:
        body = await get(client, "/relations/A?hops=3")
        assert body["as_of"] == {"0": 2, "1": 2}
        assert without_as_of(body) == reference_relations(payments(), "A", 3)
        assert body["cycle"] == {"found": True, "path": ["A", "B", "C", "A"]}
        assert body["out"][0] == {
            "counterparty": "B",
            "count": 1,
            "totals": {"EUR": "9500.00"},
            "first_seen": "2026-03-01T11:30:00.000000Z",
            "last_seen": "2026-03-01T11:30:00.000000Z",
        }
        default = await get(client, "/relations/A")
        assert default["hops"] == 2 and default["cycle"]["found"] is False
        # Any account id works as one percent-encoded path segment.
        odd = await get(client, "/relations/" + quote("a/b ü", safe=""))
        assert odd["account"] == "a/b ü" and odd["in"][0]["counterparty"] == "A"
        assert (await get(client, "/relations/" + "x" * 128))["out"] == []
        # Only the parts asked for, each equal to the full answer's.
        some = await get(client, "/relations/A?hops=3&parts=cycle,out")
        assert some == {k: body[k] for k in ("account", "hops", "as_of", "log", "out", "cycle")}
        nothing_stored = await get(client, "/relations/nobody?parts=neighbourhood")
        assert set(nothing_stored) == {"account", "hops", "as_of", "log", "neighbourhood"}
        # A loop goes forward in time: C paid A, A paid B; B paying C at T0 closes C A B C. The cycle
        # A B C A of the same edges is no loop closed by C paying A: C paid A first.
        at = quote("2026-03-01T12:00:00+00:00", safe="")
        loop = await get(client, f"/relations/C?parts=loop&closing=B&at={at}")
        assert loop["loop"] == {"found": True, "path": ["C", "A", "B", "C"], "complete": True}
        assert (await get(client, f"/relations/A?parts=loop&closing=C&at={at}"))["loop"]["found"] is False
        short = await get(client, f"/relations/C?parts=loop,out&closing=B&at={at}&loop_hops=2")
        assert short["loop"]["found"] is False and [e["counterparty"] for e in short["out"]] == ["A"]


async def test_relations_unknown_account_is_a_well_formed_empty_answer(stores: str) -> None:
    async with client_for(relations_api(stores)) as client:
        assert await get(client, "/relations/nobody?hops=1") == {
            "account": "nobody",
            "hops": 1,
            "as_of": {"0": 2, "1": 2},
            "log": None,
            "out": [],
            "in": [],
            "neighbourhood": [],
            "cycle": {"found": False, "path": []},
            "chain": [],
            "sources": [],
            "co_payees": [],
        }


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("hops=0", "hops must be a whole number from 1 to 3, got '0'"),
        ("hops=4", "from 1 to 3"),
        ("hops=x", "got 'x'"),
        ("hops=", "got ''"),
        ("hops=-1", "from 1 to 3"),
        ("hops=1.5", "whole number"),
        ("hops=1&hops=2", "given 2 times"),
        ("parts=cycle,edges", "parts must be a comma-separated list of out, in, neighbourhood, cycle"),
        ("parts=", "got ''"),
        ("parts=out&parts=in", "given 2 times"),
        ("min_average=-1", "min_average must be a plain decimal number >= 0"),
        ("min_average=usd:1", "one per currency such as USD:1000,EUR:853.4, got 'usd:1'"),
        ("min_average=USD:1,USD:2", "got 'USD:1,USD:2'"),
        ("min_average=USD:", "got 'USD:'"),
        ("parts=loop&at=2026-03-01T12:00:00Z", "the part loop needs closing"),
        ("parts=loop&closing=B", "the part loop needs at"),
        ("parts=loop&closing=B&at=yesterday", "at must be an ISO-8601 instant"),
        (
            "parts=loop&closing=B&at=2026-03-01T12:00:00Z&loop_hops=17",
            "loop_hops must be a whole number from 2",
        ),
        ("parts=loop&closing=B&at=2026-03-01T12:00:00Z&loop_hops=1", "from 2 to 16"),
        ("parts=out&closing=B", "closing belongs to the parts chain and loop, neither of which is asked"),
        ("parts=out&at=2026-03-01", "at must include a timezone"),
        ("parts=chain&loop_hops=3", "loop_hops belongs to the part loop, which is not asked"),
        ("parts=chain&at=yesterday", "at must be an ISO-8601 instant"),
        ("parts=chain&closing=%20", "closing must be the payer of the payment"),
    ],
)
async def test_relations_bad_parameters(store_url: str, query: str, words: str) -> None:
    async with client_for(relations_api(store_url)) as client:
        body = await get(client, f"/relations/A?{query}", status=400)
        assert words in body["error"]


async def test_errors_are_json_sentences(store_url: str) -> None:
    async with client_for(relations_api(store_url)) as client:
        too_long = await get(client, "/relations/" + "x" * 129, status=400)
        assert "129 characters" in too_long["error"] and "128" in too_long["error"]
        blank = await get(client, "/relations/%20%20", status=400)
        assert "blank" in blank["error"]
        missing = await get(client, "/nothing/here", status=404)
        assert "GET /relations/{account}" in missing["error"]
        response = await client.post("/relations/A")
        assert response.status == 405 and "use GET" in (await response.json())["error"]


async def test_health_and_as_of_follow_the_applies(spark: Any, store_url: str) -> None:
    settings = with_dependencies(SETTINGS, store_url=store_url)
    async with client_for(build_app("relations", settings, check=False)) as client:
        health = await get(client, "/health")
        assert health == {
            "status": "ok",
            "service": "relations",
            "store": redacted(store_url),
            "store_exists": False,
            "as_of": {},
            "log": None,
            "folded_before": None,
            "answer_cache": {
                "entries": 0,
                "capacity": settings.dependencies.api_cache_answers,
                "hits": 0,
                "misses": 0,
                "joined": 0,
                "cleared": 0,
            },
        }
        assert (await get(client, "/relations/A"))["as_of"] == {}
        # The pipeline (another process in production) creates the tables and writes.
        apply_records(spark, store_url, "relations", [(0, 5, b"A", b"not json")])
        health = await get(client, "/health")
        assert health["store_exists"] is True and health["as_of"] == {"0": 6}
        apply_payments(spark, store_url, "relations", [replace(payments()[0], offset=6)])
        apply_records(spark, store_url, "relations", [(3, 8, b"A", b"not json")])
        body = await get(client, "/relations/A?hops=1")
        assert body["as_of"] == {"0": 7, "3": 9}
        assert [e["counterparty"] for e in body["out"]] == ["B"]


async def test_reads_run_concurrently_with_a_writer(spark: Any, store_url: str) -> None:
    async with client_for(relations_api(store_url)) as client:
        writes = asyncio.Event()

        async def write() -> None:
            for i in range(12):
                row = PaymentRow(0, i, "p", "A", f"N{i:02}", Decimal("1"), "EUR", T0)
                await asyncio.to_thread(apply_payments, spark, store_url, "relations", [row])
            writes.set()

        async def read() -> list[dict[str, Any]]:
            answers = []
            while not writes.is_set():
                answers.append(await get(client, "/relations/A?hops=1"))
                await asyncio.sleep(0.02)
            return answers

        _, answers = await asyncio.gather(write(), read())
        for body in answers:  # every answer is one snapshot: as many edges as offsets applied
            assert len(body["out"]) == body["as_of"].get("0", 0)
        assert len({len(body["out"]) for body in answers}) > 2, "the reads saw the writes progress"
        assert len((await get(client, "/relations/A?hops=1"))["out"]) == 12


# --- aggregates ----------------------------------------------------------------------------------


async def test_aggregates_answers(stores: str) -> None:
    async with client_for(aggregates_api(stores)) as client:
        body = await get(client, "/aggregates/A?at=2026-03-01T12:00:00Z")
        assert body["as_of"] == {"0": 2, "1": 2}
        assert without_as_of(body) == reference_aggregates([payments()], "A", T0, THRESHOLD, BAND)
        assert body["at"] == "2026-03-01T12:00:00.000000Z"
        assert body["near_threshold_24h"] == 1
        assert body["windows"]["1h"] == {
            "sent_count": 2,
            "sent": {"EUR": "9501.00"},
            "sent_total": "11133.11",  # in US dollars at AMLworld's 0.8534 euros to the dollar
            "received_count": 0,
            "received": {},
            "received_total": "0.00",
            "counterparties": 2,
            "sent_counterparties": 2,
            "received_counterparties": 0,
        }
        assert body["windows"]["7d"]["received"] == {"EUR": "0.0001"}
        # The same instant written with an offset: encoded '+', or a raw '+' the query decodes to a space.
        for at in (
            "2026-03-01T13:00:00%2B01:00",
            "2026-03-01T13:00:00+01:00",
            "2026-03-01T12:00:00.000000+00:00",
        ):
            assert (await get(client, f"/aggregates/A?at={at}")) == body
        assert body["reporting_currency"] == "USD" and body["unconverted"] == []
        unknown = await get(client, "/aggregates/nobody?at=2026-03-01T12:00:00Z")
        assert unknown["windows"]["24h"] == {
            "sent_count": 0,
            "sent": {},
            "sent_total": "0.00",
            "received_count": 0,
            "received": {},
            "received_total": "0.00",
            "counterparties": 0,
            "sent_counterparties": 0,
            "received_counterparties": 0,
        }
        assert unknown["near_threshold_24h"] == 0 and unknown["as_of"] == {"0": 2, "1": 2}


def with_rates(rates: ExchangeRates) -> Settings:
    """SETTINGS with the AML rules' reporting currency and exchange rates set to `rates`."""
    detection = SETTINGS.detection
    thresholds = replace(detection.aml_thresholds, rates=rates)
    return replace(SETTINGS, detection=replace(detection, aml_thresholds=thresholds))


async def test_aggregates_answer_in_the_configured_reporting_currency(stores: str) -> None:
    """C states its sums in the AML rules' reporting currency, read from the same settings; a currency
    without a rate counts nothing there and is named."""
    rates = ExchangeRates.from_env({"AML_REPORTING_CURRENCY": "GBP", "AML_EXCHANGE_RATES": "USD=1.25"})
    settings = with_rates(rates)
    async with client_for(aggregates_api(stores, settings)) as client:
        body = await get(client, "/aggregates/A?at=2026-03-01T12:00:00Z")
    assert body["reporting_currency"] == "GBP" and body["unconverted"] == ["EUR"]
    assert body["windows"]["1h"]["sent"] == {"EUR": "9501.00"}
    assert body["windows"]["1h"]["sent_total"] == "0.00"
    assert without_as_of(body) == reference_aggregates([payments()], "A", T0, THRESHOLD, BAND, rates)
    rates = ExchangeRates.from_env({"AML_REPORTING_CURRENCY": "EUR"})
    settings = with_rates(rates)
    async with client_for(aggregates_api(stores, settings)) as client:
        body = await get(client, "/aggregates/A?at=2026-03-01T12:00:00Z")
    assert body["reporting_currency"] == "EUR" and body["unconverted"] == []
    assert body["windows"]["1h"]["sent_total"] == "9501.00"
    assert body["windows"]["7d"]["received_total"] == "0.00"  # 0.0001 EUR, to the cent


async def test_aggregates_at_defaults_to_now(store_url: str) -> None:
    async with client_for(aggregates_api(store_url)) as client:
        before = datetime.now(UTC)
        body = await get(client, "/aggregates/A")
        at = datetime.fromisoformat(body["at"])
        assert before <= at <= datetime.now(UTC)
        assert body["as_of"] == {} and body["late_dropped"] == 0


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("at=garbage", "at must be an ISO-8601 instant"),
        ("at=2026-03-01T12:00:00", "at must include a timezone"),
        ("at=2026-03-01", "at must include a timezone"),
        ("at=2026-13-01T00:00:00Z", "ISO-8601"),
        ("at=", "ISO-8601"),
        ("at=2026-03-01T12:00:00Z&at=2026-03-01T12:00:00Z", "given 2 times"),
        ("at=0001-01-01T00:00:00%2B01:00", "out of range"),
    ],
)
async def test_aggregates_bad_at(store_url: str, query: str, words: str) -> None:
    async with client_for(aggregates_api(store_url)) as client:
        body = await get(client, f"/aggregates/A?{query}", status=400)
        assert words in body["error"]
        assert (await get(client, "/aggregates/" + "y" * 129, status=400))["error"].startswith(
            "The account id"
        )


async def test_aggregates_health_without_then_with_a_store(spark: Any, store_url: str) -> None:
    settings = with_dependencies(SETTINGS, store_url=store_url, reporting_threshold=Decimal("5000"))
    async with client_for(build_app("aggregates", settings, check=False)) as client:
        health = await get(client, "/health")
        assert health["store_exists"] is False and health["as_of"] == {}
        assert health["late_dropped"] == 0 and health["max_event_ts"] is None
        empty = await get(client, "/aggregates/A?at=2026-03-01T12:00:00Z")
        assert empty["as_of"] == {} and empty["reporting_threshold"] == "5000"
        apply_payments(spark, store_url, "aggregates", payments(), settings=settings)
        late = PaymentRow(0, 2, "old", "A", "B", Decimal("1"), "EUR", T0 - timedelta(days=8))
        apply_payments(spark, store_url, "aggregates", [late], settings=settings)
        health = await get(client, "/health")
        assert health["store_exists"] is True
        assert health["as_of"] == {"0": 3, "1": 2}
        assert health["late_dropped"] == 1
        assert health["max_event_ts"] == "2026-03-01T12:00:00.000000Z"
        body = await get(client, "/aggregates/A?at=2026-03-01T12:00:00Z")
        assert body["as_of"] == {"0": 3, "1": 2} and body["late_dropped"] == 1
        assert body["near_threshold_24h"] == 0  # 9500 is not near a 5000 threshold
        # Tables it has seen, dropped under it (a rebuild): it looks again rather than failing.
        with psycopg.connect(store_url, autocommit=True) as conn:
            drop(conn, aggregates.SCHEMA)
        assert (await get(client, "/aggregates/A?at=2026-03-01T12:00:00Z"))["as_of"] == {}
        assert (await get(client, "/health"))["store_exists"] is False


@asynccontextmanager
async def round_trips(reader: Reader) -> AsyncIterator[list[int]]:
    """The round trips of the block's snapshots (the pool holds one connection), counted in libpq's trace
    of the connection: a round trip is a message sent (F, the frontend) followed by one received (B).
    """
    counted: list[int] = []
    with tempfile.TemporaryFile("w+") as trace:
        async with reader.pool.connection() as conn:
            conn.pgconn.trace(trace.fileno())
        yield counted
        async with reader.pool.connection() as conn:
            conn.pgconn.untrace()
        trace.seek(0)
        # A message's line starts with its time; a statement's text may go on over lines of its own.
        sides = [line.split("\t")[1] for line in trace if line[:1].isdigit() and "\t" in line]
    counted.append(sum(1 for sent, then in itertools.pairwise(sides) if (sent, then) == ("F", "B")))


async def test_a_snapshot_waits_for_two_round_trips_beside_its_answer(stores: str) -> None:
    """A request waits for each round trip to PostgreSQL, and more so on a busy machine: a snapshot's
    BEGIN goes in the message of the statement that reads the store's state, then come the answer's own
    statements (here one), then COMMIT."""
    reader = Reader(stores, aggregates.SCHEMA, max_connections=1)
    await reader.open()
    await reader.pool.wait(10)
    try:
        trips = []
        for _ in range(2):  # the first one also asks whether the store has its tables
            async with round_trips(reader) as counted:
                async with reader.snapshot() as snap:
                    assert snap.as_of == {0: 2, 1: 2}
                    await snap.cur.execute("SELECT 1")
                    assert await snap.cur.fetchall() == [(1,)]
            trips += counted
        assert trips == [4, 3]
    finally:
        await reader.close()


async def test_a_batch_of_every_part_waits_for_the_server_once(stores: str) -> None:
    """B sends a batch's statements for every part but `neighbourhood` (one per part, more with several
    kinds of `chain` or heavy edges) and the loop searches' first round together, and reads them after:
    the answer waits for the server once for them all, beside its snapshot's two round trips. The loop's
    later rounds cost one each."""
    at = T0
    parts = ["out", "in", "cycle", "chain", "sources", "co_payees"]
    asked = [
        relations.Query("A", 3, parts),
        relations.Query("B", 2, parts, Decimal(5)),
        relations.Query("C", 3, ["chain", "loop"], Decimal(0), "B", at),
        relations.Query("A", 3, ["chain"], Decimal(0), "C", at),
    ]
    loops = [
        relations.Query("C", 3, ["loop"], Decimal(0), "B", at),
        relations.Query("B", 3, ["loop"], Decimal(0), "A", at),
    ]
    reader = Reader(stores, relations.SCHEMA, max_connections=1)
    await reader.open()
    await reader.pool.wait(10)
    try:
        async with reader.snapshot():
            pass  # the first snapshot also asks whether the store has its tables
        trips, answers = [], []
        for queries in (asked[:2], asked, loops, asked + loops):
            async with round_trips(reader) as counted:
                async with reader.snapshot() as snap:
                    answers.append(await relations.relations_many(snap.cur, snap.schema, queries, snap.as_of))
            trips += counted
        one_by_one = []
        for query in asked + loops:
            async with reader.snapshot() as snap:
                one_by_one += await relations.relations_many(snap.cur, snap.schema, [query], snap.as_of)
        assert answers[3] == one_by_one
        assert answers[3][2]["loop"] == {"found": True, "path": ["C", "A", "B", "C"], "complete": True}
        # The snapshot's two round trips and one for every part's statement; the loop searches' first
        # round goes with the other parts' statements.
        assert trips[0] == 3
        assert trips[3] == trips[2] > 3
    finally:
        await reader.close()


def test_build_app_refuses_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown service 'ledger'"):
        build_app("ledger", SETTINGS)


# --- serve ---------------------------------------------------------------------------------------


async def test_serve_runs_the_service_until_stopped(store_url: str, broker: EmbeddedBroker) -> None:
    port = free_port()
    settings = (
        f"kafka=KafkaSettings(bootstrap_servers=({broker.bootstrap!r},)), "
        f"dependencies=DependencySettings(store_url={store_url!r})"
    )
    code = (
        "from aml_app.dependencies.api import serve\n"
        "from aml_app.settings import DependencySettings, KafkaSettings, Settings\n"
        f"serve('aggregates', Settings({settings}).with_endpoint('aggregates', port={port}))\n"
    )
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health") as response:
                        body = await response.json()
                        break
                except aiohttp.ClientConnectionError:
                    if child.returncode is not None:
                        output = await child.stdout.read() if child.stdout else b""
                        pytest.fail(f"the service exited early: {output.decode()}")
                    assert time.monotonic() < deadline, "the service did not answer within 30 s"
                    await asyncio.sleep(0.1)
        assert body["service"] == "aggregates" and body["store_exists"] is False
    finally:
        if child.returncode is None:
            child.terminate()
            try:
                await asyncio.wait_for(child.wait(), 10)
            except TimeoutError:
                child.kill()
                await child.wait()


# --- batches -------------------------------------------------------------------------------------


JSON = {"Content-Type": "application/json"}


async def post(client: TestClient, path: str, body: Any, status: int = 200) -> dict[str, Any]:
    response = (
        await client.post(path, json=body)
        if not isinstance(body, bytes)
        else await client.post(path, data=body, headers=JSON)
    )
    answer = await response.json()
    assert response.status == status, answer
    return answer


async def test_batches_answer_like_the_single_queries_from_one_snapshot(stores: str) -> None:
    async with client_for(relations_api(stores)) as r, client_for(aggregates_api(stores)) as a:
        queries = [
            {"account": "A", "hops": 3, "parts": "out,cycle"},
            {"account": "a/b ü", "hops": "1"},
            {"account": "nobody"},
            {"account": "C", "parts": "loop", "closing": "B", "at": "2026-03-01T12:00:00Z", "loop_hops": 3},
        ]
        batch = await post(r, "/relations", {"queries": queries})
        singles = [
            await get(r, "/relations/A?hops=3&parts=out,cycle"),
            await get(r, "/relations/" + quote("a/b ü", safe="") + "?hops=1"),
            await get(r, "/relations/nobody"),
            await get(r, "/relations/C?parts=loop&closing=B&at=2026-03-01T12:00:00Z&loop_hops=3"),
        ]
        assert batch == {"answers": singles}
        at = "2026-03-01T12:00:00Z"
        batch = await post(
            a, "/aggregates", {"queries": [{"account": "A", "at": at}, {"account": "C", "at": at}]}
        )
        assert batch == {
            "answers": [await get(a, f"/aggregates/A?at={at}"), await get(a, f"/aggregates/C?at={at}")]
        }
        assert await post(a, "/aggregates", {"queries": []}) == {"answers": []}


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/aggregates", b"not json", "must be JSON"),
        ("/aggregates", {"query": []}, 'must be {"queries": [...]}'),
        ("/aggregates", {"queries": ["A"]}, "one object per query"),
        ("/aggregates", {"queries": [{"account": "A"}] * 1001}, "at most 1000 queries; this one has 1001"),
        ("/aggregates", {"queries": [{"at": "2026-03-01T12:00:00Z"}]}, "queries[0].account must be"),
        ("/aggregates", {"queries": [{"account": "A", "at": "yesterday"}]}, "at must be an ISO-8601 instant"),
        ("/aggregates", {"queries": [{"account": "A", "at": 5}]}, "queries[0].at must be a string"),
        ("/relations", {"queries": [{"account": "A", "hops": 4}]}, "hops must be a whole number from 1 to 3"),
        ("/relations", {"queries": [{"account": "A", "parts": "edges"}]}, "parts must be a comma-separated"),
        ("/relations", {"queries": [{"account": "x" * 129}]}, "at most 128 characters"),
        (
            "/relations",
            {"queries": [{"account": "A", "parts": "loop", "at": "2026-03-01T12:00:00Z"}]},
            "queries[0]: the part loop needs closing",
        ),
        (
            "/relations",
            {"queries": [{"account": "A", "parts": "loop", "closing": "B", "at": 5}]},
            "queries[0].at must be a string",
        ),
    ],
)
async def test_bad_batches_get_a_400_sentence(store_url: str, path: str, body: Any, words: str) -> None:
    app = relations_api(store_url) if path == "/relations" else aggregates_api(store_url)
    async with client_for(app) as client:
        answer = await post(client, path, body, status=400)
        assert words in answer["error"] and answer["error"].endswith(".")


# --- the store check and outages -----------------------------------------------------------------


def on_broker(store_url: str, broker: EmbeddedBroker, names: Names) -> Settings:
    """SETTINGS with the test's store, broker and payments topic."""
    kafka = replace(SETTINGS.kafka, bootstrap_servers=(broker.bootstrap,), payments_topic=names.payments)
    return replace(with_dependencies(SETTINGS, store_url=store_url), kafka=kafka)


def checked(store_url: str, broker: EmbeddedBroker, names: Names) -> Settings:
    """Settings for an API whose store check watches `names.deps[0]` as the relations group."""
    return on_broker(store_url, broker, names).with_endpoint("relations", group=names.deps[0])


@contextmanager
def relations_group(names: Names, broker: EmbeddedBroker) -> Iterator[GroupProgress]:
    """The relations group of `checked`, for a test to commit offsets as the pipeline would."""
    progress = GroupProgress({"bootstrap.servers": broker.bootstrap}, names.payments, names.deps[0])
    try:
        yield progress
    finally:
        progress.close()


async def test_a_store_behind_its_group_is_unhealthy_and_answers_nothing(
    stores: str, broker: EmbeddedBroker, names: Names
) -> None:
    """The group says offsets up to 2 of partition 0 are processed; a store that holds them is healthy,
    one that lost them (here: a group far ahead, as after a lost disk) answers 503 with what to do."""
    with relations_group(names, broker) as progress:
        progress.commit({0: 2, 1: 1})
        async with client_for(build_app("relations", checked(stores, broker, names))) as client:
            await wait_for_check(client, "ok")
            assert (await get(client, "/relations/A"))["as_of"] == {"0": 2, "1": 2}
            # A gated batch whose answers the replica keeps: asked again, it is read from the answer
            # cache, and must be refused all the same once the store is behind.
            gated = {"queries": [{"account": "A"}], "need": {"as_of": {"0": 2}, "wait_ms": 0}}
            for _ in range(2):
                response = await client.post("/relations", json=gated)
                assert response.status == 200, await response.text()
            progress.commit({0: 500})
            health = await wait_for_check(client, "behind")
            assert health["status"] == "behind"
            problem = health["store_check"]["problem"]
            assert "partition 0: group" in problem and "committed offset 500" in problem
            assert "aml-app rebuild relations" in problem
            refused = await get(client, "/relations/A", status=503)
            assert "behind its consumer group" in refused["error"]
            for body in ({"queries": [{"account": "A"}]}, gated):
                response = await client.post("/relations", json=body)
                assert response.status == 503, (body, await response.text())


async def test_an_api_refuses_a_store_at_another_schema_version_until_it_is_migrated(
    store_url: str, broker: EmbeddedBroker, names: Names
) -> None:
    """During an upgrade the API can be newer than its store (the new pipeline has not migrated it yet)
    or older: every answer, /health included, is a 503 sentence saying what to do, never a 500 from a
    missing table; the store check keeps running, and answers resume once the store is migrated."""
    schema, ours = aggregates.SCHEMA, aggregates.SCHEMA.version
    with psycopg.connect(store_url) as conn:
        migrate(conn, aggregates.Schema(schema.name, schema.migrations[: ours - 1]))
    settings = on_broker(store_url, broker, names).with_endpoint("aggregates", group=names.deps[1])
    async with client_for(build_app("aggregates", settings)) as client:
        for path in ("/health", "/aggregates/A?at=2026-03-01T12:00:00Z"):
            refused = await get(client, path, status=503)
            assert f"schema version {ours - 1} and this program reads version {ours}" in refused["error"]
            assert "migrates the store when it starts (aml-app pipeline)" in refused["error"]
        response = await client.post("/aggregates", json={"queries": [{"account": "A"}]})
        assert response.status == 503
        with psycopg.connect(store_url) as conn:
            migrate(conn, schema)
        await wait_for_check(client, "ok")
        assert (await get(client, "/aggregates/A?at=2026-03-01T12:00:00Z"))["as_of"] == {}
        with psycopg.connect(store_url) as conn:
            conn.execute("INSERT INTO aggregates.schema_version (version) VALUES (%s)", (ours + 1,))
            conn.commit()
        refused = await get(client, "/health", status=503)
        assert f"schema version {ours + 1}, newer than this program's {ours}" in refused["error"]


async def test_the_store_check_outlives_a_failure_it_does_not_expect(
    stores: str, broker: EmbeddedBroker, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    """A check that fails in a way it does not handle (here the offsets table renamed by hand: a
    missing table, not an outage) is logged and retried; the guard still sees the group run ahead once
    the table is back, instead of leaving its last verdict, "ok", standing for good."""
    with relations_group(names, broker) as progress:
        progress.commit({0: 2, 1: 1})
        async with client_for(build_app("relations", checked(stores, broker, names))) as client:
            await wait_for_check(client, "ok")
            with psycopg.connect(stores, autocommit=True) as conn:
                conn.execute("ALTER TABLE relations.applied_offsets RENAME TO applied_offsets_away")
                deadline = time.monotonic() + 30
                while "the relations store check failed" not in caplog.text:
                    assert time.monotonic() < deadline, "the store check never ran into the missing table"
                    await asyncio.sleep(0.1)
                progress.commit({0: 500})
                conn.execute("ALTER TABLE relations.applied_offsets_away RENAME TO applied_offsets")
            health = await wait_for_check(client, "behind")
            assert "committed offset 500" in health["store_check"]["problem"]


async def wait_for_check(client: TestClient, state: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        response = await client.get("/health")
        body = await response.json()
        if body.get("store_check", {}).get("state") == state:
            assert response.status == (200 if state == "ok" else 503), body
            return body
        assert time.monotonic() < deadline, f"the store check did not become {state!r}: {body}"
        await asyncio.sleep(0.2)


async def test_the_api_answers_503_while_the_database_is_away_and_recovers(
    spark: Any, own_postgres: Any
) -> None:
    """The database stopped and started under the API: no crash, a 503 sentence, then answers again."""
    url = own_postgres.url()
    apply_payments(spark, url, "relations", payments())
    async with client_for(relations_api(url)) as client:
        assert (await get(client, "/relations/A"))["as_of"] == {"0": 2, "1": 2}
        await asyncio.to_thread(own_postgres.stop)
        away = await get(client, "/relations/A", status=503)
        assert "could not be read right now" in away["error"]
        assert (await client.get("/health")).status == 503
        await asyncio.to_thread(own_postgres.start)
        deadline = time.monotonic() + 30
        while (await client.get("/relations/A")).status != 200:
            assert time.monotonic() < deadline, "the API did not recover after the database came back"
            await asyncio.sleep(0.2)
        assert (await get(client, "/relations/A"))["as_of"] == {"0": 2, "1": 2}


# --- what a batch needs: a bounded wait, "not yet", and answers that went back ---------------------


def one_more() -> PaymentRow:
    """Offset 2 of partition 0, after `payments()`."""
    return PaymentRow(0, 2, "pay-more", "A", "B", Decimal("5"), "EUR", T0)


async def test_a_batch_waits_for_what_it_needs_or_answers_not_yet(spark: Any, stores: str) -> None:
    query = {"queries": [{"account": "A", "at": "2026-03-01T12:00:00Z"}]}
    async with client_for(aggregates_api(stores)) as client:
        plain = await post(client, "/aggregates", query)
        met = await post(client, "/aggregates", {**query, "need": {"as_of": {"0": 2, "1": 2}, "wait_ms": 0}})
        assert met["answers"] == plain["answers"], "a need the store already meets changes nothing"
        started = time.monotonic()
        later = await post(client, "/aggregates", {**query, "need": {"as_of": {"0": 3}, "wait_ms": 300}})
        assert time.monotonic() - started >= 0.3
        assert later["not_yet"] is True and later["as_of"] == {"0": 2, "1": 2} and later["waited_ms"] >= 300
        assert "answers" not in later
        other_log = await post(
            client, "/aggregates", {**query, "need": {"as_of": {"0": 1}, "log": "c:other", "wait_ms": 0}}
        )
        assert other_log["not_yet"] is True, "offsets of another log prove nothing"
        for bad, words in (
            ({"as_of": {"x": 1}}, "need.as_of maps partitions"),
            ({"as_of": {"0": 1}, "wait_ms": 60_000}, "need.wait_ms must be a whole number from 0 to 10000"),
            ([1], "need must be an object"),
        ):
            body = await post(client, "/aggregates", {**query, "need": bad}, status=400)
            assert words in body["error"], body
        # Asked before the store has offset 2 of partition 0, answered once it does, within the bound.
        waiting = asyncio.ensure_future(
            post(client, "/aggregates", {**query, "need": {"as_of": {"0": 3}, "wait_ms": 10_000}})
        )
        await asyncio.to_thread(apply_payments, spark, stores, "aggregates", [one_more()])
        fresh = await asyncio.wait_for(waiting, 60)
        assert fresh["answers"][0]["as_of"] == {"0": 3, "1": 2}
        assert fresh["answers"][0]["windows"]["1h"]["sent_count"] == 3


async def test_the_client_asks_another_replica_when_one_is_behind_or_went_back(
    spark: Any, postgres: Any, stores: str
) -> None:
    """Two replicas of C over two stores, one a payment behind. A question that needs that payment goes
    on to the replica that has it; an answer below what the service showed before is the named event
    "went back", and the other replica is asked first; with no other replica, it is taken as the
    service's progress, once."""
    ahead = postgres.create_database(f"ahead_{uuid.uuid4().hex[:12]}")
    await asyncio.to_thread(apply_payments, spark, ahead, "aggregates", [*payments(), one_more()])
    at = datetime(2026, 3, 1, 12, tzinfo=UTC)
    async with (
        TestServer(aggregates_api(stores), host="127.0.0.1") as behind_server,
        TestServer(aggregates_api(ahead), host="127.0.0.1") as ahead_server,
    ):
        behind_url, ahead_url = str(behind_server.make_url("")), str(ahead_server.make_url(""))
        client = DependencyClient(ahead_url, [behind_url, ahead_url], timeout=5)
        try:
            [answer] = await client.aggregates_many([("A", at)], need=Need({0: 3}, None, 0.1))
            assert answer["as_of"] == {"0": 3, "1": 2} and client.stats.not_yet == 1
            assert client.stats.went_back == 0
            # Turns: the replica ahead first, then the one behind, which went back: the other answers.
            for went_back in (0, 1):
                [answer] = await client.aggregates_many([("A", at)], need=Need({0: 1}, None, 0.1))
                assert answer["as_of"] == {"0": 3, "1": 2} and client.stats.went_back == went_back
            # The replica ahead goes away: the one behind is all there is, and is taken as it is, once.
            # (Questions it has not answered before: a reply of answers it kept says where the newest
            # store it read was, which tells nothing of going back.)
            await ahead_server.close()
            for minutes in (1, 2):
                later = at + timedelta(minutes=minutes)
                [answer] = await client.aggregates_many([("A", later)], need=Need({0: 1}, None, 0.1))
                assert answer["as_of"] == {"0": 2, "1": 2} and client.stats.went_back == 2
            [answer] = await client.aggregates_many([("A", at)], need=Need({0: 1}, None, 0.1))
            assert answer["as_of"] == {"0": 2, "1": 2} and client.stats.went_back == 2, "kept: not counted"
        finally:
            await client.close()


@pytest.mark.parametrize("media", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
async def test_a_batch_not_sent_as_json_is_refused_as_a_browser_could_send_it(
    stores: str, media: str
) -> None:
    """A web page can make a visitor's browser POST these three without asking (no CORS preflight): such
    a body, however valid its JSON, is refused with 415 and answers nothing."""
    body = json.dumps({"queries": [{"account": "A"}]}).encode()
    async with client_for(relations_api(stores)) as r, client_for(aggregates_api(stores)) as a:
        for client, path in ((r, "/relations"), (a, "/aggregates")):
            response = await client.post(path, data=body, headers={"Content-Type": media})
            got = await response.json()
            assert response.status == 415, got
            assert got == {
                "error": "Send the batch as JSON with Content-Type: application/json (this one is "
                f"{media}); other media types are refused, so that no web page can make a browser ask."
            }
            assert (await post(client, path, {"queries": [{"account": "A"}]}))["answers"]


async def test_a_replica_bound_to_loopback_answers_only_requests_addressed_to_loopback(stores: str) -> None:
    """DNS rebinding: a page of evil.example, its name pointed at 127.0.0.1, reaches a replica bound there
    with `Host: evil.example`; that is refused (421), whatever the path. Bound to every address (a
    container), any name is served."""
    loopback = with_dependencies(SETTINGS, store_url=stores, services_host="127.0.0.1")
    async with client_for(build_app("relations", loopback, check=False)) as client:
        for host in ("evil.example", "evil.example:8081", "10.0.0.7:8081", "127.0.0.1.evil.example"):
            response = await client.get("/relations/A", headers={"Host": host})
            got = await response.json()
            assert response.status == 421, (host, got)
            assert got["error"].startswith("This server listens on a loopback address"), got
        for host in ("127.0.0.1:8081", "localhost", "[::1]:8081", "LOCALHOST:1"):
            response = await client.get("/relations/A", headers={"Host": host})
            assert response.status == 200, (host, await response.text())
    everywhere = with_dependencies(loopback, services_host="0.0.0.0")
    async with client_for(build_app("relations", everywhere, check=False)) as client:
        response = await client.get("/relations/A", headers={"Host": "relations-1:8081"})
        assert response.status == 200, await response.text()


TOKEN = "t0ken-for-the-test-" + "x" * 12


async def test_with_a_token_set_only_requests_carrying_it_are_answered(stores: str) -> None:
    """AML_API_TOKEN: a request without it or with another one is a 401 (with `WWW-Authenticate`), a load
    balancer's /health is answered anyway, and the detectors' client, given the token, gets its answers."""
    guarded = with_dependencies(SETTINGS, store_url=stores, api_token=TOKEN)
    async with client_for(build_app("relations", guarded, check=False)) as client:
        for headers, said in (({}, "none."), ({"Authorization": "Bearer nope"}, "another one.")):
            for response in (
                await client.get("/relations/A", headers=headers),
                await client.post("/relations", json={"queries": [{"account": "A"}]}, headers=headers),
                await client.get("/metrics", headers=headers),
            ):
                got = await response.json()
                assert response.status == 401, got
                assert response.headers["WWW-Authenticate"] == 'Bearer realm="aml-app"'
                assert got["error"].endswith(said) and TOKEN not in got["error"], got
        assert (await client.get("/health")).status == 200
        ok = await client.get("/relations/A", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status == 200, await ok.text()

        url = str(client.make_url("")).rstrip("/")
        with_token = DependencyClient(url, url, token=TOKEN)
        without = DependencyClient(url, url)
        try:
            answer = await with_token.relations("A")
            assert answer["account"] == "A"
            with pytest.raises(
                DependencyRequestError, match="401 This service answers only requests with its token"
            ):
                await without.relations("A")
        finally:
            await with_token.close()
            await without.close()
