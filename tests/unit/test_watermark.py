"""Watermark arithmetic: W(p) = min committed offset over the groups; (p, o) open iff o < W(p)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aml_app.gate.watermark import build_rows, is_open, live_demand, refresh_due, watermark

# --- watermark ----------------------------------------------------------------------------------


def test_watermark_is_the_minimum() -> None:
    assert watermark({"relations": 10, "aggregates": 7, "other": 12}) == 7


def test_watermark_single_group() -> None:
    assert watermark({"relations": 3}) == 3


def test_none_counts_as_zero() -> None:
    assert watermark({"relations": 10, "aggregates": None}) == 0
    assert watermark({"relations": None}) == 0


def test_negative_counts_as_zero() -> None:
    assert watermark({"relations": 10, "aggregates": -1001}) == 0
    assert watermark({"relations": -1}) == 0


def test_empty_raises() -> None:
    with pytest.raises(ValueError, match="at least one"):
        watermark({})


# --- is_open ------------------------------------------------------------------------------------


def test_offset_equal_to_watermark_is_closed() -> None:
    assert is_open(5, {"watermark": 5}) is False


def test_offset_one_below_watermark_is_open() -> None:
    assert is_open(4, {"watermark": 5}) is True


def test_offset_above_watermark_is_closed() -> None:
    assert is_open(6, {"watermark": 5}) is False


def test_zero_watermark_closes_offset_zero() -> None:
    assert is_open(0, {"watermark": 0}) is False


def test_missing_row_is_closed() -> None:
    assert is_open(0, None) is False


# --- build_rows ---------------------------------------------------------------------------------


def test_build_rows() -> None:
    committed = {
        "relations": {0: 10, 1: None, 2: 5, 3: 8},
        "aggregates": {0: 7, 2: -1, 3: 9},
    }
    rows = build_rows([0, 1, 2, 3], committed, refreshed_at=123.5)
    assert set(rows) == {0, 1, 2, 3}
    assert rows[0] == {
        "partition": 0,
        "watermark": 7,
        "dependencies": {"relations": 10, "aggregates": 7},
        "refreshed_at": 123.5,
    }
    # None and a missing partition both count as 0
    assert rows[1]["dependencies"] == {"relations": 0, "aggregates": 0}
    assert rows[1]["watermark"] == 0
    # negative offsets are clamped to 0
    assert rows[2]["dependencies"] == {"relations": 5, "aggregates": 0}
    assert rows[2]["watermark"] == 0
    assert rows[3]["watermark"] == 8
    assert all(rows[p]["partition"] == p for p in rows)


def test_build_rows_only_for_requested_partitions() -> None:
    rows = build_rows([2], {"g": {0: 1, 2: 4}}, 0.0)
    assert list(rows) == [2]
    assert rows[2]["watermark"] == 4


def test_build_rows_without_groups_raises() -> None:
    with pytest.raises(ValueError):
        build_rows([0], {}, 0.0)


# --- live_demand --------------------------------------------------------------------------------


def test_live_demand_min_across_workers_ignoring_stale() -> None:
    now = 1000.0
    entries = [
        {"at": now - 10, "waiting": {"0": 1, "2": 1}},  # stale: older than max_age
        {"at": now, "waiting": {"0": 7, "1": 3}},
        {"at": now - 1, "waiting": {"0": 4}},
    ]
    assert live_demand(entries, now, max_age=5) == {0: 4, 1: 3}


def test_live_demand_string_partition_keys_become_ints() -> None:
    result = live_demand([{"at": 10.0, "waiting": {"3": 9}}, {"at": 10.0, "waiting": {3: 2}}], 10, 5)
    assert result == {3: 2}
    assert all(isinstance(p, int) for p in result)


def test_live_demand_age_boundary_is_inclusive() -> None:
    assert live_demand([{"at": 95.0, "waiting": {"0": 1}}], now=100.0, max_age=5) == {0: 1}
    assert live_demand([{"at": 94.9, "waiting": {"0": 1}}], now=100.0, max_age=5) == {}


def test_live_demand_tolerates_missing_fields() -> None:
    # no "at": treated as epoch 0, stale; no "waiting": contributes nothing
    assert live_demand([{"waiting": {"0": 1}}, {"at": 100.0}], now=100.0, max_age=5) == {}


def test_live_demand_empty() -> None:
    assert live_demand([], now=1.0, max_age=1.0) == {}


# --- refresh_due --------------------------------------------------------------------------------

SLOW, FAST = 1.0, 0.1


def due(age: float | None, waiting: dict[int, int], rows: dict[int, dict]) -> bool:
    now = 500.0
    last = None if age is None else now - age
    return refresh_due(now, last, waiting, rows, SLOW, FAST)


def test_first_refresh_is_always_due() -> None:
    assert due(None, {}, {}) is True


def test_slow_interval_elapsed() -> None:
    assert due(SLOW, {}, {}) is True
    assert due(SLOW + 5, {}, {}) is True


def test_nothing_waiting_waits_for_slow_interval() -> None:
    assert due(0.5, {}, {}) is False
    assert due(0.999, {}, {}) is False


def test_blocked_partition_uses_fast_interval() -> None:
    rows = {0: {"watermark": 5}}
    assert due(FAST, {0: 5}, rows) is True
    assert due(0.5, {0: 9}, rows) is True
    assert due(FAST / 2, {0: 5}, rows) is False  # even blocked, not faster than the fast interval


def test_waiting_but_open_partition_waits_for_slow_interval() -> None:
    rows = {0: {"watermark": 5}}
    assert due(0.5, {0: 4}, rows) is False


def test_any_blocked_partition_triggers_fast_refresh() -> None:
    rows = {0: {"watermark": 5}, 1: {"watermark": 2}}
    assert due(0.5, {0: 1, 1: 2}, rows) is True


def test_partition_without_row_counts_as_blocked() -> None:
    assert due(0.5, {3: 0}, {0: {"watermark": 100}}) is True


# --- property -----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    committed=st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.one_of(st.none(), st.integers(min_value=-5, max_value=50)),
        min_size=1,
        max_size=6,
    ),
    offset=st.integers(min_value=0, max_value=55),
)
def test_open_iff_every_group_committed_past_the_offset(
    committed: dict[str, int | None], offset: int
) -> None:
    expected = all((c if c is not None else 0) > offset for c in committed.values())
    assert is_open(offset, {"watermark": watermark(committed)}) == expected
    row = build_rows([0], {g: {0: c} for g, c in committed.items()}, 0.0)[0]
    assert is_open(offset, row) == expected
