"""The lane's handling step: run the service's handler on admitted payments until it succeeds, show a
lane that keeps failing to the operators (`Retrying`), and park a payment on the review topic once a
retry ceiling or an operator says so. Nothing is skipped silently: Faust would ack a crashed event
(issue #315), so a failure here holds the lane on that payment."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from faust.types import EventT

from aml_app.backoff import awaited, retry_forever
from aml_app.faust_internals import set_current_event
from aml_app.gate.gate import Admission, Admitted
from aml_app.gate.sink import ReviewKind, Sink
from aml_app.gate.stats import GateStats
from aml_app.models import Payment

if TYPE_CHECKING:
    from aml_app.gate.options import LanePolicy, ParkRequest

log = logging.getLogger(__name__)

#: What a handler leaves to complete before its payments may be acked, e.g. the broker's acknowledgement
#: of a decision it sent (a future); None when it finished everything itself. The lane goes on with the
#: next payments meanwhile and acks, in offset order, once this completes (pipelined sends).
LeftToComplete = Awaitable[Any] | None
Handler = Callable[[Payment, Admission], Awaitable[LeftToComplete]]
#: Handles several admitted payments of one partition at once (in offset order); must be idempotent per
#: payment, since a failure retries the whole batch.
BatchHandler = Callable[[list[tuple[Payment, Admission]]], Awaitable[LeftToComplete]]


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


class Handling:
    def __init__(
        self,
        handler: Handler | None,
        batch_handler: BatchHandler | None,
        sink: Sink,
        stats: GateStats,
        policy: LanePolicy,
    ) -> None:
        """`policy.max_attempts` (> 0) parks a payment whose handler failed that many times;
        `policy.park_requested(partition, offset)` parks it at its next failure."""
        self.handler = handler
        self.batch_handler = batch_handler
        self.sink = sink
        self.stats = stats
        self.max_attempts = policy.max_attempts
        self.park_requested = policy.park_requested
        #: Lanes that keep failing on a payment, by partition.
        self.retrying: dict[int, Retrying] = {}

    async def handle(self, admitted: list[Admitted]) -> LeftToComplete:
        """Run the handler until it succeeds (retrying with backoff, shown in `retrying`); with a retry
        ceiling, a batch that reaches it is handled one payment at a time, and a payment that reaches it
        alone is parked on the review topic (then it is done: the lane moves on)."""
        first, last = admitted[0].admission, admitted[-1].admission
        if len(admitted) == 1:
            what = f"processing payment {admitted[0].payment.payment_id} at {first.partition}:{first.offset}"
        else:
            what = f"processing {len(admitted)} payments at {first.partition}:{first.offset}..{last.offset}"
        attempts = [0]

        def failed(attempt: int, exc: BaseException, wait: float) -> None:
            attempts[0] = attempt
            self.failed(admitted, attempt, exc, wait)

        try:
            return await retry_forever(
                what,
                lambda: self.call(admitted),
                on_failure=failed,
                attempts=self.max_attempts or None,
                stop=lambda: self._any_asked(admitted),
            )
        except Exception as exc:  # a retry ceiling or a park request: retry_forever raises nothing else
            if len(admitted) > 1:
                pending = [await self.handle([one]) for one in admitted]
                waits = [p for p in pending if p is not None]
                return asyncio.gather(*waits) if waits else None
            attempts[0] += 1  # the failure retry_forever raised was not reported to `failed`
            await self._park(admitted[0].event, first.partition, first.offset, attempts[0], exc)
            return None

    async def _park(
        self,
        event: EventT[Any],
        partition: int,
        offset: int,
        attempts: int,
        exc: BaseException,
        why: str = "",
    ) -> None:
        """Write the payment to the review topic, saying why: an operator's request (if one was made
        before the ceiling) or the ceiling, the last error, and `why` more."""
        asked = self._asked_to_park(partition, offset)
        if asked is not None and (not self.max_attempts or attempts < self.max_attempts):
            parked = f"parked by hand ({asked.by}: {asked.reason or 'no reason given'})"
        else:
            parked = f"parked after {attempts} failed attempts"
        reason = f"{parked}: {describe_error(exc)}" + (f"; {why}" if why else "")
        await self.sink.to_review(event, ReviewKind.PARKED, reason, attempts=attempts)

    def _asked_to_park(self, partition: int, offset: int) -> ParkRequest | None:
        return None if self.park_requested is None else self.park_requested(partition, offset)

    def _any_asked(self, admitted: list[Admitted]) -> bool:
        return any(self._asked_to_park(a.admission.partition, a.admission.offset) for a in admitted)

    def _gives_up(self, admitted: list[Admitted], failures: int) -> bool:
        """Whether `failures` failed attempts reach the retry ceiling, or an operator asked to park."""
        return bool(self.max_attempts and failures >= self.max_attempts) or self._any_asked(admitted)

    async def redo(self, admitted: list[Admitted], exc: BaseException) -> None:
        """Handle the payments again: their pending work (the sends) failed with `exc`, their first failed
        attempt. As in `handle`, a batch that reaches the retry ceiling or a park request is handled one
        payment at a time, and a payment that reaches it alone is parked."""
        first = admitted[0].admission
        self.failed(admitted, 1, exc, 0.0)
        log.warning(
            "the pending work of %d payment(s) at %d:%d failed (%s); handling them again",
            len(admitted),
            first.partition,
            first.offset,
            describe_error(exc),
        )

        async def again() -> None:
            pending = await self.call(admitted)
            if pending is not None:
                await awaited(pending, f"the pending work of {first.partition}:{first.offset}")

        failures, last = [1], exc

        def failed(attempt: int, error: BaseException, wait: float) -> None:
            failures[0] = attempt + 1
            self.failed(admitted, attempt + 1, error, wait)

        if not self._gives_up(admitted, 1):
            try:
                await retry_forever(
                    f"processing {len(admitted)} payment(s) again at {first.partition}:{first.offset} "
                    "(their pending work failed)",
                    again,
                    on_failure=failed,
                    attempts=self.max_attempts - 1 if self.max_attempts else None,
                    stop=lambda: self._any_asked(admitted),
                )
                return
            except Exception as error:  # a retry ceiling or a park request
                failures[0] += 1
                last = error
        if len(admitted) > 1:
            for one in admitted:
                await self.redo([one], last)
            return
        await self._park(admitted[0].event, first.partition, first.offset, failures[0], last)

    async def dead_letter(self, event: EventT[Any], reason: str) -> None:
        """Write a payment that breaks the contract to the dead-letter topic, retrying as `handle` does:
        at the retry ceiling or an operator's request it is parked on the review topic instead, with
        both reasons, so a dead-letter topic that refuses it never holds the partition."""
        partition, offset = event.message.partition, event.message.offset
        failures = [0]

        def failed(attempt: int, exc: BaseException, wait: float) -> None:
            failures[0] = attempt
            self.failed_at(partition, offset, 1, attempt, exc, wait)

        try:
            await self.sink.dead_letter(
                event,
                reason,
                on_failure=failed,
                attempts=self.max_attempts or None,
                stop=lambda: self._asked_to_park(partition, offset) is not None,
            )
        except Exception as exc:  # a retry ceiling or a park request: retry_forever raises nothing else
            why = f"it breaks the contract ({reason}) and its dead letter failed"
            await self._park(event, partition, offset, failures[0] + 1, exc, why)

    async def call(self, admitted: list[Admitted]) -> LeftToComplete:
        # The handler runs as if inside Faust's stream iteration of the (first) event, so it can use
        # partitioned tables like any agent: their reads and writes go to the event's partition, which
        # every event of a lane's batch shares. A retry of a stopped lane whose cancel was lost ends here.
        admitted[0].admission.go_on()
        set_current_event(admitted[0].event)
        if self.batch_handler is not None:
            return await self.batch_handler([(a.payment, a.admission) for a in admitted])
        assert self.handler is not None and len(admitted) == 1
        return await self.handler(admitted[0].payment, admitted[0].admission)

    def failed(self, admitted: list[Admitted], attempt: int, exc: BaseException, wait: float) -> None:
        first = admitted[0].admission
        self.failed_at(first.partition, first.offset, len(admitted), attempt, exc, wait)

    def failed_at(
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

    def settled(self, partition: int, first: int, last: int) -> None:
        """Offsets `first`..`last` of the partition are done: a lane retrying among them no longer is."""
        retrying = self.retrying.get(partition)
        if retrying is not None and first <= retrying.offset <= last:
            del self.retrying[partition]

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
