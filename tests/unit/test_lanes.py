"""GatedConsumer lanes with hand-written stand-ins for the Faust objects it touches; no broker.

Every wait is bounded by a deadline; "does not happen" is checked over a short quiet period.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import IllegalStateError, KafkaTimeoutError
from faust.types import TP

from aml_app.gate import Admission, GatedConsumer
from aml_app.gate.event_time import micros
from aml_app.gate.gate import FreshnessGate
from aml_app.gate.options import LaneLimits, LanePolicy
from aml_app.gate.watermark import WatermarkRow
from aml_app.kafka.deadlines import CancelledWithin
from aml_app.models import Payment

TOPIC = "payments"
DEADLINE = 2.0  # generous upper bound for things that should happen at once
QUIET = 0.05  # how long something must not happen to count as "held"


# --- stand-ins -----------------------------------------------------------------------------------


def payment_value(p: int, o: int, payer: str = "acct-1") -> bytes:
    return json.dumps(
        {
            "payment_id": f"pay-{p}-{o}",
            "payer": payer,
            "payee": "acct-2",
            "amount": "10.00",
            "currency": "EUR",
            "ts": "2026-11-20T10:15:00Z",
        }
    ).encode()


@dataclass
class FakeMessage:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    generation_id: int = 1
    tracked: bool = False
    timestamp: float | None = None  # Faust's: the record's, in seconds (None: the record has none)
    headers: list[tuple[str, bytes]] = field(default_factory=list)

    @property
    def tp(self) -> TP:
        return TP(self.topic, self.partition)


@dataclass
class FakeEvent:
    message: FakeMessage


def event(
    p: int, o: int, key: bytes | None = b"acct-1", value: bytes | None = None, timestamp: float | None = None
) -> FakeEvent:
    if value is None:
        value = payment_value(p, o)
    return FakeEvent(FakeMessage(TOPIC, p, o, key, value, timestamp=timestamp))


def po(e: FakeEvent) -> tuple[int, int]:
    return e.message.partition, e.message.offset


class FakeConsumer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[TP], Any]] = []
        self.seeks: list[tuple[TP, int]] = []
        self.assigned: set[TP] = set()
        self.positions: dict[TP, int | None] = {}
        #: What `position` raises for a partition (revoked under the call: aiokafka's IllegalStateError).
        self.failing: dict[TP, Exception] = {}
        #: The gaps recorded in Faust's commit bookkeeping: (tp, first, last).
        self.gaps: list[tuple[TP, int, int]] = []
        #: Called at each pause/resume; its result is recorded with the call.
        self.probe: Callable[[], Any] = lambda: None

    def pause_partitions(self, tps: Iterable[TP]) -> None:
        self.calls.append(("pause", list(tps), self.probe()))

    def resume_partitions(self, tps: Iterable[TP]) -> None:
        self.calls.append(("resume", list(tps), self.probe()))

    def assignment(self) -> set[TP]:
        return set(self.assigned)

    async def position(self, tp: TP) -> int | None:
        if tp in self.failing:
            raise self.failing[tp]
        return self.positions.get(tp)

    async def seek(self, tp: TP, offset: int) -> None:
        self.seeks.append((tp, offset))

    async def _add_gap(self, tp: TP, first: int, last: int) -> None:
        self.gaps.append((tp, first, last))


class FakeApp:
    def __init__(self) -> None:
        self.consumer = FakeConsumer()
        #: Faust's flag, set from the start of a rebalance to the end of its recovery.
        self.rebalancing = False


class FakeQueue(deque):  # type: ignore[type-arg]
    def empty(self) -> bool:
        return not self

    def get_nowait(self) -> FakeEvent:
        return self.popleft()


class FakeStream:
    """Manual-ack stream: `noack()` is itself; its channel holds the given events, then ends (what
    `dispatch_events` reads of a Faust stream)."""

    def __init__(self, on_ack: Callable[[FakeEvent], None], events: Iterable[FakeEvent] = ()) -> None:
        self.acks: list[tuple[int, int]] = []
        self._on_ack = on_ack
        self.manual = False
        self.should_stop = False
        self.events_total = 0
        self.tracked: list[FakeMessage] = []
        self.channel = SimpleNamespace(queue=FakeQueue(events), __anext__=self._end)
        self.app = SimpleNamespace(
            flow_control=SimpleNamespace(is_active=lambda: True),
            topics=SimpleNamespace(acking_topics={TOPIC}),
            consumer=SimpleNamespace(unacked=SimpleNamespace(add=self.tracked.append)),
            consumer_generation_id=1,
        )
        self._on_message_in = self._on_stream_event_in = lambda *args: None

    def noack(self) -> FakeStream:
        self.manual = True
        return self

    async def _end(self) -> FakeEvent:
        raise StopAsyncIteration  # one batch: every event is dispatched before any lane runs

    async def maybe_start(self) -> bool:
        return False

    def _channel_stop_iteration(self, channel: Any) -> None:
        pass

    async def ack(self, e: FakeEvent) -> bool:
        self._on_ack(e)
        self.acks.append(po(e))
        return True


class FakeDeadLetters:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(
        self, *, key: bytes | None, value: bytes | None, headers: list, timestamp: float | None = None
    ) -> asyncio.Future[None]:
        self.sent.append({"key": key, "value": value, "headers": dict(headers)})
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


class FakeReview(FakeDeadLetters):
    """The review topic; its broker refuses the next `refusals` sends."""

    refusals = 0

    async def send(  # type: ignore[override]
        self,
        *,
        key: bytes | None,
        value: bytes | None,
        partition: int,
        headers: list,
        timestamp: float | None = None,
    ) -> asyncio.Future[None]:
        if self.refusals:
            self.refusals -= 1
            raise KafkaTimeoutError("the review topic did not answer")
        return await super().send(
            key=key, value=value, headers=[*headers, ("partition", str(partition).encode())]
        )


def row(p: int, w: int) -> WatermarkRow:
    return WatermarkRow(partition=p, watermark=w, dependencies={"relations": w}, refreshed_at=0.0)


class Harness:
    """One GatedConsumer over the fakes; the handler records what it processed, in order."""

    def __init__(
        self,
        *,
        gate_enabled: bool = True,
        max_pending: int = 1000,
        max_batch: int = 1,
        max_attempts: int = 0,
        stale_after: float | None = None,
    ) -> None:
        self.rows: dict[int, dict[str, Any]] = {}
        self.gate = FreshnessGate(lookup=self.rows.get)
        self.app = FakeApp()
        self.dlq = FakeDeadLetters()
        self.review = FakeReview()
        self.calls: list[tuple[int, int]] = []  # every handler call, failed or not
        self.handled: list[tuple[int, int]] = []  # successful handler calls
        self.admissions: dict[tuple[int, int], Admission] = {}
        self.failures: dict[tuple[int, int], int] = {}  # (p, o) -> how many first calls raise
        self.violations: list[str] = []
        self.batches: list[list[tuple[int, int]]] = []  # every batch handler call, in order
        self.gated = GatedConsumer(
            self.app,  # type: ignore[arg-type]
            self.gate,
            self.handle if max_batch == 1 else None,
            self.dlq,  # type: ignore[arg-type]
            batch_handler=self.handle_batch if max_batch > 1 else None,
            limits=LaneLimits(max_batch=max_batch, max_pending=max_pending),
            policy=LanePolicy(gate_enabled=gate_enabled, max_attempts=max_attempts, stale_after=stale_after),
            worker_id="w-test",
            review=self.review,  # type: ignore[arg-type]
        )
        self.stream = self.new_stream()
        self.gated.acks.stream = self.stream  # type: ignore[assignment]
        self.tasks: set[asyncio.Task[None]] = set()

    def new_stream(self, events: Iterable[FakeEvent] = ()) -> FakeStream:
        return FakeStream(self._check_ack, events)

    @property
    def acks(self) -> list[tuple[int, int]]:
        return self.stream.acks

    def _check_ack(self, e: FakeEvent) -> None:
        key = po(e)
        if key in self.stream.acks:
            self.violations.append(f"{key} acked twice")
        dead = any(
            s["headers"]["dlq.partition"] == str(key[0]).encode()
            and s["headers"]["dlq.offset"] == str(key[1]).encode()
            for s in self.dlq.sent
        )
        parked = any(
            s["headers"]["review.kind"] == b"parked"
            and s["headers"]["review.partition"] == str(key[0]).encode()
            and s["headers"]["review.offset"] == str(key[1]).encode()
            for s in self.review.sent
        )
        if key not in self.handled and not dead and not parked:
            self.violations.append(f"{key} acked before it was handled or dead-lettered")

    async def handle(self, payment: Payment, admission: Admission) -> None:
        key = (admission.partition, admission.offset)
        self.calls.append(key)
        assert payment.payment_id == f"pay-{key[0]}-{key[1]}"
        await asyncio.sleep(0)  # let the other lanes run in between
        if self.failures.get(key, 0) > 0:
            self.failures[key] -= 1
            raise RuntimeError(f"handler failure at {key}")
        self.admissions[key] = admission
        self.handled.append(key)

    async def handle_batch(self, items: list[tuple[Payment, Admission]]) -> None:
        keys = [(a.partition, a.offset) for _, a in items]
        self.batches.append(keys)
        for key in keys:
            if self.gated.admitter.gate_enabled and not self.gate.is_open(*key):
                self.violations.append(f"{key} handed to the handler while its partition was closed")
            if self.failures.get(key, 0) > 0:
                self.failures[key] -= 1
                raise RuntimeError(f"batch failure at {key}")
        await asyncio.sleep(0)
        for key, (_, admission) in zip(keys, items, strict=True):
            self.admissions[key] = admission
            self.handled.append(key)

    def open(self, p: int, watermark: int) -> None:
        self.rows[p] = row(p, watermark)
        self.gate.notify([p])

    def _track(self) -> None:
        self.tasks.update(lane.task for lane in self.gated.lanes.values() if lane.task is not None)

    def dispatch(self, *events: FakeEvent) -> None:
        for e in events:
            self.gated._dispatch(e)  # type: ignore[arg-type]
        self._track()

    def assign(self, starts: dict[int, int]) -> None:
        self.gated.on_assigned(starts)
        self._track()

    def of(self, items: list[tuple[int, int]], p: int) -> list[int]:
        return [o for q, o in items if q == p]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), DEADLINE)
        notifications = list(self.gate._notifications)
        if notifications:
            await asyncio.wait_for(asyncio.gather(*notifications, return_exceptions=True), DEADLINE)


async def until(predicate: Callable[[], bool], what: str) -> None:
    async def poll() -> None:
        while True:  # polling like tests.harness.wait_until, but bounded by wait_for
            if predicate():
                return
            await asyncio.sleep(0.002)

    try:
        await asyncio.wait_for(poll(), DEADLINE)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


async def quiet() -> None:
    await asyncio.sleep(QUIET)


@pytest.fixture
async def make() -> AsyncIterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def build(**kwargs: Any) -> Harness:
        h = Harness(**kwargs)
        made.append(h)
        return h

    yield build
    for h in made:
        await h.close()


# --- tests ---------------------------------------------------------------------------------------


async def test_in_order_processing_and_acks_per_partition(make: Callable[..., Harness]) -> None:
    h = make()
    h.open(0, 100)
    h.open(1, 100)
    events = [event(p, o) for o in range(5) for p in (0, 1)]
    h.stream = h.new_stream(events)
    await asyncio.wait_for(h.gated.consume(h.stream), DEADLINE)  # type: ignore[arg-type]
    assert h.stream.manual and h.gated.acks.stream is h.stream
    h._track()

    await until(lambda: len(h.acks) == 10, "all ten payments acked")
    assert h.violations == []
    for p in (0, 1):
        assert h.of(h.handled, p) == [0, 1, 2, 3, 4]
        assert h.of(h.acks, p) == [0, 1, 2, 3, 4]  # contiguous, in offset order
    assert h.acks == h.handled  # each ack right after its handler finished
    assert h.dlq.sent == []
    assert {lane.done for lane in h.gated.lanes.values()} == {5}


async def test_gate_holds_each_payment_until_the_watermark_passes_it(make: Callable[..., Harness]) -> None:
    h = make()
    h.open(0, 2)
    h.open(1, 100)
    h.dispatch(*(event(0, o) for o in range(4)))

    await until(lambda: h.gate.waiting == {0: 2}, "offset 2 waiting at the gate")
    assert h.handled == [(0, 0), (0, 1)]
    assert h.acks == [(0, 0), (0, 1)]

    # No head-of-line blocking: partition 1 flows while partition 0 is held.
    h.dispatch(*(event(1, o) for o in range(3)))
    await until(lambda: h.of(h.acks, 1) == [0, 1, 2], "partition 1 acked while partition 0 waits")
    assert h.of(h.handled, 0) == [0, 1]

    h.open(0, 2)  # a refresh that does not move the watermark keeps it waiting
    await quiet()
    assert h.of(h.handled, 0) == [0, 1]

    h.open(0, 3)  # 2 < 3: offset 2 goes; watermark == 3 keeps offset 3 waiting
    await until(lambda: (0, 2) in h.acks, "offset 2 acked once the watermark passed it")
    await until(lambda: h.gate.waiting == {0: 3}, "offset 3 waiting at the gate")
    await quiet()
    assert h.of(h.handled, 0) == [0, 1, 2]

    h.open(0, 4)
    await until(lambda: h.of(h.acks, 0) == [0, 1, 2, 3], "offset 3 acked")
    assert h.of(h.handled, 0) == [0, 1, 2, 3]
    assert h.violations == []
    held = h.admissions[(0, 2)]
    assert held == Admission(
        partition=0,
        offset=2,
        watermark=3,
        dependencies={"relations": 3},
        waited_ms=held.waited_ms,
        gated=True,
    )
    assert held.waited_ms >= QUIET * 1000 / 2


async def test_handler_exception_is_retried_never_skipped(make: Callable[..., Harness]) -> None:
    h = make()
    h.open(0, 100)
    h.open(1, 100)
    h.failures[(0, 1)] = 2  # default backoff: 0.1 s + 0.2 s
    h.dispatch(*(event(0, o) for o in range(3)))

    await until(lambda: h.calls.count((0, 1)) >= 1, "first attempt at offset 1")
    h.dispatch(*(event(1, o) for o in range(3)))
    await until(lambda: h.of(h.acks, 1) == [0, 1, 2], "partition 1 acked while partition 0 retries")
    assert (0, 1) not in h.handled
    assert (0, 2) not in h.calls

    await until(lambda: h.of(h.acks, 0) == [0, 1, 2], "partition 0 acked after the retries")
    assert h.of(h.calls, 0) == [0, 1, 1, 1, 2]  # offset 2 only after offset 1 succeeded
    assert h.of(h.handled, 0) == [0, 1, 2]
    assert h.acks.count((0, 1)) == 1
    assert h.violations == []


async def test_invalid_payments_are_dead_lettered_in_order_without_the_gate(
    make: Callable[..., Harness],
) -> None:
    h = make()  # no row for partition 0: its gate is closed
    consulted: list[tuple[int, int]] = []
    wait_open = h.gate.wait_open

    async def spy(partition: int, offset: int, *args: Any) -> Any:
        consulted.append((partition, offset))
        return await wait_open(partition, offset, *args)

    h.gate.wait_open = spy  # type: ignore[method-assign]
    bad_json = b'{"payment_id": "pay-0-0", '
    null_key_value = payment_value(0, 1)
    h.dispatch(
        event(0, 0, value=bad_json),
        event(0, 1, key=None, value=null_key_value),
        event(0, 2),
        event(0, 3, value=b"not json at all"),
    )

    await until(lambda: h.gate.waiting == {0: 2}, "the valid payment waiting at the gate")
    await quiet()
    assert h.acks == [(0, 0), (0, 1)]
    assert h.handled == []
    assert consulted == [(0, 2)]
    assert len(h.dlq.sent) == 2  # offset 3 waits behind offset 2
    first, second = h.dlq.sent
    assert first["key"] == b"acct-1" and first["value"] == bad_json
    assert first["headers"]["dlq.reason"].startswith(b"value is not JSON")
    assert first["headers"]["dlq.topic"] == TOPIC.encode()
    assert (first["headers"]["dlq.partition"], first["headers"]["dlq.offset"]) == (b"0", b"0")
    assert first["headers"]["dlq.worker"] == b"w-test"
    assert second["key"] is None and second["value"] == null_key_value
    assert second["headers"]["dlq.reason"].startswith(b"key is missing (null)")
    assert second["headers"]["dlq.offset"] == b"1"

    h.open(0, 10)
    await until(lambda: h.acks == [(0, 0), (0, 1), (0, 2), (0, 3)], "all four acked in order")
    assert h.handled == [(0, 2)]
    assert consulted == [(0, 2)]
    assert [s["headers"]["dlq.offset"] for s in h.dlq.sent] == [b"0", b"1", b"3"]
    assert h.dlq.sent[2]["value"] == b"not json at all"
    assert h.gated.stats.dead_lettered == 3
    assert h.violations == []


async def test_a_payment_timestamped_after_its_record_and_the_skew_is_dead_lettered(
    make: Callable[..., Harness],
) -> None:
    """The lane hands the contract Faust's record timestamp: `ts` up to AML_MAX_CLOCK_SKEW (5 s by
    default) after it is a payment, a millisecond more a dead letter, and a record without a timestamp
    is not bounded."""
    h = make()  # no row for partition 0: its gate is closed
    ts = micros("2026-11-20T10:15:00Z") / 1_000_000  # every payment's `ts`, in Faust's seconds
    h.dispatch(
        event(0, 0, timestamp=ts - 5),
        event(0, 1, timestamp=ts - 5.001),
        event(0, 2, timestamp=None),
    )
    await until(lambda: h.gate.waiting == {0: 0}, "the payment at the bound waiting at the gate")
    h.open(0, 10)
    await until(lambda: h.acks == [(0, 0), (0, 1), (0, 2)], "all three acked in order")
    assert h.handled == [(0, 0), (0, 2)]
    [letter] = h.dlq.sent
    assert letter["headers"]["dlq.offset"] == b"1" and letter["value"] == payment_value(0, 1)
    assert letter["headers"]["dlq.reason"].decode() == (
        "field 'ts' 2026-11-20T10:15:00Z is more than the allowed clock skew of 5 s (AML_MAX_CLOCK_SKEW) "
        "after its Kafka record's timestamp 2026-11-20T10:14:54.999Z: a payment cannot happen after it "
        "was sent"
    )
    assert h.violations == []


async def test_rebalance_keeps_resumes_deduplicates_or_drops_pending(make: Callable[..., Harness]) -> None:
    h = make()  # both partitions closed
    h.dispatch(*(event(p, o) for p in (0, 1) for o in range(3)))
    await until(lambda: h.gate.waiting == {0: 0, 1: 0}, "both lanes waiting")
    old_tasks = [lane.task for lane in h.gated.lanes.values()]

    h.gated.on_revoked()
    results = await asyncio.wait_for(asyncio.gather(*old_tasks, return_exceptions=True), DEADLINE)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert h.gated.lanes == {}
    assert h.gated.starts == {}
    assert {p: [po(e)[1] for e in events] for p, events in h.gated.kept.items()} == {
        0: [0, 1, 2],
        1: [0, 1, 2],
    }
    assert h.gate.waiting == {}
    assert h.acks == [] and h.handled == []

    h.assign({0: 0})  # partition 0 stays here, partition 1 went elsewhere
    assert h.gated.kept == {}
    assert set(h.gated.lanes) == {0}
    h.dispatch(*(event(0, o) for o in range(4)))  # re-delivery of 0..2, then new offset 3
    h.open(0, 100)
    h.open(1, 100)
    await until(lambda: h.acks == [(0, 0), (0, 1), (0, 2), (0, 3)], "the kept payments resumed")
    await quiet()
    assert h.handled == [(0, 0), (0, 1), (0, 2), (0, 3)]  # each exactly once
    assert h.acks == h.handled
    assert 1 not in h.gated.lanes  # the dropped partition's kept events are never handled
    assert h.violations == []


async def test_kept_payments_wait_for_the_recovery_of_the_generation_that_gives_them_back(
    make: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept events come from memory, past Faust's pause of the partition while it recovers its tables:
    resumed before that recovery, a kept payment is checked against an `alerts-sent` store that lacks
    what the partition's owner in between alerted on."""
    h = make()
    h.dispatch(*(event(0, o) for o in range(3)))
    await until(lambda: h.gate.waiting == {0: 0}, "the lane waiting")
    h.app.rebalancing = True  # aiokafka's thread sets it when the revoke begins
    h.gated.on_revoked()
    h.open(0, 100)

    async def starts(*args: Any) -> tuple[dict[int, int], str | None]:
        return {0: 0}, None

    monkeypatch.setattr(h.gated.delivery, "starts", starts)
    learning = asyncio.ensure_future(
        h.gated._learn_starts(["broker:9092"], "group", [TP(TOPIC, 0)], lambda: None, h.gated.assignment)
    )
    await quiet()
    assert not learning.done() and h.gated.lanes == {} and h.handled == []
    assert not h.gated.assignment.known

    h.app.rebalancing = False  # Faust's recovery of this generation resumed its streams
    await asyncio.wait_for(learning, DEADLINE)
    h._track()
    await until(lambda: h.acks == [(0, 0), (0, 1), (0, 2)], "the kept payments resumed")
    assert h.handled == [(0, 0), (0, 1), (0, 2)]

    # A newer rebalance during the wait: the stale assignment resumes nothing.
    h.dispatch(event(0, 3))
    h.app.rebalancing = True
    h.gated.on_revoked()
    stale = h.gated.assignment
    learning = asyncio.ensure_future(
        h.gated._learn_starts(["broker:9092"], "group", [TP(TOPIC, 0)], lambda: None, stale)
    )
    await quiet()
    h.gated.on_revoked()
    await asyncio.wait_for(learning, DEADLINE)
    h.app.rebalancing = False
    await quiet()
    assert not stale.known and h.gated.lanes == {}
    assert h.handled == [(0, 0), (0, 1), (0, 2)]


async def test_back_pressure_pauses_and_resumes_only_the_blocked_partition(
    make: Callable[..., Harness],
) -> None:
    h = make(max_pending=3)
    h.open(1, 100)
    tp0 = TP(TOPIC, 0)
    h.app.consumer.probe = lambda: list(h.handled)

    # Partition 1 flows: its lane never holds max_pending events, so it is never paused.
    for o in range(5):
        h.dispatch(event(1, o))
        await until(lambda o=o: (1, o) in h.acks, f"partition 1 offset {o} acked")

    h.dispatch(event(0, 0), event(0, 1))
    assert h.app.consumer.calls == []
    h.dispatch(event(0, 2))  # the third event queued: pause
    assert h.app.consumer.calls == [("pause", [tp0], list(h.handled))]
    await until(lambda: h.gate.waiting == {0: 0}, "partition 0 waiting")
    h.dispatch(event(0, 3))  # already paused: no second pause
    await quiet()
    assert [c[:2] for c in h.app.consumer.calls] == [("pause", [tp0])]

    h.open(0, 100)
    await until(lambda: h.of(h.acks, 0) == [0, 1, 2, 3], "partition 0 drained")
    _, resume = h.app.consumer.calls
    # Resumed when the lane took offset 2, leaving 1 queued (<= 3 // 2); not when it left 2 queued.
    assert resume[:2] == ("resume", [tp0])
    assert h.of(resume[2], 0) == [0, 1]
    assert not h.gated.lanes[0].paused
    # Fetched again from the first offset the lane has not had (offset 3 was queued): Faust drops what
    # its current fetch held of a partition it pauses.
    assert h.app.consumer.seeks == [(tp0, 4)]
    assert h.violations == []


async def test_check_delivery_refetches_only_what_never_reached_a_lane(make: Callable[..., Harness]) -> None:
    h = make()
    tp0 = TP(TOPIC, 0)
    consumer = h.app.consumer
    consumer.assigned = {tp0}
    consumer.positions[tp0] = 5

    h.assign({0: 0})
    await h.gated.check_delivery(TOPIC, quiet=1.0)
    assert consumer.seeks == []  # just assigned: not quiet long enough yet

    h.gated.assignment.known_at = time.monotonic() - 10
    await h.gated.check_delivery(TOPIC, quiet=1.0)
    assert consumer.seeks == [(tp0, 0)]
    assert h.gated.stats.refetches == 1

    # A lane that has seen offsets up to 4 expects 5: position 5 means nothing is missing.
    consumer.seeks.clear()
    h.open(0, 100)
    h.dispatch(event(0, 4))
    await until(lambda: h.acks == [(0, 4)], "offset 4 acked")
    lane = h.gated.lanes[0]
    assert lane.next_offset == 5
    lane.last_dispatch = time.monotonic() - 10
    await h.gated.check_delivery(TOPIC, quiet=1.0)
    assert consumer.seeks == []
    assert h.gated.stats.refetches == 1

    consumer.positions[tp0] = 7  # 5 and 6 were fetched but never dispatched
    await h.gated.check_delivery(TOPIC, quiet=1.0)
    assert consumer.seeks == [(tp0, 5)]
    assert h.gated.stats.refetches == 2


async def test_a_delivery_check_that_fails_on_one_partition_checks_the_others_and_never_raises(
    make: Callable[..., Harness],
) -> None:
    """It runs on a timer, which stops for good (and stops the worker) when it raises: a partition
    revoked between the assignment and the position (aiokafka's IllegalStateError) fails only its check."""
    h = make()
    tp0, tp1 = TP(TOPIC, 0), TP(TOPIC, 1)
    consumer = h.app.consumer
    consumer.assigned = {tp0, tp1}
    consumer.positions[tp1] = 3
    consumer.failing[tp0] = IllegalStateError(f"No current assignment for partition {tp0}")
    h.assign({0: 0, 1: 0})
    h.gated.assignment.known_at = time.monotonic() - 10
    await h.gated.check_delivery(TOPIC, quiet=1.0)
    assert consumer.seeks == [(tp1, 0)] and h.gated.stats.refetches == 1
    consumer.failing[tp0] = CancelledWithin("the position was cancelled by the code it called")
    await h.gated.check_delivery(TOPIC, quiet=1.0)
    assert consumer.seeks == [(tp1, 0), (tp1, 0)]


async def test_gate_disabled_handles_at_once(make: Callable[..., Harness]) -> None:
    h = make(gate_enabled=False)
    h.rows[1] = row(1, 0)  # closed for offset 0
    h.dispatch(event(0, 0), event(0, 1), event(1, 0))
    await until(lambda: len(h.acks) == 3, "all acked with the gate closed")
    assert h.of(h.handled, 0) == [0, 1]
    assert h.gate.waiting == {}
    assert all(not a.gated for a in h.admissions.values())
    assert (h.admissions[(0, 0)].watermark, h.admissions[(0, 0)].dependencies) == (-1, {})
    assert (h.admissions[(1, 0)].watermark, h.admissions[(1, 0)].dependencies) == (0, {"relations": 0})
    assert h.violations == []


# --- batches -------------------------------------------------------------------------------------


async def test_a_batch_takes_the_open_payments_behind_its_head_and_never_waits_for_more(
    make: Callable[..., Harness],
) -> None:
    h = make(max_batch=4)
    h.dispatch(*(event(0, o) for o in range(10)))
    await quiet()
    assert h.batches == [] and h.acks == []
    h.open(0, 6)
    await until(lambda: len(h.acks) == 6, "offsets 0..5 acked")
    assert h.batches == [[(0, o) for o in range(4)], [(0, 4), (0, 5)]]
    await quiet()
    assert len(h.acks) == 6, "a closed payment joined a batch"
    h.open(0, 10)
    await until(lambda: len(h.acks) == 10, "offsets 6..9 acked")
    assert h.batches[2:] == [[(0, 6), (0, 7), (0, 8), (0, 9)]]
    assert h.acks == [(0, o) for o in range(10)]
    assert h.violations == []


async def test_a_dead_letter_inside_a_batch_keeps_the_acks_in_offset_order(
    make: Callable[..., Harness],
) -> None:
    h = make(max_batch=8)
    h.open(1, 100)
    h.dispatch(event(1, 0), event(1, 1, value=b"not json"), event(1, 2), event(1, 3))
    await until(lambda: len(h.acks) == 4, "four acks")
    assert h.acks == [(1, 0), (1, 1), (1, 2), (1, 3)]
    assert [s["headers"]["dlq.offset"] for s in h.dlq.sent] == [b"1"]
    assert [k for batch in h.batches for k in batch] == [(1, 0), (1, 2), (1, 3)]
    assert h.violations == []


async def test_a_failing_batch_is_retried_whole_and_acked_only_after(make: Callable[..., Harness]) -> None:
    h = make(max_batch=8)
    h.failures[(2, 1)] = 1
    h.open(2, 100)
    h.dispatch(*(event(2, o) for o in range(3)))
    await until(lambda: len(h.acks) == 3, "three acks after the retry")
    assert h.batches[0] == h.batches[1] == [(2, 0), (2, 1), (2, 2)], "the failed batch is retried whole"
    assert h.handled == [(2, 0), (2, 1), (2, 2)] and h.violations == []


def test_one_kind_of_handler_and_a_sane_batch_size() -> None:
    h = Harness()
    with pytest.raises(ValueError, match="either a handler or a batch_handler"):
        GatedConsumer(h.app, h.gate, h.handle, h.dlq, batch_handler=h.handle_batch)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_batch"):
        GatedConsumer(h.app, h.gate, h.handle, h.dlq, limits=LaneLimits(max_batch=2))  # type: ignore[arg-type]


# --- holes in delivery ---------------------------------------------------------------------------


class FakeLog:
    """What the partition's log holds: the first record at or after an offset, as the broker answers."""

    def __init__(self, offsets: Iterable[int]) -> None:
        self.offsets = sorted(offsets)
        self.asked: list[tuple[int, int]] = []
        self.answer = asyncio.Event()
        self.answer.set()

        #: How many reads still find nothing in time (the hole reader's None: "assume the records exist").
        self.unanswered = 0
        #: Where a read lands when the offset asked is past the log's end (a log truncated or created
        #: again: the hole reader resets to the log start), else None.
        self.reset_to: int | None = None

    async def first_offset(self, partition: int, offset: int) -> int | None:
        self.asked.append((partition, offset))
        await asyncio.wait_for(self.answer.wait(), DEADLINE)
        if self.unanswered:
            self.unanswered -= 1
            return None
        if self.reset_to is not None:
            return self.reset_to
        return next((o for o in self.offsets if o >= offset), None)


async def test_a_lane_never_runs_past_records_the_consumer_skipped(make: Callable[..., Harness]) -> None:
    h = make()
    log_ = FakeLog(range(20))
    h.gated.delivery.first_offset = log_.first_offset
    tp0 = TP(TOPIC, 0)
    h.assign({0: 0})
    h.open(0, 100)
    h.dispatch(event(0, 0), event(0, 1), event(0, 5), event(0, 6))  # 2..4 never reached the stream
    await until(lambda: h.app.consumer.seeks == [(tp0, 2)], "fetched again from offset 2")
    await quiet()
    assert h.handled == [(0, 0), (0, 1)], "a payment past the hole was processed"
    assert log_.asked == [(0, 2)]
    assert h.gated.stats.holes_refetched == 1

    h.dispatch(*(event(0, o) for o in range(2, 8)))  # the refetch delivers 2.. in order
    await until(lambda: len(h.acks) == 8, "offsets 0..7 acked")
    assert h.handled == [(0, o) for o in range(8)]
    assert h.acks == [(0, o) for o in range(8)]
    assert h.violations == [] and h.gated.lanes[0].hole is None
    # Records exist there: telling Faust it may commit over them would lose them at the next crash.
    assert h.app.consumer.gaps == []


async def test_a_gap_in_the_log_itself_is_crossed_with_the_held_payments_in_order(
    make: Callable[..., Harness],
) -> None:
    h = make()
    log_ = FakeLog([0, 1, 5, 6, 7])  # 2..4 are not records (transaction markers, compaction)
    log_.answer.clear()
    h.gated.delivery.first_offset = log_.first_offset
    h.assign({0: 0})
    h.open(0, 100)
    h.dispatch(event(0, 0), event(0, 1), event(0, 5), event(0, 6))
    await until(lambda: log_.asked == [(0, 2)], "the log asked about offset 2")
    h.dispatch(event(0, 7))  # arrives while the log is being read: held too
    await quiet()
    assert h.handled == [(0, 0), (0, 1)]
    log_.answer.set()
    await until(lambda: len(h.acks) == 5, "all five acked")
    assert h.handled == [(0, 0), (0, 1), (0, 5), (0, 6), (0, 7)]
    assert h.app.consumer.seeks == [] and h.gated.stats.gaps_accepted == 1 and h.violations == []
    assert h.app.consumer.gaps == [(TP(TOPIC, 0), 2, 4)], "Faust commits over the gap only if told"


async def test_a_gap_the_log_did_not_answer_about_in_time_is_checked_again_when_the_refetch_skips_it(
    make: Callable[..., Harness],
) -> None:
    """The first read of the log finds nothing in time, so the lane fetches the hole again; the broker
    goes on after the gap, and what comes past it opens the question again instead of being held for
    ever (a paused lane is not looked at by the delivery check)."""
    h = make()
    log_ = FakeLog([0, 1, 5, 6, 7])
    log_.unanswered = 1
    h.gated.delivery.first_offset = log_.first_offset
    tp0 = TP(TOPIC, 0)
    h.assign({0: 0})
    h.open(0, 100)
    h.dispatch(event(0, 0), event(0, 1), event(0, 5), event(0, 6))
    await until(lambda: h.app.consumer.seeks == [(tp0, 2)], "fetched again from offset 2")
    h.dispatch(event(0, 5), event(0, 6), event(0, 7))  # the refetch: the log has nothing at 2..4
    await until(lambda: len(h.acks) == 5, "all five acked")
    assert log_.asked == [(0, 2), (0, 2)]
    assert h.handled == [(0, 0), (0, 1), (0, 5), (0, 6), (0, 7)] and h.violations == []
    assert h.gated.stats.gaps_accepted == 1 and h.app.consumer.gaps == [(tp0, 2, 4)]


async def test_a_hole_whose_first_record_lies_inside_it_is_narrowed_to_that_record(
    make: Callable[..., Harness],
) -> None:
    """The log holds no record at the hole's first offset (a transaction marker, or below the log
    start) but holds some inside it: the offsets before the first record are a gap, recorded, and the
    partition is fetched again from that record, which the lane then expects. Asking the log again at
    the hole's start would find the same answer for ever."""
    h = make()
    log_ = FakeLog([0, 1, 3, 4, 5, 6])
    h.gated.delivery.first_offset = log_.first_offset
    tp0 = TP(TOPIC, 0)
    h.assign({0: 0})
    h.open(0, 100)
    h.dispatch(event(0, 0), event(0, 1), event(0, 5))  # 3 and 4 never reached the stream
    await until(lambda: h.app.consumer.seeks != [], "fetched again")
    h.dispatch(event(0, 3), event(0, 4), event(0, 5))  # what the broker delivers from 2 or 3 on
    await until(lambda: len(h.acks) == 5, "all five acked")
    assert h.handled == [(0, 0), (0, 1), (0, 3), (0, 4), (0, 5)] and h.violations == []
    assert h.app.consumer.seeks == [(tp0, 3)] and log_.asked == [(0, 2)]
    assert h.app.consumer.gaps == [(tp0, 2, 2)], "Faust commits over offset 2 only if told"
    assert h.gated.lanes[0].hole is None and h.gated.stats.holes_refetched == 1


async def test_a_log_that_answers_below_the_hole_is_not_believed_to_have_a_gap(
    make: Callable[..., Harness],
) -> None:
    """The hole reader resets to the log start when the offset asked is past the log's end (a log
    truncated, or created again): its answer lies below the hole, says nothing about it, and must not
    move the lane back over payments it handled; the hole is fetched again from where it starts."""
    h = make()
    log_ = FakeLog(range(20))
    log_.reset_to = 0
    h.gated.delivery.first_offset = log_.first_offset
    tp0 = TP(TOPIC, 0)
    h.assign({0: 0})
    h.open(0, 100)
    h.dispatch(event(0, 0), event(0, 1), event(0, 5))
    await until(lambda: h.app.consumer.seeks != [], "fetched again")
    assert h.app.consumer.seeks == [(tp0, 2)] and h.app.consumer.gaps == []
    assert h.gated.lanes[0].next_offset == 2
    h.dispatch(*(event(0, o) for o in range(2, 6)))
    await until(lambda: len(h.acks) == 6, "offsets 0..5 acked")
    assert h.handled == [(0, o) for o in range(6)] and h.violations == []


async def test_stopping_the_consumer_cancels_its_lanes_and_its_hole_checks(
    make: Callable[..., Harness],
) -> None:
    """What the worker's gate service does when it stops: every lane task and every background read
    ends, nothing acked."""
    h = make()
    log_ = FakeLog(range(20))
    log_.answer.clear()  # the hole check waits on the log
    h.gated.delivery.first_offset = log_.first_offset
    h.assign({0: 0, 1: 0})
    h.dispatch(event(0, 0), event(1, 0), event(1, 3))  # partition 0 waits at the gate; 1 has a hole
    await until(lambda: log_.asked == [(1, 1)], "the hole checked")
    tasks = [t for lane in h.gated.lanes.values() for t in lane.tasks()] + list(h.gated._background)
    assert len(tasks) == 5 and not any(t.done() for t in tasks)
    h.gated.stop()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), DEADLINE)
    assert all(t.cancelled() for t in tasks) and h.acks == []


async def test_events_held_past_a_hole_pause_the_partition_at_max_pending(
    make: Callable[..., Harness],
) -> None:
    """While the log is read about a hole, what arrives past it is held: `max_pending` of them pause the
    partition, as a full queue does; the refetch resumes it and the held events come again in order."""
    h = make(max_pending=3)
    log_ = FakeLog(range(20))
    log_.answer.clear()  # the log is slow to answer: the events past the hole pile up
    h.gated.delivery.first_offset = log_.first_offset
    tp0 = TP(TOPIC, 0)
    h.assign({0: 0})
    h.open(0, 100)
    h.dispatch(event(0, 0))
    await until(lambda: h.acks == [(0, 0)], "offset 0 acked")
    h.dispatch(event(0, 4), event(0, 5))  # 1..3 never reached the stream
    await until(lambda: log_.asked == [(0, 1)], "the log asked about offset 1")
    assert h.app.consumer.calls == []
    h.dispatch(event(0, 6))  # the third held event: pause
    assert [c[:2] for c in h.app.consumer.calls] == [("pause", [tp0])]
    assert h.gated.lanes[0].paused and len(h.gated.lanes[0].held) == 3

    log_.answer.set()  # records exist at 1..3: fetched again, and the partition fetched again
    await until(lambda: h.app.consumer.seeks == [(tp0, 1)], "fetched again from offset 1")
    assert [c[:2] for c in h.app.consumer.calls] == [("pause", [tp0]), ("resume", [tp0])]
    assert not h.gated.lanes[0].paused and h.gated.lanes[0].held == []
    h.dispatch(*(event(0, o) for o in range(1, 8)))
    await until(lambda: len(h.acks) == 8, "offsets 0..7 acked")
    assert h.handled == [(0, o) for o in range(8)] and h.violations == []


async def test_events_before_the_assignment_is_known_pause_the_partition_at_max_pending(
    make: Callable[..., Harness],
) -> None:
    """Events wait in `early` until this worker knows where the generation starts: `max_pending` of a
    partition pause it; once the lane has them, it is fetched again from the first offset it lacks."""
    h = make(max_pending=3)
    h.gated.delivery.first_offset = FakeLog(range(20)).first_offset
    h.gated.topic = TOPIC
    tp0 = TP(TOPIC, 0)
    h.open(0, 100)
    h.dispatch(event(0, 0), event(0, 1))
    assert h.app.consumer.calls == []
    h.dispatch(event(0, 2), event(0, 3))  # the third: pause; the fourth was already fetched
    assert [c[:2] for c in h.app.consumer.calls] == [("pause", [tp0])]
    assert h.handled == [] and 0 not in h.gated.lanes

    h.assign({0: 2})  # 0 and 1 were committed before: dropped; 2 and 3 queued, below max_pending
    await until(lambda: len(h.acks) == 2, "offsets 2 and 3 acked")
    await until(lambda: len(h.app.consumer.calls) == 2, "the partition resumed")
    assert [c[:2] for c in h.app.consumer.calls] == [("pause", [tp0]), ("resume", [tp0])]
    assert h.app.consumer.seeks == [(tp0, 4)]  # what Faust dropped at the pause is fetched again
    h.dispatch(event(0, 4), event(0, 5))
    await until(lambda: len(h.acks) == 4, "offsets 2..5 acked")
    assert h.handled == [(0, o) for o in range(2, 6)] and h.violations == []


async def test_the_first_payment_of_an_assignment_past_its_start_is_a_hole(
    make: Callable[..., Harness],
) -> None:
    h = make()
    log_ = FakeLog(range(40))
    h.gated.delivery.first_offset = log_.first_offset
    tp0 = TP(TOPIC, 0)
    h.open(0, 100)
    h.dispatch(event(0, 33))  # delivered before this worker knows where the generation starts
    await quiet()
    assert h.app.consumer.seeks == [] and h.handled == [] and 0 not in h.gated.lanes
    h.assign({0: 30})  # it starts at the committed offset 30: 30..32 were skipped
    await until(lambda: h.app.consumer.seeks == [(tp0, 30)], "fetched again from the start")
    h.dispatch(event(0, 29), *(event(0, o) for o in range(30, 35)))  # 29: before the start, dropped
    await until(lambda: len(h.acks) == 5, "offsets 30..34 acked")
    assert h.handled == [(0, o) for o in range(30, 35)] and h.violations == []


# --- pipelined sends ------------------------------------------------------------------------------


class Sends:
    """A handler that, like the probe, sends a decision and returns the broker's acknowledgement
    without waiting for it; the test resolves (or fails) each acknowledgement when it wants."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.futures: dict[tuple[int, int], list[asyncio.Future[None]]] = {}
        self.calls: list[tuple[int, int]] = []

    async def handle(self, payment: Payment, admission: Admission) -> asyncio.Future[None]:
        key = (admission.partition, admission.offset)
        self.calls.append(key)
        if self.h.failures.get(key, 0) > 0:
            self.h.failures[key] -= 1
            raise RuntimeError(f"handler failure at {key}")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.futures.setdefault(key, []).append(fut)
        self.h.handled.append(key)
        return fut

    def resolve(self, key: tuple[int, int], error: Exception | None = None) -> None:
        fut = self.futures[key][-1]
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)


def pipelined(make: Callable[..., Harness], **kwargs: Any) -> tuple[Harness, Sends]:
    h = make()
    sends = Sends(h)
    h.gated = GatedConsumer(
        h.app,  # type: ignore[arg-type]
        h.gate,
        sends.handle,
        h.dlq,  # type: ignore[arg-type]
        worker_id="w-test",
        **kwargs,
    )
    h.gated.acks.stream = h.stream  # type: ignore[assignment]
    return h, sends


def check_acks_after_sends(h: Harness, sends: Sends) -> None:
    """Every ack came after the acknowledgement of its payment's decision completed."""
    for key in h.acks:
        assert sends.futures[key][-1].done() and sends.futures[key][-1].exception() is None, key


async def test_decisions_are_pipelined_and_acked_only_in_offset_order_after_their_send(
    make: Callable[..., Harness],
) -> None:
    h, sends = pipelined(make, limits=LaneLimits(max_in_flight=4))
    h.open(0, 100)
    h.dispatch(*(event(0, o) for o in range(6)))

    # Four sends in flight at once, none acknowledged: nothing acked, and the fifth waits for room.
    await until(lambda: len(sends.calls) == 4, "four decisions sent without waiting")
    await quiet()
    assert sends.calls == [(0, o) for o in range(4)] and h.acks == []
    assert h.gated.lanes[0].in_flight == 0

    sends.resolve((0, 2))
    sends.resolve((0, 1))  # acknowledged out of order: offset 0 still holds the acks back
    await quiet()
    assert h.acks == [] and len(sends.calls) == 4

    sends.resolve((0, 0))
    await until(lambda: h.acks == [(0, 0), (0, 1), (0, 2)], "0..2 acked in order")
    await until(lambda: len(sends.calls) == 6, "room again: offsets 4 and 5 sent")
    for o in (3, 4, 5):
        sends.resolve((0, o))
    await until(lambda: len(h.acks) == 6, "everything acked")
    assert h.acks == [(0, o) for o in range(6)]
    check_acks_after_sends(h, sends)
    assert h.gated.lanes[0].done == 6 and h.gated.lanes[0].in_flight is None


async def test_a_failed_send_is_handled_again_and_nothing_behind_it_is_acked_before(
    make: Callable[..., Harness],
) -> None:
    h, sends = pipelined(make)
    h.open(0, 100)
    h.dispatch(*(event(0, o) for o in range(3)))
    await until(lambda: len(sends.calls) == 3, "three decisions sent")
    sends.resolve((0, 2))
    sends.resolve((0, 1))
    sends.resolve((0, 0), OSError("broker said no"))
    await until(lambda: sends.calls.count((0, 0)) == 2, "offset 0 handled again")
    await quiet()
    assert h.acks == []
    retrying = h.gated.retrying[0]
    assert (retrying.offset, retrying.attempts) == (0, 1) and "broker said no" in retrying.error
    sends.resolve((0, 0))
    await until(lambda: len(h.acks) == 3, "all acked")
    assert h.acks == [(0, 0), (0, 1), (0, 2)]
    check_acks_after_sends(h, sends)
    assert h.gated.retrying == {}


async def test_a_payment_that_keeps_failing_shows_as_retrying_with_its_error(
    make: Callable[..., Harness],
) -> None:
    h = make()
    h.open(0, 100)
    h.failures[(0, 1)] = 3
    h.dispatch(*(event(0, o) for o in range(3)))
    await until(lambda: 0 in h.gated.retrying and h.gated.retrying[0].attempts >= 2, "two failed attempts")
    shown = h.gated.retrying_json()["0"]
    assert (shown["partition"], shown["offset"], shown["payments"]) == (0, 1, 1)
    assert shown["error"] == "RuntimeError: handler failure at (0, 1)"
    assert shown["attempts"] >= 2 and shown["since"] <= time.time()
    assert h.gated.stats.handler_failures >= 2
    await until(lambda: len(h.acks) == 3, "acked after the retries")
    assert h.gated.retrying == {} and h.gated.retrying_json() == {}
    assert h.violations == []


@pytest.mark.parametrize("then", ["handles it", "fails"])
async def test_a_lane_whose_handler_swallows_the_revoke_stops_all_the_same(
    make: Callable[..., Harness], then: str
) -> None:
    """A cancel can be lost inside an await (Python 3.11's `asyncio.wait_for` returns a result that was
    ready when the cancel came). The stopped lane must not go on with the events its successor owns.
    Where the handler then handles the payment, its call runs to its end; where it fails (a dependency
    away), the stopped lane does not try again: the successor handles every payment once."""
    h = make()
    h.open(0, 100)
    inside = asyncio.Event()
    release = asyncio.Event()
    plain = h.handle

    async def swallowing(payment: Payment, admission: Admission) -> None:
        if admission.offset == 0 and not inside.is_set():
            inside.set()
            try:
                await release.wait()
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # the lost cancel
            if then == "fails":
                raise RuntimeError("relations answered 503")
        await plain(payment, admission)

    h.gated.handling.handler = swallowing  # type: ignore[assignment]
    h.dispatch(*(event(0, o) for o in range(3)))
    await until(inside.is_set, "the first payment in the handler")
    old = h.gated.lanes[0].task
    h.gated.on_revoked()
    h.assign({0: 0})
    h.dispatch(*(event(0, o) for o in range(3)))  # the successor gets them all again
    assert old is not None
    twice = then == "handles it"  # the stopped lane's call ran to its end, then the successor's
    await until(
        lambda: old.done() and len(h.handled) >= 3 + twice, "the stopped lane ended, its successor on"
    )
    await quiet()
    assert sorted(h.handled) == [(0, 0)] * (1 + twice) + [(0, 1), (0, 2)]


async def test_a_rebalance_keeps_the_payments_in_flight_with_the_queued_ones(
    make: Callable[..., Harness],
) -> None:
    h, sends = pipelined(make)
    h.open(0, 100)
    h.dispatch(*(event(0, o) for o in range(3)))
    await until(lambda: len(sends.calls) == 3, "three decisions sent")
    sends.resolve((0, 0))
    await until(lambda: h.acks == [(0, 0)], "offset 0 acked")
    tasks = h.gated.lanes[0].tasks()
    h.gated.on_revoked()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), DEADLINE)
    assert [po(e) for e in h.gated.kept[0]] == [(0, 1), (0, 2)]  # unacked: decided again if kept
    sends.resolve((0, 1))
    await quiet()
    assert h.acks == [(0, 0)], "nothing acked after the revoke"


async def test_a_partition_that_stays_resumes_after_what_it_acked_and_faust_may_commit_over_it(
    make: Callable[..., Harness],
) -> None:
    """Offsets 0..2 of partition 0 and 0..1 of partition 1 are decided and acked, and nothing was
    committed (the group still says 0) when a rebalance gives both partitions back. Faust forgot those
    acks at the revoke and fetches from 0 again: the lanes drop the re-deliveries (no payment decided
    twice), and the acked offsets become gaps of the generation, or Faust's commit would wait for them
    for ever."""
    h = make()
    h.gated.topic = TOPIC
    h.assign({0: 0, 1: 0})
    h.open(0, 3)
    h.open(1, 100)
    h.dispatch(*(event(0, o) for o in range(5)), *(event(1, o) for o in range(2)))
    await until(lambda: len(h.acks) == 5, "0:0..2 and 1:0..1 acked")
    tasks = [t for lane in h.gated.lanes.values() for t in lane.tasks()]
    h.gated.on_revoked()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), DEADLINE)

    h.assign({0: 0, 1: 0})  # both stay; nothing was committed
    await until(lambda: len(h.app.consumer.gaps) == 2, "the acked offsets recorded as gaps")
    assert sorted(h.app.consumer.gaps) == [(TP(TOPIC, 0), 0, 2), (TP(TOPIC, 1), 0, 1)]
    h.dispatch(*(event(0, o) for o in range(6)), *(event(1, o) for o in range(3)))  # fetched again from 0
    h.open(0, 100)
    await until(lambda: len(h.acks) == 9, "the rest acked")
    await quiet()
    assert sorted(h.handled) == [*((0, o) for o in range(6)), *((1, o) for o in range(3))]
    assert len(h.handled) == len(set(h.handled)) == 9, "each payment decided once"
    assert h.violations == []


async def test_no_ack_reaches_faust_while_a_rebalance_runs(make: Callable[..., Harness]) -> None:
    """Faust forgets a revoked partition's acks when the revoke begins and keeps the ones made after:
    the lanes hold their acks from the start of a rebalance until they stop (or it ends)."""
    h = make()
    h.open(0, 100)
    h.dispatch(event(0, 0))
    await until(lambda: h.acks == [(0, 0)], "offset 0 acked")
    h.app.rebalancing = True
    h.dispatch(event(0, 1), event(0, 2))
    await until(lambda: (0, 1) in h.handled, "1 handled")
    await quiet()
    assert h.acks == [(0, 0)], "acked while the rebalance ran"
    h.app.rebalancing = False
    await until(lambda: h.acks == [(0, 0), (0, 1), (0, 2)], "the held acks made once it ended")


async def test_a_payment_that_reaches_the_retry_ceiling_is_parked_and_its_lane_moves_on(
    make: Callable[..., Harness],
) -> None:
    h = make(max_attempts=3)
    h.open(0, 100)
    h.failures[(0, 1)] = 100
    h.dispatch(*(event(0, o) for o in range(3)))
    await until(lambda: h.of(h.acks, 0) == [0, 1, 2], "the lane past the parked payment")
    assert h.of(h.calls, 0) == [0, 1, 1, 1, 2] and h.of(h.handled, 0) == [0, 2]
    (parked,) = h.review.sent
    assert parked["value"] == payment_value(0, 1) and parked["key"] == b"acct-1"
    headers = parked["headers"]
    assert headers["review.kind"] == b"parked" and headers["review.attempts"] == b"3"
    assert headers["review.offset"] == b"1" and headers["partition"] == b"0"
    assert b"RuntimeError: handler failure at (0, 1)" in headers["review.reason"]
    assert h.gated.stats.payments_parked == 1 and h.gated.retrying == {} and h.violations == []


async def test_a_batch_at_the_ceiling_is_tried_one_payment_at_a_time_and_only_the_failing_one_parked(
    make: Callable[..., Harness],
) -> None:
    h = make(max_batch=8, max_attempts=2)
    h.open(2, 100)
    h.failures[(2, 1)] = 100
    h.dispatch(*(event(2, o) for o in range(3)))
    await until(lambda: len(h.acks) == 3, "three acks")
    whole = [(2, 0), (2, 1), (2, 2)]
    assert h.batches == [whole, whole, [(2, 0)], [(2, 1)], [(2, 1)], [(2, 2)]]
    assert h.handled == [(2, 0), (2, 2)] and [s["headers"]["review.offset"] for s in h.review.sent] == [b"1"]
    assert h.violations == []


async def test_a_stale_payment_the_review_topic_refuses_shows_as_retrying_until_it_has_it(
    make: Callable[..., Harness],
) -> None:
    """The lane holds on the payment until the review topic has its copy; meanwhile operators see why."""
    h = make(stale_after=0.05)  # partition 0 has no row: its gate never opens
    h.review.refusals = 2
    h.dispatch(event(0, 0))
    await until(
        lambda: 0 in h.gated.retrying and h.gated.retrying[0].error.startswith("writing it to the review"),
        "the refused review copy shown as retrying",
    )
    await until(lambda: h.acks == [(0, 0)], "the payment decided stale once the review topic has it")
    assert len(h.review.sent) == 1 and h.gated.retrying == {}


async def test_decide_stale_admits_a_payment_that_waited_past_the_bound_and_sends_it_for_review(
    make: Callable[..., Harness],
) -> None:
    h = make(stale_after=0.05)  # partition 0 has no row: its gate never opens
    h.dispatch(event(0, 0))
    await until(lambda: h.acks == [(0, 0)], "the payment decided stale")
    admission = h.admissions[(0, 0)]
    assert admission.stale is not None and admission.stale >= 0.05 and not admission.wants_fresh
    (sent,) = h.review.sent
    assert sent["headers"]["review.kind"] == b"stale" and sent["value"] == payment_value(0, 0)
    assert h.gated.stats.decided_stale == 1
    # Without the policy the same payment waits.
    waiting = make()
    waiting.dispatch(event(0, 0))
    await asyncio.sleep(0.2)
    assert waiting.calls == [] and waiting.review.sent == []


async def test_a_background_read_that_fails_stops_the_worker_loudly() -> None:
    """A generation's reads and repairs (its starts, a hole's check) retry until done; one that failed
    anyway left its partition paused or held for good without a word. It now stops the worker, as a
    failed lane does, so that a restart and a rebalance repair it."""
    h = Harness()
    crashed: list[BaseException] = []

    async def crash(exc: BaseException) -> None:
        crashed.append(exc)

    h.app.crash = crash  # type: ignore[attr-defined]
    h.app.add_future = asyncio.ensure_future  # type: ignore[attr-defined]

    async def fails() -> None:
        raise RuntimeError("the log start offsets could not be read")

    async def cancelled_with_its_generation() -> None:
        await asyncio.sleep(3600)

    h.gated._spawn(fails())
    h.gated._spawn(cancelled_with_its_generation())
    await asyncio.sleep(0.05)
    for task in list(h.gated._background):
        task.cancel()
    await asyncio.sleep(0.01)
    assert [str(exc) for exc in crashed] == ["the log start offsets could not be read"]


async def test_a_hole_read_that_aiokafka_cancels_on_its_own_is_an_error_to_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aiokafka cancels its own futures when a broker stops answering mid-request. Escaped as a
    CancelledError, that ended the hole's check as if its lane had stopped: the lane then held what came
    after the hole for good. Read under `within`, it is `CancelledWithin`, which the check retries."""
    from aml_app.gate import delivery
    from aml_app.kafka.deadlines import CancelledWithin
    from aml_app.kafka.security import KafkaSecurity

    class Reader:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def start(self) -> None:
            pass

        def assign(self, tps: Any) -> None:
            pass

        def seek(self, tp: Any, offset: int) -> None:
            pass

        async def getmany(self, *args: Any, **kwargs: Any) -> Any:
            raise asyncio.CancelledError  # its own future, cancelled inside aiokafka

        async def stop(self) -> None:
            pass

    monkeypatch.setattr(delivery, "AIOKafkaConsumer", Reader)
    with pytest.raises(CancelledWithin):
        await delivery.first_offset_from(["b:9092"], TOPIC, 0, 5, 0.5, security=KafkaSecurity())


async def test_offsets_that_hold_only_a_transaction_marker_are_fetched_again_once(
    make: Callable[..., Harness],
) -> None:
    """aiokafka's position steps past a transaction's commit marker: an idle partition of a transactional
    topic stands one past its last record. It was fetched again, and warned about, at every check; now
    once, then the log is asked and says the offsets hold no records. Where they do (a refetch that did
    not take), the check fetches again each time."""
    # (the log's records, the refetches of three checks, the log's reads): the first check fetches again
    # at once; the next ones ask the log first.
    for records, fetched_again, asked in ((range(3), [3], 1), (range(5), [3, 3, 3], 2)):
        h = make()
        log_ = FakeLog(records)
        h.gated.delivery.first_offset = log_.first_offset
        tp0 = TP(TOPIC, 0)
        consumer = h.app.consumer
        consumer.assigned = {tp0}
        h.assign({0: 0})
        h.open(0, 100)
        h.dispatch(event(0, 0), event(0, 1), event(0, 2))
        await until(lambda h=h: len(h.acks) == 3, "offsets 0..2 acked")
        consumer.positions[tp0] = 4  # past the marker at 3, or past 3 never delivered
        for _ in range(3):
            h.gated.lanes[0].last_dispatch = time.monotonic() - 10
            await h.gated.check_delivery(TOPIC, quiet=1.0)
        assert [offset for _, offset in consumer.seeks] == fetched_again, list(records)
        assert len(log_.asked) == asked
