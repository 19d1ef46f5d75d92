"""A payment timestamped far ahead of its Kafka record breaks the contract and never holds its partition.

Under the event-time gate a payment at t waits until every partition's dependencies have applied every
payment up to t; under continuous traffic they never reach 2099, so a payment stamped 2099 would hold its
partition, and every later payment of it, for as long as the traffic flows. The contract bounds `ts` by the
record's timestamp plus AML_MAX_CLOCK_SKEW: the worker dead-letters such a payment and its partition goes
on. Here a real worker on the event-time gate decides continuous traffic on every partition while the
dependencies, played by the test, stay a few records behind the log end of each (so some payment is always
unapplied and no cut ever reaches 2099); one payment stamped 2099 and one stamped 1971 arrive in the
middle. The negative control runs the same with the bound switched off (a skew of 10^12 s): the 2099
payment holds its partition until the traffic stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from aiokafka import AIOKafkaProducer

from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka.tools import GroupCommitter, payment_json, produce
from tests.harness import DecisionLog, Names, TopicReader, wait_until

pytestmark = pytest.mark.integration

FUTURE = "2099-01-01T00:00:00Z"
PAST = "1971-01-01T00:00:00Z"
#: How many records the dependencies stay behind each partition's log end while the traffic flows.
BEHIND = 10
#: A round sends one payment to every partition; about 20 rounds a second.
ROUND_EVERY = 0.05
#: Rounds before the odd payments arrive, and payments after them whose decisions are waited for.
LEAD_IN = 20
AFTER = 20
#: The traffic stops by itself after this long: a test that needed longer has failed anyway.
TRAFFIC_DEADLINE = 90.0


def now_z() -> str:
    """Now, to the millisecond (rounded down): never after the record timestamp the producer gives it."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class Traffic:
    """Rounds of payments on every partition, each stamped just before it is sent, with `odd` ones (round
    -> partition -> ts) in between; the dependencies commit each partition up to BEHIND records short of
    what was sent, so that while the traffic flows every partition has payments not yet applied."""

    producer: AIOKafkaProducer
    names: Names
    deps: dict[str, GroupCommitter]
    timeline: CommitTimeline
    odd: dict[int, dict[int, str]]
    placed: dict[tuple[int, int], bytes] = field(default_factory=dict)
    odd_at: dict[str, tuple[int, int]] = field(default_factory=dict)  # ts -> where that payment landed
    ends: dict[int, int] = field(default_factory=dict)
    rounds: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        deadline = time.monotonic() + TRAFFIC_DEADLINE
        committed: dict[int, int] = {}
        while not self.stop.is_set() and time.monotonic() < deadline:
            records = []
            for p in range(self.names.partitions):
                payer = f"acct-{p}-{self.rounds % 5}"
                ts = self.odd.get(self.rounds, {}).get(p) or now_z()
                value = payment_json(f"t-{self.rounds}-{p}", payer, f"acct-x{self.rounds % 7}", "10.00", ts)
                records.append((p, payer.encode(), value))
            for (p, o), (_, _, value) in zip(
                await produce(self.producer, self.names.payments, records), records, strict=True
            ):
                self.placed[(p, o)] = value
                self.ends[p] = max(self.ends.get(p, 0), o + 1)
                if self.rounds in self.odd and p in self.odd[self.rounds]:
                    self.odd_at[self.odd[self.rounds][p]] = (p, o)
            self.rounds += 1
            behind = {p: end - BEHIND for p, end in self.ends.items() if end - BEHIND > committed.get(p, 0)}
            if behind:
                await self.timeline.commit(self.deps, behind)
                committed.update(behind)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), ROUND_EVERY)

    def after(self, partition: int, offset: int, count: int) -> set[tuple[int, int]]:
        """The first `count` payments of `partition` placed after `offset`."""
        later = sorted(o for p, o in self.placed if p == partition and o > offset)
        return {(partition, o) for o in later[:count]}


@contextlib.asynccontextmanager
async def flowing(traffic: Traffic) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(traffic.run())
    try:
        yield task
    finally:
        traffic.stop.set()
        await task


async def all_decided(log: DecisionLog, expected: set[tuple[int, int]]) -> bool:
    await log.poll(0.2)
    return log.decided() >= expected


async def odd_payments_sent(traffic: Traffic, task: asyncio.Task[None], count: int) -> None:
    await wait_until(
        lambda: len(traffic.odd_at) == count or task.done(), 60, "the odd payments to be sent", interval=0.05
    )
    assert len(traffic.odd_at) == count, "the traffic ended before the odd payments were sent"


async def test_a_payment_stamped_in_2099_is_dead_lettered_and_holds_nothing_nor_does_one_from_1971(
    broker, names, producer, new_worker, deps, decision_log: DecisionLog
) -> None:
    worker = new_worker(AML_GATE_MODE="event-time")
    await worker.wait_ready(set(range(names.partitions)))
    timeline = CommitTimeline()
    traffic = Traffic(producer, names, deps, timeline, odd={LEAD_IN: {0: FUTURE, 1: PAST}})
    async with flowing(traffic) as task:
        await odd_payments_sent(traffic, task, 2)
        future, past = traffic.odd_at[FUTURE], traffic.odd_at[PAST]
        await wait_until(lambda: len(traffic.after(*future, AFTER)) == AFTER, 30, "payments after 2099")
        # Every later payment of either partition is decided while the traffic still flows.
        expected = traffic.after(*future, AFTER) | traffic.after(*past, AFTER) | {past}
        await wait_until(
            lambda: task.done() or all_decided(decision_log, expected), 60, "the later payments decided"
        )
        assert not task.done(), "the traffic had ended before the payments after 2099 and 1971 were decided"
    await timeline.commit(deps, traffic.ends)
    await decision_log.wait_for(set(traffic.placed) - {future}, timeout=60)
    assert future not in decision_log.decided(), "the payment stamped 2099 was decided"
    assert premature(decision_log.decisions(), names.deps, timeline) == []

    stamped = await record_timestamp(broker.bootstrap, names, future)
    dlq = await TopicReader(broker.bootstrap, names.dlq, names.partitions).start()
    try:
        await wait_until(lambda: dlq.poll(0.2), 30, "the dead letter", interval=0)
        await dlq.poll(0.5)
        [letter] = dlq.records
    finally:
        await dlq.stop()
    headers = {k: v.decode() for k, v in letter.headers}
    assert (int(headers["dlq.partition"]), int(headers["dlq.offset"])) == future
    key = f"acct-0-{LEAD_IN % 5}".encode()
    assert (letter.key, letter.value) == (key, traffic.placed[future]), "the original key and value"
    assert headers["dlq.reason"] == (
        f"field 'ts' {FUTURE} is more than the allowed clock skew of 5 s (AML_MAX_CLOCK_SKEW) after its "
        f"Kafka record's timestamp {stamped}: a payment cannot happen after it was sent"
    )
    assert (await worker.state())["dead_lettered"] == 1


async def test_negative_control_without_the_bound_the_2099_payment_holds_its_partition_while_traffic_flows(
    names, producer, new_worker, deps, decision_log: DecisionLog
) -> None:
    """With AML_MAX_CLOCK_SKEW at 10^12 s the payment stamped 2099 is valid: it waits for a cut that the
    traffic never lets come, and its partition with it, while the other partitions are decided well past
    it; once the traffic stops and the dependencies catch up, it and the rest are decided."""
    worker = new_worker(AML_GATE_MODE="event-time", AML_MAX_CLOCK_SKEW="1e12")
    await worker.wait_ready(set(range(names.partitions)))
    timeline = CommitTimeline()
    traffic = Traffic(producer, names, deps, timeline, odd={LEAD_IN: {0: FUTURE}})
    async with flowing(traffic) as task:
        await odd_payments_sent(traffic, task, 1)
        future = traffic.odd_at[FUTURE]
        await wait_until(lambda: traffic.rounds >= LEAD_IN + 3 * AFTER, 60, "traffic after 2099")
        # The other partitions are decided past it by more than the test above waits for on partition 0.
        others = set().union(
            *(traffic.after(p, future[1] - 1, 3 * AFTER) for p in range(1, names.partitions))
        )
        await wait_until(
            lambda: task.done() or all_decided(decision_log, others), 60, "the other partitions decided"
        )
        assert not task.done(), "the traffic had ended before the other partitions were decided"
        held = {(p, o) for p, o in decision_log.decided() if p == 0 and o >= future[1]}
        assert held == set(), f"partition 0 went past the payment stamped 2099: {sorted(held)[:5]}"
        assert (await worker.state())["waiting"].get("0") == future[1]
    await timeline.commit(deps, traffic.ends)
    await decision_log.wait_for(set(traffic.placed), timeout=60)
    assert premature(decision_log.decisions(), names.deps, timeline) == []
    assert (await worker.state())["dead_lettered"] == 0


async def record_timestamp(bootstrap: str, names: Names, where: tuple[int, int]) -> str:
    """The Kafka timestamp of the record at `where`, as the contract's sentence writes it."""
    reader = await TopicReader(bootstrap, names.payments, names.partitions).start()
    try:
        found = await wait_until(lambda: _at(reader, where), 30, f"the record at {where}", interval=0)
    finally:
        await reader.stop()
    when = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=found.timestamp)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


async def _at(reader: TopicReader, where: tuple[int, int]):  # type: ignore[no-untyped-def]
    await reader.poll(0.2)
    return next((r for r in reader.records if (r.partition, r.offset) == where), None)
