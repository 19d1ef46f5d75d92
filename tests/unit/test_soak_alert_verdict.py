"""How the chaos soak tells an alert sent twice that a worker could have seen from one a frozen worker
sent when it ran again (the alert was in its producer when it was stopped; only a broker that fences
producers can refuse it)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace

from aiokafka import TopicPartition

from bench.chaos_soak import (
    AlertSeen,
    Seen,
    TopicReader,
    alerted_after_a_freeze,
    only_frozen_sends,
    sent_after_a_freeze,
)

#: aml-1 stopped at 100.0 and continued at 110.0 (wall clock).
FREEZES = [("aml-1", 100.0, 110.0)]


def seen(worker: str, created: float, arrived: float, decided: float | None = None) -> AlertSeen:
    """An alert record of `worker` its producer created at `created`, decided at `decided` (by default
    just before it was created)."""
    when = datetime.fromtimestamp(created - 0.1 if decided is None else decided, UTC).isoformat()
    value = json.dumps({"payment_id": "p", "worker": worker, "decided_at": when}).encode()
    return AlertSeen.of(Seen(0, 0, b"p", value, (), arrived, created))


def test_an_alert_the_frozen_worker_created_before_its_stop_and_sent_after_is_told_apart() -> None:
    records = [seen("aml-2", 109.0, 109.1), seen("aml-1", 99.5, 110.2)]
    assert sent_after_a_freeze(records, FREEZES) == 1


def test_alerts_sent_twice_otherwise_still_count() -> None:
    cases = {
        "by another worker": [seen("aml-2", 109.0, 109.1), seen("aml-3", 99.5, 110.2)],
        "created after the stop began": [seen("aml-2", 109.0, 109.1), seen("aml-1", 100.5, 110.2)],
        "arrived before the worker ran again": [seen("aml-2", 99.0, 99.1), seen("aml-1", 99.5, 99.6)],
        "no freeze at all": [seen("aml-2", 9.0, 9.1), seen("aml-1", 9.5, 9.6)],
    }
    for case, records in cases.items():
        assert sent_after_a_freeze(records, FREEZES if case != "no freeze at all" else []) == 0, case


def test_an_alert_decided_before_the_stop_but_created_after_it_still_counts() -> None:
    """The detector stamps `decided_at` before it checks that the partition is still its own: a worker
    that decided before its stop and sent once it ran again, the partition another's by then, sent twice
    an alert it could have seen. Only the record's own timestamp says it was in the producer at the stop."""
    records = [seen("aml-2", 109.0, 109.1), seen("aml-1", 110.1, 110.2, decided=99.5)]
    assert sent_after_a_freeze(records, FREEZES) == 0


async def test_a_reader_keeps_when_the_producer_created_a_record() -> None:
    reader = TopicReader("localhost:9", "alerts", 1)
    value = json.dumps({"payment_id": "p", "worker": "aml-1"}).encode()
    records = [
        SimpleNamespace(
            partition=0, offset=0, key=b"p", value=value, headers=(), timestamp=99_500, timestamp_type=0
        ),
        SimpleNamespace(
            partition=0, offset=1, key=b"p", value=value, headers=(), timestamp=110_100, timestamp_type=1
        ),
    ]
    reader.keep(TopicPartition("alerts", 0), records, now=110.2)
    await reader.consumer.stop()  # never started: nothing to reach

    create_time, log_append_time = (AlertSeen.of(r) for r in reader.records)
    assert (create_time.worker, create_time.created, create_time.arrived) == ("aml-1", 99.5, 110.2)
    assert log_append_time.created is None  # the broker's clock: nothing of when the producer had it


def test_at_most_one_alert_of_a_payment_is_told_apart_and_only_beside_another_worker_s() -> None:
    records = {
        "next owner too": [seen("aml-1", 99.5, 110.2), seen("aml-2", 109.0, 109.1)],
        "twice by the frozen worker": [seen("aml-1", 99.4, 110.2), seen("aml-1", 99.5, 110.3)],
        "twice by the next owner": [
            seen("aml-1", 99.5, 110.2),
            seen("aml-2", 109.0, 109.1),
            seen("aml-2", 111.0, 111.1),
        ],
    }
    alerts = {pid: len(sent) for pid, sent in records.items()}

    after_freeze = alerted_after_a_freeze(alerts, records, FREEZES)
    alerted_twice = {pid for pid, n in alerts.items() if n > 1 and pid not in after_freeze}

    assert after_freeze == {"next owner too": 2}
    assert alerted_twice == {"twice by the frozen worker", "twice by the next owner"}
    assert [sent_after_a_freeze(sent, FREEZES) for sent in records.values()] == [1, 0, 1]


def test_an_unreadable_alert_is_never_told_apart() -> None:
    record = AlertSeen.of(Seen(0, 0, b"p", b"not json", (), 110.2, 99.5))
    assert record.worker == ""
    assert sent_after_a_freeze([record, seen("aml-2", 109.0, 109.1)], FREEZES) == 0


def test_a_clear_decision_beside_an_alert_is_excused_only_when_a_frozen_worker_alone_alerted() -> None:
    """The next owner read `alerts-sent` without the frozen worker's alert, which arrived after it ran
    again, and may have decided the payment clear; beside any other alert a clear decision is a failure."""
    assert only_frozen_sends([seen("aml-1", 99.5, 110.2)], FREEZES)
    assert not only_frozen_sends([seen("aml-1", 99.5, 110.2), seen("aml-2", 105.0, 105.1)], FREEZES)
    assert not only_frozen_sends([seen("aml-1", 99.5, 99.6)], FREEZES), "it arrived before the stop"
    assert not only_frozen_sends([], FREEZES)
