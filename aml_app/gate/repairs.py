"""How the lanes repair Faust's delivery: a lane that received an offset past the one it expects has a
*hole* (records Faust did not hand over, or a gap in the log: the log tells which), a lane quiet while
its partition has records was fetched and not delivered, and a partition paused by back-pressure is
fetched again from where its lane stands. Each repair asks the log or seeks through
`aml_app.gate.delivery`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import faust
from faust.types import TP, EventT

from aml_app.gate.delivery import DeliveryChecker
from aml_app.gate.generation import Assignment
from aml_app.gate.lane import Lane
from aml_app.gate.stats import GateStats

log = logging.getLogger(__name__)

#: How long the delivery check believes the log's word that offsets past a lane hold no records.
MARKERS_RECHECK = 60.0


class Repairs:
    def __init__(
        self,
        app: faust.App,
        delivery: DeliveryChecker,
        stats: GateStats,
        lanes: dict[int, Lane],
        assignment: Callable[[], Assignment],
        enqueue: Callable[[Lane, EventT[Any]], None],
    ) -> None:
        """`lanes` is the consumer's own dict of lanes (changed in place), `assignment` gives its current
        generation and `enqueue` hands a lane an event again."""
        self.app = app
        self.delivery = delivery
        self.stats = stats
        self.lanes = lanes
        self.assignment = assignment
        self.enqueue = enqueue
        #: Partition -> (expected, position) of its last refetch by the delivery check.
        self.refetched: dict[int, tuple[int, int]] = {}
        #: Partition -> (expected, position, when) the log said those offsets hold no records.
        self.no_records: dict[int, tuple[int, int, float]] = {}

    async def check_hole(self, lane: Lane, tp: TP) -> None:
        """Offsets `expected`..`received - 1` never reached the lane: fetch them again from the log's
        first record there, and cross what lies before it (a gap in offsets is real: transaction
        markers, compaction, retention)."""
        assert lane.hole is not None
        hole = expected, received = lane.hole
        start = await self.delivery.first_to_fetch(tp, expected, received)
        if lane.hole != hole or self.lanes.get(lane.partition) is not lane:
            return  # filled meanwhile, or the partition moved on
        if start > expected:
            log.info("%s: no records at offsets %d..%d (a gap in the log); going on", tp, expected, start - 1)
            self.stats.gaps_accepted += 1
        if start == received:
            for event in lane.cross_gap():
                self.enqueue(lane, event)
            return
        log.warning(
            "%s: the consumer skipped offsets %d..%d (delivered %d next); fetching them again",
            tp,
            start,
            received - 1,
            received,
        )
        lane.narrow_hole(start)
        lane.refetching()
        await self.delivery.seek(tp, start)
        self.stats.holes_refetched += 1
        if lane.paused:  # paused while it held events past the hole: they come again
            await self.resume(lane, tp, None)

    async def check_delivery(self, topic: str, quiet: float) -> None:
        """Fetch again what an owned partition should have delivered to its lane and did not, once the
        lane has had nothing new for `quiet` seconds: from the first offset it still needs (it drops any
        duplicate). See `DeliveryChecker.undelivered`. It runs on a timer, which stops for good when it
        raises: a check that fails under a rebalance fails only its partition's, until the next run."""
        now = time.monotonic()
        for p, start in list(self.assignment().starts.items()):
            lane = self.lanes.get(p)
            last = lane.last_dispatch if lane else self.assignment().known_at
            if now - last < quiet or (lane is not None and lane.paused):
                continue
            expected = lane.next_offset if lane and lane.next_offset is not None else start
            tp = TP(topic, p)
            try:
                position = await self.delivery.undelivered(tp, expected, quiet)
                if position is None:
                    continue
                if await self._only_markers(tp, expected, position, now):
                    continue
                self.refetched[p] = (expected, position)
                log.warning(
                    "%s: offsets %d..%d were fetched but never delivered; fetching them again",
                    tp,
                    expected,
                    position - 1,
                )
                await self.delivery.seek(tp, expected)
            except Exception as exc:  # revoked under the check (IllegalStateError), a client closed under it
                log.warning("%s: the delivery check failed (%r); checking again at its next run", tp, exc)
                continue
            self.stats.refetches += 1

    async def _only_markers(self, tp: TP, expected: int, position: int, now: float) -> bool:
        """Whether `expected`..`position - 1` hold no records: aiokafka's position steps past a
        transaction's commit marker (and a compacted tail), so an idle partition of a transactional
        topic stands one past its last record, and was fetched again and warned about at every check.
        Asked of the log once a refetch of the same offsets brought nothing, and believed for
        MARKERS_RECHECK seconds; a log that does not answer in time is believed too, for as long."""
        p = tp.partition
        said = self.no_records.get(p)
        if said is not None and said[:2] == (expected, position) and now - said[2] < MARKERS_RECHECK:
            return True
        if self.refetched.get(p) != (expected, position):
            return False  # not fetched again yet: that is the first repair
        first = await self.delivery.first_record(tp, expected)
        if first is not None and expected <= first < position:
            return False  # records there, and the refetch did not take: fetch again
        if said is None or said[:2] != (expected, position):
            log.info("%s: offsets %d..%d hold no records (transaction markers)", tp, expected, position - 1)
        self.no_records[p] = (expected, position, now)
        return True

    def fetch_state(self, topic: str) -> dict[int, dict[str, Any]]:
        """Per owned partition, what the delivery check looks at: where this generation started, the next
        offset the lane expects, how long it has had nothing, and whether Faust fetches it at all."""
        now = time.monotonic()
        state = {}
        for p in sorted(set(self.assignment().starts) | set(self.lanes)):
            lane = self.lanes.get(p)
            paused_in_faust, fetched_by_faust = self.delivery.flags(TP(topic, p))
            state[p] = {
                "start": self.assignment().starts.get(p),
                "next_offset": lane.next_offset if lane else None,
                "queued": len(lane.queue) if lane else 0,
                "quiet_s": round(now - (lane.last_dispatch if lane else self.assignment().known_at), 3),
                "paused_by_lane": bool(lane and lane.paused),
                "hole": list(lane.hole) if lane and lane.hole else None,
                "paused_in_faust": paused_in_faust,
                "fetched_by_faust": fetched_by_faust,
            }
        return state

    async def resume(self, lane: Lane, tp: TP, offset: int | None) -> None:
        """Fetch a partition paused by back-pressure again, from `offset`: the first offset its lane
        has not had (None: already sought).

        Faust drops the records of a partition it pauses that its current fetch still holds (its
        `getmany` checks the set of active partitions that `pause_partitions` shrinks), while aiokafka's
        position is already past them. Without the seek the lane would have a hole, found only by the
        hole check or by `check_delivery` once the lane has been quiet: seconds at every pause, measured
        in the end-to-end benchmark. `tp` is Faust's own TP type: aiokafka's would crash its checks.
        """
        if offset is not None:
            await self.delivery.seek(tp, offset)
        self.app.consumer.resume_partitions([tp])
        lane.paused = False
