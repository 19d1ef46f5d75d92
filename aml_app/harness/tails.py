"""Readers of the system's output topics, from the beginning and without a consumer group.

The demo, the end-to-end tests and the benchmarks judge the system by what it wrote: decisions and alerts
of each detecting service, and the dead letters. These readers keep everything they saw, so a verdict can
count records (duplicates included) as well as distinct payments.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

#: How long a jump in a partition's offsets is read again before the reader takes it as a gap in the log.
GAP_CONFIRM_S = 1.0
#: The pause between two reads of a jump.
REREAD_PAUSE_S = 0.05


def from_the_start(consumer: AIOKafkaConsumer, tps: Sequence[TopicPartition]) -> None:
    """Read `tps` from offset 0, for a consumer made with `auto_offset_reset="earliest"`: where
    retention has moved a log's start, the fetch at 0 is out of range and the consumer resets to the
    start. ListOffsets(earliest) is not asked first: the embedded broker answers it past a partition's
    first records when two producers' first batches to it race (1 of 150 fresh partitions in a probe;
    both pipeline services' dead letters), and a fetch at 0 still returns them."""
    for tp in tps:
        consumer.seek(tp, 0)


async def partitions_of(consumer: AIOKafkaConsumer, topic: str, expected: int) -> list[int]:
    """The topic's partitions from the broker (an existing topic may have its own count)."""
    await consumer.topics()
    found = consumer.partitions_for_topic(topic)
    return sorted(found) if found else list(range(expected))


class InOrder:
    """A live reader's records of each partition in offset order, with no record skipped that a fresh
    read would find.

    A jump in a partition's offsets is read again for `GAP_CONFIRM_S` before the reader goes on past it:
    the embedded broker, appending batches of several producers to one partition, can hand a reader a
    later batch before an earlier one is visible (a live reader then skips records a fresh read finds;
    seen in 1 of 9 runs of three or four producers, 13 of 60,000 records). In a Kafka log a gap is real
    (transaction markers, compaction) and costs the reader that wait once.
    """

    def __init__(self, seek: Callable[[TopicPartition, int], object]) -> None:
        self.seek = seek
        #: Per partition, the offset after the last record taken.
        self.next_offset: dict[int, int] = {}
        #: Per (partition, expected offset) of a jump seen, when it was first seen.
        self.jumps: dict[tuple[int, int], float] = {}

    def accept(self, tp: TopicPartition, records: Sequence[Any]) -> tuple[list[Any], bool]:
        """The records of one partition to take, in order, and whether the reader sought back to the
        offset it expects at a jump not yet confirmed (the rest of `records` comes again)."""
        taken: list[Any] = []
        for record in records:
            expected = self.next_offset.get(tp.partition)
            if expected is not None and record.offset < expected:
                continue  # taken before a seek back
            if expected is not None and record.offset > expected:
                first_seen = self.jumps.setdefault((tp.partition, expected), time.monotonic())
                if time.monotonic() - first_seen < GAP_CONFIRM_S:
                    self.seek(tp, expected)
                    return taken, True
            taken.append(record)
            self.next_offset[tp.partition] = record.offset + 1
        return taken, False


class TopicTail:
    """Reads a whole topic from the beginning, in order (`InOrder`); `run` loops until `halt`."""

    def __init__(self, bootstrap: Sequence[str], topic: str) -> None:
        self.topic = topic
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=list(bootstrap), enable_auto_commit=False, auto_offset_reset="earliest"
        )
        self.closing = False
        self.order = InOrder(lambda tp, offset: self.consumer.seek(tp, offset))

    async def start(self, expected_partitions: int) -> TopicTail:
        await self.consumer.start()
        partitions = await partitions_of(self.consumer, self.topic, expected_partitions)
        tps = [TopicPartition(self.topic, p) for p in partitions]
        self.consumer.assign(tps)
        from_the_start(self.consumer, tps)
        return self

    async def run(self) -> None:
        while not self.closing:
            batch = await self.consumer.getmany(timeout_ms=200)
            reread = False
            for tp, records in batch.items():
                reread |= self.receive(tp, records)
            if reread:
                await asyncio.sleep(REREAD_PAUSE_S)

    def receive(self, tp: TopicPartition, records: Sequence[Any]) -> bool:
        """Take `records` of one partition in offset order (True: a jump is read again)."""
        taken, reread = self.order.accept(tp, records)
        for record in taken:
            self.take(record)
        return reread

    def take(self, record: Any) -> None:
        raise NotImplementedError

    def halt(self) -> None:
        self.closing = True

    async def stop(self) -> None:
        await self.consumer.stop()


class RecordTail(TopicTail):
    """A topic of JSON records keyed by payment id (decisions, alerts); a record that is not JSON is
    skipped, not fatal."""

    def __init__(self, bootstrap: Sequence[str], topic: str) -> None:
        super().__init__(bootstrap, topic)
        self.records: list[dict[str, Any]] = []
        self.ids: set[Any] = set()  # every payment id seen, kept as records arrive (cheap to poll)

    def take(self, record: Any) -> None:
        with contextlib.suppress(TypeError, ValueError):
            doc = json.loads(record.value)
            if isinstance(doc, dict):
                self.records.append(doc)
                self.ids.add(doc.get("payment_id"))

    def of_run(self, ids: set[str]) -> list[dict[str, Any]]:
        """Records about this run's payments (a shared cluster may hold older ones)."""
        return [d for d in self.records if d.get("payment_id") in ids]

    def distinct(self, ids: set[str]) -> set[str]:
        return self.ids & ids


class DeadLetterTail(TopicTail):
    """The dead-letter topic: original bytes as value, where it came from and why in the headers.

    Each service dead-letters a bad record itself: `dlq.worker` is the group name for B and C and the
    worker id for a gated worker; `source_of` maps a worker id to its service.
    """

    def __init__(self, bootstrap: Sequence[str], topic: str, groups: Sequence[str]) -> None:
        super().__init__(bootstrap, topic)
        self.groups = set(groups)
        self.worker_services: dict[str, str] = {}
        self.origins: dict[str, dict[tuple[int, int], str]] = {}

    def take(self, record: Any) -> None:
        headers = {k: v.decode(errors="replace") for k, v in (record.headers or ())}
        source = headers.get("dlq.worker", "")
        source = source if source in self.groups else self.worker_services.get(source, source)
        with contextlib.suppress(KeyError, ValueError):
            origin = (int(headers["dlq.partition"]), int(headers["dlq.offset"]))
            self.origins.setdefault(source, {})[origin] = headers.get("dlq.reason", "?")

    def of_run(self, source: str, malformed: set[tuple[int, int]]) -> dict[tuple[int, int], str]:
        return {o: reason for o, reason in self.origins.get(source, {}).items() if o in malformed}
