"""Read-only views served by every worker on Faust's web server.

`/watermarks.json` is this worker's view of the shared watermark table plus its own gate state. The
HTML page and the operator fields come with the web-view issue; the field names here are kept stable.
"""

from __future__ import annotations

import time
from typing import Any

from faust.web import Request, Response, View

from aml_app import detector, service
from aml_app.app import app, settings
from tables.watermarks import gate, offsets, status, watermarks


def snapshot() -> dict[str, Any]:
    now = time.time()
    gated = service.running[0]
    assigned = (
        sorted(tp.partition for tp in app.consumer.assignment() if tp.topic == settings.payments_topic)
        if app.consumer
        else []
    )
    rows = {str(p): watermarks[p] for p in sorted(watermarks.keys())}
    return {
        "worker": settings.worker_id,
        "service": settings.service,
        "app_id": settings.app_id,
        "topic": settings.payments_topic,
        "depends_on": list(settings.depends_on),
        "gate_enabled": settings.gate_enabled,
        "recovering": bool(app.in_recovery) or not app.tables.recovery.completed.is_set(),
        "is_leader": app.is_leader(),
        "assigned": assigned,
        "watermarks": rows,
        "waiting": {str(p): o for p, o in gate.waiting.items()},
        "blocked_since": {str(p): t for p, t in gate.blocked_since.items()},
        "in_flight": {str(p): lane.in_flight for p, lane in gated.lanes.items()},
        "processed": {str(p): lane.done for p, lane in gated.lanes.items()},
        "dead_lettered": gated.dead_lettered,
        "rebalances": gated.rebalances,
        "refetches": gated.refetches,
        "refresh": {
            "last_refresh_age_s": None
            if status.last_refresh is None
            else round(time.monotonic() - status.last_refresh, 3),
            "refreshes": status.refreshes,
            "errors": status.errors,
            "last_error": status.last_error,
            "admin_requests": offsets.requests,
        },
        "detector": detector.stats_json(detector.running[0]) if detector.running else None,
        "generated_at": now,
    }


@app.page("/watermarks.json")
class WatermarksJson(View):
    async def get(self, request: Request) -> Response:
        return self.json(snapshot())
