"""The pieces of the operator views that need no worker: the metric families (parsed back with the
Prometheus client's own parser), query checking, the page's self-containment, the status table, the
gated consumer's observer hook."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from aml_app.gate import Admission
from aml_app.gate.health import Limits, describe
from aml_app.gate.watermark import REFRESH_PHASES, build_rows
from aml_app.views import metrics
from aml_app.views.page import PAGE, PAGE_HEADERS, BadQuery, check_query, parse_partitions
from aml_app.views.status import render, worker_json_url
from tests.unit.test_lanes import Harness, event, until

NOW = 5000.0
LIMITS = Limits(30, 1000, max_wait=30)


def snapshot(*, detector: dict[str, Any] | None = None, recovering: bool = False) -> dict[str, Any]:
    rows = build_rows(
        [0, 1],
        {"rel": {0: 3, 1: 8}, "agg": {0: 5, 1: None}},
        NOW - 40,
        log_ends={0: 10, 1: 8},
        service_committed={0: 3, 1: 0},
    )
    view = describe(
        rows,
        ["rel", "agg"],
        NOW,
        Limits(30, 1000, max_wait=30),
        waiting={0: 3},
        blocked_since={0: NOW - 35},
        untrusted={1: "the row is 40.0 s old (more than 5 s): the leader has not refreshed it"},
    )
    if recovering:
        view = {"partitions": [], "dependencies": [], "gate": None}
    return {
        "worker": "w1",
        "service": "probe",
        "app_id": "aml",
        "topic": "payments",
        "depends_on": ["rel", "agg"],
        "recovering": recovering,
        "is_leader": True,
        "dead_lettered": 2,
        "rebalances": 1,
        "refresh": {
            "errors": 4,
            "admin_requests": 99,
            "phase_s": {"offsets": 1.5, "log_identity": 0.25, "event_time_cut": 0.75},
        },
        "detector": detector,
        **view,
        "generated_at": NOW,
    }


def parse(snap: dict[str, Any], handled: int = 7) -> dict[str, Any]:
    class Once(Collector):
        def collect(self) -> Iterable[Metric]:
            return metrics.families(snap, handled)

    registry = CollectorRegistry()
    registry.register(Once())
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Any], name: str, **labels: str) -> float:
    """The one sample of `name` with `labels` (and the snapshot's service, unless given)."""
    family = families[name.removesuffix("_total")]
    labels = {"service": "probe", **labels}
    found = [s.value for s in family.samples if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, family.samples)
    return found[0]


def test_metric_families_parse_with_their_values() -> None:
    fams = parse(snapshot())
    assert value(fams, "aml_watermark", partition="0") == 3
    assert value(fams, "aml_watermark", partition="1") == 0
    assert value(fams, "aml_log_end_offset", partition="0") == 10
    assert value(fams, "aml_service_committed_offset", partition="0") == 3
    assert value(fams, "aml_payments_waiting", partition="0") == 7
    assert value(fams, "aml_dependency_committed_offset", dependency="agg", partition="0") == 5
    assert value(fams, "aml_dependency_lag", dependency="rel", partition="0") == 7
    assert value(fams, "aml_dependency_stalled", dependency="rel") == 1  # 40 s quiet, payment 0:3 waits
    assert value(fams, "aml_dependency_stalled", dependency="agg") == 0
    assert value(fams, "aml_dependency_status", dependency="rel", status="stalled") == 1
    assert value(fams, "aml_dependency_status", dependency="rel", status="ok") == 0
    assert value(fams, "aml_dependency_status", dependency="agg", status="lagging") == 1  # 8 behind on 1
    assert value(fams, "aml_dependency_last_advance_timestamp_seconds", dependency="rel") == NOW - 40
    assert value(fams, "aml_blocked_partitions") == 1
    assert value(fams, "aml_untrusted_partitions") == 1
    assert value(fams, "aml_wait_breached_partitions") == 1  # waited 35 s, the bound is 30
    assert value(fams, "aml_longest_wait_seconds") == 35
    assert value(fams, "aml_refresh_age_seconds") == 40
    assert value(fams, "aml_admin_error") == 0
    assert value(fams, "aml_recovering") == 0 and value(fams, "aml_is_leader") == 1
    assert value(fams, "aml_decisions_total") == 7  # no detector: the payments handled
    assert value(fams, "aml_payments_handled_total") == 7
    assert value(fams, "aml_dead_lettered_total") == 2
    assert value(fams, "aml_admin_refresh_errors_total") == 4
    assert value(fams, "aml_admin_requests_total") == 99
    assert value(fams, "aml_admin_refresh_phase_seconds_total", phase="offsets") == 1.5
    assert value(fams, "aml_admin_refresh_phase_seconds_total", phase="log_identity") == 0.25
    assert value(fams, "aml_admin_refresh_phase_seconds_total", phase="event_time_cut") == 0.75
    assert fams["aml_decisions"].type == "counter" and fams["aml_watermark"].type == "gauge"
    assert "aml_alerts" not in fams and "aml_freshness_violations" not in fams  # no detector, no lie


RETRYING = {
    "partition": 1,
    "offset": 7,
    "payments": 1,
    "attempts": 4,
    "error": "ClientResponseError: 404, message='Not Found'",
    "since": NOW - 90,
    "retrying_for_s": 90.0,
    "worker": "w2",
}


def test_a_payment_that_keeps_failing_is_a_metric_of_its_partition_without_unbounded_labels() -> None:
    fams = parse({**snapshot(), "retrying": [RETRYING], "handler_failures": 4})
    assert value(fams, "aml_payment_retrying_attempts", partition="1") == 4
    assert value(fams, "aml_payment_retrying_offset", partition="1") == 7
    assert value(fams, "aml_payment_retrying_seconds", partition="1") == 90
    assert value(fams, "aml_handler_failures_total") == 4
    for name in (
        "aml_payment_retrying_attempts",
        "aml_payment_retrying_offset",
        "aml_payment_retrying_seconds",
    ):
        assert parse(snapshot())[name].samples == []  # nothing fails: no sample


def test_every_series_names_its_service_and_no_label_is_unbounded() -> None:
    """AML and fraud workers publish the same names: the service label tells them apart. The labels a
    worker may use take values from small sets (partitions, dependency groups, statuses, a refresh's
    phases, services)."""
    for service in ("aml", "fraud"):
        snap = {**snapshot(detector=DETECTOR), "service": service, "retrying": [RETRYING]}
        samples = [s for family in parse(snap).values() for s in family.samples]
        assert samples and all(s.labels["service"] == service for s in samples)
        labels = {key for s in samples for key in s.labels}
        assert labels <= {"service", "partition", "dependency", "status", "phase"}
        phases = {s.labels["phase"] for s in samples if "phase" in s.labels}
        assert phases <= set(REFRESH_PHASES)


def test_status_shows_the_retrying_payments() -> None:
    lines = render({**snapshot(), "source": "worker", "retrying": [RETRYING]}).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("retrying"))
    assert lines[at + 1].split() == [
        "PARTITION",
        "OFFSET",
        "PAYMENTS",
        "ATTEMPTS",
        "SINCE",
        "WORKER",
        "ERROR",
    ]
    assert lines[at + 2].split()[:7] == ["1", "7", "1", "4", "90s", "ago", "w2"]
    assert lines[at + 2].endswith(RETRYING["error"])
    assert not any(
        line.startswith("retrying") for line in render({**snapshot(), "source": "worker"}).splitlines()
    )


DETECTOR = {
    "decisions": 11,
    "alerts": 3,
    "freshness_violations": 1,
    "dependency_not_yet": 4,
    "dependency_went_back": 2,
}


def test_detector_counters_when_a_detector_runs() -> None:
    fams = parse(snapshot(detector=DETECTOR))
    assert value(fams, "aml_dependency_not_yet_total") == 4
    assert value(fams, "aml_dependency_went_back_total") == 2
    assert value(fams, "aml_decisions_total") == 11
    assert value(fams, "aml_alerts_total") == 3
    assert value(fams, "aml_freshness_violations_total") == 1


def test_recovering_has_no_per_partition_samples() -> None:
    fams = parse(snapshot(recovering=True))
    assert value(fams, "aml_recovering") == 1
    assert fams["aml_watermark"].samples == []
    assert fams["aml_dependency_status"].samples == []


def test_process_registry_renders_and_the_wait_histogram_counts_admissions() -> None:
    before = metrics.counts.handled
    metrics.observe_admission(Admission(0, 5, 6, {"rel": 6}, waited_ms=1500.0, gated=True))
    assert metrics.counts.handled == before + 1
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    hist = fams["aml_gate_wait_seconds"]
    assert hist.type == "histogram"
    assert {s.labels["service"] for s in hist.samples} == {metrics.service["service"]}
    buckets = {s.labels["le"]: s.value for s in hist.samples if s.name.endswith("_bucket")}
    assert buckets["1.0"] == buckets["0.005"]  # 1.5 s lands above 1 s ...
    assert buckets["2.5"] >= buckets["1.0"] + 1  # ... and within 2.5 s
    assert "aml_admin_refresh_seconds" in fams


# --- query parameters ---------------------------------------------------------------------------


def test_check_query() -> None:
    check_query({}, ())
    check_query({"partition": "1"}, ("partition",))
    with pytest.raises(BadQuery, match=r"unknown query parameter 'x'.*accepts only partition"):
        check_query({"x": "1"}, ("partition",))
    with pytest.raises(BadQuery, match="takes no query parameter"):
        check_query({"refresh": "1"}, ())
    with pytest.raises(BadQuery, match="more than once"):
        check_query({"partition": "1"}, ("partition",), repeated=["partition"])


def test_parse_partitions() -> None:
    assert parse_partitions("0,2", {0, 1, 2, 3}) == [0, 2]
    assert parse_partitions(" 3 , 3", {0, 1, 2, 3}) == [3]
    for bad in ("", "a", "-1", "1.5", "0,,1", "\u0661"):  # the last: an Arabic-Indic digit one
        with pytest.raises(BadQuery, match="not a comma-separated list"):
            parse_partitions(bad, {0, 1})
    with pytest.raises(BadQuery, match=r"partition 7 is not a partition of the topic \(it has 0..3\)"):
        parse_partitions("7", {0, 1, 2, 3})


# --- the page -----------------------------------------------------------------------------------


def test_page_is_self_contained() -> None:
    assert not re.search(r"(https?:)?//[a-z0-9]", PAGE, re.IGNORECASE), "the page names an external URL"
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(", PAGE, re.IGNORECASE)
    assert 'fetch("../watermarks.json"' in PAGE
    assert "innerHTML" not in PAGE  # values are written as text, never as markup
    assert "default-src 'none'" in PAGE_HEADERS["Content-Security-Policy"]


# --- aml-app status -----------------------------------------------------------------------------


def test_worker_json_url() -> None:
    assert worker_json_url("127.0.0.1:6066") == "http://127.0.0.1:6066/watermarks.json"
    assert worker_json_url("http://h:1/") == "http://h:1/watermarks.json"
    assert worker_json_url("https://h/x/watermarks.json") == "https://h/x/watermarks.json"


def test_render_table_aligns_columns() -> None:
    doc = {**snapshot(), "source": "worker"}
    lines = render(doc).splitlines()
    assert lines[0].startswith("topic payments, service group aml: as worker w1 sees it (the leader)")
    header, first, second = lines[2], lines[3], lines[4]
    assert header.split() == [
        "PARTITION",
        "LOG-END",
        "COMMITTED",
        "IN-FLIGHT",
        "rel",
        "agg",
        "WATERMARK",
        "WAITING",
        "WAITING-AT",
        "BLOCKED-SINCE",
        "BOTTLENECK",
    ]
    assert first.split() == ["0", "10", "3", "-", "3", "5", "3", "7", "3", "35s", "ago", "rel"]
    assert second.split() == ["1", "8", "0", "-", "8", "0", "0", "8", "-", "-", "agg"]
    # aligned: every value starts exactly where its column's header starts
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    for line in (first, second):
        assert all(line[i] != " " and (i == 0 or line[i - 1] == " ") for i in starts), line
    deps = lines[6:]
    assert deps[0].split()[:2] == ["DEPENDENCY", "STATUS"]
    assert deps[1].split()[:2] == ["rel", "stalled"]
    assert deps[2].split()[:2] == ["agg", "lagging"]


def test_render_recovering_and_empty() -> None:
    assert "still recovering" in render({**snapshot(recovering=True), "source": "worker"})
    broker_doc = {**snapshot(), "source": "broker", "bootstrap_servers": ["b:9092"], "partitions": []}
    assert "no watermark yet" in render(broker_doc)


def test_render_says_why_the_gate_is_closed_where_the_dependencies_are_not_to_blame() -> None:
    """A distrusted row or cut, and the leader's failing first refresh, were in the document only."""
    doc = {**snapshot(), "source": "worker"}
    doc["cut"] = {"untrusted": "the row was written in consumer generation 2, before this worker's 3"}
    text = render(doc)
    assert "partition 1: the row is 40.0 s old (more than 5 s): the leader has not refreshed it" in text
    assert "event-time cut distrusted, the gate admits nothing: the row was written in consumer" in text
    doc["cut"] = {"untrusted": None, "unread": [2, 3]}
    assert "event-time cut: partitions 2, 3 could not be read; the gate admits nothing" in render(doc)
    empty = {**doc, "partitions": [], "refresh": {"last_error": "topic 'payments' does not exist (yet)"}}
    lines = render(empty).splitlines()
    assert lines[1:] == [
        "this worker's last offset refresh failed: topic 'payments' does not exist (yet)",
        "no watermark yet: the leader has not written the table",
    ]


def test_a_failing_refresh_before_any_row_raises_the_admin_error_metric() -> None:
    """The rows carry a refresh's error to every worker, but there are none before the first success."""
    empty = {
        **snapshot(),
        "partitions": [],
        "dependencies": [],
        "gate": describe({}, [], NOW, LIMITS)["gate"],
    }
    assert value(parse(empty), "aml_admin_error") == 0
    empty["refresh"] = {**empty["refresh"], "last_error": "topic 'payments' does not exist (yet)"}
    assert value(parse(empty), "aml_admin_error") == 1


# --- the gated consumer's observer hook ---------------------------------------------------------


async def test_observers_see_each_handled_payment_once_and_cannot_break_a_lane() -> None:
    h = Harness()
    seen: list[tuple[int, int]] = []

    def broken(admission: Admission) -> None:
        raise RuntimeError("telemetry bug")

    h.gated.observers.extend([broken, lambda a: seen.append((a.partition, a.offset))])
    h.failures[(0, 1)] = 2  # retried twice: still one observation
    try:
        h.open(0, 100)
        h.dispatch(event(0, 0), event(0, 1), event(0, 2))
        await until(lambda: len(h.acks) == 3, "three payments acked")
        assert seen == [(0, 0), (0, 1), (0, 2)]
        assert h.violations == []
    finally:
        await h.close()
        await asyncio.sleep(0)


def test_the_operating_guide_lists_every_metric_a_worker_publishes() -> None:
    from pathlib import Path

    guide = (Path(__file__).parents[2] / "docs" / "operating.md").read_text()
    snap = {**snapshot(detector={**DETECTOR, "decided_on_pruned": 0}), "retrying": [RETRYING]}
    names = {family.name for family in metrics.families(snap, 7)}
    names |= {"aml_gate_wait_seconds", "aml_admin_refresh_seconds"}
    shown = {name + ("_total" if family.type == "counter" else "") for name, family in parse(snap).items()}
    missing = sorted(n for n in shown | names if f"`{n}`" not in guide and f"`{n}_total`" not in guide)
    assert missing == [], f"docs/operating.md does not list {missing}"


def test_a_distrusted_or_partly_read_cut_is_a_metric() -> None:
    assert value(parse(snapshot()), "aml_cut_untrusted") == 0
    assert value(parse({**snapshot(), "cut": {"untrusted": None, "unread": []}}), "aml_cut_untrusted") == 0
    assert (
        value(parse({**snapshot(), "cut": {"untrusted": "the row is 9.0 s old"}}), "aml_cut_untrusted") == 1
    )
    assert value(parse({**snapshot(), "cut": {"untrusted": None, "unread": [2]}}), "aml_cut_untrusted") == 1
