"""Deadlines that hold even when the awaited code swallows its cancellation.

`asyncio.wait_for` cancels what it awaits at its deadline and then waits for the cancellation to finish:
against code that catches `CancelledError` and carries on, it never returns. aiokafka's fetch routine
does that (it awaits its fetch tasks inside `suppress(CancelledError)`, which also swallows a cancel of
the routine itself), so `AIOKafkaConsumer.stop()` can wait forever on a fetcher that will never end:
seen after a broker was frozen for a few seconds, where the leader's refresh stopped for good on closing
the consumer that reads the first unapplied payments. `within` asks for the cancellation and returns at
its deadline whatever the awaited code does; what it leaves behind runs on detached and is only logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Work given up at a deadline, kept referenced until it ends (asyncio keeps only weak references).
_abandoned: set[asyncio.Future[Any]] = set()


class DeadlineExceeded(TimeoutError):
    """An awaited call did not finish in time; it was cancelled and left behind."""


class CancelledWithin(RuntimeError):
    """An awaited call ended cancelled while its caller was not: a client closed under it, or a future it
    awaited was cancelled by code it does not own (aiokafka, a broker frozen mid-request). An error of the
    call, not a cancel of the caller: as a `CancelledError` it would end the caller's task for good, and a
    timer with it."""


def abandoned() -> int:
    """How many calls given up at a deadline have not ended yet (for the views and the tests)."""
    return len(_abandoned)


def _forget(future: asyncio.Future[Any]) -> None:
    _abandoned.discard(future)
    if not future.cancelled() and future.exception() is not None:
        log.debug("work given up at a deadline ended with %r", future.exception())


def _abandon(future: asyncio.Future[Any]) -> None:
    future.cancel()
    if not future.done():
        _abandoned.add(future)
        future.add_done_callback(_forget)


async def within(awaitable: Awaitable[T], seconds: float, what: str) -> T:
    """Await `awaitable` for at most `seconds`; then cancel it, leave it behind and raise
    `DeadlineExceeded` naming `what`. A cancel of the caller cancels it too, without waiting for it; a
    call that ends cancelled on its own raises `CancelledWithin`."""
    future = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({future}, timeout=seconds)
    except asyncio.CancelledError:
        _abandon(future)
        raise
    if not done:
        _abandon(future)
        raise DeadlineExceeded(f"{what} took longer than {seconds:g} s")
    if future.cancelled():
        raise CancelledWithin(f"{what} was cancelled by the code it called")
    return future.result()


async def close_within(closing: Awaitable[Any], seconds: float, what: str) -> None:
    """Close a client for at most `seconds`, never raising: a client that does not close in time (or
    fails to) is left behind, since the caller has given up on it anyway."""
    try:
        await within(closing, seconds, what)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a broken client must not hide what the caller is doing
        log.debug("%s failed: %r", what, exc)


async def start_within(
    starting: Callable[[], Awaitable[Any]], stopping: Callable[[], Awaitable[Any]], seconds: float, what: str
) -> None:
    """Start a client (`starting()`) for at most `seconds`; one that fails to start, or not in time, is
    stopped (`stopping()`, `close_within`) before the error goes on, so no half-started client is left."""
    try:
        await within(starting(), seconds, f"starting {what}")
    except BaseException:
        await close_within(stopping(), seconds, f"stopping {what}")
        raise
