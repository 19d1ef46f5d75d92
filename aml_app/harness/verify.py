"""Checking the gate from the outside: was any payment decided before its dependencies committed?

The gate promises that a payment is decided only after every dependency group was told to commit past
it. Whoever plays the dependencies (the demo, the integration tests, the benchmarks) records when it
*initiated* each commit in a `CommitTimeline`; `premature` then compares the decisions' `decided_at`
against it. Initiation is the earliest moment the gate could have seen the commit, so a decision
before it is early for certain, and one after it may be honest. One implementation, so the demo's
verdict, the tests' assertions and the benchmarks' latencies all mean the same thing.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

#: (partition, offset, group, when the group's covering commit was initiated or None, decided at)
Premature = tuple[int, int, str, float | None, float]


class Committer(Protocol):
    async def commit(self, offsets: Mapping[int, int]) -> None: ...


class CommitTimeline:
    """When each dependency commit was initiated, per (group, partition), in the order recorded.

    Only commits that move a (group, partition) further than before are kept: the first commit past an
    offset is the only one that matters, so a bisection finds it.
    """

    def __init__(self) -> None:
        self._times: dict[tuple[str, int], list[float]] = {}
        self._offsets: dict[tuple[str, int], list[int]] = {}
        self.count = 0  # every recorded (group, partition, offset), moving forward or not

    def record(self, group: str, partition: int, offset: int, at: float | None = None) -> None:
        """`group` starts committing `offset` on `partition` now (or at wall-clock time `at`)."""
        self.count += 1
        offsets = self._offsets.setdefault((group, partition), [])
        if not offsets or offset > offsets[-1]:
            offsets.append(offset)
            self._times.setdefault((group, partition), []).append(time.time() if at is None else at)

    async def commit(self, committers: Mapping[str, Committer], offsets: Mapping[int, int]) -> None:
        """Commit `offsets` for every group in `committers` (group -> committer), recording it first."""
        for group, committer in committers.items():
            for p, o in offsets.items():
                self.record(group, p, o)
            await committer.commit(offsets)

    def committed(self, group: str) -> dict[int, int]:
        """The furthest offset recorded for `group`, per partition."""
        return {p: offsets[-1] for (g, p), offsets in self._offsets.items() if g == group}

    def covered_at(self, group: str, partition: int, offset: int) -> float | None:
        """Earliest time `group` was told to commit past `offset` on `partition`."""
        offsets = self._offsets.get((group, partition), [])
        i = bisect.bisect_right(offsets, offset)
        return self._times[(group, partition)][i] if i < len(offsets) else None

    def opened_at(self, groups: Iterable[str], partition: int, offset: int) -> float | None:
        """When the last of the dependency commits covering (partition, offset) was initiated."""
        times = [self.covered_at(g, partition, offset) for g in groups]
        return None if any(t is None for t in times) else max(t for t in times if t is not None)


def decided_at(decision: Mapping[str, Any]) -> float:
    """A decision record's `decided_at` as a POSIX timestamp."""
    return datetime.fromisoformat(decision["decided_at"]).timestamp()


def premature(
    decisions: Iterable[Mapping[str, Any]], groups: Iterable[str], timeline: CommitTimeline
) -> list[Premature]:
    """Decisions made before some dependency was told to commit past their payment, one entry per
    (decision, group) at fault."""
    groups = tuple(groups)
    bad = []
    for d in decisions:
        decided = decided_at(d)
        for group in groups:
            covered = timeline.covered_at(group, d["partition"], d["offset"])
            if covered is None or covered > decided:
                bad.append((d["partition"], d["offset"], group, covered, decided))
    return bad


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN when there are no values, infinite where it
    reaches an infinite value (a payment never decided: inf - inf and inf * 0 would give NaN)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    if k == lo or ordered[lo] == ordered[hi]:
        return float(ordered[lo])
    if math.isinf(ordered[hi]):
        return float(ordered[hi])
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
