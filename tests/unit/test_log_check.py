"""The planner's watch on which log the topic is, at its narrowest seam: `KafkaStreamReader.check_log`
with a fake cluster (the identity it answers) and a fake clock; no Kafka, no Spark.

The planner asks the cluster at most every LOG_CHECK_INTERVAL seconds (a clock reading per plan
otherwise), at once when told to, and stops the query (LogChanged) with the sentence that says which
stores were built from which log and what to do.
"""

from __future__ import annotations

import pytest

from aml_app.pipeline.kafka_source import LOG_CHECK_INTERVAL, KafkaStreamReader, LogChanged
from aml_app.pipeline.runner import Pipeline


class Cluster:
    """A fake `log_identity`: answers `log`, counts the questions."""

    def __init__(self, log: str) -> None:
        self.log = log
        self.asked = 0

    def __call__(self, config: object, topic: str) -> str:
        self.asked += 1
        return self.log


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def planner(cluster: Cluster, clock: Clock, **options: str) -> KafkaStreamReader:
    reader = KafkaStreamReader({"kafka.bootstrap.servers": "127.0.0.1:1", "subscribe": "payments", **options})
    reader.read_log = cluster  # type: ignore[method-assign]
    reader.clock = clock  # type: ignore[method-assign]
    return reader


STORES = {"log": "c1:AAAA", "services": "relations,aggregates", "store": "host=db dbname=aml"}


def test_the_planner_asks_at_most_every_interval_and_stops_on_another_log() -> None:
    cluster, clock = Cluster("c1:AAAA"), Clock()
    reader = planner(cluster, clock, **STORES)
    reader.check_log()
    assert cluster.asked == 1
    clock.now += LOG_CHECK_INTERVAL - 0.1
    reader.check_log()
    assert cluster.asked == 1, "asked the cluster again within the interval"

    cluster.log = "c1:BBBB"  # the topic deleted and created again
    reader.check_log()
    assert cluster.asked == 1
    clock.now += 0.1
    with pytest.raises(LogChanged) as stopped:
        reader.check_log()
    assert cluster.asked == 2
    assert str(stopped.value) == (
        "the relations and aggregates stores at host=db dbname=aml were built from log c1:AAAA of topic "
        "payments, but payments is now log c1:BBBB (the topic was deleted and created again, or the "
        "cluster changed): rebuild them (aml-app rebuild relations, aml-app rebuild aggregates), or point "
        "AML_STORE_URL at this log's stores"
    )


def test_a_check_asked_for_now_asks_at_once() -> None:
    cluster, clock = Cluster("c1:AAAA"), Clock()
    reader = planner(cluster, clock, **{**STORES, "services": "relations"})
    reader.check_log()
    cluster.log = "c2:AAAA"  # the same topic id on another cluster
    with pytest.raises(LogChanged, match=r"^the relations store at host=db dbname=aml was built from log"):
        reader.check_log(now=True)
    assert cluster.asked == 2


def test_without_a_log_given_the_planner_keeps_the_first_it_sees() -> None:
    cluster, clock = Cluster("c1:AAAA"), Clock()
    reader = planner(cluster, clock)
    reader.check_log()
    assert reader.log == "c1:AAAA"
    cluster.log = "c1:BBBB"
    clock.now += LOG_CHECK_INTERVAL
    with pytest.raises(LogChanged) as stopped:
        reader.check_log()
    assert str(stopped.value) == (
        "topic payments was log c1:AAAA when this query started, but is now log c1:BBBB (the topic was "
        "deleted and created again, or the cluster changed)"
    )


class StoppedQuery:
    """A query Spark stopped, with its exception's text as PySpark gives it (a Python traceback inside)."""

    name = "relations+aggregates"
    isActive = False

    def __init__(self, text: str) -> None:
        self.text = text

    def exception(self) -> str:
        return self.text


def test_the_pipeline_reports_the_planners_sentence_alone() -> None:
    sentence = "the relations store at host=db was built from log a:1 of topic p, but p is now log a:2 (...)"
    text = (
        "[STREAM_FAILED] Query [id = 1] terminated with exception: An exception was thrown from the Python "
        'worker.\nTraceback (most recent call last):\n  File "kafka_source.py", line 1, in latestOffset\n'
        f"aml_app.pipeline.kafka_source.LogChanged: {sentence}\n\n\tat org.apache.spark.Something"
    )
    assert Pipeline(None, [StoppedQuery(text)], []).failure() == sentence
    other = "[STREAM_FAILED] Query [id = 1] terminated with exception: RuntimeError: no such topic"
    assert (
        Pipeline(None, [StoppedQuery(other)], []).failure() == f"query relations+aggregates stopped: {other}"
    )
