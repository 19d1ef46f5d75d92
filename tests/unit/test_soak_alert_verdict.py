"""How the chaos soak tells an alert sent twice that a worker could have seen from one a frozen worker
sent when it ran again (the alert was in its producer when it was stopped; only a broker that fences
producers can refuse it)."""

from __future__ import annotations

import json

from bench.chaos_soak import AlertSeen, Seen, sent_after_a_freeze

#: aml-1 stopped at 100.0 and continued at 110.0 (wall clock).
FREEZES = [("aml-1", 100.0, 110.0)]


def seen(worker: str, decided: str, arrived: float) -> AlertSeen:
    value = json.dumps({"payment_id": "p", "worker": worker, "decided_at": decided}).encode()
    return AlertSeen.of(Seen(0, 0, b"p", value, (), arrived))


def at(seconds: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, UTC).isoformat()


def test_an_alert_the_frozen_worker_decided_before_its_stop_and_sent_after_is_told_apart() -> None:
    records = [seen("aml-2", at(109.0), 109.1), seen("aml-1", at(99.5), 110.2)]
    assert sent_after_a_freeze(records, FREEZES) == 1


def test_alerts_sent_twice_otherwise_still_count() -> None:
    cases = {
        "by another worker": [seen("aml-2", at(109.0), 109.1), seen("aml-3", at(99.5), 110.2)],
        "decided after the stop began": [seen("aml-2", at(109.0), 109.1), seen("aml-1", at(100.5), 110.2)],
        "arrived before the worker ran again": [seen("aml-2", at(99.0), 99.1), seen("aml-1", at(99.5), 99.6)],
        "no freeze at all": [seen("aml-2", at(9.0), 9.1), seen("aml-1", at(9.5), 9.6)],
    }
    for case, records in cases.items():
        assert sent_after_a_freeze(records, FREEZES if case != "no freeze at all" else []) == 0, case


def test_an_unreadable_alert_is_never_told_apart() -> None:
    record = AlertSeen.of(Seen(0, 0, b"p", b"not json", (), 110.2))
    assert record.worker == "" and record.decided_at is None
    assert sent_after_a_freeze([record], FREEZES) == 0
