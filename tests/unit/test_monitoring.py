"""The operator's monitoring kit in docker/monitoring: the Grafana dashboard and the Prometheus alerting
rules query only metrics a worker, an API replica or the pipeline publishes, with labels they set;
`promtool` accepts the rules and every dashboard query, and the rules' own unit tests pass (each alert
fires once per service on the series that should raise it, not on a healthy worker)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import ProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from aml_app.dependencies.answer_cache import AnswerCache
from aml_app.dependencies.api_metrics import ApiMetrics
from aml_app.enrichment import StageMetrics
from aml_app.pipeline.jobs import BatchReport
from aml_app.pipeline.metrics import PipelineMetrics
from aml_app.views import metrics
from tests.unit.test_operator_views import DETECTOR, RETRYING, snapshot

ROOT = Path(__file__).parents[2]
KIT = ROOT / "docker" / "monitoring"
RULES, RULE_TESTS, DASHBOARD = (
    KIT / "prometheus-rules.yml",
    KIT / "prometheus-rules.test.yml",
    KIT / "grafana-dashboard.json",
)
NAME = re.compile(r"\b((?:aml|process)_[a-z_]+)\b")
BY = re.compile(r"\bby \(([^)]*)\)")
#: Labels the workers and APIs set, Prometheus's own (instance, job) and the histograms' bucket bound.
LABELS = {"service", "partition", "dependency", "status", "route", "result", "phase", "instance", "job", "le"}


def published() -> set[str]:
    """Every series name the /metrics of a worker, an API replica, the pipeline or the stage can show."""
    snap = {**snapshot(detector={**DETECTOR, "decided_on_pruned": 0}), "retrying": [RETRYING]}
    names = set()
    for family in metrics.families(snap, 7):
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    for histogram in ("aml_gate_wait_seconds", "aml_admin_refresh_seconds"):
        names |= {f"{histogram}_{suffix}" for suffix in ("bucket", "sum", "count")}
    for family in ProcessCollector(registry=CollectorRegistry()).collect():
        names |= {sample.name for sample in family.samples}

    class Behind:
        state = "behind"

    api = ApiMetrics("relations", AnswerCache(1), Behind())
    api.requests.labels("relations", "POST /relations", "200").inc()
    api.seconds.labels("relations", "POST /relations").observe(0.1)
    api.saw_not_yet()
    names |= {s.name for f in text_string_to_metric_families(api.render().decode()) for s in f.samples}
    pipeline = PipelineMetrics()
    pipeline.observe(BatchReport("relations", 1, 10, 10, 1, {0: 10}, 0.5, {"spark": 0.4, "store": 0.1}))
    pipeline.restarts.labels("relations").inc()
    names |= {s.name for f in pipeline.registry.collect() for s in f.samples}
    stage: Any = SimpleNamespace(derived=1, dead_lettered=0, transactions=1, aborted=0, last_progress=0.0)
    names |= {s.name for f in StageMetrics(stage).registry.collect() for s in f.samples}
    return names


def rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_query_names_published_metrics_and_labels(source: str) -> None:
    expressions = rule_expressions() if source == "rules" else dashboard_expressions()
    assert len(expressions) >= 10
    known = published()
    unknown = sorted({name for e in expressions for name in NAME.findall(e)} - known)
    assert unknown == [], f"{source} query metrics no worker publishes: {unknown}"
    grouped = {label.strip() for e in expressions for group in BY.findall(e) for label in group.split(",")}
    assert grouped <= LABELS, grouped - LABELS


def test_the_dashboard_covers_what_an_operator_watches() -> None:
    queried = {name for e in dashboard_expressions() for name in NAME.findall(e)}
    watched = {
        "aml_gate_wait_seconds_bucket",
        "aml_decisions_total",
        "aml_payments_waiting",
        "aml_dependency_lag",
        "aml_dependency_status",
        "aml_watermark",
        "aml_log_end_offset",
        "aml_admin_refresh_seconds_bucket",
        "aml_refresh_stuck",
        "aml_payment_retrying_attempts",
        "aml_dead_lettered_total",
        "aml_freshness_violations_total",
    }
    assert watched <= queried, watched - queried
    variables = {v["name"] for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert variables == {"datasource", "service"}


def test_every_alert_has_a_severity_a_summary_and_a_rule_test() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {rule["alert"]: rule for group in groups for rule in group["rules"]}
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("page", "ticket"), name
        # A target that is down has no `service`: Prometheus's own `up` names its job.
        label = "job" if name == "AmlTargetDown" else "service"
        assert f"{{{{ $labels.{label} }}}}" in rule["annotations"]["summary"], name
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
    }
    paging = {name for name, rule in alerts.items() if rule["labels"]["severity"] == "page"}
    assert paging - {"AmlAdminError", "AmlDependencyUnknown"} <= tested


def promtool() -> str:
    found = shutil.which("promtool") or (ROOT / "var" / "tools" / "promtool")
    assert Path(found).exists(), "promtool is missing: .ci/system-deps takes it from Debian's packages"
    return str(found)


def test_promtool_accepts_the_rules_and_their_unit_tests_pass() -> None:
    tool = promtool()
    for args in (["check", "rules", RULES.name], ["test", "rules", RULE_TESTS.name]):
        done = subprocess.run([tool, *args], cwd=KIT, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each query as a recording rule, Grafana's variables given values: `promtool check rules` parses it."""
    tool = promtool()
    rules = [
        {
            "record": f"dashboard:query{i}",
            "expr": e.replace("$__rate_interval", "5m").replace("$service", ".*"),
        }
        for i, e in enumerate(dashboard_expressions())
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
