"""The operator rules: bottleneck, payments waiting, dependency status (each rule, its boundary, and the
order of precedence), the assembled view, and the stall watch's log lines."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from aml_app.gate.health import (
    ERROR,
    LAGGING,
    OK,
    STALLED,
    STATUSES,
    UNKNOWN_GROUP,
    Limits,
    StallWatch,
    bottleneck,
    dependency_view,
    describe,
    partition_view,
    payments_waiting,
)
from aml_app.gate.watermark import WatermarkRow, build_rows

NOW = 10_000.0
LIMITS = Limits(stall_after=30.0, lag_warn=100)


def rows_for(
    committed: dict[str, dict[int, int | None]],
    log_ends: dict[int, int],
    *,
    advanced: float = NOW,
    own: dict[int, int | None] | None = None,
) -> dict[int, WatermarkRow]:
    """Rows as the leader builds them, every offset last moving at `advanced`."""
    return build_rows(sorted(log_ends), committed, advanced, log_ends=log_ends, service_committed=own or {})


def status_of(group: str, rows: dict[int, WatermarkRow], waiting: dict[int, int] | None = None, **kw: Any):
    view = describe(rows, list(rows[min(rows)].dependencies), NOW, LIMITS, waiting=waiting or {}, **kw)
    return next(d for d in view["dependencies"] if d["group"] == group)


# --- bottleneck and payments waiting ------------------------------------------------------------


def test_bottleneck_is_the_lowest_and_ties_are_all() -> None:
    assert bottleneck({"r": 5, "a": 2, "x": 9}) == ["a"]
    assert bottleneck({"r": 5, "a": 5, "x": 9}) == ["r", "a"]
    assert bottleneck({"r": 0}) == ["r"]
    assert bottleneck({}) == []


@pytest.mark.parametrize(
    ("log_end", "w", "ours", "expected"),
    [
        (10, 4, 2, 6),  # offsets 4..9 lie at or past the watermark
        (10, 4, None, 6),
        (10, 10, 10, 0),
        (10, 12, 3, 0),  # never negative
        (10, 2, 5, 5),  # our commit past W (dependencies reset): count from our commit
        (None, 4, 2, None),  # no log end known: unknown, not zero
    ],
)
def test_payments_waiting(log_end: int | None, w: int, ours: int | None, expected: int | None) -> None:
    assert payments_waiting(log_end, w, ours) == expected


def test_partition_view_takes_the_larger_log_end_and_derives_lags() -> None:
    row = rows_for({"r": {0: 8}, "a": {0: 3}}, {0: 4}, own={0: 3})[0]
    assert row.log_end == 8  # raised to the highest commit by build_rows
    part = partition_view(row, highwater=12, waiting_offset=3, in_flight=None, local=True)
    assert part["log_end"] == 12  # this worker's fetches saw further
    assert part["dependency_lag"] == {"r": 4, "a": 9}
    assert part["lag"] == 9
    assert part["payments_waiting"] == 9
    assert part["bottleneck"] == ["a"]
    assert part["local"] is True and part["waiting_offset"] == 3
    assert partition_view(row, highwater=None)["log_end"] == 8


# --- status rules -------------------------------------------------------------------------------


def test_ok_when_caught_up_or_keeping_up() -> None:
    rows = rows_for({"r": {0: 10, 1: 5}}, {0: 10, 1: 5})
    d = status_of("r", rows)
    assert (d["status"], d["detail"], d["lag"]) == (OK, "caught up", 0)
    rows = rows_for({"r": {0: 9, 1: 5}}, {0: 10, 1: 5})  # behind by one, and just moved
    d = status_of("r", rows)
    assert (d["status"], d["detail"], d["lag"]) == (OK, "keeping up", 1)


def test_unknown_group_needs_no_commit_on_every_partition() -> None:
    rows = rows_for({"r": {0: 10, 1: 5}, "typo": {0: None, 1: None}}, {0: 10, 1: 5})
    assert status_of("typo", rows)["status"] == UNKNOWN_GROUP
    rows = rows_for({"r": {0: 10, 1: 5}, "new": {0: None, 1: 0}}, {0: 10, 1: 5})
    assert status_of("new", rows)["status"] != UNKNOWN_GROUP  # it committed 0 on partition 1


def test_unknown_group_wins_over_stalled() -> None:
    rows = rows_for({"r": {0: 10}, "typo": {0: None}}, {0: 10}, advanced=NOW - 1000)
    assert status_of("typo", rows, waiting={0: 0})["status"] == UNKNOWN_GROUP


def test_stalled_boundaries() -> None:
    def stalled(committed: int, waiting_at: int, quiet: float) -> bool:
        rows = rows_for({"r": {0: committed}}, {0: 20}, advanced=NOW - quiet)
        return status_of("r", rows, waiting={0: waiting_at})["status"] == STALLED

    assert stalled(5, 5, 30.0)  # committed == waiting offset: the payment is held by this group
    assert stalled(3, 5, 31.0)
    assert not stalled(6, 5, 100.0)  # committed past the waiting payment: not holding it
    assert not stalled(5, 5, 29.9)  # not long enough
    rows = rows_for({"r": {0: 5}}, {0: 20}, advanced=NOW - 100)
    assert status_of("r", rows)["status"] == LAGGING  # nobody waits: lagging, not stalled


def test_stalled_names_only_the_partitions_where_it_holds_a_wait() -> None:
    rows = rows_for({"r": {0: 2, 1: 2, 2: 9}, "a": {0: 9, 1: 9, 2: 8}}, {0: 9, 1: 9, 2: 9}, advanced=NOW - 60)
    waiting = {0: 2, 2: 8}
    d = status_of("r", rows, waiting=waiting)
    assert d["status"] == STALLED
    assert d["stalled_partitions"] == [0]  # on 2 it committed past the waiting payment
    assert d["detail"] == "not advanced for 60 s on partition 0 while payments wait (0:2)"
    assert d["holding_back"] == [0, 1]  # payments lie past W on 1 too, but nobody waits there yet
    a = status_of("a", rows, waiting=waiting)
    assert (a["status"], a["stalled_partitions"], a["holding_back"]) == (STALLED, [2], [2])


def test_lagging_by_records_is_strictly_more_than_lag_warn() -> None:
    def status(lag: int) -> str:
        return status_of("r", rows_for({"r": {0: 1000 - lag}}, {0: 1000}))["status"]

    assert status(100) == OK
    assert status(101) == LAGGING
    d = status_of("r", rows_for({"r": {0: 0, 1: 500}}, {0: 500, 1: 900}))
    assert d["lagging_partitions"] == [0, 1] and d["lag"] == 900
    assert d["detail"] == "behind the log end on partitions 0, 1 (up to 500 records)"


def test_lagging_by_time_behind_the_log_end_without_advancing() -> None:
    rows = rows_for({"r": {0: 9}}, {0: 10}, advanced=NOW - 30)
    assert status_of("r", rows)["status"] == LAGGING
    rows = rows_for({"r": {0: 10}}, {0: 10}, advanced=NOW - 3000)
    assert status_of("r", rows)["status"] == OK  # idle at the log end is fine


def test_error_wins_over_everything() -> None:
    rows = rows_for({"r": {0: 1}, "typo": {0: None}}, {0: 10}, advanced=NOW - 1000)
    rows = {p: row.failed("KafkaConnectionError", NOW - 1) for p, row in rows.items()}
    view = describe(rows, ["r", "typo"], NOW, LIMITS, waiting={0: 1})
    assert {d["status"] for d in view["dependencies"]} == {ERROR}
    assert "KafkaConnectionError" in view["dependencies"][0]["detail"]
    assert view["gate"]["admin_error"] == "KafkaConnectionError"
    assert view["gate"]["admin_error_at"] == NOW - 1


def test_a_group_the_leaders_rows_do_not_count_is_an_error_and_never_breaks_the_view() -> None:
    """A group added to AML_DEPENDS_ON during a rolling restart: the leader (still on the old setting)
    writes rows without it. The view names it and keeps every other group's status."""
    rows = rows_for({"r": {0: 4, 1: 7}}, {0: 10, 1: 7}, advanced=NOW - 1000)
    view = describe(rows, ["r", "risk"], NOW, LIMITS, waiting={0: 4})
    r, risk = view["dependencies"]
    assert r["status"] == STALLED and r["committed"] == {"0": 4, "1": 7}
    assert risk["status"] == ERROR and risk["committed"] == {"0": None, "1": None}
    assert risk["detail"].startswith("the leader's rows do not count this group on partitions 0, 1")
    assert risk["stalled_partitions"] == [] and risk["lag"] is None


def test_without_log_ends_lag_is_unknown_and_not_lagging() -> None:
    rows = build_rows([0], {"r": {0: 3}}, NOW - 1000)  # the leader has not read a log end yet
    d = status_of("r", rows)
    assert d["lag"] is None and d["status"] == OK


def test_dependency_view_with_no_partitions_is_unknown() -> None:
    assert dependency_view("r", [], NOW, LIMITS)["status"] == UNKNOWN_GROUP
    assert dependency_view("r", [], NOW, LIMITS, error="boom")["status"] == ERROR


def test_statuses_are_the_five_documented_words() -> None:
    assert STATUSES == ("ok", "lagging", "stalled", "unknown group", "error")


# --- the assembled view ---------------------------------------------------------------------------


def test_describe_gate_and_partitions() -> None:
    rows = rows_for({"r": {0: 4, 1: 7}, "a": {0: 6, 1: 7}}, {0: 10, 1: 7}, advanced=NOW - 5, own={0: 4, 1: 7})
    view = describe(
        rows,
        ["r", "a"],
        NOW,
        LIMITS,
        waiting={0: 4},
        blocked_since={0: NOW - 2},
        in_flight={1: None, 0: 4},
        local={0},
        highwaters={0: 11},
        untrusted={1: "the row is 9.0 s old (more than 5 s): the leader has not refreshed it"},
    )
    p0, p1 = view["partitions"]
    assert p0["untrusted"] is None and p1["untrusted"].startswith("the row is 9.0 s old")
    assert (p0["partition"], p0["log_end"], p0["watermark"], p0["payments_waiting"]) == (0, 11, 4, 7)
    assert (p0["waiting_offset"], p0["blocked_since"], p0["in_flight"], p0["local"]) == (4, NOW - 2, 4, True)
    assert p0["bottleneck"] == ["r"] and p1["bottleneck"] == ["r", "a"]
    assert (p1["log_end"], p1["local"], p1["waiting_offset"], p1["payments_waiting"]) == (7, False, None, 0)
    assert view["gate"] == {
        "refresh_age_s": 5.0,
        "admin_error": None,
        "admin_error_at": None,
        "blocked_partitions": [0],
        "untrusted_partitions": [1],
        "payments_waiting": 7,
        "stall_after_s": 30.0,
        "lag_warn": 100,
        "max_wait_s": 300.0,
        "longest_wait_s": 2.0,
        "breached_partitions": [],
    }
    r = view["dependencies"][0]
    assert r["committed"] == {"0": 4, "1": 7} and r["last_advance"] == NOW - 5
    assert [d["group"] for d in view["dependencies"]] == ["r", "a"]


def test_a_payment_waiting_past_the_bound_marks_its_partition_breached() -> None:
    rows = rows_for({"r": {0: 4, 1: 7, 2: 3}}, {0: 10, 1: 9, 2: 5}, advanced=NOW - 5, own={0: 4, 1: 7, 2: 3})
    limits = Limits(stall_after=30.0, lag_warn=100, max_wait=60.0)
    view = describe(
        rows,
        ["r"],
        NOW,
        limits,
        waiting={0: 4, 1: 7, 2: 3},
        blocked_since={0: NOW - 61, 1: NOW - 59, 2: NOW - 60},
    )
    assert [p["breached"] for p in view["partitions"]] == [True, False, True]
    assert [p["waited_s"] for p in view["partitions"]] == [61.0, 59.0, 60.0]
    assert view["gate"]["breached_partitions"] == [0, 2] and view["gate"]["longest_wait_s"] == 61.0
    quiet = describe(rows, ["r"], NOW, limits)
    assert quiet["gate"]["breached_partitions"] == [] and quiet["gate"]["longest_wait_s"] is None


def test_describe_empty_table() -> None:
    view = describe({}, ["r"], NOW, LIMITS)
    assert view["partitions"] == []
    assert view["gate"]["refresh_age_s"] is None
    assert view["gate"]["payments_waiting"] == 0
    # No row: nothing is known of any group ("unknown group" blamed its name for a refresh that failed).
    assert view["dependencies"] == []


# --- the stall watch ----------------------------------------------------------------------------


def dep(group: str, status: str, parts: list[int] = (), detail: str = "why") -> dict[str, Any]:  # type: ignore[assignment]
    return {"group": group, "status": status, "stalled_partitions": list(parts), "detail": detail}


def test_stall_watch_logs_once_when_a_stall_starts_and_once_when_it_clears() -> None:
    watch = StallWatch()
    assert watch.update([dep("r", OK), dep("a", OK)]) == []
    lines = watch.update([dep("r", STALLED, [0, 2], "not advanced for 31 s"), dep("a", OK)])
    assert lines == [
        (logging.WARNING, "dependency group 'r' stalled on partitions 0, 2: not advanced for 31 s"),
    ]
    assert watch.update([dep("r", STALLED, [0, 2, 3], "later"), dep("a", OK)]) == []  # still the same stall
    lines = watch.update([dep("r", OK), dep("a", OK)])
    assert lines == [(logging.INFO, "dependency group 'r' no longer stalled on partitions 0, 2, 3 (now ok)")]
    assert watch.update([dep("r", OK), dep("a", OK)]) == []


def test_stall_watch_several_groups_and_error() -> None:
    watch = StallWatch()
    lines = watch.update([dep("r", STALLED, [1]), dep("a", STALLED, [1])])
    assert [level for level, _ in lines] == [logging.WARNING, logging.WARNING]
    assert "'r' stalled on partition 1" in lines[0][1] and "'a'" in lines[1][1]
    lines = watch.update([dep("r", ERROR), dep("a", STALLED, [1])])
    assert lines == [(logging.INFO, "dependency group 'r' no longer stalled on partition 1 (now error)")]
