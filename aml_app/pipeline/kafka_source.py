"""A Kafka streaming source for PySpark, written with the Python Data Source API.

The PySpark wheel ships no Kafka connector (that is a Maven jar), so this source reads Kafka with
confluent-kafka: the driver plans offset ranges per partition, the executors read them and hand Spark Arrow
record batches. Usage:

    spark.dataSource.register(KafkaSource)
    spark.readStream.format("aml-kafka")
        .option("kafka.bootstrap.servers", "host:9092")
        .option("subscribe", "payments")
        .option("startingOffsets", '{"0": 42}')  # where a new query starts (else the log start), or
        .option("groupId", "relations")          # start from this group's committed offsets
        .option("maxRecordsPerTrigger", "100000")  # back-pressure: records per micro-batch
        .option("maxTasks", "2")                  # pack a batch's partitions into at most 2 tasks
        .option("minRecordsPerTask", "5000")      # and a smaller batch into fewer (the default)
        .option("log", "cluster:topic-id")        # the log the query's results are of (else its first)
        .option("sourceHeader", "aml-source")     # add a column with each record's first such header
        .option("transactional", "true")          # the topic is written in transactions (see below)
        .load()

Columns: partition INT, offset BIGINT, timestamp TIMESTAMP, key BINARY, value BINARY, and with
`sourceHeader`, source STRING (the header's first value as UTF-8 text, null without one: a topic derived
from payments names each record's payment there, `aml_app.kafka.derivation`). Options starting with
`kafka.` go to the client as they are (e.g. `kafka.security.protocol`, `kafka.sasl.mechanism`).

`transactional` says whether the topic's offsets have holes (transaction markers): "true" by default with
`sourceHeader` (a derived topic, which its stage writes in transactions), else "false" (payments). A task
reads a jump in the offsets of a topic without holes again rather than skip records (`read_ranges`).

The source does not commit the group's offsets itself: Spark calls `commit(end)` one batch late and never
while the topic is idle, so the service commits after its own store write instead (see `progress.py`).

Offsets mean something only within one log (`aml_app.kafka.identity`): the planner stops the query
(`LogChanged`) when the topic's log is no longer the one given as `log` (see `KafkaStreamReader`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from pyspark.sql.types import StructType

from aml_app.kafka.identity import LogUnknown, log_identity
from aml_app.pipeline.ranges import (
    Range,
    SparkOffset,
    from_spark,
    pack_ranges,
    plan_end,
    planned_ranges,
    starting_offsets,
    to_spark,
)

SCHEMA = "partition INT, offset BIGINT, timestamp TIMESTAMP, key BINARY, value BINARY"
#: The schema with `sourceHeader` given.
SOURCE_SCHEMA = f"{SCHEMA}, source STRING"
#: The latest record timestamp (ms) the source passes on: 9999-12-31T23:59:59.999Z, after every `ts` the
#: contract accepts, so a later one bounds nothing. Kafka takes any 64-bit timestamp from a producer, and
#: one past about year 294,000 overflows Spark's microseconds (the read would fail, and the query with it):
#: such a record reads as one without a timestamp, which the contract treats alike.
LATEST_TIMESTAMP_MS = 253_402_300_799_999
ARROW_BATCH_ROWS = 10_000
#: A micro-batch gets one reading task per this many records (at most maxTasks): a task costs tens of
#: milliseconds of its own, more than reading and checking a few thousand records in parallel saves.
MIN_RECORDS_PER_TASK = 5_000
METADATA_TIMEOUT = 10.0
#: The planner asks which log the topic is at most this often (seconds): a topic deleted and created again
#: is noticed within about this long, at the price of one admin request per interval.
LOG_CHECK_INTERVAL = 10.0
#: A plan whose reading of the log ends takes longer (seconds) is logged with where its time went: under
#: overload on the embedded broker the planner has stood still for minutes, inside these reads.
SLOW_PLAN = 2.0

#: How long (seconds) the planner plans nothing while it cannot read the log before it stops the query: a
#: broker away for less (a restart, a frozen process) costs the pipeline a pause, not a restart.
PLAN_OUTAGE_LIMIT = 120.0
# A task that gets no record for this long fails instead of hanging the batch: on a cluster Spark retries
# it (spark.task.maxFailures); in local mode (`local[2]`, no retries) the query stops and the pipeline
# exits, for its supervisor to start again. As long as the planner waits: a read under way when the
# broker stops answering rides out what a plan does.
READ_STALL_TIMEOUT = PLAN_OUTAGE_LIMIT
#: How long the query's start pauses between two reads of a log it cannot read (seconds).
PLAN_RETRY_S = 1.0
#: How long a task reads a jump in the offsets of a topic without holes again before it fails, and the
#: pause before each reading (seconds). The harness's readers see the embedded broker show an earlier
#: record batch within a second of a later one (`aml_app.harness.tails.GAP_CONFIRM_S`); the budget
#: leaves room for a loaded machine, since a failed task stops the query in local mode.
REREAD_BUDGET_S = 10.0
REREAD_PAUSE_S = 0.1

#: Settings of every client the source makes, one per plan or task. librdkafka holds back a client's
#: first connection to the cluster for half of reconnect.backoff.ms (100 ms by default) whenever a request
#: arrives before its bootstrap connection is up, which for a fresh client is nearly always: a plan's
#: reading of the log ends took 57 ms at rest against 21 with 10 (`bench.probe_answers`). Backoff after
#: a failed connection still grows to reconnect.backoff.max.ms (10 s).
FRESH_CLIENT = {"reconnect.backoff.ms": 10}

log = logging.getLogger(__name__)


class SourceConfigError(ValueError):
    """An option of the source is missing or wrong."""


class LogUnreadable(RuntimeError):
    """The cluster does not say what the topic holds: unreachable, no such topic, or a partition's log end
    unknown (its ListOffsets end can be short, and the fetch that tells goes unanswered)."""


class RecordsSkipped(RuntimeError):
    """The client keeps handing a task a later record than the next one of a topic without holes."""


class LogChanged(RuntimeError):
    """The topic is no longer the log the query's results are of (another log, or this one cut below
    where the query stands); the message says what to do."""


def log_changed(services: Sequence[str], store: str, topic: str, old: str, new: str) -> str:
    """The sentence that refuses stores built from log `old` of `topic` now that it is log `new`.

    The pipeline refuses such a store at start-up, and the planner stops a running query with it."""
    cause = "(the topic was deleted and created again, or the cluster changed)"
    if not services:
        return f"topic {topic} was log {old} when this query started, but is now log {new} {cause}"
    if len(services) == 1:
        built, them, stores = f"the {services[0]} store at {store} was", "it", "store"
    else:
        built, them, stores = f"the {' and '.join(services)} stores at {store} were", "them", "stores"
    rebuild = ", ".join(f"aml-app rebuild {service}" for service in services)
    return (
        f"{built} built from log {old} of topic {topic}, but {topic} is now log {new} {cause}: rebuild "
        f"{them} ({rebuild}), or point AML_STORE_URL at this log's {stores}"
    )


def log_truncated(
    services: Sequence[str], store: str, topic: str, partition: int, end: int, standing: int
) -> str:
    """The sentence that stops a query whose partition now ends at `end`, below `standing`, where the
    query stands, on the same log: records written from `end` on would take offsets the stores count as
    applied, and be skipped."""
    where = f"partition {partition} of topic {topic} now ends at {end}, below offset {standing} where "
    cause = "(a leader without its latest records took over, or a broker lost its unflushed tail)"
    skipped = f"the records written there from offset {end} on would be skipped"
    if not services:
        return f"{where}this query stands on the same log {cause}: {skipped}"
    stores = "store" if len(services) == 1 else "stores"
    rebuild = ", ".join(f"aml-app rebuild {service}" for service in services)
    return (
        f"{where}the {' and '.join(services)} {stores} at {store} stand on the same log {cause}: "
        f"{skipped}; rebuild the {stores} ({rebuild})"
    )


def client_config(options: Mapping[str, str]) -> dict[str, Any]:
    """confluent-kafka settings from the source options: every `kafka.*` option, prefix removed."""
    config = {k.removeprefix("kafka."): v for k, v in options.items() if k.startswith("kafka.")}
    if not config.get("bootstrap.servers"):
        raise SourceConfigError("the aml-kafka source needs the option kafka.bootstrap.servers")
    return config


def parse_starting_offsets(raw: str | None) -> dict[int, int] | None:
    """`startingOffsets`: "earliest" ({}), or JSON {"partition": next offset, ...}; None if absent."""
    if raw is None or raw.strip() == "":
        return None
    if raw.strip() == "earliest":
        return {}
    import json

    try:
        parsed = json.loads(raw)
        offsets = {int(p): int(o) for p, o in parsed.items()}
    except (ValueError, AttributeError, TypeError):
        raise SourceConfigError(
            f'startingOffsets={raw[:80]!r} is neither "earliest" nor a JSON object such as {{"0": 42}}'
        ) from None
    if any(p < 0 or o < 0 for p, o in offsets.items()):
        raise SourceConfigError(f"startingOffsets={raw[:80]!r} has a negative partition or offset")
    return offsets


class KafkaTask(InputPartition):
    """One Spark task: for each (partition, start, end), the offsets start <= o < end of that partition."""

    def __init__(self, ranges: Sequence[Range]) -> None:
        super().__init__(tuple(ranges))
        self.ranges = tuple(ranges)


def _consumer(config: Mapping[str, Any]) -> Any:
    from confluent_kafka import Consumer

    return Consumer(
        {
            **FRESH_CLIENT,
            # A group id is required by the client but never joined: we only assign() and never commit here.
            "group.id": "aml-kafka-source-reader",
            # A task reads ranges below the high watermark, so a long-polling fetch has nothing to wait for;
            # but librdkafka keeps one fetch in flight per broker, and when a task moves on to its next
            # partition, that fetch (still held by the broker for the old one) would delay the first
            # records of the new one by up to this wait (500 ms by default: a quarter-second per batch).
            # Not less: the embedded broker answers a fetch that may wait only 1 ms with no records when
            # the partition holds a few thousand record batches (a read stalled at 2,500).
            "fetch.wait.max.ms": 10,
            # librdkafka stops fetching a partition whose local queue holds queued.min.messages (100,000)
            # and fetches it again only after this backoff, 1 s by default (librdkafka issue 2879): a task
            # reading a range of more than that idled a second per 100,000 records or so (one 600,000-record
            # range: 3.3-3.6 s instead of 0.65-0.82 s; bench/fetch_backoff.py). The queue drains far faster.
            "fetch.queue.backoff.ms": 10,
            **config,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )


def topic_partitions(consumer: Any, topic: str) -> list[int]:
    """Every partition the topic has now (new partitions included), from the cluster's metadata."""
    metadata = consumer.list_topics(topic, timeout=METADATA_TIMEOUT)
    described = metadata.topics.get(topic)
    if described is None or described.error is not None or not described.partitions:
        reason = described.error if described is not None else "no such topic"
        raise LogUnreadable(f"cannot read the partitions of topic {topic!r}: {reason}")
    return sorted(described.partitions)


def topic_watermarks(
    config: Mapping[str, Any], topic: str, client: Any = None, partitions: Sequence[int] | None = None
) -> dict[int, tuple[int, int]]:
    """(low, high) watermarks by ListOffsets of `partitions` (default: every partition the topic has now).

    Uses `client` (a consumer) when given, else a short-lived one. On the embedded broker a ListOffsets
    costs about 1.6 µs of its CPU per record batch the partition holds, and librdkafka asks twice per
    partition (low and high), so the planner asks only about partitions it knows nothing of.
    """
    from confluent_kafka import TopicPartition

    consumer = client or _consumer(config)
    try:
        asked = topic_partitions(consumer, topic) if partitions is None else partitions
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=METADATA_TIMEOUT)
            for p in asked
        }
    finally:
        if client is None:
            consumer.close()


def fetched_high_watermarks(
    consumer: Any, topic: str, starts: Mapping[int, int], timeout: float = METADATA_TIMEOUT
) -> dict[int, int]:
    """High watermarks as fetch responses report them, for the partitions it could reach in `timeout`.

    ListOffsets (what `get_watermark_offsets` asks) is the usual way, and on Apache Kafka both agree. Some
    Kafka-compatible brokers answer ListOffsets with the base offset of the last record batch instead
    (Tansu, our embedded broker, does: 1 for a 1000-record batch), which would leave a batch's tail unread
    until the next write. A fetch response always carries the real high watermark; where ListOffsets was
    asked too, the planner takes the larger of the two (`log_ends`).

    The answer is librdkafka's cache of each partition's high watermark, which every fetch response sets
    for all the partitions it covers (one request covers every partition a broker leads) and which a
    fresh consumer holds empty (-1001) until then; the records themselves are never read. Reading them
    instead took up to `timeout` under a steady write: the queue hands out one partition's records after
    another, and a probe that started deep in one partition's log reached the next partition's first
    record only after that backlog (10 s with no answer for one partition of four at 2,000 records/s:
    `bench/probe_answers.py`). The fetch is bounded to one small batch per partition, and callers start
    it where the end can be no earlier (`probe_starts`), so Kafka answers at once.
    """
    from confluent_kafka import TopicPartition

    consumer.assign([TopicPartition(topic, p, o) for p, o in starts.items()])
    ends: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    try:
        while True:
            for p in starts:
                if p not in ends:
                    _low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)
                    if high >= 0:
                        ends[p] = high
            if len(ends) == len(starts) or time.monotonic() >= deadline:
                return ends
            # Returns with the next fetch response's first record or event (dropped), or after 10 ms.
            consumer.poll(0.01)
    finally:
        consumer.unassign()


def probe_starts(
    partitions: Sequence[int], marks: Mapping[int, tuple[int, int]], floors: Mapping[int, int]
) -> dict[int, int]:
    """Where the fetch probe starts on each partition: where the log can end no earlier, the later of
    ListOffsets' answer (`marks`, where asked) and `floors` (where the query stands, where known)."""
    return {p: max(marks[p][1] if p in marks else 0, floors.get(p, 0)) for p in partitions}


def cut_below(
    standing: Mapping[int, int], marks: Mapping[int, tuple[int, int]], ends: Mapping[int, int]
) -> dict[int, int]:
    """The partitions whose end, as a fetch reported it, is below where the query stands (`standing`).

    `bounds` lists (`marks`) a partition the query stands on only when no fetch answered for it, and
    ListOffsets can answer short of the end (the embedded broker: the start of the last record batch + 1),
    so a listed end never counts: a short answer must not stop a healthy query."""
    return {p: ends[p] for p, o in standing.items() if p in ends and p not in marks and ends[p] < o}


def log_ends(marks: Mapping[int, tuple[int, int]], probed: Mapping[int, int]) -> dict[int, int]:
    """Each partition's log end: the larger of ListOffsets' answer (`marks`, where asked) and the probe's
    (`probed`, where it answered)."""
    return {p: max(marks[p][1] if p in marks else -1, probed.get(p, -1)) for p in sorted({*marks, *probed})}


def past_the_end(
    config: Mapping[str, Any], topic: str, partition: int, offset: int, timeout: float = METADATA_TIMEOUT
) -> bool:
    """Whether the partition's leader refuses a fetch at `offset` as out of range: its log ends before it.
    A fetch at or below the leader's log end is answered (with nothing past its high watermark), so a
    high watermark below `offset` alone does not say the log was cut. False when no answer came in
    `timeout`: the planner asks again at its next plan."""
    from confluent_kafka import KafkaError, TopicPartition

    consumer = probe_consumer(config, reset="error")
    try:
        consumer.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = consumer.poll(0.1)
            if message is None:
                continue
            error = message.error()
            if error is None or error.code() == KafkaError._PARTITION_EOF:
                return False
            if error.code() == KafkaError._AUTO_OFFSET_RESET:
                return True
        return False
    finally:
        consumer.close()


def probe_consumer(config: Mapping[str, Any], reset: str = "earliest") -> Any:
    """A consumer for `fetched_high_watermarks` and `past_the_end`: fetches as little as the protocol
    allows; `reset` is its auto.offset.reset ("error": an offset past the log's end is reported)."""
    from confluent_kafka import Consumer

    return Consumer(
        {
            **FRESH_CLIENT,
            "group.id": "aml-kafka-source-probe",
            **config,
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": reset,
            "max.partition.fetch.bytes": 1,
            "queued.min.messages": 1,
            "fetch.wait.max.ms": 10,
            # The probe's queue is over queued.min.messages after its first fetch, and librdkafka then
            # holds back the partition's next fetch for fetch.queue.backoff.ms (1 s by default): a probe
            # that has to fetch again would wait that out. librdkafka also holds back a fresh client's
            # first fetch for it.
            "fetch.queue.backoff.ms": 1,
        }
    )


#: How many fresh probes `log_bounds` makes for the partitions no fetch answered before it gives up.
PROBE_ROUNDS = 3


def log_bounds(
    config: Mapping[str, Any], topic: str, rounds: int = PROBE_ROUNDS
) -> dict[int, tuple[int, int]]:
    """(log start, log end) of every partition, the end as fetch responses report it (see
    `fetched_high_watermarks`), with short-lived clients.

    The pipeline's start compares each store's offsets with these ends (a store past the end is of
    another log), so an end only ListOffsets gave, which can be short of the real one, would refuse a
    healthy store. A partition no fetch answered is probed again, and after `rounds` probes without an
    answer this raises LogUnreadable."""
    marks: dict[int, tuple[int, int]] | None = None
    fetched: dict[int, int] = {}
    missing: list[int] = []
    for _ in range(rounds):
        probe = probe_consumer(config)
        try:
            if marks is None:
                marks = topic_watermarks(config, topic, probe)
            missing = [p for p in marks if p not in fetched]
            fetched.update(fetched_high_watermarks(probe, topic, probe_starts(missing, marks, {})))
        finally:
            probe.close()
        missing = [p for p in marks if p not in fetched]
        if not missing:
            break
    assert marks is not None
    if missing:
        raise LogUnreadable(unanswered(topic, missing, rounds))
    ends = log_ends(marks, fetched)
    return {p: (low, ends[p]) for p, (low, _high) in marks.items()}


def unanswered(topic: str, partitions: Sequence[int], probes: int) -> str:
    return (
        f"no fetch answered for partitions {sorted(partitions)} of {topic!r} in {probes} probe(s) of "
        f"{METADATA_TIMEOUT:g} s: their log end is unknown (a ListOffsets answer alone can be short of it)"
    )


def committed_offsets(config: Mapping[str, Any], topic: str, group: str, partitions: list[int]) -> dict:
    """The group's committed offsets (None where it has none), read without joining the group."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**config, "group.id": group, "enable.auto.commit": False})
    try:
        found = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=METADATA_TIMEOUT)
        return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in found}
    finally:
        consumer.close()


def read_range(
    config: Mapping[str, Any], topic: str, partition: int, start: int, end: int, rows: int = ARROW_BATCH_ROWS
) -> Iterator[Any]:
    """Yield Arrow record batches with the records start <= offset < end of one partition."""
    yield from read_ranges(config, topic, [(partition, start, end)], rows)


def first_header(headers: Sequence[tuple[str, bytes | None]] | None, name: str) -> str | None:
    """The first value of header `name` as text (None: no such header, or not UTF-8)."""
    for key, value in headers or ():
        if key == name:
            try:
                return None if value is None else value.decode()
            except UnicodeDecodeError:
                return None
    return None


def read_ranges(
    config: Mapping[str, Any],
    topic: str,
    ranges: Sequence[Range],
    rows: int = ARROW_BATCH_ROWS,
    source_header: str | None = None,
    transactional: bool = False,
    services: Sequence[str] = (),
) -> Iterator[Any]:
    """Yield Arrow record batches with the records of each (partition, start, end) range, in turn; with
    `source_header`, a `source` column of each record's first such header (`first_header`), and a jump
    of more than a commit marker checked against the log start: a derived topic's records that
    retention deleted before `services` read them stop the query (`refuse_gone`).

    One client serves every range of a task. A range ends at the first record at or past `end - 1` or
    when the client reports the end of the partition at or past `end`. A batch never mixes partitions.

    The batch handler counts a range as applied up to its last record, so a record the client skips is
    lost. A topic written in transactions (`transactional`: the derived topic, a marker at each commit)
    has holes, and a jump in its offsets is taken at once: any wait per jump would cost every
    micro-batch that wait per marker. A topic without holes (payments) has none, so a jump there is
    either retention, which deleted the records before the task read them (the client resumes at the
    log start: logged, `retained`), or records the client skipped: the embedded broker can show a
    partition's later record batch before an earlier one when several producers write it (the
    harness's readers met it in 1 of 9 runs, `aml_app.harness.tails.InOrder`). The task reads from
    the expected offset again for up to REREAD_BUDGET_S, then fails (in local mode the query stops).
    """
    import pyarrow as pa
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    consumer = _consumer(config)
    columns: dict[str, list] = {"offset": [], "timestamp": [], "key": [], "value": []}
    if source_header is not None:
        columns["source"] = []

    def flush(partition: int) -> Any:
        n = len(columns["offset"])
        arrays = [
            pa.array([partition] * n, pa.int32()),
            pa.array(columns["offset"], pa.int64()),
            pa.array(columns["timestamp"], pa.timestamp("us", tz="UTC")),
            pa.array(columns["key"], pa.binary()),
            pa.array(columns["value"], pa.binary()),
        ]
        names = ["partition", "offset", "timestamp", "key", "value"]
        if source_header is not None:
            arrays.append(pa.array(columns["source"], pa.string()))
            names.append("source")
        batch = pa.RecordBatch.from_arrays(arrays, names=names)
        for values in columns.values():
            values.clear()
        return batch

    try:
        for partition, start, end in ranges:
            consumer.assign([TopicPartition(topic, partition, start)])
            position = start
            rereads, jumped_at = 0, None
            last_progress = time.monotonic()
            while position < end:
                messages = consumer.consume(num_messages=min(rows, end - position), timeout=0.5)
                if not messages and time.monotonic() - last_progress > READ_STALL_TIMEOUT:
                    raise TimeoutError(
                        f"no record of {topic}[{partition}] at offset {position} (reading up to {end}) "
                        f"for {READ_STALL_TIMEOUT:.0f} s"
                    )
                for message in messages:
                    error = message.error()
                    eof = error is not None and error.code() == KafkaError._PARTITION_EOF
                    if error is not None and not eof:
                        raise KafkaException(error)
                    offset = message.offset()
                    if offset > position + 1 and source_header is not None:
                        # More than a commit marker: an aborted transaction, or records retention deleted
                        # before they were read, which a commit past them would claim the store holds.
                        refuse_gone(consumer, topic, partition, position, services)
                    if offset > position and not transactional:
                        position = retained(consumer, topic, partition, position, end)
                        if position < min(offset, end):
                            rereads += 1
                            jumped_at = jumped_at or time.monotonic()
                            if time.monotonic() - jumped_at > REREAD_BUDGET_S:
                                raise RecordsSkipped(skipped(topic, partition, position, offset, rereads))
                            time.sleep(REREAD_PAUSE_S)
                            consumer.assign([TopicPartition(topic, partition, position)])
                            break
                    if eof:
                        position = max(position, offset)
                        continue
                    if offset < position:
                        continue  # read before (a client that went back to the log start)
                    if offset >= end:
                        position = end
                        break
                    last_progress = time.monotonic()
                    rereads, jumped_at = 0, None
                    position = offset + 1
                    columns["offset"].append(offset)
                    _, ts_ms = message.timestamp()
                    columns["timestamp"].append(ts_ms * 1000 if 0 <= ts_ms <= LATEST_TIMESTAMP_MS else None)
                    columns["key"].append(message.key())
                    columns["value"].append(message.value())
                    if source_header is not None:
                        columns["source"].append(first_header(message.headers(), source_header))
                if len(columns["offset"]) >= rows:
                    yield flush(partition)
            if columns["offset"]:
                yield flush(partition)
            consumer.unassign()
    finally:
        consumer.close()


def refuse_gone(consumer: Any, topic: str, partition: int, position: int, services: Sequence[str]) -> None:
    """Raise LogChanged when retention deleted a derived topic's records from `position` on: each names
    payments that are then in no store, while the group, committed past them, would say they are (the
    gate's reader refuses them too, but only while the group's offsets are below them)."""
    low = log_start(consumer, topic, partition)  # None: no answer now, and the next jump asks again
    if low is not None and low > position:
        raise LogChanged(derived_gone(services, topic, partition, position, low))


def log_start(consumer: Any, topic: str, partition: int) -> int | None:
    """The partition's log start as the broker gives it now; None when it does not answer in time."""
    from confluent_kafka import KafkaException, TopicPartition

    try:
        low, _high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=METADATA_TIMEOUT
        )
    except KafkaException:
        return None
    return int(low)


def derived_gone(services: Sequence[str], topic: str, partition: int, position: int, low: int) -> str:
    """The sentence that stops a query whose derived topic lost records it had not read."""
    whose = " and ".join(services) or "the services"
    rebuild = ", ".join(f"aml-app rebuild {s}" for s in services) or "aml-app rebuild"
    return (
        f"offsets {position}..{low - 1} of partition {partition} of topic {topic} were deleted by "
        f"retention before {whose} read them: the payments they name are in no store, and a commit past "
        f"them would say they are; derive them again and rebuild the stores ({rebuild}), and keep {topic} "
        "longer than the pipeline may stand still"
    )


def retained(consumer: Any, topic: str, partition: int, position: int, end: int) -> int:
    """Where a partition's records go on from `position`: its log start, when retention deleted the
    records from `position` on (logged once, with those of the range up to `end`: they exist nowhere)."""
    low = log_start(consumer, topic, partition)  # None: no answer now, read again within the budget
    if low is None or low <= position:
        return position
    log.warning(
        "%s[%d]: offsets %d..%d were deleted by retention before the pipeline read them: their records "
        "are lost, and the pipeline goes on from offset %d",
        topic, partition, position, min(low, end) - 1, low,
    )  # fmt: skip
    return low


def skipped(topic: str, partition: int, position: int, offset: int, reads: int) -> str:
    return (
        f"{topic}[{partition}] handed this task offset {offset} where it expects {position}, "
        f"{reads} times in {REREAD_BUDGET_S:g} s: offsets {position}..{offset - 1} are missing from a topic "
        "read as one without transactions (the source's option transactional; for payments "
        "AML_PAYMENTS_TRANSACTIONAL), so the task fails rather than count them as read"
    )


def count_option(options: Mapping[str, str], name: str) -> int | None:
    """A whole-number option of at least 1, or None when it is not given."""
    raw = options.get(name)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise SourceConfigError(f"{name}={raw!r} is not a whole number") from None
    if value < 1:
        raise SourceConfigError(f"{name}={raw} must be at least 1")
    return value


def flag_option(options: Mapping[str, str], name: str, default: bool) -> bool:
    """A "true" or "false" option, or `default` when it is not given."""
    raw = options.get(name)
    if not raw:
        return default
    if raw.strip().lower() not in ("true", "false"):
        raise SourceConfigError(f'{name}={raw[:80]!r} is neither "true" nor "false"')
    return raw.strip().lower() == "true"


class KafkaStreamReader(DataSourceStreamReader):
    """The planner (driver side) and the readers (executors) of the `aml-kafka` source.

    The planner also watches which log the topic is, because it is where a new log's offsets would enter
    the query: a topic deleted and created again starts at offset 0, and once its records pass the
    offsets the query stands at, they would be read and written as if they continued the old log. Every
    plan looks at the clock, and asks the cluster (`log_identity`, one admin request) only when
    LOG_CHECK_INTERVAL has passed since it last did, or at once when a partition ends below where the
    query stands or has gone (what a new log looks like). A log other than `log` (the identity the
    stores recorded, given by the pipeline; else the one seen at the first plan) raises `LogChanged`:
    Spark stops the query with its sentence before any record of the new log is planned, and the
    pipeline exits with it. So does a partition that ends below where the query stands on the same log
    (`cut_below`): records written after such a cut take offsets the groups have committed past. The
    planner, rather than the batch handler, because it runs even while the topic is idle (the change is
    noticed before the first new record arrives) and it already holds the Kafka settings; the batch
    handler would see a new log's records only once they are read.
    """

    #: Which log a topic is (module-level function; a test gives the reader a fake one).
    read_log = staticmethod(log_identity)
    #: Whether a fetch at an offset is refused as past the log's end (a test gives the reader a fake one).
    confirm_cut = staticmethod(
        lambda config, topic, partition, offset: past_the_end(config, topic, partition, offset)
    )
    #: The planner's clock, and how it pauses (a test gives the reader fake ones).
    clock = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)

    def __init__(self, options: Mapping[str, str]) -> None:
        self.config = client_config(options)
        self.topic = options.get("subscribe", "")
        if not self.topic:
            raise SourceConfigError("the aml-kafka source needs the option subscribe (one topic name)")
        self.group = options.get("groupId") or None
        self.starting = parse_starting_offsets(options.get("startingOffsets"))
        self.max_records = count_option(options, "maxRecordsPerTrigger")
        self.max_tasks = count_option(options, "maxTasks")
        self.min_records_per_task = count_option(options, "minRecordsPerTask") or MIN_RECORDS_PER_TASK
        #: The log the query's results are of; what the stores built from it are, for LogChanged's sentence.
        self.log: str | None = options.get("log") or None
        self.log_services = tuple(s for s in options.get("services", "").split(",") if s)
        self.log_store = options.get("store", "")
        self.source_header = options.get("sourceHeader") or None
        self.transactional = flag_option(options, "transactional", self.source_header is not None)
        self._log_checked_at: float | None = None
        #: When the planner last began to fail to read the log (None: it reads it).
        self._unreadable_since: float | None = None

    def bounds(
        self, floors: Mapping[int, int] | None = None, *, answered: bool = False
    ) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
        """ListOffsets' (low, high) of the partitions not in `floors`, and every partition's log end as
        fetches report it, read with a probe made for this plan alone.

        `floors` is where the query stands: the log reaches at least there, so the probe starts there and
        those partitions need no ListOffsets, whose cost on the embedded broker grows with the partition
        (a reading took 4 ms of broker CPU against 26 with every partition listed, at 2,500 record
        batches a partition: `bench/probe_answers.py`). A partition the probe does not reach is listed
        after all. A probe kept across plans would hold the topic in librdkafka's metadata cache, and
        librdkafka can crash the process when that topic is deleted and created again (same name, new
        topic id: confluentinc/librdkafka#4964; measured here in 1 of about 8 runs of the planner's
        test). The fresh probe costs about 13 ms more per plan (median 17 ms against 4 on the embedded
        broker). A reading slower than SLOW_PLAN is logged with its parts. With `answered`, a partition
        the probe does not reach raises LogUnreadable instead (a query's start clamps the group's offsets
        to these ends: a short one would start it below what its store holds)."""
        floors = floors or {}
        started = self.clock()
        probe = probe_consumer(self.config)
        try:
            partitions = topic_partitions(probe, self.topic)
            unknown = [p for p in partitions if p not in floors]
            marks = topic_watermarks(self.config, self.topic, probe, unknown) if unknown else {}
            listed = self.clock()
            fetched = fetched_high_watermarks(probe, self.topic, probe_starts(partitions, marks, floors))
            probed = self.clock()
            unreached = [p for p in partitions if p not in fetched]
            if unreached and answered:
                raise LogUnreadable(unanswered(self.topic, unreached, 1))
            if unreached:
                marks.update(topic_watermarks(self.config, self.topic, probe, unreached))
        finally:
            probe.close()
        done = self.clock()
        if done - started > SLOW_PLAN:
            # Spark's source runner sets up no logging: Python's last-resort handler prints the message
            # alone to the pipeline's log, so it says when.
            log.warning(
                "the source's planner at %s UTC: reading the log ends of %s took %.1f s: the partitions "
                "and the ListOffsets of %d %.1f s, the fetch probe %.1f s%s",
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                self.topic,
                done - started,
                len(unknown),
                listed - started,
                probed - listed,
                f" (no fetch answer for {unreached}: their ListOffsets taken, {done - probed:.1f} s)"
                if unreached
                else "",
            )
        return marks, log_ends(marks, fetched)

    def check_log(self, now: bool = False) -> None:
        """Raise LogChanged if the topic is no longer log `self.log` (see the class docstring); asks the
        cluster only when `now`, or when LOG_CHECK_INTERVAL has passed since the last answer."""
        checked = self._log_checked_at
        if not now and checked is not None and self.clock() - checked < LOG_CHECK_INTERVAL:
            return
        current = self.read_log(self.config, self.topic)
        self._log_checked_at = self.clock()
        if self.log is None:
            self.log = current
        elif current != self.log:
            raise LogChanged(log_changed(self.log_services, self.log_store, self.topic, self.log, current))

    def initialOffset(self) -> SparkOffset:
        """Where a new query starts; while the log cannot be read, read again every PLAN_RETRY_S for at
        most PLAN_OUTAGE_LIMIT seconds (`unreadable`)."""
        from confluent_kafka import KafkaException

        while True:
            began = self.clock()
            try:
                offsets = self._initial()
            except (KafkaException, LogUnknown, LogUnreadable) as exc:
                self.unreadable(exc, began, "waiting to start the query")
                self.sleep(PLAN_RETRY_S)
                continue
            self.readable()
            return offsets

    def _initial(self) -> SparkOffset:
        self.check_log(now=True)
        # Clamp committed offsets into the log as fetch responses see it: a ListOffsets high watermark that
        # stops at the last batch's base offset would pull a committed offset inside that batch back to it.
        marks, ends = self.bounds(answered=True)  # no floors: every partition listed
        marks = {p: (low, ends[p]) for p, (low, _high) in marks.items()}
        if self.starting is not None:
            chosen: dict[int, int | None] = dict(self.starting)
        elif self.group:
            chosen = committed_offsets(self.config, self.topic, self.group, list(marks))
        else:
            chosen = {}
        return to_spark(starting_offsets(marks, chosen))

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadAllAvailable() if self.max_records is None else ReadMaxRows(self.max_records)

    def latestOffset(self, start: SparkOffset, limit: ReadLimit) -> SparkOffset:
        """The end of the next micro-batch; `start` itself (nothing to read: Spark asks again at the next
        trigger) while the log cannot be read, for at most PLAN_OUTAGE_LIMIT seconds (`unreadable`)."""
        from confluent_kafka import KafkaException

        began = self.clock()
        try:
            end = self._plan(start, limit)
        except (KafkaException, LogUnknown, LogUnreadable) as exc:
            self.unreadable(exc, began, "planning nothing")
            return start
        self.readable()
        return end

    def unreadable(self, exc: Exception, began: float, meanwhile: str) -> None:
        """The planner could not read the log in a call that began at `began`: say so, and raise `exc` once
        that has lasted PLAN_OUTAGE_LIMIT since the first such call began.

        Spark stops a query whose planner raises, and the pipeline exits with it: without this, a broker
        frozen for 15 s (the chaos soak's fault) restarts the whole pipeline whenever it catches an idle
        query's plan or a query's start, each of which waits METADATA_TIMEOUT for an answer."""
        now = self.clock()
        if self._unreadable_since is None:
            self._unreadable_since = began
        if now - self._unreadable_since >= PLAN_OUTAGE_LIMIT:
            raise exc
        log.warning(
            "the source's planner at %s UTC: cannot read the log of %s for %.1f s (%s); %s, it stops the "
            "query after %.0f s",
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            self.topic,
            now - self._unreadable_since,
            exc,
            meanwhile,
            PLAN_OUTAGE_LIMIT,
        )

    def readable(self) -> None:
        """The planner read the log: an outage, if there was one, is over."""
        if self._unreadable_since is not None:
            log.warning(
                "the source's planner at %s UTC: reads the log of %s again after %.1f s",
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                self.topic,
                self.clock() - self._unreadable_since,
            )
            self._unreadable_since = None

    def _plan(self, start: SparkOffset, limit: ReadLimit) -> SparkOffset:
        begin = from_spark(start)
        marks, ends = self.bounds(begin)
        for p, (low, _high) in marks.items():
            begin.setdefault(p, low)  # a partition added since the last batch starts at its log start
        self.check_log(now=any(ends.get(p, -1) < o for p, o in begin.items()))
        # The same log, ending below where the query stands: new records would fill the offsets between
        # and be planned past, with the groups already committed over them.
        cut = cut_below(begin, marks, ends)
        # A new leader can report a lower high watermark for a while after a clean election, while its
        # log holds every record below where the query stands: only a fetch there refused as out of range
        # says the log was cut. Until then the partition gets nothing planned.
        for p in sorted(cut):
            if self.confirm_cut(self.config, self.topic, p, begin[p]):
                raise LogChanged(
                    log_truncated(self.log_services, self.log_store, self.topic, p, cut[p], begin[p])
                )
        max_records = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return to_spark(plan_end(begin, ends, max_records))

    def partitions(self, start: SparkOffset, end: SparkOffset) -> list[KafkaTask]:
        ranges = planned_ranges(from_spark(start), from_spark(end))
        return [KafkaTask(task) for task in pack_ranges(ranges, self.max_tasks, self.min_records_per_task)]

    def read(self, partition: KafkaTask) -> Iterator[Any]:  # type: ignore[override]
        yield from read_ranges(
            self.config,
            self.topic,
            partition.ranges,
            source_header=self.source_header,
            transactional=self.transactional,
            services=self.log_services,
        )

    def commit(self, end: SparkOffset) -> None:
        """Nothing: the service commits its group after its own durable write (see progress.py)."""

    def stop(self) -> None:
        """Nothing to release: every client lives for one call."""


class KafkaSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "aml-kafka"

    def schema(self) -> str:
        return SOURCE_SCHEMA if self.options.get("sourceHeader") else SCHEMA

    def streamReader(self, schema: StructType) -> KafkaStreamReader:
        return KafkaStreamReader(self.options)
