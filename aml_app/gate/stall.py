"""Has this worker just come back from a stall? Sends wait until its consumer can know who owns what.

A worker process stopped for longer than its session timeout (SIGSTOP, a paused VM, a machine that
swapped) is out of its group when it runs again, and its partitions are another worker's, which may have
alerted on the payments its lanes were deciding. When it runs again its lanes finish the batches whose
evidence arrived meanwhile at once, before aiokafka's thread has sent the heartbeat that finds the
eviction and before the revoke reaches the lanes: without a wait they alert a second time. So a ticker
notes when the event loop did not run for `limit` seconds, and for `settle` seconds after that the lanes
hold their sends (`Admission.still_ours`); then a lane that was revoked meanwhile is stopped, and one
that was not goes on. A stall the ticker has not run since is seen as one too: after a stop the loop
may run a lane's continuation before the ticker's.

The watch is off until `start` and its first tick: a process without a gated consumer (a unit test, a
command) never holds, and nor does a worker's start-up, which runs before its timers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: How often the ticker runs (s).
TICK = 0.1


class StallWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.limit = 0.0
        self.settle = 0.0
        self.started = False
        #: When the ticker last ran (None: not yet).
        self.last: float | None = None
        #: When a stall was last seen to end.
        self.resumed_at = float("-inf")
        #: Stalls seen.
        self.stalls = 0

    def start(self, session_timeout: float) -> None:
        """Watch for stalls of half the session timeout, and hold sends a fifth of it after one (the
        heartbeat interval the workers use, within which aiokafka's thread learns of an eviction)."""
        self.limit, self.settle = session_timeout / 2, session_timeout / 5
        self.started = True

    def tick(self) -> None:
        """The ticker's run; the first one starts the watch (the worker's start-up is no stall)."""
        now = self.clock()
        if self.started:
            self._observe(now)
            self.last = now

    async def tick_async(self) -> None:
        """`tick`, as a Faust timer calls it."""
        self.tick()

    def hold(self) -> float:
        """How long sends must still wait (s): 0 unless a stall ended less than `settle` ago."""
        if self.last is None:
            return 0.0
        now = self.clock()
        self._observe(now)
        return max(0.0, self.resumed_at + self.settle - now)

    async def settled(self) -> None:
        """Return once no stall holds sends; at most `settle` after the last stall ended."""
        while (wait := self.hold()) > 0:  # noqa: ASYNC110 - a wait for a time, not for a flag
            await asyncio.sleep(wait)

    def _observe(self, now: float) -> None:
        if self.last is not None and now - self.last > self.limit and self.resumed_at < self.last:
            self.resumed_at = now
            self.stalls += 1
            log.warning(
                "this worker did not run for %.1f s (stopped, or starved of CPU): its lanes hold their "
                "sends %.1f s, until its consumer knows whether its partitions moved",
                now - self.last,
                self.settle,
            )


#: The worker process's watch: one event loop, one gated consumer per worker.
stalls = StallWatch()
