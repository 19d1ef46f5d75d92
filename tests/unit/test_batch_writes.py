"""How a query hands a micro-batch to the services' store writes (`QueryBatches.hand_to_services`): the
services write side by side, the call returns only once every service is done, and a failed write is raised
(which fails the query) only after the other service finished. Fake services stand in for the store
writes; Spark is not involved."""

from __future__ import annotations

import threading
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
    assert batches.hand_to_services(outputs(), 0, 0.0) == ["relations-0", "aggregates-0"]


def test_the_call_returns_only_once_every_service_wrote_the_batch() -> None:
    batches, services, log = query("relations", "aggregates")
    gate = threading.Event()
    services[1].gate = gate  # aggregates is slow
    threading.Timer(0.2, gate.set).start()
    batches.hand_to_services(outputs(), 0, 0.0)
    assert ("relations", 0, "end") in log and ("aggregates", 0, "end") in log


def test_a_failed_write_is_raised_once_the_other_service_is_done() -> None:
    batches, services, log = query("relations", "aggregates")
    services[0].error = RuntimeError("the store refused the batch")
    gate = threading.Event()
    services[1].gate = gate
    threading.Timer(0.2, gate.set).start()
    with pytest.raises(RuntimeError, match="refused"):
        batches.hand_to_services(outputs(), 0, 0.0)
    assert ("aggregates", 0, "end") in log  # not abandoned halfway
