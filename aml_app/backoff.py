"""Retrying with exponential backoff and jitter: forever by default, so a lane never skips a payment it
failed on unless a retry ceiling (AML_MAX_ATTEMPTS) says to park it."""

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
    delay = first_delay
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
            wait = jitter(delay)
            log.warning("%s failed (attempt %d, retrying in %.2fs): %r", what, attempt, wait, exc)
            if on_failure is not None:
                on_failure(attempt, exc, wait)
            await asyncio.sleep(wait)
            delay = min(delay * 2, max_delay)
            attempt += 1
