"""Where the fetch probe does not reach a partition, its only end is ListOffsets' answer, which some
brokers give short (the embedded one: the start of the last record batch + 1). The pipeline's start
compares its stores and its groups' offsets with these ends, so a short one must never stand in for the
real end: the store check would refuse a healthy store as "ahead of its topic", and a query would start
below what its store holds (StaleBatch at its first batch, at every restart while the broker is slow).
The probe and ListOffsets are replaced at their seams (`kafka_source`'s module functions)."""

from __future__ import annotations

from typing import Any

import pytest

from aml_app.pipeline import kafka_source
from aml_app.pipeline.kafka_source import KafkaStreamReader, LogUnreadable, log_bounds

#: The real ends; ListOffsets answers 1 (one record batch per partition).
ENDS = {0: 100, 1: 100}
LISTED = {0: (0, 1), 1: (0, 1)}


class Broker:
    """The probe answers for the partitions in each round's `reached` (the last round repeats)."""

    def __init__(self, *rounds: set[int]) -> None:
        self.rounds = list(rounds)
        self.probes = 0

    def fetched(
        self, consumer: Any, topic: str, starts: dict[int, int], timeout: float = 0
    ) -> dict[int, int]:
        reached = self.rounds[min(self.probes, len(self.rounds) - 1)]
        self.probes += 1
        return {p: ENDS[p] for p in starts if p in reached}


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> Any:
    def make(*rounds: set[int]) -> Broker:
        b = Broker(*rounds)
        monkeypatch.setattr(
            kafka_source, "probe_consumer", lambda config: type("P", (), {"close": lambda s: None})()
        )
        monkeypatch.setattr(kafka_source, "topic_partitions", lambda probe, topic: sorted(ENDS))
        monkeypatch.setattr(
            kafka_source,
            "topic_watermarks",
            lambda config, topic, probe, ps=None: {p: LISTED[p] for p in ps or ENDS},
        )
        monkeypatch.setattr(kafka_source, "fetched_high_watermarks", b.fetched)
        monkeypatch.setattr(
            kafka_source, "committed_offsets", lambda config, topic, group, ps: {0: 50, 1: 80}
        )
        return b

    return make


def test_the_store_check_gets_every_end_from_a_fetch(broker: Any) -> None:
    b = broker({0}, {0, 1})
    assert log_bounds({}, "payments") == {0: (0, 100), 1: (0, 100)}
    assert b.probes == 2


def test_an_end_no_fetch_gives_is_unknown_not_short(broker: Any) -> None:
    broker({0})
    with pytest.raises(LogUnreadable, match=r"partitions \[1\] of 'payments'"):
        log_bounds({}, "payments")


def test_a_query_never_starts_below_its_group_at_an_end_listoffsets_gave_short(broker: Any) -> None:
    b = broker({0}, {0, 1})
    reader = KafkaStreamReader(
        {"kafka.bootstrap.servers": "127.0.0.1:1", "subscribe": "payments", "groupId": "g"}
    )
    reader.read_log = lambda config, topic: "c1:AAAA"  # type: ignore[method-assign]
    reader.sleep = lambda seconds: None  # type: ignore[method-assign]
    assert reader.initialOffset() == {"0": 50, "1": 80}
    assert b.probes == 2
