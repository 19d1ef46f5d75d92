"""Read-only views served by every worker on Faust's web server (bound to AML_WEB_HOST, 127.0.0.1).

- `/watermarks/`: the page an on-call engineer opens first (`aml_app.views.page.PAGE`); `/watermarks`
  redirects there.
- `/watermarks.json`: this worker's view of the shared watermark table plus its own gate state; every
  field is documented in docs/operating.md, and the older field names are kept as they were.
- `/metrics`: Prometheus text format (`aml_app.views.metrics`).
- `/health`: a probe's answer that the web server runs; the only route open without AML_WEB_TOKEN
  (`aml_app.tokens`). The gate's own health is on the page, in the JSON and in `/metrics`.

Only GET; no secrets and no payment contents (offsets, group names and counts only). Faust's web server
starts before the tables are recovered, so while they recover the operator fields stay empty and
`recovering` says why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from faust.types import TP
from faust.web import Request, Response, View
from prometheus_client import CONTENT_TYPE_LATEST

from aml_app.app import app, settings
from aml_app.gate import GatedConsumer
from aml_app.tables.alerts import recovered_to
from aml_app.tables.watermarks import WorkerGate, watermarks
from aml_app.tables.watermarks import recovering as watermarks_recovering
from aml_app.views import metrics
from aml_app.views.page import PAGE, PAGE_HEADERS, BadQuery, check_query, parse_partitions
from aml_app.worker.detector import Detector, stats_json

if TYPE_CHECKING:
    from multidict import MultiMapping


def _assigned() -> list[int]:
    if not app.consumer:
        return []
    return sorted(
        tp.partition for tp in app.consumer.assignment() if tp.topic == settings.kafka.payments_topic
    )


def _highwaters(partitions: list[int]) -> dict[int, int | None]:
    """The log end as this worker's own fetches saw it (exact even where ListOffsets is not, on Tansu)."""
    found: dict[int, int | None] = {}
    for p in partitions:
        try:
            found[p] = app.consumer.highwater(TP(settings.kafka.payments_topic, p))
        except Exception:  # not fetched yet, or the assignment just changed: the leader's value stands
            found[p] = None
    return found


@dataclass(frozen=True)
class Shown:
    """What a worker's views show: its gate service, its gated consumer and its detector (None for a
    service without one, the probe)."""

    worker_gate: WorkerGate
    gated: GatedConsumer
    detector: Detector | None

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        assigned = _assigned()
        recovering = watermarks_recovering()
        rows = {str(p): watermarks[p] for p in sorted(watermarks.keys())}
        in_flight = {p: lane.in_flight for p, lane in self.gated.lanes.items()}
        if recovering:
            view: dict[str, Any] = {"partitions": [], "dependencies": [], "gate": None}
        else:
            view = self.worker_gate.operator_view(
                now, in_flight=in_flight, local=assigned, highwaters=_highwaters(assigned)
            )
        return {
            "worker": settings.worker_id,
            "service": settings.service,
            "app_id": settings.app_id,
            "topic": settings.kafka.payments_topic,
            "depends_on": list(settings.depends_on),
            "gate_enabled": settings.gate.enabled,
            "gate_mode": settings.gate.mode.value,
            "cut": self.worker_gate.cut_view(),
            "recovering": recovering,
            "is_leader": app.is_leader(),
            "assigned": assigned,
            "watermarks": rows,
            "waiting": {str(p): o for p, o in self.worker_gate.gate.waiting.items()},
            "blocked_since": {str(p): t for p, t in self.worker_gate.gate.blocked_since.items()},
            "in_flight": {str(p): o for p, o in in_flight.items()},
            "processed": {str(p): lane.done for p, lane in self.gated.lanes.items()},
            "payments_handled": metrics.counts.handled,
            "dead_lettered": self.gated.stats.dead_lettered,
            "decided_stale": self.gated.stats.decided_stale,
            "parked": self.gated.stats.payments_parked,
            "wait_policy": settings.gate.wait_policy.value,
            "max_attempts": settings.gate.max_attempts,
            "rebalances": self.gated.stats.rebalances,
            "refetches": self.gated.stats.refetches,
            "holes_refetched": self.gated.stats.holes_refetched,
            "gaps_accepted": self.gated.stats.gaps_accepted,
            "fetching": {
                str(p): state for p, state in self.gated.fetch_state(settings.kafka.payments_topic).items()
            },
            "refresh": {
                "last_refresh_age_s": None
                if self.worker_gate.status.last_refresh is None
                else round(time.monotonic() - self.worker_gate.status.last_refresh, 3),
                "refreshes": self.worker_gate.status.refreshes,
                "errors": self.worker_gate.status.errors,
                "last_error": self.worker_gate.status.last_error,
                "admin_requests": self.worker_gate.offsets.requests,
                "phase_s": {k: round(v, 4) for k, v in self.worker_gate.status.phase_s.items()},
                "derived_requests": self.worker_gate.offsets.derived_requests,
                "derived_records_read": self.worker_gate.offsets.derived_records_read,
                **self.worker_gate.watchdog.as_json(time.monotonic()),
            },
            "detector": None if self.detector is None else stats_json(self.detector),
            "alerts_sent": {str(p): state for p, state in recovered_to().items()},
            "retrying": self.worker_gate.retrying_everywhere(now),
            "handler_failures": self.gated.stats.handler_failures,
            "opened_by_recheck": self.worker_gate.gate.opened_by_recheck,
            "table_writes": {
                "demand": self.worker_gate.publisher.stats(),
                "watermarks": {
                    "errors": self.worker_gate.refresh_errors.count,
                    "last_error": self.worker_gate.refresh_errors.last,
                },
            },
            **view,
            "generated_at": now,
        }


def _check(request: Request, allowed: tuple[str, ...] = ()) -> None:
    # Faust types the query as a Mapping; the web driver's (aiohttp's) is a MultiDictProxy.
    query = cast("MultiMapping[str]", request.query)
    repeated = sorted(name for name in set(query) if len(query.getall(name)) > 1)
    check_query(query, allowed, repeated)


class WatermarksPage(View):
    """The operator page: one self-contained HTML document that polls `watermarks.json`."""

    async def get(self, request: Request) -> Response:
        try:
            _check(request)
        except BadQuery as exc:
            return self.error(400, str(exc))
        return self.html(PAGE, headers=dict(PAGE_HEADERS))


class WatermarksRedirect(View):
    async def get(self, request: Request) -> Response:
        # Relative, so it also works behind a proxy that serves the worker under a prefix.
        return self.text("see watermarks/\n", status=302, headers={"Location": "watermarks/"})


class Metrics(View):
    """Prometheus text format, rendered by prometheus_client from this process's registry."""

    async def get(self, request: Request) -> Response:
        try:
            _check(request)
        except BadQuery as exc:
            return self.error(400, str(exc))
        return self.bytes(metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


class Health(View):
    """For a container's or a load balancer's probe: this worker's web server answers."""

    async def get(self, request: Request) -> Response:
        return self.json({"service": settings.service, "worker": settings.worker_id})


def add_views(shown: Shown) -> None:
    """Serve `shown` on this worker's web server, and count each admission and refresh in `/metrics`."""
    shown.gated.observers.append(metrics.observe_admission)
    shown.worker_gate.status.duration_observers.append(metrics.observe_refresh)
    metrics.register_snapshot(shown.snapshot, settings.service)

    @app.page("/watermarks.json")
    class WatermarksJson(View):
        """The watermark table and this worker's gate, as JSON; `?partition=0,2` keeps only those
        partitions."""

        async def get(self, request: Request) -> Response:
            try:
                _check(request, ("partition",))
                doc = shown.snapshot()
                raw = request.query.get("partition")
                if raw is not None:
                    chosen = parse_partitions(raw, set(watermarks.keys()))
                    doc["partitions"] = [p for p in doc["partitions"] if p["partition"] in chosen]
            except BadQuery as exc:
                return self.error(400, str(exc))
            return self.json(doc)

    app.page("/watermarks/")(WatermarksPage)
    app.page("/watermarks")(WatermarksRedirect)
    app.page("/metrics")(Metrics)
    app.page("/health")(Health)
