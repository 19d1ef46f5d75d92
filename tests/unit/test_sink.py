"""Where a lane sets a payment aside: the dead-letter and review topics get the original bytes with where
they were read, and the log line names the same place (a topic's offsets repeat across its partitions)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from aml_app.gate.sink import ReviewKind, Sink
from aml_app.gate.stats import GateStats


class Topic:
    """The narrowest seam of a Faust topic: `send` hands back a future the broker would resolve."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, **record: Any) -> asyncio.Future[None]:
        self.sent.append(record)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def event(partition: int, offset: int) -> Any:
    message = SimpleNamespace(topic="payments", partition=partition, offset=offset, key=b"p1", value=b"{bad")
    return SimpleNamespace(message=message)


async def test_a_dead_letter_and_its_log_line_name_the_partition_and_the_offset(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead_letters, review = Topic(), Topic()
    sink = Sink(dead_letters, review, "aml-0", GateStats())  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="aml_app.gate.sink"):
        await sink.dead_letter(event(2, 6144), "value is not JSON")
        await sink.to_review(event(3, 6144), ReviewKind.PARKED, "failed 3 times", attempts=3)
    [letter], [parked] = dead_letters.sent, review.sent
    assert (letter["key"], letter["value"]) == (b"p1", b"{bad")
    headers = dict(letter["headers"])
    assert (headers["dlq.partition"], headers["dlq.offset"], headers["dlq.worker"]) == (
        b"2",
        b"6144",
        b"aml-0",
    )
    assert parked["partition"] == 3 and dict(parked["headers"])["review.partition"] == b"3"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "dead-lettered payments partition 2 offset 6144: value is not JSON",
        "parked payments partition 3 offset 6144: failed 3 times",
    ]
