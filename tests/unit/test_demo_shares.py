"""The demo's split of a payment's wait: produced -> its dependencies committed past it, then committed
-> decided (the gated service's own share), each dated by the commit watch's timeline."""

from __future__ import annotations

from datetime import UTC, datetime

from aml_app.harness.verdict import Ledger, Sent, after_commits, committed_after
from aml_app.harness.verify import CommitTimeline

GROUPS = ("relations", "aggregates")


def sent(payment_id: str) -> Sent:
    return Sent(payment_id, "payer", "payee", "2026-12-06T00:00:00+00:00")


def ledger() -> Ledger:
    runs = Ledger()
    runs.place(0, 0, sent("warm"), 90.0)  # the warm-up's payment: left out
    runs.place(0, 1, sent("a"), 100.0)
    runs.place(1, 0, sent("b"), 100.5)
    runs.place(1, 1, sent("late"), 101.0)  # not yet covered by every group
    runs.warm_up.add("warm")
    return runs


def timeline() -> CommitTimeline:
    commits = CommitTimeline()
    commits.record("relations", 0, 2, at=100.2)
    commits.record("aggregates", 0, 1, at=100.1)
    commits.record("aggregates", 0, 2, at=100.3)  # the later of the two covers partition 0's offset 1
    commits.record("relations", 1, 2, at=100.9)
    commits.record("aggregates", 1, 1, at=100.7)
    return commits


def decision(partition: int, offset: int, at: float) -> dict[str, object]:
    when = datetime.fromtimestamp(at, UTC).isoformat()
    return {"partition": partition, "offset": offset, "decided_at": when}


def test_the_dependencies_commit_a_payment_when_the_last_group_covers_it() -> None:
    waits = committed_after(ledger(), GROUPS, timeline())
    # a: both groups past offset 1 of partition 0 at 100.3; b: past offset 0 of partition 1 at 100.9;
    # late: aggregates never committed past it; the warm-up payment is not counted.
    assert sorted(round(w) for w in waits) == [300, 400]


def test_a_service_s_own_share_starts_when_every_dependency_committed_past_the_payment() -> None:
    decisions = [decision(0, 1, 100.45), decision(1, 0, 101.0), decision(1, 1, 101.5)]
    shares = after_commits(decisions, GROUPS, timeline())
    assert sorted(round(s) for s in shares) == [100, 150]
