"""The probe: the smallest gated service. It asks no dependency and runs no rule; it records, for every
payment, that the gate let it through and when.

The gate's own integration tests and benchmarks run it, so they check and measure the gate alone, with
the dependency groups played by the test (no Spark, no HTTP).
"""

from __future__ import annotations

from datetime import UTC, datetime

from aml_app.app import decisions_topic, settings
from aml_app.gate import Admission
from aml_app.models import Decision, Payment
from aml_app.service import gated_service

NOTE = "probe: admitted by the gate; no evidence asked for and no rule run"


async def record(payment: Payment, admission: Admission) -> None:
    decision = Decision(
        payment_id=payment.payment_id,
        partition=admission.partition,
        offset=admission.offset,
        service="probe",
        verdict="clear",
        rules=[],
        typologies=[],
        note=NOTE,
        watermark=admission.watermark,
        dependencies=admission.dependencies,
        waited_ms=admission.waited_ms,
        decided_at=datetime.now(UTC).isoformat(timespec="microseconds"),
        worker=settings.worker_id,
        gated=admission.gated,
    )
    # Wait for the broker's acknowledgement: the payment is acked (and later committed) only after.
    await (await decisions_topic.send(key=payment.payment_id, value=decision))


gated = gated_service(record)
