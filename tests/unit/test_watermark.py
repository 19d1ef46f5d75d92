"""Watermark arithmetic: W(p) = min committed offset over the groups; (p, o) open iff o < W(p)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aml_app.gate.event_time import Cut, Unapplied, cut_row
from aml_app.gate.watermark import (
    Demand,
    WatermarkRow,
    build_rows,
    derived_need,
    distrust,
    is_open,
    live_blocked_since,
    live_demand,
    refresh_due,
    row_changed,
    watermark,
)

#: A row from its JSON, as the gate reads the table's values (fields left out take their defaults).
R = WatermarkRow.from_json


def entries_of(docs: list[dict[str, Any]]) -> list[Demand]:
    """Demand entries from their JSON, as the leader reads the demand table."""
    return [Demand.from_json(doc) for doc in docs]


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
    assert is_open(5, R({"watermark": 5})) is False


def test_offset_one_below_watermark_is_open() -> None:
    assert is_open(4, R({"watermark": 5})) is True


def test_offset_above_watermark_is_closed() -> None:
    assert is_open(6, R({"watermark": 5})) is False


def test_zero_watermark_closes_offset_zero() -> None:
    assert is_open(0, R({"watermark": 0})) is False


def test_missing_row_is_closed() -> None:
    assert is_open(0, None) is False


# --- build_rows ---------------------------------------------------------------------------------


def test_build_rows() -> None:
    committed = {
        "relations": {0: 10, 1: None, 2: 5, 3: 8},
        "aggregates": {0: 7, 2: -1, 3: 9},
    }
    rows = build_rows([0, 1, 2, 3], committed, refreshed_at=123.5, generation=7, log="c:t1")
    assert set(rows) == {0, 1, 2, 3}
    assert rows[0].as_json() == {
        "partition": 0,
        "watermark": 7,
        "dependencies": {"relations": 10, "aggregates": 7},
        "refreshed_at": 123.5,
        # the operator fields: nothing read about them (no log ends, no own commits), first sighting
        "log_end": None,
        "service_committed": None,
        "never_committed": [],
        "advanced_at": {"relations": 123.5, "aggregates": 123.5},
        "generation": 7,
        "log": "c:t1",
    }
    # None and a missing partition both count as 0
    assert rows[1].dependencies == {"relations": 0, "aggregates": 0}
    assert rows[1].watermark == 0
    # negative offsets are clamped to 0
    assert rows[2].dependencies == {"relations": 5, "aggregates": 0}
    assert rows[2].watermark == 0
    assert rows[3].watermark == 8
    assert all(rows[p].partition == p for p in rows)


def test_build_rows_only_for_requested_partitions() -> None:
    rows = build_rows([2], {"g": {0: 1, 2: 4}}, 0.0)
    assert list(rows) == [2]
    assert rows[2].watermark == 4


def test_build_rows_without_groups_raises() -> None:
    with pytest.raises(ValueError):
        build_rows([0], {}, 0.0)


def test_build_rows_log_end_is_never_below_a_committed_offset() -> None:
    committed = {"relations": {0: 10, 1: 4}, "aggregates": {0: 7, 1: None}}
    # Tansu answers ListOffsets with a batch's base offset + 1: 3 on partition 0, short of the commits.
    rows = build_rows([0, 1, 2], committed, 1.0, log_ends={0: 3, 1: 9}, service_committed={0: 12, 1: None})
    assert rows[0].log_end == 12  # our own commit proves the log reaches 12
    assert rows[1].log_end == 9
    assert rows[2].log_end is None  # no log end read for partition 2
    assert rows[0].service_committed == 12
    assert rows[1].service_committed is None


def test_build_rows_own_commit_negative_means_none() -> None:
    rows = build_rows([0], {"g": {0: 1}}, 1.0, log_ends={0: 5}, service_committed={0: -1})
    assert rows[0].service_committed is None
    assert rows[0].log_end == 5


def test_build_rows_never_committed_lists_none_and_negative_offsets() -> None:
    rows = build_rows([0, 1], {"a": {0: None, 1: 3}, "b": {0: -1}, "c": {0: 0, 1: 2}}, 1.0)
    assert rows[0].never_committed == ("a", "b")  # an explicit 0 is a commit
    assert rows[1].never_committed == ("b",)
    assert rows[0].watermark == 0 and rows[1].watermark == 0  # the gate's rule is unchanged


def test_build_rows_advanced_at_kept_while_the_offset_stays_and_reset_when_it_moves() -> None:
    first = build_rows([0], {"r": {0: 5}, "a": {0: 2}}, 100.0)
    assert first[0].advanced_at == {"r": 100.0, "a": 100.0}
    second = build_rows([0], {"r": {0: 6}, "a": {0: 2}}, 105.0, previous=first)
    assert second[0].advanced_at == {"r": 105.0, "a": 100.0}
    # a group moving backwards (its offsets were reset) moved too
    third = build_rows([0], {"r": {0: 6}, "a": {0: 1}}, 110.0, previous=second)
    assert third[0].advanced_at == {"r": 105.0, "a": 110.0}


def test_build_rows_advanced_at_from_an_error_row_or_an_old_row_shape() -> None:
    errored = build_rows([0], {"r": {0: 5}}, 100.0)[0].failed("boom", 101.0)
    assert build_rows([0], {"r": {0: 5}}, 102.0, previous={0: errored})[0].advanced_at == {"r": 100.0}
    old_shape = R({"partition": 0, "watermark": 5, "dependencies": {"r": 5}, "refreshed_at": 90.0})
    assert build_rows([0], {"r": {0: 5}}, 102.0, previous={0: old_shape})[0].advanced_at == {"r": 102.0}
    assert build_rows([0], {"r": {0: 5}}, 102.0, previous={0: None})[0].advanced_at == {"r": 102.0}


def test_row_changed() -> None:
    base = build_rows([0], {"r": {0: 5}}, 100.0, log_ends={0: 8}, service_committed={0: 3})[0]
    same_later = build_rows([0], {"r": {0: 5}}, 200.0, log_ends={0: 8}, service_committed={0: 3})[0]
    assert row_changed(None, base)
    assert not row_changed(base, same_later)  # only the times differ
    assert row_changed(replace(base, error="x"), same_later)
    changes: list[dict[str, Any]] = [
        {"log_end": 9},
        {"service_committed": 4},
        {"watermark": 6},
        {"never_committed": ("r",)},
    ]
    for change in changes:
        assert row_changed(base, replace(same_later, **change)), change
    assert row_changed(
        base, build_rows([0], {"r": {0: 6}}, 200.0, log_ends={0: 8}, service_committed={0: 3})[0]
    )


# --- live_demand --------------------------------------------------------------------------------


def test_live_demand_min_across_workers_ignoring_stale() -> None:
    now = 1000.0
    entries = [
        {"at": now - 10, "waiting": {"0": 1, "2": 1}},  # stale: older than max_age
        {"at": now, "waiting": {"0": 7, "1": 3}},
        {"at": now - 1, "waiting": {"0": 4}},
    ]
    assert live_demand(entries_of(entries), now, max_age=5) == {0: 4, 1: 3}


def test_live_demand_string_partition_keys_become_ints() -> None:
    result = live_demand(
        entries_of([{"at": 10.0, "waiting": {"3": 9}}, {"at": 10.0, "waiting": {3: 2}}]), 10, 5
    )
    assert result == {3: 2}
    assert all(isinstance(p, int) for p in result)


def test_live_demand_age_boundary_is_inclusive() -> None:
    assert live_demand(entries_of([{"at": 95.0, "waiting": {"0": 1}}]), now=100.0, max_age=5) == {0: 1}
    assert live_demand(entries_of([{"at": 94.9, "waiting": {"0": 1}}]), now=100.0, max_age=5) == {}


def test_live_demand_tolerates_missing_fields() -> None:
    # no "at": treated as epoch 0, stale; no "waiting": contributes nothing
    assert live_demand(entries_of([{"waiting": {"0": 1}}, {"at": 100.0}]), now=100.0, max_age=5) == {}


def test_live_demand_empty() -> None:
    assert live_demand([], now=1.0, max_age=1.0) == {}


def test_live_blocked_since_earliest_over_recent_entries() -> None:
    now = 1000.0
    entries = [
        {"at": now - 10, "waiting": {"0": 1}, "since": {"0": 1.0}},  # stale
        {"at": now, "waiting": {"0": 7, "1": 3}, "since": {"0": 990.0, "1": 995.0}},
        {"at": now - 1, "waiting": {"0": 4}, "since": {"0": 980.0}},
        {"at": now, "waiting": {"2": 1}},  # an entry from before "since" existed
    ]
    assert live_blocked_since(entries_of(entries), now, max_age=5) == {0: 980.0, 1: 995.0}


# --- refresh_due --------------------------------------------------------------------------------

SLOW, FAST = 1.0, 0.1


def due(age: float | None, waiting: dict[int, int], rows: dict[int, WatermarkRow]) -> bool:
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
    rows = {0: R({"watermark": 5})}
    assert due(FAST, {0: 5}, rows) is True
    assert due(0.5, {0: 9}, rows) is True
    assert due(FAST / 2, {0: 5}, rows) is False  # even blocked, not faster than the fast interval


def test_waiting_but_open_partition_waits_for_slow_interval() -> None:
    rows = {0: R({"watermark": 5})}
    assert due(0.5, {0: 4}, rows) is False


def test_the_event_time_gate_refreshes_fast_while_anything_waits() -> None:
    """Its payments can wait on the cut while their own row is open."""
    rows = {0: R({"watermark": 5})}
    assert refresh_due(500.0, 499.5, {0: 4}, rows, SLOW, FAST, every_wait=True) is True
    assert refresh_due(500.0, 499.95, {0: 4}, rows, SLOW, FAST, every_wait=True) is False
    assert refresh_due(500.0, 499.5, {}, rows, SLOW, FAST, every_wait=True) is False


def test_any_blocked_partition_triggers_fast_refresh() -> None:
    rows = {0: R({"watermark": 5}), 1: R({"watermark": 2})}
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
    assert is_open(offset, R({"watermark": watermark(committed)})) == expected
    row = build_rows([0], {g: {0: c} for g, c in committed.items()}, 0.0)[0]
    assert is_open(offset, row) == expected


# --- distrust ------------------------------------------------------------------------------------


def test_a_recent_row_of_this_generation_is_trusted() -> None:
    row = R({"watermark": 5, "refreshed_at": 100.0, "generation": 3})
    assert distrust(row, now=104.0, max_age=5.0, generation=3) is None
    assert distrust(row, now=105.0, max_age=5.0, generation=3) is None  # exactly max_age old
    assert distrust(row, now=104.0, max_age=5.0, generation=2) is None  # a newer generation's row


def test_a_row_older_than_the_max_age_is_not_trusted() -> None:
    row = R({"watermark": 5, "refreshed_at": 100.0, "generation": 3})
    reason = distrust(row, now=105.5, max_age=5.0, generation=3)
    assert reason == "the row is 5.5 s old (more than 5 s): the leader has not refreshed it"
    failed = distrust(row, now=105.5, max_age=5.0, generation=3, failure=lambda: "no answer within 5 s")
    assert failed == "the row is 5.5 s old (more than 5 s): the leader's read failed: no answer within 5 s"


def test_the_failure_of_a_row_is_asked_only_when_the_row_is_old() -> None:
    def failure() -> str:
        raise AssertionError("asked for a recent row")

    row = R({"watermark": 5, "refreshed_at": 100.0, "generation": 3})
    assert distrust(row, now=104.0, max_age=5.0, generation=3, failure=failure) is None


def test_a_row_of_an_earlier_generation_is_not_trusted() -> None:
    """Replayed from the changelog at a restart, or written before the last rebalance (the generation
    counts from 0, so 0 is a generation like any other)."""
    row = R({"watermark": 5, "refreshed_at": 100.0, "generation": 0})
    assert "written in consumer generation 0, before this worker's 1" in distrust(row, 100.0, 5.0, 1)
    assert distrust(row, 100.0, 5.0, 0) is None
    unstamped = R({"watermark": 5, "refreshed_at": 100.0})
    assert "generation None" in distrust(unstamped, 100.0, 5.0, 0)
    assert distrust(unstamped, 100.0, 5.0, None) is None  # no generation to compare with


def test_a_row_of_another_log_is_not_trusted() -> None:
    """The payments topic deleted and created again (or another cluster): offsets of two logs."""
    row = R({"watermark": 5, "refreshed_at": 100.0, "generation": 3, "log": "c:old"})
    assert distrust(row, 100.0, 5.0, 3, log="c:old") is None
    reason = distrust(row, 100.0, 5.0, 3, log="c:new")
    assert reason is not None and reason.startswith("the row's offsets are of log c:old, but this worker")
    assert distrust(replace(row, log=None), 100.0, 5.0, 3, log="c:new") is not None
    assert distrust(row, 100.0, 5.0, 3, log=None) is None  # the worker has not read its log yet


def test_a_row_that_does_not_count_every_group_this_worker_depends_on_is_not_trusted() -> None:
    """A group added to AML_DEPENDS_ON during a rolling restart: the leader on the old setting writes
    W(p) without it, and a worker on the new one must not admit payments the new group has not applied.
    A leader counting more groups than the worker gives a lower W(p): safe, so trusted."""
    row = build_rows([0], {"relations": {0: 9}, "aggregates": {0: 8}}, 100.0, generation=3)[0]
    assert row.groups == ("relations", "aggregates")
    assert distrust(row, 100.0, 5.0, 3, groups=("aggregates", "relations")) is None
    assert distrust(row, 100.0, 5.0, 3, groups=("relations",)) is None
    reason = distrust(row, 100.0, 5.0, 3, groups=("relations", "aggregates", "risk"))
    assert reason is not None and reason.startswith(
        "the row's watermark does not count group risk, which this worker depends on"
    )
    cut = cut_row({0: 8}, {0: Unapplied(8, None)}, 100.0, generation=3, groups=("relations", "aggregates"))
    assert Cut.from_json(cut.as_json()) == cut and cut.groups == ("relations", "aggregates")
    assert distrust(cut, 100.0, 5.0, 3, groups=("relations", "aggregates")) is None
    assert distrust(cut, 100.0, 5.0, 3, groups=("relations", "aggregates", "risk")) is not None
    unnamed = Cut.from_json({k: v for k, v in cut.as_json().items() if k != "groups"})
    assert distrust(unnamed, 100.0, 5.0, 3, groups=("relations",)) is not None


def test_a_cut_that_misses_a_partition_this_worker_knows_of_is_not_trusted() -> None:
    """Partitions added to the payments topic: a cut the leader read before it knew of them says
    nothing of the payments there, so a worker whose consumer sees more partitions than the cut covers
    admits nothing on it. A partition's own row speaks for itself only, and is judged as before."""
    unapplied = {p: Unapplied(8, None) for p in (0, 1)}
    cut = cut_row({0: 8, 1: 8}, unapplied, 100.0, generation=3, groups=("relations",))
    assert cut.partitions == 2
    assert distrust(cut, 100.0, 5.0, 3, groups=("relations",), partitions=2) is None
    assert distrust(cut, 100.0, 5.0, 3, groups=("relations",), partitions=0) is None  # not known yet
    reason = distrust(cut, 100.0, 5.0, 3, groups=("relations",), partitions=3)
    assert reason is not None and reason.startswith(
        "the cut covers 2 partitions, but the payments topic has 3 as this worker's consumer sees it"
    )
    row = build_rows([0], {"relations": {0: 9}}, 100.0, generation=3)[0]
    assert row.partitions is None
    assert distrust(row, 100.0, 5.0, 3, groups=("relations",), partitions=3) is None


def test_the_leader_refreshes_fast_for_a_waiter_on_a_row_of_an_earlier_generation() -> None:
    """The row is open by its watermark, but this worker cannot trust it: the next refresh stamps it."""
    rows = {0: R({"watermark": 10, "generation": 2})}
    assert refresh_due(10.3, 10.0, {0: 4}, rows, 1.0, 0.1, generation=3) is True
    assert refresh_due(10.3, 10.0, {0: 4}, rows, 1.0, 0.1, generation=2) is False
    assert refresh_due(10.05, 10.0, {0: 4}, rows, 1.0, 0.1, generation=3) is False  # not yet


def test_rows_and_the_cut_carry_a_derived_groups_offsets_and_the_need_takes_the_highest() -> None:
    committed = {"b": {0: 5, 1: 6}, "c": {0: 4, 1: 4}}
    rows = build_rows([0, 1], committed, refreshed_at=1.0, derived={"c": {0: 17, 2: 3}})
    assert rows[0].derived == rows[1].derived == {"c": {"0": 17, "2": 3}}
    assert build_rows([0], committed, refreshed_at=1.0)[0].derived is None
    assert row_changed(
        rows[0], build_rows([0, 1], committed, refreshed_at=2.0, derived={"c": {0: 18, 2: 3}})[0]
    )
    cut = SimpleNamespace(derived={"c": {"0": 16, "2": 9}, "d": {"1": 1}})
    assert derived_need(rows[0], cut) == {"c": {0: 17, 2: 9}, "d": {1: 1}}
    assert derived_need(None, None) == {}


def test_a_row_and_the_cut_read_back_from_their_json_are_themselves() -> None:
    """The table holds each row's JSON (the changelog's format, `/watermarks.json`); the gate reads it
    back into the same row, every field, an error and a derived group's offsets included."""
    from aml_app.gate.event_time import Cut, Unapplied, cut_row

    rows = build_rows(
        [0, 1],
        {"b": {0: 5, 1: None}},
        refreshed_at=7.0,
        log_ends={0: 9},
        service_committed={0: 2},
        generation=3,
        log="c:t",
        derived={"c": {0: 17}},
    )
    for row in (*rows.values(), rows[0].failed("boom", 8.0)):
        assert WatermarkRow.from_json(row.as_json()) == row
    cut = cut_row(
        {0: 5, 1: 0}, {0: Unapplied(9, 1_000)}, 7.0, generation=3, log="c:t", derived={"c": {"0": 17}}
    )
    assert Cut.from_json(cut.as_json()) == cut
    assert cut.as_json()["unread"] == [1] and "derived" not in cut_row({0: 5}, {}, 7.0).as_json()


def test_a_demand_entry_read_back_from_its_json_is_itself() -> None:
    entry = Demand(at=5.0, waiting={0: 3}, since={0: 4.5}, retrying={1: {"offset": 7, "attempts": 2}})
    assert entry.as_json() == {
        "waiting": {"0": 3},
        "retrying": {"1": {"offset": 7, "attempts": 2}},
        "since": {"0": 4.5},
        "at": 5.0,
    }
    assert Demand.from_json(entry.as_json()) == entry
