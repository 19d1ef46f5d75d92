"""What the dependency groups' committed offsets can do besides moving forward, on the real broker: a
group deleted while payments flow, and a group moved back while a payment waits. Committed offsets are
the only thing the gate trusts, so a payment waits until they pass it again; nothing is decided early,
nothing is decided twice."""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka.admin import AdminClient

from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka.tools import produce
from tests.harness import payments_for, wait_until

pytestmark = pytest.mark.integration


def delete_group(bootstrap: str, group: str) -> None:
    """What `kafka-consumer-groups.sh --delete` does (aiokafka's admin client has no DeleteGroups)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_consumer_groups([group], request_timeout=10).values():
        future.result(10)


async def held_at(worker, offsets: dict[int, int], watermark: int) -> dict:
    """Until the worker waits at `offsets` on every partition and its rows say W = `watermark`."""

    async def held() -> dict | None:
        state = await worker.state()
        if not state or state["recovering"]:
            return None
        waiting = {int(p): o for p, o in state["waiting"].items()}
        rows = state["watermarks"].values()
        at_w = len(rows) == len(offsets) and all(r["watermark"] == watermark for r in rows)
        return state if waiting == offsets and at_w else None

    return await wait_until(held, 60, f"every partition to wait at {offsets} with W = {watermark}")


def decided_once(decision_log, placed: list[tuple[int, int]]) -> list[dict]:
    made = decision_log.decisions()
    ids = [d["payment_id"] for d in made]
    assert len(ids) == len(set(ids)), "a payment was decided twice"
    assert {(d["partition"], d["offset"]) for d in made} == set(placed)
    return made


async def test_a_dependency_group_deleted_mid_run_closes_the_gate_until_it_commits_again(
    broker, names, producer, new_worker, deps, decision_log
):
    partitions = range(names.partitions)
    relations, aggregates = names.deps
    before = await produce(producer, names.payments, payments_for(names.partitions, 3, "d"))
    timeline = CommitTimeline()
    await timeline.commit(deps, dict.fromkeys(partitions, 3))
    worker = new_worker()
    await decision_log.wait_for(set(before), timeout=60)

    await asyncio.to_thread(delete_group, broker.bootstrap, relations)
    after = await produce(producer, names.payments, payments_for(names.partitions, 3, "e"))
    # The other dependency goes on: a group that lost its offsets must hold the gate by itself.
    await timeline.commit({aggregates: deps[aggregates]}, dict.fromkeys(partitions, 6))
    state = await held_at(worker, dict.fromkeys(partitions, 3), watermark=0)
    status = {d["group"]: d["status"] for d in state["dependencies"]}
    assert status[relations] == "unknown group", status
    await decision_log.poll(0.2)
    assert not decision_log.decided() & set(after), "decided while its dependency had no committed offset"

    await timeline.commit(deps, dict.fromkeys(partitions, 6))
    await decision_log.wait_for(set(after), timeout=60)
    # The timeline keeps commits that move a group forward: 3..5 count as covered at the commit of 6.
    assert premature(decided_once(decision_log, before + after), names.deps, timeline) == []


async def test_a_dependency_moved_back_while_a_payment_waits_keeps_it_waiting(
    names, producer, new_worker, deps, decision_log
):
    partitions = range(names.partitions)
    relations, _ = names.deps
    placed = await produce(producer, names.payments, payments_for(names.partitions, 6, "b"))
    timeline = CommitTimeline()
    await timeline.commit(deps, dict.fromkeys(partitions, 3))
    worker = new_worker()
    await decision_log.wait_for({(p, o) for p, o in placed if o < 3}, timeout=60)
    await held_at(worker, dict.fromkeys(partitions, 3), watermark=3)

    # Group reset to an earlier offset (kafka-consumer-groups.sh --reset-offsets): W falls to 1.
    await timeline.commit({relations: deps[relations]}, dict.fromkeys(partitions, 1))
    await held_at(worker, dict.fromkeys(partitions, 3), watermark=1)
    await decision_log.poll(0.2)
    assert {o for _, o in decision_log.decided()} == {0, 1, 2}, "nothing past 3, and 1..2 not again"

    await timeline.commit(deps, dict.fromkeys(partitions, 6))
    await decision_log.wait_for(set(placed), timeout=60)
    # The timeline keeps commits that move a group forward: 3..5 count as covered at the commit of 6.
    assert premature(decided_once(decision_log, placed), names.deps, timeline) == []


def test_the_pipeline_commits_every_partition_again_so_the_brokers_expiry_takes_nothing_back(
    broker,
) -> None:
    """A group without members loses a partition's offset `offsets.retention.minutes` after its last
    commit (KIP-211): a partition with no payments for a week, or an idle topic, would read as nothing
    applied, and the event-time gate would hold every payment until a restart. The embedded broker
    expires nothing, so the group is deleted by hand, as the expiry leaves it."""
    import uuid

    from confluent_kafka.admin import NewTopic

    from aml_app.pipeline.progress import GroupProgress

    topic, group = f"payments-{uuid.uuid4().hex[:8]}", f"relations-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for future in admin.create_topics([NewTopic(topic, 2, 1)], operation_timeout=10).values():
        future.result(10)
    config = {"bootstrap.servers": broker.bootstrap}

    kept = GroupProgress(config, topic, group, recommit_every=0.0)
    unchanged = GroupProgress(config, topic, f"{group}-control", recommit_every=3600.0)
    try:
        for progress in (kept, unchanged):
            progress.commit({0: 5, 1: 3})
            delete_group(broker.bootstrap, progress.group)
            progress.commit({0: 6, 1: 3})  # payments on partition 0 only
        assert unchanged.committed([0, 1]) == {0: 6}, "the control: partition 1 is not committed again"
        assert kept.committed([0, 1]) == {0: 6, 1: 3}
        delete_group(broker.bootstrap, group)
        kept.recommit()  # the topic idle: no micro-batch runs
        assert kept.committed([0, 1]) == {0: 6, 1: 3}
    finally:
        kept.close()
        unchanged.close()
