"""The stores of B and C fed by the test instead of Spark, for tests that must choose what each store has
applied and when (one partition held back, a store behind its group), with the real APIs in front.

The stores are written with the pipeline's own store writes (`aml_app.pipeline.jobs.writer_for`, one
transaction with the offsets they cover) from Arrow rows built here as Spark's transforms build them for
payments on distinct keys (one payment per edge and per flow row): no Spark, which would take half a
minute to start. `Pipeline.apply` then commits the store's own group, as the pipeline does after a
durable write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from aml_app import dependency_services as registry
from aml_app.dependencies import aggregates
from aml_app.dependencies.store import Writer, write_meta
from aml_app.dependency_services import Endpoint
from aml_app.harness.dependencies import ApiProcess
from aml_app.kafka.broker import free_port
from aml_app.kafka.tools import GroupCommitter
from aml_app.pipeline.jobs import writer_for
from aml_app.pipeline.transforms import BatchOutputs
from aml_app.settings import DependencySettings, KafkaSettings, Settings
from tests.payments import PaymentRow
from tests.stores import schema_of

SERVICES = ("relations", "aggregates")


def utc(values: Sequence[datetime]) -> pa.Array:
    return pa.array(values, pa.timestamp("us", "UTC"))


def money(payments: Sequence[PaymentRow]) -> pa.Array:
    return pa.array([p.amount for p in payments], pa.decimal128(38, 8))


def edges(payments: Sequence[PaymentRow]) -> pa.Table:
    """Service B's rows for payments on distinct edges: one payment each (no times/amounts lists)."""
    assert len({(p.payer, p.payee) for p in payments}) == len(payments), "one payment per edge"
    n = len(payments)
    return pa.table(
        {
            "payer": [p.payer for p in payments],
            "payee": [p.payee for p in payments],
            "currency": [p.currency for p in payments],
            "payments": pa.array([1] * n, pa.int64()),
            "total": money(payments),
            "first_seen": utc([p.ts for p in payments]),
            "last_seen": utc([p.ts for p in payments]),
            "times": pa.array([None] * n, pa.list_(pa.timestamp("us", "UTC"))),
            "amounts": pa.array([None] * n, pa.list_(pa.decimal128(38, 8))),
        }
    )


def flows(payments: Sequence[PaymentRow], settings: Settings) -> pa.Table:
    """Service C's rows for payments in distinct (payer, minute, payee) keys: one payment each."""
    minutes = [(p.payer, p.ts.replace(second=0, microsecond=0), p.payee) for p in payments]
    assert len(set(minutes)) == len(payments), "one payment per flow row"
    n = len(payments)
    low, high = aggregates.near_bounds(
        settings.dependencies.reporting_threshold, settings.dependencies.threshold_band
    )
    return pa.table(
        {
            "payer": [p.payer for p in payments],
            "bucket": utc([m for _, m, _ in minutes]),
            "payee": [p.payee for p in payments],
            "currency": [p.currency for p in payments],
            "payments": pa.array([1] * n, pa.int64()),
            "total": money(payments),
            "near": pa.array([1 if low <= p.amount < high else 0 for p in payments], pa.int64()),
            "times": pa.array([None] * n, pa.list_(pa.timestamp("us", "UTC"))),
            "amounts": pa.array([None] * n, pa.list_(pa.decimal128(38, 8))),
            "first_ts": utc([p.ts for p in payments]),
            "last_ts": utc([p.ts for p in payments]),
        }
    )


def apply(url: str, service: str, payments: Sequence[PaymentRow], settings: Settings, log: str) -> None:
    """Payments of one partition into `service`'s store as the pipeline applies a micro-batch: its rows
    and the offsets they cover, in one transaction; the store records the log they are of."""
    [partition] = {p.partition for p in payments}
    table = registry.service(service).table
    rows = edges(payments) if table == "edges" else flows(payments, settings)
    outputs = BatchOutputs(spans=None, rejects=None, tables={table: rows})
    covered = {partition: (payments[0].offset, payments[-1].offset + 1)}
    write = writer_for(service)
    writer = Writer(url, schema_of(service))
    try:
        writer.migrate()
        with writer.connection().transaction():
            write_meta(writer.connection(), writer.schema, {"log": log})
        with writer.connection().transaction():
            registry.service(service).check_store(writer.connection(), writer.schema, settings)
        writer.apply(covered, lambda conn: write(conn, outputs))
    finally:
        writer.close()


class Pipeline:
    """Plays the stores' pipeline: applies payments to a store, then commits them to its group(s)."""

    def __init__(self, committers: dict[str, list[GroupCommitter]], settings: Settings, log: str) -> None:
        self.committers = committers
        self.settings = settings
        self.log = log

    async def apply(self, service: str, payments: Sequence[PaymentRow]) -> None:
        """Payments of one partition, in offset order, from the store's next offset on."""
        await asyncio.to_thread(
            apply, self.settings.dependencies.store_url, service, payments, self.settings, self.log
        )
        partition = payments[0].partition
        for committer in self.committers[service]:
            await committer.commit({partition: payments[-1].offset + 1})

    async def apply_both(self, payments: Sequence[PaymentRow]) -> None:
        for service in SERVICES:
            await self.apply(service, payments)


def api_settings(bootstrap: str, names: Any, store_url: str, groups: dict[str, str]) -> Settings:
    """Settings for `aml-app serve` of both services on the test's store, checking it against `groups`."""
    return Settings(
        kafka=KafkaSettings(
            bootstrap_servers=(bootstrap,), payments_topic=names.payments, partitions=names.partitions
        ),
        dependencies=DependencySettings(
            store_url=store_url,
            endpoints={name: Endpoint(groups[name], free_port()) for name in registry.NAMES},
        ),
    )


def start_apis(settings: Settings, folder: Path) -> dict[str, ApiProcess]:
    started = {kind: ApiProcess(kind, settings, folder / f"{kind}-api.log") for kind in SERVICES}
    for api in started.values():
        api.start()
    return started


async def stop_apis(apis: dict[str, ApiProcess]) -> None:
    for api in apis.values():
        await asyncio.to_thread(api.stop, 10)


async def checked_ok(api: ApiProcess) -> dict[str, Any] | None:
    """The API's /health once its store check has compared the store with its group and found it whole."""
    assert api.alive(), f"the {api.kind} API exited:\n{api.log_tail()}"
    health = await api.health()
    return health if health and health["store_check"]["state"] == "ok" else None
