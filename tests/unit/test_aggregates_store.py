"""Service C's store against the naive reference: windows, threshold band, too-late rule, pruning,
idempotency. Real SQLite files in temporary folders; nothing is mocked."""

from __future__ import annotations

import sqlite3
import tempfile
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aml_app.services.aggregates import AggregatesStore, PaymentRow, to_units, units_text
from aml_app.services.store import StaleBatch, money_text
from tests.reference import exact_from, reference_aggregates
from tests.unit.test_relations_store import ACCOUNTS, Scenario, scenarios, without_as_of

THRESHOLD = Decimal("10000")
BAND = Decimal("0.1")
T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)
US = timedelta(microseconds=1)
HOUR = timedelta(hours=1)
DAY = timedelta(days=1)
EDGES = [timedelta(0), -US, US, HOUR, HOUR - US, HOUR + US, DAY, DAY - US, DAY + US, 7 * DAY, 7 * DAY + US]


def open_store(path: str | Path) -> AggregatesStore:
    return AggregatesStore(str(path), THRESHOLD, BAND)


@pytest.fixture
def store(tmp_path: Path) -> AggregatesStore:
    with open_store(tmp_path / "c" / "aggregates.sqlite") as opened:
        yield opened


class Feed:
    """Applies batches on partition 0 with consecutive offsets; remembers them for the reference."""

    def __init__(self, store: AggregatesStore) -> None:
        self.store = store
        self.offset = 0
        self.batches: list[list[PaymentRow]] = []

    def batch(self, *payments: tuple[str, str, str, datetime]) -> list[PaymentRow]:
        rows = [
            PaymentRow(0, self.offset + i, f"pay-{self.offset + i}", payer, payee, Decimal(amount), "EUR", ts)
            for i, (payer, payee, amount, ts) in enumerate(payments)
        ]
        self.store.apply(rows, {0: (self.offset, self.offset + len(rows))})
        self.offset += len(rows)
        self.batches.append(rows)
        return rows

    def check(self, account: str, at: datetime) -> dict[str, Any]:
        answer = self.store.aggregates(account, at)
        assert without_as_of(answer) == reference_aggregates(self.batches, account, at, THRESHOLD, BAND)
        return answer


def window(answer: dict[str, Any], name: str) -> tuple[int, int]:
    w = answer["windows"][name]
    return w["sent_count"], w["received_count"]


# --- store vs reference --------------------------------------------------------------------------


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), data=st.data())
def test_aggregates_match_the_reference(scenario: Scenario, data: st.DataObject) -> None:
    batches = [b.rows for b in scenario.batches]
    with tempfile.TemporaryDirectory() as folder, open_store(f"{folder}/aggregates.sqlite") as store:
        for batch in scenario.batches:
            store.apply(batch.rows, batch.covered)
        start = exact_from(batches)
        if start is None:
            instants = [T0]
        else:
            # Exact window boundaries around payments, from the first instant the store answers exactly.
            candidates = {ts_at for p in scenario.payments for d in EDGES if (ts_at := p.ts + d) >= start}
            instants = [
                start,
                start + HOUR,
                *data.draw(st.lists(st.sampled_from(sorted(candidates)), max_size=6)),
            ]
        expected_as_of = {str(p): o for p, o in sorted(scenario.final_offsets.items())}
        for at in instants:
            for account in [*ACCOUNTS, "nobody"]:
                answer = store.aggregates(account, at)
                assert answer["as_of"] == expected_as_of
                assert without_as_of(answer) == reference_aggregates(batches, account, at, THRESHOLD, BAND)
        replayable = [b for b in scenario.batches if any(s < e for s, e in b.covered.values())]
        if replayable and start is not None:
            before = store.aggregates("A", start)
            with pytest.raises(StaleBatch):
                store.apply(replayable[-1].rows, replayable[-1].covered)
            assert store.aggregates("A", start) == before


# --- boundaries ----------------------------------------------------------------------------------


def test_window_edges(store: AggregatesStore) -> None:
    feed = Feed(store)
    feed.batch(("A", "B", "5", T0), ("C", "A", "7.25", T0 - 23 * HOUR))
    at_payment = feed.check("A", T0)
    assert window(at_payment, "1h") == (1, 0)  # ts == at is included
    assert at_payment["windows"]["24h"] == {
        "sent_count": 1,
        "sent": {"EUR": "5.00"},
        "received_count": 1,
        "received": {"EUR": "7.25"},
        "counterparties": 2,
        "sent_counterparties": 1,
        "received_counterparties": 1,
    }
    assert window(feed.check("A", T0 + HOUR), "1h") == (0, 0)  # ts == at - 1h is excluded
    assert window(feed.check("A", T0 + HOUR - US), "1h") == (1, 0)
    assert window(feed.check("A", T0 + HOUR), "24h") == (1, 0)  # 7.25 at at - 24h: excluded
    assert window(feed.check("A", T0 + HOUR - US), "24h") == (1, 1)
    assert window(feed.check("A", T0 - US), "24h") == (0, 1)  # before the payment: not yet
    assert window(feed.check("A", T0 + 7 * DAY - US), "7d") == (1, 0)
    assert window(feed.check("A", T0 + 7 * DAY), "7d") == (0, 0)


def test_threshold_band_edges(store: AggregatesStore) -> None:
    feed = Feed(store)
    near = {  # payer -> (amount sent, counts as near the threshold)
        "at-threshold": ("10000", False),
        "just-below": ("9999.9999", True),
        "at-band-edge": ("9000.00", True),
        "below-band": ("8999.9999", False),
    }
    feed.batch(*[(payer, "Z", amount, T0) for payer, (amount, _) in near.items()])
    for payer, (_, counted) in near.items():
        assert feed.check(payer, T0)["near_threshold_24h"] == int(counted), payer
    feed.batch(
        ("A", "B", "9999.9999", T0),
        ("A", "C", "9000", T0 - DAY + US),  # inside the 24h window
        ("A", "D", "9100", T0 - DAY),  # 24h before at: outside the window
        ("B", "A", "9500", T0),  # received, not sent: not counted
    )
    answer = feed.check("A", T0)
    assert answer["near_threshold_24h"] == 2
    assert answer["reporting_threshold"] == "10000" and answer["threshold_band"] == "0.1"
    # B is paid by A and pays A: one counterparty, counted in each direction.
    assert answer["windows"]["7d"]["counterparties"] == 3
    assert answer["windows"]["7d"]["sent_counterparties"] == 3
    assert answer["windows"]["7d"]["received_counterparties"] == 1
    assert feed.check("A", T0 + US)["near_threshold_24h"] == 1
    assert feed.check("Z", T0)["near_threshold_24h"] == 0


def test_too_late_edge_across_batches(store: AggregatesStore) -> None:
    feed = Feed(store)
    feed.batch(("A", "B", "1", T0))
    feed.batch(("A", "B", "2", T0 - 7 * DAY))  # ts == max - 7d: too late
    feed.batch(("A", "B", "3", T0 - 7 * DAY + US))  # inside the horizon: counts
    answer = feed.check("A", T0)
    assert answer["late_dropped"] == 1
    assert answer["windows"]["7d"]["sent"] == {"EUR": "4.00"}
    assert store.status()["late_dropped"] == 1
    assert store.status()["max_event_ts"] == "2026-03-01T12:00:00.000000Z"


def test_too_late_rule_inside_one_batch_ignores_order(store: AggregatesStore) -> None:
    feed = Feed(store)
    # The old payment comes first in the batch, but the batch's own max already makes it too late.
    feed.batch(("A", "B", "1", T0 - 7 * DAY), ("A", "B", "2", T0), ("A", "B", "4", T0 - 6 * DAY))
    answer = feed.check("A", T0)
    assert answer["late_dropped"] == 1
    assert answer["windows"]["7d"]["sent"] == {"EUR": "6.00"}
    # A later batch raises max_event_ts; earlier stored payments still count where their windows hold.
    feed.batch(("C", "A", "8", T0 + 2 * DAY))
    assert feed.check("A", T0 + 2 * DAY)["windows"]["7d"]["sent"] == {"EUR": "2.00"}


def test_pruning_keeps_exact_answers_from_max_minus_one_hour(store: AggregatesStore) -> None:
    feed = Feed(store)
    feed.batch(("A", "B", "1", T0), ("A", "B", "2", T0 + 30 * US), ("A", "B", "3", T0 + HOUR))
    feed.batch(("A", "C", "4", T0 + 7 * DAY + HOUR))  # prunes rows with ts <= T0
    conn = sqlite3.connect(store.path)
    try:
        remaining = sorted(r[0] for r in conn.execute("SELECT amount FROM sides WHERE direction = 'out'"))
    finally:
        conn.close()
    assert remaining == ["2.00", "3.00", "4.00"]
    exact = T0 + 7 * DAY  # = max_event_ts - 1h
    assert feed.check("A", exact)["windows"]["7d"]["sent"] == {"EUR": "5.00"}  # 2 + 3: T0 is just out
    assert feed.check("A", exact + US)["windows"]["7d"]["sent"] == {"EUR": "5.00"}
    assert feed.check("A", exact + HOUR)["windows"]["7d"]["sent"] == {"EUR": "4.00"}
    assert feed.check("A", exact + HOUR)["windows"]["1h"]["sent"] == {"EUR": "4.00"}


def test_unknown_account_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "none" / "aggregates.sqlite"
    store = open_store(path)
    zeros = {
        "sent_count": 0,
        "sent": {},
        "received_count": 0,
        "received": {},
        "counterparties": 0,
        "sent_counterparties": 0,
        "received_counterparties": 0,
    }
    expected = {
        "account": "A",
        "at": "2026-03-01T12:00:00.000000Z",
        "as_of": {},
        "windows": {"1h": zeros, "24h": zeros, "7d": zeros},
        "near_threshold_24h": 0,
        "reporting_threshold": "10000",
        "threshold_band": "0.1",
        "late_dropped": 0,
    }
    assert store.aggregates("A", T0) == expected
    assert store.status() == {"store_exists": False, "as_of": {}, "late_dropped": 0, "max_event_ts": None}
    assert not path.exists()
    store.apply([], {1: (10, 12)})
    assert store.aggregates("A", T0) == {**expected, "as_of": {"1": 12}}
    # An instant in another timezone is the same instant, shown in UTC.
    assert store.aggregates("A", T0.astimezone(timezone(timedelta(hours=5))))["at"] == expected["at"]
    with pytest.raises(ValueError, match="timezone-aware"):
        store.aggregates("A", datetime(2026, 3, 1))


# --- idempotency ---------------------------------------------------------------------------------


def test_same_batch_twice_is_refused_and_changes_nothing(store: AggregatesStore) -> None:
    rows = [PaymentRow(2, 5, "p", "A", "B", Decimal("9500"), "EUR", T0)]
    store.apply(rows, {2: (5, 6)})
    before = store.aggregates("A", T0), store.status()
    with pytest.raises(StaleBatch, match="partition 2"):
        store.apply(rows, {2: (5, 6)})
    assert (store.aggregates("A", T0), store.status()) == before
    assert before[0]["near_threshold_24h"] == 1 and before[1]["as_of"] == {"2": 6}


def test_a_failure_midway_leaves_nothing_half_applied(store: AggregatesStore) -> None:
    feed = Feed(store)
    feed.batch(("A", "B", "1", T0))
    before = store.aggregates("A", T0), store.status()
    rows = [
        PaymentRow(0, 1, "p1", "A", "C", Decimal("2"), "EUR", T0 + DAY),  # raises max_event_ts
        PaymentRow(0, 2, "p2", "A", "D", Decimal("3"), "EUR", T0 - 7 * DAY),  # too late: counter
        PaymentRow(0, 1, "p1", "A", "C", Decimal("2"), "EUR", T0 + DAY),  # the same record again
    ]
    with pytest.raises(ValueError, match="offset 1 is given twice"):
        store.apply(rows, {0: (1, 3)})
    assert (store.aggregates("A", T0), store.status()) == before
    # Offsets outside the covered range are refused too, and the store stays usable.
    with pytest.raises(ValueError, match="outside the covered offsets"):
        store.apply([rows[0], PaymentRow(0, 3, "p3", "A", "B", Decimal("1"), "EUR", T0)], {0: (1, 3)})
    store.apply(rows[:2], {0: (1, 3)})
    assert store.status()["late_dropped"] == 1
    assert store.status()["as_of"] == {"0": 3}


def test_malformed_rows_are_refused(store: AggregatesStore) -> None:
    bad = [
        PaymentRow(0, 0, "p", "A", "B", Decimal("0"), "EUR", T0),
        PaymentRow(0, 0, "p", "A", "B", 1.5, "EUR", T0),  # type: ignore[arg-type]
        PaymentRow(0, 0, "p", "A", "", Decimal("1"), "EUR", T0),
        PaymentRow(0, 0, "p", "A", "B", Decimal("1"), "EUR", datetime(2026, 3, 1)),
    ]
    for row in bad:
        with pytest.raises(ValueError):
            store.apply([row], {0: (0, 1)})
    assert store.status()["as_of"] == {}


@settings(max_examples=500)
@given(
    st.lists(st.decimals(min_value=Decimal("0.0001"), max_value=Decimal("1e15") - 1, places=4), min_size=1)
)
def test_integer_units_sum_exactly_like_decimals(amounts: list[Decimal]) -> None:
    texts = [money_text(a) for a in amounts]
    assert [to_units(t) for t in texts] == [int(a * 10_000) for a in amounts]
    assert units_text(sum(to_units(t) for t in texts)) == money_text(sum(amounts, Decimal(0)))
