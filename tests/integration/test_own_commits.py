"""The service's own committed offsets follow its decisions, so lag monitors and the next owner of a
partition see where it really is."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from aml_app.harness.verify import CommitTimeline
from aml_app.kafka.tools import produce
from tests.harness import committed_offsets, ends_of, payments_for, produce_in_transactions, wait_until

pytestmark = pytest.mark.integration

#: The tests run with a commit every 0.5 s (tests/harness.TEST_ENV): this is many commit intervals.
COMMITS_FOLLOW_WITHIN = 15.0


async def test_own_commits_reach_the_last_decision_across_transaction_markers(
    broker, names, new_worker, deps, decision_log
):
    """Payments written in transactions: every commit marker leaves a gap in a partition's offsets (about
    120 per partition here). Each gap the lanes cross, once the log confirms it, must cost nothing: when
    Faust's commit bookkeeping held offsets twice, each commit advanced past one gap only, and the group
    stood a minute behind its decisions (and any rebalance meanwhile decided them again)."""
    placed = await asyncio.to_thread(
        produce_in_transactions,
        broker.bootstrap,
        names,
        payments_for(names.partitions, 150, "c"),
        random.Random(5),
    )
    last = ends_of(placed)
    worker = new_worker()
    await CommitTimeline().commit(deps, last)
    await decision_log.wait_for(set(placed), timeout=120)

    async def followed() -> bool:
        return (
            await committed_offsets(broker.bootstrap, names.app_id, names.payments, names.partitions) == last
        )

    await wait_until(followed, COMMITS_FOLLOW_WITHIN, "the group's commits to reach the last decisions")
    state = await worker.state()
    assert state["gaps_accepted"] >= names.partitions, "the lanes crossed the markers as gaps"
    assert state["holes_refetched"] == 0


async def test_a_partition_that_stays_through_a_rebalance_goes_on_committing(
    broker, producer, names, new_worker, deps, decision_log
):
    """A worker that commits every 15 s has committed 0..2 of every partition and decided 3..5 when a
    second worker joins, before its next commit. It keeps some partitions: Faust forgot the acks of 3..5
    at the revoke and fetches them again from the group's offset (3). They must not be decided again,
    and the partition must not stop committing: Faust's commit waits for the offset after the committed
    one, which the lane dropped as delivered before, so the partition stood still until the next
    rebalance (the group fell thousands of records behind after a scale-down, and the worker that took
    the partition then decided them all again)."""
    partitions = range(names.partitions)
    placed = await produce(producer, names.payments, payments_for(names.partitions, 10, "s"))
    first = new_worker(AML_COMMIT_INTERVAL="15")
    await first.wait_ready(set(partitions))
    timeline = CommitTimeline()
    await timeline.commit(deps, dict.fromkeys(partitions, 3))

    async def committed_to(offset: int) -> bool:
        ours = await committed_offsets(broker.bootstrap, names.app_id, names.payments, names.partitions)
        return ours == dict.fromkeys(partitions, offset)

    # Faust's first commit comes two intervals after the start, then one interval apart.
    await wait_until(lambda: committed_to(3), 2 * 15 + COMMITS_FOLLOW_WITHIN, "the first worker's commit")
    await timeline.commit(deps, dict.fromkeys(partitions, 6))
    await decision_log.wait_for({(p, o) for p, o in placed if o < 6}, timeout=60)
    second = new_worker()

    async def shared() -> set[int] | None:
        states = [await first.state(), await second.state()]
        if any(not s or s["recovering"] for s in states):
            return None
        kept, taken = (set(s["assigned"]) for s in states)
        return kept if kept and taken and kept | taken == set(partitions) and not kept & taken else None

    kept = await wait_until(shared, 90, "the two workers to share the partitions")
    await timeline.commit(deps, dict.fromkeys(partitions, 10))
    await decision_log.wait_for(set(placed), timeout=60)
    await wait_until(
        lambda: committed_to(10), 15 + COMMITS_FOLLOW_WITHIN, "every partition committed to its end"
    )
    twice = Counter((d["partition"], d["offset"]) for d in decision_log.decisions() if d["partition"] in kept)
    assert [po for po, n in twice.items() if n > 1] == [], "payments of a kept partition decided again"
