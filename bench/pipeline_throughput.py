"""Pipeline throughput: Services B and C (Spark, local[2]) against a plain Kafka consumer, on the same data.

One run on a private broker. N payments (valid JSON from `payment_json`, ~1 % invalid, key = payer) are
produced to a fresh 4-partition topic beforehand, then:

a. raw consume: one confluent-kafka Consumer assigned to every partition reads all N records and touches
   each key and value; best of 3 (after one unmeasured warm-up read, alternating with b). The baseline of
   every ratio is a consumer that never idles: `fetch.queue.backoff.ms` 10 ms. With librdkafka's default
   (1 s) a partition whose local queue passed `queued.min.messages` is not fetched again for a second
   (librdkafka issue 2879): most reads of 300,000 records then took 1.2 s instead of 0.2-0.4 s, and that
   idle second made the baseline of earlier runs of this benchmark 3-6 times too slow. The default
   consumer is still read alongside (a'.), for the record.
b. source read: the same client through the source's `read_range` (Arrow batches), one partition after the
   other as one Spark task slot would; best of 3.
c. pipeline: `start_pipeline` with both services on fresh stores (a database of their own on an embedded
   PostgreSQL server) and fresh groups. Throughput = N / time until both groups' committed offsets reach
   the log end: from before the SparkSession is created ("cold") and from after ("warm"). The steady-state
   rate leaves out each service's first batch (Python worker start-up, first-time planning) and runs from
   the end of that batch to the end of the last one.
d. latency: with the pipeline caught up, records are produced at a fixed rate R for D seconds; a thread
   polls both groups' committed offsets every 20 ms. A record's latency = the first poll that saw both
   groups past its offset minus the moment it was handed to the producer, so it includes the producer's
   linger (5 ms) and reads up to one poll interval (+ one OffsetFetch round trip) late.
e. where the time goes: Spark's own per-trigger durations (latestOffset = our planner, planning, addBatch =
   our handler, WAL and offset commits), the handler's phases per batch (`BatchReport.phases`: the Spark
   jobs that read, check and aggregate the batch, dead letters, the store transaction, the group commit),
   and, per service and phase, a least-squares fit of seconds = fixed + per-record x records over every
   batch of c. (large) and d. (small): the fixed cost of a micro-batch and the cost of each record.
f. warm JVM: the queries stop, N more payments are produced, and the queries start again on the same
   SparkSession (as a restarted job on a long-running cluster would); time from the restart until both
   groups committed them. Three times (`--warm-runs`): the JIT goes on compiling for minutes; the last run
   stands for f. c. includes the JVM compiling Spark's and the contract's code (its JIT compilers used
   more CPU than the work itself); f. far less.
   For c. and f., the CPU seconds of every process on the machine by kind (the JVM, its JIT compiler
   threads apart, PostgreSQL, the broker, Python: this process, which is also Spark's driver and polls
   the groups, and Spark's Python workers, which read Kafka), per record; the CPU-bound limit is the rate
   at which that CPU would fill every core. While c. and f. are timed the groups are polled every 100 ms
   (the end of a catch-up is seen up to that late), during d. every 20 ms. Run it on an otherwise idle
   machine.

    .venv/bin/python -m bench.pipeline_throughput [--payments 200000] [--rate 2000] [--duration 20]
        [--max-records-per-trigger 100000] [--trigger-interval 0.5] [--warm-runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aml_app.dependency_services import NAMES as SERVICES
from aml_app.dependency_services import service as dependency_service
from aml_app.harness.embedded_postgres import EmbeddedPostgres
from aml_app.harness.verify import percentile
from aml_app.kafka.broker import EmbeddedBroker, free_port, wait_until_answering
from aml_app.kafka.tools import payment_json
from aml_app.settings import DependencySettings, KafkaSettings, PipelineSettings, Settings
from bench.common import finish, machine, markdown_table

NAME = "pipeline_throughput"
PARTITIONS = 4
ACCOUNTS = 5000
MAX_PAYMENT_BYTES = 65536
POLL_INTERVAL = 0.02  # while latencies are measured (d.)
CATCH_UP_POLL_INTERVAL = 0.1  # while a catch-up is timed (c., f.): the poller runs in the measured driver
INVALID = (
    b"not json",
    b'{"payment_id": "x"}',
    b"[]",
    b"\xff\xfe",
)


# --- data -----------------------------------------------------------------------------------------


def payments(n: int, invalid_every: int, seed: int, tag: str) -> Iterator[tuple[bytes, bytes, bool]]:
    """(key, value, valid): key = payer; every `invalid_every`-th record breaks the contract."""
    rng = random.Random(seed)
    now = datetime.now(UTC)
    for i in range(n):
        payer, payee = rng.sample(range(ACCOUNTS), 2)
        key = f"acct-{payer}".encode()
        if invalid_every and i % invalid_every == invalid_every - 1:
            yield key, INVALID[i % len(INVALID)], False
            continue
        ts = (now - timedelta(seconds=rng.randrange(3600))).isoformat().replace("+00:00", "Z")
        amount = f"{rng.randrange(1, 2_000_000) / 100:.2f}"
        yield key, payment_json(f"{tag}-{i}", f"acct-{payer}", f"acct-{payee}", amount, ts), True


def pipeline_settings(
    bootstrap: str, topic: str, dlq: str, groups: list[str], store_url: str, pipeline: PipelineSettings
) -> Settings:
    """The pipeline's settings on a benchmark's own broker, topics, groups (B's, then C's) and store."""
    return Settings(
        kafka=KafkaSettings(
            bootstrap_servers=(bootstrap,),
            payments_topic=topic,
            dlq_topic=dlq,
            max_payment_bytes=MAX_PAYMENT_BYTES,
        ),
        dependencies=DependencySettings(
            endpoints={
                name: dataclasses.replace(dependency_service(name).default_endpoint(), group=group)
                for name, group in zip(SERVICES, groups, strict=True)
            },
            store_url=store_url,
        ),
        pipeline=pipeline,
    )


def create_topics(bootstrap: str, topics: list[str], partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(t, partitions, 1) for t in topics], operation_timeout=30)
    for future in futures.values():
        future.result(30)


def produce_all(
    bootstrap: str, topic: str, n: int, invalid_every: int, seed: int = 1, held: int = 0
) -> dict[str, Any]:
    """Produce the benchmark's payments to a topic holding `held` records; return the true log end per
    partition (from delivery reports)."""
    from confluent_kafka import Producer

    ends: dict[int, int] = defaultdict(int)
    errors: list[str] = []
    invalid = 0

    def delivered(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            ends[msg.partition()] = max(ends[msg.partition()], msg.offset() + 1)

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "batch.num.messages": 10000})
    started = time.monotonic()
    for key, value, valid in payments(n, invalid_every, seed=seed, tag=f"p{seed}"):
        invalid += not valid
        while True:
            try:
                producer.produce(topic, key=key, value=value, on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    remaining = producer.flush(60)
    if remaining or errors:
        raise RuntimeError(f"{remaining} payments undelivered, errors: {errors[:3]}")
    if sum(ends.values()) != held + n:
        raise RuntimeError(f"the log holds {sum(ends.values())} records, expected {held + n}")
    return {"ends": dict(ends), "invalid": invalid, "seconds": time.monotonic() - started}


# --- a, b: reading without Spark ------------------------------------------------------------------


#: What the baseline consumer sets beyond librdkafka's defaults: no idle second once a partition's local
#: queue is full (`fetch.queue.backoff.ms`, 1,000 ms by default; librdkafka issue 2879).
UNIDLE = {"fetch.queue.backoff.ms": 10}


def raw_consume(
    bootstrap: str, topic: str, ends: dict[int, int], extra: dict[str, Any] | None = None
) -> float:
    """Seconds for one plain consumer (librdkafka's defaults, then `extra`) to read every record, touching
    key and value."""
    from confluent_kafka import Consumer, TopicPartition

    started = time.monotonic()
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-raw-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            **(extra or {}),
        }
    )
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        total, touched, wanted = 0, 0, sum(ends.values())
        deadline = started + 120
        while total < wanted:
            if time.monotonic() > deadline:
                raise RuntimeError(f"raw consumer read {total} of {wanted} records in 120 s")
            for message in consumer.consume(num_messages=10_000, timeout=1.0):
                if message.error() is not None:
                    raise RuntimeError(f"raw consumer: {message.error()}")
                touched += len(message.key() or b"") + len(message.value() or b"")
                total += 1
        return time.monotonic() - started
    finally:
        consumer.close()


def source_read(
    bootstrap: str, topic: str, ends: dict[int, int], extra: dict[str, Any] | None = None
) -> tuple[float, dict[int, list[Any]]]:
    """Seconds for `read_range` (client options `extra` added) to read every partition in turn, each as one
    range, and the Arrow batches it made."""
    from aml_app.pipeline.kafka_source import read_range

    config = {"bootstrap.servers": bootstrap, **(extra or {})}
    started = time.monotonic()
    batches = {p: list(read_range(config, topic, p, 0, end)) for p, end in sorted(ends.items())}
    seconds = time.monotonic() - started
    rows = sum(b.num_rows for bs in batches.values() for b in bs)
    if rows != sum(ends.values()):
        raise RuntimeError(f"read_range gave {rows} records, expected {sum(ends.values())}")
    return seconds, batches


# --- CPU per process ------------------------------------------------------------------------------

PROCESS_KINDS = {
    "java": "Spark (JVM)",
    "postgres": "PostgreSQL",
    "tansu": "broker (Tansu)",
    "python": "Python",
}
#: The JVM's JIT compiler threads, counted apart from the rest of the JVM: their work is the price of a JVM
#: that has not yet compiled the code it runs, not of the records.
JIT = "JVM: JIT compilers"
JIT_THREADS = ("C1 CompilerThre", "C2 CompilerThre")


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by the processes of each kind (`PROCESS_KINDS`), from
    /proc: the JVM, PostgreSQL's processes, the broker, and Python (this process, which is also Spark's
    driver and polls the groups' offsets, and Spark's Python workers, which read Kafka). The JVM's JIT
    compiler threads are counted apart (`JIT`), not in the JVM's figure."""
    used: dict[str, float] = defaultdict(float)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        comm, seconds = _comm_and_cpu(stat)
        prefix = prefix_of(comm)
        if prefix is None:
            continue
        kind = PROCESS_KINDS[prefix]
        used[kind] += seconds
        if prefix == "java":
            threads = map(_comm_and_cpu, stat.parent.glob("task/*/stat"))
            compiling = sum(cpu for name, cpu in threads if name in JIT_THREADS)
            used[kind] -= compiling
            used[JIT] += compiling
    return dict(used)


def prefix_of(comm: str) -> str | None:
    return next((prefix for prefix in PROCESS_KINDS if comm.startswith(prefix)), None)


def _comm_and_cpu(stat: Path) -> tuple[str, float]:
    """The command name and CPU seconds (user + system) of a /proc stat file (a process or a thread);
    ("", 0) for one that ended meanwhile."""
    try:
        text = stat.read_text()
    except OSError:
        return "", 0.0
    comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
    return comm, (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def cpu_since(before: dict[str, float], records: int, seconds: float) -> dict[str, Any]:
    """CPU used per kind of process since `before`: seconds, µs per record, and in all."""
    return cpu_report(cpu_used(before, cpu_seconds()), records, seconds)


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per kind of process between two `cpu_seconds()` readings."""
    return {kind: after.get(kind, 0.0) - before.get(kind, 0.0) for kind in (*PROCESS_KINDS.values(), JIT)}


def cpu_report(used: dict[str, float], records: int, seconds: float) -> dict[str, Any]:
    """CPU seconds per kind of process over `seconds` of wall time: per record, in all, cores busy."""
    total = sum(used.values())
    return {
        "seconds": {k: round(v, 2) for k, v in used.items()},
        "us_per_record": {k: round(v / records * 1e6, 1) for k, v in used.items()},
        "total_s": round(total, 2),
        "total_us_per_record": round(total / records * 1e6, 1),
        "cores_busy": round(total / seconds, 2),
        "cpu_bound_records_per_s": round(records / (total / (os.cpu_count() or 1))),
    }


class CpuSampler:
    """`cpu_seconds()` twice a second in a thread, so that the CPU of any stretch of a run can be
    told afterwards (`between`)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            self.samples.append((time.monotonic(), cpu_seconds()))
            self.stopping.wait(self.interval)

    def __enter__(self) -> CpuSampler:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stopping.set()
        self.thread.join(10)
        self.samples.append((time.monotonic(), cpu_seconds()))

    def between(self, start: float, end: float, records: int) -> dict[str, Any]:
        """`cpu_since` from the last sample at or before `start` to the first at or after `end`."""
        before = max((s for s in self.samples if s[0] <= start), default=self.samples[0], key=lambda s: s[0])
        after = min((s for s in self.samples if s[0] >= end), default=self.samples[-1], key=lambda s: s[0])
        return cpu_report(cpu_used(before[1], after[1]), records, after[0] - before[0])


def first_trigger_with_data(pipeline: Any, timeout: float = 15) -> float:
    """When the first trigger that read records started (epoch seconds), over the pipeline's queries.

    A trigger's progress is published a moment after its handler committed the groups, so it may not be
    there yet when the groups are seen caught up: waits up to `timeout` for it."""
    deadline = time.monotonic() + timeout
    while True:
        starts = [
            datetime.fromisoformat(progress.timestamp.replace("Z", "+00:00")).timestamp()
            for query in pipeline.queries
            for progress in query.recentProgress
            if progress.numInputRows > 0
        ]
        if starts:
            return min(starts)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no trigger with records in the queries' progress after {timeout:.0f} s")
        time.sleep(0.05)


# --- e: fixed and per-record costs ---------------------------------------------------------------


def fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares seconds = fixed + per_record * records over (records, seconds) points."""
    n = len(points)
    if n < 2 or len({x for x, _ in points}) < 2:
        return {"points": n}
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return {
        "points": n,
        "fixed_ms": (mean_y - slope * mean_x) * 1000,
        "per_record_us": slope * 1e6,
    }


def costs(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase of the handler and for the whole handler: the fixed cost of a batch and each record's."""
    steps = sorted({k for r in reports for k in r["phases"]})
    out = {step: fit([(r["records"], r["phases"].get(step, 0.0)) for r in reports]) for step in steps}
    out["handler_total"] = fit([(r["records"], r["seconds"]) for r in reports])
    return out


# --- c, d: the pipeline ---------------------------------------------------------------------------


@dataclass
class Batches:
    """BatchReports as the handlers deliver them (from Spark's query threads), with arrival times."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    reports: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, report: Any) -> None:
        with self.lock:
            self.reports.append(
                {
                    "service": report.service,
                    "batch_id": report.batch_id,
                    "records": report.records,
                    "dead_lettered": report.dead_lettered,
                    "seconds": report.seconds,
                    # Per step: spark (read + parse + shape, one job), collect, dead_letters, store, commit.
                    "phases": dict(getattr(report, "phases", {}) or {}),
                    "at": time.monotonic(),
                }
            )

    def of(self, service: str, first_batch: int = 0, since: int = 0) -> list[dict[str, Any]]:
        """The service's batches with records, from batch id `first_batch` on, among the reports from the
        `since`-th on (a restarted query numbers its batches from 0 again)."""
        with self.lock:
            return [
                r
                for r in self.reports[since:]
                if r["service"] == service and r["records"] and r["batch_id"] >= first_batch
            ]

    def count(self) -> int:
        with self.lock:
            return len(self.reports)

    def next_batch(self, service: str) -> int:
        with self.lock:
            return 1 + max((r["batch_id"] for r in self.reports if r["service"] == service), default=-1)

    def wait_for(
        self, records: int, first_batch: dict[str, int], timeout: float = 30, since: int = 0
    ) -> None:
        """Until each service reported `records` (a handler reports after it committed the group)."""
        deadline = time.monotonic() + timeout
        for service in SERVICES:
            while sum(r["records"] for r in self.of(service, first_batch.get(service, 0), since)) < records:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{service} reported fewer than {records} records in its batches")
                time.sleep(0.01)


def phases(reports: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per step of the handler (`BatchReport.phases`) summed over batches, and its total."""
    out: dict[str, float] = defaultdict(float)
    for r in reports:
        for step, seconds in r["phases"].items():
            out[step] += seconds
        out["handler_total"] += r["seconds"]
    return {k: round(v, 3) for k, v in out.items()}


class CommitPoller:
    """Polls both groups' committed offsets in a thread; keeps (time, {p: min over groups})."""

    def __init__(self, bootstrap: str, topic: str, groups: list[str], interval: float) -> None:
        from aml_app.pipeline.progress import GroupProgress

        self.progress = [GroupProgress({"bootstrap.servers": bootstrap}, topic, g) for g in groups]
        self.interval = interval
        self.samples: list[tuple[float, dict[int, int]]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="commit-poller", daemon=True)

    def both(self) -> dict[int, int]:
        seen = [g.committed(range(PARTITIONS)) for g in self.progress]
        return {p: min(c.get(p, 0) for c in seen) for p in range(PARTITIONS)}

    def _run(self) -> None:
        while not self.stopping.is_set():
            asked = time.monotonic()
            offsets = self.both()
            self.samples.append((time.monotonic(), offsets))
            self.stopping.wait(max(0.0, self.interval - (time.monotonic() - asked)))

    def start(self) -> CommitPoller:
        self.thread.start()
        return self

    def latest(self) -> dict[int, int]:
        return self.samples[-1][1] if self.samples else {}

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        for g in self.progress:
            g.close()


def wait_committed(poller: CommitPoller, ends: dict[int, int], timeout: float, pipeline: Any) -> float:
    """Block until both groups committed `ends` on every partition; return the time it was seen. The
    queries are asked whether they still run twice a second only: each question is a call into the JVM,
    and this process is also the driver whose CPU is measured."""
    deadline = time.monotonic() + timeout
    asked = 0.0
    while True:
        now = poller.latest()
        if all(now.get(p, 0) >= end for p, end in ends.items()):
            return poller.samples[-1][0]
        if time.monotonic() - asked > 0.5:
            asked = time.monotonic()
            for query in pipeline.queries:
                if not query.isActive:
                    raise RuntimeError(f"query {query.name} stopped: {query.exception()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"groups at {now}, log end {ends}: not caught up in {timeout:.0f} s")
        time.sleep(0.01)


def spark_progress(pipeline: Any, since_batch: dict[str, int]) -> dict[str, Any]:
    """Spark's per-trigger durations (ms) summed over the triggers that read records (a query named
    "relations+aggregates" serves both services; `since_batch` is per service)."""
    out: dict[str, Any] = {}
    for query in pipeline.queries:
        sums: dict[str, float] = defaultdict(float)
        triggers = rows = 0
        since = min(since_batch.get(service, 0) for service in query.name.split("+"))
        for progress in query.recentProgress:
            if progress.numInputRows <= 0 or progress.batchId < since:
                continue
            triggers += 1
            rows += progress.numInputRows
            for key, value in progress.durationMs.items():
                sums[key] += value
        out[query.name] = {"triggers_with_data": triggers, "rows": rows, "duration_ms": dict(sums)}
    return out


def settled_progress(pipeline: Any, rows: int, since_batch: dict[str, int], timeout: float = 15) -> dict:
    """`spark_progress` once every query's triggers account for `rows` (a trigger's progress is only
    published after its offsets are committed, a moment after the handler returned)."""
    deadline = time.monotonic() + timeout
    while True:
        progress = spark_progress(pipeline, since_batch)
        if all(q["rows"] >= rows for q in progress.values()) or time.monotonic() > deadline:
            return progress
        time.sleep(0.05)


def whole(rate: float) -> float:
    """`rate` rounded for a table; NaN (too few batches to measure) stays NaN."""
    return rate if math.isnan(rate) else round(rate)


def steady_state(batches: Batches, service: str) -> dict[str, Any]:
    """Rates of one service's batches after its first one with records (both in and between handlers)."""
    reports = batches.of(service)
    if len(reports) < 2:
        return {"batches": len(reports), "note": "fewer than 2 batches: no steady state to measure"}
    rest = reports[1:]
    records = sum(r["records"] for r in rest)
    span = rest[-1]["at"] - reports[0]["at"]
    handler = sum(r["seconds"] for r in rest)
    return {
        "batches": len(reports),
        "first_batch": {"records": reports[0]["records"], "handler_s": reports[0]["seconds"]},
        "records_after_first": records,
        "wall_s_after_first": span,
        "records_per_s": records / span if span > 0 else float("nan"),
        "handler_s_after_first": handler,
        "handler_records_per_s": records / handler if handler > 0 else float("nan"),
        "handler_s_per_batch": [round(r["seconds"], 3) for r in reports],
        "records_per_batch": [r["records"] for r in reports],
    }


def produce_at_rate(
    bootstrap: str, topic: str, rate: float, duration: float, invalid_every: int
) -> list[tuple[int, int, float]]:
    """Produce `rate` records/s for `duration` s; return (partition, offset, monotonic send time)."""
    from confluent_kafka import Producer

    placed: list[tuple[int, int, float]] = []
    errors: list[str] = []

    def delivered_at(sent: float) -> Any:
        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(str(err))
            else:
                placed.append((msg.partition(), msg.offset(), sent))

        return delivered

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    records = payments(int(rate * duration), invalid_every, seed=2, tag="l")
    started = time.monotonic()
    sent = 0
    total = int(rate * duration)
    while sent < total:
        due = min(total, int((time.monotonic() - started) * rate) + 1)
        while sent < due:
            key, value, _valid = next(records)
            producer.produce(topic, key=key, value=value, on_delivery=delivered_at(time.monotonic()))
            sent += 1
        producer.poll(0)
        time.sleep(0.002)
    remaining = producer.flush(60)
    if remaining or errors:
        raise RuntimeError(f"{remaining} records undelivered, errors: {errors[:3]}")
    return placed


def latencies(
    placed: list[tuple[int, int, float]], samples: list[tuple[float, dict[int, int]]]
) -> list[float]:
    """Per record: first poll that saw both groups past its offset, minus its send time (seconds)."""
    by_partition: dict[int, tuple[list[float], list[int]]] = {}
    for p in range(PARTITIONS):
        times = [t for t, _ in samples]
        commits = [offsets.get(p, 0) for _, offsets in samples]
        by_partition[p] = (times, commits)
    out = []
    for p, offset, sent in placed:
        times, commits = by_partition[p]
        i = bisect_right(commits, offset)  # committed offsets only grow: first sample with commit > offset
        if i == len(times):
            raise RuntimeError(f"record {p}@{offset} was never seen committed")
        out.append(times[i] - sent)
    return out


# --- the run --------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> dict[str, Any]:
    from aml_app.pipeline.runner import spark_session, start_pipeline

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    invalid_every = round(1 / args.invalid_fraction) if args.invalid_fraction > 0 else 0
    doc: dict[str, Any] = {
        "benchmark": NAME,
        "machine": machine(),
        "params": {
            "payments": args.payments,
            "partitions": PARTITIONS,
            "invalid_every": invalid_every,
            "rate": args.rate,
            "duration_s": args.duration,
            "max_records_per_trigger": args.max_records_per_trigger,
            "trigger_interval_s": args.trigger_interval,
            "spark_master": args.master,
            "runs_without_spark": args.runs,
            "commit_poll_interval_s": POLL_INTERVAL,
            "catch_up_commit_poll_interval_s": CATCH_UP_POLL_INTERVAL,
        },
    }
    workdir = Path(tempfile.mkdtemp(prefix="aml-bench-pipeline-"))
    workdir.chmod(0o755)  # a root run hands the PostgreSQL folder inside it to an unprivileged user
    broker = EmbeddedBroker(free_port(), log_path=workdir / "broker.log").start()
    suffix = uuid.uuid4().hex[:8]
    topic, dlq = f"payments-{suffix}", f"dlq-{suffix}"
    ok = False
    try:
        asyncio.run(wait_until_answering([broker.bootstrap]))
        create_topics(broker.bootstrap, [topic, dlq], PARTITIONS)
        produced = produce_all(broker.bootstrap, topic, args.payments, invalid_every)
        ends, n = produced["ends"], args.payments
        print(f"produced {n} payments ({produced['invalid']} invalid) in {produced['seconds']:.1f} s: {ends}")
        doc["produced"] = produced

        # One unmeasured read first (the broker may still be settling after taking N records in), then
        # a. and b. alternate, so a slow moment of the machine does not hit only one of them.
        warm_up = raw_consume(broker.bootstrap, topic, ends, UNIDLE)
        raw, raw_defaults, reads = [], [], []
        batches: dict[int, list[Any]] = {}
        for _ in range(args.runs):
            raw.append(raw_consume(broker.bootstrap, topic, ends, UNIDLE))
            raw_defaults.append(raw_consume(broker.bootstrap, topic, ends))
            seconds, batches = source_read(broker.bootstrap, topic, ends)
            reads.append(seconds)
        doc["raw_consume"] = {
            "config": UNIDLE,
            "warm_up_s": warm_up,
            "runs_s": raw,
            "best_s": min(raw),
            "records_per_s": n / min(raw),
        }
        doc["raw_consume_defaults"] = {
            "runs_s": raw_defaults,
            "best_s": min(raw_defaults),
            "records_per_s": n / min(raw_defaults),
        }
        print(f"a. raw consume: {n / min(raw):,.0f} records/s (best of {args.runs}: {min(raw):.2f} s)")
        print(
            f"a'. librdkafka's defaults: {n / min(raw_defaults):,.0f} records/s (runs: "
            + ", ".join(f"{r:.2f}" for r in raw_defaults)
            + " s)"
        )
        doc["source_read"] = {
            "runs_s": reads,
            "best_s": min(reads),
            "records_per_s": n / min(reads),
            "us_per_record": min(reads) / n * 1e6,
        }
        print(f"b. read_range:  {n / min(reads):,.0f} records/s (best of {args.runs}: {min(reads):.2f} s)")

        del batches
        server = EmbeddedPostgres(workdir / "postgres", free_port()).start()
        groups = [f"relations-{suffix}", f"aggregates-{suffix}"]
        settings = pipeline_settings(
            broker.bootstrap,
            topic,
            dlq,
            groups,
            server.url(),
            PipelineSettings(
                spark_master=args.master,
                trigger_interval=args.trigger_interval,
                max_records_per_trigger=args.max_records_per_trigger,
            ),
        )
        poller = CommitPoller(broker.bootstrap, topic, groups, CATCH_UP_POLL_INTERVAL).start()
        reports = Batches()
        spark = pipeline = None
        try:
            t_cold = time.monotonic()
            spark = spark_session(args.master, app_name="bench-pipeline")
            t_warm = time.monotonic()
            cpu_before = cpu_seconds()
            pipeline = start_pipeline(spark, settings, on_batch=reports)
            t_done = wait_committed(poller, ends, args.timeout, pipeline)
            cpu_catch_up = cpu_since(cpu_before, n, t_done - t_warm)
            reports.wait_for(n, {})
            steady = {s: steady_state(reports, s) for s in SERVICES}
            dead = {s: sum(r["dead_lettered"] for r in reports.of(s)) for s in SERVICES}
            doc["pipeline"] = {
                "session_start_s": t_warm - t_cold,
                "cold_s": t_done - t_cold,
                "warm_s": t_done - t_warm,
                "records_per_s_cold": n / (t_done - t_cold),
                "records_per_s_warm": n / (t_done - t_warm),
                "steady_state": steady,
                "steady_records_per_s": min(s.get("records_per_s", float("nan")) for s in steady.values()),
                "dead_lettered": dead,
                "handler_phases_s": {s: phases(reports.of(s)) for s in SERVICES},
                "spark_progress": settled_progress(pipeline, n, {}),
                "cpu": cpu_catch_up,
            }
            if any(d != produced["invalid"] for d in dead.values()):
                raise RuntimeError(f"dead letters {dead}, expected {produced['invalid']} per service")
            p = doc["pipeline"]
            print(
                f"c. pipeline: {p['records_per_s_cold']:,.0f} records/s cold ({p['cold_s']:.1f} s, session "
                f"start {p['session_start_s']:.1f} s), {p['records_per_s_warm']:,.0f} warm, steady "
                f"{p['steady_records_per_s']:,.0f}"
            )

            # d. latency at a steady rate, on the same running pipeline.
            batch_ids = {s: reports.next_batch(s) for s in SERVICES}
            poller.interval = POLL_INTERVAL
            placed = produce_at_rate(broker.bootstrap, topic, args.rate, args.duration, invalid_every)
            late_ends = dict(ends)
            for part, offset, _sent in placed:
                late_ends[part] = max(late_ends[part], offset + 1)
            wait_committed(poller, late_ends, args.timeout, pipeline)
            poller.interval = CATCH_UP_POLL_INTERVAL
            reports.wait_for(len(placed), batch_ids)
            lat = latencies(placed, list(poller.samples))
            lat_ms = [x * 1000 for x in lat]
            doc["latency"] = {
                "records": len(placed),
                "rate": args.rate,
                "duration_s": args.duration,
                "p50_ms": percentile(lat_ms, 50),
                "p90_ms": percentile(lat_ms, 90),
                "p99_ms": percentile(lat_ms, 99),
                "max_ms": max(lat_ms),
                "min_ms": min(lat_ms),
                "resolution_ms": POLL_INTERVAL * 1000,
                "batches": {s: len(reports.of(s, batch_ids[s])) for s in SERVICES},
                "handler_s_per_batch": {
                    s: [round(r["seconds"], 3) for r in reports.of(s, batch_ids[s])] for s in SERVICES
                },
                "handler_phases_s": {s: phases(reports.of(s, batch_ids[s])) for s in SERVICES},
                "spark_progress": settled_progress(pipeline, len(placed), batch_ids),
            }
            doc["costs"] = {s: costs(reports.of(s)) for s in SERVICES}

            # f. the catch-up again with the JVM's code compiled: the queries stop, N more payments arrive,
            # the queries start again on the same SparkSession (as after a restart of the job on a
            # long-running cluster); several times, since the JIT goes on compiling for minutes. c.
            # includes the JIT's compiling, which took more CPU than the work.
            ends_now, runs = late_ends, []
            for run in range(args.warm_runs):
                pipeline.stop()
                pipeline = None
                more = produce_all(
                    broker.bootstrap, topic, n, invalid_every, seed=3 + run, held=sum(ends_now.values())
                )
                ends_now = {p: max(ends_now.get(p, 0), end) for p, end in more["ends"].items()}
                cpu_before, started, reported = cpu_seconds(), time.monotonic(), reports.count()
                started_wall = time.time()
                with CpuSampler() as sampler:
                    pipeline = start_pipeline(spark, settings, on_batch=reports)
                    t_again = wait_committed(poller, ends_now, args.timeout, pipeline)
                cpu = cpu_since(cpu_before, n, t_again - started)
                reports.wait_for(n, {}, since=reported)
                first = started + first_trigger_with_data(pipeline) - started_wall
                runs.append(
                    {
                        "records": n,
                        "seconds": t_again - started,
                        "records_per_s": n / (t_again - started),
                        "cpu": cpu,
                        # The restart (stores checked, groups read, Spark's planner process started, the
                        # first plan) apart from the work: from the first micro-batch's trigger on.
                        "query_start_s": first - started,
                        "records_per_s_from_first_batch": n / (t_again - first),
                        "cpu_from_first_batch": sampler.between(first, t_again, n),
                        "handler_phases_s": {s: phases(reports.of(s, since=reported)) for s in SERVICES},
                        # The restarted query numbers its batches from 0: all its triggers are this run's.
                        "spark_progress": settled_progress(pipeline, n, {}),
                    }
                )
                print(
                    f"f. pipeline on a warm JVM, run {run + 1}: {n / (t_again - started):,.0f} records/s "
                    f"({n / (t_again - first):,.0f} from its first micro-batch, "
                    f"{first - started:.1f} s after the restart)"
                )
            # The warmest run stands for f.; every run is kept.
            doc["warm_jvm"] = {**runs[-1], "runs": runs}
            latency = doc["latency"]
            print(
                f"d. latency at {args.rate:.0f}/s for {args.duration:.0f} s: p50 {latency['p50_ms']:.0f} ms, "
                f"p99 {latency['p99_ms']:.0f} ms"
            )
        finally:
            if pipeline is not None:
                pipeline.stop()
            if spark is not None:
                spark.stop()
            poller.stop()
            server.stop()
        raw_rate = doc["raw_consume"]["records_per_s"]
        doc["summary"] = {
            "raw_consume_per_s": raw_rate,
            "read_range_per_s": doc["source_read"]["records_per_s"],
            "pipeline_cold_per_s": doc["pipeline"]["records_per_s_cold"],
            "pipeline_warm_per_s": doc["pipeline"]["records_per_s_warm"],
            "pipeline_steady_per_s": doc["pipeline"]["steady_records_per_s"],
            "pipeline_warm_jvm_per_s": doc["warm_jvm"]["records_per_s"],
            "ratio_warm_jvm_to_raw": doc["warm_jvm"]["records_per_s"] / raw_rate,
            "pipeline_running_per_s": doc["warm_jvm"]["records_per_s_from_first_batch"],
            "ratio_running_to_raw": doc["warm_jvm"]["records_per_s_from_first_batch"] / raw_rate,
            "ratio_read_range_to_raw": doc["source_read"]["records_per_s"] / raw_rate,
            "ratio_cold_to_raw": doc["pipeline"]["records_per_s_cold"] / raw_rate,
            "ratio_warm_to_raw": doc["pipeline"]["records_per_s_warm"] / raw_rate,
            "ratio_steady_to_raw": doc["pipeline"]["steady_records_per_s"] / raw_rate,
            "goal": "pipeline (warm) / raw consume >= 0.10 at local[2]; latency p99 < 1.5 s at 2,000/s",
            "raw_consume_defaults_per_s": doc["raw_consume_defaults"]["records_per_s"],
            "goal_met": doc["warm_jvm"]["records_per_s"] / raw_rate >= 0.10,
            "latency_goal_met": doc["latency"]["p99_ms"] < 1500,
            "latency_p50_ms": doc["latency"]["p50_ms"],
            "latency_p99_ms": doc["latency"]["p99_ms"],
        }
        ok = True
    finally:
        broker.stop()
        if ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"broker log, stores and checkpoints kept in {workdir}", file=sys.stderr)
    return doc


def report(doc: dict[str, Any]) -> str:
    s, p = doc["summary"], doc["pipeline"]
    rates = markdown_table(
        ["measure", "records/s", "÷ raw consume"],
        [
            ("a. raw consume (confluent-kafka, best of 3)", round(s["raw_consume_per_s"]), 1.0),
            (
                "a'. the same, librdkafka's defaults (fetch.queue.backoff.ms at 1,000 ms)",
                round(s["raw_consume_defaults_per_s"]),
                s["raw_consume_defaults_per_s"] / s["raw_consume_per_s"],
            ),
            ("b. read_range → Arrow (best of 3)", round(s["read_range_per_s"]), s["ratio_read_range_to_raw"]),
            (
                "c. pipeline, incl. Spark session start",
                round(s["pipeline_cold_per_s"]),
                s["ratio_cold_to_raw"],
            ),
            ("c. pipeline, session already up", round(s["pipeline_warm_per_s"]), s["ratio_warm_to_raw"]),
            (
                "c. pipeline, steady (after 1st batch)",
                whole(s["pipeline_steady_per_s"]),
                s["ratio_steady_to_raw"],
            ),
            *(
                row
                for i, run in enumerate(doc["warm_jvm"]["runs"])
                for row in (
                    (
                        f"f. warm JVM, run {i + 1}: from the queries' restart",
                        round(run["records_per_s"]),
                        run["records_per_s"] / s["raw_consume_per_s"],
                    ),
                    (
                        f"f. warm JVM, run {i + 1}: from its first micro-batch "
                        f"({run['query_start_s']:.1f} s later)",
                        round(run["records_per_s_from_first_batch"]),
                        run["records_per_s_from_first_batch"] / s["raw_consume_per_s"],
                    ),
                )
            ),
        ],
    )
    cpu = {
        "c. catch-up": p["cpu"],
        **{
            f"f. warm JVM, run {i + 1}{part}": run[key]
            for i, run in enumerate(doc["warm_jvm"]["runs"])
            for part, key in (("", "cpu"), (", from its first micro-batch", "cpu_from_first_batch"))
        },
    }
    kinds = [*PROCESS_KINDS.values(), JIT]
    cpu_table = markdown_table(
        ["CPU µs per record", *kinds, "in all", "cores busy", "CPU-bound limit, records/s"],
        [
            (
                phase,
                *(c["us_per_record"].get(k, "") for k in kinds),
                c["total_us_per_record"],
                c["cores_busy"],
                c["cpu_bound_records_per_s"],
            )
            for phase, c in cpu.items()
        ],
    )
    services = markdown_table(
        ["service", "batches", "1st batch: records, handler s", "after it: records/s (wall)", "in handler"],
        [
            (
                name,
                st["batches"],
                f"{st['first_batch']['records']}, {st['first_batch']['handler_s']:.2f}"
                if "first_batch" in st
                else "",
                whole(st.get("records_per_s", float("nan"))),
                whole(st.get("handler_records_per_s", float("nan"))),
            )
            for name, st in p["steady_state"].items()
        ],
    )
    phases_of = {"catch-up": p, f"f. run {len(doc['warm_jvm']['runs'])}": doc["warm_jvm"]}
    spark = markdown_table(
        ["query", "triggers", "trigger s", "latestOffset s", "planning s", "addBatch s", "WAL+commit s"],
        [
            (
                f"{name} ({phase})",
                sp["triggers_with_data"],
                sp["duration_ms"].get("triggerExecution", 0) / 1000,
                sp["duration_ms"].get("latestOffset", 0) / 1000,
                sp["duration_ms"].get("queryPlanning", 0) / 1000,
                sp["duration_ms"].get("addBatch", 0) / 1000,
                (sp["duration_ms"].get("walCommit", 0) + sp["duration_ms"].get("commitOffsets", 0)) / 1000,
            )
            for phase, measured in phases_of.items()
            for name, sp in measured["spark_progress"].items()
        ],
    )
    columns = [(phase, service) for phase, m in phases_of.items() for service in m["handler_phases_s"]]
    names = sorted(
        {k for m in phases_of.values() for ph in m["handler_phases_s"].values() for k in ph},
        key=lambda k: (k == "handler_total", k),
    )
    handler = markdown_table(
        ["handler phase (s)", *(f"{service} ({phase})" for phase, service in columns)],
        [
            (k, *(phases_of[phase]["handler_phases_s"][service].get(k, 0.0) for phase, service in columns))
            for k in names
        ],
    )
    per_record = markdown_table(
        ["service", "phase", "batches", "fixed ms per batch", "µs per record"],
        [
            (
                service,
                step,
                f.get("points", 0),
                f.get("fixed_ms", float("nan")),
                f.get("per_record_us", float("nan")),
            )
            for service, steps in doc["costs"].items()
            for step, f in steps.items()
        ],
    )
    lat = doc["latency"]
    latency = markdown_table(
        ["rate/s", "records", "p50 ms", "p90 ms", "p99 ms", "max ms", "poll every ms"],
        [
            (
                lat["rate"],
                lat["records"],
                lat["p50_ms"],
                lat["p90_ms"],
                lat["p99_ms"],
                lat["max_ms"],
                lat["resolution_ms"],
            )
        ],
    )
    goal = "met" if s["goal_met"] else "NOT met"
    latency_goal = "met" if s["latency_goal_met"] else "NOT met"
    verdict = f"goal {s['goal']}: throughput {goal}, latency {latency_goal}"
    return "\n\n".join([rates, verdict, cpu_table, services, spark, handler, per_record, latency])


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payments", type=int, default=200_000, help="N, produced before the measurements")
    parser.add_argument("--rate", type=float, default=2000, help="records/s for the latency phase")
    parser.add_argument("--duration", type=float, default=20, help="seconds of the latency phase")
    parser.add_argument(
        "--max-records-per-trigger",
        type=int,
        default=Settings().pipeline.max_records_per_trigger,
        help="the pipeline's default (AML_MAX_RECORDS_PER_TRIGGER)",
    )
    parser.add_argument("--trigger-interval", type=float, default=0.5, help="seconds between micro-batches")
    parser.add_argument("--invalid-fraction", type=float, default=0.01)
    parser.add_argument("--runs", type=int, default=3, help="runs of a. and b. (the best counts)")
    parser.add_argument(
        "--warm-runs", type=int, default=3, help="runs of f., each with N more payments (the last counts)"
    )
    parser.add_argument("--master", default="local[2]")
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds the pipeline may take to catch up"
    )
    parser.add_argument("--keep", action="store_true", help="keep the broker log, stores and checkpoints")
    args = parser.parse_args()
    doc = main(args)
    finish(NAME, doc, report)


if __name__ == "__main__":
    cli()
