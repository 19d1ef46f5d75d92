"""The gate's ordering guarantee against the real broker and a real worker process.

The test plays the dependencies: it commits their consumer-group offsets step by step, in random order,
and records when it started each commit. A decision for (p, o) is premature if some dependency had not
been told to commit past o on p before the decision was made.
"""

from __future__ import annotations

import random

import pytest

from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka.tools import produce
from tests.harness import ends_of, payments_for

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("seed", [7, 2026])
async def test_random_commit_order_never_decides_early_and_decides_everything_once(
    names, producer, new_worker, deps, decision_log, seed
):
    rng = random.Random(seed)
    placed = await produce(producer, names.payments, payments_for(names.partitions, 12, "r"))
    ends = ends_of(placed)
    worker = new_worker()
    await worker.wait_ready(set(range(names.partitions)))
    timeline = CommitTimeline()
    # Each (group, partition) advances in random increments up to the log end; the steps of all of
    # them interleave in random order, so the watermark's bottleneck keeps moving between groups.
    sequences = {}
    for group in deps:
        for p in range(names.partitions):
            offsets, offset = [], 0
            while offset < ends[p]:
                offset = min(ends[p], offset + rng.randint(1, 4))
                offsets.append(offset)
            sequences[(group, p)] = offsets[::-1]
    order = [key for key, offsets in sequences.items() for _ in offsets]
    rng.shuffle(order)
    for group, p in order:
        offset = sequences[(group, p)].pop()
        timeline.record(group, p, offset)
        await deps[group].commit({p: offset})
        if rng.random() < 0.3:
            await decision_log.poll(timeout=rng.choice([0.05, 0.2, 0.5]))

    await decision_log.wait_for(set(placed), timeout=60)
    made = decision_log.decisions()
    assert premature(made, names.deps, timeline) == []
    for d in made:
        assert d["offset"] < d["watermark"]
        assert all(d["offset"] < c for c in d["dependencies"].values())
        assert d["gated"] is True
    ids = [d["payment_id"] for d in made]
    assert len(ids) == len(set(ids)) == len(placed), "each payment decided exactly once"


async def test_control_the_same_check_catches_an_ungated_worker(
    names, producer, new_worker, deps, decision_log
):
    """Negative control: with the gate off, the checker above must report premature decisions."""
    placed = await produce(producer, names.payments, payments_for(names.partitions, 3, "c"))
    worker = new_worker(AML_GATE="off")
    await worker.wait_ready(set(range(names.partitions)))
    await decision_log.wait_for(set(placed), timeout=60)
    timeline = CommitTimeline()
    await timeline.commit(deps, {p: 3 for p in range(names.partitions)})
    made = decision_log.decisions()
    assert len(premature(made, names.deps, timeline)) >= len(placed)
    assert all(d["gated"] is False for d in made)
