"""Gated consumption for any Faust agent: ordered per partition, never blocking other partitions.

Faust delivers every partition of an agent through one stream; waiting inside that loop would stall
all partitions behind the slowest one. So the agent only dispatches each event to a *lane*, one asyncio
task per partition that processes its payments in offset order:

    parse -> (invalid: dead-letter) -> wait for the gate -> handler -> ack

The stream runs with manual acks and each lane acks strictly in offset order, after the handler has
finished. Faust commits the longest contiguous run of acked offsets, so the committed offset never
passes a payment that is waiting or in flight (the over-commit of Faust issue #606 needs an ack ahead
of an unacked head, which in-order acks never produce). A handler exception is retried with backoff and
the lane stays on that payment: nothing is skipped (Faust would ack a crashed event, issue #315). On a
rebalance every lane stops at once, waiting or not; its unacked payments are re-read by the next owner
(or resumed here, if the partition stays).

Each lane's state and its rules for what arrives are in `aml_app.gate.lane`; Faust's delivery has gaps
the lanes repair, asking the log through `aml_app.gate.delivery`. Every buffer is bounded by
`max_pending` per partition: a lane's queue with what it holds past a hole, and the events received
before the assignment's starts are known; reaching it pauses the partition.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import faust
from faust.types import TP, EventT, StreamT, TopicT

from aml_app.contract import DEFAULT_MAX_CLOCK_SKEW, dead_letter_headers
from aml_app.faust_internals import dispatch_events, record_gap, set_current_event
from aml_app.gate.delivery import DeliveryChecker
from aml_app.gate.event_time import micros
from aml_app.gate.gate import Admission, Admitted, FreshnessGate
from aml_app.gate.lane import Arrival, GateStats, InFlight, Lane
from aml_app.gate.retry import retry_forever
from aml_app.gate.watermark import derived_need
from aml_app.kafka.security import PLAINTEXT, KafkaSecurity
from aml_app.models import InvalidPayment, Payment, parse_payment

log = logging.getLogger(__name__)


#: Seconds between looks at whether a rebalance still holds the acks (see `GatedConsumer._settle`).
ACK_HOLD_CHECK = 0.05


class AssignmentRefused(RuntimeError):
    """An assignment under which nothing may be processed (the sentence says why and what to do)."""


#: What a handler leaves to complete before its payments may be acked, e.g. the broker's acknowledgement
#: of a decision it sent (a future); None when it finished everything itself. The lane goes on with the
#: next payments meanwhile and acks, in offset order, once this completes (pipelined sends).
Pending = Awaitable[Any] | None
Handler = Callable[[Payment, Admission], Awaitable[Pending]]
#: Handles several admitted payments of one partition at once (in offset order); must be idempotent per
#: payment, since a failure retries the whole batch.
BatchHandler = Callable[[list[tuple[Payment, Admission]]], Awaitable[Pending]]


@dataclass
class Retrying:
    """A lane that keeps failing on a payment (or a batch starting there): shown to the operators."""

    partition: int
    offset: int
    payments: int
    since: float
    attempts: int = 0
    error: str = ""
    next_retry_at: float = 0.0

    def as_json(self, now: float) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "offset": self.offset,
            "payments": self.payments,
            "attempts": self.attempts,
            "error": self.error,
            "since": self.since,
            "retrying_for_s": round(now - self.since, 3),
            "next_retry_in_s": round(max(self.next_retry_at - now, 0.0), 3),
        }


def describe_error(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _done() -> asyncio.Future[None]:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


class GatedConsumer:
    """Bridges one Faust agent stream to per-partition lanes guarded by a FreshnessGate."""

    def __init__(
        self,
        app: faust.App,
        gate: FreshnessGate,
        handler: Handler | None,
        dead_letters: TopicT,
        *,
        batch_handler: BatchHandler | None = None,
        max_batch: int = 1,
        gate_enabled: bool = True,
        max_pending: int = 1000,
        max_payment_bytes: int = 65536,
        max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW,
        worker_id: str = "",
        max_in_flight: int = 1000,
        review: TopicT | None = None,
        stale_after: float | None = None,
        max_attempts: int = 0,
        park_requested: Callable[[int, int], dict[str, Any] | None] | None = None,
        security: KafkaSecurity = PLAINTEXT,
    ) -> None:
        """Give `handler` (one payment at a time) or `batch_handler` (up to `max_batch` payments of one
        partition at a time, every one of them already admitted by the gate). Either may return what is
        left to complete (`Pending`); up to `max_in_flight` payments per partition wait for that while
        the lane goes on.

        `review` is where payments decided stale or parked go. `stale_after` (seconds, the decide-stale
        wait policy) admits a payment that has waited that long at the gate as stale; `max_attempts`
        (> 0) parks a payment whose handler failed that many times. By default neither happens.
        `park_requested(partition, offset)` says whether an operator asked to park a payment (`aml-app
        park`): it is parked at its next failure."""
        if (stale_after is not None or max_attempts or park_requested) and review is None:
            raise ValueError("deciding stale or parking needs a review topic")
        if (handler is None) == (batch_handler is None):
            raise ValueError("give either a handler or a batch_handler")
        if max_batch < 1 or (handler is not None and max_batch != 1):
            raise ValueError("max_batch must be at least 1, and 1 with a per-payment handler")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.max_in_flight = max_in_flight
        self.app = app
        self.gate = gate
        self.handler = handler
        self.batch_handler = batch_handler
        self.max_batch = max_batch
        self.dead_letters = dead_letters
        self.gate_enabled = gate_enabled
        self.max_pending = max_pending
        self.max_payment_bytes = max_payment_bytes
        self.max_clock_skew = max_clock_skew
        self.worker_id = worker_id
        #: Reads the log and the group's commits for the lanes, with the cluster's TLS/SASL.
        self.delivery = DeliveryChecker(app, security)
        self.stats = GateStats()
        self.lanes: dict[int, Lane] = {}
        self.parked: dict[int, list[EventT[Any]]] = {}
        #: Per partition revoked from a lane: the first offset it had not finished handling (everything
        #: below was handled here); where its lane resumes if the partition stays with this worker.
        self.resume_at: dict[int, int] = {}
        #: The payments topic, for the gaps recorded at a resumption (set by attach()).
        self.topic: str | None = None
        #: Where each assigned partition starts in this generation, and since when it is ours.
        self.starts: dict[int, int] = {}
        #: Whether `starts` is known for the current generation; until then (attached only) events wait
        #: in `early`, so that a jump past the start is seen as the hole it is.
        self.assigned = False
        self.early: dict[int, list[EventT[Any]]] = {}
        #: Partitions paused because `early` holds `max_pending` of their events.
        self.early_paused: set[int] = set()
        self.assigned_at = time.monotonic()
        #: Called with the admission of each payment once it is done (its handler and whatever the handler
        #: left pending completed), before its ack (metrics); never fails a lane.
        self.observers: list[Callable[[Admission], None]] = []
        #: Lanes that keep failing on a payment, by partition (see `Retrying`).
        self.retrying: dict[int, Retrying] = {}
        self._stream: StreamT[Any] | None = None
        self._background: set[asyncio.Future[None]] = set()
        self.review = review
        self.stale_after = stale_after
        self.max_attempts = max_attempts
        self.park_requested = park_requested

    def attach(
        self,
        *,
        bootstrap_servers: Sequence[str],
        topic: str,
        group: str,
        check_every: float,
        quiet: float,
        refuse: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Wire this consumer to the app's rebalances; every `check_every` s, check the delivery of the
        lanes quiet for `quiet` s.

        Any gated service calls this once next to its agent: the lanes stop on revoke, resume (or drop
        their kept events) on assignment, and fetched-but-undelivered records are fetched again. At each
        assignment `refuse` may name a reason not to process anything under it: the worker then stops
        with that sentence, and no event of the assignment reaches a lane.
        """

        async def stop_lanes(sender: Any, *revoked: Any, **kwargs: Any) -> None:
            """On a revoke, and before the worker leaves its group when it stops: the lanes stop, then
            every send they handed to the producer (an alert, a decision) reaches the broker before the
            next owner of their partitions recovers `alerts-sent` from the alerts topic, so it finds an
            alert sent here just before, and does not send it again."""
            self.on_revoked()
            await self.app.producer.flush()

        async def learn_starts(mine: list[TP], generation: int) -> None:
            # A refused assignment returns before `on_assigned`: its events stay in `early`, unprocessed.
            problem = refuse()
            if problem is not None:
                self._refuse(problem)
                return
            starts, read_from = (
                await self.delivery.starts(bootstrap_servers, group, mine) if mine else ({}, None)
            )
            if self.stats.rebalances != generation:
                return  # a newer rebalance began: its own task takes over
            if read_from is not None and self.gate.log not in (None, read_from):
                # The lanes' offsets and kept events are of the old log: only a fresh start is right.
                self._refuse(
                    f"{topic} is now log {read_from}, not log {self.gate.log} as when this worker started "
                    "(it was deleted and created again, or the cluster changed): this worker stops so "
                    "that it starts again on the new log with nothing of the old one"
                )
                return
            if read_from is not None:
                self.gate.log = read_from
            self.on_assigned(starts)

        async def resume_lanes(sender: Any, assigned: Any, **kwargs: Any) -> None:
            # Reading offsets takes round trips to the broker: do it beside the rebalance, not inside
            # Faust's rebalance callback, which holds up the group join while it runs.
            mine = sorted(tp for tp in assigned if tp.topic == topic)
            self._spawn(learn_starts(mine, self.stats.rebalances))

        async def check_delivery() -> None:
            await self.check_delivery(topic, quiet=quiet)

        self.delivery.attach(bootstrap_servers, topic)
        self.topic = topic

        # mode types a signal's receivers so that no function matches them (not even `def f(*a, **k)`).
        self.app.on_partitions_revoked.connect(stop_lanes)  # type: ignore[arg-type]
        self.app.on_before_shutdown.connect(stop_lanes)  # type: ignore[arg-type]
        self.app.on_partitions_assigned.connect(resume_lanes)  # type: ignore[arg-type]
        self.app.timer(check_every)(check_delivery)

    async def consume(self, stream: faust.Stream[Any]) -> None:
        """The agent body: dispatch, never wait."""
        self._stream = manual = stream.noack()
        await dispatch_events(manual, self._dispatch)

    def _lane(self, partition: int) -> Lane:
        lane = self.lanes.get(partition)
        if lane is None:
            lane = self.lanes[partition] = Lane(partition)
            lane.task = asyncio.ensure_future(self._run_lane(lane))
            lane.acker = asyncio.ensure_future(self._run_acker(lane))
            for task in lane.tasks():
                task.add_done_callback(self._lane_ended)
            parked = self.parked.pop(partition, [])
            resume = self.resume_at.pop(partition, None)
            if resume is not None:
                lane.resume_from(resume, self.starts.get(partition))
                self._handled_before(partition, resume)
            for event in parked:
                self._enqueue(lane, event)
        return lane

    def _refuse(self, sentence: str) -> None:
        """Stop the worker with `sentence` instead of processing anything under this assignment."""
        log.error("%s", sentence)
        self.app.add_future(self.app.crash(AssignmentRefused(sentence)))

    def _handled_before(self, partition: int, resume: int) -> None:
        """Offsets from this generation's start up to `resume` were handled here (their decisions
        acknowledged) before the rebalance that gave the partition back; Faust forgot their acks at the
        revoke, or never had them (held during the rebalance), and expects them again from the committed
        offset. Fetched again, the lane drops them as delivered before, so they are a gap of the
        generation: without it Faust never commits the partition again (the group stood thousands of
        records behind after a scale-down, and the next owner decided them again)."""
        start = self.starts.get(partition)
        if start is not None and start < resume and self.topic is not None:
            self._spawn(record_gap(self.app, TP(self.topic, partition), start, resume - 1))

    def _dispatch(self, event: EventT[Any]) -> None:
        partition = event.message.partition
        if self.delivery.checks_holes and not self.assigned:
            early = self.early.setdefault(partition, [])
            early.append(event)
            if len(early) >= self.max_pending and partition not in self.early_paused:
                # Bounded like a lane's queue: the rest is fetched again once the assignment is known.
                self.app.consumer.pause_partitions([TP(*event.message.tp)])
                self.early_paused.add(partition)
            return
        lane = self._lane(partition)
        self._enqueue(lane, event)
        if not lane.paused and lane.buffered >= self.max_pending:
            # Back-pressure for this partition only: stop fetching it until the lane catches up.
            self.app.consumer.pause_partitions([TP(*event.message.tp)])
            lane.paused = True

    def _enqueue(self, lane: Lane, event: EventT[Any]) -> None:
        start = self.starts.get(lane.partition)
        if lane.receive(event, start, checks_holes=self.delivery.checks_holes) is Arrival.HOLE:
            self._spawn(self._check_hole(lane, TP(*event.message.tp)))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def on_revoked(self) -> None:
        """Stop every lane; keep its unacked events aside until we know who owns the partition.

        Nothing is acked, so the next owner starts at the committed offset. If the partition comes back
        to this worker, its lane resumes with the kept events: Faust does not always deliver records
        again that it had already delivered before the rebalance (seen under CPU load).
        """
        self.stats.rebalances += 1
        self.starts = {}  # nothing is ours until the next assignment
        self.assigned = False
        self.early, self.early_paused = {}, set()  # Faust forgets its pauses of revoked partitions too
        lanes, self.lanes = self.lanes, {}
        self.retrying = {}
        for lane in lanes.values():
            lane.stop()
            pending = lane.pending()
            if pending:
                self.parked[lane.partition] = pending
            resume = lane.resume_offset()
            if resume is not None:
                self.resume_at[lane.partition] = resume

    def stop(self) -> None:
        """Cancel every lane and background task (hole checks, reading the starts): the worker stops.
        Nothing is acked, as at a revoke."""
        for lane in self.lanes.values():
            lane.stop()
        for task in list(self._background):
            task.cancel()

    def on_assigned(self, starts: dict[int, int]) -> None:
        """Drop the kept events of partitions that went to another worker; resume the others.

        `starts` maps each assigned partition to where this generation starts reading it (the
        group's committed offset, or the log start): the delivery check below compares against it.
        """
        self.starts = dict(starts)
        self.assigned = True
        self.assigned_at = time.monotonic()
        for p in sorted(set(self.parked) | set(self.resume_at)):
            if p not in starts:
                self.parked.pop(p, None)
                self.resume_at.pop(p, None)
            else:
                self._lane(p)
        for p, lane in list(self.lanes.items()):
            if p not in starts:
                # Only an event from before the assignment could have made this lane: never ours.
                lane.stop()
                del self.lanes[p]
                self.retrying.pop(p, None)
        early, self.early = self.early, {}
        for p, events in early.items():
            if p in starts:
                for event in events:
                    self._dispatch(event)
        paused, self.early_paused = self.early_paused, set()
        for p in sorted(paused & set(starts)):
            lane = self._lane(p)
            if not lane.paused and self.topic is not None:  # else the lane resumes it, as its own pauses
                self._spawn(self._resume(lane, TP(self.topic, p), lane.expected(starts[p])))

    async def _check_hole(self, lane: Lane, tp: TP) -> None:
        """Offsets `expected`..`received - 1` never reached the lane: fetch them again, unless the log
        holds no record there (the gap in offsets is real)."""
        assert lane.hole is not None
        hole = expected, received = lane.hole
        gap = await self.delivery.is_gap(tp, expected, received)
        if lane.hole != hole or self.lanes.get(lane.partition) is not lane:
            return  # filled meanwhile, or the partition moved on
        if gap:
            log.info(
                "%s: no records at offsets %d..%d (a gap in the log); going on", tp, expected, received - 1
            )
            self.stats.gaps_accepted += 1
            for event in lane.cross_gap():
                self._enqueue(lane, event)
            return
        log.warning(
            "%s: the consumer skipped offsets %d..%d (delivered %d next); fetching them again",
            tp,
            expected,
            received - 1,
            received,
        )
        lane.refetching()
        await self.delivery.seek(tp, expected)
        self.stats.holes_refetched += 1
        if lane.paused:  # paused while it held events past the hole: they come again
            await self._resume(lane, tp, None)

    async def check_delivery(self, topic: str, quiet: float) -> None:
        """Fetch again what an owned partition should have delivered to its lane and did not, once the
        lane has had nothing new for `quiet` seconds: from the first offset it still needs (it drops any
        duplicate). See `DeliveryChecker.undelivered`."""
        now = time.monotonic()
        for p, start in list(self.starts.items()):
            lane = self.lanes.get(p)
            last = lane.last_dispatch if lane else self.assigned_at
            if now - last < quiet or (lane is not None and lane.paused):
                continue
            expected = lane.next_offset if lane and lane.next_offset is not None else start
            tp = TP(topic, p)
            position = await self.delivery.undelivered(tp, expected, quiet)
            if position is None:
                continue
            log.warning(
                "%s: offsets %d..%d were fetched but never delivered; fetching them again",
                tp,
                expected,
                position - 1,
            )
            await self.delivery.seek(tp, expected)
            self.stats.refetches += 1

    def fetch_state(self, topic: str) -> dict[int, dict[str, Any]]:
        """Per owned partition, what the delivery check looks at: where this generation started, the next
        offset the lane expects, how long it has had nothing, and whether Faust fetches it at all."""
        now = time.monotonic()
        state = {}
        for p in sorted(set(self.starts) | set(self.lanes)):
            lane = self.lanes.get(p)
            paused_in_faust, fetched_by_faust = self.delivery.flags(TP(topic, p))
            state[p] = {
                "start": self.starts.get(p),
                "next_offset": lane.next_offset if lane else None,
                "queued": len(lane.queue) if lane else 0,
                "quiet_s": round(now - (lane.last_dispatch if lane else self.assigned_at), 3),
                "paused_by_lane": bool(lane and lane.paused),
                "hole": list(lane.hole) if lane and lane.hole else None,
                "paused_in_faust": paused_in_faust,
                "fetched_by_faust": fetched_by_faust,
            }
        return state

    def retrying_json(self) -> dict[str, Any]:
        """The lanes that keep failing, partition (str) -> `Retrying.as_json` (stable between attempts
        but for `attempts`, so the demand publisher re-publishes only when something changed)."""
        now = time.time()
        out = {}
        for p, r in sorted(self.retrying.items()):
            doc = r.as_json(now)
            del doc["retrying_for_s"], doc["next_retry_in_s"]
            out[str(p)] = doc
        return out

    def _lane_ended(self, task: asyncio.Task[None]) -> None:
        """A lane ends only when cancelled. Anything else is a bug: stop loudly, never stall silently."""
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a partition lane stopped unexpectedly; stopping the worker", exc_info=exc)
            self.app.add_future(self.app.crash(exc))

    async def _run_lane(self, lane: Lane) -> None:
        """Take, admit and handle the lane's payments in offset order; hand them to the acks."""
        while True:
            await lane.wait_for_work(self.max_in_flight)
            lane.go_on()
            batch = await self._take(lane)
            lane.go_on()
            admitted = [(event, a) for event, a in batch if a is not None]
            pending = await self._handle(admitted) if admitted else None
            lane.go_on()
            events = lane.hand_over()
            if pending is None and not lane.inflight:
                await self._settle(lane, events, admitted)  # nothing to wait for: ack at once
            else:
                lane.add_in_flight(InFlight(events, admitted, pending or _done()))

    async def _run_acker(self, lane: Lane) -> None:
        """Ack the lane's handled batches in offset order as their pending work completes.

        A pending send that fails is not skipped: its payments are handled again (handlers are
        idempotent per payment) until their work completes; the batches behind it wait for that.
        """
        while True:
            entry = await lane.front()
            lane.go_on()
            try:
                pending = entry.pending
                if isinstance(pending, asyncio.Future) and pending.done():
                    pending.result()  # the common case under load: already acknowledged
                else:
                    # Shielded: a revoke cancels this task, not the send (Faust completes it anyway).
                    await asyncio.shield(pending)
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # this lane stops (a revoke)
                await self._redo(entry, exc)  # the send itself was cancelled
            except Exception as exc:
                await self._redo(entry, exc)
            lane.go_on()
            # Settled while still at the front: the lane queues behind it rather than acking ahead.
            await self._settle(lane, entry.events, entry.admitted)
            lane.acked_front()

    async def _redo(self, entry: InFlight, exc: BaseException) -> None:
        """Handle the payments of `entry` again: their pending work (the sends) failed with `exc`."""
        first = entry.admitted[0][1][1]
        self._failed(entry.admitted, 1, exc, 0.0)
        log.warning(
            "the pending work of %d payment(s) at %d:%d failed (%s); handling them again",
            len(entry.admitted),
            first.partition,
            first.offset,
            describe_error(exc),
        )

        async def again() -> None:
            pending = await self._call_handler(entry.admitted)
            if pending is not None:
                await pending

        await retry_forever(
            f"processing {len(entry.admitted)} payment(s) again at {first.partition}:{first.offset} "
            "(their pending work failed)",
            again,
            on_failure=lambda attempt, exc, wait: self._failed(entry.admitted, attempt, exc, wait),
        )

    async def _settle(
        self, lane: Lane, events: list[EventT[Any]], admitted: list[tuple[EventT[Any], Admitted]]
    ) -> None:
        """The payments are done: tell the observers, then ack every event in offset order."""
        retrying = self.retrying.get(lane.partition)
        if retrying is not None and events[0].message.offset <= retrying.offset <= events[-1].message.offset:
            del self.retrying[lane.partition]
        for _, (_, admission) in admitted:
            for observe in self.observers:
                try:
                    observe(admission)
                except Exception:  # an observer is for telemetry; it must never stop a lane
                    log.exception("an admission observer failed")
        assert self._stream is not None
        ack = self._stream.ack
        for event in events:
            # Faust forgets the acks of a revoked partition when its revoke begins, but keeps any made
            # after that, until the lanes stop: held over into the next generation, they were counted
            # twice with the offsets a resumed lane records as handled, and Faust's commit crawled. A
            # held ack is not lost: the lane stops, or the rebalance ends first. The flag is set by
            # aiokafka's thread before the revoke reaches this loop, which no asyncio.Event could be.
            while getattr(self.app, "rebalancing", False):  # noqa: ASYNC110
                await asyncio.sleep(ACK_HOLD_CHECK)
            await ack(event)
        lane.settled(len(events))

    async def _take(self, lane: Lane) -> list[tuple[EventT[Any], Admitted | None]]:
        """The next events of the lane, in offset order, each admitted (or dead-lettered: None).

        The head waits for the gate. Then, up to `max_batch` payments, the events queued behind it join
        the batch while the gate is already open for them: a batch never waits for a later payment.
        """
        taken: list[tuple[EventT[Any], Admitted | None]] = []
        payments = 0
        while lane.queue and payments < self.max_batch:
            event = lane.queue[0]
            head = not taken
            parsed = self._parse(event)
            event_us = self._event_us(parsed)
            if (
                not head
                and self.gate_enabled
                and not self.gate.is_open(event.message.partition, event.message.offset, event_us)
            ):
                break
            _, arrived = lane.take()
            if lane.paused and lane.hole is None and len(lane.queue) <= self.max_pending // 2:
                await self._resume(lane, TP(*event.message.tp), lane.next_offset)
            admitted = await self._admit(event, arrived, parsed, event_us)
            lane.go_on()
            taken.append((event, admitted))
            payments += admitted is not None
        return taken

    async def _resume(self, lane: Lane, tp: TP, offset: int | None) -> None:
        """Fetch a partition paused by back-pressure again, from `offset`: the first offset its lane
        has not had (None: already sought).

        Faust drops the records of a partition it pauses that its current fetch still holds (its
        `getmany` checks the set of active partitions that `pause_partitions` shrinks), while aiokafka's
        position is already past them. Without the seek the lane would have a hole, found only by the
        hole check or by `check_delivery` once the lane has been quiet: seconds at every pause, measured
        in the end-to-end benchmark. `tp` is Faust's own TP type: aiokafka's would crash its checks.
        """
        if offset is not None:
            await self.delivery.seek(tp, offset)
        self.app.consumer.resume_partitions([tp])
        lane.paused = False

    def _parse(self, event: EventT[Any]) -> Payment | InvalidPayment:
        """The payment, or why it breaks the contract, which bounds its `ts` by the record's timestamp
        (Faust's seconds, None when the record has none; the contract takes Kafka's milliseconds)."""
        message = event.message
        stamp = message.timestamp
        try:
            return parse_payment(
                message.key,
                message.value,
                self.max_payment_bytes,
                None if stamp is None else round(stamp * 1000),
                self.max_clock_skew,
            )
        except InvalidPayment as exc:
            return exc

    def _event_us(self, parsed: Payment | InvalidPayment) -> int | None:
        """The payment's event time for the event-time gate (None: the per-partition gate, or no payment)."""
        if not self.gate.event_time or isinstance(parsed, InvalidPayment):
            return None
        return micros(parsed.ts)

    async def _admit(
        self, event: EventT[Any], arrived: float, parsed: Payment | InvalidPayment, event_us: int | None
    ) -> Admitted | None:
        """Wait for the gate (`event_us`: the payment's event time, for the event-time gate); a payment
        that breaks the contract is dead-lettered."""
        message = event.message
        p, offset = message.tp.partition, message.offset
        payment = parsed
        if isinstance(payment, InvalidPayment):
            reason = str(payment)
            await retry_forever(
                f"dead-lettering {p}:{offset}",
                lambda: self._dead_letter(event, reason),
                on_failure=lambda attempt, exc, wait: self._failed_at(p, offset, 1, attempt, exc, wait),
            )
            return None
        if self.gate_enabled:
            row = await self.gate.wait_open(p, offset, event_us, self.stale_after)
            if row.get("stale") is not None:
                await self._to_review(
                    event, "stale", f"decided stale after waiting {row['stale']:g} s at the gate"
                )
                self.stats.decided_stale += 1
        else:
            row = self.gate.row(p) or {"watermark": -1, "dependencies": {}}
        admission = Admission(
            partition=p,
            offset=offset,
            watermark=row["watermark"],
            dependencies=dict(row["dependencies"]),
            # From arrival at this worker to the start of processing: the time the payment was held,
            # by the gate on itself or on an earlier payment of its partition.
            waited_ms=round((time.monotonic() - arrived) * 1000, 3),
            gated=self.gate_enabled,
            log=row.get("log"),
            cut=row.get("cut"),
            stale=row.get("stale"),
            derived=derived_need(row, row.get("cut")),
        )
        return payment, admission

    async def _handle(self, admitted: list[tuple[EventT[Any], Admitted]]) -> Pending:
        """Run the handler until it succeeds (retrying with backoff, shown in `retrying`); with a retry
        ceiling, a batch that reaches it is handled one payment at a time, and a payment that reaches it
        alone is parked on the review topic (then it is done: the lane moves on)."""
        first, last = admitted[0][1][1], admitted[-1][1][1]
        if len(admitted) == 1:
            what = f"processing payment {admitted[0][1][0].payment_id} at {first.partition}:{first.offset}"
        else:
            what = f"processing {len(admitted)} payments at {first.partition}:{first.offset}..{last.offset}"
        attempts = [0]

        def failed(attempt: int, exc: BaseException, wait: float) -> None:
            attempts[0] = attempt
            self._failed(admitted, attempt, exc, wait)

        try:
            return await retry_forever(
                what,
                lambda: self._call_handler(admitted),
                on_failure=failed,
                attempts=self.max_attempts or None,
                stop=lambda: any(self._asked_to_park(a) is not None for _, a in admitted),
            )
        except Exception as exc:  # a retry ceiling or a park request: retry_forever raises nothing else
            if len(admitted) > 1:
                pending = [await self._handle([one]) for one in admitted]
                waits = [p for p in pending if p is not None]
                return asyncio.gather(*waits) if waits else None
            attempts[0] += 1  # the failure retry_forever raised was not reported to `failed`
            asked = self._asked_to_park(admitted[0][1])
            if asked is not None and (not self.max_attempts or attempts[0] < self.max_attempts):
                by, because = asked.get("by", "aml-app park"), asked.get("reason") or "no reason given"
                why = f"parked by hand ({by}: {because})"
            else:
                why = f"parked after {attempts[0]} failed attempts"
            reason = f"{why}: {describe_error(exc)}"
            await self._to_review(admitted[0][0], "parked", reason, attempts=attempts[0])
            self.stats.payments_parked += 1
            return None

    def _asked_to_park(self, admitted: Admitted) -> dict[str, Any] | None:
        if self.park_requested is None:
            return None
        admission = admitted[1]
        return self.park_requested(admission.partition, admission.offset)

    async def _call_handler(self, admitted: list[tuple[EventT[Any], Admitted]]) -> Pending:
        # The handler runs as if inside Faust's stream iteration of the (first) event, so it can use
        # partitioned tables like any agent: their reads and writes go to the event's partition, which
        # every event of a lane's batch shares.
        set_current_event(admitted[0][0])
        if self.batch_handler is not None:
            return await self.batch_handler([a for _, a in admitted])
        assert self.handler is not None and len(admitted) == 1
        payment, admission = admitted[0][1]
        return await self.handler(payment, admission)

    def _failed(
        self, admitted: list[tuple[EventT[Any], Admitted]], attempt: int, exc: BaseException, wait: float
    ) -> None:
        first = admitted[0][1][1]
        self._failed_at(first.partition, first.offset, len(admitted), attempt, exc, wait)

    def _failed_at(
        self, partition: int, offset: int, payments: int, attempt: int, exc: BaseException, wait: float
    ) -> None:
        """Record a failed attempt where the operators see it (`retrying`)."""
        now = time.time()
        current = self.retrying.get(partition)
        if current is None or current.offset != offset:
            current = self.retrying[partition] = Retrying(partition, offset, payments, since=now)
        current.attempts = max(current.attempts + 1, attempt)
        current.error = describe_error(exc)
        current.next_retry_at = now + wait
        self.stats.handler_failures += 1

    async def _to_review(self, event: EventT[Any], kind: str, reason: str, attempts: int = 0) -> None:
        """A payment decided stale or parked: its original bytes, and why in headers (`review.*`), on the
        review topic, in the payment's partition; retried until the broker has it."""
        message = event.message
        headers = [
            ("review.kind", kind.encode()),
            ("review.reason", reason.encode()),
            ("review.attempts", str(attempts).encode()),
            ("review.topic", message.topic.encode()),
            ("review.partition", str(message.partition).encode()),
            ("review.offset", str(message.offset).encode()),
            ("review.worker", self.worker_id.encode()),
        ]
        review = self.review
        assert review is not None

        async def send() -> None:
            fut = await review.send(
                key=message.key, value=message.value, partition=message.partition, headers=headers
            )
            await fut

        await retry_forever(f"writing {message.partition}:{message.offset} to the review topic", send)
        log.warning("%s %s:%d: %s", kind, message.topic, message.offset, reason)

    async def _dead_letter(self, event: EventT[Any], reason: str) -> None:
        """Original bytes as the value, the reason and the origin in headers (Kafka Connect style)."""
        message = event.message
        headers = dead_letter_headers(
            reason, message.topic, message.partition, message.offset, self.worker_id
        )
        fut = await self.dead_letters.send(key=message.key, value=message.value, headers=headers)
        await fut
        self.stats.dead_lettered += 1
        log.info("dead-lettered %s:%d: %s", message.topic, message.offset, reason)
