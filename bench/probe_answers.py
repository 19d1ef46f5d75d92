"""How the source's planner reads the log ends under a steady write, three ways side by side.

The planner of the `aml-kafka` source asks ListOffsets for each partition's end and then a fetch probe,
since the embedded broker's ListOffsets can stand behind the log (`fetched_high_watermarks`). On one
private broker a producer writes a 4-partition topic at a steady rate, and a planner loop reads the ends
again and again, turning through three probes, each keeping where its own plans stand:

- `records from ListOffsets`: the fetch starts at ListOffsets' answer and a partition's end is taken
  when its first record (or end-of-partition event) comes out of the consumer's queue;
- `cache from ListOffsets`: the same start, the end read from librdkafka's cache of the fetch
  responses' high watermarks;
- `cache from the plan's start` (what the source does): the cache, the fetch started no earlier than
  where the previous plan ended.

Per probe: how long a reading took, how often a partition had no fetch answer in the probe's timeout
(its ListOffsets answer is then taken), and how often an end stood below what the producer had been told
was written before the reading began (0 is the only right answer). Also how far ListOffsets stood behind.

    .venv/bin/python -m bench.probe_answers [--rates 500,2000] [--seconds 60]
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
    fetched_high_watermarks,
    log_ends,
    probe_consumer,
    probed_ends,
    topic_watermarks,
)
from bench.common import finish, machine, markdown_table
from bench.pipeline_throughput import create_topics

NAME = "probe_answers"
PARTITIONS = 4
#: Seconds between two readings (the pipeline plans about once a second under load; three probes turn).
PAUSE = 0.3

Ends = dict[int, int]
Marks = dict[int, tuple[int, int]]


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


Probe = Callable[[Any, str, Marks, Ends], Ends]

PROBES: dict[str, Probe] = {
    "records from ListOffsets": lambda c, t, marks, _start: records_probe(
        c, t, {p: high for p, (_low, high) in marks.items()}, METADATA_TIMEOUT
    ),
    "cache from ListOffsets": lambda c, t, marks, _start: fetched_high_watermarks(
        c, t, {p: high for p, (_low, high) in marks.items()}
    ),
    "cache from the plan's start": probed_ends,
}


class Writer(threading.Thread):
    """Produces `rate` records a second round-robin over the partitions; `acked` is what the broker
    confirmed (next offset per partition)."""

    def __init__(self, bootstrap: str, topic: str, rate: int) -> None:
        super().__init__(daemon=True)
        from confluent_kafka import Producer

        self.topic, self.rate = topic, rate
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
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
        while not self.halt.is_set():
            wait = began + sent / self.rate - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, 0.01))
                continue
            self.producer.produce(
                self.topic, b"x" * 300, partition=sent % PARTITIONS, on_delivery=self.delivered
            )
            self.producer.poll(0)
            sent += 1
        self.producer.flush(10)


def at_rate(bootstrap: str, rate: int, seconds: float) -> dict[str, Any]:
    topic = f"probe-{uuid.uuid4().hex[:8]}"
    create_topics(bootstrap, [topic], PARTITIONS)
    config = {"bootstrap.servers": bootstrap}
    writer = Writer(bootstrap, topic, rate)
    writer.start()
    starts = {name: dict.fromkeys(range(PARTITIONS), 0) for name in PROBES}
    seen: dict[str, dict[str, list[Any]]] = {
        name: {"seconds": [], "unanswered": [], "short": []} for name in PROBES
    }
    behind: list[int] = []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for name, probe in PROBES.items():
                before = writer.snapshot()
                began = time.monotonic()
                consumer = probe_consumer(config)
                try:
                    marks = topic_watermarks(config, topic, consumer)
                    fetched = probe(consumer, topic, marks, starts[name])
                finally:
                    consumer.close()
                ends = log_ends(marks, fetched)
                seen[name]["seconds"].append(time.monotonic() - began)
                seen[name]["unanswered"].append(len(set(marks) - set(fetched)))
                seen[name]["short"].append(sum(ends[p] < before[p] for p in ends))
                behind.extend(before[p] - high for p, (_low, high) in marks.items())
                starts[name] = {p: max(starts[name][p], ends[p]) for p in ends}
                time.sleep(PAUSE)
    finally:
        writer.halt.set()
        writer.join(30)
    return {
        "written": writer.snapshot(),
        "list_offsets_behind_records": {
            "p50": statistics.median(behind),
            "p99": statistics.quantiles(behind, n=100)[98] if len(behind) > 1 else behind[0],
            "max": max(behind),
        },
        "probes": {
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


def main(args: argparse.Namespace) -> dict[str, Any]:
    doc: dict[str, Any] = {"benchmark": NAME, "machine": machine(), "params": vars(args), "rates": {}}
    workdir = Path(tempfile.mkdtemp(prefix="aml-bench-probe-"))
    broker = EmbeddedBroker(free_port(), log_path=workdir / "broker.log").start()
    try:
        asyncio.run(wait_until_answering([broker.bootstrap]))
        for rate in args.rates:
            print(f"{rate} records/s for {args.seconds:g} s ...", flush=True)
            doc["rates"][str(rate)] = at_rate(broker.bootstrap, rate, args.seconds)
    finally:
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return doc


def report(doc: dict[str, Any]) -> str:
    rows = [
        (
            f"{int(rate):,}",
            name,
            probe["readings"],
            probe["seconds_p50"],
            probe["seconds_max"],
            probe["readings_with_an_unanswered_partition"],
            probe["ends_below_written"],
        )
        for rate, at in doc["rates"].items()
        for name, probe in at["probes"].items()
    ]
    behind = "; ".join(
        f"{int(rate):,}/s: p50 {at['list_offsets_behind_records']['p50']:g}, "
        f"max {at['list_offsets_behind_records']['max']:g}"
        for rate, at in doc["rates"].items()
    )
    table = markdown_table(
        [
            "records/s",
            "probe",
            "readings",
            "s p50",
            "s max",
            "with a partition unanswered",
            "ends below written",
        ],
        rows,
    )
    return f"{table}\n\nListOffsets behind what was written, records a partition: {behind}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=lambda s: [int(r) for r in s.split(",")], default=[500, 2000])
    parser.add_argument("--seconds", type=float, default=60.0)
    finish(NAME, main(parser.parse_args()), report)
