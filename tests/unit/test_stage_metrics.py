"""The enrichment stage's /metrics: its counters as they stand at each scrape, behind the web token, and
/health open (what the compose file's health check asks)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

from aml_app.enrichment import StageMetrics
from aml_app.kafka.broker import free_port
from aml_app.metrics_server import serve_metrics
from aml_app.tokens import bearer
from tests.unit.test_tokens import ask

TOKEN = "a-stage-metrics-token-" + "y" * 20


def samples(text: str) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        if line.startswith("aml_enrichment_"):
            name, value = line.rsplit(" ", 1)
            assert name.endswith('{service="enrichment"}'), name
            found[name.split("{")[0]] = float(value)
    return found


def test_each_scrape_reads_the_stages_counters_now() -> None:
    stage: Any = SimpleNamespace(derived=3, dead_lettered=1, transactions=2, aborted=0, last_progress=100.0)
    port = free_port()
    server = serve_metrics(StageMetrics(stage).registry, "enrichment", "127.0.0.1", port, TOKEN)
    try:
        assert ask(port, "/metrics", {})[0] == 401
        assert ask(port, "/health", {}) == (200, json.dumps({"service": "enrichment"}).encode())
        status, body = ask(port, "/metrics", bearer(TOKEN))
        assert status == 200
        assert samples(body.decode()) == {
            "aml_enrichment_payments_derived_total": 3.0,
            "aml_enrichment_dead_lettered_total": 1.0,
            "aml_enrichment_transactions_total": 2.0,
            "aml_enrichment_aborted_total": 0.0,
            "aml_enrichment_last_progress_timestamp_seconds": 100.0,
        }
        stage.derived, stage.aborted, stage.last_progress = 10, 1, time.time()
        now = samples(ask(port, "/metrics", bearer(TOKEN))[1].decode())
        assert now["aml_enrichment_payments_derived_total"] == 10.0
        assert now["aml_enrichment_aborted_total"] == 1.0
        assert now["aml_enrichment_last_progress_timestamp_seconds"] == stage.last_progress
    finally:
        server.shutdown()
        server.server_close()
