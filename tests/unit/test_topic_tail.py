"""The demo's topic readers across a jump in a partition's offsets: read again until the jump is
confirmed, so a batch the broker shows late is not skipped (`aml_app.harness.tails.InOrder`, as
`TopicTail` uses it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import TopicPartition

from aml_app.harness import tails
from aml_app.harness.tails import TopicTail

TP = TopicPartition("decisions", 0)


@dataclass
class Record:
    offset: int


class Seeks:
    """The consumer seam: where the reader asked to read again."""

    def __init__(self) -> None:
        self.calls: list[tuple[TopicPartition, int]] = []

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.calls.append((tp, offset))


class Kept(TopicTail):
    def __init__(self) -> None:
        super().__init__(["127.0.0.1:1"], "decisions")
        self.consumer: Any = Seeks()
        self.order.seek = self.consumer.seek
        self.taken: list[int] = []

    def take(self, record: Any) -> None:
        self.taken.append(record.offset)


async def test_a_batch_shown_after_a_later_one_is_read_in_order() -> None:
    tail = Kept()
    assert not tail.receive(TP, [Record(0), Record(1)])
    # Offsets 2..4 are not visible yet: the reader goes back for them rather than past them.
    assert tail.receive(TP, [Record(5), Record(6)])
    assert tail.consumer.calls == [(TP, 2)]
    assert tail.taken == [0, 1]
    assert not tail.receive(TP, [Record(2), Record(3), Record(4), Record(5), Record(6)])
    assert tail.taken == [0, 1, 2, 3, 4, 5, 6]


async def test_a_record_taken_before_a_seek_back_is_not_taken_twice() -> None:
    tail = Kept()
    tail.receive(TP, [Record(0), Record(1)])
    tail.receive(TP, [Record(1), Record(2)])
    assert tail.taken == [0, 1, 2]


async def test_a_jump_that_stays_is_a_gap_in_the_log(monkeypatch: pytest.MonkeyPatch) -> None:
    tail = Kept()
    tail.receive(TP, [Record(0)])
    assert tail.receive(TP, [Record(3)])
    monkeypatch.setattr(tails, "GAP_CONFIRM_S", 0.0)
    assert not tail.receive(TP, [Record(3), Record(4)])
    assert tail.taken == [0, 3, 4]
