"""The two streaming queries: Service-B (relations) and Service-C (aggregates), one micro-batch at a time.

Each micro-batch follows the same four steps, in this order, on the driver:

1. Skip what the store already holds. The store keeps, per partition, the next offset it applied; rows
   below it are a replay (a restart after a crash between the store write and Spark's checkpoint commit)
   and are filtered out before anything is computed. So a replayed batch changes nothing.
2. Dead-letter the records that break the payment contract (original bytes, reason in headers).
3. Apply the batch to the store in one SQLite transaction together with the per-partition offsets it
   covers ("store offsets with the results").
4. Commit those offsets to the service's consumer group. Only now does the gate see the progress, so a
   committed offset is never ahead of what the API answers.

Spark does the parsing on the executors (Arrow in and out) and, for relations, aggregates each task's
payments into edge deltas there; the store adds the deltas up exactly. One Spark job per micro-batch:
each task returns its span of offsets, its rejected records and its rows in one Arrow schema
(`parse.BATCH_SCHEMA`), and one `toArrow()` brings them to the driver.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pyspark.sql import DataFrame

from aml_app.pipeline.parse import BATCH_SCHEMA, batch_task
from aml_app.pipeline.progress import DeadLetters, GroupProgress, Rejected
from aml_app.services.aggregates import PreparedPayment
from aml_app.services.relations import PreparedEdge

log = logging.getLogger("aml_app.pipeline")


class Store(Protocol):
    def applied_offsets(self) -> dict[int, int]: ...

    def apply_prepared(self, rows: Any, covered: Mapping[int, tuple[int, int]]) -> None: ...


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


def failpoint(name: str) -> None:
    """Die here, like a kill -9, when AML_FAILPOINT names this point.

    How the crash test reproduces the worst moment on purpose: the store holds a batch that neither the
    group nor Spark's checkpoint has recorded as done, so the restart must replay it and change nothing.
    """
    if os.environ.get("AML_FAILPOINT") == name:
        log.warning("failpoint %s: exiting now", name)
        os._exit(137)


def _column_rows(table: Any, kind: str, names: list[str]) -> list[Any]:
    """The rows of one kind as tuples."""
    import pyarrow.compute as pc

    part = table.filter(pc.equal(table["kind"], kind))
    return list(zip(*(part[name].to_pylist() for name in names), strict=True))


def relations_rows(table: Any) -> list[PreparedEdge]:
    """Edge deltas, pre-aggregated per task on the executors; the store adds them up exactly."""
    return _column_rows(table, "edge", ["payer", "payee", "currency", "n", "amount", "first_us", "last_us"])


def aggregates_rows(table: Any) -> list[PreparedPayment]:
    """One row per payment; the store keeps both sides and answers windows at any instant."""
    names = ["partition", "offset", "payment_id", "payer", "payee", "amount", "currency", "first_us"]
    return _column_rows(table, "payment", names)


SHAPE = {"relations": "edges", "aggregates": "payments"}


class ServiceBatches:
    """The `foreachBatch` function of one service: parse, dead-letter, apply with offsets, commit."""

    def __init__(
        self,
        service: str,
        store: Store,
        to_rows: Callable[[Any], list[Any]],
        progress: GroupProgress,
        dead_letters: DeadLetters,
        max_payment_bytes: int,
        on_batch: Callable[[BatchReport], None] | None = None,
    ) -> None:
        self.service, self.store, self.to_rows = service, store, to_rows
        self.progress, self.dead_letters = progress, dead_letters
        self.max_payment_bytes = max_payment_bytes
        self.on_batch = on_batch

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        started = time.monotonic()
        phases: dict[str, float] = {}

        def lap(name: str) -> None:
            phases[name] = time.monotonic() - started - sum(phases.values())

        applied = self.store.applied_offsets()
        task = batch_task(self.max_payment_bytes, SHAPE[self.service], applied)
        table = batch.mapInArrow(task, BATCH_SCHEMA).toArrow()
        lap("spark")
        spans: dict[int, tuple[int, int, int]] = {}
        for p, first, last, n in _column_rows(table, "span", ["partition", "offset", "last_offset", "n"]):
            seen = spans.get(p)
            spans[p] = (
                (first, last, n) if seen is None else (min(seen[0], first), max(seen[1], last), seen[2] + n)
            )
        # From the store's offset (records may have holes: transaction markers, compaction). A row below it
        # would make `start` disagree with the store, which then refuses the batch (StaleBatch).
        covered = {p: (min(first, applied.get(p, first)), last + 1) for p, (first, last, _n) in spans.items()}
        rejected = [
            Rejected(*row)
            for row in _column_rows(table, "reject", ["partition", "offset", "key", "value", "error"])
        ]
        rows = self.to_rows(table)
        lap("collect")
        self.dead_letters.send(rejected)
        lap("dead_letters")
        if covered:
            self.store.apply_prepared(rows, covered)
            failpoint("after-store-write")
        lap("store")
        # Commit what the store holds, including a replayed batch's offsets that a crash left uncommitted.
        committed = {**applied, **{p: end for p, (_start, end) in covered.items()}}
        self.progress.commit(committed)
        lap("commit")
        records = sum(n for _first, _last, n in spans.values())
        report = BatchReport(
            self.service,
            batch_id,
            records,
            len(rows),
            len(rejected),
            committed,
            time.monotonic() - started,
            phases,
        )
        if records:
            log.info(
                "%s batch %d: %d records, %d dead-lettered, %.2f s (%s), committed %s",
                self.service,
                batch_id,
                report.records,
                report.dead_lettered,
                report.seconds,
                " ".join(f"{k} {v:.2f}" for k, v in phases.items()),
                committed,
            )
        if self.on_batch is not None:
            self.on_batch(report)
