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
from typing import TYPE_CHECKING, Any, TypeVar

from faust.types import EventT

from aml_app.backoff import OnFailure, awaited, retry_forever
from aml_app.faust_internals import set_current_event
from aml_app.gate.gate import Admission, Admitted
from aml_app.gate.sink import ReviewKind, Sink
from aml_app.gate.stats import GateStats
from aml_app.models import Payment

if TYPE_CHECKING:
    from aml_app.gate.options import LanePolicy, ParkRequest

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What a handler leaves to complete before its payments may be acked, e.g. the broker's acknowledgement
#: of a decision it sent (a future); None when it finished everything itself. The lane goes on with the
#: next payments meanwhile and acks, in offset order, once this completes (pipelined sends).
LeftToComplete = Awaitable[Any] | None
Handler = Callable[[Payment, Admission], Awaitable[LeftToComplete]]
#: Handles several admitted payments of one partition at once (in offset order); must be idempotent per
#: payment, since a failure retries the whole batch.
BatchHandler = Callable[[list[tuple[Payment, Admission]]], Awaitable[LeftToComplete]]


@dataclass(frozen=True)
class Handled:
    """What `Handling.handle` leaves: the work to complete before the payments are acked (None: none), and
    the payments that work is for, which are handled again if it fails. A payment parked on the review
    topic is done: it is not among them."""

    pending: LeftToComplete
    covers: list[Admitted]


NOTHING_LEFT = Handled(None, [])


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


class GaveUp(Exception):
    """Retries ended by the retry ceiling or an operator's park request: after `attempts` failed
    attempts in all, the last with `error`."""

    def __init__(self, attempts: int, error: BaseException) -> None:
        super().__init__(f"gave up after {attempts} failed attempts: {describe_error(error)}")
        self.attempts, self.error = attempts, error


#: Runs something until it succeeds, reporting each failure to `on_failure`, and raises the last one
#: after `attempts` failures (None: no ceiling) or once `stop()` is true (`retry_forever`'s contract).
Retried = Callable[[OnFailure, int | None, Callable[[], bool]], Awaitable[T]]


def _retrying(what: str, action: Callable[[], Awaitable[T]]) -> Retried[T]:
    """`action` under `retry_forever`, as `Handling._until_done` runs it."""

    def retried(on_failure: OnFailure, attempts: int | None, stop: Callable[[], bool]) -> Awaitable[T]:
        return retry_forever(what, action, on_failure=on_failure, attempts=attempts, stop=stop)

    return retried


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

    async def handle(self, admitted: list[Admitted]) -> Handled:
        """Run the handler until it succeeds (retrying with backoff, shown in `retrying`); with a retry
        ceiling, a batch that reaches it is handled one payment at a time, and a payment that reaches it
        alone is parked on the review topic (then it is done: the lane moves on)."""
        first, last = admitted[0].admission, admitted[-1].admission
        if len(admitted) == 1:
            what = f"processing payment {admitted[0].payment.payment_id} at {first.partition}:{first.offset}"
        else:
            what = f"processing {len(admitted)} payments at {first.partition}:{first.offset}..{last.offset}"
        try:
            pending = await self._until_done(
                _retrying(what, lambda: self.call(admitted)),
                (first.partition, first.offset, len(admitted)),
                lambda: self._any_asked(admitted),
            )
        except GaveUp as gave_up:
            if len(admitted) > 1:
                handled = [await self.handle([one]) for one in admitted]
                waits = [h.pending for h in handled if h.pending is not None]
                covers = [a for h in handled if h.pending is not None for a in h.covers]
                return Handled(asyncio.gather(*waits), covers) if waits else NOTHING_LEFT
            await self._park(admitted[0].event, gave_up)
            return NOTHING_LEFT
        return NOTHING_LEFT if pending is None else Handled(pending, admitted)

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
        await self._again(admitted, exc, failed=1)

    async def _again(self, admitted: list[Admitted], exc: BaseException, failed: int) -> None:
        """`redo`'s retries, `failed` attempts counted before them: a payment split from its batch starts
        its own count, as in `handle`, so that only a payment that keeps failing alone is parked."""
        first = admitted[0].admission

        async def again() -> None:
            pending = await self.call(admitted)
            if pending is not None:
                # Shielded, as the acks' wait is: a revoke stops this redo, not the sends it waits for,
                # which the producer completes anyway (a cancelled send future logs Faust's traceback).
                where = f"{first.partition}:{first.offset}"
                await awaited(asyncio.shield(pending), f"the pending work of {where}")

        what = f"processing {len(admitted)} payment(s) again at {first.partition}:{first.offset}"
        try:
            await self._until_done(
                _retrying(f"{what} (their pending work failed)", again),
                (first.partition, first.offset, len(admitted)),
                lambda: self._any_asked(admitted),
                failed=failed,
                error=exc,
            )
        except GaveUp as gave_up:
            if len(admitted) > 1:
                for one in admitted:
                    await self._again([one], gave_up.error, failed=0)
                return
            await self._park(admitted[0].event, gave_up)

    async def dead_letter(self, event: EventT[Any], reason: str) -> None:
        """Write a payment that breaks the contract to the dead-letter topic, retrying as `handle` does
        (by default until it is written: a record is never dropped unwritten); at the retry ceiling
        (`AML_MAX_ATTEMPTS`) or an operator's request (`aml-app park`) it is parked on the review topic
        instead, with both reasons, so a dead-letter topic that refuses it holds the partition no longer
        than the ceiling or the operator allows."""
        partition, offset = event.message.partition, event.message.offset

        async def retried(on_failure: OnFailure, attempts: int | None, stop: Callable[[], bool]) -> None:
            # The sink retries each part of a large value on its own: a failure never sends one twice.
            await self.sink.dead_letter(event, reason, on_failure=on_failure, attempts=attempts, stop=stop)

        try:
            await self._until_done(
                retried, (partition, offset, 1), lambda: self._asked_to_park(partition, offset) is not None
            )
        except GaveUp as gave_up:
            why = f"it breaks the contract ({reason}) and its dead letter failed"
            await self._park(event, gave_up, why)

    async def _until_done(
        self,
        retried: Retried[T],
        where: tuple[int, int, int],
        asked: Callable[[], bool],
        failed: int = 0,
        error: BaseException | None = None,
    ) -> T:
        """What `retried` returns once it succeeds, each failed attempt shown in `retrying` at `where`
        (partition, offset, payments); `GaveUp` once `failed` attempts before this one and those made
        here reach the retry ceiling, or `asked()` says an operator asked to park."""
        partition, offset, payments = where
        if error is not None and (bool(self.max_attempts and failed >= self.max_attempts) or asked()):
            raise GaveUp(failed, error)
        attempts = [failed]

        def on_failure(attempt: int, exc: BaseException, wait: float) -> None:
            attempts[0] = failed + attempt
            self.failed_at(partition, offset, payments, failed + attempt, exc, wait)

        try:
            return await retried(on_failure, self.max_attempts - failed if self.max_attempts else None, asked)
        except Exception as exc:  # the ceiling or a park request: retry_forever raises nothing else
            raise GaveUp(attempts[0] + 1, exc) from exc  # the failure it raised was not reported

    async def _park(self, event: EventT[Any], gave_up: GaveUp, why: str = "") -> None:
        """Write the payment to the review topic, saying why: an operator's request (if one was made
        before the ceiling) or the ceiling, the last error, and `why` more."""
        attempts, exc = gave_up.attempts, gave_up.error
        asked = self._asked_to_park(event.message.partition, event.message.offset)
        if asked is not None and (not self.max_attempts or attempts < self.max_attempts):
            parked = f"parked by hand ({asked.by}: {asked.reason or 'no reason given'})"
        else:
            parked = f"parked after {attempts} failed attempts"
        reason = f"{parked}: {describe_error(exc)}" + (f"; {why}" if why else "")
        partition, offset = event.message.partition, event.message.offset
        await self.sink.to_review(
            event,
            ReviewKind.PARKED,
            reason,
            attempts=attempts,
            on_failure=self.review_failed(partition, offset),
        )

    def review_failed(self, partition: int, offset: int) -> OnFailure:
        """Shows a payment whose copy the review topic keeps refusing in `retrying`, as a failing handler
        is: the lane holds on it until the broker has it, and an operator must see why."""

        def on_failure(attempt: int, exc: BaseException, wait: float) -> None:
            self.failed_at(partition, offset, 1, attempt, exc, wait, during="writing it to the review topic")

        return on_failure

    def _asked_to_park(self, partition: int, offset: int) -> ParkRequest | None:
        return None if self.park_requested is None else self.park_requested(partition, offset)

    def _any_asked(self, admitted: list[Admitted]) -> bool:
        return any(self._asked_to_park(a.admission.partition, a.admission.offset) for a in admitted)

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
        self,
        partition: int,
        offset: int,
        payments: int,
        attempt: int,
        exc: BaseException,
        wait: float,
        during: str = "",
    ) -> None:
        """Record a failed attempt where the operators see it (`retrying`); `during` names a step other
        than the handler's."""
        now = time.time()
        current = self.retrying.get(partition)
        if current is None or current.offset != offset:
            current = self.retrying[partition] = Retrying(partition, offset, payments, since=now)
        current.attempts = max(current.attempts + 1, attempt)
        current.error = f"{during}: {describe_error(exc)}" if during else describe_error(exc)
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
