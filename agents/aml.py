"""Service-A: the AML agent, gated on its dependencies' committed offsets.

Detection rules arrive with the detection issue; until then every payment is cleared and the decision
says so, so nobody mistakes a placeholder for a verdict.
"""

from __future__ import annotations

from datetime import UTC, datetime

from aml_app.app import app, decisions_topic, dlq_topic, payments_topic, settings
from aml_app.gate import Admission, DependencyOffsets, GatedConsumer, retry_forever
from aml_app.models import Decision, Payment
from tables.watermarks import gate

NO_RULES_NOTE = "no detection rules are configured yet: verdict 'clear' means not examined"


async def decide(payment: Payment, admission: Admission) -> None:
    decision = Decision(
        payment_id=payment.payment_id,
        partition=admission.partition,
        offset=admission.offset,
        verdict="clear",
        rules=[],
        note=NO_RULES_NOTE,
        watermark=admission.watermark,
        dependencies=admission.dependencies,
        waited_ms=admission.waited_ms,
        decided_at=datetime.now(UTC).isoformat(timespec="microseconds"),
        worker=settings.worker_id,
        gated=admission.gated,
    )
    # Wait for the broker's acknowledgement: the payment is acked (and later committed) only after.
    await (await decisions_topic.send(key=payment.payment_id, value=decision))


gated = GatedConsumer(
    app,
    gate,
    decide,
    dlq_topic,
    gate_enabled=settings.gate_enabled,
    max_pending=settings.max_pending_per_partition,
    max_payment_bytes=settings.max_payment_bytes,
    worker_id=settings.worker_id,
)


@app.agent(payments_topic, name="aml")
async def aml(stream):  # type: ignore[no-untyped-def]
    await gated.consume(stream)


@app.on_partitions_revoked.connect
async def _stop_lanes(sender, revoked, **kwargs) -> None:  # type: ignore[no-untyped-def]
    gated.on_revoked()


@app.on_partitions_assigned.connect
async def _resume_lanes(sender, assigned, **kwargs) -> None:  # type: ignore[no-untyped-def]
    mine = sorted(tp for tp in assigned if tp.topic == settings.payments_topic)
    generation = gated.rebalances
    starts = await _starts(mine) if mine else {}
    if gated.rebalances == generation:  # a newer rebalance has begun: its own handler takes over
        gated.on_assigned(starts)


async def _starts(tps: list) -> dict[int, int]:
    """Where each partition starts: our group's committed offset, or the log start."""
    reader = DependencyOffsets(settings.bootstrap_servers, settings.payments_topic, [settings.app_id])
    try:
        _, committed = await retry_forever("reading our committed offsets", reader.read)
    finally:
        await reader.close()
    earliest = await app.consumer.earliest_offsets(*tps)
    ours = committed[settings.app_id]
    return {tp.partition: max(ours.get(tp.partition) or 0, earliest.get(tp) or 0) for tp in tps}


@app.timer(settings.refresh_interval)
async def _check_delivery() -> None:
    await gated.check_delivery(settings.payments_topic, quiet=2 * settings.refresh_interval)
