"""The freshness gate: a per-partition asyncio condition over the shared watermark table.

Each partition has its own condition, so a payment waiting on partition p never holds up another
partition. Whoever updates the table (the leader's refresh, or the changelog applying it on the other
workers) calls `notify(p)`, and the waiters re-check `offset < W(p)`. The waiters also re-check on a
timer (`recheck_every`): the notification comes from a hook into Faust's table internals, and a hook
that stops firing after an upgrade must slow the gate down, not hang it (`opened_by_recheck` counts
the payments that only the timer let through).

With a `cut` lookup the gate is the event-time gate across partitions (`aml_app.gate.event_time`): a
payment also needs the cut row to admit its event time, and a new cut row wakes every waiter.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aml_app.gate.event_time import Cut, admits, decided_at
from aml_app.gate.stall import stalls
from aml_app.gate.watermark import Stamped, WatermarkRow, derived_need, is_open

if TYPE_CHECKING:
    from faust.types import EventT

    from aml_app.models import Payment

#: What a partition with no row yet stands at: nothing is done.
CLOSED = WatermarkRow(partition=-1, watermark=-1, dependencies={}, refreshed_at=0.0)


@dataclass(frozen=True)
class Opening:
    """What let a payment through: its partition's watermark row, the event-time cut it was admitted
    at, or the seconds it waited before the decide-stale policy admitted it anyway."""

    row: WatermarkRow
    #: The event-time gate's cut the payment was admitted at (`aml_app.gate.event_time.decided_at`);
    #: None for the per-partition gate.
    cut: dict[str, Any] | None = None
    #: Seconds waited before the decide-stale policy gave up on the gate (None: the gate opened).
    stale: float | None = None

    #: The cut the payment was admitted at, whose derived offsets its evidence must include too.
    cut_row: Cut | None = None

    @property
    def watermark(self) -> int:
        return self.row.watermark

    @property
    def dependencies(self) -> dict[str, int]:
        return dict(self.row.dependencies)

    @property
    def log(self) -> str | None:
        return self.row.log

    @property
    def derived(self) -> dict[str, dict[int, int]]:
        return derived_need(self.row, self.cut_row)


@dataclass(frozen=True)
class Admission:
    """What the gate saw when it let a payment through; recorded in the decision."""

    partition: int
    offset: int
    watermark: int
    dependencies: dict[str, int]
    waited_ms: float
    gated: bool
    #: Which log the offsets are of, as the row that admitted it says (`aml_app.kafka.identity`).
    log: str | None = None
    #: The event-time gate's cut it was admitted at (`aml_app.gate.event_time.decided_at`); None for the
    #: per-partition gate.
    cut: dict[str, Any] | None = None
    #: Seconds it waited at the gate before the decide-stale policy admitted it without the gate's
    #: guarantee (None: admitted by the gate, or the gate is off).
    stale: float | None = None
    #: Per group reading a topic derived from payments, its offsets on that topic that the admitting
    #: reading mapped (`aml_app.gate.watermark.derived_need`): what that group's answers must include.
    derived: dict[str, dict[int, int]] = field(default_factory=dict)
    #: Whether the lane that admitted it has stopped (a revoke): its partition is another owner's then.
    stopped: Callable[[], bool] = field(default=lambda: False, compare=False, repr=False)

    def go_on(self) -> None:
        """Raise `CancelledError` once the lane that admitted it stopped. A lane's stop is a cancel, and
        a cancel can be lost inside the handler's awaits (the chaos soak saw one lost in a request to an
        API answering 503: the stopped lane waited out the outage, then decided 55 payments its
        partition's next owner decided too). A handler that waits out a dependency, or is about to send
        its decisions, checks here, so a stopped lane never decides for the next owner."""
        if self.stopped():
            raise asyncio.CancelledError(f"the lane of partition {self.partition} was stopped")

    async def still_ours(self) -> None:
        """`go_on`, once no stall of this worker holds sends (`aml_app.gate.stall`): a worker stopped
        past its session timeout learns of its eviction only at its next heartbeat, and a lane that
        sent before then alerted on what the partition's next owner had alerted on already."""
        await stalls.settled()
        self.go_on()

    @property
    def wants_fresh(self) -> bool:
        """Whether its evidence must include it (gated and not decided stale)."""
        return self.gated and self.stale is None

    @classmethod
    def of(
        cls,
        opening: Opening,
        partition: int,
        offset: int,
        waited_ms: float,
        gated: bool,
        stopped: Callable[[], bool] = lambda: False,
    ) -> Admission:
        return cls(
            partition=partition,
            offset=offset,
            watermark=opening.watermark,
            dependencies=opening.dependencies,
            waited_ms=waited_ms,
            gated=gated,
            log=opening.log,
            cut=opening.cut,
            stale=opening.stale,
            derived=opening.derived,
            stopped=stopped,
        )


@dataclass(frozen=True)
class Admitted:
    """An event the gate let through: its payment and what the gate saw."""

    event: EventT[Any]
    payment: Payment
    admission: Admission


Lookup = Callable[[int], WatermarkRow | None]
CutLookup = Callable[[], Cut | None]
#: Why a row may not be trusted (None: it may); see `aml_app.gate.watermark.distrust`.
Distrust = Callable[[Stamped], str | None]


class FreshnessGate:
    def __init__(
        self,
        lookup: Lookup,
        recheck_every: float = 1.0,
        distrust: Distrust | None = None,
        *,
        cut: CutLookup | None = None,
        lateness_us: int = 0,
    ) -> None:
        """`distrust` keeps the gate closed on rows it names a reason for (too old, or replayed from
        before this worker's consumer generation); by default every row counts. `cut` makes it the
        event-time gate, with `lateness_us` the allowed lateness in microseconds."""
        self._lookup = lookup
        self._distrust = distrust
        self._cut = cut
        self.lateness_us = lateness_us
        self.recheck_every = recheck_every
        #: Which log this worker's payments come from (`aml_app.kafka.identity`), learnt at each
        #: assignment; rows of another log are not trusted (see `aml_app.gate.watermark.distrust`).
        self.log: str | None = None
        self.opened_by_recheck = 0
        self._conditions: dict[int, asyncio.Condition] = {}
        self._notifications: set[asyncio.Task[None]] = set()
        #: partition -> (offset, since) of every waiter; one per lane, but any number is safe.
        self._waiters: dict[int, list[tuple[int, float]]] = {}

    @property
    def waiting(self) -> dict[int, int]:
        """Lowest waiting offset per partition (read by the demand publisher and the web view)."""
        return {p: min(o for o, _ in ws) for p, ws in self._waiters.items()}

    @property
    def blocked_since(self) -> dict[int, float]:
        """Since when (wall clock) each partition has had a waiter."""
        return {p: min(t for _, t in ws) for p, ws in self._waiters.items()}

    def row(self, partition: int) -> WatermarkRow | None:
        return self._lookup(partition)

    @property
    def event_time(self) -> bool:
        """Whether this is the event-time gate across partitions."""
        return self._cut is not None

    def _opening(
        self, partition: int, offset: int, event_us: int | None
    ) -> tuple[WatermarkRow, Cut | None] | None:
        """The partition's row and, in event-time mode, the cut row, if they let the payment through."""
        row = self._lookup(partition)
        if row is None or not is_open(offset, row):
            return None
        if self._distrust is not None and self._distrust(row) is not None:
            return None
        if self._cut is None:
            return row, None
        cut = self._cut()
        if event_us is None or cut is None or not admits(cut, partition, offset, event_us, self.lateness_us):
            return None
        if self._distrust is not None and self._distrust(cut) is not None:
            return None
        return row, cut

    def _open(self, partition: int, offset: int, event_us: int | None = None) -> Opening | None:
        """What lets `offset` through, if anything does; in event-time mode with the cut the payment was
        admitted at (see `aml_app.gate.event_time.decided_at`)."""
        opening = self._opening(partition, offset, event_us)
        if opening is None:
            return None
        row, cut = opening
        if cut is None:
            return Opening(row)
        assert event_us is not None  # a cut admits only a payment with an event time
        return Opening(row, decided_at(cut, event_us, self.lateness_us), cut_row=cut)

    def is_open(self, partition: int, offset: int, event_us: int | None = None) -> bool:
        return self._opening(partition, offset, event_us) is not None

    def distrusted(self, partition: int) -> str | None:
        """Why this partition's row keeps the gate closed whatever its watermark (None: it does not)."""
        row = self._lookup(partition)
        return None if row is None or self._distrust is None else self._distrust(row)

    def _condition(self, partition: int) -> asyncio.Condition:
        cond = self._conditions.get(partition)
        if cond is None:
            cond = self._conditions[partition] = asyncio.Condition()
        return cond

    async def wait_open(
        self, partition: int, offset: int, event_us: int | None = None, give_up_after: float | None = None
    ) -> Opening:
        """Return what opened once `offset < W(partition)` (and, in event-time mode, the cut admits
        the payment's event time `event_us`); wait as long as it takes, or `give_up_after` seconds: then
        the row as it is, with `stale`: the seconds waited (the caller decides it stale, openly).

        Cancellation (a rebalance revoking the partition) leaves the payment unprocessed and uncommitted.
        """
        opened = self._open(partition, offset, event_us)
        if opened is not None:
            return opened  # open: the common case costs one lookup, no lock
        cond = self._condition(partition)
        started = time.monotonic()
        async with cond:
            # One evaluation per check, returned as it is: trust is read off the clock, and a row that
            # ages out between a check and a second evaluation would leave nothing to return.
            if (opened := self._open(partition, offset, event_us)) is not None:
                return opened
            waiter = (offset, time.time())
            waiters = self._waiters.setdefault(partition, [])
            waiters.append(waiter)
            try:
                while True:
                    wait = self.recheck_every
                    if give_up_after is not None:
                        left = started + give_up_after - time.monotonic()
                        if left <= 0:
                            closed = self._lookup(partition) or CLOSED
                            return Opening(closed, stale=round(time.monotonic() - started, 3))
                        wait = min(wait, left)
                    # Not `asyncio.wait_for`: on Python 3.11 it swallows a cancel that lands just after a
                    # notification (it returns the finished `cond.wait()` instead), and a lane a revoke
                    # stops would wait on and handle its old queue again.
                    notified = True
                    try:
                        async with asyncio.timeout(wait):
                            await cond.wait()
                    except TimeoutError:
                        notified = False
                    if (opened := self._open(partition, offset, event_us)) is not None:
                        if not notified:
                            self.opened_by_recheck += 1
                        return opened
            finally:
                waiters.remove(waiter)
                if not waiters and self._waiters.get(partition) is waiters:
                    del self._waiters[partition]

    def notify_all(self) -> None:
        """Wake every waiter (a new cut row concerns every partition)."""
        self.notify(list(self._waiters))

    def notify(self, partitions: Iterable[int]) -> None:
        """Wake the waiters of these partitions; safe to call from synchronous table hooks."""
        for p in partitions:
            if p in self._waiters:
                task = asyncio.ensure_future(self._notify(p))
                self._notifications.add(task)
                task.add_done_callback(self._notifications.discard)

    async def _notify(self, partition: int) -> None:
        cond = self._condition(partition)
        async with cond:
            cond.notify_all()
