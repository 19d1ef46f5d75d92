"""The detector counts a decision only once the broker has acknowledged it (the `decisions` figure of
`/watermarks.json`, `/metrics` and the benchmarks), not when it is handed to the producer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest


def detector() -> Any:
    from aml_app.detection.detector import Detector

    return Detector("aml", rules=None, client=None)  # type: ignore[arg-type]  # neither is used here


async def test_a_batch_counts_once_every_decision_is_acknowledged() -> None:
    d = detector()
    loop = asyncio.get_running_loop()
    acks = [loop.create_future(), loop.create_future()]
    pending = asyncio.ensure_future(d.acknowledged(acks))
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
        await d.acknowledged([failed])
    assert d.stats.decisions == 0
