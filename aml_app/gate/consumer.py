"""Gated consumption for any Faust agent: ordered per partition, never blocking other partitions.

Faust delivers every partition of an agent through one stream; waiting inside that loop would stall
all partitions behind the slowest one. So the agent only dispatches each event to a *lane*, one asyncio
task per partition that runs its payments through three steps in offset order:

    admit (`aml_app.gate.admit`: parse, dead-letter, gate wait, stale)
      -> handle (`aml_app.gate.handling`: the handler, retried; parked at a ceiling)
      -> ack (`aml_app.gate.acks`: in offset order, after the handler's sends, held over a rebalance)

The stream runs with manual acks, so the committed offset never passes a payment that is waiting or in
flight. On a rebalance every lane stops at once, waiting or not; its unacked payments are re-read by the
next owner (or resumed here, if the partition stays). This class keeps the dispatch, the lanes' tasks and
the generation (`aml_app.gate.generation.Assignment`); each lane's state and its rules for what arrives
are in `aml_app.gate.lane`, and Faust's delivery has gaps the lanes repair, asking the log through
`aml_app.gate.delivery`. Every buffer is bounded by `max_pending` per partition: a lane's queue with what
it holds past a hole, and the events received before the assignment's starts are known; reaching it
pauses the partition.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import faust
from faust.types import TP, EventT, TopicT

from aml_app.faust_internals import dispatch_events, record_gap
from aml_app.gate.acks import Acks
from aml_app.gate.admit import Admitter
from aml_app.gate.delivery import DeliveryChecker
from aml_app.gate.gate import Admission, FreshnessGate
from aml_app.gate.generation import Assignment, log_changed, recovered
from aml_app.gate.handling import NOTHING_LEFT, BatchHandler, Handler, Handling, Retrying
from aml_app.gate.lane import Arrival, Lane
from aml_app.gate.options import DEFAULT_LIMITS, DEFAULT_POLICY, LaneLimits, LanePolicy
from aml_app.gate.repairs import Repairs
from aml_app.gate.sink import Sink
from aml_app.gate.stall import TICK as STALL_TICK
from aml_app.gate.stall import stalls
from aml_app.gate.stats import GateStats
from aml_app.kafka.security import PLAINTEXT, KafkaSecurity

log = logging.getLogger(__name__)


class AssignmentRefused(RuntimeError):
    """An assignment under which nothing may be processed (the sentence says why and what to do)."""


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
        limits: LaneLimits = DEFAULT_LIMITS,
        policy: LanePolicy = DEFAULT_POLICY,
        review: TopicT | None = None,
        worker_id: str = "",
        security: KafkaSecurity = PLAINTEXT,
    ) -> None:
        """Give `handler` (one payment at a time) or `batch_handler` (up to `limits.max_batch` payments
        of one partition at a time, every one of them already admitted by the gate). Either may return
        what is left to complete; up to `limits.max_in_flight` payments per partition wait for that
        while the lane goes on. `review` is where the payments `policy` sets aside go."""
        if (handler is None) == (batch_handler is None):
            raise ValueError("give either a handler or a batch_handler")
        if handler is not None and limits.max_batch != 1:
            raise ValueError("max_batch must be at least 1, and 1 with a per-payment handler")
        if policy.sets_aside and review is None:
            raise ValueError("deciding stale or parking needs a review topic")
        self.app = app
        self.gate = gate
        self.limits = limits
        self.stats = GateStats()
        self.sink = Sink(dead_letters, review, worker_id, self.stats)
        self.handling = Handling(handler, batch_handler, self.sink, self.stats, policy)
        self.admitter = Admitter(gate, self.sink, self.handling, limits, policy)
        self.acks = Acks(app, self.handling)
        #: Reads the log and the group's commits for the lanes, with the cluster's TLS/SASL.
        self.delivery = DeliveryChecker(app, security)
        self.lanes: dict[int, Lane] = {}
        self.assignment = Assignment()
        #: Per partition revoked from a lane: its unacked events, kept until we know who owns it.
        self.kept: dict[int, list[EventT[Any]]] = {}
        #: Per partition revoked from a lane: the first offset it had not finished handling (everything
        #: below was handled here); where its lane resumes if the partition stays with this worker.
        self.resume_at: dict[int, int] = {}
        #: The payments topic, for the gaps recorded at a resumption (set by attach()).
        self.topic: str | None = None
        self._background: set[asyncio.Future[None]] = set()
        current = lambda: self.assignment  # noqa: E731
        self.repairs = Repairs(app, self.delivery, self.stats, self.lanes, current, self._enqueue)

    @property
    def observers(self) -> list[Callable[[Admission], None]]:
        """Called with each payment's admission once it is done, before its ack (metrics)."""
        return self.acks.observers

    @property
    def retrying(self) -> dict[int, Retrying]:
        """Lanes that keep failing on a payment, by partition."""
        return self.handling.retrying

    def retrying_json(self) -> dict[str, Any]:
        return self.handling.retrying_json()

    async def check_delivery(self, topic: str, quiet: float) -> None:
        await self.repairs.check_delivery(topic, quiet)

    def fetch_state(self, topic: str) -> dict[int, dict[str, Any]]:
        return self.repairs.fetch_state(topic)

    @property
    def starts(self) -> dict[int, int]:
        return self.assignment.starts

    def attach(
        self,
        *,
        bootstrap_servers: Sequence[str],
        topic: str,
        group: str,
        check_every: float,
        quiet: float,
        refuse: Callable[[], str | None] = lambda: None,
        session_timeout: float | None = None,
    ) -> None:
        """Wire this consumer to the app's rebalances; every `check_every` s, check the delivery of the
        lanes quiet for `quiet` s; with the group's `session_timeout`, watch for stalls of the worker
        (`aml_app.gate.stall`).

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

        async def resume_lanes(sender: Any, assigned: Any, **kwargs: Any) -> None:
            # Reading offsets takes round trips to the broker: do it beside the rebalance, not inside
            # Faust's rebalance callback, which holds up the group join while it runs.
            mine = sorted(tp for tp in assigned if tp.topic == topic)
            self._spawn(self._learn_starts(bootstrap_servers, group, mine, refuse, self.assignment))

        async def check_delivery() -> None:
            await self.check_delivery(topic, quiet=quiet)

        self.delivery.attach(bootstrap_servers, topic)
        self.topic = topic
        # mode types a signal's receivers so that no function matches them (not even `def f(*a, **k)`).
        self.app.on_partitions_revoked.connect(stop_lanes)  # type: ignore[arg-type]
        self.app.on_before_shutdown.connect(stop_lanes)  # type: ignore[arg-type]
        self.app.on_partitions_assigned.connect(resume_lanes)  # type: ignore[arg-type]
        self.app.timer(check_every)(check_delivery)
        if session_timeout is not None:
            stalls.start(session_timeout)
            self.app.timer(STALL_TICK)(stalls.tick_async)

    async def _learn_starts(
        self,
        bootstrap_servers: Sequence[str],
        group: str,
        mine: list[TP],
        refuse: Callable[[], str | None],
        assignment: Assignment,
    ) -> None:
        # A refused assignment returns before `on_assigned`: its events stay in `early`, unprocessed.
        problem = refuse()
        if problem is not None:
            self._refuse(problem)
            return
        starts, read_from = await self.delivery.starts(bootstrap_servers, group, mine) if mine else ({}, None)
        if not assignment.active:
            return  # a newer rebalance began: its own task takes over
        if read_from is not None and self.gate.log not in (None, read_from):
            self._refuse(log_changed(self.topic, self.gate.log, read_from))
            return
        if read_from is not None:
            self.gate.log = read_from
        if await recovered(self.app, assignment):
            self.on_assigned(starts)

    async def consume(self, stream: faust.Stream[Any]) -> None:
        """The agent body: dispatch, never wait."""
        self.acks.stream = manual = stream.noack()
        await dispatch_events(manual, self._dispatch)

    def _lane(self, partition: int) -> Lane:
        lane = self.lanes.get(partition)
        if lane is None:
            lane = self.lanes[partition] = Lane(partition)
            lane.task = asyncio.ensure_future(self._run_lane(lane))
            lane.acker = asyncio.ensure_future(self.acks.run(lane))
            for task in lane.tasks():
                task.add_done_callback(self._lane_ended)
            kept = self.kept.pop(partition, [])
            resume = self.resume_at.pop(partition, None)
            if resume is not None:
                lane.resume_from(resume, self.starts.get(partition))
                self._handled_before(partition, resume)
            for event in kept:
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
        assignment = self.assignment
        if self.delivery.checks_holes and not assignment.known:
            early = assignment.early.setdefault(partition, [])
            early.append(event)
            if len(early) >= self.limits.max_pending and partition not in assignment.early_paused:
                # Bounded like a lane's queue: the rest is fetched again once the assignment is known.
                self.app.consumer.pause_partitions([TP(*event.message.tp)])
                assignment.early_paused.add(partition)
            return
        lane = self._lane(partition)
        self._enqueue(lane, event)
        if not lane.paused and lane.buffered >= self.limits.max_pending:
            # Back-pressure for this partition only: stop fetching it until the lane catches up.
            self.app.consumer.pause_partitions([TP(*event.message.tp)])
            lane.paused = True

    def _enqueue(self, lane: Lane, event: EventT[Any]) -> None:
        start = self.starts.get(lane.partition)
        if lane.receive(event, start, checks_holes=self.delivery.checks_holes) is Arrival.HOLE:
            self._spawn(self.repairs.check_hole(lane, TP(*event.message.tp)))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        # A generation's reads and repairs retry until done or cancelled with it: one that failed left
        # its partition paused or held for good, so it ends the worker as a failed lane does.
        task.add_done_callback(self._lane_ended)

    def on_revoked(self) -> None:
        """Stop every lane; keep its unacked events aside until we know who owns the partition.

        Nothing is acked, so the next owner starts at the committed offset. If the partition comes back
        to this worker, its lane resumes with the kept events: Faust does not always deliver records
        again that it had already delivered before the rebalance (seen under CPU load). Faust forgets
        its pauses of revoked partitions too, so the generation's early pauses go with it.
        """
        self.stats.rebalances += 1
        self.assignment.active = False
        self.assignment = Assignment()  # nothing is ours until the next assignment
        lanes = dict(self.lanes)
        self.lanes.clear()
        self.handling.retrying.clear()
        for lane in lanes.values():
            lane.stop()
            unacked = lane.unacked()
            if unacked:
                self.kept[lane.partition] = unacked
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
        group's committed offset, or the log start): the delivery check compares against it.
        """
        self.assignment.learnt(starts)
        for p in sorted(set(self.kept) | set(self.resume_at)):
            if p not in starts:
                self.kept.pop(p, None)
                self.resume_at.pop(p, None)
            else:
                self._lane(p)
        for p, lane in list(self.lanes.items()):
            if p not in starts:
                # Only an event from before the assignment could have made this lane: never ours.
                lane.stop()
                del self.lanes[p]
                self.handling.retrying.pop(p, None)
        early, paused = self.assignment.take_early()
        for p, events in early.items():
            if p in starts:
                for event in events:
                    self._dispatch(event)
        for p in sorted(paused & set(starts)):
            lane = self._lane(p)
            if not lane.paused and self.topic is not None:  # else the lane resumes it, as its own pauses
                self._spawn(self.repairs.resume(lane, TP(self.topic, p), lane.expected(starts[p])))

    def _lane_ended(self, task: asyncio.Task[None]) -> None:
        """A lane, or a partition's background read, ends only when cancelled. Anything else is a bug:
        stop loudly (a restart and a rebalance repair it), never stall silently."""
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a partition's lane or read stopped unexpectedly; stopping the worker", exc_info=exc)
            self.app.add_future(self.app.crash(exc))

    async def _run_lane(self, lane: Lane) -> None:
        """Admit, handle and hand to the acks the lane's payments, in offset order."""
        while True:
            await lane.wait_for_work(self.limits.max_in_flight)
            lane.go_on()
            admitted = await self.admitter.take(lane, self._taken)
            lane.go_on()
            handled = await self.handling.handle(admitted) if admitted else NOTHING_LEFT
            lane.go_on()
            await self.acks.hand_over(lane, admitted, handled)

    async def _taken(self, lane: Lane, event: EventT[Any]) -> None:
        """A lane paused by back-pressure whose queue fell to half the bound fetches again."""
        if lane.paused and lane.hole is None and len(lane.queue) <= self.limits.max_pending // 2:
            await self.repairs.resume(lane, TP(*event.message.tp), lane.next_offset)
