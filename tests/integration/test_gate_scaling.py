"""Partitions move between workers while payments flow: 1 -> 3 -> 1 workers."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka.tools import produce
from tests.harness import ends_of, payments_for, wait_until

pytestmark = pytest.mark.integration


class Traffic:
    """Payments keep arriving and the dependencies keep following the log end, a little behind."""

    def __init__(self, producer, names, deps) -> None:
        self.producer, self.names, self.deps = producer, names, deps
        self.placed: list[tuple[int, int]] = []
        self.timeline = CommitTimeline()
        self.rounds = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            batch = payments_for(self.names.partitions, 2, f"t{self.rounds}")
            self.placed += await produce(self.producer, self.names.payments, batch)
            self.rounds += 1
            await self.timeline.commit(self.deps, ends_of(self.placed))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)
        await self.timeline.commit(self.deps, ends_of(self.placed))


def owners(states: list[dict]) -> list[set[int]]:
    return [set(s["assigned"]) for s in states]


async def test_one_to_three_to_one_workers_loses_nothing_and_decides_nothing_early(
    names, producer, new_worker, deps, decision_log
):
    all_partitions = set(range(names.partitions))
    first = new_worker()
    await first.wait_ready(all_partitions)
    traffic = Traffic(producer, names, deps)
    stop = asyncio.Event()
    flowing = asyncio.create_task(traffic.run(stop))
    try:
        others = [new_worker(), new_worker()]
        trio = [first, *others]

        async def spread() -> list[dict] | None:
            states = [await w.state() for w in trio]
            if any(s is None or s["recovering"] for s in states):
                return None
            sets = owners(states)
            disjoint = sum(len(s) for s in sets) == len(set().union(*sets))
            ok = all(sets) and set().union(*sets) == all_partitions and disjoint
            return states if ok else None

        states = await wait_until(spread, 90, "three workers to share the partitions disjointly")
        # Every worker sees every partition's watermark, owned or not, and the rows are fresh.
        now = time.time()
        for state in states:
            assert set(map(int, state["watermarks"])) == all_partitions
            assert all(now - row["refreshed_at"] < 10 for row in state["watermarks"].values())
        assert sum(s["is_leader"] for s in states) == 1

        async def all_working() -> bool:
            states = [await w.state() for w in trio]
            return all(s and sum(s["processed"].values()) > 0 for s in states)

        await wait_until(all_working, 60, "each of the three workers to decide payments")

        for worker in others:
            worker.stop()
        await first.wait_ready(all_partitions, timeout=90)
    finally:
        stop.set()
        await flowing

    await decision_log.wait_for(set(traffic.placed), timeout=90)
    made = decision_log.decisions()
    assert premature(made, names.deps, traffic.timeline) == []
    produced_ids = {f"t{r}-{p}-{i}" for r in range(traffic.rounds) for p in all_partitions for i in (0, 1)}
    assert {d["payment_id"] for d in made} == produced_ids
    assert {first.worker_id, *(w.worker_id for w in others)} <= {d["worker"] for d in made}
