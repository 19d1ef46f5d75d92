"""Service B's store against the naive reference, plus idempotency (offsets stored with the results).

Real SQLite files in temporary folders; nothing is mocked. The generated-batches strategy here is shared
with test_aggregates_store.py.
"""

from __future__ import annotations

import itertools
import sqlite3
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aml_app.services.aggregates import PaymentRow
from aml_app.services.relations import EdgeDelta, RelationsStore
from aml_app.services.store import StaleBatch, connect, money_text
from tests.reference import money_text as reference_money_text
from tests.reference import reference_relations

ACCOUNTS = ["A", "B", "C", "D", "Ä"]  # few, so edges repeat and cycles occur; "Ä" sorts after "D"
CURRENCIES = ["EUR", "USD", "JPY"]
T0 = datetime(2026, 3, 1, tzinfo=UTC)
HALF_HOUR = timedelta(minutes=30)


# --- generated batches ---------------------------------------------------------------------------


@dataclass
class Batch:
    rows: list[PaymentRow]
    covered: dict[int, tuple[int, int]]
    split: bool = False  # deliver some edges as several deltas


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
            offsets.update({p: end for p, (_, end) in batch.covered.items()})
        return offsets


amounts = st.one_of(
    st.tuples(st.integers(1, 300_000_000), st.integers(0, 4)).map(lambda t: Decimal(t[0]).scaleb(-t[1])),
    st.sampled_from(["9000", "9000.00", "10000", "8999.9999", "9999.9999", "0.0001", "0.1", "0.20"]).map(
        Decimal
    ),
)
# Coarse half-hour steps make exact window boundaries between payments common; some odd microseconds too.
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
                st.integers(0, 9).map(lambda n: n > 0),  # 1 in 10 records is invalid (an offset, no row)
            ),
            max_size=max_records,
        )
    )
    # Cut points may repeat: a batch can cover nothing but empty ranges.
    cuts = sorted([0, len(records), *draw(st.lists(st.integers(0, len(records)), max_size=6))])
    scenario = Scenario()
    for lo, hi in itertools.pairwise(cuts):
        covered = {p: (next_offset[p], next_offset[p]) for p in range(partitions)}
        rows = []
        for partition, payer, payee, currency, amount, ts, valid in records[lo:hi]:
            offset = next_offset[partition]
            next_offset[partition] += 1
            covered[partition] = (covered[partition][0], next_offset[partition])
            if valid:
                rows.append(PaymentRow(partition, offset, f"pay-{partition}-{offset}", payer, payee, amount,
                                       currency, ts))  # fmt: skip
        scenario.batches.append(Batch(rows, covered, split=draw(st.booleans())))
    return scenario


def edge_deltas(rows: list[PaymentRow], split: bool = False) -> list[EdgeDelta]:
    """What Spark sends for a batch: one delta per (payer, payee, currency), or two when `split`."""
    groups: dict[tuple[str, str, str], list[PaymentRow]] = defaultdict(list)
    for row in rows:
        groups[(row.payer, row.payee, row.currency)].append(row)
    deltas = []
    for (payer, payee, currency), members in groups.items():
        parts = [members[: len(members) // 2], members[len(members) // 2 :]] if split else [members]
        for part in parts:
            if part:
                deltas.append(
                    EdgeDelta(
                        payer,
                        payee,
                        currency,
                        len(part),
                        sum((r.amount for r in part), Decimal(0)),
                        min(r.ts for r in part),
                        max(r.ts for r in part),
                    )
                )
    return deltas


def without_as_of(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k != "as_of"}


def row(
    payer: str, payee: str, amount: str, ts: datetime, currency: str = "EUR", offset: int = 0
) -> PaymentRow:
    return PaymentRow(0, offset, f"pay-{offset}", payer, payee, Decimal(amount), currency, ts)


def apply_payments(
    store: RelationsStore, payments: list[PaymentRow], partition: int = 0, start: int = 0
) -> None:
    store.apply(edge_deltas(payments), {partition: (start, start + len(payments))})


@pytest.fixture
def store(tmp_path: Path) -> RelationsStore:
    with RelationsStore(str(tmp_path / "b" / "relations.sqlite")) as opened:
        yield opened


# --- store vs reference --------------------------------------------------------------------------


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_relations_match_the_reference(scenario: Scenario) -> None:
    with tempfile.TemporaryDirectory() as folder, RelationsStore(f"{folder}/relations.sqlite") as store:
        for batch in scenario.batches:
            store.apply(edge_deltas(batch.rows, batch.split), batch.covered)
        expected_as_of = {str(p): o for p, o in sorted(scenario.final_offsets.items())}
        for account in [*ACCOUNTS, "nobody"]:
            for hops in (1, 2, 3):
                answer = store.relations(account, hops)
                assert answer["as_of"] == expected_as_of
                assert without_as_of(answer) == reference_relations(scenario.payments, account, hops)
        assert store.applied_offsets() == scenario.final_offsets
        # Replaying any batch that covered offsets is refused and changes nothing.
        replayable = [b for b in scenario.batches if any(s < e for s, e in b.covered.values())]
        if replayable:
            before = store.relations("A", 3)
            with pytest.raises(StaleBatch):
                store.apply(edge_deltas(replayable[0].rows), replayable[0].covered)
            assert store.relations("A", 3) == before


# --- worked examples -----------------------------------------------------------------------------


def test_out_in_totals_and_seen_times(store: RelationsStore) -> None:
    t = T0 + timedelta(microseconds=123456)
    apply_payments(
        store,
        [
            row("A", "B", "0.1", t),
            row("A", "B", "0.2", t + timedelta(hours=2)),
            row("A", "B", "5", t - timedelta(hours=1), currency="USD"),
            row("C", "A", "1.2345", t),
        ],
    )
    answer = store.relations("A", 1)
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


def test_totals_are_exact_for_large_sums(store: RelationsStore) -> None:
    big = "999999999999999.9999"
    for i in range(3):
        store.apply([EdgeDelta("A", "B", "EUR", 1, Decimal(big), T0, T0)], {0: (i, i + 1)})
    assert store.relations("A", 1)["out"][0]["totals"] == {"EUR": "2999999999999999.9997"}


def test_neighbourhood_ignores_direction_and_keeps_shortest_distance(store: RelationsStore) -> None:
    # A -> B -> C, D -> C, D -> A (so D is 1 hop, not 3), E -> D
    edges = [("A", "B"), ("B", "C"), ("D", "C"), ("D", "A"), ("E", "D")]
    apply_payments(store, [row(payer, payee, "1", T0) for payer, payee in edges])
    assert store.relations("A", 1)["neighbourhood"] == [
        {"account": "B", "hops": 1},
        {"account": "D", "hops": 1},
    ]
    assert store.relations("A", 3)["neighbourhood"] == [
        {"account": "B", "hops": 1},
        {"account": "D", "hops": 1},
        {"account": "C", "hops": 2},
        {"account": "E", "hops": 2},
    ]


def test_cycles(store: RelationsStore) -> None:
    apply_payments(
        store,
        [
            row("A", "C", "1", T0),
            row("C", "A", "1", T0),  # A C A
            row("A", "B", "1", T0),
            row("B", "A", "1", T0),  # A B A: same length, smaller
            row("X", "Y", "1", T0),
            row("Y", "Z", "1", T0),
            row("Z", "X", "1", T0),  # 3-cycle
            row("S", "S", "1", T0),  # self-payment
        ],
    )
    assert store.relations("A", 2)["cycle"] == {"found": True, "path": ["A", "B", "A"]}
    assert store.relations("A", 1)["cycle"] == {"found": False, "path": []}
    assert store.relations("X", 2)["cycle"] == {"found": False, "path": []}
    assert store.relations("X", 3)["cycle"] == {"found": True, "path": ["X", "Y", "Z", "X"]}
    assert store.relations("S", 1)["cycle"] == {"found": True, "path": ["S", "S"]}
    assert store.relations("S", 1)["out"][0]["counterparty"] == "S"
    assert store.relations("S", 1)["neighbourhood"] == []


def test_unknown_account_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "not" / "yet" / "relations.sqlite"
    store = RelationsStore(str(path))
    empty = {"out": [], "in": [], "neighbourhood": [], "cycle": {"found": False, "path": []}}
    assert store.relations("A", 2) == {"account": "A", "hops": 2, "as_of": {}, **empty}
    assert store.applied_offsets() == {}
    assert not path.exists(), "reading must not create the store file"
    apply_payments(store, [row("A", "B", "1", T0)], partition=3, start=5)
    assert store.relations("nobody", 3) == {"account": "nobody", "hops": 3, "as_of": {"3": 6}, **empty}
    with pytest.raises(ValueError):
        store.relations("A", 4)


# --- idempotency ---------------------------------------------------------------------------------


def snapshot(store: RelationsStore) -> list[dict[str, Any]]:
    return [store.relations(a, 3) for a in ("A", "B", "C")]


def test_same_batch_twice_is_refused_and_changes_nothing(store: RelationsStore) -> None:
    deltas = edge_deltas([row("A", "B", "1", T0), row("B", "C", "2", T0)])
    store.apply(deltas, {0: (0, 2), 1: (40, 40)})
    before = snapshot(store)
    with pytest.raises(StaleBatch, match=r"partition 0: .*already applied \(replay\)"):
        store.apply(deltas, {0: (0, 2), 1: (40, 40)})
    assert snapshot(store) == before
    assert store.applied_offsets() == {0: 2, 1: 40}
    # A batch that overlaps the applied range is a replay too; one after a gap is refused as well.
    with pytest.raises(StaleBatch, match="replay"):
        store.apply(deltas, {0: (1, 3)})
    with pytest.raises(StaleBatch, match=r"offsets 2\.\.4 would be skipped \(gap\)"):
        store.apply(deltas, {0: (5, 7)})
    assert snapshot(store) == before
    # One stale partition spoils the whole batch, including its fresh partitions.
    with pytest.raises(StaleBatch):
        store.apply(deltas, {0: (2, 4), 1: (39, 41)})
    assert snapshot(store) == before
    assert store.applied_offsets() == {0: 2, 1: 40}


def test_first_batch_may_start_anywhere_and_empty_ranges_advance(store: RelationsStore) -> None:
    store.apply([], {0: (1000, 1003), 1: (0, 0), 2: (17, 17)})
    assert store.applied_offsets() == {0: 1003, 1: 0, 2: 17}
    store.apply(edge_deltas([row("A", "B", "1", T0)]), {0: (1003, 1004), 2: (17, 20)})
    assert store.applied_offsets() == {0: 1004, 1: 0, 2: 20}
    assert store.relations("A", 1)["as_of"] == {"0": 1004, "1": 0, "2": 20}


def test_a_bad_row_midway_leaves_nothing_half_applied(store: RelationsStore) -> None:
    store.apply(edge_deltas([row("A", "B", "1", T0)]), {0: (0, 1)})
    before = snapshot(store)
    good = edge_deltas([row("A", "B", "2", T0), row("B", "C", "3", T0)])
    naive = EdgeDelta("C", "A", "EUR", 1, Decimal("4"), datetime(2026, 3, 1), datetime(2026, 3, 1))
    with pytest.raises(ValueError, match="timezone-aware"):
        store.apply([*good, naive], {0: (1, 4)})  # the good deltas were upserted before the bad one
    assert snapshot(store) == before
    assert store.applied_offsets() == {0: 1}
    # The store is still usable, and the same range applies cleanly once the batch is right.
    store.apply(good, {0: (1, 4)})
    assert store.relations("A", 1)["out"][0]["totals"] == {"EUR": "3.00"}
    assert store.applied_offsets() == {0: 4}


@pytest.mark.parametrize(
    ("covered", "message"),
    [
        ({0: (5, 4)}, "start is after end"),
        ({0: (-1, 2)}, "non-negative"),
        ({-1: (0, 1)}, "non-negative"),
        ({}, "without any covered offsets"),
        ({0: (3, 3)}, "without any covered offsets"),
    ],
)
def test_malformed_ranges_are_refused(store: RelationsStore, covered: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        store.apply(edge_deltas([row("A", "B", "1", T0)]), covered)
    assert store.applied_offsets() == {}
    assert store.relations("A", 1)["out"] == []


def test_durable_across_reopen_and_wal_full_sync(tmp_path: Path) -> None:
    path = str(tmp_path / "relations.sqlite")
    with RelationsStore(path) as first:
        apply_payments(first, [row("A", "B", "1.5", T0)])
    with RelationsStore(path) as second:
        assert second.relations("A", 1)["out"][0]["totals"] == {"EUR": "1.50"}
        apply_payments(second, [row("A", "B", "1", T0)], start=1)
        assert second.applied_offsets() == {0: 2}
    writer = connect(path)
    try:
        assert writer.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert writer.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert writer.execute("SELECT typeof(total) FROM edges").fetchone()[0] == "text"
    finally:
        writer.close()


def test_readers_see_one_snapshot_while_the_writer_is_mid_transaction(tmp_path: Path) -> None:
    path = str(tmp_path / "relations.sqlite")
    with RelationsStore(path) as store:
        apply_payments(store, [row("A", "B", "1", T0)])
        other = connect(path)  # a second writer holds its write transaction open
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("UPDATE applied_offsets SET next_offset = 99")
            other.execute("UPDATE edges SET count = 50")
            answer = store.relations("A", 1)  # must neither block nor see uncommitted data
            assert answer["as_of"] == {"0": 1} and answer["out"][0]["count"] == 1
            other.execute("ROLLBACK")
        finally:
            other.close()


@pytest.mark.parametrize(
    ("value", "text"),
    [("12.5", "12.50"), ("12.5000", "12.50"), ("0.0001", "0.0001"), ("100", "100.00"), ("1E+3", "1000.00"),
     ("0", "0.00"), ("7.1230", "7.123")],
)  # fmt: skip
def test_money_text_is_canonical(value: str, text: str) -> None:
    assert money_text(Decimal(value)) == text
    assert reference_money_text(Decimal(value)) == text


def test_sqlite_is_real() -> None:
    assert sqlite3.sqlite_version_info >= (3, 24)  # upsert
