"""The delivery repairs: what the lanes do about records Faust's consumer did not hand over.

A lane never runs past a hole. Faust can skip records of a partition (seen about once in ten runs of
three workers joining at once: a range of offsets never reached the stream, later ones did) and then
commits over the range it counts as a gap once a later offset is acked. So when an offset arrives past
the one a lane expects, the lane holds it and reads the log directly: if records exist in between, the
partition is fetched again from the expected offset; if not (transaction markers, compaction), the held
events go on. The expected offset of a partition's first event is where the generation starts (the
group's committed offset), so events wait until this worker has read that after an assignment.

A hole in delivery (records the consumer skipped) is told from a gap in a partition's offsets: offsets
in a Kafka partition are not always contiguous: transaction markers take an offset and
compaction removes records. So when a lane receives offset 140 right after 32, only the broker can
say whether 33..139 exist. This reads the partition directly, outside any group, from the first
missing offset and returns the offset of the first record there (`first_offset_from`).

Right after an assignment Faust can also skip freshly fetched records and not seek back; the periodic
`check_delivery` fetches again what an owned partition should have delivered and did not.

`DeliveryRepairs` is the part of `GatedConsumer` that checks delivery; the lanes themselves are in
`aml_app.gate.consumer`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import faust
from aiokafka import AIOKafkaConsumer, TopicPartition
from faust.types import TP, EventT

from aml_app.faust_internals import partition_flags, record_gap
from aml_app.gate.retry import retry_forever
from aml_app.kafka.offsets import DependencyOffsets
from aml_app.kafka.security import KafkaSecurity, aiokafka_kwargs

if TYPE_CHECKING:
    from aml_app.gate.consumer import Lane

log = logging.getLogger(__name__)


async def first_offset_from(
    bootstrap_servers: Sequence[str],
    topic: str,
    partition: int,
    offset: int,
    timeout: float = 5.0,
    *,
    security: KafkaSecurity,
) -> int | None:
    """The offset of the first record at or after `offset` in the partition; None if none arrived in
    `timeout` seconds (the caller must then assume the records exist)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=list(bootstrap_servers),
        group_id=None,
        enable_auto_commit=False,
        client_id="aml-gate-holes",
        max_poll_records=1,
        **aiokafka_kwargs(security),
    )
    await asyncio.wait_for(consumer.start(), timeout)
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        records = await consumer.getmany(tp, timeout_ms=int(timeout * 1000), max_records=1)
        found = records.get(tp)
        return found[0].offset if found else None
    finally:
        await consumer.stop()


def generation_starts(
    tps: Sequence[TP], committed: Mapping[int, int | None], earliest: Mapping[TP, int | None]
) -> tuple[dict[int, int], list[tuple[TP, int, int]]]:
    """Where each partition starts in a generation, and the offsets retention deleted past our commit.

    A partition starts at the group's committed offset, or at the log start when retention deleted
    records the group never committed past (the consumer resets to the log start there): those offsets
    are returned as (tp, first, last) gaps, since no record of them will ever be acked.
    """
    starts: dict[int, int] = {}
    deleted: list[tuple[TP, int, int]] = []
    for tp in tps:
        own, first = committed.get(tp.partition), earliest.get(tp) or 0
        if own is not None and own < first:
            deleted.append((tp, own, first - 1))
        starts[tp.partition] = max(own or 0, first)
    return starts, deleted


class DeliveryRepairs:
    """Where each partition starts in a generation, holes in delivery, and records fetched but never
    delivered; mixed into `GatedConsumer`, whose lanes and consumer these read."""

    app: faust.App
    lanes: dict[int, Lane]
    starts: dict[int, int]
    assigned_at: float
    first_offset: Callable[[int, int], Awaitable[int | None]] | None
    security: KafkaSecurity
    holes_refetched: int
    gaps_accepted: int
    refetches: int

    _enqueue: Callable[[Lane, EventT[Any]], None]

    async def _starts(
        self, bootstrap_servers: Sequence[str], group: str, tps: list[TP]
    ) -> tuple[dict[int, int], str | None]:
        """Where each partition starts in this generation (the group's committed offset, or the log
        start), and which log those offsets are of (`aml_app.kafka.identity`)."""
        reader = DependencyOffsets(bootstrap_servers, tps[0].topic, [group], security=self.security)
        try:
            reading = await retry_forever(
                "reading our committed offsets", lambda: reader.read_all("", operator_fields=False)
            )
        finally:
            await reader.close()
        committed = reading.committed
        # Until this returns, this generation's events wait (see `early`): a failure must be retried.
        consumer = self.app.consumer
        earliest = await retry_forever(
            "reading the log start offsets", lambda: consumer.earliest_offsets(*tps)
        )
        starts, deleted = generation_starts(tps, committed[group], earliest)
        for tp, first, last in deleted:
            # Nothing will ever ack these offsets: without the gap, Faust would never commit again.
            await record_gap(self.app, tp, first, last)
        return starts, reading.log

    async def _check_hole(self, lane: Lane, tp: TP) -> None:
        """Offsets `expected`..`received - 1` never reached the lane: fetch them again, unless the log
        holds no record there (the gap in offsets is real)."""
        assert lane.hole is not None and self.first_offset is not None
        hole = expected, received = lane.hole
        first_offset = self.first_offset
        first = await retry_forever(
            f"reading {tp.topic}:{tp.partition} at {expected} from the log",
            lambda: first_offset(tp.partition, expected),
        )
        if first is not None and first >= received:
            # Faust commits over a gap only once it knows of it. True of the log whatever the lane does
            # meanwhile, so recorded before the lane's state is looked at again.
            await record_gap(self.app, tp, expected, received - 1)
        if lane.hole != hole or self.lanes.get(lane.partition) is not lane:
            return  # filled meanwhile, or the partition moved on
        if first is not None and first >= received:
            log.info(
                "%s: no records at offsets %d..%d (a gap in the log); going on", tp, expected, received - 1
            )
            held, lane.hole, lane.held = lane.held, None, []
            lane.next_offset = received
            self.gaps_accepted += 1
            for event in held:
                self._enqueue(lane, event)
            return
        log.warning(
            "%s: the consumer skipped offsets %d..%d (delivered %d next); fetching them again",
            tp,
            expected,
            received - 1,
            received,
        )
        lane.held = []  # they come again after the missing ones
        await self.app.consumer.seek(tp, expected)
        self.holes_refetched += 1

    async def check_delivery(self, topic: str, quiet: float) -> None:
        """Fetch again what an owned partition should have delivered to its lane and did not.

        Right after an assignment Faust can skip freshly fetched records and then, for a partition
        without a committed offset, not seek back (seen under CPU load: a new owner received nothing,
        with nothing logged): the consumer's position is past what the lane has had. A hole whose
        refetch did not take looks the same. Once the lane has had nothing new for `quiet` seconds, the
        partition is seeked to the first offset the lane still needs; the lane drops any duplicate.
        """
        now = time.monotonic()
        consumer = self.app.consumer
        for p, start in list(self.starts.items()):
            lane = self.lanes.get(p)
            last = lane.last_dispatch if lane else self.assigned_at
            if now - last < quiet or (lane is not None and lane.paused):
                continue
            expected = lane.next_offset if lane and lane.next_offset is not None else start
            tp = TP(topic, p)
            if tp not in consumer.assignment():
                continue
            try:
                position = await asyncio.wait_for(consumer.position(tp), quiet)
            except TimeoutError:
                continue  # no valid position yet: the consumer is still resetting it
            if position is None or position <= expected:
                continue
            log.warning(
                "%s: offsets %d..%d were fetched but never delivered; fetching them again",
                tp,
                expected,
                position - 1,
            )
            await consumer.seek(tp, expected)
            self.refetches += 1

    def fetch_state(self, topic: str) -> dict[int, dict[str, Any]]:
        """Per owned partition, what the delivery check looks at: where this generation started, the next
        offset the lane expects, how long it has had nothing, and whether Faust fetches it at all."""
        now = time.monotonic()
        state = {}
        for p in sorted(set(self.starts) | set(self.lanes)):
            lane = self.lanes.get(p)
            paused_in_faust, fetched_by_faust = partition_flags(self.app, TP(topic, p))
            state[p] = {
                "start": self.starts.get(p),
                "next_offset": lane.next_offset if lane else None,
                "queued": len(lane.queue) if lane else 0,
                "quiet_s": round(now - (lane.last_dispatch if lane else self.assigned_at), 3),
                "paused_by_lane": bool(lane and lane.paused),
                "hole": list(lane.hole) if lane and lane.hole else None,
                "paused_in_faust": paused_in_faust,
                "fetched_by_faust": fetched_by_faust,
            }
        return state
