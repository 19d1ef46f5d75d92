"""The freshness gate: a per-partition asyncio condition over the shared watermark table.

Each partition has its own condition, so a payment waiting on partition p never holds up another
partition. Whoever updates the table (the leader's refresh, or the changelog applying it on the other
workers) calls `notify(p)`, and the waiters re-check `offset < W(p)`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from aml_app.gate.watermark import Row, is_open

Lookup = Callable[[int], Row | None]


class FreshnessGate:
    def __init__(self, lookup: Lookup) -> None:
        self._lookup = lookup
        self._conditions: dict[int, asyncio.Condition] = {}
        self._notifications: set[asyncio.Task[None]] = set()
        #: partition -> offset currently waiting, and since when (wall clock); read by the web view.
        self.waiting: dict[int, int] = {}
        self.blocked_since: dict[int, float] = {}

    def row(self, partition: int) -> Row | None:
        return self._lookup(partition)

    def is_open(self, partition: int, offset: int) -> bool:
        return is_open(offset, self._lookup(partition))

    def _condition(self, partition: int) -> asyncio.Condition:
        cond = self._conditions.get(partition)
        if cond is None:
            cond = self._conditions[partition] = asyncio.Condition()
        return cond

    async def wait_open(self, partition: int, offset: int) -> Row:
        """Return the watermark row once `offset < W(partition)`; wait as long as it takes.

        Cancellation (a rebalance revoking the partition) leaves the payment unprocessed and uncommitted.
        """
        cond = self._condition(partition)
        async with cond:
            if not self.is_open(partition, offset):
                self.waiting[partition] = offset
                self.blocked_since[partition] = time.time()
                try:
                    await cond.wait_for(lambda: self.is_open(partition, offset))
                finally:
                    self.waiting.pop(partition, None)
                    self.blocked_since.pop(partition, None)
            row = self._lookup(partition)
            assert row is not None and offset < row["watermark"]
            return row

    def notify(self, partitions: Iterable[int]) -> None:
        """Wake the waiters of these partitions; safe to call from synchronous table hooks."""
        for p in partitions:
            if p in self.waiting:
                task = asyncio.ensure_future(self._notify(p))
                self._notifications.add(task)
                task.add_done_callback(self._notifications.discard)

    async def _notify(self, partition: int) -> None:
        cond = self._condition(partition)
        async with cond:
            cond.notify_all()
