"""The streaming query's batch handler: Service-B (relations) and Service-C (aggregates).

Both services usually share one query (`QueryBatches`): Kafka is read and the contract checked once per
micro-batch, and the validated batch, kept in memory, feeds each service in turn (Spark's "write to
multiple locations" idiom with `foreachBatch`). Each service keeps its own store, group and dead letters,
and skips the records its store already holds (after a crash between the two services' writes, or a
rebuild of one of them). Steps 2-4 run in a thread per service, side by side, and for a large batch while
Spark computes the next one (`QueryBatches`). For each service, in this order, on the driver:

1. Spark computes the services' outputs (`transforms.outputs_by_service`): the contract (applied by the
   query itself), aggregation, all in the JVM; they arrive as Arrow tables.
2. Dead-letter the records that break the payment contract (original bytes, the reason in headers). The
   reason is the worker's own (`aml_app.contract`), computed here for the rejected records only.
3. Apply the results to the store in ONE PostgreSQL transaction together with the per-partition offsets
   they cover ("store offsets with the results"). The store refuses a batch that does not start where it
   left off, so nothing is ever counted twice. While the database is unreachable, this step waits.
4. Commit those offsets to the service's consumer group. Only now does the gate see the progress, so a
   committed offset is never ahead of what the API answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any, TypeVar

import psycopg
from pyspark.sql import DataFrame

from aml_app import dependency_services as registry
from aml_app.contract import DEFAULT_MAX_CLOCK_SKEW, InvalidPayment, validate_payment
from aml_app.dependencies import aggregates
from aml_app.dependencies.store import Writer, read_meta, write_meta
from aml_app.failpoints import failpoint
from aml_app.pipeline.progress import DeadLetters, GroupProgress, Rejected
from aml_app.pipeline.repeats import seen_from_text, seen_to_text
from aml_app.pipeline.transforms import BatchOutputs, kept, outputs_by_service

log = logging.getLogger("aml_app.pipeline")
T = TypeVar("T")
#: The store's meta key of a derived topic's applied payments (`repeats`).
SEEN_KEY = "sources"

#: A record that Spark's contract check rejected although the Python contract accepts it: a bug (the two
#: are checked against each other by tests), dead-lettered with this reason rather than lost.
DISAGREEMENT = "rejected by the pipeline's Spark SQL contract check although the payment contract accepts it"


@dataclass
class BatchReport:
    service: str
    batch_id: int
    records: int
    applied: int
    dead_lettered: int
    committed: dict[int, int]
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step, for the benchmark


def rejected_records(
    outputs: BatchOutputs, max_bytes: int, max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW
) -> list[Rejected]:
    """The rejected records with the payment contract's reason for each."""
    rejected = []
    rows = outputs.rejects.to_pydict()
    sources = rows.get("source") or [None] * len(rows["offset"])
    for p, o, sent, key, value, source in zip(
        rows["partition"],
        rows["offset"],
        rows["timestamp_ms"],
        rows["key"],
        rows["value"],
        sources,
        strict=True,
    ):
        try:
            validate_payment(key, value, max_bytes, sent, max_clock_skew)
        except InvalidPayment as exc:
            reason = str(exc)
        else:
            log.error("partition %d offset %d: %s", p, o, DISAGREEMENT)
            reason = DISAGREEMENT
        rejected.append(Rejected(p, o, key, value, reason, sent, source))
    return rejected


def writer_for(
    service: str, keep: timedelta = aggregates.KEEP
) -> Callable[[psycopg.Connection, BatchOutputs], int]:
    """The store write of `service`: results of one batch into its tables; returns the rows applied.
    `keep`: how long C keeps flows past its longest window."""
    registered = registry.service(service)

    def write(conn: psycopg.Connection, outputs: BatchOutputs) -> int:
        return registered.write(conn, outputs.tables[registered.table], keep)

    return write


#: A batch's log line: `bench.capacity` reads the commits' instants and phases from it.
BATCH_LOG = "%s batch %d: %d records, %d dead-lettered, %.3f s (%s), committed %s"


class ServiceBatches:
    """One service's part of a micro-batch: compute, dead-letter, apply with offsets, commit."""

    def __init__(
        self,
        service: str,
        topic: str,
        store: Writer,
        progress: GroupProgress,
        dead_letters: DeadLetters,
        max_payment_bytes: int,
        threshold: Decimal,
        band: Decimal,
        on_batch: Callable[[BatchReport], None] | None = None,
        keep: timedelta = aggregates.KEEP,
        max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW,
    ) -> None:
        self.service, self.topic, self.store = service, topic, store
        self.progress, self.dead_letters = progress, dead_letters
        self.max_payment_bytes, self.max_clock_skew = max_payment_bytes, max_clock_skew
        self.threshold, self.band = threshold, band
        self.on_batch = on_batch
        self.write = writer_for(service, keep)
        #: The store's offsets: read once, then advanced by every apply (the store has one writer, us).
        self.applied = store.applied_offsets()
        #: Reading a derived topic: the payments applied per (derived partition, payments partition), in
        #: the store with the offsets (`repeats`); taken from each batch as it is handed over, before its
        #: write, since the next batch is computed while this one may still be written.
        self.seen = seen_from_text(store.patiently("reading the store", self._read_seen))

    def _read_seen(self, conn: psycopg.Connection) -> str | None:
        with conn.transaction():  # a read outside one would leave the connection in a transaction
            return read_meta(conn, self.store.schema).get(SEEN_KEY)

    def process(self, outputs: BatchOutputs, batch_id: int, spark_seconds: float = 0.0) -> BatchReport:
        """This service's steps for its outputs of a micro-batch (see the module docstring).

        `spark_seconds`: what computing the outputs took, reported as this service's `spark` phase.
        """
        started = time.monotonic() - spark_seconds
        phases: dict[str, float] = {"spark": spark_seconds}

        def lap(name: str) -> None:
            phases[name] = time.monotonic() - started - sum(phases.values())

        covered = outputs.covered(self.applied)
        rejected = rejected_records(outputs, self.max_payment_bytes, self.max_clock_skew)
        # What the group has already committed was dead-lettered when it was first processed (a rebuild).
        fresh = [r for r in rejected if r.offset >= self.progress.floor.get(r.partition, 0)]
        self.dead_letters.send(fresh)
        lap("dead_letters")
        applied = 0
        if covered:
            sources = outputs.sources

            def write(conn: psycopg.Connection) -> None:
                nonlocal applied
                applied = self.write(conn, outputs)
                if sources is not None:
                    write_meta(conn, self.store.schema, {SEEN_KEY: seen_to_text(sources)})

            self.store.apply(covered, write)
            self.applied.update({p: end for p, (_start, end) in covered.items()})
            # The crash test's worst moment: the store holds a batch that the group has not committed, so
            # the restart must publish it and change nothing.
            failpoint("after-store-write")
        lap("store")
        committed = self.progress.commit(self.applied)
        lap("commit")
        report = BatchReport(
            self.service,
            batch_id,
            outputs.records,
            applied,
            len(rejected),
            committed,
            time.monotonic() - started,
            phases,
        )
        if outputs.repeated:
            log.warning(
                "%s batch %d: skipped %d record(s) repeating payments applied before (the stage wrote "
                "them again)", self.service, batch_id, outputs.repeated,
            )  # fmt: skip
        if report.records:
            log.info(
                BATCH_LOG,
                self.service,
                batch_id,
                report.records,
                report.dead_lettered,
                report.seconds,
                " ".join(f"{k} {v:.3f}" for k, v in phases.items()),
                committed,
            )
        if self.on_batch is not None:
            self.on_batch(report)
        return report


#: A batch of at least this many records is being caught up on: its store writes go on while Spark
#: computes the next batch. A smaller one is written before the call returns (latency first).
OVERLAP_FROM_RECORDS = 10_000


class QueryBatches:
    """The `foreachBatch` function of a query that feeds one or more services: the batch (validated by the
    query) is kept in memory, the services' outputs computed from it together, and handed to the services,
    which write their stores side by side, each in a thread of its own (PostgreSQL runs each transaction
    in a process of its own, so the two take the time of the slower one, not the sum).

    Large batches (a catch-up, at least OVERLAP_FROM_RECORDS records) are written while Spark computes the
    next micro-batch, so Spark's work and the stores' (PostgreSQL and the driver's CSV rendering) fill
    both cores together: at most one batch is being written, and before handing over the next one the
    call waits for it (so batches reach each store in order) and raises its error, which fails the query.
    A small batch is written before the call returns: at 2,000 payments/s a batch holds about a thousand
    records, and overlapping them slowed Spark and PostgreSQL both and raised latency (BENCHMARKS.md).
    Nothing of the promise changes: a group is committed only after its store's transaction, and Spark's
    own checkpoint is not what says where a service resumes (the stores do). The writes of the last
    batch may end after Spark considers it done: `failure` and `drain` see to them.
    """

    def __init__(self, services: list[ServiceBatches]) -> None:
        if not services:
            raise ValueError("a query needs at least one service")
        self.services = services
        self.max_payment_bytes = services[0].max_payment_bytes
        self.max_clock_skew = services[0].max_clock_skew
        self.threshold, self.band = services[0].threshold, services[0].band
        self._writing: list[Future[BatchReport]] = []

    @property
    def start(self) -> dict[int, int]:
        """Where the query starts: per partition, the earliest offset a service still needs."""
        partitions = {p for service in self.services for p in service.applied}
        return {p: min(service.applied.get(p, 0) for service in self.services) for p in partitions}

    def __call__(self, checked: DataFrame, batch_id: int) -> None:
        """One micro-batch, already checked against the contract by the query (`validation.validated`)."""
        started = time.monotonic()
        with kept(checked) as batch:
            # The stores' offsets may not yet include a batch still being written: a lower bound is all
            # the skipping needs, since this batch's records all come after that one's.
            applied = {service.service: dict(service.applied) for service in self.services}
            # The copies of a derived topic are judged against every batch handed over before this one.
            seen = {service.service: dict(service.seen) for service in self.services}
            outputs = outputs_by_service(batch, applied, self.threshold, self.band, seen)
        for service in self.services:
            sources = outputs[service.service].sources
            if sources is not None:
                service.seen = sources
        self.hand_to_services(outputs, batch_id, time.monotonic() - started)

    def hand_to_services(
        self, outputs: dict[str, BatchOutputs], batch_id: int, spark_seconds: float
    ) -> list[BatchReport] | None:
        """Wait for the previous batch's writes (raising their error), then start this one's, every service
        side by side; a small batch's reports (or first error) once all are done, None for a large one,
        whose writes go on."""
        self.wait()
        self._writing = [
            # The Spark time is the query's, shared: reported once, with the first service.
            in_background(
                f"aml-{service.service}-batch-{batch_id}",
                service.process,
                outputs[service.service],
                batch_id,
                spark_seconds if service is self.services[0] else 0.0,
            )
            for service in self.services
        ]
        if max(output.records for output in outputs.values()) >= OVERLAP_FROM_RECORDS:
            return None
        return self.wait()

    def wait(self, timeout: float | None = None) -> list[BatchReport]:
        """The reports of the batch being written, once every service has written it; raises the first
        error (TimeoutError if `timeout` passes first)."""
        writing, self._writing = self._writing, []
        _done, not_done = futures.wait(writing, timeout)
        if not_done:
            self._writing = writing
            raise TimeoutError(f"{len(not_done)} store writes still running after {timeout} s")
        return [future.result() for future in writing]

    def failure(self) -> BaseException | None:
        """The error of a finished store write that no micro-batch has raised yet (the topic went idle)."""
        for future in self._writing:
            if future.done() and future.exception() is not None:
                return future.exception()
        return None

    def drain(self, timeout: float) -> None:
        """Let the last batch's writes finish (a stop): what is not written by then is redone at the next
        start, since neither its store nor its group moved."""
        try:
            self.wait(timeout)
        except TimeoutError:
            log.warning(
                "stopping: a store write was still running after %.0f s; the next start redoes it", timeout
            )
        except Exception as exc:
            log.warning("stopping: the last store write failed (%s); the next start redoes it", exc)


def in_background(name: str, function: Callable[..., T], *args: Any) -> Future[T]:
    """`function(*args)` in a daemon thread (a store write waiting for a database that is away must not
    keep the process from exiting), its outcome as a Future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as exc:  # handed to whoever waits for the future
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
