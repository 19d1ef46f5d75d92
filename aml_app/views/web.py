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

import importlib
import time
from typing import TYPE_CHECKING, Any, cast

from faust.types import TP
from faust.web import Request, Response, View
from prometheus_client import CONTENT_TYPE_LATEST

from aml_app.app import app, settings
from aml_app.gate import GatedConsumer
from aml_app.tables.alerts import recovered_to
from aml_app.tables.watermarks import recovering as watermarks_recovering
from aml_app.tables.watermarks import watermarks, worker_gate
from aml_app.views import metrics
from aml_app.views.page import PAGE, PAGE_HEADERS, BadQuery, check_query, parse_partitions
from aml_app.worker import detector

if TYPE_CHECKING:
    from multidict import MultiMapping

# The service's agent module registers its gated consumer; make sure it exists before hooking into it.
service_module = importlib.import_module(f"aml_app.agents.{settings.service}")


def _registered() -> GatedConsumer:
    if worker_gate.consumer is None:
        raise RuntimeError(f"aml_app.agents.{settings.service} registered no gated agent (gated_agent)")
    return worker_gate.consumer


gated = _registered()
#: The detecting services' handler (None for a service without one, the probe).
running_detector: detector.Detector | None = getattr(service_module, "detector", None)
gate, status, publisher = worker_gate.gate, worker_gate.status, worker_gate.publisher
gated.observers.append(metrics.observe_admission)
status.duration_observers.append(metrics.observe_refresh)


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


def snapshot() -> dict[str, Any]:
    now = time.time()
    assigned = _assigned()
    recovering = watermarks_recovering()
    rows = {str(p): watermarks[p] for p in sorted(watermarks.keys())}
    in_flight = {p: lane.in_flight for p, lane in gated.lanes.items()}
    if recovering:
        view: dict[str, Any] = {"partitions": [], "dependencies": [], "gate": None}
    else:
        view = worker_gate.operator_view(
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
        "cut": worker_gate.cut_view(),
        "recovering": recovering,
        "is_leader": app.is_leader(),
        "assigned": assigned,
        "watermarks": rows,
        "waiting": {str(p): o for p, o in gate.waiting.items()},
        "blocked_since": {str(p): t for p, t in gate.blocked_since.items()},
        "in_flight": {str(p): o for p, o in in_flight.items()},
        "processed": {str(p): lane.done for p, lane in gated.lanes.items()},
        "payments_handled": metrics.counts.handled,
        "dead_lettered": gated.stats.dead_lettered,
        "decided_stale": gated.stats.decided_stale,
        "parked": gated.stats.payments_parked,
        "wait_policy": settings.gate.wait_policy.value,
        "max_attempts": settings.gate.max_attempts,
        "rebalances": gated.stats.rebalances,
        "refetches": gated.stats.refetches,
        "holes_refetched": gated.stats.holes_refetched,
        "gaps_accepted": gated.stats.gaps_accepted,
        "fetching": {str(p): state for p, state in gated.fetch_state(settings.kafka.payments_topic).items()},
        "refresh": {
            "last_refresh_age_s": None
            if status.last_refresh is None
            else round(time.monotonic() - status.last_refresh, 3),
            "refreshes": status.refreshes,
            "errors": status.errors,
            "last_error": status.last_error,
            "admin_requests": worker_gate.offsets.requests,
            "derived_requests": worker_gate.offsets.derived_requests,
            "derived_records_read": worker_gate.offsets.derived_records_read,
            **worker_gate.watchdog.as_json(time.monotonic()),
        },
        "detector": None if running_detector is None else detector.stats_json(running_detector),
        "alerts_sent": {str(p): state for p, state in recovered_to().items()},
        "retrying": worker_gate.retrying_everywhere(now),
        "handler_failures": gated.stats.handler_failures,
        "opened_by_recheck": gate.opened_by_recheck,
        "table_writes": {
            "demand": publisher.stats(),
            "watermarks": {
                "errors": worker_gate.refresh_errors.count,
                "last_error": worker_gate.refresh_errors.last,
            },
        },
        **view,
        "generated_at": now,
    }


metrics.register_snapshot(snapshot, settings.service)


def _check(request: Request, allowed: tuple[str, ...] = ()) -> None:
    # Faust types the query as a Mapping; the web driver's (aiohttp's) is a MultiDictProxy.
    query = cast("MultiMapping[str]", request.query)
    repeated = sorted(name for name in set(query) if len(query.getall(name)) > 1)
    check_query(query, allowed, repeated)


@app.page("/watermarks.json")
class WatermarksJson(View):
    """The watermark table and this worker's gate, as JSON; `?partition=0,2` keeps only those partitions."""

    async def get(self, request: Request) -> Response:
        try:
            _check(request, ("partition",))
            doc = snapshot()
            raw = request.query.get("partition")
            if raw is not None:
                chosen = parse_partitions(raw, set(watermarks.keys()))
                doc["partitions"] = [p for p in doc["partitions"] if p["partition"] in chosen]
        except BadQuery as exc:
            return self.error(400, str(exc))
        return self.json(doc)


@app.page("/watermarks/")
class WatermarksPage(View):
    """The operator page: one self-contained HTML document that polls `watermarks.json`."""

    async def get(self, request: Request) -> Response:
        try:
            _check(request)
        except BadQuery as exc:
            return self.error(400, str(exc))
        return self.html(PAGE, headers=dict(PAGE_HEADERS))


@app.page("/watermarks")
class WatermarksRedirect(View):
    async def get(self, request: Request) -> Response:
        # Relative, so it also works behind a proxy that serves the worker under a prefix.
        return self.text("see watermarks/\n", status=302, headers={"Location": "watermarks/"})


@app.page("/metrics")
class Metrics(View):
    """Prometheus text format, rendered by prometheus_client from this process's registry."""

    async def get(self, request: Request) -> Response:
        try:
            _check(request)
        except BadQuery as exc:
            return self.error(400, str(exc))
        return self.bytes(metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


@app.page("/health")
class Health(View):
    """For a container's or a load balancer's probe: this worker's web server answers."""

    async def get(self, request: Request) -> Response:
        return self.json({"service": settings.service, "worker": settings.worker_id})
