"""The Kafka source's reader without Spark, against the session's embedded broker.

The driver half (`initialOffset`, `latestOffset`, `partitions`) and the executor half (`read`, i.e.
`read_range`) are called directly, as Spark would call them. Records are produced with linger so that many
land in one record batch: Tansu answers ListOffsets(latest) with the last batch's base offset + 1, so a
source trusting it would stop short of a batch's tail (see `fetched_high_watermarks`).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from aml_app.kafka.broker import EmbeddedBroker
from aml_app.pipeline import kafka_source
from aml_app.pipeline.kafka_source import (
    LATEST_TIMESTAMP_MS,
    KafkaStreamReader,
    KafkaTask,
    SourceConfigError,
    read_range,
    topic_watermarks,
)
from aml_app.pipeline.progress import GroupProgress

pytestmark = pytest.mark.integration

ARROW_SCHEMA = pa.schema(
    [
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("key", pa.binary()),
        ("value", pa.binary()),
    ]
)
TIMEOUT = 30.0


@dataclass(frozen=True)
class Placed:
    partition: int
    offset: int
    key: bytes
    value: bytes


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def new_topic(bootstrap: str, partitions: int) -> str:
    topic = fresh("source")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)], operation_timeout=TIMEOUT).values():
        future.result(TIMEOUT)
    return topic


def produce(bootstrap: str, topic: str, counts: dict[int, int], tag: str = "") -> list[Placed]:
    """Send counts[p] records to each partition p in one go, with linger so they share record batches.

    Returns every record with the offset the broker gave it (from the delivery reports).
    """
    placed: list[Placed] = []
    errors: list[str] = []

    def delivered(err, msg) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            placed.append(Placed(msg.partition(), msg.offset(), msg.key(), msg.value()))

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 200,
            "batch.num.messages": 100_000,
            "batch.size": 8_000_000,
            "message.max.bytes": 8_000_000,
        }
    )
    for p, n in sorted(counts.items()):
        for i in range(n):
            producer.produce(
                topic,
                key=f"k{tag}-{p}-{i}".encode(),
                value=f"v{tag}-{p}-{i}".encode() * 3,
                partition=p,
                on_delivery=delivered,
            )
            producer.poll(0)
    remaining = producer.flush(TIMEOUT)
    assert remaining == 0 and not errors, f"{remaining} undelivered, errors {errors[:3]}"
    assert len(placed) == sum(counts.values())
    return sorted(placed, key=lambda r: (r.partition, r.offset))


def produce_batches(bootstrap: str, topic: str, partition: int, batches: int, size: int) -> list[Placed]:
    """`batches` separate record batches of `size` records each on one partition (a flush between)."""
    placed: list[Placed] = []
    for b in range(batches):
        placed += produce(bootstrap, topic, {partition: size}, tag=f"b{b}")
    return placed


def read_all(bootstrap: str, topic: str, partition: int, start: int, end: int, **kw) -> pa.Table:
    batches = list(read_range({"bootstrap.servers": bootstrap}, topic, partition, start, end, **kw))
    for batch in batches:
        assert batch.schema == ARROW_SCHEMA
    return pa.Table.from_batches(batches, ARROW_SCHEMA)


def as_placed(table: pa.Table) -> list[Placed]:
    columns = table.to_pydict()
    return [
        Placed(p, o, k, v)
        for p, o, k, v in zip(
            columns["partition"], columns["offset"], columns["key"], columns["value"], strict=True
        )
    ]


def options(bootstrap: str, topic: str, **extra: str) -> dict[str, str]:
    return {"kafka.bootstrap.servers": bootstrap, "subscribe": topic, **extra}


@contextlib.contextmanager
def stream_reader(opts: dict[str, str]) -> Iterator[KafkaStreamReader]:
    reader = KafkaStreamReader(opts)
    try:
        yield reader
    finally:
        reader.stop()


def read_planned(reader: KafkaStreamReader, start: dict, end: dict) -> list[Placed]:
    """What Spark does with a planned batch: each task reads its ranges."""
    out: list[Placed] = []
    for part in reader.partitions(start, end):
        assert isinstance(part, KafkaTask)
        for batch in reader.read(part):
            assert batch.schema == ARROW_SCHEMA
            out += as_placed(pa.Table.from_batches([batch]))
    return out


# --- read_range ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("start", "end"), [(0, 1000), (300, 700), (0, 1), (999, 1000), (517, 518)])
def test_read_range_inside_one_big_batch(broker: EmbeddedBroker, start: int, end: int) -> None:
    topic = new_topic(broker.bootstrap, 2)
    before = time.time()
    placed = produce(broker.bootstrap, topic, {1: 1000, 0: 5})
    after = time.time()
    on_one = [r for r in placed if r.partition == 1]
    assert [r.offset for r in on_one] == list(range(1000))

    table = read_all(broker.bootstrap, topic, 1, start, end)
    assert table.column("offset").to_pylist() == list(range(start, end))
    assert as_placed(table) == on_one[start:end]
    stamps = [t.timestamp() for t in table.column("timestamp").to_pylist()]
    assert all(before - 1 <= t <= after + 1 for t in stamps), (before, stamps[:3], after)


def test_a_record_timestamp_past_year_9999_reads_as_none_instead_of_failing_the_read(
    broker: EmbeddedBroker,
) -> None:
    """Kafka takes any 64-bit timestamp from a producer. One past year 9999 bounds no payment's `ts`, and
    one past about year 294,000 does not fit Spark's microseconds (Arrow raised OverflowError, which would
    fail every read of the record and stop the pipeline): both read as no timestamp, like Kafka's -1."""
    topic = new_topic(broker.bootstrap, 1)
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    stamps = [1, 1_714_564_800_000, LATEST_TIMESTAMP_MS, LATEST_TIMESTAMP_MS + 1, 2**62, 2**63 - 1]
    for n, stamp in enumerate(stamps):
        producer.produce(topic, key=b"k", value=f"v{n}".encode(), partition=0, timestamp=stamp)
    assert producer.flush(TIMEOUT) == 0
    table = read_all(broker.bootstrap, topic, 0, 0, len(stamps))
    micros = table.column("timestamp").cast(pa.int64()).to_pylist()
    assert micros == [1000, 1_714_564_800_000_000, LATEST_TIMESTAMP_MS * 1000, None, None, None]


class Hiding:
    """The source's real client, leaving out the offsets in `hidden` until it is assigned again, as a
    client handed a later record batch first does."""

    def __init__(self, real: Any, hidden: set[int]) -> None:
        self.real, self.hidden = real, hidden
        self.assigns: list[int] = []

    def assign(self, partitions: list[Any]) -> None:
        self.assigns.append(partitions[0].offset)
        self.real.assign(partitions)

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        messages = self.real.consume(num_messages=num_messages, timeout=timeout)
        if len(self.assigns) > 1:
            return messages
        return [m for m in messages if m.error() is not None or m.offset() not in self.hidden]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_records_the_client_skipped_are_read_again_from_the_broker(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fetched records after them are in librdkafka's queue when the task assigns the partition again:
    # what comes next must start at the skipped offset, not with those.
    topic = new_topic(broker.bootstrap, 1)
    placed = produce(broker.bootstrap, topic, {0: 6})
    made: list[Hiding] = []
    real = kafka_source._consumer

    def hiding(config: Any) -> Hiding:
        made.append(Hiding(real(config), {2, 3}))
        return made[-1]

    monkeypatch.setattr(kafka_source, "_consumer", hiding)
    assert as_placed(read_all(broker.bootstrap, topic, 0, 0, 6)) == placed
    assert made[0].assigns == [0, 2]


def test_read_range_across_batch_boundaries(broker: EmbeddedBroker) -> None:
    topic = new_topic(broker.bootstrap, 1)
    placed = produce_batches(broker.bootstrap, topic, 0, batches=5, size=100)
    assert [r.offset for r in placed] == list(range(500))
    for start, end in [(50, 350), (100, 200), (199, 201), (99, 100), (0, 500), (450, 500)]:
        table = read_all(broker.bootstrap, topic, 0, start, end)
        assert as_placed(table) == placed[start:end], (start, end)


def test_read_range_splits_into_arrow_batches_of_bounded_size(broker: EmbeddedBroker) -> None:
    topic = new_topic(broker.bootstrap, 1)
    placed = produce(broker.bootstrap, topic, {0: 1000})
    batches = list(read_range({"bootstrap.servers": broker.bootstrap}, topic, 0, 10, 990, rows=128))
    assert len(batches) > 1
    assert all(0 < b.num_rows < 2 * 128 for b in batches)
    assert as_placed(pa.Table.from_batches(batches)) == placed[10:990]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def librdkafka_log() -> tuple[logging.Logger, _Lines]:
    """A fresh logger for a client's `logger` setting and the handler that keeps its lines."""
    handler = _Lines()
    logger = logging.getLogger(fresh("rdkafka"))
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    return logger, handler


def queue_full_backoffs(
    bootstrap: str, topic: str, end: int, first_only: bool = False, **extra: object
) -> tuple[list[int], pa.Table]:
    """The backoffs (ms) librdkafka's fetch log shows for a full local queue while `read_range` reads
    offsets 0..end, and what it read (with `first_only`, up to the first backoff). The queue is full at
    one record, each fetch brings a few kB, and the reader takes one record per Arrow batch: each fetch
    response leaves records queued while the reader is busy, so the fetcher's next decision finds the
    queue full whatever the scheduling."""
    logger, handler = librdkafka_log()
    config = {
        "bootstrap.servers": bootstrap,
        "queued.min.messages": 1,
        "max.partition.fetch.bytes": 4096,
        "debug": "fetch",
        "logger": logger,
    }

    def backoffs() -> list[int]:
        found = (re.search(r"Fetch backoff for (\d+)ms: Local: Queue full", line) for line in handler.lines)
        return [int(m.group(1)) for m in found if m]

    batches = []
    for batch in read_range({**config, **extra}, topic, 0, 0, end, rows=1):
        batches.append(batch)
        if first_only and backoffs():
            break  # closes the reader
    return backoffs(), pa.Table.from_batches(batches, ARROW_SCHEMA)


def test_read_range_never_idles_in_librdkafkas_fetch_queue_backoff(broker: EmbeddedBroker) -> None:
    # librdkafka stops fetching a partition whose local queue holds queued.min.messages, and by default
    # fetches it again only a second later: a task's range longer than that queue idled a second per queue
    # (BENCHMARKS.md). Here the queue is full at one record; the fetch log shows every backoff, with no
    # timing in the test.
    topic = new_topic(broker.bootstrap, 1)
    placed = produce(broker.bootstrap, topic, {0: 2000})
    ours, table = queue_full_backoffs(broker.bootstrap, topic, 2000)
    assert as_placed(table) == placed
    assert ours, "the queue never filled: the test no longer provokes the backoff"
    assert max(ours) <= 10, f"backoffs of {sorted(set(ours))} ms"
    # Negative control: librdkafka's default, given explicitly (a kafka.* option wins over ours), read
    # until its first backoff (each one idles the reader a second).
    default, table = queue_full_backoffs(
        broker.bootstrap, topic, 2000, first_only=True, **{"fetch.queue.backoff.ms": 1000}
    )
    assert as_placed(table) == placed[: table.num_rows]
    assert default and max(default) >= 1000, default


# --- initialOffset ------------------------------------------------------------------------------


def test_initial_offset_is_the_groups_commit_else_the_log_start(broker: EmbeddedBroker) -> None:
    topic = new_topic(broker.bootstrap, 4)
    produce(broker.bootstrap, topic, {0: 1000, 1: 1000, 2: 1000, 3: 20})
    group = fresh("relations")
    progress = GroupProgress({"bootstrap.servers": broker.bootstrap}, topic, group)
    try:
        # Partition 0 mid-batch (a ListOffsets-clamped start would pull it back to the batch's base),
        # 1 at its end, 2 never committed, 3 beyond its end (clamped to it).
        progress.commit({0: 500, 1: 1000, 3: 5000})
        assert progress.committed(range(4)) == {0: 500, 1: 1000, 3: 5000}
    finally:
        progress.close()

    with stream_reader(options(broker.bootstrap, topic, groupId=group)) as reader:
        assert reader.initialOffset() == {"0": 500, "1": 1000, "2": 0, "3": 20}
    with stream_reader(options(broker.bootstrap, topic, groupId=fresh("nobody"))) as reader:
        assert reader.initialOffset() == {"0": 0, "1": 0, "2": 0, "3": 0}
    with stream_reader(options(broker.bootstrap, topic)) as reader:
        assert reader.initialOffset() == {"0": 0, "1": 0, "2": 0, "3": 0}


# --- latestOffset -------------------------------------------------------------------------------


def test_latest_offset_reaches_the_true_end_of_big_batches(broker: EmbeddedBroker) -> None:
    topic = new_topic(broker.bootstrap, 3)
    produce(broker.bootstrap, topic, {0: 1000, 1: 1})
    marks = topic_watermarks({"bootstrap.servers": broker.bootstrap}, topic)
    print(f"ListOffsets says {marks} after 1000 + 1 + 0 records")  # on Tansu: {0: (0, 1), ...}

    with stream_reader(options(broker.bootstrap, topic)) as reader:
        start = reader.initialOffset()
        assert start == {"0": 0, "1": 0, "2": 0}
        assert reader.latestOffset(start, ReadAllAvailable()) == {"0": 1000, "1": 1, "2": 0}
        # From inside the batch, and from its end.
        assert reader.latestOffset({"0": 400, "1": 1, "2": 0}, ReadAllAvailable()) == {
            "0": 1000,
            "1": 1,
            "2": 0,
        }
        assert reader.latestOffset({"0": 1000, "1": 1, "2": 0}, ReadAllAvailable()) == {
            "0": 1000,
            "1": 1,
            "2": 0,
        }
        # A second big batch moves the end again (the probe consumer is reused).
        produce(broker.bootstrap, topic, {0: 700, 2: 300}, tag="again")
        assert reader.latestOffset({"0": 1000, "1": 1, "2": 0}, ReadAllAvailable()) == {
            "0": 1700,
            "1": 1,
            "2": 300,
        }


def test_the_planner_lists_only_the_partitions_it_does_not_stand_on(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where the query stands, the log reaches at least: the probe starts there, and ListOffsets (whose
    # cost grows with the partition on the embedded broker, and which says 1 for a 1000-record batch)
    # is asked only about a partition the query has no position on.
    topic = new_topic(broker.bootstrap, 2)
    produce(broker.bootstrap, topic, {0: 1000, 1: 10})
    real_fetch, real_list = kafka_source.fetched_high_watermarks, kafka_source.topic_watermarks
    started: list[dict[int, int]] = []
    listed: list[list[int] | None] = []

    def recorded_fetch(consumer: object, topic: str, starts: dict[int, int]) -> dict[int, int]:
        started.append(dict(starts))
        return real_fetch(consumer, topic, starts)

    def recorded_list(*args: Any) -> dict[int, tuple[int, int]]:
        listed.append(list(args[3]) if len(args) > 3 else None)  # (config, topic, client, partitions)
        return real_list(*args)

    monkeypatch.setattr(kafka_source, "fetched_high_watermarks", recorded_fetch)
    monkeypatch.setattr(kafka_source, "topic_watermarks", recorded_list)
    with stream_reader(options(broker.bootstrap, topic)) as reader:
        assert reader.latestOffset({"0": 600, "1": 10}, ReadAllAvailable()) == {"0": 1000, "1": 10}
        assert (started, listed) == ([{0: 600, 1: 10}], [])
        started.clear()
        assert reader.latestOffset({"0": 600}, ReadAllAvailable()) == {"0": 1000, "1": 10}
        assert listed == [[1]]
        assert started[0][0] == 600


def test_latest_offset_stays_fast_with_a_probe_per_plan(broker: EmbeddedBroker) -> None:
    # Each plan probes the partitions it will read with a consumer of its own (one kept across plans
    # can crash librdkafka when the topic is created again). Without a short fetch.queue.backoff.ms,
    # librdkafka held a probe's fetches back for 1 s.
    topic = new_topic(broker.bootstrap, 4)
    produce(broker.bootstrap, topic, {p: 2000 for p in range(4)})
    with stream_reader(options(broker.bootstrap, topic)) as reader:
        start = reader.initialOffset()
        took = []
        for _ in range(5):
            began = time.monotonic()
            end = reader.latestOffset(start, ReadMaxRows(1000))
            took.append(time.monotonic() - began)
            assert sum(end[p] - start[p] for p in end) == 1000
            start = end
        assert sorted(took)[2] < 0.5, f"latestOffset took {[round(t, 3) for t in took]} s"


def connection_holds(bootstrap: str, topic: str, **extra: object) -> list[int]:
    """The hold-backs (ms) of a cluster connection librdkafka's broker log shows while a fresh planner's
    probe reads the topic's partitions and a fresh reading task reads a record of each of two partitions.
    A fresh client's first requests nearly always come before its bootstrap connection is up, and each
    then waits for the next connection attempt; the log shows the wait, with no timing in the test."""
    logger, handler = librdkafka_log()
    config = {"bootstrap.servers": bootstrap, "debug": "broker", "logger": logger, **extra}
    probe = kafka_source.probe_consumer(config)
    try:
        assert kafka_source.topic_partitions(probe, topic) == [0, 1]
    finally:
        probe.close()
    read = list(kafka_source.read_ranges(config, topic, [(0, 0, 1), (1, 0, 1)]))
    assert sum(batch.num_rows for batch in read) == 2
    found = (re.search(r"still suppressed for (\d+)ms", line) for line in handler.lines)
    return [int(m.group(1)) for m in found if m]


def test_a_fresh_client_of_the_source_is_not_held_back_a_tenth_of_a_second(broker: EmbeddedBroker) -> None:
    # The planner and every reading task make a client of their own. librdkafka holds a fresh client's
    # first connection back for half of reconnect.backoff.ms, 50 ms by default: a plan's reading of the
    # log ends took 57 ms at rest where 21 do (`bench.probe_answers`). The source sets 10 ms.
    topic = new_topic(broker.bootstrap, 2)
    produce(broker.bootstrap, topic, {0: 1, 1: 1})
    ours = connection_holds(broker.bootstrap, topic)
    assert max(ours, default=0) <= 10, f"connections held back {sorted(set(ours))} ms"
    # Negative control: librdkafka's default, given explicitly (a kafka.* option wins over ours).
    default = connection_holds(broker.bootstrap, topic, **{"reconnect.backoff.ms": 100})
    assert default and max(default) > 10, default


def test_a_slow_plan_says_where_its_time_went(
    broker: EmbeddedBroker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under overload on the embedded broker the planner has stood still for minutes inside its reads
    # of the log ends; a plan slower than SLOW_PLAN names its parts and the partitions the fetch probe
    # did not reach (their ends then come from ListOffsets alone).
    topic = new_topic(broker.bootstrap, 3)
    produce(broker.bootstrap, topic, {0: 50, 1: 5, 2: 5})
    real_fetch = kafka_source.fetched_high_watermarks

    def partition_0_only(consumer: object, topic: str, starts: dict[int, int]) -> dict[int, int]:
        return {p: end for p, end in real_fetch(consumer, topic, starts).items() if p == 0}

    with stream_reader(options(broker.bootstrap, topic)) as reader:
        start = reader.initialOffset()  # a query's start waits for every partition's fetched end
        monkeypatch.setattr(kafka_source, "fetched_high_watermarks", partition_0_only)
        ticks = iter(range(0, 1000, 2))  # each reading of the planner's clock 2 s after the last
        reader.clock = lambda: float(next(ticks))  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="aml_app.pipeline.kafka_source"):
            end = reader.latestOffset(start, ReadAllAvailable())
    assert end["0"] == 50
    [line] = [r.getMessage() for r in caplog.records if "reading the log ends" in r.getMessage()]
    assert re.search(rf"of {topic} took 6\.0 s: .* ListOffsets of 0 2\.0 s, the fetch probe 2\.0 s", line), (
        line
    )
    assert "no fetch answer for [1, 2]: their ListOffsets taken, 2.0 s" in line


def test_latest_offset_respects_read_max_rows(broker: EmbeddedBroker) -> None:
    topic = new_topic(broker.bootstrap, 3)
    produce(broker.bootstrap, topic, {0: 1000, 1: 10})
    with stream_reader(options(broker.bootstrap, topic, maxRecordsPerTrigger="100")) as reader:
        assert reader.getDefaultReadLimit() == ReadMaxRows(100)
        start = reader.initialOffset()
        # Partition 1 takes its 10, partition 0 the remaining 90 of the budget.
        assert reader.latestOffset(start, ReadMaxRows(100)) == {"0": 90, "1": 10, "2": 0}
        small = reader.latestOffset(start, ReadMaxRows(3))
        assert small["2"] == 0 and small["0"] >= 1 and small["1"] >= 1 and small["0"] + small["1"] == 3
        # Batch after batch, never more than n, until the end.
        sizes = []
        while True:
            end = reader.latestOffset(start, ReadMaxRows(64))
            size = sum(end[p] - start[p] for p in end)
            if size == 0:
                break
            assert size <= 64
            sizes.append(size)
            start = end
            assert len(sizes) < 100, "the plan does not converge"
        assert start == {"0": 1000, "1": 10, "2": 0}
        assert sum(sizes) == 1010 and all(s == 64 for s in sizes[:-1])


def test_default_read_limit_without_max_records() -> None:
    with stream_reader(options("127.0.0.1:1", fresh("unused"))) as reader:
        assert reader.getDefaultReadLimit() == ReadAllAvailable()


# --- partitions + read --------------------------------------------------------------------------


def test_planned_batches_read_every_record_exactly_once(broker: EmbeddedBroker) -> None:
    topic = new_topic(broker.bootstrap, 4)
    placed = produce_batches(broker.bootstrap, topic, 0, batches=3, size=250)
    placed += produce(broker.bootstrap, topic, {1: 1000, 2: 3}, tag="big")
    group = fresh("aggregates")
    seen: list[Placed] = []
    with stream_reader(options(broker.bootstrap, topic, groupId=group, maxRecordsPerTrigger="137")) as reader:
        start = reader.initialOffset()
        for _batch in range(100):
            end = reader.latestOffset(start, reader.getDefaultReadLimit())
            if end == start:
                break
            assert reader.partitions(end, end) == []
            # The executors get a pickled copy of the reader.
            executor = pickle.loads(pickle.dumps(reader))
            got = read_planned(executor, start, end)
            assert len(got) == sum(end[p] - start.get(p, 0) for p in end) <= 137
            seen += got
            start = end
        else:
            pytest.fail("the plan never caught up with the log")
    keys = [(r.partition, r.offset) for r in seen]
    assert len(keys) == len(set(keys)), "a record was read twice"
    assert sorted(seen, key=lambda r: (r.partition, r.offset)) == placed
    assert start == {"0": 750, "1": 1000, "2": 3, "3": 0}


def test_partition_unknown_to_the_previous_plan_is_read_from_its_start(broker: EmbeddedBroker) -> None:
    # Tansu does not implement CreatePartitions (aiokafka: IncompatibleBrokerVersion, confluent-kafka:
    # _UNSUPPORTED_FEATURE), so a partition "added after the first plan" is played by a start offset that
    # does not know partitions 1 and 2, as when the previous batch was planned on a 1-partition topic.
    topic = new_topic(broker.bootstrap, 3)
    placed = produce(broker.bootstrap, topic, {0: 100, 1: 400, 2: 5})
    with stream_reader(options(broker.bootstrap, topic)) as reader:
        start = {"0": 100}
        end = reader.latestOffset(start, ReadAllAvailable())
        assert end == {"0": 100, "1": 400, "2": 5}
        # 405 records: one task (MIN_RECORDS_PER_TASK) reads both new partitions from their start.
        assert [task.ranges for task in reader.partitions(start, end)] == [((1, 0, 400), (2, 0, 5))]
        got = read_planned(reader, start, end)
        assert sorted(got, key=lambda r: (r.partition, r.offset)) == placed[100:]

        # Under a limit the new partitions get their share too.
        limited = reader.latestOffset({"0": 50}, ReadMaxRows(30))
        assert limited["2"] == 5 and limited["1"] >= 10 and limited["0"] >= 60
        assert limited["0"] - 50 + limited["1"] + limited["2"] == 30
        got = read_planned(reader, {"0": 50}, limited)
        assert sorted((r.partition, r.offset) for r in got) == [
            *((0, o) for o in range(50, limited["0"])),
            *((1, o) for o in range(limited["1"])),
            *((2, o) for o in range(5)),
        ]


def test_a_task_reads_several_partitions_with_one_client(broker: EmbeddedBroker) -> None:
    topic = new_topic(broker.bootstrap, 4)
    placed = produce(broker.bootstrap, topic, {0: 300, 1: 40, 2: 260, 3: 1})
    with stream_reader(options(broker.bootstrap, topic, maxTasks="2")) as reader:
        start = {"0": 0, "1": 0, "2": 0, "3": 0}
        end = reader.latestOffset(start, ReadAllAvailable())
        # 601 records: by default one task reads them all (MIN_RECORDS_PER_TASK).
        assert [task.ranges for task in reader.partitions(start, end)] == [
            ((0, 0, 300), (1, 0, 40), (2, 0, 260), (3, 0, 1))
        ]
    with stream_reader(options(broker.bootstrap, topic, maxTasks="2", minRecordsPerTask="300")) as reader:
        tasks = reader.partitions(start, end)
        # Longest first onto the least-loaded task: 300 | 260, 40 onto the 260, then 1 onto the first.
        assert [task.ranges for task in tasks] == [((0, 0, 300), (3, 0, 1)), ((1, 0, 40), (2, 0, 260))]
        batches = list(reader.read(tasks[1]))
        assert all(len(set(b.column("partition").to_pylist())) == 1 for b in batches), "a batch mixed"
        got = read_planned(reader, start, end)
    assert sorted(got, key=lambda r: (r.partition, r.offset)) == placed


# --- pickling -----------------------------------------------------------------------------------


def test_reader_pickles_after_latest_offset(broker: EmbeddedBroker) -> None:
    topic = new_topic(broker.bootstrap, 2)
    placed = produce(broker.bootstrap, topic, {0: 300, 1: 2})
    with stream_reader(options(broker.bootstrap, topic, groupId=fresh("g"))) as reader:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadAllAvailable())
        copy = pickle.loads(pickle.dumps(reader))  # no client is kept: nothing to leave out
        assert (copy.config, copy.topic, copy.group, copy.max_records) == (
            reader.config,
            reader.topic,
            reader.group,
            reader.max_records,
        )
        # The copy reads (executor side) and the original keeps planning with its probe.
        assert sorted(read_planned(copy, start, end), key=lambda r: (r.partition, r.offset)) == placed
        assert reader.latestOffset(end, ReadAllAvailable()) == end
        copy.stop()


# --- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"kafka.bootstrap.servers": "h:1", "subscribe": "t", "maxRecordsPerTrigger": "0"}, "at least 1"),
        ({"kafka.bootstrap.servers": "h:1", "subscribe": "t", "maxRecordsPerTrigger": "-5"}, "at least 1"),
        (
            {"kafka.bootstrap.servers": "h:1", "subscribe": "t", "maxRecordsPerTrigger": "lots"},
            "not a whole number",
        ),
        (
            {"kafka.bootstrap.servers": "h:1", "subscribe": "t", "maxTasks": "0"},
            "maxTasks=0 must be at least 1",
        ),
        (
            {"kafka.bootstrap.servers": "h:1", "subscribe": "t", "maxTasks": "2.5"},
            "maxTasks='2.5' is not a whole",
        ),
        (
            {"kafka.bootstrap.servers": "h:1", "subscribe": "t", "minRecordsPerTask": "0"},
            "minRecordsPerTask=0 must be at least 1",
        ),
        (
            {"kafka.bootstrap.servers": "h:1", "subscribe": "t", "minRecordsPerTask": "many"},
            "minRecordsPerTask='many' is not a whole",
        ),
        ({"kafka.bootstrap.servers": "h:1"}, "needs the option subscribe"),
        ({"kafka.bootstrap.servers": "h:1", "subscribe": ""}, "needs the option subscribe"),
        ({"subscribe": "t"}, "needs the option kafka.bootstrap.servers"),
        ({"kafka.bootstrap.servers": "", "subscribe": "t"}, "needs the option kafka.bootstrap.servers"),
    ],
)
def test_bad_options_are_refused_with_a_clear_message(opts: dict[str, str], message: str) -> None:
    with pytest.raises(SourceConfigError, match=message) as caught:
        KafkaStreamReader(opts)
    if "maxRecordsPerTrigger" in opts:
        assert "maxRecordsPerTrigger" in str(caught.value)


def test_a_fetch_within_the_log_is_never_taken_for_a_cut(broker: EmbeddedBroker) -> None:
    """The planner stops a query only when a fetch where it stands is refused as past the log's end: a
    fetch at any offset the log holds, or at its end, must not read as one."""
    topic = new_topic(broker.bootstrap, 1)
    produce(broker.bootstrap, topic, {0: 10})
    config = {"bootstrap.servers": broker.bootstrap}
    assert [kafka_source.past_the_end(config, topic, 0, o, timeout=10) for o in (0, 5, 10)] == [False] * 3
