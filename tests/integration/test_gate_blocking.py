"""Where the gate must hold: the exact boundary, one frozen partition, a long dependency stall."""

from __future__ import annotations

import asyncio

import pytest

from aml_app.kafka_tools import produce
from tests.harness import CommitTimeline, ends_of, payments_for, premature, wait_until

pytestmark = pytest.mark.integration


async def refreshed_after(worker, predicate, refreshes: int = 3, timeout: float = 30) -> dict:
    """Wait until the worker's state satisfies `predicate` and the leader has refreshed `refreshes`
    more times since: the gate has demonstrably seen that state (no fixed sleep)."""
    state = await wait_until(lambda: _matching(worker, predicate), timeout, "the expected gate state")
    target = state["refresh"]["refreshes"] + refreshes

    async def enough() -> dict | None:
        now = await worker.state()
        return now if now and now["refresh"]["refreshes"] >= target and predicate(now) else None

    return await wait_until(enough, timeout, f"{refreshes} more refreshes")


async def _matching(worker, predicate) -> dict | None:
    state = await worker.state()
    return state if state and predicate(state) else None


async def test_boundary_every_dependency_exactly_at_o_keeps_o_waiting(
    names, producer, new_worker, deps, decision_log
):
    placed = await produce(producer, names.payments, payments_for(names.partitions, 4, "b"))
    ends = ends_of(placed)
    worker = new_worker()
    await worker.wait_ready(set(range(names.partitions)))
    timeline = CommitTimeline()
    # Partition 0: every dependency has committed exactly 2, i.e. finished offsets 0 and 1 only.
    await timeline.commit(deps, {0: 2, **{p: ends[p] for p in range(1, names.partitions)}})
    await decision_log.wait_for({(p, o) for p, o in placed if p != 0 or o < 2}, timeout=30)

    await refreshed_after(
        worker, lambda s: s["waiting"].get("0") == 2 and s["watermarks"]["0"]["watermark"] == 2
    )
    await decision_log.poll(0.5)
    assert (0, 2) not in decision_log.decided()

    # One dependency past it is not enough: the watermark is the minimum.
    first, second = names.deps
    await timeline.commit({first: deps[first]}, {0: 3})
    await refreshed_after(
        worker,
        lambda s: s["watermarks"]["0"]["dependencies"][first] == 3 and s["waiting"].get("0") == 2,
    )
    await decision_log.poll(0.5)
    assert (0, 2) not in decision_log.decided()

    await timeline.commit({second: deps[second]}, {0: 3})
    await decision_log.wait_for({(0, 2)}, timeout=15)
    assert (0, 3) not in decision_log.decided()
    assert premature(decision_log.decisions(), names.deps, timeline) == []


async def test_frozen_partition_does_not_hold_up_the_others(names, producer, new_worker, deps, decision_log):
    # Partition 0's payments come first in every round, so a worker that waits in its main loop
    # would stall on the very first one and decide nothing else.
    placed = await produce(producer, names.payments, payments_for(names.partitions, 30, "f"))
    ends = ends_of(placed)
    worker = new_worker()
    await worker.wait_ready(set(range(names.partitions)))
    timeline = CommitTimeline()
    await timeline.commit(deps, {p: ends[p] for p in range(1, names.partitions)})

    await decision_log.wait_for({(p, o) for p, o in placed if p != 0}, timeout=30)
    assert not any(p == 0 for p, _ in decision_log.decided())
    state = await worker.state()
    assert state["waiting"] == {"0": 0}

    await timeline.commit(deps, {0: ends[0]})
    await decision_log.wait_for(set(placed), timeout=30)
    assert premature(decision_log.decisions(), names.deps, timeline) == []


async def test_stall_of_three_session_timeouts_neither_evicts_nor_loses(
    names, producer, new_worker, deps, decision_log
):
    session_timeout = 4.0
    placed = await produce(producer, names.payments, payments_for(names.partitions, 10, "s"))
    ends = ends_of(placed)
    worker = new_worker(AML_SESSION_TIMEOUT=str(session_timeout))
    ready = await worker.wait_ready(set(range(names.partitions)))
    timeline = CommitTimeline()
    await timeline.commit(deps, {p: 5 for p in range(names.partitions)})
    await decision_log.wait_for({(p, o) for p, o in placed if o < 5}, timeout=30)

    # The stall is the scenario itself: the dependencies commit nothing for 3x the session timeout.
    loop = asyncio.get_running_loop()
    stall_ends = loop.time() + 3 * session_timeout
    while loop.time() < stall_ends:
        state = await worker.state()
        assert state is not None and len(state["waiting"]) == names.partitions
        assert state["rebalances"] == ready["rebalances"], "the worker was evicted or rebalanced"
        await decision_log.poll(1.0)
    assert all(o < 5 for _, o in decision_log.decided())

    await timeline.commit(deps, ends)
    await decision_log.wait_for(set(placed), timeout=15)
    after = await worker.state()
    assert after["rebalances"] == ready["rebalances"]
    assert sorted(after["assigned"]) == list(range(names.partitions))
    assert premature(decision_log.decisions(), names.deps, timeline) == []
