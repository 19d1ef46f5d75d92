"""One partition's lane: the events it holds, in offset order, from arrival to ack.

A lane receives its partition's events from the agent's stream, queues them, hands them to processing
one batch at a time and keeps the handled batches until their acks. It knows the next offset it
expects, so it drops a re-delivery and notices a jump: a *hole* (records Faust did not hand over, or a
gap in the log; `aml_app.gate.delivery` tells which), past which it holds what arrives. It knows nothing
of Faust's consumer or the gate: `GatedConsumer` runs its tasks and pauses its partition, and the
steps (`admit`, `handling`, `acks`) take, handle and ack its events.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from faust.types import EventT

from aml_app.gate.gate import Admitted


class Arrival(Enum):
    """What a lane did with an event it received."""

    #: Below the offset it expects: delivered before (kept over a rebalance, or fetched again); dropped.
    REDELIVERED = "redelivered"
    #: Past an open hole: held until the hole is checked.
    HELD = "held"
    #: Past the offset it expects: a hole opens, held with this event; the log must say what it is. Also
    #: the first event past a hole fetched again: the fetch skipped it too, so the log is asked again.
    HOLE = "hole"
    #: Queued for processing.
    QUEUED = "queued"


@dataclass
class HandledBatch:
    """Payments whose handler ran and whose `pending` work (a decision's send) has not completed; `events`
    also holds the batch's dead letters, acked with it. `again`: the payments handled again should the
    work fail (those of `admitted` not parked)."""

    events: list[EventT[Any]]
    admitted: list[Admitted]
    pending: Awaitable[Any]
    again: list[Admitted]


@dataclass
class Lane:
    partition: int
    queue: deque[EventT[Any]] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    #: Whether `GatedConsumer` paused the partition's fetching for this lane (back-pressure).
    paused: bool = False
    #: The events taken from the queue and not handed to the acks yet (the batch being handled).
    current: list[EventT[Any]] = field(default_factory=list)
    #: Handled batches not acked yet, in offset order: acked from the front.
    handled: deque[HandledBatch] = field(default_factory=deque)
    handled_payments: int = 0
    #: Set when `handled` gains an entry (wakes the acker) and when it has room again (wakes the lane).
    more_handled: asyncio.Event = field(default_factory=asyncio.Event)
    room: asyncio.Event = field(default_factory=asyncio.Event)
    acker: asyncio.Task[None] | None = None
    #: When each queued offset reached this worker (monotonic), for the decision's waited_ms.
    arrived: dict[int, float] = field(default_factory=dict)
    done: int = 0
    #: Next offset this lane expects; anything lower was delivered before (a re-delivery).
    next_offset: int | None = None
    #: When the lane last received the offset it expected.
    last_dispatch: float = field(default_factory=time.monotonic)
    #: (expected, received) while a jump past the expected offset is being checked against the log.
    hole: tuple[int, int] | None = None
    #: The events received past the hole meanwhile, in offset order; queued if the hole is no hole.
    held: list[EventT[Any]] = field(default_factory=list)
    #: The hole is fetched again: what comes past it first says the fetch skipped it too (the log did
    #: not answer in time about a real gap), and the log is asked again.
    refetched: bool = False
    #: Set by `stop`: the lane's successor owns its events from then on.
    stopped: bool = False

    # --- arrivals ---------------------------------------------------------------------------------

    def expected(self, start: int | None) -> int | None:
        """The next offset the lane expects: past the last one it queued, or the generation's start."""
        return self.next_offset if self.next_offset is not None else start

    def receive(self, event: EventT[Any], start: int | None, *, checks_holes: bool) -> Arrival:
        """Queue `event` if it is the next one; `start` is where the partition starts in this generation,
        and `checks_holes` whether a jump past the expected offset opens a hole (else it is queued)."""
        offset = event.message.offset
        expected = self.expected(start)
        if expected is not None and offset < expected:
            return Arrival.REDELIVERED
        if self.hole is not None:
            if expected is not None and offset > expected:
                if not self.held or offset > self.held[-1].message.offset:
                    self.held.append(event)
                if self.refetched:
                    self.refetched = False
                    return Arrival.HOLE
                return Arrival.HELD
            self.hole, self.held, self.refetched = None, [], False  # the missing record came after all
        elif expected is not None and offset > expected and checks_holes:
            self.hole, self.held, self.refetched = (expected, offset), [event], False
            return Arrival.HOLE
        now = time.monotonic()
        self.next_offset = offset + 1
        self.last_dispatch = now
        self.arrived[offset] = now
        self.queue.append(event)
        self.ready.set()
        return Arrival.QUEUED

    def cross_gap(self) -> list[EventT[Any]]:
        """The open hole is a gap in the log: expect what came past it; its held events, to receive again."""
        assert self.hole is not None
        held, self.next_offset = self.held, self.hole[1]
        self.hole, self.held, self.refetched = None, [], False
        return held

    def narrow_hole(self, first: int) -> None:
        """The log holds no record before `first` in the open hole: expect `first` next."""
        assert self.hole is not None
        self.next_offset, self.hole = first, (first, self.hole[1])

    def refetching(self) -> None:
        """The hole's records are fetched again: the held events come again after them, and the first
        that comes before them opens the question again."""
        self.held, self.refetched = [], True

    @property
    def buffered(self) -> int:
        """Events received and not taken yet: queued, and held past a hole."""
        return len(self.queue) + len(self.held)

    def resume_from(self, resume: int, start: int | None) -> None:
        """The partition came back to this worker: everything below `resume` was handled here."""
        self.next_offset = resume if start is None else max(resume, start)

    # --- processing -------------------------------------------------------------------------------

    async def wait_for_work(self, max_in_flight: int) -> None:
        """Until something is queued and fewer than `max_in_flight` payments wait for their acks."""
        while not self.queue:
            self.ready.clear()
            await self.ready.wait()
        while self.handled_payments >= max_in_flight:
            self.room.clear()
            await self.room.wait()

    def take(self) -> tuple[EventT[Any], float]:
        """The head of the queue, into the current batch, with when it arrived (monotonic)."""
        event = self.queue.popleft()
        self.current.append(event)
        return event, self.arrived.pop(event.message.offset, time.monotonic())

    def hand_over(self) -> list[EventT[Any]]:
        """The current batch's events, handled: the batch is no longer current."""
        events, self.current = self.current, []
        return events

    def add_handled(self, entry: HandledBatch) -> None:
        self.handled.append(entry)
        self.handled_payments += len(entry.events)
        self.more_handled.set()

    async def front(self) -> HandledBatch:
        """The oldest handled batch not acked yet, once there is one."""
        while not self.handled:
            self.more_handled.clear()
            await self.more_handled.wait()
        return self.handled[0]

    def acked_front(self) -> None:
        """The oldest handled batch is acked: it leaves, and makes room."""
        entry = self.handled.popleft()
        self.handled_payments -= len(entry.events)
        self.room.set()

    def settled(self, events: int) -> None:
        """`events` more were acked (counted for the web view)."""
        self.done += events

    # --- views ------------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int | None:
        """The lowest offset being processed and not acked yet."""
        if self.handled:
            return self.handled[0].events[0].message.offset
        return self.current[0].message.offset if self.current else None

    def unacked(self) -> list[EventT[Any]]:
        """The unacked events, in offset order: the handled ones first."""
        return [*(e for entry in self.handled for e in entry.events), *self.current, *self.queue]

    def resume_offset(self) -> int | None:
        """Where the lane would go on: its first unacked event, or the next offset it expects."""
        unacked = self.unacked()
        return unacked[0].message.offset if unacked else self.next_offset

    def tasks(self) -> list[asyncio.Task[None]]:
        return [t for t in (self.task, self.acker) if t is not None]

    def stop(self) -> None:
        self.stopped = True
        for task in self.tasks():
            task.cancel()

    def go_on(self) -> None:
        """Raise `CancelledError` once stopped. A cancel that an await swallows (Python 3.11's
        `asyncio.wait_for` returns a result that was ready when the cancel came) must not leave a
        stopped lane handling the events its successor handles too."""
        if self.stopped:
            raise asyncio.CancelledError(f"lane {self.partition} was stopped")
