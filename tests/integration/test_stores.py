"""The stores of Services B and C on a real PostgreSQL server, fed by the pipeline's own Spark transforms,
against the naive reference (aml_app/training/reference.py); idempotency (offsets stored with the results),
snapshot reads, migrations and the store's recorded definitions.

Every batch goes through `aml_app.pipeline.transforms.batch_outputs` on a real SparkSession (one for the
module) and the store write the pipeline uses, in one transaction with its offsets; only Kafka is left
out (tests/stores.py). Each test, and each generated example, gets a fresh database.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from psycopg import sql

from aml_app.dependencies import aggregates, relations
from aml_app.dependencies import store as store_module
from aml_app.dependencies.copy import copy_arrow
from aml_app.dependencies.store import (
    ANALYZE_GROWTH,
    StaleBatch,
    StoreError,
    Writer,
    migrate,
    money_text,
    read_meta,
)
from aml_app.detection.exchange import ExchangeRates
from aml_app.harness.embedded_postgres import EmbeddedPostgres
from aml_app.pipeline.transforms import batch_outputs
from aml_app.settings import Settings
from aml_app.training.reference import (
    exact_from,
    is_loop,
    reference_aggregates,
    reference_layering,
    reference_loop,
    reference_relations,
)
from aml_app.training.reference import money_text as reference_money_text
from tests.payments import PaymentRow
from tests.stores import (
    aggregates_answers,
    apply_payments,
    apply_records,
    payment_records,
    records_frame,
    relations_answers,
    with_dependencies,
    without_as_of,
)

ACCOUNTS = ["A", "B", "C", "D", "Ä"]  # few, so edges repeat and cycles occur; "Ä" sorts after "D"
CURRENCIES = ["EUR", "USD", "JPY", "NOK"]  # NOK has no AMLworld rate: unconverted
T0 = datetime(2026, 3, 1, tzinfo=UTC)
HALF_HOUR = timedelta(minutes=30)
SETTINGS = Settings()
THRESHOLD, BAND = SETTINGS.dependencies.reporting_threshold, SETTINGS.dependencies.threshold_band
MALFORMED = b'{"payment_id": "broken"'


# --- generated batches ---------------------------------------------------------------------------


@dataclass
class Batch:
    rows: list[PaymentRow]
    records: list[tuple[int, int, bytes | None, bytes | None]]


@dataclass
class Scenario:
    batches: list[Batch] = field(default_factory=list)

    @property
    def payments(self) -> list[PaymentRow]:
        return [row for batch in self.batches for row in batch.rows]

    @property
    def final_offsets(self) -> dict[int, int]:
        offsets: dict[int, int] = {}
        for batch in self.batches:
            for p, o, _k, _v in batch.records:
                offsets[p] = max(offsets.get(p, 0), o + 1)
        return offsets


amounts = st.one_of(
    st.tuples(st.integers(1, 300_000_000), st.integers(0, 4)).map(lambda t: Decimal(t[0]).scaleb(-t[1])),
    st.sampled_from(["9000", "9000.00", "10000", "8999.9999", "9999.9999", "0.0001", "0.1", "0.20"]).map(
        Decimal
    ),
)
# Coarse half-hour steps make exact window and minute boundaries between payments common; odd microseconds
# too; and a spread over ten days, so that some payments are too late and some are pruned.
timestamps = st.one_of(
    st.integers(0, 480).map(lambda k: T0 + k * HALF_HOUR),
    st.integers(0, 10 * 86400 * 10**6).map(lambda us: T0 + timedelta(microseconds=us)),
)


@st.composite
def scenarios(draw: st.DrawFn, max_records: int = 40) -> Scenario:
    partitions = draw(st.integers(2, 3))
    next_offset = {p: draw(st.sampled_from([0, 0, 7, 1000])) for p in range(partitions)}
    records = draw(
        st.lists(
            st.tuples(
                st.integers(0, partitions - 1),
                st.sampled_from(ACCOUNTS),
                st.sampled_from(ACCOUNTS),
                st.sampled_from(CURRENCIES),
                amounts,
                timestamps,
                st.integers(0, 9).map(lambda n: n > 0),  # 1 in 10 records breaks the contract
            ),
            min_size=1,
            max_size=max_records,
        )
    )
    cuts = sorted({0, len(records), *draw(st.lists(st.integers(1, len(records)), max_size=3))})
    scenario = Scenario()
    for lo, hi in itertools.pairwise(cuts):
        batch = Batch([], [])
        for partition, payer, payee, currency, amount, ts, valid in records[lo:hi]:
            offset = next_offset[partition]
            next_offset[partition] += 1
            if not valid:
                batch.records.append((partition, offset, payer.encode(), MALFORMED))
                continue
            row = PaymentRow(
                partition, offset, f"pay-{partition}-{offset}", payer, payee, amount, currency, ts
            )
            batch.rows.append(row)
            batch.records.extend(payment_records([row]))
        scenario.batches.append(batch)
    return scenario


# Each example runs Spark jobs and a database of its own: few examples, and no shrinking (a failing example
# is reported as drawn).
EXAMPLES = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)


@EXAMPLES
@given(scenario=scenarios())
def test_relations_match_the_reference(spark: Any, postgres: EmbeddedPostgres, scenario: Scenario) -> None:
    url = postgres.create_database(f"example_{uuid.uuid4().hex[:12]}")
    kept, folds = relations.LOOP_MAX_PAYEES, relations.FOLD_FROM
    try:
        # Written with a limit of two payees, so that each batch's write keeps `many_payees` for accounts
        # that pass it, or pass it earlier, in any order of their payments.
        relations.LOOP_MAX_PAYEES = 2
        # And each edge of two payments or more is folded (a day before each batch's newest payment).
        relations.FOLD_FROM = 2
        for batch in scenario.batches:
            apply_records(spark, url, "relations", batch.records)
        relations.LOOP_MAX_PAYEES, relations.FOLD_FROM = kept, folds
        with psycopg.connect(url) as conn:
            folded = relations.folded_before(read_meta(conn, relations.SCHEMA))

        def exact(q: relations.Query, answer: dict[str, Any]) -> bool:
            """Whether `answer` is to equal the reference: as of an instant the store folded edges before,
            it cannot, and says so."""
            if folded is None or q.at is None or q.at >= folded:
                assert "exact" not in answer, (q, answer)
                return True
            assert answer.pop("exact") is False, (q, answer)
            return False

        expected_as_of = {str(p): o for p, o in sorted(scenario.final_offsets.items())}
        # min_average: every edge, a threshold amid the amounts drawn, and exactly at a sampled amount.
        # And one per currency (JPY named nowhere: never heavy).
        per_currency = {"EUR": Decimal("9000"), "USD": Decimal("100")}
        for hops, heavy in (
            (1, Decimal(0)),
            (2, Decimal("9000")),
            (3, Decimal(0)),
            (3, Decimal("5000")),
            (3, per_currency),
        ):
            queries = [relations.Query(a, hops, relations.PARTS, heavy) for a in [*ACCOUNTS, "nobody"]]
            answers = run(relations_answers(url, queries))
            for account, answer in zip([*ACCOUNTS, "nobody"], answers, strict=True):
                assert answer["as_of"] == expected_as_of
                assert without_as_of(answer) == reference_relations(scenario.payments, account, hops, heavy)
            # As of an instant, every part is the answer over the payments made by then: a day in, mid-way,
            # exactly at a payment's time (it counts), and after the drawn ten days.
            instants = [T0 + timedelta(days=d) for d in (1, 5, 11)] + [p.ts for p in scenario.payments[::7]]
            cut = [
                relations.Query(a, hops, relations.PARTS, heavy, at=at) for a in ACCOUNTS for at in instants
            ]
            for q, answer in zip(cut, run(relations_answers(url, cut)), strict=True):
                if exact(q, answer):
                    expected = reference_relations(scenario.payments, q.account, hops, heavy, q.at)
                    assert without_as_of(answer) == expected, (q.account, q.at, hops, heavy)
            # Chains ending with one payer's edge (the payment being decided), every account pair, without
            # a time and at instants inside and after the drawn ten days.
            asked = [
                (a, x, at)
                for a in ACCOUNTS
                for x in ACCOUNTS
                for at in (None, T0 + timedelta(days=5), T0 + timedelta(days=11))
            ]
            chains = [relations.Query(a, hops, ["chain"], heavy, x, at) for a, x, at in asked]
            for q, answer in zip(chains, run(relations_answers(url, chains)), strict=True):
                if exact(q, answer):
                    layering = reference_layering(scenario.payments, q.account, hops, heavy, q.closing, q.at)
                    assert answer["chain"] == layering["chain"], (q, hops, heavy)
        # Loops: every (account, closing payer) pair at instants inside and after the drawn ten days, with
        # the shortest and longest limits and one between; with any account allowed in between, and with
        # those that paid at most two.
        ats = [T0 + timedelta(days=d) for d in (2, 5, 11)] + [p.ts for p in scenario.payments[:2]]
        loop_queries = [
            relations.Query(a, 1, ["loop"], Decimal(0), x, at, most)
            for a in ACCOUNTS
            for x in ACCOUNTS  # x == a too: a self-payment closes no loop
            for at in ats
            for most in (2, 3, 16)
        ]
        with psycopg.connect(url, autocommit=True) as conn:
            marked = conn.execute("SELECT * FROM relations.many_payees ORDER BY payer").fetchall()
            relations.LOOP_MAX_PAYEES = 2
            relations.count_many_payees(conn, relations.SCHEMA)
            assert conn.execute("SELECT * FROM relations.many_payees ORDER BY payer").fetchall() == marked
        try:
            for payees in (2, kept):
                relations.LOOP_MAX_PAYEES = payees
                if payees == kept:
                    with psycopg.connect(url, autocommit=True) as conn:
                        relations.count_many_payees(conn, relations.SCHEMA)
                answers = run(relations_answers(url, loop_queries))
                for q, answer in zip(loop_queries, answers, strict=True):
                    assert q.closing is not None and q.at is not None
                    if not exact(q, answer):
                        continue
                    expected = reference_loop(
                        scenario.payments,
                        q.account,
                        q.closing,
                        q.at,
                        q.loop_hops,
                        relations.LOOP_SPAN,
                        payees,
                    )
                    found = answer["loop"]
                    assert (found["found"], len(found["path"]), found["complete"]) == (
                        expected["found"],
                        len(expected["path"]),
                        True,
                    ), (q, payees)
                    if found["found"]:
                        assert found["path"][-2] == q.closing
                        assert is_loop(scenario.payments, found["path"], q.at, relations.LOOP_SPAN), q
        finally:
            relations.LOOP_MAX_PAYEES = kept
        # Any batch applied again changes nothing: the last one is recognised as done, others are refused.
        before = run(relations_answers(url, [(a, 3, relations.PARTS) for a in ACCOUNTS]))
        for batch in scenario.batches:
            again = covered_by(batch)
            if any(o > again[p][1] for p, o in scenario.final_offsets.items() if p in again):
                with pytest.raises(StaleBatch):
                    apply_records(spark, url, "relations", batch.records, covered=again)
            else:
                apply_records(spark, url, "relations", batch.records, covered=again)
        assert run(relations_answers(url, [(a, 3, relations.PARTS) for a in ACCOUNTS])) == before
    finally:
        relations.LOOP_MAX_PAYEES, relations.FOLD_FROM = kept, folds
        drop_database(postgres, url)


@EXAMPLES
@given(scenario=scenarios(), data=st.data())
def test_aggregates_match_the_reference(
    spark: Any, postgres: EmbeddedPostgres, scenario: Scenario, data: st.DataObject
) -> None:
    url = postgres.create_database(f"example_{uuid.uuid4().hex[:12]}")
    try:
        for batch in scenario.batches:
            apply_records(spark, url, "aggregates", batch.records)
        batches = [b.rows for b in scenario.batches]
        start = exact_from(batches)
        if start is None:
            return
        # Instants from where the answers must be exact, on and around payments, minutes and windows.
        stamps = [p.ts for p in scenario.payments]
        candidates = [
            start,
            *stamps,
            *(t + d for t in stamps for d in (timedelta(hours=1), timedelta(days=1))),
        ]
        wiggle = st.sampled_from([timedelta(0), timedelta(microseconds=1), -timedelta(microseconds=1)])
        instants = [
            at + data.draw(wiggle) for at in data.draw(st.lists(st.sampled_from(candidates), max_size=6))
        ]
        instants = [at for at in [start, *instants] if at >= start]
        queries = [(a, at) for at in instants for a in [*ACCOUNTS, "nobody"]]
        answers = run(aggregates_answers(url, queries, SETTINGS))
        for (account, at), answer in zip(queries, answers, strict=True):
            assert without_as_of(answer) == reference_aggregates(batches, account, at, THRESHOLD, BAND), (
                account,
                at,
            )
    finally:
        drop_database(postgres, url)


def covered_by(batch: Batch) -> dict[int, tuple[int, int]]:
    spans: dict[int, tuple[int, int]] = {}
    for p, o, _k, _v in batch.records:
        first, last = spans.get(p, (o, o))
        spans[p] = (min(first, o), max(last, o))
    return {p: (first, last + 1) for p, (first, last) in spans.items()}


def run(coroutine: Any) -> Any:
    import asyncio

    return asyncio.run(coroutine)


def drop_database(postgres: EmbeddedPostgres, url: str) -> None:
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(postgres.url("postgres"), autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(psycopg.sql.Identifier(name))
        )


# --- worked examples: relations ------------------------------------------------------------------


def row(
    payer: str,
    payee: str,
    amount: str,
    ts: datetime,
    currency: str = "EUR",
    offset: int = 0,
    partition: int = 0,
) -> PaymentRow:
    return PaymentRow(
        partition, offset, f"pay-{partition}-{offset}", payer, payee, Decimal(amount), currency, ts
    )


def rows(*specs: tuple, start: int = 0) -> list[PaymentRow]:
    return [row(*spec, offset=start + i) for i, spec in enumerate(specs)]


async def one_relation(url: str, account: str, hops: int) -> dict[str, Any]:
    return (await relations_answers(url, [(account, hops, relations.PARTS)]))[0]


async def test_out_in_totals_and_seen_times(spark: Any, store_url: str) -> None:
    t = T0 + timedelta(microseconds=123456)
    payments = rows(
        ("A", "B", "0.1", t),
        ("A", "B", "0.2", t + timedelta(hours=2)),
        ("A", "B", "5", t - timedelta(hours=1), "USD"),
        ("C", "A", "1.2345", t),
    )
    apply_payments(spark, store_url, "relations", payments)
    answer = await one_relation(store_url, "A", 1)
    assert answer["out"] == [
        {
            "counterparty": "B",
            "count": 3,
            "totals": {"EUR": "0.30", "USD": "5.00"},
            "first_seen": "2026-02-28T23:00:00.123456Z",
            "last_seen": "2026-03-01T02:00:00.123456Z",
        }
    ]
    assert answer["in"] == [
        {
            "counterparty": "C",
            "count": 1,
            "totals": {"EUR": "1.2345"},
            "first_seen": "2026-03-01T00:00:00.123456Z",
            "last_seen": "2026-03-01T00:00:00.123456Z",
        }
    ]
    assert answer["neighbourhood"] == [{"account": "B", "hops": 1}, {"account": "C", "hops": 1}]
    assert answer["as_of"] == {"0": 4}


async def test_seen_times_keep_four_digits_of_year_and_six_of_fraction(spark: Any, store_url: str) -> None:
    """The server writes the `out` and `in` lists' times: the year 1 with four digits, a whole second with
    six digits of fraction, and the first and last over two currencies by time."""
    year_1 = datetime(1, 1, 1, tzinfo=UTC)
    apply_payments(spark, store_url, "relations", rows(("A", "B", "1", year_1), ("A", "B", "1", T0, "USD")))
    answer = await one_relation(store_url, "A", 1)
    assert [(e["first_seen"], e["last_seen"]) for e in answer["out"]] == [
        ("0001-01-01T00:00:00.000000Z", "2026-03-01T00:00:00.000000Z")
    ]


async def test_an_answer_as_of_an_instant_holds_only_the_payments_made_by_then(
    spark: Any, store_url: str
) -> None:
    hour = timedelta(hours=1)
    first = rows(
        ("A", "B", "0.10", T0),
        ("A", "B", "5000", T0 + 2 * hour),
        ("B", "A", "100", T0 + 3 * hour),  # closes a cycle A -> B -> A, from then on
        ("A", "D", "4000", T0 + 2 * hour),
        ("C", "B", "5000", T0 + hour),
    )
    # A later batch adds to A -> B a payment made between the two before it: the row's payments are merged.
    second = rows(("A", "B", "0.20", T0 + hour), ("C", "D", "3000", T0 + 4 * hour), start=len(first))
    apply_payments(spark, store_url, "relations", first)
    apply_payments(spark, store_url, "relations", second)
    payments = [*first, *second]

    async def at(account: str, when: datetime | None, heavy: Decimal = Decimal(0)) -> dict[str, Any]:
        query = relations.Query(account, 3, relations.PARTS, heavy, at=when)
        return without_as_of((await relations_answers(store_url, [query]))[0])

    early = await at("A", T0 + hour)
    assert early["out"] == [
        {
            "counterparty": "B",
            "count": 2,
            "totals": {"EUR": "0.30"},
            "first_seen": "2026-03-01T00:00:00.000000Z",
            "last_seen": "2026-03-01T01:00:00.000000Z",
        }
    ]
    assert early["cycle"] == {"found": False, "path": []}
    assert (await at("A", T0 + 3 * hour))["cycle"] == {"found": True, "path": ["A", "B", "A"]}
    # Heavy edges (average >= 1000) as of then: A -> B is light until its 5000 is paid.
    assert (await at("B", T0 + hour, Decimal(1000)))["co_payees"] == []
    assert (await at("D", T0 + 4 * hour, Decimal(1000)))["co_payees"] == [{"account": "B", "shared": 2}]
    assert (await at("B", None))["out"][0]["count"] == 1
    for account in ("A", "B", "C", "D"):
        for when in (T0 - hour, T0, T0 + hour, T0 + 2 * hour, T0 + 3 * hour, T0 + 4 * hour, None):
            for heavy in (Decimal(0), Decimal(1000)):
                expected = reference_relations(payments, account, 3, heavy, when)
                assert await at(account, when, heavy) == expected, (account, when, heavy)


async def test_totals_are_exact_for_large_sums(spark: Any, store_url: str) -> None:
    big = "999999999999999.9999"
    for i in range(3):
        apply_payments(spark, store_url, "relations", [row("A", "B", big, T0, offset=i)])
    assert (await one_relation(store_url, "A", 1))["out"][0]["totals"] == {"EUR": "2999999999999999.9997"}


async def test_neighbourhood_ignores_direction_and_keeps_shortest_distance(
    spark: Any, store_url: str
) -> None:
    # A -> B -> C, D -> C, D -> A (so D is 1 hop, not 3), E -> D
    edges = [("A", "B"), ("B", "C"), ("D", "C"), ("D", "A"), ("E", "D")]
    apply_payments(spark, store_url, "relations", rows(*[(payer, payee, "1", T0) for payer, payee in edges]))
    assert (await one_relation(store_url, "A", 1))["neighbourhood"] == [
        {"account": "B", "hops": 1},
        {"account": "D", "hops": 1},
    ]
    assert (await one_relation(store_url, "A", 3))["neighbourhood"] == [
        {"account": "B", "hops": 1},
        {"account": "D", "hops": 1},
        {"account": "C", "hops": 2},
        {"account": "E", "hops": 2},
    ]


async def test_cycles(spark: Any, store_url: str) -> None:
    payments = rows(
        ("A", "C", "1", T0),
        ("C", "A", "1", T0),  # A C A
        ("A", "B", "1", T0),
        ("B", "A", "1", T0),  # A B A: same length, smaller
        ("X", "Y", "1", T0),
        ("Y", "Z", "1", T0),
        ("Z", "X", "1", T0),  # 3-cycle
        ("X", "Ä", "1", T0),
        ("Ä", "X", "1", T0, "USD"),  # X Ä X: a 2-cycle in another currency
        ("S", "S", "1", T0),  # self-payment
        ("P", "Q", "1", T0),
        ("Q", "R", "1", T0),
        ("R", "P", "1", T0),
        ("P", "Ä", "1", T0),
        ("Ä", "Ö", "1", T0),
        ("Ö", "P", "1", T0),  # two 3-cycles through P: P Q R P is the smaller path
    )
    apply_payments(spark, store_url, "relations", payments)
    cycle = {
        (a, h): (await one_relation(store_url, a, h))["cycle"]
        for a, h in [("A", 2), ("A", 1), ("X", 3), ("S", 1)]
    }
    assert cycle[("A", 2)] == {"found": True, "path": ["A", "B", "A"]}
    assert cycle[("A", 1)] == {"found": False, "path": []}
    assert cycle[("X", 3)] == {"found": True, "path": ["X", "Ä", "X"]}
    assert cycle[("S", 1)] == {"found": False, "path": []}, "a self-payment makes no cycle"
    assert (await one_relation(store_url, "P", 2))["cycle"] == {"found": False, "path": []}
    assert (await one_relation(store_url, "P", 3))["cycle"] == {"found": True, "path": ["P", "Q", "R", "P"]}
    assert (await one_relation(store_url, "Y", 3))["cycle"] == {"found": True, "path": ["Y", "Z", "X", "Y"]}
    assert (await one_relation(store_url, "S", 1))["neighbourhood"] == []
    for account in ("A", "X", "S", "P", "Ä", "nobody"):
        for hops in (1, 2, 3):
            assert without_as_of(await one_relation(store_url, account, hops)) == reference_relations(
                payments, account, hops
            )


async def test_chains_follow_the_money_in_time_and_amount(spark: Any, store_url: str) -> None:
    hour = timedelta(hours=1)
    per_currency = {"USD": Decimal("1000"), "EUR": Decimal("800")}
    payments = rows(
        ("A", "B", "1250", T0, "USD"),
        ("B", "C", "1000", T0 + hour, "USD"),  # 0.8 times what B got: flows on
        ("C", "D", "1250", T0 + 2 * hour, "USD"),  # 1.25 times: flows on
        ("F", "G", "1000", T0 + 5 * hour, "USD"),
        ("G", "H", "1000", T0 + hour, "USD"),  # G paid H before F paid G: no flow F -> G -> H
        ("K", "L", "1300", T0, "USD"),
        ("L", "M", "1039.99", T0 + hour, "USD"),  # just under 0.8 times: no flow K -> L -> M
        ("L", "N", "1300", T0 + hour, "USD"),
        ("N", "M", "1300", T0 + 2 * hour, "USD"),  # K -> L -> N -> M flows
        ("P", "Q", "800", T0, "EUR"),  # one unit (EUR's minimum)
        ("Q", "R", "1200", T0 + hour, "USD"),  # 1.2 units: flows on, though 1.5 times the EUR amount
    )
    apply_payments(spark, store_url, "relations", payments)

    async def chain(account: str, closing: str | None = None, at: datetime | None = None) -> list[str]:
        query = relations.Query(account, 3, ["chain"], per_currency, closing, at)
        return (await relations_answers(store_url, [query]))[0]["chain"]

    assert await chain("D") == ["A", "B", "C", "D"]
    assert await chain("D", "C") == ["A", "B", "C", "D"]
    assert await chain("D", "B") == [], "the last edge must be the closing payer's"
    assert await chain("H") == ["G", "H"]
    assert await chain("M") == ["K", "L", "N", "M"]
    assert await chain("M", "L") == ["L", "M"]
    assert await chain("R") == ["P", "Q", "R"]
    # At the time of C's payment to D: every edge paid within the span before it.
    assert await chain("D", "C", T0 + 2 * hour) == ["A", "B", "C", "D"]
    # B paid C more than the span before: no flow through it then.
    late = T0 + hour + relations.LOOP_SPAN + timedelta(microseconds=1)
    assert await chain("D", "C", late) == ["C", "D"]
    assert await chain("D", "C", T0 + hour) == [], "C first paid D after that instant"
    for account in "DHMR":  # the reference agrees
        for closing in (None, *"ABCGLNQ"):
            for at in (None, T0 + 2 * hour, late):
                expected = reference_layering(payments, account, 3, per_currency, closing, at)["chain"]
                assert await chain(account, closing, at) == expected, (account, closing, at)


async def test_loops_go_forward_in_time_within_the_span_past_few_payees_up_to_the_frontier_cap(
    spark: Any, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    day = timedelta(days=1)
    payments = rows(
        ("A", "B", "1", T0),
        ("B", "C", "1", T0 + day),
        ("C", "D", "1", T0 + 2 * day),  # A B C D: in time order
        ("C", "X", "1", T0 - day),  # C X before A paid B: money cannot have gone A B C X
        ("B", "X", "1", T0 + 3 * day, "USD"),
        ("B", "X", "1", T0 - 2 * day),  # B X in two currencies, one of them in time
        ("D", "E", "1", T0 + 20 * day),  # long after: outside the span of a loop closed at day 3
        ("A", "A", "1", T0),  # a self-payment is part of no loop
        ("G", "H", "1", T0),
        ("H", "G", "1", T0 + day),
        *[("A", f"F{i:02d}", "1", T0) for i in range(12)],  # a wide first level for the cap
    )
    apply_payments(spark, store_url, "relations", payments)

    async def loop(account: str, closing: str, at: datetime, most: int = 12) -> dict[str, Any]:
        query = relations.Query(account, 1, ["loop"], Decimal(0), closing, at, most)
        return (await relations_answers(store_url, [query]))[0]["loop"]

    at = T0 + 3 * day
    assert await loop("A", "D", at) == {"found": True, "path": ["A", "B", "C", "D", "A"], "complete": True}
    assert (await loop("A", "D", at, most=3))["found"] is False  # 4 payments around
    assert (await loop("A", "D", T0 + 36 * timedelta(hours=1)))["found"] is False  # C D not paid yet
    assert await loop("A", "X", at) == {"found": True, "path": ["A", "B", "X", "A"], "complete": True}
    assert (await loop("A", "E", T0 + 21 * day))["found"] is False  # A B paid 21 days before: past the span
    assert (await loop("B", "E", T0 + 21 * day))["found"] is False
    assert (await loop("D", "E", T0 + 21 * day))["found"] is True
    assert (await loop("A", "A", at))["found"] is False
    # G paid H and H paid G: H paying G closes G H G; G paying itself closes nothing.
    assert await loop("G", "H", at) == {"found": True, "path": ["G", "H", "G"], "complete": True}
    assert await loop("G", "G", at) == {"found": False, "path": [], "complete": True}
    assert is_loop(payments, ["A", "B", "C", "D", "A"], at, relations.LOOP_SPAN)
    assert not is_loop(payments, ["A", "B", "C", "X", "A"], at, relations.LOOP_SPAN)

    def count_payees_up_to(limit: int) -> None:
        monkeypatch.setattr(relations, "LOOP_MAX_PAYEES", limit)
        with psycopg.connect(store_url, autocommit=True) as conn:
            relations.count_many_payees(conn, relations.SCHEMA)

    count_payees_up_to(1)  # B paid C and X: no way through B
    assert (await loop("A", "D", at))["found"] is False and (await loop("A", "X", at))["found"] is False
    assert (await loop("D", "E", T0 + 21 * day))["found"] is True  # no account in between
    count_payees_up_to(2)
    monkeypatch.setattr(relations, "LOOP_FRONTIER", 10)
    assert await loop("A", "D", at) == {"found": False, "path": [], "complete": False}


def many_payees(url: str) -> list[tuple[str, datetime]]:
    with psycopg.connect(url) as conn:
        return [(a, t) for a, t in conn.execute("SELECT * FROM relations.many_payees ORDER BY payer")]


@pytest.mark.parametrize("retention", [timedelta(hours=2), None])
async def test_a_pair_that_pays_every_ten_minutes_keeps_its_row_to_the_retention_and_answers_exactly(
    spark: Any, store_url: str, retention: timedelta | None
) -> None:
    """An edge lists only the payments made from the instant the store folded it at (and the latest
    before it), so a pair that pays all day keeps a bounded row; answers as of any instant from there on
    equal the reference, and answers as of an earlier one say they are not exact. With a retention
    longer than the history (None) nothing is folded and every instant is exact."""
    keep = retention or timedelta(days=3650)
    settings = with_dependencies(SETTINGS, aggregates_retention=keep.total_seconds())
    # In batches of 25, in time order but for the pair's fifth 25, which come after the sixth.
    order = [*range(100), *range(125, 150), *range(100, 125)]
    paid = rows(
        *[("A", "B", f"{100 + k}.{k % 100:02d}", T0 + k * timedelta(minutes=10)) for k in order],
        *[("B", "C", "7", T0 + k * timedelta(hours=6)) for k in range(4)],
    )
    for i in range(0, len(paid), 25):
        apply_payments(spark, store_url, "relations", paid[i : i + 25], settings=settings)
    with psycopg.connect(store_url) as conn:
        listed = conn.execute(
            "SELECT cardinality(times) FROM relations.edges WHERE payer = 'A' AND payee = 'B'"
        ).fetchone()[0]
        folded = relations.folded_before(read_meta(conn, relations.SCHEMA))
    newest = T0 + 149 * timedelta(minutes=10)
    if retention is None:
        assert (listed, folded) == (150, None)
    else:
        # Folded at the last on-time batch, 2 h before its newest payment; a row is folded once it lists
        # FOLD_FROM payments and a quarter of them can go, so it lists fewer than that of the 150.
        assert folded == newest - retention
        assert listed < relations.FOLD_FROM, listed
    instants = [T0 + timedelta(hours=h, minutes=m) for h in range(0, 26, 3) for m in (0, 5)]
    instants += [folded or newest, newest - timedelta(minutes=5), newest, newest + timedelta(days=1)]
    queries = [relations.Query(a, 2, relations.PARTS, at=at) for a in ("A", "B") for at in instants]
    for q, answer in zip(queries, await relations_answers(store_url, queries), strict=True):
        if folded is not None and q.at is not None and q.at < folded:
            assert answer.pop("exact") is False, q
            continue
        assert "exact" not in answer, q
        assert without_as_of(answer) == reference_relations(paid, q.account, 2, Decimal(0), q.at), q


def test_each_write_keeps_when_an_account_passed_the_payees_a_loop_goes_through(
    spark: Any, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`many_payees` holds, for each account that paid more than LOOP_MAX_PAYEES distinct others, the
    first payment to the payee that took it past: a new payee before that moves it earlier, and so does
    an earlier payment to a payee it had; a self-payment, another currency or a later payee does not."""
    monkeypatch.setattr(relations, "LOOP_MAX_PAYEES", 2)
    minute = timedelta(minutes=1)
    batches = [
        (("P", "Q1", "1", T0 + 10 * minute), ("P", "Q2", "1", T0 + 20 * minute), ("P", "P", "1", T0)),
        (("P", "Q3", "1", T0 + 30 * minute), ("R", "Q1", "1", T0), ("R", "Q2", "1", T0)),
        (("P", "Q4", "1", T0 + 5 * minute), ("P", "Q5", "1", T0 + 40 * minute)),
        (("P", "Q2", "1", T0 + 2 * minute, "USD"), ("R", "Q1", "1", T0 - minute, "USD")),
    ]
    expected = [
        [],  # P paid two others: at the limit, not past it
        [("P", T0 + 30 * minute)],
        [("P", T0 + 20 * minute)],  # Q4 at 5 minutes: P's third payee is Q2
        [("P", T0 + 10 * minute)],  # Q2 first paid at 2 minutes, in USD: its third is Q1
    ]
    start = 0
    for batch, marked in zip(batches, expected, strict=True):
        apply_payments(spark, store_url, "relations", rows(*batch, start=start))
        start += len(batch)
        assert many_payees(store_url) == marked
    with psycopg.connect(store_url, autocommit=True) as conn:
        relations.count_many_payees(conn, relations.SCHEMA)
    assert many_payees(store_url) == expected[-1]


def test_a_version_5_relations_store_migrates_to_many_payees(store_url: str) -> None:
    """Version 6 counts the accounts of many payees in a store written before it."""
    version_5 = relations.Schema("relations", relations.SCHEMA.migrations[:5])
    wide = relations.LOOP_MAX_PAYEES + 1
    with psycopg.connect(store_url) as conn:
        migrate(conn, version_5)
        for payer, payees in (("P", wide), ("F", wide - 1)):
            conn.execute(
                "INSERT INTO relations.edges SELECT %s, 'Q' || i, 'EUR', 1, 1,"
                " %s + i * interval '1 minute', %s + i * interval '1 minute'"
                " FROM generate_series(1, %s) AS i",
                (payer, T0, T0, payees),
            )
        conn.execute("INSERT INTO relations.edges VALUES ('F', 'F', 'EUR', 1, 1, %s, %s)", (T0, T0))
        conn.commit()
        assert migrate(conn, relations.SCHEMA) == 5
    assert many_payees(store_url) == [("P", T0 + wide * timedelta(minutes=1))]


async def test_unknown_account_and_a_store_without_tables(spark: Any, store_url: str) -> None:
    empty = {"out": [], "in": [], "neighbourhood": [], "cycle": {"found": False, "path": []}}
    empty |= {"chain": [], "sources": [], "co_payees": []}
    assert await one_relation(store_url, "A", 2) == {
        "account": "A",
        "hops": 2,
        "as_of": {},
        "log": None,
        **empty,
    }
    with psycopg.connect(store_url) as conn:
        assert conn.execute("SELECT to_regnamespace('relations')").fetchone() == (None,), (
            "reading made tables"
        )
    apply_records(spark, store_url, "relations", [(3, 5, b"A", MALFORMED)])
    assert await one_relation(store_url, "nobody", 3) == {
        "account": "nobody",
        "hops": 3,
        "as_of": {"3": 6},
        "log": None,
        **empty,
    }
    with pytest.raises(ValueError):
        await relations_answers(store_url, [("A", 4, relations.PARTS)])


# --- worked examples: aggregates -----------------------------------------------------------------


async def one_aggregate(url: str, account: str, at: datetime) -> dict[str, Any]:
    return (await aggregates_answers(url, [(account, at)], SETTINGS))[0]


async def test_window_edges_inside_and_across_minutes(spark: Any, store_url: str) -> None:
    """(at - w, at]: a payment exactly at `at` counts, one exactly w before does not; bucket-served
    minutes and partial minutes add up to the same."""
    at = T0 + timedelta(days=3, seconds=30, microseconds=7)
    specs = [
        ("A", "B", "1", at),
        ("A", "B", "2", at - timedelta(hours=1)),  # excluded from 1h
        ("A", "C", "4", at - timedelta(hours=1) + timedelta(microseconds=1)),
        ("A", "B", "8", at - timedelta(minutes=30)),  # a whole minute inside 1h: from a bucket
        ("D", "A", "16", at - timedelta(hours=24)),  # excluded from 24h
        ("D", "A", "32", at - timedelta(days=7) + timedelta(microseconds=1)),
        ("A", "B", "64", at + timedelta(microseconds=1)),  # after at
    ]
    payments = rows(*specs)
    apply_payments(spark, store_url, "aggregates", payments)
    answer = await one_aggregate(store_url, "A", at)
    assert answer["windows"]["1h"]["sent"] == {"EUR": "13.00"}
    assert answer["windows"]["1h"]["sent_counterparties"] == 2
    assert answer["windows"]["24h"]["sent_count"] == 4
    assert answer["windows"]["7d"]["received"] == {"EUR": "48.00"}
    assert answer["windows"]["7d"]["counterparties"] == 3
    for when in [
        at,
        at - timedelta(minutes=1),
        at + timedelta(seconds=30),
        at - timedelta(hours=1, seconds=30),
    ]:
        for account in ("A", "B", "C", "D"):
            expected = reference_aggregates([payments], account, when, THRESHOLD, BAND)
            assert without_as_of(await one_aggregate(store_url, account, when)) == expected


async def test_payments_in_the_first_week_of_year_one_are_stored_and_answered(
    spark: Any, store_url: str
) -> None:
    """The contract's first week: the store's horizon and pruning stop at the first instant there is
    instead of overflowing, which would fail every write of the batch (and stop the query)."""
    year_1 = datetime(1, 1, 1, tzinfo=UTC)
    first = rows(("A", "B", "1", year_1), ("B", "A", "2", year_1 + timedelta(days=1)))
    apply_payments(spark, store_url, "aggregates", first)
    apply_payments(spark, store_url, "aggregates", rows(("A", "C", "4", year_1 + timedelta(days=2)), start=2))
    answer = await one_aggregate(store_url, "A", year_1 + timedelta(days=3))
    assert answer["windows"]["7d"]["sent"] == {"EUR": "5.00"}
    assert answer["windows"]["7d"]["received"] == {"EUR": "2.00"}
    assert answer["late_dropped"] == 0


async def test_a_self_payment_is_neither_sent_nor_received(spark: Any, store_url: str) -> None:
    """AMLworld's "reinvestments": most real accounts pay themselves, and counted both ways such a
    payment looked like money passing through (a pass-through on 35 % of real benign payments)."""
    at = T0 + timedelta(hours=2)
    near = str(THRESHOLD * (1 - BAND))
    payments = rows(
        ("A", "A", "5000", at - timedelta(minutes=5)),
        ("A", "A", near, at - timedelta(minutes=4)),  # near the threshold, to itself: not structuring
        ("A", "B", "7", at - timedelta(minutes=3)),
        ("C", "A", "9", at - timedelta(minutes=2)),
    )
    apply_payments(spark, store_url, "aggregates", payments)
    answer = await one_aggregate(store_url, "A", at)
    for window in ("1h", "24h", "7d"):
        counted = answer["windows"][window]
        assert (counted["sent_count"], counted["sent"]) == (1, {"EUR": "7.00"}), window
        assert (counted["received_count"], counted["received"]) == (1, {"EUR": "9.00"}), window
        assert (counted["counterparties"], counted["sent_counterparties"]) == (2, 1), window
    assert answer["near_threshold_24h"] == 0
    for account in ("A", "B", "C"):
        assert without_as_of(await one_aggregate(store_url, account, at)) == reference_aggregates(
            [payments], account, at, THRESHOLD, BAND
        )


async def test_each_window_counts_its_partial_first_minute_once(spark: Any, store_url: str) -> None:
    """The windows nest, and one pass over the flows serves all three: a payment in a window's partial
    first minute is read for that window alone, and counted by the wider windows through its minute's
    flow row, never twice."""
    at = T0 + timedelta(days=3, seconds=30, microseconds=7)
    head = timedelta(seconds=10)  # 10 s after at - w: inside the minute that (at - w, at] cuts in two
    payments = rows(
        ("A", "B", "1", at - timedelta(hours=1) + head),
        ("A", "C", "2", at - timedelta(hours=24) + head),
        ("A", "G", "4", at - timedelta(days=7) + head),
        ("D", "A", "8", at - timedelta(hours=1) + head),
        ("E", "A", "16", at - timedelta(hours=24) + head),
        ("F", "A", "32", at - timedelta(days=7) + head),
    )
    apply_payments(spark, store_url, "aggregates", payments)
    windows = (await one_aggregate(store_url, "A", at))["windows"]
    assert [windows[w]["sent"] for w in ("1h", "24h", "7d")] == [
        {"EUR": "1.00"},
        {"EUR": "3.00"},
        {"EUR": "7.00"},
    ]
    assert [windows[w]["received"]["EUR"] for w in ("1h", "24h", "7d")] == ["8.00", "24.00", "56.00"]
    assert [windows[w]["received_count"] for w in ("1h", "24h", "7d")] == [1, 2, 3]
    assert [windows[w]["counterparties"] for w in ("1h", "24h", "7d")] == [2, 4, 6]
    for when in [at, at + head, at + timedelta(minutes=1)]:
        for account in ("A", "B", "E", "F"):
            expected = reference_aggregates([payments], account, when, THRESHOLD, BAND)
            assert without_as_of(await one_aggregate(store_url, account, when)) == expected


async def test_questions_about_one_account_in_one_call_are_each_answered_exactly(
    spark: Any, store_url: str
) -> None:
    """A batch asks about a busy account many times: what its questions share is counted once for all of
    them, and each answer still equals its own computation over every payment, wherever its instant falls
    against the others and their windows' edges."""
    at = T0 + timedelta(days=8, seconds=30, microseconds=7)
    near = str(THRESHOLD * (1 - BAND))
    specs: list[tuple] = []
    for i in range(240):  # 40 payers of a merchant over 8 days, some twice in a minute, one currency aside
        when = at - timedelta(days=8) + timedelta(minutes=47 * i, seconds=i % 7)
        payer = f"P{i % 40}"
        specs.append((payer, "M", near if i % 11 == 0 else str(i + 1), when, "USD" if i % 13 == 0 else "EUR"))
        if i % 5 == 0:
            specs.append((payer, "M", "3", when + timedelta(seconds=20)))
        if i % 9 == 0:  # the merchant pays some of them back
            specs.append(("M", payer, "2", when + timedelta(seconds=5)))
    for w in (timedelta(hours=1), timedelta(hours=24), timedelta(days=7)):  # at the edges of `at`'s windows
        specs += [("E", "M", "5", at - w), ("E", "M", "6", at - w + timedelta(microseconds=1))]
    for w in (timedelta(0), timedelta(hours=1), timedelta(hours=24), timedelta(days=7)):
        # Between the edges of the first call's questions, where each of them counts another way.
        specs += [("B", "M", "7", at - w - timedelta(seconds=s)) for s in (1, 30, 58)]
        specs += [
            ("M", "B", "9", at - w - timedelta(seconds=20)),
            ("M", "P1", "4", at - w - timedelta(seconds=3)),
        ]
    for ago in (timedelta(hours=2), timedelta(seconds=10)):  # counterparties of both kinds of rows
        specs += [("P2", "M", "8", at - ago), ("M", "P2", "3", at - ago - timedelta(hours=1))]
    payments = rows(*specs)
    apply_payments(spark, store_url, "aggregates", payments)
    calls = [
        [at, *(at - timedelta(seconds=s) for s in (1, 2, 9, 31, 59))],  # a batch's instants, seconds apart
        [p.ts + d for p in payments[200:205] for d in (timedelta(0), timedelta(microseconds=-1))],
        [
            at,
            at + timedelta(hours=1),  # its 1 h edge is `at`
            at + timedelta(minutes=1),
            at - timedelta(hours=1),
            at - timedelta(days=1, microseconds=-1),
            at - timedelta(days=3),
        ],
    ]
    for instants in calls:
        queries = [(account, when) for when in instants for account in ("M", "P0", "P1", "B", "E")]
        answers = await aggregates_answers(store_url, queries, SETTINGS)
        for (account, when), answer in zip(queries, answers, strict=True):
            expected = reference_aggregates([payments], account, when, THRESHOLD, BAND)
            assert without_as_of(answer) == expected, (account, when)


async def test_a_minute_filled_by_several_batches_is_cut_exactly_at_a_windows_edge(
    spark: Any, store_url: str
) -> None:
    """A flow row gathers its minute's payments from every batch (its times and amounts grow with its
    counts); a window that cuts the minute in two, at its end (`at`) or its start (`at - w`), counts
    exactly the payments on its side of the cut, whichever batch brought them."""
    minute = T0 + timedelta(days=2, minutes=5)
    first = rows(
        ("A", "B", "1", minute + timedelta(seconds=10)), ("A", "B", "2", minute + timedelta(seconds=40))
    )
    second = rows(
        ("A", "B", "4", minute + timedelta(seconds=20)),
        ("A", "B", "8", minute + timedelta(seconds=50), "USD"),
        ("A", "B", "16", minute + timedelta(seconds=50)),
        start=2,
    )
    apply_payments(spark, store_url, "aggregates", first)
    apply_payments(spark, store_url, "aggregates", second)
    with psycopg.connect(store_url) as conn:
        stored = conn.execute(
            "SELECT currency, payments, total, cardinality(times), cardinality(amounts)"
            " FROM aggregates.flows ORDER BY currency"
        ).fetchall()
        # A row of one payment lists none (it is its first_ts and total); one of several must list them.
        with pytest.raises(psycopg.errors.CheckViolation, match="flows_payments_listed"):
            conn.execute(
                "INSERT INTO aggregates.flows SELECT payer, bucket, payee, 'GBP', 2, total, near, NULL, NULL,"
                " first_ts, last_ts FROM aggregates.flows WHERE currency = 'USD'"
            )
    assert stored == [("EUR", 4, Decimal("23"), 4, 4), ("USD", 1, Decimal("8"), None, None)]
    cut = minute + timedelta(seconds=20)
    assert (await one_aggregate(store_url, "A", cut))["windows"]["1h"]["sent"] == {"EUR": "5.00"}
    after_cut = (await one_aggregate(store_url, "A", cut + timedelta(hours=1)))["windows"]
    assert after_cut["1h"]["sent"] == {"EUR": "18.00", "USD": "8.00"}  # (cut, ...]: 16 + 2, and 8
    assert after_cut["24h"]["sent"] == {"EUR": "23.00", "USD": "8.00"}
    for seconds in (0, 10, 15, 20, 45, 50, 59):
        for span in (timedelta(0), timedelta(hours=1), timedelta(hours=24), timedelta(days=7)):
            when = minute + timedelta(seconds=seconds) + span
            for account in ("A", "B"):
                expected = reference_aggregates([first, second], account, when, THRESHOLD, BAND)
                assert without_as_of(await one_aggregate(store_url, account, when)) == expected, (
                    account,
                    when,
                )


async def test_threshold_band_edges(spark: Any, store_url: str) -> None:
    t = T0 + timedelta(days=1)
    amounts = ["8999.9999", "9000", "9000.0001", "9999.9999", "10000", "10000.01"]
    payments = rows(*[("A", "B", a, t - timedelta(minutes=i)) for i, a in enumerate(amounts)])
    apply_payments(spark, store_url, "aggregates", payments)
    answer = await one_aggregate(store_url, "A", t)
    assert answer["near_threshold_24h"] == 3  # 9000, 9000.0001, 9999.9999
    assert answer["reporting_threshold"] == "10000" and answer["threshold_band"] == "0.1"
    assert (await one_aggregate(store_url, "B", t))["near_threshold_24h"] == 0, "only payments sent count"


async def test_too_late_across_batches_and_inside_one(spark: Any, store_url: str) -> None:
    newest = T0 + timedelta(days=9, seconds=45)
    minute_start = (newest - timedelta(days=7)).replace(second=0, microsecond=0)
    first = rows(("A", "B", "1", newest))
    second = rows(
        ("A", "B", "2", minute_start),  # its minute starts at the cutoff: on time
        ("A", "B", "4", minute_start - timedelta(microseconds=1)),  # the minute before: too late
        start=1,
    )
    third = rows(  # inside one batch the order does not matter: the batch's own newest payment counts
        ("A", "C", "8", newest + timedelta(days=1) - timedelta(days=7, minutes=2)),
        ("A", "C", "16", newest + timedelta(days=1)),
        start=3,
    )
    for batch in (first, second, third):
        apply_payments(spark, store_url, "aggregates", batch)
    answer = await one_aggregate(store_url, "A", newest + timedelta(days=1))
    assert answer["late_dropped"] == 2
    batches = [first, second, third]
    assert without_as_of(answer) == reference_aggregates(
        batches, "A", newest + timedelta(days=1), THRESHOLD, BAND
    )


async def test_pruning_keeps_answers_exact_from_the_newest_minus_one_hour(spark: Any, store_url: str) -> None:
    old = rows(*[("A", "B", "1", T0 + timedelta(hours=h)) for h in range(0, 48, 6)])
    new = rows(("A", "B", "2", T0 + timedelta(days=8, hours=3)), start=len(old))
    an_hour = with_dependencies(SETTINGS, aggregates_retention=3600)
    apply_payments(spark, store_url, "aggregates", old, settings=an_hour)
    apply_payments(spark, store_url, "aggregates", new, settings=an_hour)
    with psycopg.connect(store_url) as conn:
        kept = conn.execute("SELECT sum(payments) FROM aggregates.flows").fetchone()[0]
    assert kept < len(old) + 1, "old payments were pruned"
    start = exact_from([old, new])
    assert start is not None
    for when in [start, start + timedelta(minutes=30), start + timedelta(hours=2)]:
        expected = reference_aggregates([old, new], "A", when, THRESHOLD, BAND)
        assert without_as_of(await one_aggregate(store_url, "A", when)) == expected
    # Two minutes further back, the week reaches before what was pruned: the answer says so.
    assert (await one_aggregate(store_url, "A", start - timedelta(minutes=2)))["exact"] is False


@pytest.mark.parametrize("retention", [timedelta(hours=1), timedelta(days=3)])
async def test_an_answer_as_of_an_instant_behind_the_newest_is_exact_within_the_retention(
    spark: Any, store_url: str, retention: timedelta
) -> None:
    """C answers as of an instant up to AML_AGGREGATES_RETENTION behind its newest event time as it did
    when it had just applied that instant (a partition of C lagging, a replay); further back, `exact`
    says it cannot."""
    settings = with_dependencies(SETTINGS, aggregates_retention=retention.total_seconds())
    paid = rows(*[("A", "B", "1", T0 + timedelta(hours=h)) for h in range(0, 24 * 10, 5)])
    when = T0 + timedelta(days=7, hours=12)  # its week reaches back to T0 + 12 h
    made_by_then = [p for p in paid if p.ts <= when]
    apply_payments(spark, store_url, "aggregates", made_by_then, settings=settings)
    timely = await one_aggregate(store_url, "A", when)
    apply_payments(spark, store_url, "aggregates", paid[len(made_by_then) :], settings=settings)
    # The store has gone on to T0 + 10 d - 5 h: 2 d 7 h past `when`.
    later = await one_aggregate(store_url, "A", when)
    assert timely["exact"] is True
    if retention > timedelta(days=2, hours=7):
        assert without_as_of(later) == without_as_of(timely)
    else:
        assert later["exact"] is False
        assert later["windows"]["7d"]["sent_count"] < timely["windows"]["7d"]["sent_count"]


async def test_a_store_counted_with_other_thresholds_is_refused(spark: Any, store_url: str) -> None:
    apply_payments(spark, store_url, "aggregates", rows(("A", "B", "9500", T0)))
    other = with_dependencies(Settings(), reporting_threshold=Decimal("5000"))
    with pytest.raises(StoreError, match="AML_REPORTING_THRESHOLD=10000"):
        apply_payments(spark, store_url, "aggregates", rows(("A", "B", "1", T0), start=1), settings=other)
    # The API reports the store's definition, whatever its own settings say.
    answer = (await aggregates_answers(store_url, [("A", T0)], other))[0]
    assert answer["reporting_threshold"] == "10000" and answer["near_threshold_24h"] == 1


# --- idempotency, atomicity, snapshots -----------------------------------------------------------


async def snapshot(url: str) -> list[dict[str, Any]]:
    return await relations_answers(url, [(a, 3, relations.PARTS) for a in ("A", "B", "C")])


async def test_same_batch_twice_is_refused_and_gaps_too(spark: Any, store_url: str) -> None:
    records = payment_records(rows(("A", "B", "1", T0), ("B", "C", "2", T0)))
    apply_records(spark, store_url, "relations", records, covered={0: (0, 2), 1: (40, 41)})
    before = await snapshot(store_url)
    with pytest.raises(StaleBatch, match=r"partition 0: offsets 1\.\.2 are already applied up to 1"):
        apply_records(spark, store_url, "relations", records, covered={0: (1, 3)})
    with pytest.raises(StaleBatch, match="starts at 5 but the store holds only up to 1"):
        apply_records(spark, store_url, "relations", records, covered={0: (5, 7)})
    # One stale partition spoils the whole batch, including its fresh partitions.
    with pytest.raises(StaleBatch):
        apply_records(spark, store_url, "relations", records, covered={0: (2, 4), 1: (39, 42)})
    assert await snapshot(store_url) == before
    writer = Writer(store_url, relations.SCHEMA)
    assert writer.applied_offsets() == {0: 2, 1: 41}
    writer.close()


async def test_a_batch_applied_before_a_lost_commit_is_recognised(spark: Any, store_url: str) -> None:
    """The retry after a connection lost during COMMIT finds the batch's ends stored: done, not stale."""
    records = payment_records(rows(("A", "B", "1", T0), ("A", "B", "2", T0)))
    apply_records(spark, store_url, "relations", records)
    before = await snapshot(store_url)
    apply_records(spark, store_url, "relations", records, covered={0: (0, 2)})
    assert await snapshot(store_url) == before


async def test_a_failure_midway_leaves_nothing_half_applied(spark: Any, store_url: str) -> None:
    apply_payments(spark, store_url, "relations", rows(("A", "B", "1", T0)))
    before = await snapshot(store_url)
    writer = Writer(store_url, relations.SCHEMA)

    def write_then_fail(conn: psycopg.Connection) -> None:
        conn.execute("UPDATE relations.edges SET payments = payments + 100, total = total + 100")
        raise RuntimeError("the batch broke after its first statement")

    with pytest.raises(RuntimeError, match="broke"):
        writer.apply({0: (1, 5)}, write_then_fail)
    assert await snapshot(store_url) == before
    assert writer.applied_offsets() == {0: 1}
    writer.close()


async def test_readers_see_one_snapshot_while_a_writer_is_mid_transaction(spark: Any, store_url: str) -> None:
    apply_payments(spark, store_url, "relations", rows(("A", "B", "1", T0)))
    with psycopg.connect(store_url) as other:  # a second writer holds its transaction open
        other.execute("UPDATE relations.applied_offsets SET next_offset = 99")
        other.execute("UPDATE relations.edges SET payments = 50")
        answer = await one_relation(store_url, "A", 1)  # must neither block nor see uncommitted data
        assert answer["as_of"] == {"0": 1} and answer["out"][0]["count"] == 1
        other.rollback()


def test_migrations_are_versioned_idempotent_and_refuse_a_newer_store(store_url: str) -> None:
    with psycopg.connect(store_url) as conn:
        assert migrate(conn, relations.SCHEMA) == 0
        assert migrate(conn, relations.SCHEMA) == relations.SCHEMA.version
        versions = conn.execute("SELECT version FROM relations.schema_version ORDER BY version").fetchall()
        assert versions == [(v,) for v in range(1, relations.SCHEMA.version + 1)]
        conn.execute("INSERT INTO relations.schema_version VALUES (%s)", (relations.SCHEMA.version + 1,))
        conn.commit()
        with pytest.raises(StoreError, match="newer than this program"):
            migrate(conn, relations.SCHEMA)


async def test_a_version_2_relations_store_migrates_to_one_index_by_payee(spark: Any, store_url: str) -> None:
    """Version 3 of B's store keeps one index by payee (by average payment, carrying the payer) instead of
    two (and version 5 adds one by payee and last payment): a store written at version 2 migrates in
    place, answers every part as the reference, heavy parts included, and takes new batches."""
    payments = rows(
        ("A", "B", "9500", T0),
        ("B", "C", "9800", T0),
        ("C", "A", "12", T0),  # a light edge closes the cycle
        ("D", "B", "9700", T0),
        ("D", "C", "9900", T0, "USD"),
        ("A", "A", "3", T0),
    )
    version_2 = relations.Schema("relations", relations.SCHEMA.migrations[:2])
    outputs = batch_outputs(
        records_frame(spark, payment_records(payments)),
        "relations",
        SETTINGS.kafka.max_payment_bytes,
        THRESHOLD,
        BAND,
    )
    writer = Writer(store_url, version_2)
    try:
        writer.migrate()
        writer.apply(
            outputs.covered(writer.applied_offsets()),
            # As version 2 wrote them: one row per edge, without its payments (each key is paid once here).
            lambda conn: copy_arrow(
                conn, "relations.edges", outputs.tables["edges"], relations.EDGE_COLUMNS[:7]
            ),
        )
    finally:
        writer.close()
    with psycopg.connect(store_url) as conn:
        assert migrate(conn, relations.SCHEMA) == 2  # the version it found
        indexes = conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes"
            " WHERE schemaname = 'relations' AND tablename = 'edges' ORDER BY indexname"
        ).fetchall()
    assert [name for name, _ in indexes] == ["edges_by_payee", "edges_by_payee_last", "edges_pkey"]
    assert "(payee, ((total / (payments)::numeric))) INCLUDE (payer)" in indexes[0][1]
    assert "(payee, last_seen) WHERE (times IS NOT NULL)" in indexes[1][1]  # version 5
    later = rows(("C", "D", "9600", T0), ("B", "A", "1", T0), start=len(payments))
    for batch in ([], later):
        if batch:
            apply_payments(spark, store_url, "relations", batch)
        for heavy in (Decimal(0), Decimal("9000")):
            accounts = ["A", "B", "C", "D", "nobody"]
            queries = [relations.Query(a, 3, relations.PARTS, heavy) for a in accounts]
            for account, answer in zip(accounts, await relations_answers(store_url, queries), strict=True):
                expected = reference_relations([*payments, *batch], account, 3, heavy)
                assert without_as_of(answer) == expected, (account, heavy, len(batch))


async def test_a_version_1_store_migrates_to_flows_with_the_same_answers(spark: Any, store_url: str) -> None:
    """Schema version 2 of C's store keeps one row per payment's (payer, minute, payee, currency) instead of
    one per side, version 3 keeps the payments in those rows instead of a table of their own, and version 4
    lists none in a new row of one payment: a store written by version 1 (bucket rows for both sides and
    every payment, as its pipeline wrote them) migrates in place through all three and answers exactly as
    before, then takes new batches."""
    at = T0 + timedelta(days=1, seconds=30)
    payments = rows(
        ("A", "B", "9500", at - timedelta(minutes=30)),  # near the threshold, in a whole minute
        ("A", "B", "1", at - timedelta(minutes=30, seconds=1)),  # the same minute and pair: one row
        ("B", "A", "2", at - timedelta(hours=2), "USD"),
        ("C", "A", "4", at),  # in the partial minute at the end
        ("A", "A", "8", at - timedelta(hours=3)),  # to itself: sent and received
    )
    version_1 = aggregates.Schema("aggregates", aggregates.SCHEMA.migrations[:1])
    with psycopg.connect(store_url) as conn:
        migrate(conn, version_1)
        aggregates.check_thresholds(conn, version_1, THRESHOLD, BAND)
        low, high = aggregates.near_bounds(THRESHOLD, BAND)
        for p in payments:
            conn.execute(
                "INSERT INTO aggregates.payments VALUES (%s, %s, %s, %s, %s)",
                (p.payer, p.payee, p.currency, p.amount, p.ts),
            )
            minute = aggregates.floor_bucket(p.ts)
            near = int(low <= p.amount < high)
            for account, direction, other, counted in (
                (p.payer, "out", p.payee, near),
                (p.payee, "in", p.payer, 0),
            ):
                conn.execute(
                    "INSERT INTO aggregates.buckets VALUES (%s, %s, %s, %s, %s, 1, %s, %s) "
                    "ON CONFLICT (account, bucket, direction, counterparty, currency) DO UPDATE SET "
                    "payments = buckets.payments + 1, total = buckets.total + excluded.total, "
                    "near = buckets.near + excluded.near",
                    (account, minute, direction, other, p.currency, p.amount, counted),
                )
        aggregates.write_meta(conn, version_1, {"max_event_ts": at.isoformat()})
        conn.execute("INSERT INTO aggregates.applied_offsets VALUES (0, %s)", (len(payments),))
        conn.commit()
        assert migrate(conn, aggregates.SCHEMA) == 1
        flows = conn.execute(
            "SELECT count(*), sum(payments), sum(near), sum(cardinality(times)), sum(cardinality(amounts)),"
            " bool_and(total = (SELECT sum(a) FROM unnest(amounts) AS a)),"
            " bool_and(first_ts = (SELECT min(t) FROM unnest(times) AS t)"
            " AND last_ts = (SELECT max(t) FROM unnest(times) AS t))"
            " FROM aggregates.flows"
        ).fetchone()
        assert flows == (4, 5, 1, 5, 5, True, True)
        for table in ("buckets", "payments"):
            assert conn.execute("SELECT to_regclass(%s)", (f"aggregates.{table}",)).fetchone() == (None,)
    instants = [at, at - timedelta(minutes=30), at + timedelta(hours=2, minutes=59)]
    for when in instants:
        for account in ("A", "B", "C"):
            expected = reference_aggregates([payments], account, when, THRESHOLD, BAND)
            assert without_as_of(await one_aggregate(store_url, account, when)) == expected, (account, when)
    # A payment into the minute of a migrated row of one payment (which kept its list) joins that list;
    # a window whose edge falls between the two counts each on its side.
    usd = at - timedelta(hours=2)
    later = rows(
        ("C", "A", "16", at + timedelta(minutes=1)),
        ("B", "A", "3", usd + timedelta(seconds=1), "USD"),
        start=len(payments),
    )
    apply_payments(spark, store_url, "aggregates", later)
    with psycopg.connect(store_url) as conn:
        joined = conn.execute(
            "SELECT payments, times, amounts FROM aggregates.flows WHERE currency = 'USD'"
        ).fetchall()
    assert joined == [(2, [usd, usd + timedelta(seconds=1)], [Decimal("2"), Decimal("3")])]
    for account, when in [
        ("A", at + timedelta(minutes=2)),
        ("A", usd + timedelta(hours=1)),
        ("B", usd + timedelta(hours=1)),
    ]:
        expected = reference_aggregates([payments, later], account, when, THRESHOLD, BAND)
        assert without_as_of(await one_aggregate(store_url, account, when)) == expected, (account, when)


def test_every_store_keeps_its_tables_in_its_own_schema(store_url: str) -> None:
    with psycopg.connect(store_url) as conn:
        migrate(conn, relations.SCHEMA)
        migrate(conn, aggregates.SCHEMA)
        tables = conn.execute(
            "SELECT table_schema, table_name FROM information_schema.tables "
            "WHERE table_schema IN ('relations', 'aggregates') ORDER BY 1, 2"
        ).fetchall()
    assert {("relations", "edges"), ("aggregates", "flows")} <= set(tables)
    assert ("relations", "applied_offsets") in tables and ("aggregates", "applied_offsets") in tables


@pytest.mark.parametrize(
    ("value", "text"),
    [("12.5", "12.50"), ("12.5000", "12.50"), ("0.0001", "0.0001"), ("100", "100.00"), ("1E+3", "1000.00"),
     ("0", "0.00"), ("7.1230", "7.123")],
)  # fmt: skip
def test_money_text_is_canonical(value: str, text: str) -> None:
    assert money_text(Decimal(value)) == text
    assert reference_money_text(Decimal(value)) == text


@given(st.decimals(min_value=0, max_value=10**15, allow_nan=False, allow_infinity=False))
def test_money_text_agrees_with_the_reference_on_any_amount(value: Decimal) -> None:
    # Sums in cents take money_text's short way; every other amount the long one: both must be canonical.
    value = abs(value)  # no negative zero: the store's amounts are sums of positive ones
    assert money_text(value) == reference_money_text(value)
    cents = value.quantize(Decimal("0.01"))
    assert money_text(cents) == reference_money_text(cents)
    assert money_text(Decimal("-0.00")) == money_text(Decimal("-0")) == "0.00"


async def test_the_writer_keeps_the_planner_statistics_up_with_the_tables(store_url: str) -> None:
    """A fresh store filled batch by batch is analyzed as it grows (autovacuum waits a minute and for 10 %
    of a table), so the planner's row count never lags the table by more than ANALYZE_GROWTH, and B's
    chain query is never planned as sequential scans over a never-analyzed table (1.7 s instead of 2 ms
    for 100 accounts, BENCHMARKS.md)."""
    writer = Writer(store_url, relations.SCHEMA)
    writer.migrate()

    def planned_rows() -> float:
        with psycopg.connect(store_url) as conn:
            query = "SELECT reltuples FROM pg_class WHERE oid = 'relations.edges'::regclass"
            return conn.execute(query).fetchone()[0]

    assert planned_rows() == -1  # never analyzed: what autovacuum leaves for its first minute

    def edges(first: int, count: int) -> Any:
        def write(conn: psycopg.Connection) -> None:
            conn.execute(
                "INSERT INTO relations.edges"
                " SELECT 'p' || i, 'q' || (i %% 5000), 'EUR', 1, 2000, now(), now()"
                " FROM generate_series(%s::int, %s::int) AS i",
                (first, first + count - 1),
            )

        return write

    batch, batches = 2000, 10
    for k in range(batches):
        writer.apply({0: (k * batch, (k + 1) * batch)}, edges(k * batch, batch))
        held = (k + 1) * batch
        assert planned_rows() >= held / (1 + ANALYZE_GROWTH) - batch, f"after {held} rows"
    assert 2 <= writer.analyzes < batches  # grows geometrically, not once per batch
    writer.close()
    with psycopg.connect(store_url) as conn:
        text = (
            sql.SQL(relations._CHAINS)
            .format(edges=sql.Identifier("relations", "edges"), last=relations._PINNED)
            .as_string(conn)
        )
        accounts = [f"q{i}" for i in range(100)]
        # As the detectors ask: one minimum per currency.
        heavy = relations._heavy_params(ExchangeRates().in_each(Decimal(1000)))
        low, high = relations.FLOW_RATIO
        closings = [f"p{i}" for i in range(100)]  # through the payer, as the detectors ask
        ats = [datetime.now(UTC)] * 100  # at each payment's time, as the detectors ask
        params = {
            "accounts": accounts,
            "closings": closings,
            "ats": ats,
            "span": relations.LOOP_SPAN,
            "hops": 3,
            "low": low,
            "high": high,
            **heavy,
        }
        plan = [line for (line,) in conn.execute(f"EXPLAIN {text}", params).fetchall()]
    shown = "\n".join(plan)
    assert not any("Seq Scan" in line for line in plan), shown
    # The edge from the payer into the account is looked up by its key for each length, not filtered
    # out of every edge into the account (a payee that hundreds pay: 15 times slower).
    pinned = [
        line for line in plan if "Index Cond" in line and "q.closing" in line and "payee = q.account" in line
    ]
    assert len(pinned) == 3, shown


def test_the_heavy_edges_into_an_account_that_hundreds_pay_are_found_through_its_indexes(
    store_url: str,
) -> None:
    """B's sources and co-payees read the edges into an account that are heavy as of `at`: by their
    average (the index by average) or, paid on both sides of `at`, by their payments made by then (the
    index of edges of several payments by last payment). Both are found in one bitmap scan, not by reading
    every light edge into a merchant."""
    writer = Writer(store_url, relations.SCHEMA)
    writer.migrate()
    writer.close()
    now = datetime.now(UTC)
    with psycopg.connect(store_url) as conn:
        conn.execute(  # 3,000 light payers of the merchant, one payment each
            "INSERT INTO relations.edges SELECT 'p' || i, 'merchant', 'EUR', 1, 12, %(t)s, %(t)s"
            " FROM generate_series(1, 3000) AS i",
            {"t": now - timedelta(hours=1)},
        )
        conn.execute(  # 3 payers who paid it heavily before `at` and lightly after
            "INSERT INTO relations.edges SELECT 'h' || i, 'merchant', 'EUR', 2, 2012,"
            " %(t)s, %(after)s, ARRAY[%(t)s, %(after)s]::timestamptz[], ARRAY[2000, 12]::numeric[]"
            " FROM generate_series(1, 3) AS i",
            {"t": now - timedelta(hours=1), "after": now + timedelta(minutes=1)},
        )
        conn.execute("ANALYZE relations.edges")
        heavy = relations._heavy_params(ExchangeRates().in_each(Decimal(1000)))
        for name in ("_SOURCES", "_CO_PAYEES"):
            text = sql.SQL(getattr(relations, name)).format(edges=sql.Identifier("relations", "edges"))
            params = {"accounts": ["merchant"] * 50, "ats": [now] * 50, **heavy}
            plan = [line for (line,) in conn.execute(sql.SQL("EXPLAIN ") + text, params).fetchall()]
            assert any("edges_by_payee_last" in line for line in plan), f"{name}:\n" + "\n".join(plan)


def test_a_batch_about_a_merchant_goes_through_its_week_once(store_url: str) -> None:
    """C's window query counts what a merchant's questions share once for all of them: a batch of 50
    questions seconds apart about a merchant that 3,000 pay goes through its 3,000 flow rows once, not
    once per question (150,000 rows, 25 times the time), and its aggregates stay in `work_mem` (4 MB by
    default), never spilling into temporary files."""
    writer = Writer(store_url, aggregates.SCHEMA)
    writer.migrate()
    writer.close()
    now = datetime.now(UTC)
    with psycopg.connect(store_url, autocommit=True) as conn:
        conn.execute(  # 3,000 payers of the merchant over the week, one payment each
            "INSERT INTO aggregates.flows (payer, bucket, payee, currency, payments, total, near,"
            " first_ts, last_ts) SELECT 'p' || i, date_bin('1 minute', ts, 'epoch'), 'merchant', 'EUR',"
            " 1, 12, 0, ts, ts FROM (SELECT i, %(t)s - i * interval '3 minutes' AS ts"
            " FROM generate_series(1, 3000) AS i) AS p",
            {"t": now - timedelta(minutes=1)},
        )
        conn.execute("ANALYZE aggregates.flows")
        queries = [("merchant", now - timedelta(seconds=i)) for i in range(50)]
        text, params = aggregates.windows_query(aggregates.SCHEMA, queries, THRESHOLD, BAND)
        conn.execute("SET work_mem = '4MB'")
        plan = [
            line for (line,) in conn.execute(sql.SQL("EXPLAIN (ANALYZE, BUFFERS) ") + text, params).fetchall()
        ]
    shown = "\n".join(plan)
    # What runs once per question handles a few rows each time; the merchant's week is read and
    # aggregated in steps that run once.
    per_question = [
        int(m.group(1)) for line in plan if (m := re.search(r"actual time=\S+ rows=(\d+) loops=50\)", line))
    ]
    assert per_question and max(per_question) < 100, shown
    assert any("CTE Scan on base" in line and "rows=3000 loops=1)" in line for line in plan), shown
    assert not any("temp written" in line or "Disk Usage" in line for line in plan), shown


def test_the_aggregations_of_a_batch_need_no_shuffle(spark: Any) -> None:
    """Each service's aggregation of a kept batch runs in one task: a shuffle would cost a stage, files
    and a scheduling round per aggregation, about 100 ms per micro-batch (BENCHMARKS.md). With nothing to
    adapt, the pipeline's session plans them without adaptive execution, whose re-planning and plan
    reports cost a quarter of the JVM's CPU for a small micro-batch."""
    from aml_app.pipeline.transforms import edges, flows, in_one_task, kept, trimmed
    from aml_app.pipeline.validation import validated
    from tests.stores import records_frame

    rows = [PaymentRow(p % 2, p, f"id-{p}", "A", "B", Decimal("10.00"), "EUR", T0) for p in range(20)]
    records = records_frame(spark, payment_records(rows))
    assert records.rdd.getNumPartitions() > 1  # read in parallel, as the source's tasks read a batch

    def plan(frame: Any) -> str:
        return frame._jdf.queryExecution().executedPlan().toString()

    with kept(trimmed(validated(records, SETTINGS.kafka.max_payment_bytes))) as batch:
        valid = batch.where("valid")
        for aggregated in (edges(in_one_task(valid)), flows(in_one_task(valid), THRESHOLD, BAND)):
            assert "Exchange" not in plan(aggregated), plan(aggregated)
            assert "AdaptiveSparkPlan" not in plan(aggregated), plan(aggregated)
            assert aggregated.count() >= 1
        assert "Exchange" in plan(edges(valid))  # the check sees a shuffle where there is one
        session_value = spark.conf.get("spark.sql.adaptive.enabled")
        spark.conf.set("spark.sql.adaptive.enabled", "true")
        try:  # and adaptive execution where it is on
            assert "AdaptiveSparkPlan" in plan(edges(in_one_task(valid)))
        finally:
            spark.conf.set("spark.sql.adaptive.enabled", session_value)


def test_a_service_whose_store_is_ahead_skips_what_it_holds(spark: Any) -> None:
    """After a crash between the two services' writes one store is ahead: the shared batch feeds each
    service only the records its store does not hold yet, in the aggregations and on the driver."""
    from aml_app.pipeline.transforms import kept, outputs_by_service, trimmed
    from aml_app.pipeline.validation import validated
    from tests.stores import records_frame

    rows = [PaymentRow(0, o, f"id-{o}", "A", "B", Decimal("10.00"), "EUR", T0) for o in range(10)]
    records = records_frame(spark, payment_records(rows))
    applied = {"relations": {0: 6}, "aggregates": {0: 0}}
    with kept(trimmed(validated(records, SETTINGS.kafka.max_payment_bytes))) as batch:
        outputs = outputs_by_service(batch, applied, THRESHOLD, BAND)
    relations_out, aggregates_out = outputs["relations"], outputs["aggregates"]
    assert relations_out.tables["edges"].column("payments").to_pylist() == [4]
    assert relations_out.spans.to_pylist() == [{"partition": 0, "first": 6, "last": 9, "records": 4}]
    flows = aggregates_out.tables["flows"]
    assert sum(flows.column("payments").to_pylist()) == 10
    assert sum(len(times) for times in flows.column("times").to_pylist()) == 10
    assert aggregates_out.spans.to_pylist() == [{"partition": 0, "first": 0, "last": 9, "records": 10}]


def test_the_stores_take_a_batch_in_their_primary_keys_order(spark: Any, store_url: str) -> None:
    """Edges and flows go into their tables sorted by the primary key, so PostgreSQL's index inserts walk
    each index in order (less PostgreSQL CPU per payment than rows in Spark's hash order, BENCHMARKS.md):
    a fresh table's rows lie in the order they were inserted."""
    payments = [
        PaymentRow(
            0,
            o,
            f"id-{o}",
            f"P{o * 7 % 13}",
            f"Q{o * 5 % 11}",
            Decimal(1),
            "EUR",
            T0 + timedelta(minutes=o % 3),
        )
        for o in range(120)
    ]
    apply_payments(spark, store_url, "relations", payments)
    apply_payments(spark, store_url, "aggregates", payments)
    with psycopg.connect(store_url) as conn:
        edges = conn.execute("SELECT payer, payee, currency FROM relations.edges ORDER BY ctid").fetchall()
        flows = conn.execute(
            "SELECT payer, bucket, payee, currency FROM aggregates.flows ORDER BY ctid"
        ).fetchall()
    for stored in (edges, flows):
        assert len(stored) > 30 and stored == sorted(stored)


def test_the_kept_batch_holds_no_bytes_of_valid_records(spark: Any) -> None:
    """The cached batch keeps a record's bytes only when it is rejected (for its dead letter): the valid
    ones' bytes and payment ids are read by no output, and caching them cost CPU per record. The query
    trims the batch once (`start_queries`), not per micro-batch."""
    from aml_app.pipeline.transforms import kept, trimmed
    from aml_app.pipeline.validation import validated
    from tests.stores import records_frame

    payments = [PaymentRow(0, o, f"id-{o}", "A", "B", Decimal(1), "EUR", T0) for o in range(5)]
    records = records_frame(spark, [*payment_records(payments), (0, 5, b"A", b"not json")])
    with kept(trimmed(validated(records, SETTINGS.kafka.max_payment_bytes))) as batch:
        assert "payment_id" not in batch.columns
        rows = {r["offset"]: r for r in batch.collect()}
    assert [o for o, r in rows.items() if r["key"] is not None or r["value"] is not None] == [5]
    assert bytes(rows[5]["value"]) == b"not json" and rows[4]["payer"] == "A"


def test_a_writer_waiting_out_an_outage_gives_up_when_told() -> None:
    """A stop during an outage (`Pipeline.stop`) must not wait out the writer's patience (ten minutes)."""
    writer = Writer("postgresql://aml@127.0.0.1:1/none?connect_timeout=1", relations.SCHEMA, patience=600)
    failure: list[BaseException] = []

    def read() -> None:
        try:
            writer.applied_offsets()
        except BaseException as exc:
            failure.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while writer.outages == 0 and reader.is_alive():
        assert time.monotonic() < deadline, "the writer never saw the server unavailable"
        time.sleep(0.05)
    writer.give_up()
    reader.join(30)
    assert not reader.is_alive(), "the writer still waits for the server after give_up"
    assert len(failure) == 1 and isinstance(failure[0], StoreError), failure
    assert "the pipeline is stopping" in str(failure[0])


def test_a_write_held_by_a_lock_gives_up_instead_of_waiting_for_ever(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A statement of the write waits at most LOCK_TIMEOUT for a lock (and WRITE_TIMEOUT in all) and is
    retried within the writer's patience, then fails with a StoreError: a write that waited without end
    held the pipeline's batch, and its commits, without a word."""
    monkeypatch.setattr(store_module, "LOCK_TIMEOUT", 0.2)
    writer = Writer(store_url, relations.SCHEMA, patience=1.0)
    writer.migrate()
    conn = writer.connection()
    timeouts = dict(
        conn.execute(
            "SELECT name, setting::int FROM pg_settings WHERE name IN ('lock_timeout', 'statement_timeout')"
        ).fetchall()
    )
    conn.rollback()
    assert timeouts == {"lock_timeout": 200, "statement_timeout": round(store_module.WRITE_TIMEOUT * 1000)}
    outcome: list[BaseException] = []

    def apply() -> None:
        try:
            writer.apply({0: (0, 1)}, lambda conn: None)
        except BaseException as exc:
            outcome.append(exc)

    with psycopg.connect(store_url) as holder:
        holder.execute("LOCK TABLE relations.applied_offsets IN ACCESS EXCLUSIVE MODE")
        thread = threading.Thread(target=apply)
        thread.start()
        thread.join(timeout=30)
        held = thread.is_alive()
        holder.rollback()
    thread.join(timeout=30)
    writer.close()
    assert not held, "the write waited for the lock past its timeout and the writer's patience"
    [error] = outcome
    assert isinstance(error, StoreError) and "lock timeout" in str(error)
