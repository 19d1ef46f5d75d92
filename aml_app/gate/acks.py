"""The lane's last step: ack its handled batches strictly in offset order, once what each handler left
to complete (its sends) has completed, and never while a rebalance is under way.

Faust commits the longest contiguous run of acked offsets, so in-order acks keep the committed offset
from passing a payment that is waiting or in flight (the over-commit of Faust issue #606 needs an ack
ahead of an unacked head, which in-order acks never produce).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import faust
from faust.types import EventT, StreamT

from aml_app.backoff import awaited
from aml_app.gate.gate import Admission, Admitted
from aml_app.gate.generation import rebalance_ended
from aml_app.gate.handling import Handled, Handling
from aml_app.gate.lane import HandledBatch, Lane

log = logging.getLogger(__name__)


def done() -> asyncio.Future[None]:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


class Acks:
    def __init__(self, app: faust.App, handling: Handling) -> None:
        self.app = app
        self.handling = handling
        #: Called with the admission of each payment once it is done (its handler and whatever the handler
        #: left pending completed), before its ack (metrics); never fails a lane.
        self.observers: list[Callable[[Admission], None]] = []
        #: The agent's stream, with manual acks (set when the agent starts consuming).
        self.stream: StreamT[Any] | None = None

    async def run(self, lane: Lane) -> None:
        """Ack the lane's handled batches in offset order as their pending work completes.

        A pending send that fails is not skipped: its payments are handled again (handlers are
        idempotent per payment) until their work completes; the batches behind it wait for that.
        """
        while True:
            entry = await lane.front()
            lane.go_on()
            try:
                pending = entry.pending
                if isinstance(pending, asyncio.Future) and pending.done() and not pending.cancelled():
                    pending.result()  # the common case under load: already acknowledged
                else:
                    # Shielded: a revoke cancels this task (and stops the lane), not the send, which
                    # Faust completes anyway; a cancelled send is a failure like any other.
                    await awaited(asyncio.shield(pending), "a pending send")
            except Exception as exc:
                await self.handling.redo(entry.again, exc)
            lane.go_on()
            # Settled while still at the front: the lane queues behind it rather than acking ahead.
            await self.settle(lane, entry.events, entry.admitted)
            lane.acked_front()

    async def hand_over(self, lane: Lane, admitted: list[Admitted], handled: Handled) -> None:
        """The lane's current batch is handled: ack it at once when nothing waits, else queue it."""
        events = lane.hand_over()
        if handled.pending is None and not lane.handled:
            await self.settle(lane, events, admitted)  # nothing to wait for: ack at once
        else:
            lane.add_handled(HandledBatch(events, admitted, handled.pending or done(), handled.covers))

    async def settle(self, lane: Lane, events: list[EventT[Any]], admitted: list[Admitted]) -> None:
        """The payments are done: tell the observers, then ack every event in offset order."""
        self.handling.settled(lane.partition, events[0].message.offset, events[-1].message.offset)
        for one in admitted:
            for observe in self.observers:
                try:
                    observe(one.admission)
                except Exception:  # an observer is for telemetry; it must never stop a lane
                    log.exception("an admission observer failed")
        assert self.stream is not None
        ack = self.stream.ack
        # Faust forgets the acks of a revoked partition when its revoke begins, but keeps any made after
        # that, until the lanes stop: held over into the next generation, they were counted twice with the
        # offsets a resumed lane records as handled, and Faust's commit crawled. A held ack is not lost:
        # the lane stops, or the rebalance ends first. The wait comes once, before the batch: aiokafka's
        # thread sets the flag at any moment, and a batch half acked when it waited was handled again in
        # the next generation, where Faust ignores an event's second ack, so its acked offsets began past
        # the committed one and the partition committed nothing. Stream.ack never yields, so no revoke
        # reaches the event loop between the batch's acks.
        await rebalance_ended(self.app)
        for event in events:
            await ack(event)
        lane.settled(len(events))
