"""FreshnessGate over a plain dict, and retry_forever; every wait is bounded by a deadline."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import replace
from typing import Any

import pytest

from aml_app.backoff import Backoff, jittered, retry_forever
from aml_app.gate.gate import FreshnessGate
from aml_app.gate.watermark import WatermarkRow, distrust

DEADLINE = 2.0  # generous upper bound for things that should happen at once
QUIET = 0.05  # how long a waiter must stay blocked to count as "not woken"


def row(p: int, w: int) -> WatermarkRow:
    return WatermarkRow(partition=p, watermark=w, dependencies={"relations": w}, refreshed_at=0.0)


async def spin(times: int = 5) -> None:
    """Let ready tasks (a waiter starting, a notify task) run."""
    for _ in range(times):
        await asyncio.sleep(0)


async def start_waiting(gate: FreshnessGate, p: int, offset: int) -> asyncio.Task[Any]:
    task = asyncio.ensure_future(gate.wait_open(p, offset))
    await spin()
    assert not task.done(), "the waiter should be blocked"
    assert gate.waiting.get(p, -1) <= offset, "waiting shows the lowest waiting offset"
    return task


async def assert_still_blocked(task: asyncio.Task[Any]) -> None:
    done, _ = await asyncio.wait({task}, timeout=QUIET)
    assert not done, "the waiter returned although its partition is closed or was not notified"


async def cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, DEADLINE)


async def test_wait_open_returns_immediately_when_open() -> None:
    rows = {0: row(0, 5)}
    gate = FreshnessGate(rows.get)
    result = await asyncio.wait_for(gate.wait_open(0, 4), DEADLINE)
    assert result.row is rows[0] and result.cut is None and result.stale is None
    assert gate.waiting == {}
    assert gate.blocked_since == {}


async def test_gate_row_and_is_open_read_the_lookup() -> None:
    rows = {0: row(0, 5)}
    gate = FreshnessGate(rows.get)
    assert gate.row(0) is rows[0]
    assert gate.row(1) is None
    assert gate.is_open(0, 4) is True
    assert gate.is_open(0, 5) is False
    assert gate.is_open(1, 0) is False


async def test_blocks_until_updated_and_notified() -> None:
    rows = {0: row(0, 5)}
    gate = FreshnessGate(rows.get)
    before = time.time()
    task = await start_waiting(gate, 0, 5)
    assert before <= gate.blocked_since[0] <= time.time()

    rows[0] = row(0, 6)
    gate.notify([0])
    result = await asyncio.wait_for(task, DEADLINE)
    assert result.watermark == 6
    assert gate.waiting == {}
    assert gate.blocked_since == {}


async def test_blocks_on_a_partition_without_row() -> None:
    rows: dict[int, dict[str, Any]] = {}
    gate = FreshnessGate(rows.get)
    task = await start_waiting(gate, 2, 0)
    gate.notify([2])  # still no row: the waiter re-checks and keeps waiting
    await assert_still_blocked(task)
    rows[2] = row(2, 1)
    gate.notify([2])
    assert (await asyncio.wait_for(task, DEADLINE)).watermark == 1


async def test_notify_while_still_closed_keeps_waiting() -> None:
    rows = {0: row(0, 5)}
    gate = FreshnessGate(rows.get)
    task = await start_waiting(gate, 0, 7)
    rows[0] = row(0, 7)  # advanced, but offset 7 is still not < 7
    gate.notify([0])
    await assert_still_blocked(task)
    assert gate.waiting == {0: 7}
    rows[0] = row(0, 8)
    gate.notify([0])
    assert (await asyncio.wait_for(task, DEADLINE)).watermark == 8
    assert gate.waiting == {}


async def test_notify_of_another_partition_does_not_wake_it() -> None:
    rows = {0: row(0, 5), 1: row(1, 0)}
    gate = FreshnessGate(rows.get)
    task = await start_waiting(gate, 0, 5)
    rows[0] = row(0, 6)  # open now, but only partition 1 is notified
    gate.notify([1])
    await assert_still_blocked(task)
    assert gate.waiting == {0: 5}
    gate.notify([0])
    assert (await asyncio.wait_for(task, DEADLINE)).watermark == 6


async def test_cancellation_clears_waiting() -> None:
    rows = {0: row(0, 0)}
    gate = FreshnessGate(rows.get)
    task = await start_waiting(gate, 0, 3)
    assert 0 in gate.blocked_since
    await cancel(task)
    assert gate.waiting == {}
    assert gate.blocked_since == {}
    # the partition's condition is still usable after the cancellation
    task = await start_waiting(gate, 0, 3)
    rows[0] = row(0, 4)
    gate.notify([0])
    assert (await asyncio.wait_for(task, DEADLINE)).watermark == 4


@pytest.mark.parametrize("turns", range(8))
async def test_a_cancel_right_after_a_notification_ends_the_waiter(turns: int) -> None:
    """A revoke cancels a lane waiting at the gate, typically while the leader re-stamps the still
    closed rows and notifies. Python 3.11's `asyncio.wait_for` returns the inner result instead of
    raising when the cancel lands after the inner `cond.wait()` finished but before the waiter ran
    again: the cancel was lost, and the stopped lane waited on and later handled its old queue a
    second time beside its successor (chaos soak seed 5, aml-1). Every interleaving must cancel."""
    rows = {0: row(0, 0)}
    gate = FreshnessGate(rows.get)
    task = await start_waiting(gate, 0, 3)
    rows[0] = row(0, 1)  # re-stamped, still closed for offset 3
    gate.notify([0])
    await spin(turns)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=QUIET)
    try:
        assert done, f"the cancel {turns} turns after a notification was swallowed: the waiter waits on"
        assert task.cancelled()
        assert gate.waiting == {}
    finally:
        task.cancel()


async def test_partitions_are_independent() -> None:
    rows = {0: row(0, 0), 1: row(1, 10)}
    gate = FreshnessGate(rows.get)
    blocked = await start_waiting(gate, 0, 3)
    result = await asyncio.wait_for(gate.wait_open(1, 3), DEADLINE)
    assert result.row.partition == 1
    assert not blocked.done()
    assert gate.waiting == {0: 3}
    rows[0] = row(0, 4)
    gate.notify([0, 1])
    assert (await asyncio.wait_for(blocked, DEADLINE)).row.partition == 0


async def test_two_waiters_on_one_partition_both_wake() -> None:
    rows = {0: row(0, 0)}
    gate = FreshnessGate(rows.get)
    first = await start_waiting(gate, 0, 5)
    second = await start_waiting(gate, 0, 10)
    assert gate.waiting == {0: 5}
    rows[0] = row(0, 6)
    gate.notify([0])
    assert (await asyncio.wait_for(first, DEADLINE)).watermark == 6
    assert gate.waiting == {0: 10}, "the remaining waiter is still visible"
    rows[0] = row(0, 11)
    gate.notify([0])
    try:
        assert (await asyncio.wait_for(second, 0.2)).watermark == 11
    finally:
        second.cancel()


# --- retry_forever ------------------------------------------------------------------------------


async def test_retry_forever_retries_until_success() -> None:
    calls = 0

    async def action() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise RuntimeError(f"failure {calls}")
        return "done"

    result = await asyncio.wait_for(retry_forever("test", action, first_delay=0.001), DEADLINE)
    assert result == "done"
    assert calls == 3


async def test_retry_forever_does_not_retry_cancellation() -> None:
    calls = 0

    async def action() -> None:
        nonlocal calls
        calls += 1
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(retry_forever("test", action, first_delay=0.001), DEADLINE)
    assert calls == 1


async def test_retry_forever_cancelled_during_backoff() -> None:
    calls = 0

    async def action() -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("always")

    task = asyncio.ensure_future(retry_forever("test", action, first_delay=30))
    await spin()
    assert calls == 1
    await cancel(task)
    assert calls == 1


async def test_retry_forever_backs_off_exponentially_up_to_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float, *args: Any, **kwargs: Any) -> Any:
        delays.append(delay)
        return await real_sleep(0)

    calls = 0

    async def action() -> int:
        nonlocal calls
        calls += 1
        if calls <= 5:
            raise OSError("down")
        return calls

    monkeypatch.setattr("aml_app.gate.consumer.asyncio.sleep", recording_sleep)
    failures: list[tuple[int, str, float]] = []
    result = await asyncio.wait_for(
        retry_forever(
            "test",
            action,
            first_delay=0.5,
            max_delay=2.0,
            on_failure=lambda attempt, exc, wait: failures.append((attempt, str(exc), wait)),
        ),
        DEADLINE,
    )
    calls = 0
    exact = await asyncio.wait_for(
        retry_forever("test", action, first_delay=0.5, max_delay=2.0, jitter=lambda d: d), DEADLINE
    )
    monkeypatch.undo()
    assert result == exact == 6
    caps = [0.5, 1.0, 2.0, 2.0, 2.0]
    jittered, unjittered = delays[:5], delays[5:]
    assert unjittered == caps
    # Jitter: each wait in [cap/2, cap), so failing lanes do not retry in lockstep.
    assert all(cap / 2 <= d < cap for d, cap in zip(jittered, caps, strict=True))
    assert failures == [(i + 1, "down", d) for i, d in enumerate(jittered)]


def test_jitter_spreads_within_its_bounds() -> None:
    waits = [jittered(1.0) for _ in range(2000)]
    assert all(0.5 <= w < 1.0 for w in waits)
    assert max(waits) - min(waits) > 0.4, "the waits are spread, not constant"


async def test_a_waiter_rechecks_the_table_on_a_timer_when_no_notification_comes() -> None:
    """A table hook that stops firing (say, after a Faust upgrade) slows the gate; it never hangs it."""
    rows: dict[int, dict[str, Any]] = {}
    gate = FreshnessGate(rows.get, recheck_every=0.02)
    waiter = await start_waiting(gate, 0, 3)
    rows[0] = row(0, 3)  # not past offset 3: the timer's re-check keeps it waiting
    await assert_still_blocked(waiter)
    rows[0] = row(0, 4)  # the watermark moves, and nobody calls notify()
    assert (await asyncio.wait_for(waiter, DEADLINE)).row is rows[0]
    assert gate.opened_by_recheck == 1
    assert gate.waiting == {}


async def test_a_distrusted_row_keeps_the_gate_closed_whatever_its_watermark() -> None:
    """A row the worker may not trust (too old, or replayed from before its consumer generation) admits
    nothing; the leader's next write of a trusted row lets the waiter through."""
    rows = {0: replace(row(0, 10), generation=1)}
    generation = 2
    gate = FreshnessGate(
        rows.get,
        distrust=lambda r: None if (r.generation or 0) >= generation else "written before this generation",
    )
    assert gate.is_open(0, 4) is False
    assert gate.distrusted(0) == "written before this generation"
    task = await start_waiting(gate, 0, 4)
    await assert_still_blocked(task)

    rows[0] = replace(row(0, 10), generation=2)
    gate.notify([0])
    result = await asyncio.wait_for(task, DEADLINE)
    assert result.row.generation == 2 and gate.distrusted(0) is None


class SteppingClock:
    """A wall clock that moves `step` seconds at each reading once stepping: time passing, or a clock
    stepped, between two evaluations of the same row."""

    def __init__(self, now: float) -> None:
        self.now, self.step = now, 0.0

    def __call__(self) -> float:
        now = self.now
        self.now += self.step
        return now


async def test_a_row_that_ages_out_as_the_waiter_wakes_never_ends_the_wait_with_an_error() -> None:
    """Trust is read off the clock, so each wake evaluates the row once and returns what that evaluation
    saw: a row fresh at one reading and too old at the next keeps the waiter waiting or lets it through,
    never raises (an error out of the gate ends the lane, and the worker stops)."""
    clock = SteppingClock(100.0)
    rows = {0: row(0, 10)}  # written at 0.0: too old
    gate = FreshnessGate(
        rows.get, recheck_every=60, distrust=lambda r: distrust(r, clock(), max_age=5.0, generation=None)
    )
    task = await start_waiting(gate, 0, 4)
    gate.notify([0])
    await assert_still_blocked(task)  # still too old: the wait goes on

    rows[0] = replace(row(0, 10), refreshed_at=clock.now)
    clock.step = 6.0  # each reading is 6 s after the one before: fresh once, then past the 5 s max age
    gate.notify([0])
    result = await asyncio.wait_for(task, DEADLINE)
    assert result.row is rows[0]
    assert gate.waiting == {}


async def test_give_up_after_returns_the_closed_row_marked_stale() -> None:
    rows = {0: row(0, 3)}
    gate = FreshnessGate(rows.get, recheck_every=60)
    started = time.monotonic()
    result = await asyncio.wait_for(gate.wait_open(0, 5, give_up_after=0.05), DEADLINE)
    assert time.monotonic() - started >= 0.05
    assert result.watermark == 3 and result.stale is not None and result.stale >= 0.05
    assert gate.waiting == {}
    # An open partition is never stale.
    assert (await asyncio.wait_for(gate.wait_open(0, 2, give_up_after=0.05), DEADLINE)).stale is None


async def test_retry_with_a_ceiling_raises_the_last_failure() -> None:
    calls = []

    async def failing() -> None:
        calls.append(1)
        raise ValueError(f"failure {len(calls)}")

    with pytest.raises(ValueError, match="failure 3"):
        await retry_forever("x", failing, first_delay=0.001, attempts=3)
    assert len(calls) == 3


# --- the refresh policy ------------------------------------------------------------------------------


def test_every_pace_of_the_gate_derives_from_the_operators_intervals() -> None:
    from aml_app.gate.watermark import RefreshPolicy

    policy = RefreshPolicy(interval=2.0, fast=0.1, stall_after=4.0)
    assert (policy.gate_recheck, policy.row_rewrite, policy.operator_read, policy.delivery_check) == (
        2,
        2,
        2,
        2,
    )
    assert (policy.partition_recheck, policy.demand_republish, policy.demand_max_age) == (20, 1, 6)
    assert policy.delivery_quiet == 4
    assert policy.stall_check == 1.0  # four times per stall, within the intervals
    assert RefreshPolicy(interval=1.0, fast=0.5, stall_after=0.4).stall_check == 0.5


def test_the_refresh_interval_is_read_in_one_place_only() -> None:
    """Outside the settings, `refresh_interval` is read once, to build the policy: a new pace is a
    property of `RefreshPolicy`, not another multiple of the interval somewhere."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = [*root.joinpath("aml_app").rglob("*.py"), *root.joinpath("agents").glob("*.py")]
    files += root.joinpath("tables").glob("*.py")
    reads = [
        str(path.relative_to(root))
        for path in files
        if path.name != "settings.py"
        for _ in re.finditer(r"\.(fast_)?refresh_interval\b", path.read_text())
    ]
    assert reads == ["tables/watermarks.py"] * 2  # `refresh = RefreshPolicy(...)`: both intervals


# --- Backoff ------------------------------------------------------------------------------------


def test_a_backoff_doubles_up_to_its_cap_and_jitters_each_delay() -> None:
    assert [Backoff(0.5, 2.0).next() for _ in range(1)] == [0.5]
    plain = Backoff(0.5, 2.0)
    assert [plain.next() for _ in range(5)] == [0.5, 1.0, 2.0, 2.0, 2.0]
    halved = Backoff(0.5, 2.0, jitter=lambda d: d / 2)
    assert [halved.next() for _ in range(4)] == [0.25, 0.5, 1.0, 1.0]
    # A first delay past the cap is kept once (a caller's explicit first wait), then capped.
    assert [d for b in [Backoff(30, 5)] for d in (b.next(), b.next())] == [30, 5]
    with pytest.raises(ValueError):
        Backoff(0, 1)


async def test_a_backoff_sleeps_no_longer_than_it_is_allowed() -> None:
    backoff = Backoff(30, 60)
    started = time.monotonic()
    assert await asyncio.wait_for(backoff.sleep(at_most=0.01), DEADLINE) == 0.01
    assert time.monotonic() - started < 5
    assert backoff.next() == 60  # the sleep used the first delay
