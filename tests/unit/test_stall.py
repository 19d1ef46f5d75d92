"""The stall watch: when the worker's event loop did not run, and how long sends wait after that."""

from __future__ import annotations

import asyncio

import pytest

from aml_app.gate.stall import StallWatch


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watch(session_timeout: float = 10.0) -> tuple[StallWatch, Clock]:
    clock = Clock()
    w = StallWatch(clock)
    w.start(session_timeout)
    clock.now += 7.0  # the worker's start-up, before its timers run: no stall
    w.tick()
    assert w.hold() == 0 and w.stalls == 0
    return w, clock


def test_a_watch_not_started_never_holds() -> None:
    clock = Clock()
    w = StallWatch(clock)
    clock.now += 3600
    assert w.hold() == 0 and w.stalls == 0


def test_ticks_on_time_hold_nothing() -> None:
    w, clock = watch()
    for _ in range(100):
        clock.now += 0.1
        w.tick()
        assert w.hold() == 0
    clock.now += 4.9  # a slow loop, under half the session timeout
    w.tick()
    assert w.hold() == 0 and w.stalls == 0


@pytest.mark.parametrize("first", ["the ticker", "a lane"])
def test_sends_wait_a_fifth_of_the_session_timeout_after_a_stall(first: str) -> None:
    """After a stop the loop may run a lane's continuation before the ticker: either way the stall is
    seen, once, and sends wait from the moment it was seen."""
    w, clock = watch(session_timeout=10.0)
    clock.now += 9.1  # stopped past half the session timeout
    if first == "the ticker":
        w.tick()
    assert w.hold() == pytest.approx(2.0)
    w.tick()
    clock.now += 1.5
    assert w.hold() == pytest.approx(0.5)
    clock.now += 0.5
    assert w.hold() == 0
    assert w.stalls == 1


async def test_settled_returns_once_the_hold_is_over() -> None:
    w = StallWatch()
    w.start(session_timeout=0.5)  # holds 0.1 s after a stall of 0.25 s
    w.tick()
    assert w.last is not None
    w.last -= 1.0  # the loop did not run for a second
    assert w.hold() > 0
    await asyncio.wait_for(w.settled(), 2.0)
    assert w.hold() == 0 and w.stalls == 1
