"""The detector's second line of defence on the real system: a gate that opens for a payment the stores do
not hold yet (dependency groups committed past their stores) must not lead to a decision on evidence that
lacks it. The AML worker (`aml-app worker`) asks B's and C's real APIs (`aml-app serve`, PostgreSQL),
tells them which offset its answers must include; C, whose store lacks the payment, waits its bound and
answers "not yet"; the worker counts freshness violations and asks again, deciding the payment only once
the store has caught up, on the answers that include it.

The stores are written with the pipeline's own store writes (`aml_app.pipeline.jobs.writer_for`, one
transaction with the offsets they cover) from Arrow rows built here as Spark's transforms build them for
single payments: no Spark, which would take half a minute to start.

The APIs' store check watches the groups their pipeline commits, which agree with the stores; the groups
the gate trusts are other ones (AML_DEPENDS_ON), moved past the stores by the test. Were they the same
groups, the check would find the store behind its group at its next round (`aml_app.dependencies.api`,
every CHECK_EVERY seconds) and that API would answer 503 from then on: the detector would see freshness
violations only until then, and then wait as for a dependency that is away, so the test would race the
check's interval.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from aml_app.dependencies import aggregates
from aml_app.dependencies.store import Writer, write_meta
from aml_app.harness.dependencies import ApiProcess
from aml_app.kafka.broker import EmbeddedBroker, free_port
from aml_app.kafka.identity import log_identity
from aml_app.kafka.tools import GroupCommitter, payment_json, produce
from aml_app.pipeline.jobs import writer_for
from aml_app.pipeline.transforms import BatchOutputs
from aml_app.settings import Settings
from tests.harness import DecisionLog, Names, wait_until
from tests.stores import schema_of

pytestmark = pytest.mark.integration

PARTITION = 0
PAYER = "structurer"
T0 = datetime(2026, 3, 2, 12, tzinfo=UTC)
#: Just under the reporting threshold (10000, band 0.1): the third one in 24 h is structuring.
AMOUNT = Decimal("9500.00")
DEADLINE = 60.0
#: Questions asked again while the stale payment waits, before the test looks for its decision.
VIOLATIONS_SEEN = 4


@dataclass(frozen=True)
class Paid:
    offset: int
    payment_id: str
    payee: str
    ts: datetime

    def value(self) -> bytes:
        ts = self.ts.isoformat().replace("+00:00", "Z")
        return payment_json(self.payment_id, PAYER, self.payee, str(AMOUNT), ts)


def utc(values: Sequence[datetime]) -> pa.Array:
    return pa.array(values, pa.timestamp("us", "UTC"))


def money(n: int) -> pa.Array:
    return pa.array([AMOUNT] * n, pa.decimal128(38, 8))


def edges(payments: Sequence[Paid]) -> pa.Table:
    """Service B's rows for payments on distinct edges: one payment each."""
    n = len(payments)
    return pa.table(
        {
            "payer": [PAYER] * n,
            "payee": [p.payee for p in payments],
            "currency": ["EUR"] * n,
            "payments": pa.array([1] * n, pa.int64()),
            "total": money(n),
            "first_seen": utc([p.ts for p in payments]),
            "last_seen": utc([p.ts for p in payments]),
        }
    )


def flows(payments: Sequence[Paid], settings: Settings) -> pa.Table:
    """Service C's rows for payments in distinct minutes: one payment each (no times/amounts lists)."""
    n = len(payments)
    low = settings.reporting_threshold * (1 - settings.threshold_band)
    near = 1 if low <= AMOUNT < settings.reporting_threshold else 0
    return pa.table(
        {
            "payer": [PAYER] * n,
            "bucket": utc([p.ts.replace(second=0, microsecond=0) for p in payments]),
            "payee": [p.payee for p in payments],
            "currency": ["EUR"] * n,
            "payments": pa.array([1] * n, pa.int64()),
            "total": money(n),
            "near": pa.array([near] * n, pa.int64()),
            "times": pa.array([None] * n, pa.list_(pa.timestamp("us", "UTC"))),
            "amounts": pa.array([None] * n, pa.list_(pa.decimal128(38, 8))),
            "first_ts": utc([p.ts for p in payments]),
            "last_ts": utc([p.ts for p in payments]),
        }
    )


def apply(url: str, service: str, payments: Sequence[Paid], settings: Settings, log: str) -> None:
    """Payments into `service`'s store as the pipeline applies a micro-batch: its rows and the offsets
    they cover, in one transaction; the store records the log they are of, as the pipeline's does."""
    table = edges(payments) if service == "relations" else flows(payments, settings)
    outputs = BatchOutputs(
        spans=None, rejects=None, tables={"edges" if service == "relations" else "flows": table}
    )
    covered = {PARTITION: (payments[0].offset, payments[-1].offset + 1)}
    write = writer_for(service)
    writer = Writer(url, schema_of(service))
    try:
        writer.migrate()
        with writer.connection().transaction():
            write_meta(writer.connection(), writer.schema, {"log": log})
        if service == "aggregates":
            with writer.connection().transaction():
                aggregates.check_thresholds(
                    writer.connection(), writer.schema, settings.reporting_threshold, settings.threshold_band
                )
        writer.apply(covered, lambda conn: write(conn, outputs))
    finally:
        writer.close()


class Pipeline:
    """Plays the stores' pipeline: applies payments to a store, then commits them to its own group."""

    def __init__(self, committers: dict[str, GroupCommitter], settings: Settings, log: str) -> None:
        self.committers = committers
        self.settings = settings
        self.log = log

    async def apply(self, service: str, payments: Sequence[Paid]) -> None:
        await asyncio.to_thread(apply, self.settings.store_url, service, payments, self.settings, self.log)
        await self.committers[service].commit({PARTITION: payments[-1].offset + 1})


@pytest.fixture
async def store_groups(broker: EmbeddedBroker, names: Names) -> AsyncIterator[dict[str, GroupCommitter]]:
    """The groups the stores' pipeline commits (service -> committer); not the gate's."""
    committers = {
        service: await GroupCommitter(
            [broker.bootstrap], f"store-{service}-{names.suffix}", names.payments
        ).start([PARTITION])
        for service in ("relations", "aggregates")
    }
    yield committers
    for committer in committers.values():
        await committer.stop()


@pytest.fixture
async def apis(
    broker: EmbeddedBroker,
    names: Names,
    store_url: str,
    store_groups: dict[str, GroupCommitter],
    tmp_path: Path,
) -> AsyncIterator[dict[str, ApiProcess]]:
    """`aml-app serve relations` and `aml-app serve aggregates` on the test's store, checking it against
    the stores' groups."""
    settings = replace(
        Settings(),
        bootstrap_servers=(broker.bootstrap,),
        payments_topic=names.payments,
        partitions=names.partitions,
        relations_group=f"store-relations-{names.suffix}",
        aggregates_group=f"store-aggregates-{names.suffix}",
        store_url=store_url,
        relations_port=free_port(),
        aggregates_port=free_port(),
    )
    started = {
        kind: ApiProcess(kind, settings, tmp_path / f"{kind}-api.log") for kind in ("relations", "aggregates")
    }
    try:
        for api in started.values():
            api.start()
        yield started
    finally:
        for api in started.values():
            await asyncio.to_thread(api.stop, 10)


async def checked_ok(api: ApiProcess) -> dict[str, Any] | None:
    """The API's /health once its store check has compared the store with its group and found it whole."""
    assert api.alive(), f"the {api.kind} API exited:\n{api.log_tail()}"
    health = await api.health()
    return health if health and health["store_check"]["state"] == "ok" else None


async def test_a_gate_opened_past_the_stores_is_waited_out_and_the_payment_decided_on_fresh_evidence(
    broker: EmbeddedBroker,
    names: Names,
    producer: Any,
    deps: dict[str, GroupCommitter],
    store_url: str,
    store_groups: dict[str, GroupCommitter],
    apis: dict[str, ApiProcess],
    new_worker: Any,
    decision_log: DecisionLog,
) -> None:
    # Three payments just under the threshold from one payer, a minute apart: the third is structuring,
    # which C's evidence shows only once it holds that third payment.
    paid = [Paid(o, f"s-{names.suffix}-{o}", f"payee-{o}", T0 + timedelta(minutes=o)) for o in range(3)]
    placed = await produce(producer, names.payments, [(PARTITION, PAYER.encode(), p.value()) for p in paid])
    assert placed == [(PARTITION, p.offset) for p in paid]
    first, second, third = paid

    # B holds all three; C holds the first two only.
    log = await asyncio.to_thread(log_identity, {"bootstrap.servers": broker.bootstrap}, names.payments)
    pipeline = Pipeline(store_groups, replace(Settings(), store_url=store_url), log)
    await pipeline.apply("relations", paid)
    await pipeline.apply("aggregates", [first, second])
    for api in apis.values():
        await wait_until(lambda a=api: checked_ok(a), DEADLINE, f"the {api.kind} API to find its store whole")

    worker = new_worker(
        AML_SERVICE="aml",
        AML_RELATIONS_URL=apis["relations"].url,
        AML_AGGREGATES_URL=apis["aggregates"].url,
    )
    await worker.wait_ready(set(range(names.partitions)), timeout=DEADLINE)

    # The gate's groups first say what the stores hold: the first two are decided, fresh and clear.
    await asyncio.gather(*(committer.commit({PARTITION: 2}) for committer in deps.values()))
    await decision_log.wait_for({(PARTITION, 0), (PARTITION, 1)}, timeout=DEADLINE)
    for decision in decision_log.decisions():
        assert decision["fresh"] is True and decision["stale_reads"] == 0, decision
        assert decision["verdict"] == "clear", decision

    # Then both are moved past C's store: the gate opens for the third, which C does not hold.
    await asyncio.gather(*(committer.commit({PARTITION: 3}) for committer in deps.values()))

    async def violations() -> dict[str, Any] | None:
        await decision_log.poll(0.1)
        decided = [d for d in decision_log.decisions() if d["offset"] == third.offset]
        assert decided == [], f"decided on evidence that lacks it: {decided}"
        state = await worker.state()
        stats = state and state["detector"]
        return stats if stats and stats["freshness_violations"] >= VIOLATIONS_SEEN else None

    stats = await wait_until(violations, DEADLINE, f"{VIOLATIONS_SEEN} freshness violations")
    # The gate did let it through (its watermark is past it); the detector holds it.
    state = await worker.state()
    assert state is not None and state["watermarks"][str(PARTITION)]["watermark"] == 3, state
    assert stats["decided_on_stale"] == 0 and stats["decisions"] == 2, stats
    await decision_log.poll(0.2)
    assert (PARTITION, third.offset) not in decision_log.decided()
    # Only C lacked it: told what the batch needs, it waited its bound and answered "not yet"; B had it.
    log_text = worker.log_text()
    assert "wait for their dependencies: aggregates has not applied what the question needs yet" in log_text
    assert "relations has not applied" not in log_text
    assert stats["dependency_not_yet"] >= VIOLATIONS_SEEN, stats

    # C's store catches up: the next question gets answers that include the payment.
    await pipeline.apply("aggregates", [third])
    await decision_log.wait_for({(PARTITION, third.offset)}, timeout=DEADLINE)
    [decision] = [d for d in decision_log.decisions() if d["offset"] == third.offset]
    assert decision["payment_id"] == third.payment_id
    assert decision["fresh"] is True and decision["gated"] is True and decision["note"] == "", decision
    assert decision["stale_reads"] >= VIOLATIONS_SEEN, decision
    assert set(decision["evidence_as_of"].values()) == {3}, decision
    # Decided on C's answer that holds all three payments: the structuring it shows is caught.
    assert decision["verdict"] == "alert" and decision["rules"] == ["aml.structuring"], decision

    async def counted() -> dict[str, Any] | None:
        state = await worker.state()
        stats = state and state["detector"]
        return stats if stats and stats["decisions"] == 3 else None

    stats = await wait_until(counted, DEADLINE, "the worker to count the third decision")
    # Every violation was the third payment's, and every one of them was asked about again.
    assert stats["freshness_violations"] == decision["stale_reads"], (stats, decision)
    assert stats["decided_on_stale"] == 0 and stats["dependency_unavailable"] == 0, stats
