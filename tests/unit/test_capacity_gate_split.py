"""The capacity benchmark splits the gate's own share at the first row of the gate's table that opens the
gate on a payment: rows written as the leader writes them, opened as the gate opens."""

from __future__ import annotations

from aml_app.gate.event_time import Cut
from aml_app.gate.watermark import WatermarkRow
from bench.capacity import published_at

SECOND = 1_000_000


def cut(at: float, watermarks: dict[int, int], frontier_s: int | None) -> tuple[float, dict]:
    row = Cut(
        watermarks={str(p): w for p, w in watermarks.items()},
        frontier=None if frontier_s is None else frontier_s * SECOND,
        held_by=None,
        refreshed_at=at,
    )
    return at, row.as_json()


def watermark(at: float, partition: int, w: int) -> tuple[float, dict]:
    return at, WatermarkRow(partition, w, {"b": w, "c": w}, at).as_json()


def test_an_event_time_payment_opens_at_the_first_cut_past_its_offset_and_its_time() -> None:
    rows = [
        cut(10.0, {0: 4, 1: 9}, 100),  # offset 5 not covered yet
        cut(10.1, {0: 6, 1: 9}, 100),  # covered, but the frontier is at 100 s: ts 100 s waits
        cut(10.2, {0: 6, 1: 9}, 101),  # ts 100 s < frontier: opens
        cut(10.3, {0: 7, 1: 9}, None),
    ]
    first = published_at(rows, "event-time", 0)
    assert first(0, 5, 100 * SECOND, 9.0) == 10.2
    assert first(0, 5, 99 * SECOND, 9.0) == 10.1
    assert first(0, 6, 100 * SECOND, 9.0) == 10.3
    assert first(0, 7, 100 * SECOND, 9.0) is None  # no row opens on it
    # With a second of lateness allowed, ts 100 s opens under the frontier of 100 s.
    assert published_at(rows, "event-time", SECOND)(0, 5, 100 * SECOND, 9.0) == 10.1


def test_a_row_written_before_the_payment_was_sent_does_not_count() -> None:
    rows = [cut(10.0, {0: 9}, None), cut(12.0, {0: 9}, None)]
    assert published_at(rows, "event-time", 0)(0, 5, 0, 11.0) == 12.0


def test_a_partition_payment_opens_at_its_partitions_first_watermark_past_it() -> None:
    rows = [watermark(10.0, 1, 50), watermark(10.1, 0, 5), watermark(10.2, 0, 6), watermark(10.3, 1, 60)]
    first = published_at(rows, "partition", 0)
    assert first(0, 5, 0, 9.0) == 10.2
    assert first(1, 49, 0, 9.0) == 10.0
    assert first(1, 50, 0, 9.0) == 10.3
    assert first(0, 6, 0, 9.0) is None
