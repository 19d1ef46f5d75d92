"""The delivery repairs: what the lanes do about records Faust's consumer did not hand over.

A lane never runs past a hole. Faust can skip records of a partition (seen about once in ten runs of
three workers joining at once: a range of offsets never reached the stream, later ones did) and then
commits over the range it counts as a gap once a later offset is acked. So when an offset arrives past
the one a lane expects, the lane holds it and reads the log directly: if records exist in between, the
partition is fetched again from the first of them (what lies before it is a gap); if not (transaction
markers, compaction), the held events go on. The expected offset of a partition's first event is where
the generation starts (the group's committed offset), so events wait until this worker has read that
after an assignment.

A hole in delivery (records the consumer skipped) is told from a gap in a partition's offsets: offsets
in a Kafka partition are not always contiguous: transaction markers take an offset and
compaction removes records. So when a lane receives offset 140 right after 32, only the broker can
say whether 33..139 exist. This reads the partition directly, outside any group, from the first
missing offset and returns the offset of the first record there (`first_offset_from`).

Right after an assignment Faust can also skip freshly fetched records and not seek back; the periodic
`check_delivery` fetches again what an owned partition should have delivered and did not.

`DeliveryChecker` reads the log and seeks; `GatedConsumer` (`aml_app.gate.consumer`) decides what its
lanes (`aml_app.gate.lane`) do with the answers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

import faust
from aiokafka import AIOKafkaConsumer, TopicPartition
from faust.types import TP

from aml_app.backoff import retry_forever
from aml_app.faust_internals import partition_flags, record_gap
from aml_app.kafka.deadlines import DeadlineExceeded, close_within, within
from aml_app.kafka.offsets import DependencyOffsets
from aml_app.kafka.security import KafkaSecurity, aiokafka_kwargs

log = logging.getLogger(__name__)

#: How long one read of the log start offsets may take before it is tried again.
START_READ_TIMEOUT = 30.0


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
        # As the worker's consumer reads: a payment of an aborted transaction is no record of the hole.
        isolation_level="read_committed",
        # Below the log start the first record is the log start's, not the next one to arrive.
        auto_offset_reset="earliest",
        **aiokafka_kwargs(security),
    )
    try:
        await within(consumer.start(), timeout, "starting the hole reader")
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        # Under `within` too: aiokafka cancels its own futures when a broker stops mid-request, and a
        # CancelledError that escaped ended the hole's check as if its lane had stopped.
        records = await within(
            consumer.getmany(tp, timeout_ms=int(timeout * 1000), max_records=1),
            2 * timeout,
            "reading the hole",
        )
        found = records.get(tp)
        return found[0].offset if found else None
    finally:
        await close_within(consumer.stop(), timeout, "stopping the hole reader")


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


class DeliveryChecker:
    """Asks the log and Faust's consumer what a lane did not get, and fetches it again.

    `GatedConsumer` holds one: it decides what a lane does, this reads offsets and seeks. It changes no
    lane and counts nothing.
    """

    def __init__(self, app: faust.App, security: KafkaSecurity) -> None:
        self.app = app
        #: The cluster's TLS/SASL, for the clients that read our offsets and the log.
        self.security = security
        #: The offset of the first record at or after an offset of a partition, read from the log (None:
        #: unknown); set by `attach`. Until then no jump in offsets is checked as a hole.
        self.first_offset: Callable[[int, int], Awaitable[int | None]] | None = None

    def attach(self, bootstrap_servers: Sequence[str], topic: str) -> None:
        """Read `topic`'s log on `bootstrap_servers`, outside any group, to check holes."""

        async def first_offset(partition: int, offset: int) -> int | None:
            return await first_offset_from(
                bootstrap_servers, topic, partition, offset, security=self.security
            )

        self.first_offset = first_offset

    @property
    def checks_holes(self) -> bool:
        return self.first_offset is not None

    async def starts(
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
            "reading the log start offsets",
            lambda: within(
                consumer.earliest_offsets(*tps), START_READ_TIMEOUT, "reading the log start offsets"
            ),
        )
        starts, deleted = generation_starts(tps, committed[group], earliest)
        for tp, first, last in deleted:
            # Nothing will ever ack these offsets: without the gap, Faust would never commit again.
            await record_gap(self.app, tp, first, last)
        return starts, reading.log

    async def first_record(self, tp: TP, offset: int) -> int | None:
        """The offset of the log's first record at or after `offset` (None: none came in time); `offset`
        itself, records assumed, before `attach`."""
        if self.first_offset is None:
            return offset
        return await self.first_offset(tp.partition, offset)

    async def first_to_fetch(self, tp: TP, expected: int, received: int) -> int:
        """Where the records of a hole `expected`..`received - 1` start: the log's first record at or
        after `expected`, or `received` when the log holds none before it (the hole is a gap). Unknown
        (the log did not answer in time, or answered below `expected`) counts as a record at
        `expected`. Faust is told of the gap below the returned offset, so that it commits over it."""
        assert self.first_offset is not None
        first_offset = self.first_offset
        first = await retry_forever(
            f"reading {tp.topic}:{tp.partition} at {expected} from the log",
            lambda: first_offset(tp.partition, expected),
        )
        # An answer below `expected` (the reader reset to the log start: a log truncated or created
        # again) says nothing about the hole either.
        start = expected if first is None or first < expected else min(first, received)
        if start > expected:
            # True of the log whatever the lane does meanwhile, so recorded before the lane is looked
            # at again.
            await record_gap(self.app, tp, expected, start - 1)
        return start

    async def seek(self, tp: TP, offset: int) -> None:
        """Fetch the partition again from `offset`."""
        await self.app.consumer.seek(tp, offset)

    async def undelivered(self, tp: TP, expected: int, timeout: float) -> int | None:
        """The consumer's position on an owned partition when it is past `expected`: the records
        between were fetched and never delivered (None: they were not, or there is no position yet).

        Right after an assignment Faust can skip freshly fetched records and then, for a partition
        without a committed offset, not seek back (seen under CPU load: a new owner received nothing,
        with nothing logged). A hole whose refetch did not take looks the same.
        """
        consumer = self.app.consumer
        if tp not in consumer.assignment():
            return None
        try:
            position = await within(consumer.position(tp), timeout, f"the position of {tp}")
        except DeadlineExceeded:
            return None  # no valid position yet: the consumer is still resetting it
        return position if position is not None and position > expected else None

    def flags(self, tp: TP) -> tuple[bool, bool | None]:
        """(paused in Faust, fetched by Faust) for the partition."""
        return partition_flags(self.app, tp)
