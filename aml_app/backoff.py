"""One backoff for every retry of the system: exponential delays with a cap, jittered where many callers
may fail together (a lane's handler, a store's reconnect), and `retry_forever` on top of it, so that a
lane never skips a payment it failed on unless a retry ceiling (AML_MAX_ATTEMPTS) says to park it.

Free of Faust and of the gate: the dependencies' APIs and stores back off with it too.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def jittered(delay: float) -> float:
    """A backoff delay with jitter in [delay/2, delay): failing lanes do not retry in lockstep."""
    return delay * (0.5 + 0.5 * random.random())


def exact(delay: float) -> float:
    return delay


class Backoff:
    """Delays from `first`, doubled after each one up to `most` (the first is `first` all the same);
    each passed through `jitter`."""

    def __init__(self, first: float, most: float, jitter: Callable[[float], float] = exact) -> None:
        if first <= 0 or most <= 0:
            raise ValueError(f"a backoff needs positive delays, not {first} and {most}")
        self.first, self.most, self.jitter = first, most, jitter
        self._delay = first

    def next(self) -> float:
        """The next delay (jittered); the one after it is twice as long, up to `most`."""
        delay, self._delay = self._delay, min(self._delay * 2, self.most)
        return self.jitter(delay)

    async def sleep(self, at_most: float | None = None) -> float:
        """Sleep the next delay (no longer than `at_most`); return how long."""
        delay = self.next() if at_most is None else min(self.next(), at_most)
        await asyncio.sleep(delay)
        return delay


class WorkCancelled(Exception):
    """What a task awaited was cancelled while the task itself was not (a producer that stops cancels
    the sends it holds): a failure of that work, to retry like any other."""


async def awaited(work: Awaitable[T], what: str) -> T:
    """`await work`, with its own cancellation raised as `WorkCancelled`. A `CancelledError` that
    escaped instead would end the awaiting task as if it had been cancelled, and a lane's task that
    ends cancelled is taken for a stopped lane; a cancel of this task still raises `CancelledError`."""
    try:
        return await work
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        raise WorkCancelled(f"{what} was cancelled") from exc


#: Called after each failed attempt with (attempt, exception, seconds until the next one).
OnFailure = Callable[[int, BaseException, float], None]


async def retry_forever(
    what: str,
    action: Callable[[], Awaitable[T]],
    first_delay: float = 0.1,
    max_delay: float = 5.0,
    *,
    on_failure: OnFailure | None = None,
    jitter: Callable[[float], float] = jittered,
    attempts: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> T:
    """Run `action` until it succeeds, backing off exponentially with jitter; log each failure.

    With `attempts`, the exception of the last allowed attempt is raised instead (a retry ceiling); so
    is the last failure once `stop()` says to give up (asked before each new attempt)."""
    backoff = None  # made at the first failure: the common case succeeds at once, on the hot path
    attempt = 1
    while True:
        try:
            return await action()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if (attempts is not None and attempt >= attempts) or (stop is not None and stop()):
                log.warning("%s failed (attempt %d, giving up): %r", what, attempt, exc)
                raise
            backoff = backoff or Backoff(first_delay, max_delay, jitter)
            wait = backoff.next()
            log.warning("%s failed (attempt %d, retrying in %.2fs): %r", what, attempt, wait, exc)
            if on_failure is not None:
                on_failure(attempt, exc, wait)
            await asyncio.sleep(wait)
            attempt += 1
