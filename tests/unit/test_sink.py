"""Where a lane sets a payment aside: the dead-letter and review topics get the original bytes with where
they were read, and the log line names the same place (a topic's offsets repeat across its partitions)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from aml_app.contract import SET_ASIDE_PART_BYTES
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


def event(partition: int, offset: int, headers: Any = None, timestamp: float | None = None) -> Any:
    message = SimpleNamespace(
        topic="payments",
        partition=partition,
        offset=offset,
        key=b"p1",
        value=b"{bad",
        headers=headers,
        timestamp=timestamp,
    )
    return SimpleNamespace(message=message)


@pytest.mark.parametrize(
    "headers", [[("trace", b"t1"), ("trace", b"t2")], {"trace": b"t1"}], ids=["pairs", "map"]
)
async def test_what_is_set_aside_keeps_its_headers_first_and_its_millisecond(headers: Any) -> None:
    """Faust gives the time in seconds and sends `int(seconds * 1000)`: 2161457298.391 * 1000 is
    2161457298390.9998, which it would truncate to the millisecond before."""
    assert int(2161457298391 / 1000.0 * 1000) == 2161457298390
    dead_letters, review = Topic(), Topic()
    sink = Sink(dead_letters, review, "aml-0", GateStats())  # type: ignore[arg-type]
    await sink.dead_letter(event(2, 6, headers, 2161457298391 / 1000.0), "value is not JSON")
    await sink.to_review(event(2, 7, headers, 2161457298391 / 1000.0), ReviewKind.PARKED, "failed")
    own = list(headers.items()) if isinstance(headers, dict) else headers
    for sent in (dead_letters.sent[0], review.sent[0]):
        assert sent["headers"][: len(own)] == own
        assert int(sent["timestamp"] * 1000) == 2161457298391
    await sink.dead_letter(event(2, 8), "value is not JSON")
    assert dead_letters.sent[-1]["timestamp"] is None, "none read, none sent: the producer stamps it"


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


async def test_a_value_larger_than_a_part_is_set_aside_in_parts_that_rebuild_it() -> None:
    """A record the contract refuses for its size can be larger than any producer or topic takes at
    once (1 MB by default): whole, its send fails for ever and holds the partition."""
    dead_letters, review = Topic(), Topic()
    sink = Sink(dead_letters, review, "aml-0", GateStats())  # type: ignore[arg-type]
    huge = bytes(range(256)) * (2 * SET_ASIDE_PART_BYTES // 256 + 3)
    big = event(1, 77)
    big.message.value = huge
    await sink.dead_letter(big, "value is too large")
    await sink.to_review(big, ReviewKind.PARKED, "failed 3 times", attempts=3)
    for sent, prefix in ((dead_letters.sent, "dlq"), (review.sent, "review")):
        assert len(sent) == 3 and all(len(r["value"]) <= SET_ASIDE_PART_BYTES for r in sent)
        headers = [dict(r["headers"]) for r in sent]
        assert [h[f"{prefix}.part"] for h in headers] == [b"1/3", b"2/3", b"3/3"]
        assert {h[f"{prefix}.bytes"] for h in headers} == {str(len(huge)).encode()}
        assert {h[f"{prefix}.offset"] for h in headers} == {b"77"}
        assert b"".join(r["value"] for r in sent) == huge and {r["key"] for r in sent} == {b"p1"}
    assert all(r["partition"] == 1 for r in review.sent)
    assert sink.stats.dead_lettered == 1 and sink.stats.payments_parked == 1
    # A value that fits is one record, without part headers.
    await sink.dead_letter(event(1, 78), "value is not JSON")
    assert "dlq.part" not in dict(dead_letters.sent[-1]["headers"])


async def test_every_part_leaves_room_for_a_long_key() -> None:
    """Each part carries the record's key: a 500 KB key beside a 512 KiB part is larger than a producer
    at Kafka's defaults sends, and the send would fail for ever."""
    dead_letters = Topic()
    sink = Sink(dead_letters, None, "aml-0", GateStats())  # type: ignore[arg-type]
    long_key = event(1, 79)
    long_key.message.key, long_key.message.value = b"k" * 500_000, bytes(600_000)
    await sink.dead_letter(long_key, "value is too large")
    sent = dead_letters.sent
    assert all(len(r["key"]) + len(r["value"]) <= SET_ASIDE_PART_BYTES for r in sent)
    assert b"".join(r["value"] for r in sent) == bytes(600_000) and {r["key"] for r in sent} == {
        b"k" * 500_000
    }


async def test_a_key_too_long_to_leave_room_for_a_part_travels_in_the_value() -> None:
    """A key of about 1 MB makes any record that carries it larger than a producer at Kafka's defaults
    sends: it goes at the front of the value, and the parts are keyed by its digest."""
    import hashlib

    dead_letters = Topic()
    sink = Sink(dead_letters, None, "aml-0", GateStats())  # type: ignore[arg-type]
    huge_key = event(1, 81)
    key, value = bytes(range(256)) * 3_900, b"{not json"  # 998,400 bytes of key
    huge_key.message.key, huge_key.message.value = key, value
    await sink.dead_letter(huge_key, "key is too long")
    sent = dead_letters.sent
    assert len(sent) == 2 and all(len(r["key"]) + len(r["value"]) <= SET_ASIDE_PART_BYTES for r in sent)
    assert {r["key"] for r in sent} == {b"sha256:" + hashlib.sha256(key).hexdigest().encode()}
    headers = [dict(r["headers"]) for r in sent]
    assert {h["dlq.key-bytes"] for h in headers} == {str(len(key)).encode()}
    joined = b"".join(r["value"] for r in sent)
    assert joined[: len(key)] == key and joined[len(key) :] == value


async def test_the_largest_valid_payment_with_the_longest_key_is_set_aside_whole() -> None:
    from aml_app.contract import MAX_ID_LENGTH, MAX_VALID_PAYMENT_BYTES

    review = Topic()
    sink = Sink(Topic(), review, "aml-0", GateStats())  # type: ignore[arg-type]
    largest = event(1, 80)
    largest.message.key, largest.message.value = (
        "\U0001f600".encode() * MAX_ID_LENGTH,
        bytes(MAX_VALID_PAYMENT_BYTES),
    )
    await sink.to_review(largest, ReviewKind.PARKED, "failed 3 times", attempts=3)
    assert len(review.sent) == 1 and "review.part" not in dict(review.sent[0]["headers"])


class PendingTopic(Topic):
    """A topic whose sends the broker has not acknowledged yet."""

    def __init__(self) -> None:
        super().__init__()
        self.futures: list[asyncio.Future[None]] = []
        self.asked = asyncio.Event()

    async def send(self, **record: Any) -> asyncio.Future[None]:
        self.sent.append(record)
        self.futures.append(asyncio.get_running_loop().create_future())
        self.asked.set()
        return self.futures[-1]


async def test_a_lane_stopped_while_its_dead_letter_is_in_flight_leaves_the_send_to_the_producer() -> None:
    """A rebalance stops the lanes while a dead letter's acknowledgement is awaited: the wait ends, the
    producer's future does not. Cancelled, Faust's callback on it (`Topic._on_published`) logged an
    ERROR traceback at a rebalance of the chaos soak and left its own message pending for ever."""
    dead_letters = PendingTopic()
    sink = Sink(dead_letters, None, "aml-0", GateStats())  # type: ignore[arg-type]
    lane = asyncio.ensure_future(sink.dead_letter(event(3, 179), "field 'amount' must be greater than zero"))
    await asyncio.wait_for(dead_letters.asked.wait(), 5)
    lane.cancel()
    with pytest.raises(asyncio.CancelledError):
        await lane
    [sent] = dead_letters.futures
    assert not sent.cancelled(), "the producer's future was cancelled with the lane"
    sent.set_result(None)
