"""Retrying forever, with exponential backoff and jitter: a lane never skips a payment it failed on."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)


def jittered(delay: float) -> float:
    """A backoff delay with jitter in [delay/2, delay): failing lanes do not retry in lockstep."""
    return delay * (0.5 + 0.5 * random.random())


#: Called after each failed attempt with (attempt, exception, seconds until the next one).
OnFailure = Callable[[int, BaseException, float], None]


async def retry_forever(
    what: str,
    action: Callable[[], Awaitable[Any]],
    first_delay: float = 0.1,
    max_delay: float = 5.0,
    *,
    on_failure: OnFailure | None = None,
    jitter: Callable[[float], float] = jittered,
) -> Any:
    """Run `action` until it succeeds, backing off exponentially with jitter; log each failure."""
    delay = first_delay
    attempt = 1
    while True:
        try:
            return await action()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            wait = jitter(delay)
            log.warning("%s failed (attempt %d, retrying in %.2fs): %r", what, attempt, wait, exc)
            if on_failure is not None:
                on_failure(attempt, exc, wait)
            await asyncio.sleep(wait)
            delay = min(delay * 2, max_delay)
            attempt += 1
