"""The watchdog of the leader's refresh (`aml_app.gate.watchdog`), at each boundary of its verdicts."""

from __future__ import annotations

from aml_app.gate.watchdog import Outcome, RefreshWatchdog, Verdict
from aml_app.gate.watermark import RefreshPolicy

DEADLINE, STUCK, LEAVE = 10.0, 20.0, 30.0


def watched(at: float = 0.0) -> RefreshWatchdog:
    dog = RefreshWatchdog(DEADLINE, STUCK, LEAVE)
    dog.arm(at)
    return dog


def test_a_leader_whose_refreshes_succeed_is_never_stuck() -> None:
    dog = watched()
    for t in range(0, 200):
        dog.ended(float(t), Outcome.SUCCEEDED)
        assert dog.check(t + 0.5) is Verdict.OK
    assert dog.as_json(200)["state"] == "ok"


def test_no_success_for_stuck_after_rebuilds_once_then_stays_stuck_on_fast_failures() -> None:
    dog = watched()
    dog.ended(1, Outcome.SUCCEEDED)
    for t in range(2, 21):
        dog.ended(t, Outcome.FAILED)
        assert dog.check(t) is Verdict.OK, t  # 19 s without success: not yet
    dog.ended(21, Outcome.FAILED)
    assert dog.check(21) is Verdict.REBUILD
    assert dog.rebuilds == 1 and dog.as_json(21)["state"] == "stuck"
    for t in range(22, 300):
        dog.ended(t, Outcome.FAILED)
        # Failing fast (refused, an error answer): shown, clients rebuilt once, but never leaving.
        assert dog.check(t) is Verdict.STUCK
    assert dog.rebuilds == 1
    assert dog.as_json(299)["stuck_for_s"] == 278


def test_stuck_on_overruns_for_leave_after_more_leaves_the_group() -> None:
    dog = watched()
    dog.ended(0, Outcome.SUCCEEDED)
    dog.ended(10, Outcome.OVERRAN)
    assert dog.check(20) is Verdict.REBUILD
    dog.ended(30, Outcome.OVERRAN)
    assert dog.check(49.9) is Verdict.STUCK
    assert dog.check(50) is Verdict.LEAVE
    assert dog.overruns == 2


def test_a_refresh_timer_that_ended_no_attempt_for_two_deadlines_leaves_too() -> None:
    dog = watched()
    dog.ended(0, Outcome.FAILED)
    assert dog.check(20) is Verdict.REBUILD
    assert dog.check(49) is Verdict.STUCK
    assert dog.check(50) is Verdict.LEAVE  # nothing ended since 0: hung, whatever the last outcome


def test_a_success_clears_it_and_only_leading_counts() -> None:
    dog = watched()
    assert dog.check(25) is Verdict.REBUILD  # never refreshed since it started to lead
    dog.ended(26, Outcome.SUCCEEDED)
    assert dog.check(27) is Verdict.OK and dog.as_json(27)["stuck_for_s"] is None
    dog.disarm()
    assert dog.check(500) is Verdict.OK  # not the leader: nothing to watch
    dog.arm(500)
    assert dog.check(519) is Verdict.OK  # leading again from 500: its old success does not count...
    assert dog.check(520) is Verdict.REBUILD  # ... nor against it


def test_the_policy_bounds_every_refresh_and_derives_the_watchdog_from_it() -> None:
    policy = RefreshPolicy(interval=1.0, fast=0.1, stall_after=30)
    assert policy.refresh_deadline == 10.0
    assert policy.stuck_after == 20.0 and policy.leave_after == 30.0
    slow = RefreshPolicy(interval=5.0, fast=0.5, stall_after=30)
    assert slow.refresh_deadline == 25.0 and slow.stuck_after == 100.0
    tight = RefreshPolicy(interval=1.0, fast=0.1, stall_after=30, deadline=3.0)  # AML_REFRESH_DEADLINE
    assert tight.refresh_deadline == 3.0 and tight.stuck_after == 20.0 and tight.leave_after == 9.0
