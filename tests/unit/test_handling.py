"""A lane's handling step against the narrowest seams (a handler, a Faust topic): a payment whose work
keeps failing, however it fails, reaches the retry ceiling or an operator's park request and goes to the
review topic; none holds its partition for ever."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from aiokafka.errors import KafkaTimeoutError

from aml_app.gate.acks import Acks
from aml_app.gate.gate import Admission, Admitted
from aml_app.gate.handling import Handling
from aml_app.gate.lane import Lane
from aml_app.gate.options import LanePolicy, ParkRequest
from aml_app.gate.sink import Sink
from aml_app.gate.stats import GateStats
from aml_app.models import Payment

DEADLINE = 20.0


class Message:
    def __init__(self, partition: int, offset: int, value: bytes = b"{}") -> None:
        self.topic, self.partition, self.offset, self.key, self.value = (
            "payments",
            partition,
            offset,
            b"k",
            value,
        )
        self.headers: list[tuple[str, bytes]] = []
        self.timestamp: float | None = None


class Event:
    """What the lane hands over: Faust's event (weakly referenced as the current event)."""

    def __init__(self, partition: int, offset: int, value: bytes = b"{}") -> None:
        self.message = Message(partition, offset, value)


class Topic:
    """A Faust topic whose broker refuses every send (`fails`) or keeps each record."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.sent: list[dict[str, Any]] = []

    async def send(self, **record: Any) -> asyncio.Future[None]:
        if self.fails:
            raise KafkaTimeoutError("the broker did not answer")
        self.sent.append(record)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def admitted(partition: int, offset: int) -> Admitted:
    payment = Payment(
        payment_id=f"p-{offset}",
        payer="a",
        payee="b",
        amount="1.00",
        currency="EUR",
        ts="2026-11-20T10:00:00Z",
    )
    admission = Admission(partition, offset, watermark=offset + 1, dependencies={}, waited_ms=0.0, gated=True)
    return Admitted(Event(partition, offset), payment, admission)  # type: ignore[arg-type]


async def failing_send(payment: Payment, admission: Admission) -> asyncio.Future[None]:
    """A handler whose decision the broker never acknowledges."""
    sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    sent.set_exception(KafkaTimeoutError("the decision was not acknowledged"))
    return sent


def handling(policy: LanePolicy, dead_letters: Topic | None = None) -> tuple[Handling, Topic]:
    review = Topic()
    sink = Sink(dead_letters or Topic(), review, "aml-0", GateStats())  # type: ignore[arg-type]
    return Handling(failing_send, None, sink, GateStats(), policy), review


async def test_a_payment_whose_sends_keep_failing_is_parked_at_the_retry_ceiling() -> None:
    """The lane's acks hand a failed send back (`redo`): its failures count toward AML_MAX_ATTEMPTS."""
    lane, review = handling(LanePolicy(max_attempts=3))
    one = admitted(0, 7)
    await asyncio.wait_for(lane.redo([one], KafkaTimeoutError("the decision was not acknowledged")), DEADLINE)
    [parked] = review.sent
    headers = dict(parked["headers"])
    assert headers["review.kind"] == b"parked" and headers["review.attempts"] == b"3"
    assert headers["review.reason"].startswith(b"parked after 3 failed attempts: KafkaTimeoutError")


async def test_a_batch_whose_sends_keep_failing_is_parked_one_payment_at_a_time() -> None:
    lane, review = handling(LanePolicy(max_attempts=2))
    batch = [admitted(1, 4), admitted(1, 5)]
    await asyncio.wait_for(lane.redo(batch, KafkaTimeoutError("lost")), DEADLINE)
    assert [dict(r["headers"])["review.offset"] for r in review.sent] == [b"4", b"5"]


async def test_an_operator_parks_a_payment_whose_sends_keep_failing() -> None:
    asked = {(0, 9): ParkRequest(by="ops@host", reason="broker quota")}
    lane, review = handling(LanePolicy(park_requested=lambda p, o: asked.get((p, o))))
    await asyncio.wait_for(lane.redo([admitted(0, 9)], KafkaTimeoutError("lost")), DEADLINE)
    [parked] = review.sent
    assert dict(parked["headers"])["review.reason"].startswith(b"parked by hand (ops@host: broker quota)")


async def test_a_dead_letter_the_broker_keeps_refusing_is_parked_at_the_retry_ceiling() -> None:
    """A payment that breaks the contract and cannot be dead-lettered goes to review with both reasons."""
    lane, review = handling(LanePolicy(max_attempts=2), dead_letters=Topic(fails=True))
    event = Event(2, 11, b"{bad")
    await asyncio.wait_for(lane.dead_letter(event, "value is not JSON"), DEADLINE)  # type: ignore[arg-type]
    [parked] = review.sent
    headers = dict(parked["headers"])
    assert parked["value"] == b"{bad" and headers["review.offset"] == b"11"
    reason = headers["review.reason"]
    assert reason.startswith(b"parked after 2 failed attempts: KafkaTimeoutError") and reason.endswith(
        b"the broker did not answer; it breaks the contract (value is not JSON) and its dead letter failed"
    )


async def test_an_operator_parks_a_dead_letter_the_broker_keeps_refusing() -> None:
    asked = {(2, 12): ParkRequest(by="ops@host", reason="dlq acl")}
    lane, review = handling(
        LanePolicy(park_requested=lambda p, o: asked.get((p, o))), dead_letters=Topic(fails=True)
    )
    await asyncio.wait_for(lane.dead_letter(Event(2, 12, b"[1]"), "not an object"), DEADLINE)  # type: ignore[arg-type]
    [parked] = review.sent
    assert dict(parked["headers"])["review.reason"].startswith(b"parked by hand (ops@host: dlq acl)")


class CancelledOnce:
    """A handler whose first decision send is cancelled (a producer that stopped cancels what it holds);
    the next ones are acknowledged."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, payment: Payment, admission: Admission) -> asyncio.Future[None]:
        self.calls += 1
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.calls == 1:
            sent.cancel()
        else:
            sent.set_result(None)
        return sent


async def test_a_send_cancelled_under_redo_is_handled_again_and_the_lane_goes_on() -> None:
    """A cancelled send is a failure of the send, not a stop of the lane: a CancelledError leaking out of
    `redo` ended the acker as if revoked, and the partition was never acked again."""
    handler = CancelledOnce()
    review = Topic()
    sink = Sink(Topic(), review, "aml-0", GateStats())  # type: ignore[arg-type]
    lane = Handling(handler, None, sink, GateStats(), LanePolicy(max_attempts=5))
    await asyncio.wait_for(lane.redo([admitted(0, 3)], KafkaTimeoutError("lost")), DEADLINE)
    assert handler.calls == 2 and review.sent == []


class CancelsFirstSend(Topic):
    """A Faust topic whose first send's acknowledgement is cancelled."""

    async def send(self, **record: Any) -> asyncio.Future[None]:
        sent = await super().send(**record)
        if len(self.sent) == 1:
            sent = asyncio.get_running_loop().create_future()
            sent.cancel()
        return sent


async def test_a_dead_letter_whose_send_is_cancelled_is_sent_again() -> None:
    dead_letters = CancelsFirstSend()
    lane, review = handling(LanePolicy(max_attempts=5), dead_letters=dead_letters)
    await asyncio.wait_for(lane.dead_letter(Event(2, 13, b"{bad"), "value is not JSON"), DEADLINE)  # type: ignore[arg-type]
    assert len(dead_letters.sent) == 2 and review.sent == []


async def redo_stopped_by_its_lane() -> tuple[asyncio.Task[None], asyncio.Future[None]]:
    """A redo whose handler's send is never acknowledged (the future returned), cancelled by its lane
    (a revoke) while it waits for that acknowledgement; the redo's task once it has ended."""
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    handled = asyncio.Event()

    async def unacknowledged(payment: Payment, admission: Admission) -> asyncio.Future[None]:
        handled.set()  # the redo's next step, with no turn of the loop between, awaits `never`
        return never

    sink = Sink(Topic(), Topic(), "aml-0", GateStats())  # type: ignore[arg-type]
    lane = Handling(unacknowledged, None, sink, GateStats(), LanePolicy())
    task = asyncio.ensure_future(lane.redo([admitted(0, 4)], KafkaTimeoutError("lost")))
    await asyncio.wait_for(handled.wait(), DEADLINE)
    task.cancel()
    await asyncio.wait({task}, timeout=DEADLINE)
    return task, never


async def test_a_cancel_of_the_lane_still_stops_a_redo() -> None:
    """What a cancelled send is not: the lane's own cancel (a revoke) stops the redo at once."""
    task, _ = await redo_stopped_by_its_lane()
    assert task.done() and task.cancelled()


async def test_a_lane_stopped_during_a_redo_leaves_the_pending_sends_to_the_producer() -> None:
    """A revoke stops the redo, not the broker's acknowledgement it waits for: cancelling that future
    made Faust's callback on it log a traceback and leave its own message pending."""
    task, sent = await redo_stopped_by_its_lane()
    assert task.done() and task.cancelled()
    assert not sent.cancelled()
    sent.set_result(None)


async def test_a_payment_parked_in_its_batch_is_not_handled_again_when_the_others_sends_fail() -> None:
    """A batch at the ceiling is handled one payment at a time: A keeps failing and is parked, B is decided
    and its send fails later. Only B is handled again: A, done once parked, was parked a second time (or
    decided after its parking, had its failure passed)."""
    a, b = admitted(0, 10), admitted(0, 11)
    calls: list[list[int]] = []
    send_failures = [KafkaTimeoutError("B's decision was not acknowledged")]

    async def batch(items: list[tuple[Payment, Admission]]) -> asyncio.Future[None]:
        offsets = [admission.offset for _, admission in items]
        calls.append(offsets)
        if 10 in offsets:
            raise RuntimeError("A's evidence is not fresh")
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if send_failures:
            sent.set_exception(send_failures.pop())
        else:
            sent.set_result(None)
        return sent

    review = Topic()
    handling = Handling(
        None, batch, Sink(Topic(), review, "aml-0", GateStats()), GateStats(), LanePolicy(max_attempts=2)
    )  # type: ignore[arg-type]
    acked: list[int] = []
    everything_acked = asyncio.Event()

    async def ack(event: Event) -> None:
        acked.append(event.message.offset)
        if len(acked) == 2:
            everything_acked.set()

    acks = Acks(SimpleNamespace(rebalancing=False), handling)  # type: ignore[arg-type]
    acks.stream = SimpleNamespace(ack=ack)  # type: ignore[assignment]
    lane = Lane(0)
    lane.current = [a.event, b.event]  # type: ignore[list-item]
    handled = await handling.handle([a, b])
    assert handled.covers == [b]
    await acks.hand_over(lane, [a, b], handled)
    acker = asyncio.ensure_future(acks.run(lane))
    try:
        await asyncio.wait_for(everything_acked.wait(), DEADLINE)
    finally:
        acker.cancel()
    assert acked == [10, 11]
    assert [dict(r["headers"])["review.offset"] for r in review.sent] == [b"10"]
    assert calls == [[10, 11], [10, 11], [10], [10], [11], [11]]


async def test_a_batch_split_in_a_redo_gives_each_payment_its_own_attempts() -> None:
    """With AML_MAX_ATTEMPTS=1 a batch whose send failed once reaches the ceiling at once and is split;
    each payment is then tried alone, as `handle` does, and only one that fails alone is parked (all
    three were parked without an attempt)."""
    calls: list[list[int]] = []

    async def batch(items: list[tuple[Payment, Admission]]) -> None:
        calls.append([admission.offset for _, admission in items])

    review = Topic()
    handling = Handling(
        None, batch, Sink(Topic(), review, "aml-0", GateStats()), GateStats(), LanePolicy(max_attempts=1)
    )  # type: ignore[arg-type]
    batch_of_three = [admitted(0, offset) for offset in (20, 21, 22)]
    await asyncio.wait_for(
        handling.redo(batch_of_three, KafkaTimeoutError("an alert's send timed out")), DEADLINE
    )
    assert calls == [[20], [21], [22]] and review.sent == []


class RefusesFirst(Topic):
    """A Faust topic whose broker refuses the first `refusals` sends, then keeps each record."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    async def send(self, **record: Any) -> asyncio.Future[None]:
        if self.refusals:
            self.refusals -= 1
            raise KafkaTimeoutError("the review topic did not answer")
        return await super().send(**record)


async def test_a_parked_payment_the_review_topic_refuses_shows_as_retrying() -> None:
    """The lane holds on a payment until the review topic has its copy: operators see that in `retrying`
    (the page, `aml-app status`, the metric), not only in the log."""
    review = RefusesFirst(refusals=2)
    sink = Sink(Topic(), review, "aml-0", GateStats())  # type: ignore[arg-type]
    lane = Handling(failing_send, None, sink, GateStats(), LanePolicy(max_attempts=1))
    await asyncio.wait_for(lane.redo([admitted(3, 8)], KafkaTimeoutError("lost")), DEADLINE)
    assert len(review.sent) == 1
    shown = lane.retrying[3]
    assert (shown.offset, shown.attempts) == (8, 3)
    assert shown.error.startswith("writing it to the review topic: KafkaTimeoutError")


async def test_a_batch_is_acked_whole_when_a_rebalance_starts_between_two_of_its_acks() -> None:
    """aiokafka's thread sets Faust's `rebalancing` flag at any moment. When it came between two acks of
    a batch, the acker waited there: the revoke dropped the acks made, the batch was handled again in
    the next generation, and Faust ignored the second ack of an event acked once, so its acked offsets
    began past the committed one and the partition committed nothing for a generation (the acker waited
    at offset 12 for the rebalance, which this test never ends)."""
    app = SimpleNamespace(rebalancing=False)
    acked: list[int] = []

    async def ack(event: Event) -> None:
        acked.append(event.message.offset)
        if len(acked) == 2:
            app.rebalancing = True  # the consumer thread begins a rebalance

    handling = Handling(None, None, Sink(Topic(), Topic(), "aml-0", GateStats()), GateStats(), LanePolicy())  # type: ignore[arg-type]
    acks = Acks(app, handling)  # type: ignore[arg-type]
    acks.stream = SimpleNamespace(ack=ack)  # type: ignore[assignment]
    lane = Lane(0)
    events = [Event(0, offset) for offset in (10, 11, 12, 13)]
    lane.current = events  # type: ignore[assignment]
    admitted_ = [admitted(0, offset) for offset in (10, 11, 12, 13)]
    await asyncio.wait_for(acks.settle(lane, events, admitted_), DEADLINE)  # type: ignore[arg-type]
    assert acked == [10, 11, 12, 13]
