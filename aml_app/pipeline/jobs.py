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

Spark does the parsing (on the executors, Arrow in and out) and, for relations, the per-batch aggregation
into edge deltas; the store adds the deltas up exactly.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Protocol

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from aml_app.pipeline.parse import PARSED_SCHEMA, payment_parser
from aml_app.pipeline.progress import DeadLetters, GroupProgress, Rejected
from aml_app.services.aggregates import PaymentRow
from aml_app.services.relations import EdgeDelta

log = logging.getLogger("aml_app.pipeline")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Store(Protocol):
    def applied_offsets(self) -> dict[int, int]: ...

    def apply(self, rows: Any, covered: Mapping[int, tuple[int, int]]) -> None: ...


@dataclass
class BatchReport:
    service: str
    batch_id: int
    records: int
    applied: int
    dead_lettered: int
    committed: dict[int, int]
    seconds: float


def failpoint(name: str) -> None:
    """Die here, like a kill -9, when AML_FAILPOINT names this point.

    How the crash test reproduces the worst moment on purpose: the store holds a batch that neither the
    group nor Spark's checkpoint has recorded as done, so the restart must replay it and change nothing.
    """
    if os.environ.get("AML_FAILPOINT") == name:
        log.warning("failpoint %s: exiting now", name)
        os._exit(137)


def micros_to_datetime(micros: int) -> datetime:
    return EPOCH + timedelta(microseconds=micros)


def unapplied(df: DataFrame, applied: Mapping[int, int]) -> DataFrame:
    """Rows at or past the store's next offset of their partition (all rows where it has none)."""
    if not applied:
        return df
    floor = F.create_map(*[F.lit(x) for p, o in sorted(applied.items()) for x in (p, o)])
    return df.where(F.col("offset") >= F.coalesce(F.element_at(floor, F.col("partition")), F.lit(0)))


def relations_rows(valid: DataFrame) -> list[EdgeDelta]:
    """Edge deltas of one batch: Spark groups the payments by (payer, payee, currency)."""
    rows = (
        valid.groupBy("payer", "payee", "currency")
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.sum("amount").alias("total"),
            F.min(F.unix_micros("ts")).alias("first"),
            F.max(F.unix_micros("ts")).alias("last"),
        )
        .collect()
    )
    return [
        EdgeDelta(
            payer=r.payer,
            payee=r.payee,
            currency=r.currency,
            count=r.n,
            total=Decimal(r.total),
            first_seen=micros_to_datetime(r.first),
            last_seen=micros_to_datetime(r.last),
        )
        for r in rows
    ]


def aggregates_rows(valid: DataFrame) -> list[PaymentRow]:
    """One row per payment; the store keeps both sides and answers windows at any instant."""
    table = valid.select(
        "partition",
        "offset",
        "payment_id",
        "payer",
        "payee",
        F.col("amount").cast("string").alias("amount"),
        "currency",
        F.unix_micros("ts").alias("ts"),
    ).toArrow()
    columns = table.to_pydict()
    return [
        PaymentRow(
            partition=partition,
            offset=offset,
            payment_id=payment_id,
            payer=payer,
            payee=payee,
            amount=Decimal(amount),
            currency=currency,
            ts=micros_to_datetime(ts),
        )
        for partition, offset, payment_id, payer, payee, amount, currency, ts in zip(
            *(columns[name] for name in table.column_names), strict=True
        )
    ]


class ServiceBatches:
    """The `foreachBatch` function of one service: parse, dead-letter, apply with offsets, commit."""

    def __init__(
        self,
        service: str,
        store: Store,
        to_rows: Callable[[DataFrame], list[Any]],
        progress: GroupProgress,
        dead_letters: DeadLetters,
        max_payment_bytes: int,
        on_batch: Callable[[BatchReport], None] | None = None,
    ) -> None:
        self.service, self.store, self.to_rows = service, store, to_rows
        self.progress, self.dead_letters = progress, dead_letters
        self.parser = payment_parser(max_payment_bytes)
        self.on_batch = on_batch

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        started = time.monotonic()
        applied = self.store.applied_offsets()
        parsed = unapplied(batch, applied).mapInArrow(self.parser, PARSED_SCHEMA).persist()
        try:
            spans = {
                r.partition: (r.first, r.last, r.n)
                for r in parsed.groupBy("partition")
                .agg(
                    F.min("offset").alias("first"),
                    F.max("offset").alias("last"),
                    F.count(F.lit(1)).alias("n"),
                )
                .collect()
            }
            # From the store's offset (records may have holes: transaction markers, compaction). A row below
            # it would make `start` disagree with the store, which then refuses the batch (StaleBatch).
            covered = {
                p: (min(first, applied.get(p, first)), last + 1) for p, (first, last, _n) in spans.items()
            }
            rejected = [
                Rejected(r.partition, r.offset, r.key, r.value, r.error)
                for r in parsed.where(F.col("error").isNotNull())
                .select("partition", "offset", "key", "value", "error")
                .collect()
            ]
            rows = self.to_rows(parsed.where(F.col("error").isNull())) if spans else []
        finally:
            parsed.unpersist()
        self.dead_letters.send(rejected)
        if covered:
            self.store.apply(rows, covered)
            failpoint("after-store-write")
        # Commit what the store holds, including a replayed batch's offsets that a crash left uncommitted.
        committed = {**applied, **{p: end for p, (_start, end) in covered.items()}}
        self.progress.commit(committed)
        records = sum(n for _first, _last, n in spans.values())
        report = BatchReport(
            self.service,
            batch_id,
            records,
            len(rows),
            len(rejected),
            committed,
            time.monotonic() - started,
        )
        if records:
            log.info(
                "%s batch %d: %d records, %d dead-lettered, %.2f s, committed %s",
                self.service,
                batch_id,
                report.records,
                report.dead_lettered,
                report.seconds,
                committed,
            )
        if self.on_batch is not None:
            self.on_batch(report)
