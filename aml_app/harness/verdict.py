"""The demo's verdict: what a run produced (the ledger) against what the system did with it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aml_app.harness.system import System
from aml_app.harness.verify import CommitTimeline, Premature, decided_at, percentile, premature
from aml_app.settings import Settings
from aml_app.simulation.producer import SimulatorReport
from aml_app.simulation.score import PaymentScore, TypologyScore, payment_score, score
from aml_app.simulation.traffic import SimPayment


@dataclass(frozen=True)
class Sent:
    payment_id: str
    payer: str
    payee: str
    ts: str


@dataclass
class Ledger:
    """Every record this run produced and where it landed: the reference for the final checks."""

    valid: dict[tuple[int, int], Sent] = field(default_factory=dict)
    sent_at: dict[str, float] = field(default_factory=dict)
    malformed: set[tuple[int, int]] = field(default_factory=set)
    ends: dict[int, int] = field(default_factory=dict)
    warm_up: set[str] = field(default_factory=set)
    _ids: set[str] = field(default_factory=set)

    @property
    def produced(self) -> int:
        return len(self.valid) + len(self.malformed)

    def ids(self) -> set[str]:
        """The valid payments' ids (kept as they are placed: the progress loop polls this)."""
        return self._ids

    def place(self, partition: int, offset: int, payment: Sent | None, sent_at: float) -> None:
        if payment is None:
            self.malformed.add((partition, offset))
        else:
            self.valid[(partition, offset)] = payment
            self._ids.add(payment.payment_id)
            self.sent_at[payment.payment_id] = sent_at
        self.ends[partition] = max(self.ends.get(partition, 0), offset + 1)

    def on_sent(self, payment: SimPayment, partition: int, offset: int, sent_at: float) -> None:
        """The simulator's callback for each payment the broker acknowledged."""
        self.place(
            partition, offset, Sent(payment.payment_id, payment.payer, payment.payee, payment.ts), sent_at
        )


@dataclass
class ServiceVerdict:
    """What one gated service did with this run's payments."""

    service: str
    decided: int
    records: int
    missing: int
    alerts: int
    alert_records: int
    premature: list[Premature]
    freshness_violations: int
    decided_not_fresh: int
    wait_p50: float
    wait_p99: float
    latency_p50: float
    latency_p99: float
    #: Decided minus when the dependencies' commits covered the payment (`after_commits`).
    after_commits_p50: float
    after_commits_p99: float
    dead_lettered: int

    @property
    def duplicate_alerts(self) -> int:
        return self.alert_records - self.alerts

    @property
    def premature_decisions(self) -> int:
        """Distinct decisions made too early (one may be early for several dependencies)."""
        return len({(p, o) for p, o, *_ in self.premature})


@dataclass
class Verdict:
    """The final check, from what was produced, committed, decided, alerted and answered."""

    gated: bool
    valid: int
    malformed: int
    services: dict[str, ServiceVerdict]
    #: Dependency group (or the stage it reads) -> malformed records it dead-lettered.
    dead_lettered: dict[str, int]
    reasons: Counter[str]
    behind: dict[str, int]  # group -> records it has not committed past
    #: Produced -> every dependency group committed past the payment, ms (`committed_after`).
    committed_p50: float
    committed_p99: float
    spot_failures: int
    scores: dict[str, TypologyScore]
    payments: PaymentScore

    @property
    def ok(self) -> bool:
        """Every promise kept: with the gate off, premature decisions and stale evidence are expected."""
        gate_kept = all(not v.premature and not v.freshness_violations for v in self.services.values())
        return (
            (gate_kept or not self.gated)
            and all(not v.missing and not v.duplicate_alerts for v in self.services.values())
            and all(v.dead_lettered == self.malformed for v in self.services.values())
            and all(n == self.malformed for n in self.dead_lettered.values())
            and not any(self.behind.values())
            and not self.spot_failures
        )


def committed_after(ledger: Ledger, groups: Sequence[str], timeline: CommitTimeline) -> list[float]:
    """Per valid payment past the warm-up, ms from its send until every dependency group's commit
    covered it: the floor under any gated service's latency. The commit watch dates a commit at the
    poll before the one that saw it, so each is at most a poll short."""
    waits = []
    for (partition, offset), sent in ledger.valid.items():
        if sent.payment_id in ledger.warm_up:
            continue
        covered = timeline.opened_at(groups, partition, offset)
        if covered is not None:
            waits.append((covered - ledger.sent_at[sent.payment_id]) * 1000)
    return waits


def after_commits(
    decisions: Sequence[Mapping[str, Any]], groups: Sequence[str], timeline: CommitTimeline
) -> list[float]:
    """Per decision, ms from when every dependency group's commit covered its payment until it was
    decided: the gated service's own share of the latency (at most a poll long, as `committed_after`
    says). The event-time gate's wait for other partitions' payments up to the payment's time is part
    of it."""
    shares = []
    for d in decisions:
        covered = timeline.opened_at(groups, d["partition"], d["offset"])
        if covered is not None:
            shares.append((decided_at(d) - covered) * 1000)
    return shares


def judge(
    system: System,
    ledger: Ledger,
    settings: Settings,
    *,
    gated: bool,
    report: SimulatorReport | None,
    spot_failures: int,
) -> Verdict:
    """The verdict of a run, from what the system wrote (decisions, alerts, dead letters, commits) and
    what the run produced (`ledger`) and injected (`report`)."""
    assert system.watch is not None and system.dead_letters is not None
    ids = ledger.ids()
    services = {}
    for service, tail in system.decisions.items():
        decided = tail.of_run(ids)
        alerts = system.alerts[service].of_run(ids)
        # Waits and latencies leave out the warm-up payments, which waited for Spark's first batch.
        steady = [d for d in decided if d["payment_id"] not in ledger.warm_up]
        waits = [float(d.get("waited_ms", 0)) for d in steady]
        latencies = [(decided_at(d) - ledger.sent_at[d["payment_id"]]) * 1000 for d in steady]
        shares = after_commits(steady, settings.depends_on, system.watch.timeline)
        services[service] = ServiceVerdict(
            service=service,
            decided=len(tail.distinct(ids)),
            records=len(decided),
            missing=len(ids - tail.distinct(ids)),
            alerts=len({a["payment_id"] for a in alerts}),
            alert_records=len(alerts),
            premature=premature(decided, settings.depends_on, system.watch.timeline),
            freshness_violations=sum(int(d.get("stale_reads", 0)) for d in decided),
            decided_not_fresh=sum(1 for d in decided if d.get("fresh") is False),
            wait_p50=percentile(waits, 50),
            wait_p99=percentile(waits, 99),
            latency_p50=percentile(latencies, 50),
            latency_p99=percentile(latencies, 99),
            after_commits_p50=percentile(shares, 50),
            after_commits_p99=percentile(shares, 99),
            dead_lettered=len(system.dead_letters.of_run(service, ledger.malformed)),
        )
    committed = committed_after(ledger, settings.depends_on, system.watch.timeline)
    groups = system.dead_letter_sources
    dead = system.dead_letters.of_run(groups[0], ledger.malformed)
    aml_alerts = system.alerts["aml"].of_run(ids) if "aml" in system.alerts else []
    instances = report.simulation.instances if report else ()
    sent_ids = set(report.placements) if report else set()
    typed_alerts = [(a["payment_id"], t) for a in aml_alerts for t in a.get("typologies", [])]
    complete = [i for i in instances if set(i.payment_ids) <= sent_ids]
    return Verdict(
        gated=gated,
        valid=len(ids),
        malformed=len(ledger.malformed),
        services=services,
        dead_lettered={g: len(system.dead_letters.of_run(g, ledger.malformed)) for g in groups},
        reasons=Counter(reason.split(":")[0].split(", got")[0] for reason in dead.values()),
        behind={g: system.watch.behind(g, ledger.ends) for g in system.groups},
        committed_p50=percentile(committed, 50),
        committed_p99=percentile(committed, 99),
        spot_failures=spot_failures,
        # Only instances whose every payment was sent (Ctrl-C may cut the run short).
        scores=score(typed_alerts, complete),
        payments=payment_score(typed_alerts, complete),
    )
