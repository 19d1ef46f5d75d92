"""The service's own committed offsets follow its decisions, so lag monitors and the next owner of a
partition see where it really is."""

from __future__ import annotations

import asyncio
import random

import pytest

from aml_app.harness.verify import CommitTimeline
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
