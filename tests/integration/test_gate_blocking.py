"""Where the gate must hold: the exact boundary, one frozen partition, a long dependency stall."""

from __future__ import annotations

import asyncio

import pytest

from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka.tools import produce
from tests.harness import committed_offsets, ends_of, payments_for, wait_until

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
    broker, names, producer, new_worker, deps, decision_log
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

    # The service's own committed offset stops exactly at the waiting payment, never past it.
    async def own_commit_reached() -> dict[int, int] | None:
        committed = await committed_offsets(broker.bootstrap, names.app_id, names.payments, 4)
        return committed if committed[0] == 2 and committed[1] == ends[1] else None

    await wait_until(own_commit_reached, 30, "the service to commit up to the waiting payment")

    # One dependency past it is not enough: the watermark is the minimum.
    first, second = names.deps
    await timeline.commit({first: deps[first]}, {0: 3})
    await refreshed_after(
        worker,
        lambda s: s["watermarks"]["0"]["dependencies"][first] == 3 and s["waiting"].get("0") == 2,
    )
    await decision_log.poll(0.5)
    assert (0, 2) not in decision_log.decided()

    committed = await committed_offsets(broker.bootstrap, names.app_id, names.payments, 4)
    assert committed[0] == 2, "committed past a payment that is still waiting"

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


async def test_rebalance_completes_while_every_partition_is_blocked(
    broker, names, producer, new_worker, deps, decision_log
):
    """Waiting lanes are cancelled on revoke, so a blocked worker does not hold up a rebalance."""
    placed = await produce(producer, names.payments, payments_for(names.partitions, 5, "rb"))
    first = new_worker()
    await first.wait_ready(set(range(names.partitions)))
    await wait_until(
        lambda: _matching(first, lambda s: len(s["waiting"]) == names.partitions),
        30,
        "every partition to be waiting",
    )
    second = new_worker()

    async def shared() -> bool:
        a, b = await first.state(), await second.state()
        if not a or not b or a["recovering"] or b["recovering"]:
            return False
        owned = [set(a["assigned"]), set(b["assigned"])]
        return all(owned) and owned[0] | owned[1] == set(range(names.partitions))

    await wait_until(shared, 60, "the rebalance to complete with both workers owning partitions")
    committed = await committed_offsets(broker.bootstrap, names.app_id, names.payments, 4)
    assert set(committed.values()) <= {-1, 0}, f"committed past waiting payments: {committed}"
    timeline = CommitTimeline()
    await timeline.commit(deps, ends_of(placed))
    await decision_log.wait_for(set(placed), timeout=30)
    made = decision_log.decisions()
    assert premature(made, names.deps, timeline) == []
    assert {d["worker"] for d in made} == {first.worker_id, second.worker_id}


async def test_back_pressure_pauses_only_the_blocked_partition_and_resumes(
    names, producer, new_worker, deps, decision_log
):
    """More payments than AML_MAX_PENDING behind a closed gate: the partition pauses, the others flow,
    and once the gate opens it resumes and drains without losing anything."""
    placed = await produce(producer, names.payments, payments_for(names.partitions, 60, "bp"))
    ends = ends_of(placed)
    worker = new_worker(AML_MAX_PENDING="8")
    await worker.wait_ready(set(range(names.partitions)))
    timeline = CommitTimeline()
    await timeline.commit(deps, {p: ends[p] for p in range(1, names.partitions)})
    await decision_log.wait_for({(p, o) for p, o in placed if p != 0}, timeout=30)
    assert not any(p == 0 for p, _ in decision_log.decided())

    await timeline.commit(deps, {0: ends[0]})
    await decision_log.wait_for(set(placed), timeout=30)
    assert premature(decision_log.decisions(), names.deps, timeline) == []
    state = await worker.state()
    assert state is not None, "the worker survived the pause and resume"
