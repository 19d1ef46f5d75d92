"""Records the source must not count as read without reading them, at its seams; no Kafka, no Spark.

The groups' committed offsets say what the stores hold, and the gate trusts them. So the planner stops
a query whose partition ends, by a fetch's account, below where it stands on the same log (an unclean
leader election, a broker that lost its unflushed tail): new records would fill the offsets in between
and be planned past. A short ListOffsets answer (the embedded broker's quirk) must not stop it. And a
task reading payments, a topic without holes, reads a jump in offsets again instead of skipping it,
and fails if it stays; a jump to the log start (retention) is logged, since those records are gone.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable

from aml_app.pipeline import kafka_source
from aml_app.pipeline.kafka_source import (
    KafkaStreamReader,
    KafkaTask,
    LogChanged,
    RecordsSkipped,
    SourceConfigError,
)

OPTIONS = {"kafka.bootstrap.servers": "127.0.0.1:1", "subscribe": "payments"}


class Probe:
    """The planner's reading of the log ends, at `kafka_source`'s seams: a fetch answers `fetched`, and
    ListOffsets answers `listed` for the partitions no fetch answered."""

    def __init__(self, fetched: dict[int, int], listed: dict[int, int]) -> None:
        self.fetched, self.listed = fetched, listed

    def close(self) -> None:
        pass

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(kafka_source, "probe_consumer", lambda config: self)
        monkeypatch.setattr(kafka_source, "topic_partitions", lambda probe, topic: [0])
        monkeypatch.setattr(kafka_source, "topic_watermarks", self.watermarks)
        monkeypatch.setattr(kafka_source, "fetched_high_watermarks", self.high_watermarks)

    def watermarks(
        self, config: object, topic: str, probe: object, partitions: list[int] | None = None
    ) -> dict[int, tuple[int, int]]:
        return {p: (0, self.listed[p]) for p in partitions or [0]}

    def high_watermarks(
        self, consumer: object, topic: str, starts: dict[int, int], timeout: float = 0
    ) -> dict[int, int]:
        return {p: self.fetched[p] for p in starts if p in self.fetched}


def same_log(config: object, topic: str, timeout: float = 0.0) -> str:
    return "c1:AAAA"


def planner(cut: bool = True, **options: str) -> KafkaStreamReader:
    """A planner on the same log; `cut`: whether a fetch where it stands is refused as out of range."""
    reader = KafkaStreamReader({**OPTIONS, **options})
    reader.read_log = same_log  # type: ignore[method-assign]
    reader.confirm_cut = lambda config, topic, partition, offset: cut  # type: ignore[method-assign]
    return reader


def test_a_log_cut_below_where_the_query_stands_stops_the_query(monkeypatch: pytest.MonkeyPatch) -> None:
    Probe(fetched={0: 40}, listed={}).install(monkeypatch)
    reader = planner(log="c1:AAAA", services="relations,aggregates", store="host=db dbname=aml")
    with pytest.raises(LogChanged) as stopped:
        reader.latestOffset({"0": 50}, ReadAllAvailable())
    assert str(stopped.value) == (
        "partition 0 of topic payments now ends at 40, below offset 50 where the relations and aggregates "
        "stores at host=db dbname=aml stand on the same log (a leader without its latest records took "
        "over, or a broker lost its unflushed tail): the records written there from offset 40 on would be "
        "skipped; rebuild the stores (aml-app rebuild relations, aml-app rebuild aggregates)"
    )


def test_a_high_watermark_below_the_query_with_the_records_still_there_stops_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new leader reports a lower high watermark for a while after a clean election; its log still
    holds every record below where the query stands (a fetch there is answered), so nothing is cut."""
    Probe(fetched={0: 40}, listed={}).install(monkeypatch)
    assert planner(cut=False).latestOffset({"0": 50}, ReadAllAvailable()) == {"0": 50}


def test_a_short_listoffsets_end_plans_nothing_and_stops_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # No fetch answered; ListOffsets says 41, the start of the last record batch + 1.
    Probe(fetched={}, listed={0: 41}).install(monkeypatch)
    reader = planner()
    assert reader.latestOffset({"0": 50}, ReadAllAvailable()) == {"0": 50}


class Message:
    """A record of partition 0, or the end of the partition (`eof`) at `offset`."""

    def __init__(self, offset: int, eof: bool = False) -> None:
        self._offset, self.eof = offset, eof

    def error(self) -> Any:
        from confluent_kafka import KafkaError

        return KafkaError(KafkaError._PARTITION_EOF) if self.eof else None

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return 1, 1_700_000_000_000 + self._offset

    def key(self) -> bytes:
        return b"k%d" % self._offset

    def value(self) -> bytes:
        return b"v%d" % self._offset

    def headers(self) -> None:
        return None


class Consumer:
    """One partition holding `offsets` (its log start the first of them), read as confluent-kafka's
    consumer reads it: from the assigned offset, or from the log start below it (auto.offset.reset
    earliest). The first `hiding` readings after an assign leave out the offsets in `hidden`, as a
    client handed a later record batch first does."""

    def __init__(self, offsets: list[int], hidden: Collection[int] = (), hiding: int = 0) -> None:
        self.offsets, self.hidden, self.hiding = offsets, hidden, hiding
        self.queue: list[Message] = []
        self.assigns: list[int] = []

    def assign(self, partitions: list[Any]) -> None:
        at = max(partitions[0].offset, self.offsets[0])
        hide = self.hidden if len(self.assigns) < self.hiding else ()
        self.assigns.append(partitions[0].offset)
        records = [o for o in self.offsets if o >= at and o not in hide]
        self.queue = [Message(o) for o in records] + [Message(self.offsets[-1] + 1, eof=True)]

    def unassign(self) -> None:
        self.queue = []

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        taken, self.queue = self.queue[:num_messages], self.queue[num_messages:]
        return taken

    #: Whether ListOffsets goes unanswered (librdkafka raises).
    unanswered = False

    def get_watermark_offsets(self, tp: Any, timeout: float) -> tuple[int, int]:
        if self.unanswered:
            from confluent_kafka import KafkaError, KafkaException

            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return self.offsets[0], self.offsets[-1] + 1

    def close(self) -> None:
        pass


@pytest.fixture
def consumer(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(kafka_source, "REREAD_PAUSE_S", 0.01)
    monkeypatch.setattr(kafka_source, "REREAD_BUDGET_S", 0.2)

    def make(*args: Any, **kwargs: Any) -> Consumer:
        made = Consumer(*args, **kwargs)
        monkeypatch.setattr(kafka_source, "_consumer", lambda config: made)
        return made

    return make


def read(reader: KafkaStreamReader, start: int, end: int) -> list[int]:
    batches = list(reader.read(KafkaTask([(0, start, end)])))
    return [o for batch in batches for o in batch.column("offset").to_pylist()]


def test_payments_skipped_by_the_client_are_read_again(consumer: Any) -> None:
    client = consumer(list(range(6)), hidden={2, 3}, hiding=1)
    assert read(planner(), 0, 6) == [0, 1, 2, 3, 4, 5]
    assert client.assigns == [0, 2]


def test_a_jump_read_while_listoffsets_goes_unanswered_is_read_again(consumer: Any) -> None:
    client = consumer(list(range(6)), hidden={2, 3}, hiding=1)
    client.unanswered = True
    assert read(planner(), 0, 6) == [0, 1, 2, 3, 4, 5]


def test_payments_the_client_keeps_skipping_fail_the_task(consumer: Any) -> None:
    client = consumer(list(range(6)), hidden={2, 3}, hiding=100_000)
    with pytest.raises(RecordsSkipped) as failed:
        read(planner(), 0, 6)
    reads = len(client.assigns)  # the first reading, then one after each jump but the last
    assert str(failed.value) == (
        f"payments[0] handed this task offset 4 where it expects 2, {reads} times in 0.2 s: offsets 2..3 "
        "are missing from a topic read as one without transactions (the source's option transactional; "
        "for payments AML_PAYMENTS_TRANSACTIONAL), so the task fails rather than count them as read"
    )
    assert reads >= 2 and client.assigns == [0] + [2] * (reads - 1)


def test_records_below_where_the_range_stands_are_not_read_twice(consumer: Any) -> None:
    """A client whose position went out of range resets to the log start (auto.offset.reset earliest)
    and hands over records the task already read, or that earlier ranges hold."""
    client = consumer(list(range(6)))
    real_assign = client.assign

    def back_to_the_start(partitions: list[Any]) -> None:
        real_assign(partitions)
        client.queue = [Message(o) for o in range(6)] + [Message(6, eof=True)]

    client.assign = back_to_the_start  # type: ignore[method-assign]
    assert read(planner(), 3, 6) == [3, 4, 5]


def test_a_skipped_tail_of_a_range_is_read_again(consumer: Any) -> None:
    # The range's last records hidden: the next record is past the range, or the partition's end.
    consumer(list(range(6)), hidden={4, 5}, hiding=1)
    assert read(planner(), 0, 6) == [0, 1, 2, 3, 4, 5]
    consumer(list(range(8)), hidden={4, 5}, hiding=1)
    assert read(planner(), 0, 6) == [0, 1, 2, 3, 4, 5]


def test_a_derived_topics_markers_are_crossed_at_once(consumer: Any) -> None:
    # Offsets 2 and 3 hold commit markers: the derived topic (sourceHeader) is read as transactional.
    client = consumer([0, 1, 4, 5])
    assert read(planner(sourceHeader="aml-source"), 0, 6) == [0, 1, 4, 5]
    assert client.assigns == [0]
    with pytest.raises(RecordsSkipped):
        read(planner(sourceHeader="aml-source", transactional="false"), 0, 6)
    with pytest.raises(SourceConfigError, match=r"transactional='yes' is neither"):
        planner(transactional="yes")


def test_records_retention_deleted_before_the_read_are_logged_once(
    consumer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    consumer([3, 4, 5, 6, 7])  # retention deleted offsets 0..2
    with caplog.at_level(logging.WARNING, logger=kafka_source.__name__):
        assert read(planner(), 0, 6) == [3, 4, 5]
    assert [r.getMessage() for r in caplog.records] == [
        "payments[0]: offsets 0..2 were deleted by retention before the pipeline read them: their "
        "records are lost, and the pipeline goes on from offset 3"
    ]


def test_a_derived_topics_records_retention_deleted_before_the_read_stop_the_query(consumer: Any) -> None:
    """The derived topic is read as transactional, so a jump was taken at once: the group committed past
    records no store held, and the gate's refusal of them ends once the group's offsets pass them."""
    consumer([3, 4, 5, 6, 7])  # retention deleted offsets 0..2
    reader = planner(sourceHeader="aml-source", services="aggregates", subscribe="payments.enriched")
    with pytest.raises(LogChanged) as stopped:
        read(reader, 0, 6)
    assert str(stopped.value) == (
        "offsets 0..2 of partition 0 of topic payments.enriched were deleted by retention before aggregates "
        "read them: the payments they name are in no store, and a commit past them would say they are; "
        "derive them again and rebuild the stores (aml-app rebuild aggregates), and keep payments.enriched "
        "longer than the pipeline may stand still"
    )
    # An aborted transaction's records are a jump of more than a marker too, above the log start.
    consumer([0, 1, 5, 6])
    assert read(planner(sourceHeader="aml-source"), 0, 7) == [0, 1, 5, 6]
