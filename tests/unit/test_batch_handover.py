"""How a query hands its micro-batches to the services' store writes (`QueryBatches.hand_over`): the
services write side by side, batch N+1 is handed over only once every service has written batch N,
a failed write fails the next micro-batch (or shows in `failure` while the topic is idle), and a stop
lets the last writes finish. Fake services stand in for the store writes; Spark is not involved."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from aml_app.pipeline.jobs import QueryBatches

DEADLINE = 10.0


class FakeService:
    """A service whose `process` records what it wrote, optionally waiting for a gate or failing."""

    def __init__(self, name: str, log: list[tuple[str, int, str]], lock: threading.Lock) -> None:
        self.service = name
        self.max_payment_bytes, self.threshold, self.band = 1000, 0, 0
        self.applied: dict[int, int] = {}
        self.log, self.lock = log, lock
        self.gate: threading.Event | None = None
        self.barrier: threading.Barrier | None = None
        self.error: Exception | None = None

    def process(self, outputs: Any, batch_id: int, spark_seconds: float = 0.0) -> str:
        with self.lock:
            self.log.append((self.service, batch_id, "start"))
        if self.barrier is not None:
            self.barrier.wait(DEADLINE)  # breaks (and fails the write) unless the other service is here too
        if self.gate is not None:
            assert self.gate.wait(DEADLINE)
        if self.error is not None:
            raise self.error
        with self.lock:
            self.log.append((self.service, batch_id, "end"))
        return f"{self.service}-{batch_id}"


def query(*names: str) -> tuple[QueryBatches, list[FakeService], list[tuple[str, int, str]]]:
    log: list[tuple[str, int, str]] = []
    lock = threading.Lock()
    services = [FakeService(name, log, lock) for name in names]
    return QueryBatches(services), services, log  # type: ignore[arg-type]


def outputs(names: tuple[str, ...] = ("relations", "aggregates")) -> dict[str, Any]:
    return {name: object() for name in names}


def test_the_services_write_one_batch_side_by_side() -> None:
    batches, services, _log = query("relations", "aggregates")
    barrier = threading.Barrier(2)
    for service in services:
        service.barrier = barrier
    batches.hand_over(outputs(), 0, 0.0)
    assert batches.wait(DEADLINE) == ["relations-0", "aggregates-0"]


def test_the_next_batch_is_handed_over_only_after_every_service_wrote_the_last() -> None:
    batches, services, log = query("relations", "aggregates")
    gate = threading.Event()
    services[1].gate = gate  # aggregates holds batch 0
    batches.hand_over(outputs(), 0, 0.0)
    second = threading.Thread(target=batches.hand_over, args=(outputs(), 1, 0.0))
    second.start()
    deadline = time.monotonic() + DEADLINE
    while ("relations", 0, "end") not in log and time.monotonic() < deadline:
        time.sleep(0.01)
    assert second.is_alive()  # waiting for aggregates' batch 0
    assert not any(batch == 1 for _, batch, _ in log)
    services[1].gate = None
    gate.set()
    second.join(DEADLINE)
    assert batches.wait(DEADLINE) == ["relations-1", "aggregates-1"]
    for name in ("relations", "aggregates"):
        assert log.index((name, 0, "end")) < log.index(("relations", 1, "start"))
        assert log.index((name, 0, "end")) < log.index(("aggregates", 1, "start"))


def test_a_failed_write_fails_the_next_batch_and_shows_while_idle() -> None:
    batches, services, log = query("relations", "aggregates")
    services[0].error = RuntimeError("the store refused the batch")
    batches.hand_over(outputs(), 0, 0.0)
    deadline = time.monotonic() + DEADLINE
    while batches.failure() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "refused" in str(batches.failure())
    with pytest.raises(RuntimeError, match="refused"):
        batches.hand_over(outputs(), 1, 0.0)
    assert not any(batch == 1 for _, batch, _ in log)  # batch 1 never reached a store


def test_a_stop_lets_the_last_writes_finish_and_does_not_hang_on_one_that_cannot() -> None:
    batches, services, log = query("relations")
    gate = threading.Event()
    services[0].gate = gate
    batches.hand_over(outputs(("relations",)), 0, 0.0)
    threading.Timer(0.2, gate.set).start()
    batches.drain(DEADLINE)
    assert ("relations", 0, "end") in log

    stuck = threading.Event()  # never set: a write waiting for a database that is away
    services[0].gate = stuck
    batches.hand_over(outputs(("relations",)), 1, 0.0)
    started = time.monotonic()
    batches.drain(0.2)
    assert time.monotonic() - started < DEADLINE
    assert ("relations", 1, "end") not in log
    stuck.set()
