"""The event-time gate's arithmetic (aml_app.gate.event_time) and the gate waiting on a cut row."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord

from aml_app.gate.event_time import EARLIEST_US, Cut, Unapplied, admits, cut_row, decided_at, instant, micros
from aml_app.gate.gate import FreshnessGate
from aml_app.gate.unapplied import event_time
from aml_app.gate.watermark import WatermarkRow
from aml_app.kafka.tools import payment_json

DEADLINE = 2.0
T = micros("2026-11-20T10:00:00Z")
MINUTE = 60_000_000


def row(p: int, w: int) -> WatermarkRow:
    return WatermarkRow(partition=p, watermark=w, dependencies={"relations": w}, refreshed_at=0.0)


def cut(watermarks: dict[int, int], unapplied: dict[int, Unapplied]) -> Cut:
    return cut_row(watermarks, unapplied, refreshed_at=0.0)


def test_micros_is_exact_and_round_trips() -> None:
    assert micros("1970-01-01T00:00:01.000001Z") == 1_000_001
    assert micros("2026-11-20T10:00:00+00:00") == T
    assert instant(T) == "2026-11-20T10:00:00Z"
    with pytest.raises(ValueError, match="no timezone"):
        micros("2026-11-20T10:00:00")


def test_the_frontier_is_the_earliest_unapplied_payment_and_quiet_partitions_have_none() -> None:
    row_ = cut(
        {0: 5, 1: 3, 2: 0},
        {0: Unapplied(9, T + MINUTE), 1: Unapplied(7, T), 2: Unapplied(0, None)},
    )
    assert row_.frontier == T and row_.held_by == 1
    assert row_.behind == {"0": T + MINUTE, "1": T}
    caught_up = cut({0: 5, 1: 7}, {0: Unapplied(5, None), 1: Unapplied(7, None)})
    assert caught_up.frontier is None and caught_up.held_by is None
    # A payment of any time passes partitions whose dependencies have applied their whole log.
    assert admits(caught_up, 0, 4, T + 365 * 24 * 60 * MINUTE, 0)


def test_a_partition_that_was_not_read_keeps_the_gate_closed() -> None:
    row_ = cut({0: 5, 1: 7}, {0: Unapplied(5, None)})
    assert row_.unread == (1,) and row_.held_by == 1
    assert not admits(row_, 0, 0, T, 0)
    # Before the epoch too (the row's frontier is the epoch's start), down to the contract's earliest.
    assert not admits(row_, 0, 0, T - 60 * 365 * 24 * 3600 * 10**6, 0)
    assert not admits(row_, 0, 0, EARLIEST_US, MINUTE)


def test_admits_needs_the_payment_below_its_partitions_watermark_and_before_the_frontier() -> None:
    row_ = cut({0: 5, 1: 3}, {0: Unapplied(9, T + MINUTE), 1: Unapplied(7, T)})
    assert admits(row_, 0, 4, T - 1, 0)
    assert not admits(row_, 0, 5, T - 1, 0), "offset at W(p)"
    # Every payment up to the cut must be applied, those at exactly the frontier's instant included.
    assert not admits(row_, 0, 4, T, 0)
    assert not admits(row_, 2, 0, T - 1, 0), "a partition the cut does not know"
    assert not admits(None, 0, 0, T - 1, 0)


def test_late_payments_within_the_allowed_lateness_do_not_hold_the_gate_and_past_it_do() -> None:
    # Partition 1's first unapplied payment happened 30 s before the payment of partition 0.
    row_ = cut({0: 5, 1: 3}, {0: Unapplied(5, None), 1: Unapplied(7, T - 30_000_000)})
    assert admits(row_, 0, 4, T, 60_000_000), "within a minute's lateness"
    assert not admits(row_, 0, 4, T, 30_000_000), "exactly at the lateness: the payment is at the cut"
    assert not admits(row_, 0, 4, T, 0)


def test_a_decision_records_the_cut_it_was_decided_at() -> None:
    row_ = cut({0: 5, 1: 3}, {0: Unapplied(5, None), 1: Unapplied(7, T + MINUTE)})
    assert decided_at(row_, T, MINUTE) == {
        "at": "2026-11-20T09:59:00Z",
        "frontier": "2026-11-20T10:01:00Z",
        "watermarks": {"0": 5, "1": 3},
    }


def test_a_decision_dated_within_the_lateness_of_year_one_records_the_earliest_instant() -> None:
    """The contract accepts years 0001-9999: the cut a year-1 payment is decided at stops at the earliest
    instant rather than overflow and crash the lane on every worker in turn."""
    first = micros("0001-01-01T00:00:30Z")
    row_ = cut({0: 5}, {0: Unapplied(5, None)})
    assert admits(row_, 0, 4, first, MINUTE)
    assert decided_at(row_, first, MINUTE)["at"] == "0001-01-01T00:00:00Z"


def record(
    value: bytes | None, timestamp: int = 1_800_000_000_000, key: bytes | None = b"a"
) -> ConsumerRecord:
    return ConsumerRecord("payments", 0, 7, timestamp, 0, key, value, None, 0, 0, ())


def test_event_time_reads_a_payments_ts_and_nothing_of_a_record_that_breaks_the_contract() -> None:
    """A record every dependency dead-letters carries no evidence whatever `ts` it holds: read as a
    frontier, one stamped 2099 (or missing its payee) would hide the next real payment of its partition
    from the cut, and payments of other partitions later than that one would be admitted before it."""
    good = payment_json("p1", "a", "b", "10.00", "2026-11-20T10:00:00Z")
    assert event_time(record(good), 65536, 5.0) == T
    assert event_time(record(good, timestamp=-1), 65536, 5.0) == T  # no record timestamp: not bounded
    future = payment_json("p2", "a", "b", "10.00", "2099-01-01T00:00:00Z")
    assert event_time(record(future, timestamp=-1), 65536, 5.0) is not None
    no_payee = json.dumps(
        {"payment_id": "p3", "payer": "a", "amount": "1", "currency": "EUR", "ts": "2026-11-20T10:00:00Z"}
    )
    for broken in (
        record(future),  # more than the clock skew after its record's timestamp
        record(no_payee.encode()),
        record(good, key=b"someone else"),
        record(None),
        record(b""),
        record(b"not json"),
        record(b"[1]"),
        record(b'{"ts": "2026-11-20T10:00:00Z", "payer": "a"}'),
        record(b'{"ts": "yesterday"}'),
    ):
        assert event_time(broken, 65536, 5.0) is None, broken.value
    assert event_time(record(good), 64, 5.0) is None  # larger than the contract allows


async def test_the_gate_waits_for_the_cut_and_a_new_cut_wakes_every_waiter() -> None:
    rows = {0: row(0, 9), 1: row(1, 9)}
    state: dict[str, Any] = {"cut": cut({0: 9, 1: 9}, {0: Unapplied(12, T), 1: Unapplied(9, None)})}
    gate = FreshnessGate(rows.get, recheck_every=60, cut=lambda: state["cut"])
    assert gate.event_time
    opened = await asyncio.wait_for(gate.wait_open(1, 3, T - 1), DEADLINE)
    assert opened.cut is not None and opened.cut["frontier"] == "2026-11-20T10:00:00Z"
    waiter = asyncio.ensure_future(gate.wait_open(1, 4, T + MINUTE))
    done, _ = await asyncio.wait({waiter}, timeout=0.05)
    assert not done and gate.waiting == {1: 4}
    # Partition 0's dependencies pass T: only the cut row changed, not partition 1's row.
    state["cut"] = cut({0: 12, 1: 9}, {0: Unapplied(12, None), 1: Unapplied(9, None)})
    gate.notify_all()
    opened = await asyncio.wait_for(waiter, DEADLINE)
    assert opened.cut == {"at": "2026-11-20T10:01:00Z", "frontier": None, "watermarks": {"0": 12, "1": 9}}
    # Without an event time a payment cannot pass the event-time gate.
    assert not gate.is_open(1, 3)
