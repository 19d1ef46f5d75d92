"""Failures around the gate: a worker killed with SIGKILL, the broker unreachable for a while."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from aml_app.harness.verify import CommitTimeline, decided_at, premature
from aml_app.kafka.tools import produce
from tests.harness import ends_of, payments_for, wait_until

pytestmark = pytest.mark.integration


async def advance(deps, timeline: CommitTimeline, ends: dict[int, int], step: int, pause: float) -> None:
    """Play dependencies that keep committing a little further, until they reach the log end."""
    position = dict.fromkeys(ends, 0)
    while position != ends:
        position = {p: min(ends[p], position[p] + step) for p in ends}
        await timeline.commit(deps, position)
        await asyncio.sleep(pause)


async def test_kill_9_mid_stream_then_restart_loses_nothing_and_decides_nothing_early(
    names, producer, new_worker, deps, decision_log
):
    placed = await produce(producer, names.payments, payments_for(names.partitions, 40, "k"))
    ends = ends_of(placed)
    timeline = CommitTimeline()
    first = new_worker()
    await first.wait_ready(set(range(names.partitions)))
    flowing = asyncio.create_task(advance(deps, timeline, ends, step=2, pause=0.15))
    try:
        # Kill once a fair share is decided, while later payments still wait on the gate.
        await _decisions_at_least(decision_log, 40)
        first.kill()
        second = new_worker()
        await second.wait_ready(set(range(names.partitions)))
        await flowing
    finally:
        flowing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flowing

    await decision_log.wait_for(set(placed), timeout=60)
    made = decision_log.decisions()
    assert premature(made, names.deps, timeline) == []
    assert {d["payment_id"] for d in made} == {f"k-{p}-{i}" for p in range(4) for i in range(40)}
    workers_seen = {d["worker"] for d in made}
    assert workers_seen == {first.worker_id, second.worker_id}, "both workers decided some payments"


async def _decisions_at_least(decision_log, count: int) -> None:
    async def enough() -> bool:
        await decision_log.poll(0.1)
        return len(decision_log.records) >= count

    await wait_until(enough, 60, f"{count} decisions", interval=0)


async def test_broker_unreachable_gate_holds_then_recovers(
    broker, names, producer, new_worker, deps, decision_log
):
    placed = await produce(producer, names.payments, payments_for(names.partitions, 10, "u"))
    ends = ends_of(placed)
    worker = new_worker()
    await worker.wait_ready(set(range(names.partitions)))
    timeline = CommitTimeline()
    await timeline.commit(deps, {p: 4 for p in range(names.partitions)})
    await decision_log.wait_for({(p, o) for p, o in placed if o < 4}, timeout=30)
    before = await worker.state()

    broker.pause()  # SIGSTOP: connections hang, nothing is lost
    try:

        async def refresh_failed() -> dict | None:
            state = await worker.state()
            return state if state and state["refresh"]["errors"] > before["refresh"]["errors"] else None

        during = await wait_until(refresh_failed, 60, "the worker to report a failed refresh")
        # The last known watermarks hold, with the error visible on the rows.
        for p in range(names.partitions):
            row = during["watermarks"][str(p)]
            assert row["watermark"] == 4
        assert during["refresh"]["last_error"]
    finally:
        broker.resume()

    await timeline.commit(deps, ends)
    await decision_log.wait_for(set(placed), timeout=90)
    assert premature(decision_log.decisions(), names.deps, timeline) == []

    async def healthy() -> dict | None:
        state = await worker.state()
        ok = state and state["refresh"]["last_error"] is None
        return state if ok and not any(r.get("error") for r in state["watermarks"].values()) else None

    await wait_until(healthy, 30, "the refresh error to clear")


async def test_a_restarted_worker_waits_for_its_leaders_refresh_not_rows_replayed_from_before(
    names, producer, new_worker, deps, decision_log
):
    """The watermark table outlives its workers: a restarted worker replays rows an earlier leader wrote.
    Here they say W = 10, but the dependency groups have since been moved back to 2 (a reset), so
    payments 2.. must wait. The new worker's leader refreshes only every 15 s: until its first refresh
    the replayed rows are all it has, and it must not admit anything on them."""
    partitions = range(names.partitions)
    first_payments = await produce(producer, names.payments, payments_for(names.partitions, 2, "r"))
    timeline = CommitTimeline()
    await timeline.commit(deps, dict.fromkeys(partitions, 10))
    first = new_worker()
    await decision_log.wait_for(set(first_payments), timeout=60)

    async def rows_at_ten() -> bool:
        state = await first.state()
        rows = (state or {}).get("watermarks", {}).values()
        return len(rows) == names.partitions and all(r["watermark"] == 10 for r in rows)

    await wait_until(rows_at_ten, 30, "the first worker's rows to say W = 10")
    assert first.stop(grace=30)

    await timeline.commit(deps, dict.fromkeys(partitions, 2))
    later = await produce(producer, names.payments, payments_for(names.partitions, 4, "s"))
    second = new_worker(AML_REFRESH_INTERVAL="15", AML_FAST_REFRESH_INTERVAL="15")

    async def held_at_two() -> dict | None:
        state = await second.state()
        if not state or state["recovering"] or state["waiting"] != {str(p): 2 for p in partitions}:
            return None
        return state

    state = await wait_until(held_at_two, 60, "the restarted worker to hold every partition at offset 2")
    await decision_log.poll(0.2)
    assert not decision_log.decided() & set(later), "decided on rows replayed from the earlier leader"
    reasons = {row["partition"]: row["untrusted"] for row in state["partitions"]}
    if any(reasons.values()):  # before the first refresh: the page says why the gate is closed
        assert all("before this worker's" in (reason or "") for reason in reasons.values()), reasons

    opened_at = time.time()
    await timeline.commit(deps, dict.fromkeys(partitions, 6))
    await decision_log.wait_for(set(later), timeout=60)
    made = [d for d in decision_log.decisions() if (d["partition"], d["offset"]) in set(later)]
    assert all(decided_at(d) >= opened_at for d in made), "a payment was decided before it was covered"
