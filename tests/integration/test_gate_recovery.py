"""Failures around the gate: a worker killed with SIGKILL, the broker unreachable for a while."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from aml_app.harness.verify import CommitTimeline, premature
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
