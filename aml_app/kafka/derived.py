"""Reads a derived topic's progress for the gate: a group's committed offsets on it, mapped onto `payments`.

`aml_app.kafka.derivation` holds the arithmetic and the one cooperation asked of the derivation stage; this
module makes its Kafka reads, in the order the mapping's proof needs. Per refresh, after the caller has
read the stage group's committed offsets on `payments` (S):

1. D's partitions (one Metadata request: a partition added since the last refresh is read too) and the
   dependency group's committed offsets on them (one OffsetFetch, which the caller makes as it reads
   every group's: `DependencyOffsets._fetch_committed`);
2. D's ends (one ListOffsets) and, for a partition of D read from a new place, its log start (and once,
   D's configuration: a compacted D is refused);
3. the records of D appended since the last refresh, each read once by a group-less consumer
   (`read_uncommitted`: a stage's open or aborted transactions are extra pending records, which can
   only hold W lower, and pass once the group's offset passes them).

Some brokers (Tansu) answer ListOffsets with the start of a partition's last record batch + 1: the read
goes on to the high watermark of a fetch answer that reaches that answer, which came after that batch and
covers it (`DerivedTopic._read`). Every wait has a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka import errors as Errors
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import OffsetOutOfRangeError

from aml_app.kafka.deadlines import close_within, start_within, within
from aml_app.kafka.derivation import DerivationError, PendingSources, check_retained, source_positions
from aml_app.kafka.metadata import describe_existing

#: Records fetched per call while catching up on a derived partition.
MAX_RECORDS = 5_000
#: Seconds one call waits for records before the high watermark is looked at again.
POLL = 0.01


class DerivedTopic:
    """One dependency group reading topic `topic`, derived from `payments` by the stage whose consumer
    group on `payments` is `stage_group`."""

    def __init__(
        self,
        topic: str,
        group: str,
        stage_group: str,
        client: Mapping[str, Any],
        request_timeout: float = 5.0,
    ) -> None:
        self.topic, self.group, self.stage_group = topic, group, stage_group
        self.pending = PendingSources(topic, group)
        #: The group's offsets on the topic that the last `positions` mapped (a never committed partition:
        #: its log start): a store of the group that has applied these holds every payment below W.
        self.committed: dict[int, int] = {}
        self.request_timeout = request_timeout
        #: Requests made to map the topic (the caller's OffsetFetch of the group on it, ListOffsets, fetch
        #: calls), for the views and the benchmarks.
        self.requests = 0
        #: Records of the derived topic read so far.
        self.records_read = 0
        self._client = dict(client)
        self._consumer: AIOKafkaConsumer | None = None
        self._partitions: list[int] = []
        #: The identity of the log the pending records are of (None: not read yet; `check_log`).
        self.log: str | None = None
        #: Whether the topic's configuration was checked (not compacted) since the last start or close.
        self._checked = False
        #: Per partition, the end this reader last read to (a fetch's high watermark).
        self._read_to: dict[int, int] = {}

    async def _reader(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(
                **self._client,
                group_id=None,
                enable_auto_commit=False,
                client_id="aml-gate-derived",
                isolation_level="read_uncommitted",
                # A read from an offset retention deleted raises (aiokafka's default, "latest", would go
                # on from the end, past records nobody placed): `_read` says which records are gone.
                auto_offset_reset="none",
                request_timeout_ms=int(self.request_timeout * 1000),
                # A read waits for the answer to a fetch at the end: keep that wait short (the partitions
                # are paused between reads, so nothing polls them meanwhile).
                fetch_max_wait_ms=10,
            )
            await start_within(
                consumer.start, consumer.stop, self.request_timeout, "the derived topic reader"
            )
            self._consumer = consumer
        return self._consumer

    def check_log(self, log: str) -> None:
        """`log` is the identity of the topic's log (`aml_app.kafka.identity`), read after this refresh's
        reads: the pending records are facts about one log. A topic deleted and created again under the
        same name starts a new log whose offsets the kept records say nothing about: they are dropped,
        and the refresh that read them fails with one sentence; the next one reads the new log from the
        group's offsets on it."""
        if self.log is None or self.log == log:
            self.log = log
            return
        before, self.log = self.log, log
        self.pending, self.committed = PendingSources(self.topic, self.group), {}
        self._forget_topic()
        raise DerivationError(
            f"{self.topic!r} was created again (its log was {before}, it is {log}): what the gate had read "
            "of it is dropped, and read again from the group's offsets on the new log"
        )

    def take_over(self, before: DerivedTopic) -> None:
        """Go on from what `before` (a reader this one replaces) has read of the topic: the pending
        records are facts about the log, whatever became of its clients, and reading a large lag again
        at every replacement could never fit a refresh's deadline. `before` keeps none of them, so a
        read it has left running cannot change them."""
        self.pending, before.pending = before.pending, PendingSources(self.topic, self.group)
        self.committed, self.log = before.committed, before.log

    def _forget_topic(self) -> None:
        """What the next `partitions` reads again: the topic's partitions, configuration and ends."""
        self._partitions, self._read_to, self._checked = [], {}, False

    async def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        self._forget_topic()
        if consumer is not None:
            await close_within(consumer.stop(), self.request_timeout, "stopping the derived topic reader")

    async def partitions(self, admin: AIOKafkaAdminClient) -> list[int]:
        """The topic's partitions, read at every refresh after the stage's offsets (and the topic checked
        once per reader: not compacted); the reader is assigned them, paused. A partition added to the
        topic holds records of payments below the stage's offsets as soon as the stage writes there:
        left unread, they would not hold W."""
        consumer = await self._reader()
        if not self._checked:
            self.requests += 1
            await within(
                _refuse_compacted(admin, self.topic),
                self.request_timeout,
                f"reading {self.topic!r}'s configuration",
            )
            self._checked = True
        self.requests += 1
        described = await within(
            _partitions_of(admin, self.topic), self.request_timeout, f"describing {self.topic!r}"
        )
        # Partitions never leave a topic, but a broker whose metadata lags can describe fewer than the
        # last answer did: the ones known stay read, or their pending records would stop holding W.
        partitions = sorted({*described, *self._partitions, *self.pending.known()})
        if partitions != self._partitions:
            assigned = [TopicPartition(self.topic, d) for d in partitions]
            consumer.assign(assigned)
            consumer.pause(*assigned)
            self._partitions = partitions
            self._read_to.clear()
        return self._partitions

    async def positions(
        self,
        payments_partitions: Sequence[int],
        stage: Mapping[int, int | None],
        raw: Mapping[int, int | None],
    ) -> dict[int, int]:
        """W(p) of the group on `payments`; `stage` is S(p), read first, then `raw`, the group's committed
        offsets on every partition of the topic (`partitions`; None: nothing committed). Raises
        DerivationError (one sentence) when the topic cannot be mapped."""
        if not self._partitions:
            raise RuntimeError(f"{self.topic!r}'s partitions are read (`partitions`) before its positions")
        consumer = await self._reader()
        tps = {d: TopicPartition(self.topic, d) for d in self._partitions}
        self.requests += 1
        reported = await within(
            consumer.end_offsets(list(tps.values())),
            self.request_timeout,
            f"reading the ends of {self.topic!r}",
        )
        # Where every partition starts, in one request: the records the group has not read must still be
        # in the log, whether this bookkeeping read them before or not (retention deletes both alike).
        self.requests += 1
        starts = await within(
            consumer.beginning_offsets(list(tps.values())),
            self.request_timeout,
            f"reading where {self.topic!r} starts",
        )
        committed = {
            d: check_retained(self.topic, self.group, d, raw.get(d), starts[tp]) for d, tp in tps.items()
        }
        ends = {}
        for d, tp in tps.items():
            ends[d] = await self._read_to_end(consumer, d, tp, committed[d], reported[tp])
        self.committed = committed
        return self.pending.positions(payments_partitions, stage, committed, ends)

    async def _read_to_end(
        self, consumer: AIOKafkaConsumer, partition: int, tp: TopicPartition, committed: int, reported: int
    ) -> int:
        """Read `partition` from where the bookkeeping needs it to its end (see the module docstring);
        returns that end. The partition is fetched only during this call (paused otherwise)."""
        start = self.pending.next_read(partition, committed)
        done = self._read_to.get(partition)
        if done is not None and reported <= done <= start:
            return start  # read to the end before, and no batch appended since (it would start at `done`)
        consumer.resume(tp)
        consumer.seek(tp, start)  # also wakes the fetcher up for the resumed partition
        try:
            return await self._read(consumer, partition, tp, start, reported)
        finally:
            consumer.pause(tp)

    async def _read(
        self, consumer: AIOKafkaConsumer, partition: int, tp: TopicPartition, start: int, reported: int
    ) -> int:
        """Fetch from `start` until past `reported` and a high watermark that reaches it.

        A fetch answer whose high watermark reaches `reported` came after the last batch that
        ListOffsets saw was appended (it starts at or before `reported - 1`), so its high watermark is at
        or past that batch's end: every record there was when the stage's offsets were read lies below."""
        deadline = time.monotonic() + self.request_timeout
        while True:
            position = await consumer.position(tp)
            highwater = consumer.highwater(tp)
            if highwater is not None and highwater >= reported and position >= highwater:
                self.pending.read_to(partition, position)
                self._read_to[partition] = position
                return position
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"reading {self.topic}[{partition}] from {start} to {max(reported, highwater or 0)} took "
                    f"longer than {self.request_timeout:g} s"
                )
            self.requests += 1
            # Short waits: an answer without records updates the high watermark, yet getmany would go on
            # waiting for records until its timeout.
            try:
                batches = await within(
                    consumer.getmany(
                        tp, timeout_ms=int(min(remaining, POLL) * 1000), max_records=MAX_RECORDS
                    ),
                    remaining + 1,
                    f"reading {self.topic}[{partition}]",
                )
            except OffsetOutOfRangeError:
                raise DerivationError(
                    f"{self.topic}[{partition}] from {position} is gone from the log (retention, or the "
                    f"topic was created again) before {self.group!r} or the gate read it: the payments in "
                    "those records cannot be placed; the mapping goes on once the group commits past them"
                ) from None
            for message in batches.get(tp, []):
                where = (self.topic, partition, message.offset)
                self.pending.add(partition, message.offset, source_positions(message.headers, *where))
                self.records_read += 1


async def _refuse_compacted(admin: AIOKafkaAdminClient, topic: str) -> None:
    """A compacted topic drops records a later one with the same key replaces, the payments they name
    with them: the group may never read them, and no bookkeeping can tell whether it applied them."""
    answers = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    for answer in answers:
        for resource in answer.resources:
            code, message = resource[0], resource[1]
            if code:  # no entries then: unknown is not "not compacted", and the next refresh asks again
                raise DerivationError(
                    f"cannot read {topic!r}'s configuration to check it is not compacted: "
                    f"{Errors.for_code(code).__name__}{f' ({message})' if message else ''}"
                )
            for name, value, *_ in resource[4]:
                if name == "cleanup.policy" and "compact" in (value or ""):
                    raise DerivationError(
                        f"{topic!r} is compacted (cleanup.policy={value}): records replaced by later ones "
                        "take the payments they name with them, so the gate maps only a derived topic that "
                        "keeps its records (cleanup.policy=delete)"
                    )


async def _partitions_of(admin: AIOKafkaAdminClient, topic: str) -> list[int]:
    described = await describe_existing(admin, [topic])
    found = [t for t in described if t["topic"] == topic and not t["error_code"]]
    partitions = sorted(p["partition"] for p in found[0]["partitions"]) if found else []
    if not partitions:
        raise RuntimeError(f"topic {topic!r} does not exist (yet)")
    return partitions
