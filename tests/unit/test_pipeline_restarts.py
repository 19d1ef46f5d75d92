"""The pipeline starts its queries again when Spark's Python worker did not connect back in time (an
overloaded host), within a budget; every other failure still ends the process."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from aml_app.pipeline import runner
from aml_app.pipeline.runner import Restarts, restartable

UNCONNECTED = (
    "query relations+aggregates stopped: Python worker failed to connect back.\n"
    "Caused by: java.net.SocketTimeoutException: "
    "Timed out while waiting for the Python worker to connect back"
)


class FakePipeline:
    """The narrowest seam of `_run_until_stopped`: what it asks of a Pipeline."""

    def __init__(self, failures: list[str | None]) -> None:
        self.failures = failures
        self.stopped = False
        self.recommits = 0

    def failure(self) -> str | None:
        return self.failures.pop(0) if self.failures else None

    def recommit(self) -> None:
        self.recommits += 1

    def stop(self) -> None:
        self.stopped = True


class Spark:
    def stop(self) -> None:
        pass


@pytest.fixture(autouse=True)
def signals_restored() -> Iterator[None]:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def test_only_the_worker_sentences_are_restartable() -> None:
    assert restartable(UNCONNECTED)
    assert restartable("Timed out while waiting for the Python worker to connect back")
    assert not restartable("query relations+aggregates stopped: LogChanged: the relations store ...")
    assert not restartable("a store write failed: connection refused")


def test_the_budget_allows_a_few_restarts_in_a_window() -> None:
    now = [0.0]
    restarts = Restarts(limit=3, window=600, clock=lambda: now[0])
    assert [restarts.take() for _ in range(4)] == [True, True, True, False]
    now[0] = 599.0
    assert not restarts.take()
    now[0] = 600.0  # the first three fell out of the window
    assert restarts.take() and restarts.take() and restarts.take() and not restarts.take()


def test_a_query_the_worker_stopped_is_started_again_until_done() -> None:
    first = FakePipeline([None, UNCONNECTED])
    second = FakePipeline([None, None])
    started: list[Any] = []

    def restart() -> Any:
        started.append(second)
        return second

    def done(running: Any) -> bool:
        return running is second and not second.failures

    assert runner._run_until_stopped(Spark(), first, done, restart) == 0  # type: ignore[arg-type]
    assert started == [second] and first.stopped and second.stopped


def test_a_worker_failing_beyond_the_budget_ends_the_process(caplog: pytest.LogCaptureFixture) -> None:
    pipelines = [FakePipeline([UNCONNECTED]) for _ in range(runner.RESTART_LIMIT + 1)]
    handed = iter(pipelines[1:])
    with caplog.at_level(logging.WARNING, logger="aml_app.pipeline"):
        code = runner._run_until_stopped(Spark(), pipelines[0], restart=lambda: next(handed))  # type: ignore[arg-type]
    assert code == 1
    assert all(p.stopped for p in pipelines)
    assert sum("starting the queries again" in m for m in caplog.messages) == runner.RESTART_LIMIT
    assert caplog.messages[-1].startswith(
        "pipeline failed: query relations+aggregates stopped: Python worker"
    )


def test_other_failures_and_a_failed_restart_end_the_process(caplog: pytest.LogCaptureFixture) -> None:
    def never() -> Any:
        raise AssertionError("restarted a failure that is not the worker's")

    other = FakePipeline(["a store write failed: connection refused"])
    with caplog.at_level(logging.ERROR, logger="aml_app.pipeline"):
        assert runner._run_until_stopped(Spark(), other, restart=never) == 1  # type: ignore[arg-type]
    assert (
        other.stopped and caplog.messages[-1] == "pipeline failed: a store write failed: connection refused"
    )

    def refused() -> Any:
        raise RuntimeError("the relations store is behind its consumer group")

    first = FakePipeline([UNCONNECTED])
    with caplog.at_level(logging.ERROR, logger="aml_app.pipeline"):
        assert runner._run_until_stopped(Spark(), first, restart=refused) == 1  # type: ignore[arg-type]
    assert first.stopped
    assert caplog.messages[-1] == (
        "pipeline failed: starting the queries again failed: the relations store is behind its consumer group"
    )


def test_the_watch_commits_the_groups_again_while_the_queries_run() -> None:
    """An idle topic runs no micro-batch: the driver's watch is what keeps the groups' offsets from
    expiring (`GroupProgress.recommit`)."""
    running = FakePipeline([None, None, None])
    assert runner._run_until_stopped(Spark(), running, lambda p: not p.failures) == 0  # type: ignore[arg-type]
    assert running.recommits == 2


class Refusing:
    def recommit(self) -> None:
        raise RuntimeError("KafkaError{code=_TIMED_OUT}")


class Counting:
    calls = 0

    def recommit(self) -> None:
        self.calls += 1


def test_a_recommit_the_broker_refuses_is_a_warning_and_the_other_groups_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counted = Counting()
    handlers = [
        type("Handler", (), {"service": "relations", "progress": Refusing()})(),
        type("Handler", (), {"service": "aggregates", "progress": counted})(),
    ]
    pipeline = runner.Pipeline(None, [], [], handlers=handlers)
    with caplog.at_level(logging.WARNING, logger="aml_app.pipeline"):
        pipeline.recommit()
    assert counted.calls == 1
    assert caplog.messages == ["committing relations's offsets again: KafkaError{code=_TIMED_OUT}"]
