"""Building and reading the stores of Services B and C in tests, through the pipeline's own code.

A batch is applied exactly as the pipeline applies it: Kafka-like records (key, value bytes at a partition
and offset) go through the same Spark transforms (`aml_app.pipeline.transforms.batch_outputs`) and the
same store write, in one transaction with the offsets; only Kafka itself is left out. Answers are read
through the APIs' reader, in one snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from aml_app.dependencies import aggregates, relations
from aml_app.dependencies.store import Reader, Schema, Writer
from aml_app.pipeline.jobs import writer_for
from aml_app.pipeline.transforms import BatchOutputs, batch_outputs
from aml_app.settings import Settings
from tests.payments import PaymentRow

RECORDS_SCHEMA = "partition INT, offset BIGINT, timestamp TIMESTAMP, key BINARY, value BINARY"


def schema_of(service: str) -> Schema:
    return relations.SCHEMA if service == "relations" else aggregates.SCHEMA


def records_frame(spark: Any, records: Iterable[tuple[int, int, bytes | None, bytes | None]]) -> Any:
    """A DataFrame shaped like the Kafka source's, from (partition, offset, key, value)."""
    return spark.createDataFrame([(p, o, None, k, v) for p, o, k, v in records], RECORDS_SCHEMA)


def payment_records(payments: Iterable[PaymentRow]) -> list[tuple[int, int, bytes, bytes]]:
    return [(p.partition, p.offset, *p.record()) for p in payments]


def apply_records(
    spark: Any,
    url: str,
    service: str,
    records: Sequence[tuple[int, int, bytes | None, bytes | None]],
    settings: Settings | None = None,
    covered: Mapping[int, tuple[int, int]] | None = None,
) -> BatchOutputs:
    """One micro-batch of `records` into `service`'s store at `url`, as the pipeline applies it.

    `covered` defaults to what the pipeline would claim: from the store's offsets to each partition's last
    record.
    """
    settings = settings or Settings()
    outputs = batch_outputs(
        records_frame(spark, records),
        service,
        settings.kafka.max_payment_bytes,
        settings.dependencies.reporting_threshold,
        settings.dependencies.threshold_band,
    )
    writer = Writer(url, schema_of(service))
    try:
        writer.migrate()
        if service == "aggregates":
            with writer.connection().transaction():
                aggregates.check_thresholds(
                    writer.connection(),
                    writer.schema,
                    settings.dependencies.reporting_threshold,
                    settings.dependencies.threshold_band,
                )
        claim = dict(covered) if covered is not None else outputs.covered(writer.applied_offsets())
        write = writer_for(service, timedelta(seconds=settings.dependencies.aggregates_retention))
        writer.apply(claim, lambda conn: write(conn, outputs))
    finally:
        writer.close()
    return outputs


def apply_payments(
    spark: Any, url: str, service: str, payments: Sequence[PaymentRow], **kw: Any
) -> BatchOutputs:
    return apply_records(spark, url, service, payment_records(payments), **kw)


async def relations_answers(
    url: str, queries: Sequence[tuple[str, int, Sequence[str]]]
) -> list[dict[str, Any]]:
    reader = Reader(url, relations.SCHEMA)
    await reader.open()
    try:
        async with reader.snapshot() as snap:
            return await relations.relations_many(
                snap.cur,
                snap.schema,
                queries,
                snap.as_of,
                snap.meta.get("log"),
                folded=relations.folded_before(snap.meta),
            )
    finally:
        await reader.close()


async def aggregates_answers(
    url: str, queries: Sequence[tuple[str, datetime]], settings: Settings | None = None
) -> list[dict[str, Any]]:
    settings = settings or Settings()
    reader = Reader(url, aggregates.SCHEMA)
    await reader.open()
    try:
        async with reader.snapshot() as snap:
            return await aggregates.aggregates_many(
                snap.cur,
                snap.schema,
                queries,
                snap.as_of,
                snap.meta,
                (settings.dependencies.reporting_threshold, settings.dependencies.threshold_band),
                settings.detection.aml_thresholds.rates,
            )
    finally:
        await reader.close()


def without_as_of(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without what says which offsets of which log it holds (`as_of`, `log`)."""
    return {k: v for k, v in answer.items() if k not in ("as_of", "log")}


def with_dependencies(settings: Settings, **changes: Any) -> Settings:
    """`settings` with fields of its `DependencySettings` changed (the store's URL, the APIs' bounds)."""
    return replace(settings, dependencies=replace(settings.dependencies, **changes))
