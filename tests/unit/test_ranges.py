"""Offset planning of the Kafka source: where a query starts, how far a micro-batch reads, what it reads."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aml_app.pipeline.ranges import (
    from_spark,
    pack_ranges,
    plan_end,
    planned_ranges,
    starting_offsets,
    to_spark,
)

# --- strategies ---------------------------------------------------------------------------------

offsets = st.integers(min_value=0, max_value=10_000)
limits = st.none() | st.integers(min_value=0, max_value=25_000)


@st.composite
def plans(draw: st.DrawFn) -> tuple[dict[int, int], dict[int, int], int | None]:
    """(start, latest, max_records) as `latestOffset` hands them to `plan_end`.

    Partitions are 0..7; `start` may lack some (new partitions start at 0 here, as `plan_end` assumes
    when the caller did not fold them in), `latest` may lack some (a partition the metadata did not
    list) or lie below `start` (a stale high watermark).
    """
    partitions = draw(st.lists(st.integers(0, 7), min_size=0, max_size=8, unique=True))
    start = {p: draw(offsets) for p in partitions if draw(st.booleans()) or p == 0}
    latest = {}
    for p in partitions:
        if draw(st.integers(0, 9)) == 0:
            continue  # missing from latest
        base = start.get(p, 0)
        latest[p] = draw(st.integers(max(0, base - 50), base + 5_000))
    return start, latest, draw(limits)


def backlog(start: dict[int, int], latest: dict[int, int]) -> dict[int, int]:
    return {p: latest[p] - start.get(p, 0) for p in latest if latest[p] > start.get(p, 0)}


def planned(start: dict[int, int], end: dict[int, int]) -> dict[int, int]:
    return {p: end[p] - start.get(p, 0) for p in end}


# --- plan_end: properties -----------------------------------------------------------------------


@settings(max_examples=400)
@given(plans())
def test_plan_covers_every_known_partition_and_never_goes_backwards(plan) -> None:
    start, latest, limit = plan
    end = plan_end(start, latest, limit)
    assert set(end) == set(start) | set(latest)
    for p, e in end.items():
        assert e >= start.get(p, 0), f"partition {p} went back from {start.get(p, 0)} to {e}"


@settings(max_examples=400)
@given(plans())
def test_plan_never_goes_past_latest(plan) -> None:
    start, latest, limit = plan
    end = plan_end(start, latest, limit)
    for p, e in end.items():
        # A partition whose latest is behind its start (or unknown) stays where it is.
        assert e <= max(start.get(p, 0), latest.get(p, 0))


@settings(max_examples=400)
@given(plans())
def test_plan_never_exceeds_the_limit_and_takes_all_it_may(plan) -> None:
    start, latest, limit = plan
    end = plan_end(start, latest, limit)
    total = sum(planned(start, end).values())
    available = sum(backlog(start, latest).values())
    if limit is None:
        assert total == available
    else:
        assert total <= limit
        # Work-conserving: the budget is only left unused when the backlog runs out.
        assert total == min(limit, available)


@settings(max_examples=400)
@given(plans())
def test_no_partition_with_backlog_starves(plan) -> None:
    start, latest, limit = plan
    waiting = backlog(start, latest)
    end = plan_end(start, latest, limit)
    got = planned(start, end)
    if limit is not None and limit >= len(waiting):
        for p in waiting:
            assert got[p] >= 1, f"partition {p} with {waiting[p]} waiting got nothing of {limit}"
    if limit is not None and waiting:
        # Fair share: each gets its equal share of the budget, or its whole backlog if that is smaller.
        share = limit // len(waiting)
        for p, n in waiting.items():
            assert got[p] >= min(n, share)


@settings(max_examples=300)
@given(plans())
def test_everything_is_taken_when_the_backlog_fits(plan) -> None:
    start, latest, _limit = plan
    available = sum(backlog(start, latest).values())
    everything = {p: max(start.get(p, 0), latest.get(p, 0)) for p in set(start) | set(latest)}
    assert plan_end(start, latest, available) == everything
    assert plan_end(start, latest, available + 1) == everything
    assert plan_end(start, latest, None) == everything


@settings(max_examples=300)
@given(plans(), st.randoms(use_true_random=False))
def test_plan_is_deterministic_whatever_the_dict_order(plan, rnd: random.Random) -> None:
    start, latest, limit = plan

    def shuffled(d: dict[int, int]) -> dict[int, int]:
        items = list(d.items())
        rnd.shuffle(items)
        return dict(items)

    first = plan_end(start, latest, limit)
    assert plan_end(start, latest, limit) == first
    assert plan_end(shuffled(start), shuffled(latest), limit) == first


@settings(max_examples=300)
@given(plans())
def test_plan_leaves_its_inputs_alone(plan) -> None:
    start, latest, limit = plan
    before = (dict(start), dict(latest))
    plan_end(start, latest, limit)
    assert (start, latest) == before


# --- plan_end: examples -------------------------------------------------------------------------


def test_water_filling_gives_what_a_small_backlog_leaves_to_the_others() -> None:
    # 10 waiting on 1, 1000 on 0, nothing on 2: 1 takes its 10, 0 gets the other 90.
    assert plan_end({0: 0, 1: 0, 2: 0}, {0: 1000, 1: 10, 2: 0}, 100) == {0: 90, 1: 10, 2: 0}


def test_equal_backlogs_share_equally() -> None:
    assert plan_end({0: 100, 1: 200}, {0: 1100, 1: 1200}, 100) == {0: 150, 1: 250}


def test_limit_below_partition_count_goes_to_the_smallest_backlogs_first() -> None:
    assert plan_end({0: 0, 1: 0, 2: 0}, {0: 30, 1: 10, 2: 20}, 2) == {0: 0, 1: 1, 2: 1}


def test_zero_limit_reads_nothing() -> None:
    assert plan_end({0: 5, 1: 7}, {0: 50, 1: 70}, 0) == {0: 5, 1: 7}


def test_stale_latest_keeps_the_start() -> None:
    assert plan_end({0: 500}, {0: 1}, None) == {0: 500}
    assert plan_end({0: 500}, {0: 1}, 10) == {0: 500}


def test_partition_missing_from_start_is_read_from_zero() -> None:
    assert plan_end({0: 10}, {0: 10, 1: 40}, None) == {0: 10, 1: 40}
    assert plan_end({0: 10}, {0: 20, 1: 40}, 12) == {0: 16, 1: 6}


def test_no_partitions() -> None:
    assert plan_end({}, {}, None) == {}
    assert plan_end({}, {}, 10) == {}


# --- starting_offsets ---------------------------------------------------------------------------


def test_start_at_the_committed_offset() -> None:
    marks = {0: (0, 100), 1: (0, 100)}
    assert starting_offsets(marks, {0: 40, 1: 100}) == {0: 40, 1: 100}


def test_start_at_the_low_watermark_without_a_commit() -> None:
    marks = {0: (0, 100), 1: (25, 100), 2: (7, 7)}
    assert starting_offsets(marks, {0: None}) == {0: 0, 1: 25, 2: 7}
    assert starting_offsets(marks, {}) == {0: 0, 1: 25, 2: 7}


def test_committed_offset_outside_the_log_is_clamped_into_it() -> None:
    marks = {0: (50, 100), 1: (50, 100)}
    assert starting_offsets(marks, {0: 10, 1: 5000}) == {0: 50, 1: 100}


def test_commits_for_partitions_the_topic_lacks_are_ignored() -> None:
    assert starting_offsets({0: (0, 10)}, {0: 3, 9: 4}) == {0: 3}


@given(
    st.dictionaries(
        st.integers(0, 15),
        st.tuples(offsets, st.integers(0, 10_000)).map(lambda t: (min(t), max(t))),
        max_size=8,
    ),
    st.dictionaries(st.integers(0, 15), st.none() | st.integers(0, 30_000), max_size=8),
)
def test_starting_offsets_always_inside_the_log(marks, committed) -> None:
    start = starting_offsets(marks, committed)
    assert set(start) == set(marks)
    for p, (low, high) in marks.items():
        assert low <= start[p] <= high
        if committed.get(p) is None:
            assert start[p] == low
        elif low <= committed[p] <= high:
            assert start[p] == committed[p]


# --- planned_ranges -----------------------------------------------------------------------------


def test_planned_ranges_skip_partitions_without_records() -> None:
    start = {0: 10, 1: 20, 2: 30, 3: 5}
    end = {0: 15, 1: 20, 2: 30, 3: 9}
    assert planned_ranges(start, end) == [(0, 10, 15), (3, 5, 9)]


def test_planned_ranges_are_sorted_and_new_partitions_start_at_zero() -> None:
    assert planned_ranges({1: 3}, {2: 4, 1: 8, 0: 0}) == [(1, 3, 8), (2, 0, 4)]


def test_planned_ranges_of_an_empty_batch() -> None:
    assert planned_ranges({0: 4}, {0: 4}) == []
    assert planned_ranges({}, {}) == []


@settings(max_examples=300)
@given(plans())
def test_planned_ranges_cover_exactly_the_planned_records(plan) -> None:
    start, latest, limit = plan
    end = plan_end(start, latest, limit)
    ranges = planned_ranges(start, end)
    assert all(s < e for _p, s, e in ranges)
    assert len({p for p, _s, _e in ranges}) == len(ranges)
    assert sum(e - s for _p, s, e in ranges) == sum(planned(start, end).values())


# --- Spark's offset form ------------------------------------------------------------------------


def test_to_spark_uses_sorted_string_keys_and_survives_json() -> None:
    spark = to_spark({10: 3, 2: 7, 0: 1})
    assert list(spark) == ["0", "2", "10"]  # numeric order, so equal offsets serialise alike
    assert all(isinstance(k, str) and type(v) is int for k, v in spark.items())
    assert json.loads(json.dumps(spark)) == spark


def test_to_spark_is_independent_of_dict_order() -> None:
    assert json.dumps(to_spark({1: 5, 0: 4})) == json.dumps(to_spark({0: 4, 1: 5}))


@given(st.dictionaries(st.integers(0, 10_000), st.integers(0, 2**62), max_size=20))
def test_spark_offsets_round_trip(offsets_by_partition) -> None:
    spark = to_spark(offsets_by_partition)
    assert from_spark(spark) == offsets_by_partition
    # Spark stores the offset as JSON and hands it back parsed.
    assert from_spark(json.loads(json.dumps(spark))) == offsets_by_partition
    assert to_spark(from_spark(spark)) == spark


def test_from_spark_accepts_numeric_strings() -> None:
    assert from_spark({"3": "12"}) == {3: 12}  # type: ignore[dict-item]


@pytest.mark.parametrize("bad", [{"x": 1}, {"1": "next"}])
def test_from_spark_rejects_garbage(bad) -> None:
    with pytest.raises(ValueError):
        from_spark(bad)


# --- pack_ranges: tasks of a micro-batch -----------------------------------------------------------

range_lists = st.lists(
    st.tuples(st.integers(0, 63), st.integers(0, 1000), st.integers(1, 5000)),
    max_size=24,
    unique_by=lambda r: r[0],
).map(lambda rs: sorted((p, s, s + n) for p, s, n in rs))


@settings(max_examples=400)
@given(range_lists, st.none() | st.integers(1, 8))
def test_packing_keeps_every_range_once_within_the_task_limit(ranges, max_tasks) -> None:
    tasks = pack_ranges(ranges, max_tasks)
    flat = [r for task in tasks for r in task]
    assert sorted(flat) == ranges, "a range was lost, split or duplicated"
    assert all(task for task in tasks), "an empty task"
    if max_tasks is not None:
        assert len(tasks) <= max_tasks
    for task in tasks:
        assert list(task) == sorted(task)


@settings(max_examples=400)
@given(range_lists, st.integers(1, 8))
def test_packing_balances_within_one_range_of_the_ideal(ranges, max_tasks) -> None:
    tasks = pack_ranges(ranges, max_tasks)
    if not ranges:
        assert tasks == []
        return
    sizes = [e - s for _, s, e in ranges]
    loads = [sum(e - s for _, s, e in task) for task in tasks]
    assert max(loads) <= sum(sizes) / min(max_tasks, len(ranges)) + max(sizes)


def test_packing_without_a_limit_or_with_room_keeps_one_task_per_partition() -> None:
    ranges = [(0, 0, 10), (1, 5, 6), (3, 0, 100)]
    assert pack_ranges(ranges, None) == [((0, 0, 10),), ((1, 5, 6),), ((3, 0, 100),)]
    assert pack_ranges(ranges, 3) == pack_ranges(ranges, None)


def test_four_partitions_on_two_cores_make_two_equal_tasks() -> None:
    ranges = [(0, 0, 100), (1, 0, 100), (2, 0, 100), (3, 0, 100)]
    assert pack_ranges(ranges, 2) == [((0, 0, 100), (2, 0, 100)), ((1, 0, 100), (3, 0, 100))]


def test_packing_refuses_a_task_limit_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        pack_ranges([(0, 0, 1), (1, 0, 1)], 0)


@settings(max_examples=400)
@given(range_lists, st.none() | st.integers(1, 8), st.integers(1, 20000))
def test_a_small_batch_is_read_by_fewer_tasks(ranges, max_tasks, min_records) -> None:
    tasks = pack_ranges(ranges, max_tasks, min_records)
    assert sorted(r for task in tasks for r in task) == ranges, "a range was lost, split or duplicated"
    records = sum(e - s for _, s, e in ranges)
    if ranges:
        assert 1 <= len(tasks) <= max(1, -(-records // min_records))
        assert len(tasks) == min(len(ranges), max_tasks or len(ranges), max(1, -(-records // min_records)))


def test_two_thousand_records_on_four_partitions_make_one_task_and_fifty_thousand_two() -> None:
    small = [(p, 0, 500) for p in range(4)]
    assert pack_ranges(small, 2, 5000) == [tuple(small)]
    large = [(p, 0, 12500) for p in range(4)]
    assert pack_ranges(large, 2, 5000) == pack_ranges(large, 2)
    assert len(pack_ranges(large, 2, 5000)) == 2
    with pytest.raises(ValueError, match="at least 1"):
        pack_ranges(small, 2, 0)
