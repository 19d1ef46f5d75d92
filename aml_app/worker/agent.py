"""A gated service in one call: a Faust agent on the payments topic whose payments pass the freshness gate.

Every gated service (AML, fraud, the probe) is the same machinery with a different handler: the agent only
dispatches, per-partition lanes wait on the gate, the handler runs, acks go in offset order
(`aml_app.gate.GatedConsumer`). The service in `agents/` that `AML_SERVICE` names calls `gated_agent` once,
when the worker is composed (`aml_app.agents.compose`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aml_app.app import alerts_topic, app, decisions_topic, dlq_topic, payments_topic, review_topic, settings
from aml_app.faust_internals import keep_in_metadata
from aml_app.gate import GatedConsumer
from aml_app.gate.handling import BatchHandler, Handler
from aml_app.gate.options import LaneLimits, LanePolicy
from aml_app.settings import WaitPolicy
from aml_app.tables.alerts import copartitioning_problem
from aml_app.tables.watermarks import WorkerGate, park_of, refresh

if TYPE_CHECKING:
    from aml_app.worker.detector import Detector


@dataclass(frozen=True)
class Served:
    """A gated service as a worker runs it: its gated consumer and, for a detecting service, its
    detector (what the web view shows of it)."""

    gated: GatedConsumer
    detector: Detector | None = None


def gated_agent(
    worker_gate: WorkerGate,
    handler: Handler | None = None,
    *,
    batch_handler: BatchHandler | None = None,
    max_batch: int = 1,
) -> GatedConsumer:
    """Register the agent of this worker's service, gated by `worker_gate`, and return its gated consumer.

    `handler` takes one payment at a time; `batch_handler` up to `max_batch` admitted payments of one
    partition at once (one round trip to each dependency for all of them).
    """
    gated = GatedConsumer(
        app,
        worker_gate.gate,
        handler,
        dlq_topic,
        batch_handler=batch_handler,
        limits=LaneLimits(
            max_batch=max_batch,
            max_pending=settings.gate.max_pending_per_partition,
            max_in_flight=settings.gate.max_in_flight,
            max_payment_bytes=settings.kafka.max_payment_bytes,
            max_clock_skew=settings.kafka.max_clock_skew,
        ),
        policy=LanePolicy(
            gate_enabled=settings.gate.enabled,
            stale_after=settings.gate.max_wait
            if settings.gate.wait_policy is WaitPolicy.DECIDE_STALE
            else None,
            max_attempts=settings.gate.max_attempts,
            park_requested=lambda p, o: park_of.get(f"{p}:{o}"),
        ),
        review=review_topic,
        worker_id=settings.worker_id,
        security=settings.kafka.security,
    )
    worker_gate.register(gated)  # refuses a second one before it is wired to anything
    gated.attach(
        bootstrap_servers=settings.kafka.bootstrap_servers,
        topic=settings.kafka.payments_topic,
        group=settings.app_id,
        check_every=refresh.delivery_check,
        quiet=refresh.delivery_quiet,
        refuse=copartitioning_problem,
        session_timeout=settings.kafka.session_timeout,
    )

    async def consume(stream):  # type: ignore[no-untyped-def]
        # Before the first send: every topic this worker writes stays in its producer's metadata.
        keep_in_metadata(
            app, [t.get_topic_name() for t in (decisions_topic, alerts_topic, dlq_topic, review_topic)]
        )
        await gated.consume(stream)

    app.agent(payments_topic, name=settings.service)(consume)
    return gated
