"""Is the leader's refresh alive? The watchdog that tells, and says what to do when it is not.

The leader alone refreshes the watermark table; while it cannot, every row ages out and the gate stays
closed everywhere: safe, and nothing is decided. Each refresh runs under a deadline
(`RefreshPolicy.refresh_deadline`) and one that overruns is abandoned with its Kafka clients, so an
attempt always ends. The watchdog looks at how they end, on its own timer:

- no refresh has succeeded for `stuck_after` seconds (since the last success, or since this worker
  leads): the worker is `stuck`: it says so on its views and metrics and rebuilds its clients, once;
- still stuck `leave_after` seconds later, and the last attempt overran (it was abandoned at its
  deadline, or one of its reads had no answer in time), or no attempt ended for twice the deadline (the
  refresh timer itself is not running): the worker leaves its group (it stops, and its supervisor starts
  it again), so that another worker leads. Attempts that fail fast (the broker refuses connections or
  answers with an error) keep the worker stuck but in the group: every worker would meet the same
  broker, and the errors are on every view.

Pure: the caller passes the time and acts on the verdict (`tables.watermarks.WorkerGate`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class Verdict(Enum):
    OK = "ok"
    #: No success for `stuck_after`: shown everywhere; the first time, the clients are rebuilt.
    REBUILD = "rebuild"
    STUCK = "stuck"
    #: Stuck for `leave_after` more, on overruns: leave the group so that another worker leads.
    LEAVE = "leave"


class Outcome(Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    OVERRAN = "overran"


class RefreshWatchdog:
    """The leader's refresh attempts as they end, and the verdict on them (see the module docstring)."""

    def __init__(self, deadline: float, stuck_after: float, leave_after: float) -> None:
        self.deadline = deadline
        self.stuck_after = stuck_after
        self.leave_after = leave_after
        #: Since when this worker leads and is watched (None: it does not lead).
        self.armed_at: float | None = None
        self.last_success: float | None = None
        self.last_ended: float | None = None
        self.last_outcome: Outcome | None = None
        self.stuck_since: float | None = None
        self.overruns = 0
        self.rebuilds = 0

    def arm(self, now: float) -> None:
        """This worker leads: watch it from now on (a no-op while already armed)."""
        if self.armed_at is None:
            self.armed_at = now
            self.stuck_since = None

    def disarm(self) -> None:
        """This worker no longer leads: nothing to watch, and its history no longer counts."""
        self.armed_at = self.stuck_since = None

    def ended(self, now: float, outcome: Outcome) -> None:
        self.last_ended, self.last_outcome = now, outcome
        if outcome is Outcome.SUCCEEDED:
            self.last_success = now
            self.stuck_since = None
        elif outcome is Outcome.OVERRAN:
            self.overruns += 1

    def quiet_for(self, now: float) -> float:
        """Seconds without a successful refresh, counted from when this worker started to lead."""
        if self.armed_at is None:
            return 0.0
        since = self.armed_at if self.last_success is None else max(self.last_success, self.armed_at)
        return max(0.0, now - since)

    def check(self, now: float) -> Verdict:
        if self.armed_at is None or self.quiet_for(now) < self.stuck_after:
            self.stuck_since = None
            return Verdict.OK
        if self.stuck_since is None:
            self.stuck_since = now
            self.rebuilds += 1
            return Verdict.REBUILD
        ended = self.last_ended if self.last_ended is not None else self.armed_at
        hung = now - max(ended, self.armed_at) > 2 * self.deadline
        if now - self.stuck_since >= self.leave_after and (hung or self.last_outcome is Outcome.OVERRAN):
            return Verdict.LEAVE
        return Verdict.STUCK

    def as_json(self, now: float) -> dict[str, Any]:
        """For `/watermarks.json`'s `refresh` (the leader's; zeros and nulls elsewhere)."""
        return {
            "state": "stuck" if self.stuck_since is not None else "ok",
            "stuck_for_s": None if self.stuck_since is None else round(now - self.stuck_since, 3),
            "without_success_s": round(self.quiet_for(now), 3),
            "last_outcome": None if self.last_outcome is None else self.last_outcome.value,
            "overruns": self.overruns,
            "client_rebuilds": self.rebuilds,
            "deadline_s": self.deadline,
        }
