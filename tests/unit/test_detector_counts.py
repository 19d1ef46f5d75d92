"""The detector counts a decision only once the broker has acknowledged it (the `decisions` figure of
`/watermarks.json`, `/metrics` and the benchmarks), not when it is handed to the producer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest


def detector() -> Any:
    from aml_app.worker.detector import Detector

    return Detector("aml", rules=None, client=None)  # type: ignore[arg-type]  # neither is used here


async def test_a_batch_counts_once_every_decision_is_acknowledged() -> None:
    d = detector()
    loop = asyncio.get_running_loop()
    acks = [loop.create_future(), loop.create_future()]
    pending = asyncio.ensure_future(d.acknowledged([], acks))
    acks[0].set_result("meta-0")
    await asyncio.sleep(0)
    assert d.stats.decisions == 0, "counted before the broker acknowledged every decision"
    acks[1].set_result("meta-1")
    assert await pending == ["meta-0", "meta-1"]
    assert d.stats.decisions == 2


async def test_a_failed_send_counts_nothing() -> None:
    d = detector()
    loop = asyncio.get_running_loop()
    failed = loop.create_future()
    failed.set_exception(RuntimeError("broker gone"))
    with pytest.raises(RuntimeError):
        await d.acknowledged([], [failed])
    assert d.stats.decisions == 0


async def test_every_acknowledged_alert_is_remembered_even_when_another_fails() -> None:
    """A failed alert fails the batch (handled again), but the alerts the broker has are remembered
    first, so the retry does not send them twice; no decision counts before the alerts are in."""
    from aml_app.worker.detector import SentAlert

    d = detector()
    remembered: list[str] = []
    d.remember = lambda alert: remembered.append(alert.payment_id)
    loop = asyncio.get_running_loop()
    acks = [loop.create_future() for _ in range(3)]
    alerts = [SentAlert(f"p{i}", None, ack) for i, ack in enumerate(acks)]  # type: ignore[arg-type]
    decision = loop.create_future()
    decision.set_result("meta")
    pending = asyncio.ensure_future(d.acknowledged(alerts, [decision]))
    acks[0].set_result("a0")
    await asyncio.sleep(0)
    assert remembered == [] and d.stats.decisions == 0, "nothing before every alert is acknowledged"
    acks[1].set_exception(RuntimeError("broker gone"))
    acks[2].set_result("a2")
    with pytest.raises(RuntimeError, match="broker gone"):
        await pending
    assert remembered == ["p0", "p2"]
    assert d.stats.alerts == 2 and d.stats.decisions == 0
