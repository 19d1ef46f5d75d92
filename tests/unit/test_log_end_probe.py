"""The source planner's fetch probe (`fetched_high_watermarks`, `probe_starts`) against a stand-in for
confluent-kafka's consumer: the order in which a consumer's queue hands out records is the broker's and
librdkafka's to choose, and the embedded broker produces the order that starved the probe only now and
then under a steady write (`bench/probe_answers.py`); the stand-in produces it every time."""

from __future__ import annotations

from typing import Any

from aml_app.pipeline.kafka_source import fetched_high_watermarks, probe_starts

UNKNOWN = -1001  # librdkafka's "no fetch response yet"


class Record:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def error(self) -> None:
        return None


class Consumer:
    """Every `poll` is a fetch response: it sets the cached high watermark of each partition in
    `answers` (one request covers them all) and hands out a record of partition 0 only, as a queue
    holding a deep backlog of partition 0 ahead of the others does."""

    def __init__(self, answers: dict[int, int]) -> None:
        self.answers = answers
        self.cache: dict[int, int] = {}
        self.assigned: dict[int, int] = {}
        self.next_record = 0

    def assign(self, partitions: list[Any]) -> None:
        self.assigned = {tp.partition: tp.offset for tp in partitions}

    def unassign(self) -> None:
        self.assigned = {}

    def poll(self, timeout: float) -> Record:
        self.cache.update(self.answers)
        self.next_record += 1
        return Record(0, self.next_record - 1)

    def get_watermark_offsets(self, tp: Any, cached: bool = False) -> tuple[int, int]:
        assert cached, "the probe reads the cache its fetches filled, not ListOffsets again"
        high = self.cache.get(tp.partition, UNKNOWN)
        return (UNKNOWN if high == UNKNOWN else 0, high)


def test_every_partition_is_answered_by_the_first_fetch_response_whatever_records_come_out() -> None:
    consumer = Consumer({0: 9000, 1: 7000, 2: 7100, 3: 6900})
    ends = fetched_high_watermarks(consumer, "payments", {0: 10, 1: 20, 2: 30, 3: 40}, timeout=5.0)
    assert ends == {0: 9000, 1: 7000, 2: 7100, 3: 6900}
    assert consumer.next_record == 1, "the probe answers from one fetch response, not by reading records"
    assert consumer.assigned == {}, "the probe gives its partitions back"


def test_a_partition_no_fetch_answered_is_left_to_listoffsets() -> None:
    consumer = Consumer({0: 9000, 1: 7000})
    ends = fetched_high_watermarks(consumer, "payments", {0: 10, 1: 20, 2: 30}, timeout=0.05)
    assert ends == {0: 9000, 1: 7000}


def test_the_probe_starts_where_the_log_can_end_no_earlier() -> None:
    # ListOffsets can stand behind the log (1 for a 1000-record batch on the embedded broker) and the
    # query's position behind ListOffsets; a partition the planner did not list starts at its floor.
    marks = {0: (0, 1), 1: (0, 500), 3: (0, 7)}
    floors = {0: 900, 1: 100, 2: 40}
    assert probe_starts([0, 1, 2, 3], marks, floors) == {0: 900, 1: 500, 2: 40, 3: 7}
