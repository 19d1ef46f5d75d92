"""Deadlines that hold against code that swallows its cancellation (`aml_app.kafka.deadlines`), and the
clients of the leader's refresh that close within theirs."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from aml_app.gate.unapplied import UnappliedReader
from aml_app.kafka.deadlines import (
    CancelledWithin,
    DeadlineExceeded,
    abandoned,
    close_within,
    start_within,
    within,
)
from aml_app.kafka.offsets import DependencyOffsets
from aml_app.kafka.security import PLAINTEXT


async def stubborn(ended: list[str]) -> None:
    """Waits forever and swallows every cancel, as aiokafka's fetch routine can (its `stop()` then
    waits for it forever); ends only when `ended` is told to."""
    try:
        while not ended:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.01)
    finally:
        ended.append("ended")


async def test_within_returns_at_its_deadline_from_code_that_swallows_its_cancellation() -> None:
    ended: list[str] = []
    with pytest.raises(DeadlineExceeded, match=r"the stubborn call took longer than 0\.05 s"):
        await within(stubborn(ended), 0.05, "the stubborn call")
    assert abandoned() == 1  # left behind, still referenced
    ended.append("stop")
    await asyncio.sleep(0.05)
    assert abandoned() == 0


async def test_asyncio_wait_for_does_not_return_from_such_code() -> None:
    """The negative control: wait_for waits for the cancellation to finish, which never happens."""
    ended: list[str] = []
    waiting = asyncio.ensure_future(asyncio.wait_for(stubborn(ended), 0.05))
    done, _ = await asyncio.wait({waiting}, timeout=1.0)  # twenty times its deadline
    assert not done
    ended.append("stop")
    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
        await waiting


async def test_within_gives_results_and_errors_and_a_cancel_of_the_caller_reaches_the_call() -> None:
    assert await within(asyncio.sleep(0, "answer"), 1, "a call") == "answer"
    with pytest.raises(KeyError):
        await within(_raise(KeyError("x")), 1, "a failing call")
    started = asyncio.Event()
    cancelled: list[bool] = []

    async def long_call() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    caller = asyncio.ensure_future(within(long_call(), 60, "a long call"))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0)
    assert cancelled == [True]


async def test_a_call_cancelled_by_the_code_it_called_is_an_error_not_a_cancel_of_the_caller() -> None:
    """A future the call awaits, cancelled by code the caller does not own (a client closed under it):
    `within` raises `CancelledWithin`, an Exception a timer handles, where the `CancelledError` itself
    would end the caller's task."""

    async def cancelled_under() -> None:
        pending = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(pending.cancel)
        await pending

    with pytest.raises(CancelledWithin, match="reading the offsets was cancelled by the code it called"):
        await within(cancelled_under(), 1, "reading the offsets")
    shielded = asyncio.get_running_loop().create_future()
    shielded.cancel()  # an acknowledgement cancelled under a send, awaited through a shield
    with pytest.raises(CancelledWithin):
        await within(asyncio.shield(shielded), 1, "the alert")


async def _raise(exc: BaseException) -> None:
    raise exc


async def test_close_within_never_raises() -> None:
    ended: list[str] = []
    await close_within(stubborn(ended), 0.05, "closing a stuck client")
    await close_within(_raise(OSError("broken pipe")), 1, "closing a broken client")
    ended.append("stop")


class StuckClient:
    """A started aiokafka client whose stop/close never returns (its fetcher swallowed the cancel)."""

    def __init__(self) -> None:
        self.ended: list[str] = []

    async def stop(self) -> None:
        await stubborn(self.ended)

    close = stop


async def test_a_client_that_does_not_start_in_time_is_stopped_before_the_error_goes_on() -> None:
    stopped: list[str] = []

    async def hangs() -> None:
        await asyncio.Event().wait()

    async def fails() -> None:
        raise ConnectionError("refused")

    async def stop() -> None:
        stopped.append("stop")

    with pytest.raises(DeadlineExceeded, match=r"starting the reader took longer than 0\.05 s"):
        await start_within(hangs, stop, 0.05, "the reader")
    with pytest.raises(ConnectionError, match="refused"):
        await start_within(fails, stop, 0.05, "the reader")
    assert stopped == ["stop", "stop"]

    async def starts() -> None:
        return None

    await start_within(starts, stop, 0.05, "the reader")
    assert stopped == ["stop", "stop"], "a client that started is not stopped"


async def test_the_refresh_readers_close_within_their_timeout_when_their_client_does_not() -> None:
    offsets = DependencyOffsets(["127.0.0.1:9"], "payments", ["g"], request_timeout=0.1, security=PLAINTEXT)
    unapplied = UnappliedReader(["127.0.0.1:9"], "payments", request_timeout=0.1, security=PLAINTEXT)
    stuck = [StuckClient(), StuckClient(), StuckClient()]
    offsets._client, offsets._consumer = stuck[0], stuck[1]  # type: ignore[assignment]
    unapplied._consumer = stuck[2]  # type: ignore[assignment]
    closing = asyncio.ensure_future(asyncio.gather(offsets.close(), unapplied.close()))
    done, _ = await asyncio.wait({closing}, timeout=5)
    assert done, "closing the readers hung on a client that never stops"
    assert offsets._client is None and offsets._consumer is None and unapplied._consumer is None
    for client in stuck:
        client.ended.append("stop")
