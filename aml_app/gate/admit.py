"""The lane's first step: take the next payments of a partition in offset order and admit each one.

    parse -> (breaks the contract: dead-letter) -> wait for the gate -> (waited too long under the
    decide-stale policy: admitted stale, a copy to review) -> admitted

The head of the queue waits for the gate; the payments queued behind it join its batch only while the
gate is already open for them, so a batch never waits for a later payment.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from faust.types import EventT

from aml_app.gate.event_time import micros
from aml_app.gate.gate import CLOSED, Admission, Admitted, FreshnessGate, Opening
from aml_app.gate.handling import Handling
from aml_app.gate.lane import Lane
from aml_app.gate.options import LaneLimits, LanePolicy
from aml_app.gate.sink import ReviewKind, Sink
from aml_app.models import InvalidPayment, Payment, parse_payment

#: Called with a paused lane and the event it has just taken, before the event waits (back-pressure's
#: resume).
OnTaken = Callable[[Lane, EventT[Any]], Any]


class Admitter:
    def __init__(
        self, gate: FreshnessGate, sink: Sink, handling: Handling, limits: LaneLimits, policy: LanePolicy
    ) -> None:
        """`policy.stale_after` (seconds, the decide-stale wait policy) admits a payment that has waited
        that long at the gate as stale; by default a payment waits as long as it takes."""
        self.gate = gate
        self.sink = sink
        self.handling = handling
        self.gate_enabled = policy.gate_enabled
        self.stale_after = policy.stale_after
        self.max_batch = limits.max_batch
        self.max_payment_bytes = limits.max_payment_bytes
        self.max_clock_skew = limits.max_clock_skew

    async def take(self, lane: Lane, on_taken: OnTaken) -> list[Admitted]:
        """The lane's next events into its current batch, in offset order; the admitted ones (the others
        went to the dead-letter topic), up to `max_batch` payments."""
        taken: list[Admitted] = []
        head = True
        while lane.queue and len(taken) < self.max_batch:
            event = lane.queue[0]
            parsed = self.parse(event)
            event_us = self.event_us(parsed)
            p, offset = event.message.partition, event.message.offset
            if not head and self.gate_enabled and not self.gate.is_open(p, offset, event_us):
                break
            head = False
            _, arrived = lane.take()
            if lane.paused:  # only a paused lane has anything to do when its queue shrinks
                await on_taken(lane, event)
            admitted = await self.admit(event, arrived, parsed, event_us, lambda: lane.stopped)
            lane.go_on()
            if admitted is not None:
                taken.append(admitted)
        return taken

    def parse(self, event: EventT[Any]) -> Payment | InvalidPayment:
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

    def event_us(self, parsed: Payment | InvalidPayment) -> int | None:
        """The payment's event time for the event-time gate (None: the per-partition gate, or no payment)."""
        if not self.gate.event_time or isinstance(parsed, InvalidPayment):
            return None
        return micros(parsed.ts)

    async def admit(
        self,
        event: EventT[Any],
        arrived: float,
        parsed: Payment | InvalidPayment,
        event_us: int | None,
        stopped: Callable[[], bool] = lambda: False,
    ) -> Admitted | None:
        """Wait for the gate (`event_us`: the payment's event time, for the event-time gate); a payment
        that breaks the contract is dead-lettered (None). `stopped`: whether the admitting lane stopped
        (`Admission.go_on`)."""
        p, offset = event.message.partition, event.message.offset
        if isinstance(parsed, InvalidPayment):
            await self.handling.dead_letter(event, str(parsed))
            return None
        if self.gate_enabled:
            opening = await self.gate.wait_open(p, offset, event_us, self.stale_after)
            if opening.stale is not None:
                reason = f"decided stale after waiting {opening.stale:g} s at the gate"
                await self.sink.to_review(
                    event, ReviewKind.STALE, reason, on_failure=self.handling.review_failed(p, offset)
                )
        else:
            opening = Opening(self.gate.row(p) or CLOSED)
        # From arrival at this worker to the start of processing: the time the payment was held, by the
        # gate on itself or on an earlier payment of its partition.
        waited_ms = round((time.monotonic() - arrived) * 1000, 3)
        admission = Admission.of(opening, p, offset, waited_ms, self.gate_enabled, stopped)
        return Admitted(event, parsed, admission)
