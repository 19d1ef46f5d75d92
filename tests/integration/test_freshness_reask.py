"""The detector's second line of defence on the real system: a gate that opens for a payment the stores do
not hold yet (dependency groups committed past their stores) must not lead to a decision on evidence that
lacks it. The AML worker (`aml-app worker`) asks B's and C's real APIs (`aml-app serve`, PostgreSQL),
tells them which offset its answers must include; C, whose store lacks the payment, waits its bound and
answers "not yet"; the worker counts freshness violations and asks again, deciding the payment only once
the store has caught up, on the answers that include it.

The stores are fed by the test with the pipeline's own store writes (`tests.played_stores`): no Spark.

The APIs' store check watches the groups their pipeline commits, which agree with the stores; the groups
the gate trusts are other ones (AML_DEPENDS_ON), moved past the stores by the test. Were they the same
groups, the check would find the store behind its group at its next round (`aml_app.dependencies.api`,
every CHECK_EVERY seconds) and that API would answer 503 from then on: the detector would see freshness
violations only until then, and then wait as for a dependency that is away, so the test would race the
check's interval.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from aml_app.harness.dependencies import ApiProcess
from aml_app.kafka.broker import EmbeddedBroker
from aml_app.kafka.identity import log_identity
from aml_app.kafka.tools import GroupCommitter, produce
from aml_app.settings import Settings
from tests.harness import DecisionLog, Names, wait_until
from tests.payments import PaymentRow
from tests.played_stores import Pipeline, api_settings, checked_ok, start_apis, stop_apis
from tests.stores import with_dependencies

pytestmark = pytest.mark.integration

PARTITION = 0
PAYER = "structurer"
T0 = datetime(2026, 3, 2, 12, tzinfo=UTC)
#: Just under the reporting threshold (10000, band 0.1): the third one in 24 h is structuring.
AMOUNT = Decimal("9500.00")
DEADLINE = 60.0
#: Questions asked again while the stale payment waits, before the test looks for its decision.
VIOLATIONS_SEEN = 4


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
    groups = {service: f"store-{service}-{names.suffix}" for service in ("relations", "aggregates")}
    started = start_apis(api_settings(broker.bootstrap, names, store_url, groups), tmp_path)
    try:
        yield started
    finally:
        await stop_apis(started)


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
    paid = [
        PaymentRow(
            PARTITION,
            o,
            f"s-{names.suffix}-{o}",
            PAYER,
            f"payee-{o}",
            AMOUNT,
            "EUR",
            T0 + timedelta(minutes=o),
        )
        for o in range(3)
    ]
    placed = await produce(producer, names.payments, [(PARTITION, *p.record()) for p in paid])
    assert placed == [(PARTITION, p.offset) for p in paid]
    first, second, third = paid

    # B holds all three; C holds the first two only.
    log = await asyncio.to_thread(log_identity, {"bootstrap.servers": broker.bootstrap}, names.payments)
    committers = {service: [committer] for service, committer in store_groups.items()}
    pipeline = Pipeline(committers, with_dependencies(Settings(), store_url=store_url), log)
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
    assert stats["decided_not_fresh"] == 0 and stats["decisions"] == 2, stats
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
    assert stats["decided_not_fresh"] == 0 and stats["dependency_unavailable"] == 0, stats
