"""The pipeline alone at a quiet rate, warm: the floor under produced -> decided.

No gated worker can decide a payment before both dependency groups committed it, so the pipeline's own
produced -> both committed latency, with nothing else on the machine, is the floor of the capacity
benchmark's produced -> decided. This measures it at `--rate` (50/s, the demo's rate) on one embedded
broker, one PostgreSQL and one SparkSession at local[2] (the pipeline's), for each trigger interval of
`--triggers` in turn, `--rounds` times interleaved (the machine's speed drifts: an A/B must alternate),
after `--warm-seconds` at the rate that no figure reads (the JIT compiles Spark's code for minutes; a
deployment is past that). Between arms the queries restart on the same session and stores, as a
restarted pipeline does; each arm's first `--settle` seconds are left out.

Per arm: produced -> both committed p50/p90/p99 (the groups polled every 20 ms), the micro-batches'
start-to-start interval, Spark's own durations per trigger (`StreamingQueryProgress.durationMs`:
latestOffset, queryPlanning, walCommit, addBatch, commitOffsets), the batch handler's phases inside
addBatch (Spark's jobs, the store writes, the groups' commit) and the CPU of each kind of process.

    .venv/bin/python -m bench.pipeline_floor [--rate 50] [--triggers 0.5,0.35,0.2] [--rounds 2]
        [--arm-seconds 90] [--warm-seconds 180]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from aml_app.harness.embedded_postgres import EmbeddedPostgres
from aml_app.harness.verify import percentile
from aml_app.kafka.broker import EmbeddedBroker, free_port, wait_until_answering
from aml_app.settings import PipelineSettings, Settings
from bench.common import finish, machine, markdown_table
from bench.pipeline_throughput import (
    PARTITIONS,
    POLL_INTERVAL,
    SERVICES,
    Batches,
    CommitPoller,
    CpuSampler,
    create_topics,
    latencies,
    pipeline_settings,
    produce_at_rate,
)

NAME = "pipeline_floor"
DURATIONS = ("latestOffset", "queryPlanning", "walCommit", "addBatch", "commitOffsets", "triggerExecution")


class Progress:
    """Every trigger's `StreamingQueryProgress` that read records, collected once a second (a query keeps
    only its last 100)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._seen: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._queries: list[Any] = []
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()

    def follow(self, queries: list[Any]) -> None:
        self._queries = list(queries)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.collect()

    def collect(self) -> None:
        for query in self._queries:
            for p in query.recentProgress:
                key = (str(p.runId), p.batchId)
                if key in self._seen or p.numInputRows <= 0:
                    continue
                self._seen.add(key)
                started = datetime.fromisoformat(p.timestamp.replace("Z", "+00:00")).timestamp()
                self.rows.append({"start": started, "rows": p.numInputRows, **dict(p.durationMs)})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def mean(values: Iterable[float]) -> float:
    """The mean to 0.1, NaN for none (an arm too short to hold a whole trigger after its first seconds)."""
    listed = list(values)
    return round(statistics.mean(listed), 1) if listed else math.nan


def arm(
    spark: Any, settings: Settings, trigger: float, args: argparse.Namespace, poller: CommitPoller
) -> dict[str, Any]:
    """One trigger interval: the queries (re)started with it, `args.arm_seconds` of payments at the rate."""
    from aml_app.pipeline.runner import start_pipeline

    settings = dataclasses.replace(
        settings, pipeline=dataclasses.replace(settings.pipeline, trigger_interval=trigger)
    )
    reports, progress = Batches(), Progress()
    pipeline = start_pipeline(spark, settings, on_batch=reports)
    progress.follow(pipeline.queries)
    try:
        with CpuSampler() as cpu:
            started, settle = time.time() + args.settle, time.monotonic() + args.settle
            placed = produce_at_rate(
                settings.kafka.bootstrap_servers[0],
                settings.kafka.payments_topic,
                args.rate,
                args.arm_seconds,
                0,
            )
            ended = time.monotonic()
            reports.wait_for(len(placed), {}, timeout=60)
        progress.collect()
    finally:
        progress.stop()
        pipeline.stop()
    measured = [(p, o, sent) for p, o, sent in placed if sent >= settle]
    lat_ms = [1000 * x for x in latencies(measured, list(poller.samples))]
    triggers = [row for row in progress.rows if row["start"] >= started]
    starts = sorted(row["start"] for row in triggers)
    handled = [r for r in reports.of(SERVICES[0]) if r["at"] >= settle]
    return {
        "trigger_interval_s": trigger,
        "payments": len(measured),
        "commit_ms": {q: round(percentile(lat_ms, q), 1) for q in (50, 90, 99)},
        "triggers": len(triggers),
        "rows_per_trigger": mean(r["rows"] for r in triggers),
        "start_to_start_ms": mean(1000 * (b - a) for a, b in itertools.pairwise(starts)),
        "duration_ms_mean": {k: mean(r.get(k, 0) for r in triggers) for k in DURATIONS},
        "handler_ms_mean": {
            phase: mean(1000 * r["phases"].get(phase, 0.0) for r in handled)
            for phase in ("spark", "store", "commit")
        },
        "cpu": cpu.between(settle, ended, len(measured)),
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    from aml_app.pipeline.runner import spark_session

    os.environ["PYSPARK_PYTHON"] = sys.executable
    doc: dict[str, Any] = {"benchmark": NAME, "machine": machine(), "params": vars(args)}
    workdir = Path(tempfile.mkdtemp(prefix="aml-bench-floor-"))
    workdir.chmod(0o755)  # a root run hands the PostgreSQL folder inside it to an unprivileged user
    broker = EmbeddedBroker(free_port(), log_path=workdir / "broker.log").start()
    server = None
    try:
        asyncio.run(wait_until_answering([broker.bootstrap]))
        suffix = uuid.uuid4().hex[:8]
        topic, dlq = f"payments-{suffix}", f"dlq-{suffix}"
        create_topics(broker.bootstrap, [topic, dlq], PARTITIONS)
        server = EmbeddedPostgres(workdir / "postgres", free_port()).start()
        groups = [f"relations-{suffix}", f"aggregates-{suffix}"]
        settings = pipeline_settings(
            broker.bootstrap, topic, dlq, groups, server.url(), PipelineSettings(spark_master="local[2]")
        )
        poller = CommitPoller(broker.bootstrap, topic, groups, POLL_INTERVAL).start()
        spark = spark_session("local[2]", app_name="bench-pipeline-floor")
        try:
            warm = argparse.Namespace(**{**vars(args), "arm_seconds": args.warm_seconds})
            print(f"warming up: {args.warm_seconds:.0f} s at {args.rate:g}/s", flush=True)
            doc["warm_up"] = arm(spark, settings, args.triggers[0], warm, poller)
            doc["arms"] = []
            for round_ in range(args.rounds):
                for trigger in args.triggers:
                    result = arm(spark, settings, trigger, args, poller)
                    doc["arms"].append({"round": round_ + 1, **result})
                    c = result["commit_ms"]
                    print(
                        f"round {round_ + 1}, trigger {trigger:g} s: p50 {c[50]:.0f}, p99 {c[99]:.0f} ms",
                        flush=True,
                    )
        finally:
            poller.stop()
            spark.stop()
    finally:
        if server is not None:
            server.stop()
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return doc


def report(doc: dict[str, Any]) -> str:
    rows = [
        (
            a["round"],
            a["trigger_interval_s"],
            a["commit_ms"][50],
            a["commit_ms"][99],
            a["start_to_start_ms"],
            a["rows_per_trigger"],
            a["duration_ms_mean"]["triggerExecution"],
            a["duration_ms_mean"]["latestOffset"],
            a["duration_ms_mean"]["queryPlanning"],
            a["duration_ms_mean"]["walCommit"],
            a["duration_ms_mean"]["addBatch"],
            a["handler_ms_mean"]["spark"],
            a["handler_ms_mean"]["store"],
            a["cpu"]["cores_busy"],
        )
        for a in doc["arms"]
    ]
    headers = [
        "round",
        "trigger s",
        "committed p50 ms",
        "p99 ms",
        "batch every ms",
        "payments a batch",
        "trigger ms",
        "latestOffset",
        "planning",
        "WAL",
        "addBatch",
        "of it Spark's jobs",
        "store writes",
        "cores busy",
    ]
    return markdown_table(headers, rows)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=50, help="payments/s")
    parser.add_argument(
        "--triggers", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.35, 0.2]
    )
    parser.add_argument("--rounds", type=int, default=2, help="times each trigger interval runs, interleaved")
    parser.add_argument("--arm-seconds", type=float, default=90)
    parser.add_argument("--warm-seconds", type=float, default=180, help="at the rate first, not measured")
    parser.add_argument("--settle", type=float, default=10, help="seconds of each arm left out")
    finish(NAME, main(parser.parse_args()), report)


if __name__ == "__main__":
    cli()
