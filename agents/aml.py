"""Service-A: the AML agent, gated on its dependencies' committed offsets.

Detection rules arrive with the detection issue; until then every payment is cleared and the decision
says so, so nobody mistakes a placeholder for a verdict.
"""

from __future__ import annotations

from datetime import UTC, datetime

from aml_app.app import app, decisions_topic, dlq_topic, payments_topic, settings
from aml_app.gate import Admission, GatedConsumer
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
gated.attach(
    bootstrap_servers=settings.bootstrap_servers,
    topic=settings.payments_topic,
    group=settings.app_id,
    check_every=settings.refresh_interval,
)


@app.agent(payments_topic, name="aml")
async def aml(stream):  # type: ignore[no-untyped-def]
    await gated.consume(stream)
