"""Prometheus metrics of one worker process, rendered by prometheus_client for `/metrics`.

Two kinds: what happens in this process (the gate wait of each payment, the leader's admin refresh
latency) is observed as it happens into histograms; everything else is read at scrape time from the same
snapshot as `/watermarks.json` by a custom collector, so the page and the metrics never disagree. Values
that come from the shared watermark table are the same on every worker (aggregate them with `max`);
counters of this worker's own work (decisions, dead letters, waits) add up over workers (`sum`).

Every series carries a `service` label (`AML_SERVICE`: aml, fraud, ...): the services' workers publish
the same names, and one dashboard tells them apart by it. No label takes values without bound: a payment
retried in place is shown per partition, its offset and attempts as values and its error on the page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aml_app.gate import Admission
from aml_app.gate.health import STALLED, STATUSES, cut_closed

#: One registry per worker process (not the library's global one, which other code may fill).
registry = CollectorRegistry()
ProcessCollector(registry=registry)

#: Seconds from a payment's arrival at the worker to the start of its processing: the gate's cost.
gate_wait = Histogram(
    "aml_gate_wait_seconds",
    "Time each payment was held before processing (arrival at this worker to the handler start).",
    ["service"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    registry=registry,
)
admin_refresh = Histogram(
    "aml_admin_refresh_seconds",
    "Duration of the leader's watermark refreshes (the admin reads and the event-time cut's fetch; "
    "failed and abandoned ones included).",
    ["service"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=registry,
)


@dataclass
class Counts:
    """This worker's own counts that no other component keeps."""

    handled: int = 0


counts = Counts()
#: The `service` label of this process's histograms, set by `register_snapshot`.
service = {"service": "aml"}


def observe_admission(admission: Admission) -> None:
    """The gated consumer's observer: one call per payment its handler finished."""
    gate_wait.labels(**service).observe(admission.waited_ms / 1000)
    counts.handled += 1


def observe_refresh(seconds: float) -> None:
    """The leader's observer of each watermark refresh's duration."""
    admin_refresh.labels(**service).observe(seconds)


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def families(snap: Mapping[str, Any], handled_total: float) -> list[Metric]:
    """The metric families of one `/watermarks.json` snapshot (pure: unit-tested without a worker)."""
    recovering = _gauge("aml_recovering", "1 while this worker's tables are still recovering.")
    recovering.add_metric([], 1 if snap["recovering"] else 0)
    leader = _gauge("aml_is_leader", "1 on the worker that refreshes the watermark table.")
    leader.add_metric([], 1 if snap["is_leader"] else 0)

    by_p, by_dp = ["partition"], ["dependency", "partition"]
    per_partition = {
        "watermark": _gauge("aml_watermark", "W(p): min of the dependencies' committed offsets.", by_p),
        "log_end": _gauge("aml_log_end_offset", "Log-end offset of the payments partition.", by_p),
        "service_committed": _gauge("aml_service_committed_offset", "This service's committed offset.", by_p),
        "payments_waiting": _gauge(
            "aml_payments_waiting", "Payments the gate holds back: [max(W, committed), log end).", by_p
        ),
    }
    dep_committed = _gauge("aml_dependency_committed_offset", "A dependency group's committed offset.", by_dp)
    dep_lag = _gauge("aml_dependency_lag", "Records a dependency group is behind the log end.", by_dp)
    for part in snap["partitions"]:
        p = str(part["partition"])
        for field, family in per_partition.items():
            if part[field] is not None:
                family.add_metric([p], part[field])
        for group, committed in part["dependencies"].items():
            dep_committed.add_metric([group, p], committed)
            if part["dependency_lag"].get(group) is not None:
                dep_lag.add_metric([group, p], part["dependency_lag"][group])

    status = _gauge(
        "aml_dependency_status",
        "1 for the dependency's current status (ok, lagging, stalled, unknown group, error), else 0.",
        ["dependency", "status"],
    )
    stalled = _gauge("aml_dependency_stalled", "1 while the dependency is stalled.", ["dependency"])
    advanced = _gauge(
        "aml_dependency_last_advance_timestamp_seconds",
        "When the dependency's committed offset last moved on any partition (Unix time).",
        ["dependency"],
    )
    for dep in snap["dependencies"]:
        for name in STATUSES:
            status.add_metric([dep["group"], name], 1 if dep["status"] == name else 0)
        stalled.add_metric([dep["group"]], 1 if dep["status"] == STALLED else 0)
        if dep["last_advance"] is not None:
            advanced.add_metric([dep["group"]], dep["last_advance"])

    gate = snap["gate"] or {}
    blocked = _gauge("aml_blocked_partitions", "Partitions where a payment waits at the gate (any worker).")
    blocked.add_metric([], len(gate.get("blocked_partitions") or []))
    untrusted = _gauge(
        "aml_untrusted_partitions",
        "Partitions whose watermark row this worker does not trust (too old, from before its consumer "
        "generation, or of another log): its gate stays closed there whatever the watermark.",
    )
    untrusted.add_metric([], len(gate.get("untrusted_partitions") or []))
    cut_untrusted = _gauge(
        "aml_cut_untrusted",
        "1 while this worker does not trust the event-time cut, or the cut could not read a partition: its "
        "gate admits nothing.",
    )
    cut_untrusted.add_metric([], 1 if cut_closed(snap.get("cut")) else 0)
    breached = _gauge(
        "aml_wait_breached_partitions",
        "Partitions where a payment has waited at the gate longer than AML_MAX_WAIT (any worker).",
    )
    breached.add_metric([], len(gate.get("breached_partitions") or []))
    longest = _gauge(
        "aml_longest_wait_seconds", "How long the longest-waiting payment has waited at the gate."
    )
    longest.add_metric([], gate.get("longest_wait_s") or 0.0)
    age = _gauge("aml_refresh_age_seconds", "Age of the newest watermark row.")
    if gate.get("refresh_age_s") is not None:
        age.add_metric([], gate["refresh_age_s"])
    refresh = snap["refresh"]
    admin_error = _gauge("aml_admin_error", "1 while the last watermark refresh failed.")
    # The rows carry the error to every worker; the leader's own, before it has written any row.
    admin_error.add_metric([], 1 if gate.get("admin_error") or refresh.get("last_error") else 0)
    stuck = _gauge(
        "aml_refresh_stuck",
        "1 on the leader while it has completed no watermark refresh for longer than it may "
        "(it rebuilds its Kafka clients, then leaves its group).",
    )
    stuck.add_metric([], 1 if refresh.get("state") == "stuck" else 0)

    retried = {
        "attempts": _gauge(
            "aml_payment_retrying_attempts",
            "Failed attempts so far of the payment a lane keeps retrying on this partition (its handler or "
            "its decision's send fails; the error is on the page and in `aml-app status`); absent when "
            "nothing fails there.",
            by_p,
        ),
        "offset": _gauge(
            "aml_payment_retrying_offset", "Offset of the payment retried on this partition.", by_p
        ),
        "retrying_for_s": _gauge(
            "aml_payment_retrying_seconds", "How long the payment on this partition has been retried.", by_p
        ),
    }
    for r in snap.get("retrying") or []:
        for field, family in retried.items():
            if r.get(field) is not None:
                family.add_metric([str(r["partition"])], r[field])

    detector = snap.get("detector")
    counters = [
        ("aml_admin_refresh_errors", "Failed watermark refreshes (leader only).", refresh["errors"]),
        (
            "aml_admin_refresh_overruns",
            "Watermark refreshes abandoned at their deadline, each retried with new Kafka clients.",
            refresh.get("overruns", 0),
        ),
        (
            "aml_admin_client_rebuilds",
            "Times the leader's watchdog rebuilt its Kafka clients after no refresh succeeded for long.",
            refresh.get("client_rebuilds", 0),
        ),
        ("aml_admin_requests", "Kafka admin API requests made for refreshes.", refresh["admin_requests"]),
        (
            "aml_decisions",
            "Decisions made: the detector's count, or payments handled for a service without one.",
            detector["decisions"] if detector else handled_total,
        ),
        ("aml_payments_handled", "Payments this worker's handler finished.", handled_total),
        ("aml_dead_lettered", "Payments this worker sent to the dead-letter topic.", snap["dead_lettered"]),
        (
            "aml_decided_stale",
            "Payments this worker decided stale after waiting past AML_MAX_WAIT (policy decide-stale).",
            snap.get("decided_stale", 0),
        ),
        (
            "aml_parked",
            "Payments this worker parked on the review topic after AML_MAX_ATTEMPTS failed attempts.",
            snap.get("parked", 0),
        ),
        ("aml_rebalances", "Partition rebalances this worker went through.", snap["rebalances"]),
        (
            "aml_handler_failures",
            "Failed attempts of this worker's handler (or of a decision's send); each is retried.",
            snap.get("handler_failures", 0),
        ),
    ]
    if detector:
        counters += [
            ("aml_alerts", "Alerts raised by the detector.", detector["alerts"]),
            (
                "aml_freshness_violations",
                "Answers from a dependency that did not cover the payment (as_of check).",
                detector["freshness_violations"],
            ),
            (
                "aml_dependency_not_yet",
                'Answers "not yet" from B or C: their store had not applied what the question needed.',
                detector.get("dependency_not_yet", 0),
            ),
            (
                "aml_dependency_went_back",
                "Answers from B or C below an as_of they had shown: a replica behind, or a store restored.",
                detector.get("dependency_went_back", 0),
            ),
            (
                "aml_decided_on_pruned",
                "Decisions on answers that lacked payments C had pruned or B had folded "
                "(AML_AGGREGATES_RETENTION).",
                detector.get("decided_on_pruned", 0),
            ),
            (
                "aml_payment_ids_reused",
                "Alerts not sent because an alert of another payment holds the payment's id (ids must be "
                "unique).",
                detector.get("ids_reused", 0),
            ),
            (
                "aml_decided_on_incomplete_loop",
                "Decisions whose payee's cycle search B stopped at its bound before it could rule one out.",
                detector.get("decided_on_incomplete_loop", 0),
            ),
        ]
    out: list[Metric] = [recovering, leader, *per_partition.values(), dep_committed, dep_lag]
    out += [
        status,
        stalled,
        advanced,
        blocked,
        untrusted,
        cut_untrusted,
        breached,
        longest,
        age,
        admin_error,
        stuck,
        *retried.values(),
    ]
    for name, doc, value in counters:
        counter = CounterMetricFamily(name, doc)
        counter.add_metric([], value)
        out.append(counter)
    phases = CounterMetricFamily(
        "aml_admin_refresh_phase_seconds",
        "Seconds the leader's refreshes spent in each read: the groups' committed offsets, the log's "
        "identity, the event-time cut's first unapplied payments (failed reads included).",
        labels=["phase"],
    )
    for phase, seconds in (refresh.get("phase_s") or {}).items():
        phases.add_metric([phase], seconds)
    out.append(phases)
    return labelled(out, {"service": snap["service"]})


def labelled(found: Sequence[Metric], labels: Mapping[str, str]) -> list[Metric]:
    """The metric families `found` with `labels` added to every sample."""
    for family in found:
        family.samples = [sample._replace(labels={**labels, **sample.labels}) for sample in family.samples]
    return list(found)


class SnapshotCollector(Collector):
    """Reads the worker's snapshot at each scrape."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        return families(self.snapshot(), counts.handled)

    def describe(self) -> Iterable[Metric]:
        return []  # computed at scrape time; nothing to check at registration


def register_snapshot(snapshot: Callable[[], Mapping[str, Any]], service_name: str) -> None:
    service["service"] = service_name
    registry.register(SnapshotCollector(snapshot))


def render() -> bytes:
    """The text exposition format of every metric of this process."""
    return generate_latest(registry)
