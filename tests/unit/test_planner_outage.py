"""The source's planner while the broker does not answer, at its narrowest seam: `latestOffset` and
`initialOffset` with the reading of the log ends (`bounds`) and of the log's identity replaced, and a
fake clock; no Kafka, no Spark. A frozen broker makes those reads time out; Spark stops a query whose
planner raises, and the pipeline exits with it (the chaos soak's 15 s freeze catches an idle query's
plan, or a restarted pipeline's query start)."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException
from pyspark.sql.streaming.datasource import ReadAllAvailable

from aml_app.kafka.identity import LogUnknown
from aml_app.pipeline import kafka_source
from aml_app.pipeline.kafka_source import PLAN_OUTAGE_LIMIT, KafkaStreamReader, LogChanged


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Log:
    """What `bounds` answers: the log ends, or the error a read of them raises now (it takes `wait`
    seconds on the clock, as a read that waits out its timeout does)."""

    def __init__(self, clock: Clock, ends: dict[int, int]) -> None:
        self.clock, self.ends = clock, ends
        self.error: Exception | None = None
        self.wait = 0.0
        #: The error stops after this many reads (None: it lasts).
        self.until: int | None = None
        self.reads = 0

    def bounds(
        self, floors: object = None, *, answered: bool = False
    ) -> tuple[dict, dict[int, tuple[int, int]]]:
        self.reads += 1
        self.clock.now += self.wait
        if self.error is not None and (self.until is None or self.reads <= self.until):
            raise self.error
        return {p: (0, end) for p, end in self.ends.items()}, dict(self.ends)


def planner(clock: Clock, log: Log) -> KafkaStreamReader:
    reader = KafkaStreamReader({"kafka.bootstrap.servers": "127.0.0.1:1", "subscribe": "payments"})
    reader.clock = clock  # type: ignore[method-assign]
    reader.sleep = clock.sleep  # type: ignore[method-assign]
    reader.read_log = lambda config, topic: "c1:AAAA"  # type: ignore[method-assign]
    reader.bounds = log.bounds  # type: ignore[method-assign]
    return reader


TRANSPORT = KafkaException(KafkaError(KafkaError._TRANSPORT, "Failed to get metadata"))


def test_a_broker_that_does_not_answer_plans_nothing_until_it_answers_again() -> None:
    clock = Clock()
    log = Log(clock, {0: 10, 1: 20})
    reader = planner(clock, log)
    start = {"0": 5, "1": 5}
    assert reader.latestOffset(start, ReadAllAvailable()) == {"0": 10, "1": 20}

    log.error, log.wait = TRANSPORT, kafka_source.METADATA_TIMEOUT
    for _ in range(3):  # 30 s of a frozen broker: each plan waits out its timeout and plans nothing
        assert reader.latestOffset(start, ReadAllAvailable()) == start

    log.error, log.wait = None, 0.0
    log.ends = {0: 12, 1: 20}
    assert reader.latestOffset(start, ReadAllAvailable()) == {"0": 12, "1": 20}


def test_an_outage_longer_than_the_limit_stops_the_query_with_its_error() -> None:
    clock = Clock()
    log = Log(clock, {0: 10})
    reader = planner(clock, log)
    start = {"0": 5}
    log.error, log.wait = TRANSPORT, kafka_source.METADATA_TIMEOUT
    plans = 0
    with pytest.raises(KafkaException):
        while plans < 100:
            assert reader.latestOffset(start, ReadAllAvailable()) == start
            plans += 1
    assert plans == int(PLAN_OUTAGE_LIMIT // kafka_source.METADATA_TIMEOUT) - 1


def test_an_outage_over_is_counted_afresh() -> None:
    clock = Clock()
    log = Log(clock, {0: 10})
    reader = planner(clock, log)
    start = {"0": 5}
    log.error = LogUnknown("cannot tell which log topic 'payments' is: timed out")
    reader.latestOffset(start, ReadAllAvailable())
    clock.now += PLAN_OUTAGE_LIMIT - 1
    assert reader.latestOffset(start, ReadAllAvailable()) == start
    log.error = None
    reader.latestOffset(start, ReadAllAvailable())
    log.error = TRANSPORT
    clock.now += 1
    assert reader.latestOffset(start, ReadAllAvailable()) == start, "the earlier outage still counted"


def test_another_log_stops_the_query_at_once() -> None:
    clock = Clock()
    log = Log(clock, {0: 10})
    reader = planner(clock, log)
    reader.log = "c1:OLD"
    with pytest.raises(LogChanged):
        reader.latestOffset({"0": 5}, ReadAllAvailable())


def test_a_query_started_while_the_broker_does_not_answer_starts_once_it_does() -> None:
    """A restarted pipeline's query starts during the outage (Spark took half a minute to come up on a
    busy machine, and the broker froze meanwhile): its start waits for the broker."""
    clock = Clock()
    log = Log(clock, {0: 10, 1: 20})
    log.error, log.wait, log.until = TRANSPORT, kafka_source.METADATA_TIMEOUT, 2
    reader = planner(clock, log)
    assert reader.initialOffset() == {"0": 0, "1": 0}
    assert log.reads == 3


def test_a_query_start_gives_up_after_the_outage_limit() -> None:
    clock = Clock()
    log = Log(clock, {0: 10})
    log.error, log.wait = TRANSPORT, kafka_source.METADATA_TIMEOUT
    reader = planner(clock, log)
    with pytest.raises(KafkaException):
        reader.initialOffset()
    assert clock.now - 1000.0 >= PLAN_OUTAGE_LIMIT
    assert log.reads <= PLAN_OUTAGE_LIMIT / kafka_source.METADATA_TIMEOUT + 1
