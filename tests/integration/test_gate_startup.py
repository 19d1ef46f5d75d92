"""A worker whose very first payments wait, on the real broker.

The dependency groups have never committed, so every payment waits from the worker's first second and
its first table writes (the demand it publishes, the leader's rows) happen while it waits. Faust's
`Producer.key_partition` read the producer's metadata without waiting for it, so a table write could
crash a worker whose producer did not know the changelog topic (yet, or any more: aiokafka refreshes
only the topics it tracks once it tracks any, so a send to a topic it learned late drops the changelog
from its metadata). Each test then lets the dependencies commit and checks every payment was decided
once and none early.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka.broker import create_topics
from aml_app.kafka.tools import end_offsets, produce
from tests.harness import DecisionLog, TopicReader, ends_of, payments_for, produce_in_transactions, wait_until

pytestmark = pytest.mark.integration


async def held_and_publishing(worker, partitions: int, writes: int = 3) -> dict:
    """Until every partition waits at the gate, this worker's demand went through the table `writes`
    times without an error, and the leader reads it back (the refresh runs on the fast interval)."""

    async def ready() -> dict | None:
        state = await worker.state()  # fails at once if the worker has exited
        if not state or state["recovering"] or len(state["waiting"]) != partitions:
            return None
        demand = state["table_writes"]["demand"]
        assert demand["errors"] == 0, demand
        return state if demand["writes"] >= writes else None

    first = await wait_until(ready, 60, "every partition to wait and the demand to be published")

    async def fast() -> bool:
        state = await worker.state()
        return bool(state) and state["refresh"]["refreshes"] >= first["refresh"]["refreshes"] + 20

    await wait_until(fast, 60, "the leader to refresh on the fast interval for the published demand")
    return first


async def decided_once_none_early(decision_log: DecisionLog, names, timeline, placed) -> None:
    await decision_log.wait_for(set(placed), timeout=60)
    made = decision_log.decisions()
    assert premature(made, names.deps, timeline) == []
    ids = [d["payment_id"] for d in made]
    assert len(ids) == len(set(ids)) == len(placed), "each payment decided exactly once"
    assert {(d["partition"], d["offset"]) for d in made} == set(placed)


@pytest.mark.parametrize("payments_first", [True, False], ids=["backlog", "live"])
async def test_first_payments_wait_without_crashing(
    names, producer, new_worker, deps, decision_log, payments_first
):
    """The issue's scenario: payments before or after the start, dependencies that never committed."""
    batch = payments_for(names.partitions, 5, "s")
    placed = await produce(producer, names.payments, batch) if payments_first else []
    worker = new_worker()
    if not payments_first:
        await wait_until(worker.state, 60, "the worker to answer")
        placed = await produce(producer, names.payments, batch)
    await held_and_publishing(worker, names.partitions)
    assert decision_log.decided() == set()
    timeline = CommitTimeline()
    await timeline.commit(deps, ends_of(placed))
    await decided_once_none_early(decision_log, names, timeline, placed)
    state = await worker.state()
    assert state["table_writes"]["demand"]["errors"] == 0
    assert state["table_writes"]["watermarks"]["errors"] == 0


async def test_a_topic_the_producer_learns_late_does_not_stop_the_table_writes(
    broker, names, producer, new_worker, deps, decision_log
):
    """Deterministic form of the crash: the dead-letter topic is created after the worker started, so
    the first dead letter makes the producer track that topic only. Before the fix the next table write
    crashed the worker with TypeError("'NoneType' object is not iterable") in `key_partition`."""
    late_dlq = f"late-dlq-{names.suffix}"
    worker = new_worker(AML_DLQ_TOPIC=late_dlq)
    await wait_until(lambda: _recovered(worker), 60, "the worker to be up")
    await create_topics([broker.bootstrap], [late_dlq], names.partitions)
    placed = await produce(
        producer, names.payments, [(0, b"acct-0", b"not json"), *payments_for(names.partitions, 5, "l")]
    )
    malformed, valid = placed[0], placed[1:]

    async def dead_lettered() -> bool:
        state = await worker.state()
        return bool(state) and state["dead_lettered"] == 1

    await wait_until(dead_lettered, 60, "the malformed payment in the late dead-letter topic")
    first = await held_and_publishing(worker, names.partitions)
    await held_and_publishing(worker, names.partitions, writes=first["table_writes"]["demand"]["writes"] + 3)
    timeline = CommitTimeline()
    await timeline.commit(deps, ends_of(placed))
    await decided_once_none_early(decision_log, names, timeline, valid)
    dlq = await TopicReader(broker.bootstrap, late_dlq, names.partitions).start()
    try:
        await wait_until(lambda: _polled(dlq), 30, "the dead letter to be readable")
        assert [(r.partition, r.value) for r in dlq.records] == [(malformed[0], b"not json")]
    finally:
        await dlq.stop()


async def test_every_topic_the_worker_writes_stays_in_its_producers_metadata(
    names, producer, new_worker, decision_log
):
    """aiokafka drops a topic it does not track from its metadata once it tracks another one (the first
    table write tracks the changelogs); the decisions topic's partitions then had no leader, every send
    to it hung, and an ungated worker stopped after about 400 decisions of a backlog, every time."""
    placed = await produce(producer, names.payments, payments_for(names.partitions, 1000, "m"))
    new_worker(AML_GATE="off", AML_MAX_PENDING="2000")
    await decision_log.wait_for(set(placed), timeout=120)
    ids = [d["payment_id"] for d in decision_log.decisions()]
    assert len(ids) == len(set(ids)) == len(placed), "each payment decided exactly once"


async def test_transactional_payments_leave_gaps_and_are_decided_once_none_early(
    broker, names, new_worker, deps, decision_log
):
    """Payments written in transactions: each commit marker takes an offset, so a partition's offsets
    have gaps the lane must cross (and not mistake for records Faust skipped)."""
    worker = new_worker()
    await wait_until(lambda: _recovered(worker), 60, "the worker to be up")
    rng = random.Random(11)
    placed = await asyncio.to_thread(
        produce_in_transactions, broker.bootstrap, names, payments_for(names.partitions, 12, "t"), rng
    )
    ends = await end_offsets([broker.bootstrap], names.payments, range(names.partitions))
    assert any(ends[p] > ends_of(placed)[p] for p in ends), "commit markers take offsets"
    await held_and_publishing(worker, names.partitions)

    # The dependencies advance in random steps up to the log end (markers included), in random order.
    timeline = CommitTimeline()
    steps = [(g, p, o) for g in deps for p in range(names.partitions) for o in range(2, ends[p] + 2, 2)]
    rng.shuffle(steps)
    done: dict[tuple[str, int], int] = {}
    for group, p, offset in steps:
        offset = min(offset, ends[p])
        if offset > done.get((group, p), 0):
            done[(group, p)] = offset
            timeline.record(group, p, offset)
            await deps[group].commit({p: offset})
    for group in deps:
        await timeline.commit({group: deps[group]}, ends)
    await decided_once_none_early(decision_log, names, timeline, placed)
    state = await worker.state()
    assert state["gaps_accepted"] >= 1, "the lanes crossed the markers as gaps in the log"
    assert state["holes_refetched"] == 0


async def _recovered(worker) -> bool:
    state = await worker.state()
    return bool(state) and not state["recovering"]


async def _polled(reader: TopicReader) -> bool:
    await reader.poll(0.2)
    return bool(reader.records)
