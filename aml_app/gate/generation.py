"""One consumer generation of a worker's partitions, as the gated consumer sees it.

A revoke ends the current `Assignment` (`active` turns false) and begins the next, whose partitions and
starts are not known until the assignment's starts are read from the group's commits. Work begun for a
generation (reading its starts) checks that it is still the current one before acting on what it read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import faust
from faust.types import EventT

#: How often a wait for the end of a rebalance looks at Faust's `rebalancing` flag (s).
REBALANCE_CHECK = 0.05


@dataclass
class Assignment:
    #: Where each partition assigned in this generation starts (the group's committed offset, or the log
    #: start); empty until `known`.
    starts: dict[int, int] = field(default_factory=dict)
    #: Whether `starts` is known; until then events wait in `early`, so that a jump past the start is
    #: seen as the hole it is.
    known: bool = False
    #: When the starts became known (monotonic): since when the partitions are ours.
    known_at: float = field(default_factory=time.monotonic)
    #: Events received before the starts were known, per partition.
    early: dict[int, list[EventT[Any]]] = field(default_factory=dict)
    #: Partitions paused because `early` holds `max_pending` of their events.
    early_paused: set[int] = field(default_factory=set)
    #: False once a revoke has ended this generation.
    active: bool = True

    def learnt(self, starts: dict[int, int]) -> None:
        self.starts, self.known, self.known_at = dict(starts), True, time.monotonic()

    def take_early(self) -> tuple[dict[int, list[EventT[Any]]], set[int]]:
        """The events and pauses kept while the starts were unknown, handed over once."""
        early, paused = self.early, self.early_paused
        self.early, self.early_paused = {}, set()
        return early, paused


def log_changed(topic: str | None, was: str | None, now: str) -> str:
    """Why a worker stops when its topic is another log than when it started: the lanes' offsets and
    kept events are of the old log, so only a fresh start is right."""
    return (
        f"{topic} is now log {now}, not log {was} as when this worker started (it was deleted and created "
        "again, or the cluster changed): this worker stops so that it starts again on the new log with "
        "nothing of the old one"
    )


async def recovered(app: faust.App, assignment: Assignment) -> bool:
    """Wait until Faust has recovered the tables of `assignment`'s generation; False if a newer
    rebalance began meanwhile.

    The events a lane kept across a revoke are resumed from memory, past Faust's pause of the
    partitions during recovery: resumed at once, a kept payment that the partition's owner in between
    alerted on was checked against an `alerts-sent` store still missing that alert, and alerted again.
    Faust's `rebalancing` flag stays set from a revoke until the recovery of the current generation
    resumes its streams (a stale generation's recovery leaves it set). Each wait is short; a recovery
    that never ends shows as "recovering" on the worker's views."""
    return await rebalance_ended(app, lambda: assignment.active)


async def rebalance_ended(app: faust.App, going_on: Callable[[], bool] = lambda: True) -> bool:
    """Wait while Faust's `rebalancing` flag is set, from a revoke until the recovery of the current
    generation resumes its streams; False, at once, when `going_on()` turns false meanwhile. The flag is
    set by aiokafka's thread before the revoke reaches the event loop, which no asyncio.Event could be,
    so it is polled every `REBALANCE_CHECK` s."""
    while getattr(app, "rebalancing", False):
        if not going_on():
            return False
        await asyncio.sleep(REBALANCE_CHECK)
    return going_on()
