"""How a query hands a micro-batch to the services' store writes (`QueryBatches.hand_to_services`): the
services write side by side; for a small batch the call returns only once every service is done, and a
failed write is raised (which fails the query) only after the other service finished; a large batch's
writes go on while the next batch is computed, which is handed over only once every service wrote the
last, a failed write fails the next batch (or shows in `failure` while the topic is idle), and a stop
lets the last writes finish. Fake services stand in for the store writes; Spark is not involved."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from aml_app.pipeline.jobs import OVERLAP_FROM_RECORDS, QueryBatches

DEADLINE = 10.0


class FakeService:
    """A service whose `process` records what it wrote, optionally waiting for a gate or failing."""

    def __init__(self, name: str, log: list[tuple[str, int, str]], lock: threading.Lock) -> None:
        self.service = name
        self.max_payment_bytes, self.max_clock_skew, self.threshold, self.band = 1000, 5.0, 0, 0
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


def outputs(names: tuple[str, ...] = ("relations", "aggregates"), records: int = 1000) -> dict[str, Any]:
    return {name: SimpleNamespace(records=records) for name in names}


def large(names: tuple[str, ...] = ("relations", "aggregates")) -> dict[str, Any]:
    return outputs(names, OVERLAP_FROM_RECORDS)


def wait_until(condition: Any) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


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


def test_a_small_batch_just_under_the_bound_is_written_before_the_call_returns() -> None:
    batches, services, log = query("relations")
    gate = threading.Event()
    services[0].gate = gate
    threading.Timer(0.2, gate.set).start()
    assert batches.hand_to_services(outputs(("relations",), OVERLAP_FROM_RECORDS - 1), 0, 0.0) == [
        "relations-0"
    ]
    assert ("relations", 0, "end") in log


def test_a_large_batch_is_written_while_the_next_is_computed_and_handed_over_in_order() -> None:
    batches, services, log = query("relations", "aggregates")
    gate = threading.Event()
    services[1].gate = gate  # aggregates holds batch 0
    assert batches.hand_to_services(large(), 0, 0.0) is None  # returns while batch 0 is being written
    wait_until(lambda: ("relations", 0, "end") in log)
    assert ("aggregates", 0, "end") not in log
    second = threading.Thread(target=batches.hand_to_services, args=(large(), 1, 0.0))
    second.start()
    time.sleep(0.1)
    assert second.is_alive()  # waiting for aggregates' batch 0
    assert not any(batch == 1 for _, batch, _ in log)
    services[1].gate = None
    gate.set()
    second.join(DEADLINE)
    assert batches.wait(DEADLINE) == ["relations-1", "aggregates-1"]
    for name in ("relations", "aggregates"):
        for other in ("relations", "aggregates"):
            assert log.index((name, 0, "end")) < log.index((other, 1, "start"))


def test_a_failed_large_write_fails_the_next_batch_and_shows_while_idle() -> None:
    batches, services, log = query("relations", "aggregates")
    services[0].error = RuntimeError("the store refused the batch")
    batches.hand_to_services(large(), 0, 0.0)
    wait_until(lambda: batches.failure() is not None)
    assert "refused" in str(batches.failure())
    with pytest.raises(RuntimeError, match="refused"):
        batches.hand_to_services(outputs(), 1, 0.0)
    assert not any(batch == 1 for _, batch, _ in log)  # batch 1 never reached a store


def test_a_stop_lets_the_last_writes_finish_and_does_not_hang_on_one_that_cannot() -> None:
    batches, services, log = query("relations")
    gate = threading.Event()
    services[0].gate = gate
    batches.hand_to_services(large(("relations",)), 0, 0.0)
    threading.Timer(0.2, gate.set).start()
    batches.drain(DEADLINE)
    assert ("relations", 0, "end") in log

    stuck = threading.Event()  # never set: a write waiting for a database that is away
    services[0].gate = stuck
    batches.hand_to_services(large(("relations",)), 1, 0.0)
    started = time.monotonic()
    batches.drain(0.2)
    assert time.monotonic() - started < DEADLINE
    assert ("relations", 1, "end") not in log
    stuck.set()
