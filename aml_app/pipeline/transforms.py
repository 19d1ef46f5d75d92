"""What Services B and C compute from one micro-batch, as Spark DataFrame operations (in the JVM).

Python touches no record here: the Kafka source hands Spark raw bytes, `validation.validated` parses and
checks them with Spark SQL, and the results leave Spark already aggregated, as Arrow tables:

- `spans`: per partition, the first and last offset and the number of records (what the batch covers);
- `rejects`: the records that break the payment contract, with their original bytes (for the DLQ);
- relations: `edges`, one row per (payer, payee, currency) of the batch;
- aggregates: `payments`, one narrow row per valid payment, and `buckets`, one row per (account, minute,
  direction, counterparty, currency) with counts, exact totals and near-threshold counts.

The batch is parsed once and kept in memory while the services' jobs run (`persist`), so Kafka is read
and the contract checked once per batch, whatever the number of services and outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from aml_app.pipeline.validation import validated
from aml_app.services.aggregates import PAYMENT_COLUMNS  # every valid payment, as its windows need it

SERVICES = ("relations", "aggregates")


@dataclass
class BatchOutputs:
    """One micro-batch's results on the driver, as Arrow tables (see the module docstring)."""

    spans: Any
    rejects: Any
    tables: dict[str, Any] = field(default_factory=dict)

    def covered(self, applied: dict[int, int]) -> dict[int, tuple[int, int]]:
        """Per partition, the offsets the batch covers: from where the store left off to its last record.

        From the store's offset rather than the first record: offsets may have holes (transaction markers,
        compaction) where a batch starts.
        """
        spans = self.spans.to_pydict()
        return {
            p: (min(first, applied.get(p, first)), last + 1)
            for p, first, last in zip(spans["partition"], spans["first"], spans["last"], strict=True)
        }

    @property
    def records(self) -> int:
        return sum(self.spans["records"].to_pylist())


def edges(valid: DataFrame) -> DataFrame:
    """Service B: the batch's payments summed per directed edge and currency."""
    return valid.groupBy("payer", "payee", "currency").agg(
        F.count("*").alias("payments"),
        F.sum("amount").alias("total"),
        F.min("ts").alias("first_seen"),
        F.max("ts").alias("last_seen"),
    )


def near_threshold(amount: Column, threshold: Decimal, band: Decimal) -> Column:
    """1 for an amount in [threshold * (1 - band), threshold), else 0 (exact decimal comparison)."""
    low = F.lit(threshold * (1 - band)).cast("decimal(38,8)")
    high = F.lit(threshold).cast("decimal(38,8)")
    return F.when((amount >= low) & (amount < high), 1).otherwise(0)


def buckets(valid: DataFrame, threshold: Decimal, band: Decimal) -> DataFrame:
    """Service C: per account and minute of event time, each payment once from each side."""
    minute = F.date_trunc("minute", "ts")
    sent = valid.select(
        F.col("payer").alias("account"),
        minute.alias("bucket"),
        F.lit("out").alias("direction"),
        F.col("payee").alias("counterparty"),
        "currency",
        "amount",
        near_threshold(F.col("amount"), threshold, band).alias("near"),
    )
    received = valid.select(
        F.col("payee").alias("account"),
        minute.alias("bucket"),
        F.lit("in").alias("direction"),
        F.col("payer").alias("counterparty"),
        "currency",
        "amount",
        F.lit(0).alias("near"),
    )
    return (
        sent.unionByName(received)
        .groupBy("account", "bucket", "direction", "counterparty", "currency")
        .agg(F.count("*").alias("payments"), F.sum("amount").alias("total"), F.sum("near").alias("near"))
    )


@contextmanager
def kept(frame: DataFrame) -> Iterator[DataFrame]:
    """`frame` cached in memory for the block (the batch's outputs read it once each)."""
    cached = frame.persist(StorageLevel.MEMORY_ONLY)
    try:
        yield cached
    finally:
        cached.unpersist()


def batch_outputs(
    records: DataFrame, service: str, max_bytes: int, threshold: Decimal, band: Decimal
) -> BatchOutputs:
    """Everything `service` needs from one micro-batch of Kafka records, collected to the driver."""
    with kept(validated(records, max_bytes)) as checked:
        return service_outputs(checked, service, threshold, band)


def service_outputs(checked: DataFrame, service: str, threshold: Decimal, band: Decimal) -> BatchOutputs:
    """`service`'s outputs from a validated batch (`validation.validated`, best kept in memory).

    Two Spark jobs, because each job costs a fixed scheduling price that dominates small batches: one
    narrow collect of what is per record anyway (offsets, the rejected records' bytes, and for Service C
    the payments), from which the driver takes the spans and the rejects with Arrow, and one aggregation
    (edges or buckets).
    """
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; expected one of {', '.join(SERVICES)}")
    rejected = ~F.col("valid")
    per_record: list[Column | str] = [
        "partition",
        "offset",
        "valid",
        F.when(rejected, F.col("key")).alias("key"),
        F.when(rejected, F.col("value")).alias("value"),
    ]
    if service == "aggregates":
        per_record += list(PAYMENT_COLUMNS)
    rows = checked.select(*per_record).toArrow()
    valid = checked.where("valid")
    if service == "relations":
        tables = {"edges": edges(valid).toArrow()}
    else:
        tables = {
            "buckets": buckets(valid, threshold, band).toArrow(),
            "payments": rows.filter(rows["valid"]).select(list(PAYMENT_COLUMNS)),
        }
    return BatchOutputs(arrow_spans(rows), arrow_rejects(rows), tables)


def arrow_spans(rows: Any) -> Any:
    """`spans` of a batch's per-record Arrow rows (partition, offset)."""
    aggregations = [("offset", "min"), ("offset", "max"), ("offset", "count")]
    grouped = rows.group_by("partition").aggregate(aggregations)
    return grouped.rename_columns(
        {"offset_min": "first", "offset_max": "last", "offset_count": "records"}
    ).select(["partition", "first", "last", "records"])


def arrow_rejects(rows: Any) -> Any:
    import pyarrow.compute as pc

    return rows.filter(pc.invert(rows["valid"])).select(["partition", "offset", "key", "value"])
