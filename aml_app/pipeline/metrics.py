"""Prometheus metrics of the pipeline (Services B and C on Spark), served by the driver process on
AML_PIPELINE_METRICS_PORT: what an operator needs to see of the two services the gate waits on. Each
micro-batch a service wrote and committed counts once, with its records, dead letters, its time in total
and per phase (Spark's work, dead letters, the store transaction, the group commit) and the offsets its
group then has committed. Every series has a `service` label (relations, aggregates)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import ThreadingWSGIServer

from aml_app.metrics_server import serve_metrics
from aml_app.pipeline.jobs import BatchReport


class PipelineMetrics:
    """One registry per pipeline process; `observe` is the services' `on_batch`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        by_service = ["service"]
        self.batches = Counter(
            "aml_pipeline_batches", "Micro-batches written and committed.", by_service, registry=self.registry
        )
        self.records = Counter(
            "aml_pipeline_records",
            "Records of the topic in the batches written.",
            by_service,
            registry=self.registry,
        )
        self.dead_lettered = Counter(
            "aml_pipeline_dead_lettered",
            "Records that broke the payment contract, sent to the dead-letter topic.",
            by_service,
            registry=self.registry,
        )
        self.batch_seconds = Histogram(
            "aml_pipeline_batch_seconds",
            "A micro-batch's time in the service's handler: Spark's work, dead letters, store, commit.",
            by_service,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        self.phase_seconds = Counter(
            "aml_pipeline_phase_seconds",
            "Seconds spent per phase of the handler: spark (shared by the services of one query, counted "
            "with the first), dead_letters, store (the transaction), commit (the group's offsets).",
            ["service", "phase"],
            registry=self.registry,
        )
        self.committed = Gauge(
            "aml_pipeline_committed_offset",
            "The service group's committed offset (next to read) after the last batch.",
            ["service", "partition"],
            registry=self.registry,
        )
        self.restarts = Counter(
            "aml_pipeline_restarts",
            "Times the queries were started again in the process because a Python process Spark "
            "started did not connect back in time (an overloaded host).",
            by_service,
            registry=self.registry,
        )
        self.last_batch = Gauge(
            "aml_pipeline_last_batch_timestamp_seconds",
            "When the service last committed a batch (Unix time).",
            by_service,
            registry=self.registry,
        )

    def observe(self, report: BatchReport) -> None:
        service = report.service
        self.batches.labels(service).inc()
        self.records.labels(service).inc(report.records)
        self.dead_lettered.labels(service).inc(report.dead_lettered)
        self.batch_seconds.labels(service).observe(report.seconds)
        for phase, seconds in report.phases.items():
            self.phase_seconds.labels(service, phase).inc(seconds)
        for partition, offset in report.committed.items():
            self.committed.labels(service, str(partition)).set(offset)
        self.last_batch.labels(service).set(time.time())

    def serve(self, host: str, port: int, token: str = "") -> ThreadingWSGIServer:
        """Serve `/metrics` and `/health` on host:port (`aml_app.metrics_server`)."""
        return serve_metrics(self.registry, "pipeline", host, port, token)
