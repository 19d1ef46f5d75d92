"""The payments topic deleted and created again under a running worker, on the real broker: offsets start
again at 0 and mean other payments, so the worker must not compare them with what it knew."""

from __future__ import annotations

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka.tools import produce
from tests.harness import committed_offsets, payments_for, wait_until

pytestmark = pytest.mark.integration


async def recreate(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])

        async def gone() -> bool:
            return topic not in await admin.list_topics()

        await wait_until(gone, 30, f"{topic} to be deleted", interval=0.2)
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()


async def test_payments_recreated_under_a_running_worker_close_its_gate_with_one_sentence(
    broker, names, producer, new_worker, deps, decision_log
):
    """The worker has read offsets 0..4 of the old log on every partition. The new log's payments 0..7
    are covered by the dependencies (committed on the new log): a worker that compared offsets of the
    two logs would take 5..7 for the next payments and never see 0..4 of the new log. Its gate stays
    closed with the sentence instead, and once restarted it decides all eight, none early."""
    partitions = range(names.partitions)
    old = await produce(producer, names.payments, payments_for(names.partitions, 5, "old"))
    timeline = CommitTimeline()
    await timeline.commit(deps, dict.fromkeys(partitions, 5))
    worker = new_worker()
    await decision_log.wait_for(set(old), timeout=60)

    # Its commits of the old log are done: one still in flight would land on the new topic (see
    # docs/operating.md: stop the workers before deleting the topic).
    async def committed_old() -> bool:
        ours = await committed_offsets(broker.bootstrap, names.app_id, names.payments, names.partitions)
        return ours == dict.fromkeys(partitions, 5)

    await wait_until(committed_old, 30, "the worker's commits of the old log")
    await recreate(broker.bootstrap, names.payments, names.partitions)
    new = await produce(producer, names.payments, payments_for(names.partitions, 8, "new"))
    new_timeline = CommitTimeline()
    await new_timeline.commit(deps, dict.fromkeys(partitions, 8))

    def decided_new() -> list[dict]:
        return [d for d in decision_log.decisions() if d["payment_id"].startswith("new")]

    async def closed_or_decided() -> bool:
        await decision_log.poll(0.1)
        state = await worker.state()
        reasons = [p["untrusted"] or "" for p in (state or {}).get("partitions", [])]
        closed = len(reasons) == names.partitions and all(
            "of two logs are not compared" in r for r in reasons
        )
        return closed or bool(decided_new())

    await wait_until(closed_or_decided, 60, "the worker's gate to close on the new log")
    assert decided_new() == [], "decided payments of the new log by offsets of the old one"

    worker.stop(grace=30)
    new_worker()
    await decision_log.wait_for(set(new) | set(old), timeout=90)
    assert sorted(d["payment_id"] for d in decided_new()) == sorted(
        f"new-{p}-{i}" for p in partitions for i in range(8)
    )
    assert premature(decided_new(), names.deps, new_timeline) == []
