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


class FakeAlerts:
    """The alerts topic at the narrowest seam: what the broker wrote, and the acknowledgements the
    producer hands back (which a broker that times out can fail after the write)."""

    def __init__(self, acks: list[str], delay: float = 0.0) -> None:
        self.written: list[tuple[bytes, bytes]] = []
        # Per send: "ok", "fail" (written, then the acknowledgement fails), "hold" (written, acknowledged
        # when the test says), "later" (written and acknowledged when the test says: `write_later`).
        self.acks = acks
        self.held: list[asyncio.Future[Any]] = []
        self.later: list[tuple[bytes, bytes, asyncio.Future[Any]]] = []
        self.delay = delay  # how long handing a record to the producer takes (its metadata, its buffer)

    async def send(self, key: str, value: Any, partition: int) -> asyncio.Future[Any]:
        import json

        await asyncio.sleep(self.delay)
        record = (key.encode(), json.dumps(value.asdict()).encode())
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        how = self.acks.pop(0)
        if how == "later":
            self.later.append((*record, future))
            return future
        self.written.append(record)
        if how == "ok":
            future.set_result(type("Meta", (), {"offset": len(self.written) - 1})())
        elif how == "fail":
            future.set_exception(TimeoutError("the produce request timed out"))
        else:
            self.held.append(future)
        return future

    def write_later(self, error: Exception) -> None:
        """The broker writes the first record sent "later" now, and its acknowledgement fails."""
        key, value, future = self.later.pop(0)
        self.written.append((key, value))
        future.set_exception(error)

    async def read_back(self, partition: int, start: int, timeout: float) -> list[tuple[bytes, bytes]]:
        return self.written[start:]


class FakeTable:
    def __init__(self) -> None:
        self.data: dict[bytes, Any] = {}

    def get(self, key: bytes) -> Any:
        return self.data.get(key)


def flagged(payment_id: str = "p1") -> list[Any]:
    from aml_app.detection.rules import Hit
    from aml_app.gate import Admission
    from aml_app.models import Payment

    payment = Payment(payment_id, "a", "b", "10.00", "EUR", "2026-11-20T10:00:00Z")
    admission = Admission(partition=2, offset=7, watermark=8, dependencies={}, waited_ms=1.0, gated=True)
    return [(payment, admission, [Hit(rule="r", typology="t", reason="why", figures={})])]


@pytest.fixture
def alerts(monkeypatch: pytest.MonkeyPatch) -> Any:
    from aml_app.worker import detector as module

    def make(acks: list[str], reads_back: bool = True, delay: float = 0.0) -> tuple[Any, FakeAlerts]:
        topic = FakeAlerts(acks, delay)
        monkeypatch.setattr(module, "alerts_topic", topic)
        monkeypatch.setattr(module, "alerts_sent", FakeTable())
        d = detector()
        d.read_back = topic.read_back if reads_back else _nothing
        return d, topic

    return make


async def _nothing(partition: int, start: int, timeout: float) -> list[Any]:
    return []


async def test_an_alert_the_broker_wrote_though_its_send_failed_is_not_sent_again(alerts: Any) -> None:
    """A produce that times out after the write: the batch is handled again, and the alerts partition,
    read back first, shows the alert; nothing is sent twice (this test sent it twice before the read)."""
    d, topic = alerts(["fail", "ok"])
    sent = await d.send_alerts(flagged(), "2026-11-20T10:00:01Z")
    with pytest.raises(TimeoutError):
        await d.remember_alerts(sent)
    assert set(d.in_doubt) == {2}
    assert await d.send_alerts(flagged(), "2026-11-20T10:00:02Z") == []
    assert len(topic.written) == 1 and d.stats.duplicates_suppressed == 1
    assert d.in_doubt == {}


async def test_without_reading_back_the_same_alert_goes_out_twice(alerts: Any) -> None:
    """The negative control: the failed acknowledgement alone says nothing of what the broker holds."""
    d, topic = alerts(["fail", "ok"], reads_back=False)
    sent = await d.send_alerts(flagged(), "2026-11-20T10:00:01Z")
    with pytest.raises(TimeoutError):
        await d.remember_alerts(sent)
    assert len(await d.send_alerts(flagged(), "2026-11-20T10:00:02Z")) == 1
    assert len(topic.written) == 2


async def test_a_payment_handled_again_while_its_alert_is_in_flight_waits_for_it(alerts: Any) -> None:
    """Its batch retried, or its partition back after a rebalance, before the first acknowledgement
    came: the second handling waits for it and sends nothing."""
    d, topic = alerts(["hold", "ok"])
    await d.send_alerts(flagged(), "2026-11-20T10:00:01Z")
    again = asyncio.ensure_future(d.send_alerts(flagged(), "2026-11-20T10:00:02Z"))
    await asyncio.sleep(0.01)
    assert not again.done() and len(topic.written) == 1
    topic.held[0].set_result(type("Meta", (), {"offset": 0})())
    assert await again == []
    assert len(topic.written) == 1 and d.unsettled == {}


async def test_two_handlings_of_one_payment_at_the_same_time_send_one_alert(alerts: Any) -> None:
    """The same batch handled twice at once in one worker (seen after a broker freeze): the second
    handling finds the first one's alert claimed while it is still being handed to the producer, waits
    for it and sends nothing (both sent it when the alert was registered only after the send)."""
    d, topic = alerts(["ok", "ok"], delay=0.05)
    first = asyncio.ensure_future(d.send_alerts(flagged(), "2026-11-20T10:00:01Z"))
    await asyncio.sleep(0.01)  # the first handling is inside its send
    second = asyncio.ensure_future(d.send_alerts(flagged(), "2026-11-20T10:00:02Z"))
    sent_first, sent_second = await asyncio.gather(first, second)
    await d.remember_alerts(sent_first)
    assert (len(sent_first), len(sent_second)) == (1, 0)
    assert len(topic.written) == 1 and d.stats.duplicates_suppressed == 1


def sent_per_payment(topic: FakeAlerts) -> dict[str, int]:
    import json

    ids = [json.loads(value)["payment_id"] for _, value in topic.written]
    return {payment_id: ids.count(payment_id) for payment_id in ids}


async def test_an_alert_acknowledged_after_one_whose_send_failed_does_not_hide_it(alerts: Any) -> None:
    """p1's produce times out after the broker wrote it at offset 1; p2, behind it, is acknowledged at
    offset 2. The read-back starts where p1 can be (after p0, acknowledged before p1 was sent): it
    started after p2 and missed p1, which went out twice."""
    d, topic = alerts(["ok", "fail", "ok", "ok"])
    await d.remember_alerts(await d.send_alerts(flagged("p0"), "2026-11-20T10:00:00Z"))
    sent = await d.send_alerts(flagged("p1") + flagged("p2"), "2026-11-20T10:00:01Z")
    with pytest.raises(TimeoutError):
        await d.remember_alerts(sent)
    assert await d.send_alerts(flagged("p1") + flagged("p2"), "2026-11-20T10:00:02Z") == []
    assert sent_per_payment(topic) == {"p0": 1, "p1": 1, "p2": 1}


async def test_a_send_that_fails_while_its_partition_is_read_back_keeps_it_in_doubt(alerts: Any) -> None:
    """p1's send failed; while its batch, handled again, reads the partition back, p3 (a pipelined batch
    behind it) is written after the end the read goes to, and its acknowledgement fails. The partition
    stays in doubt, so p3's batch reads it again: the doubt was cleared and p3 went out twice."""
    d, topic = alerts(["fail", "later", "ok", "ok"])
    first = await d.send_alerts(flagged("p1"), "2026-11-20T10:00:01Z")
    behind = await d.send_alerts(flagged("p3"), "2026-11-20T10:00:01Z")
    with pytest.raises(TimeoutError):
        await d.remember_alerts(first)
    reading, read_on = asyncio.Event(), asyncio.Event()

    async def read_back(partition: int, start: int, timeout: float) -> list[tuple[bytes, bytes]]:
        end = len(topic.written)  # the end a fetch reports when the read starts
        reading.set()
        await read_on.wait()
        return topic.written[start:end]

    d.read_back = read_back
    again = asyncio.ensure_future(d.send_alerts(flagged("p1"), "2026-11-20T10:00:02Z"))
    await asyncio.wait_for(reading.wait(), 5)
    topic.write_later(TimeoutError("the produce request timed out"))
    with pytest.raises(TimeoutError):
        await d.remember_alerts(behind)
    read_on.set()
    assert await asyncio.wait_for(again, 5) == []
    assert set(d.in_doubt) == {2}
    d.read_back = topic.read_back
    assert await d.send_alerts(flagged("p3"), "2026-11-20T10:00:03Z") == []
    assert sent_per_payment(topic) == {"p1": 1, "p3": 1}


async def test_an_id_an_alert_of_another_payment_holds_is_said_and_counted(
    alerts: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Payment ids name one payment (docs/contract.md); a producer that reuses one has the second
    payment's alert suppressed as a duplicate. That shows: a warning naming both, and `ids_reused`."""
    import dataclasses
    import logging

    d, topic = alerts(["ok", "ok"])
    await d.remember_alerts(await d.send_alerts(flagged("p1"), "2026-11-20T10:00:00Z"))
    [(payment, admission, hits)] = flagged("p1")
    again = [(payment, dataclasses.replace(admission, offset=9), hits)]
    assert await d.send_alerts(again, "2026-11-20T10:00:01Z") == []  # the same payment, sent twice
    assert d.stats.ids_reused == 0
    from aml_app.models import Payment

    reused = Payment("p1", "a", "b", "50000.00", "EUR", "2026-11-20T10:00:00Z")
    other = [(reused, dataclasses.replace(admission, offset=11), hits)]
    with caplog.at_level(logging.WARNING, logger="aml_app.worker.detector"):
        assert await d.send_alerts(other, "2026-11-20T10:00:02Z") == []
    assert d.stats.ids_reused == 1 and d.stats.duplicates_suppressed == 2
    assert [r.getMessage() for r in caplog.records] == [
        "payment id 'p1' of 2:11 was alerted on before for another payment (2:7: a -> b, 10.00 EUR at "
        "2026-11-20T10:00:00Z): payment ids must be unique; this one is not alerted on"
    ]
    assert len(topic.written) == 1


async def test_an_alert_waited_for_is_not_sent_once_the_partition_is_another_workers(
    alerts: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker stopped past its session timeout while a payment's alert waited for an earlier one's
    outcome (a read-back): the revoke that comes once it continues must stop the sends (the partition's
    next owner alerts on the payment itself), as it does after the evidence."""
    import dataclasses

    from aml_app.gate import gate as gate_module
    from aml_app.gate.stall import StallWatch
    from aml_app.worker.detector import Doubt

    d, topic = alerts(["ok"])
    watch = StallWatch()
    watch.start(session_timeout=1.0)
    watch.tick()
    monkeypatch.setattr(gate_module, "stalls", watch)
    revoked = [False]

    async def stalled_read_back(partition: int, start: int, timeout: float) -> list[tuple[bytes, bytes]]:
        assert watch.last is not None
        watch.last -= 30.0  # stopped half a minute here; the revoke comes after the next heartbeat
        asyncio.get_running_loop().call_later(0.05, lambda: revoked.__setitem__(0, True))
        return []

    d.read_back = stalled_read_back
    d.in_doubt[2] = Doubt(0)
    [(payment, admission, hits)] = flagged("p1")
    mine = [(payment, dataclasses.replace(admission, stopped=lambda: revoked[0]), hits)]
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(d.send_alerts(mine, "2026-11-20T10:00:00Z"), 5)
    assert topic.written == []
