"""How the source's planner reads the log ends: three ways side by side, under a steady write and at rest.

The planner of the `aml-kafka` source needs each partition's end before every micro-batch. The embedded
broker's ListOffsets can stand behind the log (`fetched_high_watermarks`), so a fetch probe reads the
high watermark. Three ways of reading, each keeping where its own plans stand:

- `records from ListOffsets`: ListOffsets for every partition, a fetch started at its answer, and a
  partition's end taken when its first record (or end-of-partition event) comes out of the queue;
- `cache from ListOffsets`: the same, the end read from librdkafka's cache of the fetch responses' high
  watermarks;
- `the source's planner` (`KafkaStreamReader.bounds`): the cache, the fetch started where the previous
  reading ended, ListOffsets only for a partition it has no position on.

a. Under a steady write: a producer writes a 4-partition topic at each rate, and the three ways take
   turns. Per way: how long a reading took, how often a partition had no fetch answer in the probe's
   10 s (its ListOffsets answer is then taken), and how often an end stood below what the producer had
   been told was written before the reading began (0 is the only right answer).
b. At rest: a topic of `--records` records in batches of 4 (the embedded broker's costs grow with the
   batches a partition holds: BENCHMARKS.md, "The embedded broker over a long run"); per way, the
   broker's CPU and the wall time of a reading, over `--readings` readings; and the same for a reading
   task of a small micro-batch (`read_ranges`: six records of each of the four partitions, a fresh
   client, as the pipeline's one task reads a batch of 24 payments).

    .venv/bin/python -m bench.probe_answers [--rates 500,2000] [--seconds 60] [--records 40000]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from aml_app.kafka.broker import EmbeddedBroker, free_port, wait_until_answering
from aml_app.pipeline.kafka_source import (
    METADATA_TIMEOUT,
    KafkaStreamReader,
    fetched_high_watermarks,
    log_ends,
    probe_consumer,
    read_ranges,
    topic_watermarks,
)
from bench.common import cpu_seconds, finish, machine, markdown_table
from bench.pipeline_throughput import create_topics

NAME = "probe_answers"
PARTITIONS = 4
#: Seconds between two readings (the pipeline plans about twice a second; the three ways take turns).
PAUSE = 0.3

Ends = dict[int, int]
Marks = dict[int, tuple[int, int]]
#: (config, topic, where the previous reading ended) -> (ListOffsets' answers, ends, partitions unreached)
Reading = Callable[[dict[str, Any], str, Ends], tuple[Marks, Ends, int]]


def records_probe(consumer: Any, topic: str, starts: Mapping[int, int], timeout: float) -> Ends:
    """The baseline: a partition's end is the cached high watermark when its first record, or the end
    event, is taken from the consumer's queue."""
    from confluent_kafka import KafkaError, TopicPartition

    consumer.assign([TopicPartition(topic, p, o) for p, o in starts.items()])
    ends: Ends = {}
    deadline = time.monotonic() + timeout
    try:
        while len(ends) < len(starts) and time.monotonic() < deadline:
            for message in consumer.consume(num_messages=len(starts), timeout=0.1):
                p, error = message.partition(), message.error()
                if error is not None and error.code() == KafkaError._PARTITION_EOF:
                    ends[p] = message.offset()
                elif error is None:
                    high = consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)[1]
                    if high >= 0:
                        ends[p] = high
    finally:
        consumer.unassign()
    return ends


def listed_then(probe: Callable[[Any, str, Ends], Ends]) -> Reading:
    """A reading that lists every partition and starts `probe` at ListOffsets' answers."""

    def reading(config: dict[str, Any], topic: str, _start: Ends) -> tuple[Marks, Ends, int]:
        consumer = probe_consumer(config)
        try:
            marks = topic_watermarks(config, topic, consumer)
            fetched = probe(consumer, topic, {p: high for p, (_low, high) in marks.items()})
        finally:
            consumer.close()
        return marks, log_ends(marks, fetched), len(set(marks) - set(fetched))

    return reading


def planner(config: dict[str, Any], topic: str, start: Ends) -> tuple[Marks, Ends, int]:
    """The source's own reading from where the previous one ended; a partition it had to list although
    it stood on it is one the probe did not reach."""
    reader = KafkaStreamReader({**{f"kafka.{k}": v for k, v in config.items()}, "subscribe": topic})
    marks, ends = reader.bounds(start)
    return marks, ends, len(set(marks) & set(start))


READINGS: dict[str, Reading] = {
    "records from ListOffsets": listed_then(
        lambda c, t, starts: records_probe(c, t, starts, METADATA_TIMEOUT)
    ),
    "cache from ListOffsets": listed_then(fetched_high_watermarks),
    "the source's planner": planner,
}


class Writer(threading.Thread):
    """Produces `rate` records a second round-robin over the partitions (0: as fast as it can, in
    batches of 4, until `total`); `acked` is what the broker confirmed (next offset per partition)."""

    def __init__(self, bootstrap: str, topic: str, rate: int, total: int | None = None) -> None:
        super().__init__(daemon=True)
        from confluent_kafka import Producer

        self.topic, self.rate, self.total = topic, rate, total
        batching = {"linger.ms": 5} if rate else {"linger.ms": 0, "batch.num.messages": 4}
        self.producer = Producer({"bootstrap.servers": bootstrap, **batching})
        self.acked = dict.fromkeys(range(PARTITIONS), 0)
        self.lock = threading.Lock()
        self.halt = threading.Event()

    def delivered(self, error: Any, message: Any) -> None:
        if error is None:
            with self.lock:
                p = message.partition()
                self.acked[p] = max(self.acked[p], message.offset() + 1)

    def snapshot(self) -> Ends:
        with self.lock:
            return dict(self.acked)

    def run(self) -> None:
        began, sent = time.monotonic(), 0
        while not self.halt.is_set() and (self.total is None or sent < self.total):
            wait = began + sent / self.rate - time.monotonic() if self.rate else 0
            if wait > 0:
                time.sleep(min(wait, 0.01))
                continue
            try:
                self.producer.produce(
                    self.topic, b"x" * 300, partition=sent % PARTITIONS, on_delivery=self.delivered
                )
            except BufferError:  # the local queue is full: let deliveries drain it
                self.producer.poll(0.1)
                continue
            self.producer.poll(0)
            sent += 1
        self.producer.flush(60)


def at_rate(bootstrap: str, rate: int, seconds: float) -> dict[str, Any]:
    topic = f"probe-{uuid.uuid4().hex[:8]}"
    create_topics(bootstrap, [topic], PARTITIONS)
    config = {"bootstrap.servers": bootstrap}
    writer = Writer(bootstrap, topic, rate)
    writer.start()
    starts = {name: dict.fromkeys(range(PARTITIONS), 0) for name in READINGS}
    seen: dict[str, dict[str, list[Any]]] = {
        name: {"seconds": [], "unanswered": [], "short": []} for name in READINGS
    }
    behind: list[int] = []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for name, read in READINGS.items():
                before = writer.snapshot()
                began = time.monotonic()
                marks, ends, unanswered = read(config, topic, starts[name])
                seen[name]["seconds"].append(time.monotonic() - began)
                seen[name]["unanswered"].append(unanswered)
                seen[name]["short"].append(sum(ends[p] < before[p] for p in ends))
                behind.extend(before[p] - high for p, (_low, high) in marks.items())
                starts[name] = {p: max(starts[name][p], ends[p]) for p in ends}
                time.sleep(PAUSE)
    finally:
        writer.halt.set()
        writer.join(30)
    return {
        "written": writer.snapshot(),
        "list_offsets_behind_records": {"p50": statistics.median(behind), "max": max(behind)},
        "readings": {
            name: {
                "readings": len(s["seconds"]),
                "seconds_p50": round(statistics.median(s["seconds"]), 3),
                "seconds_max": round(max(s["seconds"]), 3),
                "readings_with_an_unanswered_partition": sum(n > 0 for n in s["unanswered"]),
                "ends_below_written": sum(s["short"]),
            }
            for name, s in seen.items()
        },
    }


def at_rest(bootstrap: str, broker_pid: int, records: int, readings: int) -> dict[str, Any]:
    topic = f"probe-rest-{uuid.uuid4().hex[:8]}"
    create_topics(bootstrap, [topic], PARTITIONS)
    config = {"bootstrap.servers": bootstrap}
    writer = Writer(bootstrap, topic, 0, records)
    writer.run()
    written = writer.snapshot()
    found: dict[str, Any] = {}
    for name, read in READINGS.items():
        read(config, topic, written)  # one unmeasured reading: connections, metadata

        def reading(_n: int, name: str = name, read: Reading = read) -> None:
            _marks, ends, _unanswered = read(config, topic, written)
            assert ends == written, f"{name} read {ends}, the log ends at {written}"

        found[name] = per_reading(broker_pid, readings, reading)
    found["a reading task of 4 x 6 records"] = reading_tasks(config, topic, broker_pid, written, readings)
    return {"written": written, "readings": found}


def per_reading(broker_pid: int, readings: int, reading: Callable[[int], None]) -> dict[str, Any]:
    """The broker's CPU and the wall time per call of `reading(n)`, n = 0 .. readings - 1."""
    cpu, began = cpu_seconds(broker_pid) or 0.0, time.monotonic()
    for n in range(readings):
        reading(n)
    return {
        "broker_cpu_ms": round(1000 * ((cpu_seconds(broker_pid) or 0.0) - cpu) / readings, 2),
        "wall_ms": round(1000 * (time.monotonic() - began) / readings, 1),
    }


def reading_tasks(
    config: dict[str, Any], topic: str, broker_pid: int, written: Ends, readings: int
) -> dict[str, Any]:
    """What a micro-batch's reading task costs when the batch is small: six records of each partition,
    well behind their ends, a fresh client per task as the source makes."""
    offsets = [written[0] // 2 + 6 * n for n in range(readings + 1)]
    list(read_ranges(config, topic, [(0, offsets[0], offsets[0] + 6)]))  # unmeasured: the first client

    def task(n: int) -> None:
        start = offsets[n + 1]
        ranges = [(p, start, start + 6) for p in range(PARTITIONS)]
        rows = sum(b.num_rows for b in read_ranges(config, topic, ranges))
        assert rows == 6 * PARTITIONS, f"a task read {rows} records of {6 * PARTITIONS}"

    return per_reading(broker_pid, readings, task)


def main(args: argparse.Namespace) -> dict[str, Any]:
    doc: dict[str, Any] = {"benchmark": NAME, "machine": machine(), "params": vars(args), "rates": {}}
    workdir = Path(tempfile.mkdtemp(prefix="aml-bench-probe-"))
    broker = EmbeddedBroker(free_port(), log_path=workdir / "broker.log").start()
    try:
        asyncio.run(wait_until_answering([broker.bootstrap]))
        assert broker.process is not None
        print(
            f"at rest: {args.records:,} records in batches of 4, {args.readings} readings a way ...",
            flush=True,
        )
        doc["at_rest"] = at_rest(broker.bootstrap, broker.process.pid, args.records, args.readings)
        for rate in args.rates:
            print(f"{rate} records/s for {args.seconds:g} s ...", flush=True)
            doc["rates"][str(rate)] = at_rate(broker.bootstrap, rate, args.seconds)
    finally:
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return doc


def report(doc: dict[str, Any]) -> str:
    rest = doc["at_rest"]
    resting = [(name, r["broker_cpu_ms"], r["wall_ms"]) for name, r in rest["readings"].items()]
    first = f"At rest, {doc['params']['records']:,} records in batches of 4, a reading:\n\n" + markdown_table(
        ["way", "broker CPU ms", "wall ms"], resting
    )
    rows = [
        (
            f"{int(rate):,}",
            name,
            r["readings"],
            r["seconds_p50"],
            r["seconds_max"],
            r["readings_with_an_unanswered_partition"],
            r["ends_below_written"],
        )
        for rate, at in doc["rates"].items()
        for name, r in at["readings"].items()
    ]
    second = markdown_table(
        [
            "records/s",
            "way",
            "readings",
            "s p50",
            "s max",
            "with a partition unanswered",
            "ends below written",
        ],
        rows,
    )
    behind = "; ".join(
        f"{int(rate):,}/s: p50 {at['list_offsets_behind_records']['p50']:g}, "
        f"max {at['list_offsets_behind_records']['max']:g}"
        for rate, at in doc["rates"].items()
    )
    tail = f"ListOffsets behind what was written, records: {behind}"
    return f"{first}\n\nUnder a steady write:\n\n{second}\n\n{tail}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=lambda s: [int(r) for r in s.split(",")], default=[500, 2000])
    parser.add_argument("--seconds", type=float, default=60.0, help="of each rate")
    parser.add_argument("--records", type=int, default=40_000, help="in the topic read at rest")
    parser.add_argument("--readings", type=int, default=20, help="of each way at rest")
    finish(NAME, main(parser.parse_args()), report)
