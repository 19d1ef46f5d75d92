"""The probe: the smallest gated service. It asks no dependency and runs no rule; it records, for every
payment, that the gate let it through and when.

The gate's own integration tests and benchmarks run it, so they check and measure the gate alone, with
the dependency groups played by the test (no Spark, no HTTP).

`AML_PROBE_FAIL=id:n,...` makes the first n attempts at those payments fail (a handler that keeps
failing: the tests of `retrying`). `AML_PROBE_COST_MS` (default 0) adds a cost per payment, a
benchmarking knob only (`bench/scaling.py`): it makes the worker the bottleneck so that throughput
follows the worker count. `AML_PROBE_COST_KIND` says what the cost is: `cpu` burns that much CPU time
(rules that compute), `block` sleeps without releasing the event loop (a synchronous call to something
slow: no CPU, but the worker does nothing else meanwhile), `wait` awaits a sleep (an asynchronous call:
the other partitions' lanes go on).
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from aml_app.tables.watermarks import WorkerGate

from aml_app.app import send_decision, settings
from aml_app.gate import Admission
from aml_app.gate.handling import LeftToComplete
from aml_app.models import Payment, decision_json
from aml_app.settings import ProbeCostKind
from aml_app.worker.agent import Served, gated_agent

NOTE = "probe: admitted by the gate; no evidence asked for and no rule run"


def burn_cpu(seconds: float) -> None:
    """Spin until this thread has used `seconds` of CPU (not wall) time: the same work per payment
    however busy the machine is."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def pay_cost(ms: float, kind: ProbeCostKind) -> None:
    """The benchmarking cost of one payment, `ms` > 0 (see the module docstring); the caller skips the
    call when there is none, so the hot path does not create a coroutine per payment for nothing."""
    if kind is ProbeCostKind.CPU:
        burn_cpu(ms / 1000)
    elif kind is ProbeCostKind.BLOCK:
        time.sleep(ms / 1000)  # noqa: ASYNC251 - deliberately blocking: a synchronous client call
    else:
        await asyncio.sleep(ms / 1000)


class ProbeFailure(RuntimeError):
    """The failure `AML_PROBE_FAIL` asks for (a handler that keeps failing, for the tests)."""


#: Failed attempts so far per payment id named in AML_PROBE_FAIL.
failed: dict[str, int] = {}


async def record(payment: Payment, admission: Admission) -> LeftToComplete:
    planned = settings.detection.probe_fail.get(payment.payment_id)
    if planned is not None and failed.get(payment.payment_id, 0) < planned:
        failed[payment.payment_id] = failed.get(payment.payment_id, 0) + 1
        raise ProbeFailure(f"AML_PROBE_FAIL: attempt {failed[payment.payment_id]} of {planned} fails")
    if settings.detection.probe_cost_ms > 0:
        await pay_cost(settings.detection.probe_cost_ms, settings.detection.probe_cost_kind)
    value = decision_json(
        payment_id=payment.payment_id,
        partition=admission.partition,
        offset=admission.offset,
        service="probe",
        verdict="clear",
        rules=[],
        typologies=[],
        note=NOTE
        if admission.stale is None
        else f"probe: decided stale after {admission.stale:g} s at the gate",
        watermark=admission.watermark,
        dependencies=admission.dependencies,
        waited_ms=admission.waited_ms,
        decided_at=datetime.now(UTC).isoformat(timespec="microseconds"),
        worker=settings.worker_id,
        gated=admission.gated,
        cut=admission.cut,
        stale=admission.stale is not None,
    )
    # The lane acks the payment (and Faust commits it) only once the broker has the decision, and goes
    # on with the next payments meanwhile.
    return await send_decision(payment.payment_id, value)


def service(worker_gate: WorkerGate) -> Served:
    return Served(gated_agent(worker_gate, record))
