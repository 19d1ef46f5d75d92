"""The pipeline's start when the cluster does not say what a topic holds, at its narrowest seams: the
reads of the topic's log (`kafka_source.log_bounds`, `identity.log_identity`) faked; no Kafka, no
database, no Spark.

The start reads the log again with backoff for at most START_OUTAGE_LIMIT seconds (a broker restarting
costs a pause), then `aml-app pipeline` and `aml-app rebuild` exit 2 with one sentence on stderr that
names the topic, as for a refused store: no traceback.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

from aml_app.kafka import identity
from aml_app.kafka.identity import LogUnknown
from aml_app.pipeline import kafka_source, runner
from aml_app.pipeline.kafka_source import LogUnreadable, unanswered
from aml_app.settings import PipelineSettings, Settings

pytestmark = pytest.mark.timeout(30)

TOPIC = "payments"
LOG = "c1:AAAA"
BOUNDS = {0: (0, 5), 1: (2, 7)}
CONFIG = {"bootstrap.servers": "127.0.0.1:1"}


class Clock:
    """A fake monotonic clock; `sleep` moves it on and records each wait."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class Flaky:
    """A fake read that raises `error` for its first `failures` calls (each taking `cost` seconds of
    `clock`), then answers `answer`."""

    def __init__(self, answer: Any, error: Exception, failures: int, clock: Clock | None = None) -> None:
        self.answer, self.error, self.failures, self.clock = answer, error, failures, clock
        self.calls = 0

    def __call__(self, config: object, topic: str) -> Any:
        self.calls += 1
        if self.clock is not None:
            self.clock.now += 1.0
        if self.calls <= self.failures:
            raise self.error
        return self.answer


def no_answer() -> LogUnreadable:
    return LogUnreadable(unanswered(TOPIC, [1], kafka_source.PROBE_ROUNDS))


@pytest.fixture
def no_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark must not start; logging is left as the test runner set it (`basicConfig` would add a
    handler to the root logger for the rest of the session)."""

    def spark_session(*_: Any, **__: Any) -> Any:
        raise AssertionError("Spark was started although the start-up checks failed")

    monkeypatch.setattr(runner, "spark_session", spark_session)
    monkeypatch.setattr(runner, "configure_logging", lambda: None)


def settings() -> Settings:
    return dataclasses.replace(Settings(), pipeline=PipelineSettings(metrics_port=0))


@pytest.mark.parametrize("command", ["pipeline", "rebuild"])
@pytest.mark.parametrize("seam", ["log_bounds", "log_identity"])
def test_a_start_that_cannot_read_the_log_exits_2_with_one_sentence(
    command: str, seam: str, no_spark: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    bounds = Flaky(BOUNDS, no_answer(), failures=10**6 if seam == "log_bounds" else 0)
    log_id = Flaky(LOG, LogUnknown(f"cannot tell which log topic {TOPIC!r} is: no answer within 10 s"), 0)
    if seam == "log_identity":
        log_id.failures = 10**6
    monkeypatch.setattr(kafka_source, "log_bounds", bounds)
    monkeypatch.setattr(identity, "log_identity", log_id)
    # No wait: the first failure is past the limit. (raising=False: fails on the behaviour, not here.)
    monkeypatch.setattr(runner, "START_OUTAGE_LIMIT", 0.0, raising=False)

    if command == "pipeline":
        code = runner.run_pipeline(settings(), "local[1]", ["relations"])
    else:
        code = runner.run_rebuild(settings(), "local[1]", "relations")

    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"aml-app {command}: cannot read the log of topic {TOPIC} "), lines[0]
    assert "127.0.0.1:9092" in lines[0]
    assert (bounds if seam == "log_bounds" else log_id).calls == 1


def test_the_start_reads_the_log_again_until_the_broker_answers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    bounds = Flaky(BOUNDS, no_answer(), failures=1, clock=clock)
    monkeypatch.setattr(kafka_source, "log_bounds", bounds)
    monkeypatch.setattr(identity, "log_identity", Flaky(LOG, no_answer(), 0))

    with caplog.at_level(logging.WARNING, logger="aml_app.pipeline"):
        logs = runner.read_logs(CONFIG, [TOPIC], sleep=clock.sleep, clock=clock)

    assert logs == {TOPIC: (LOG, BOUNDS)}
    assert bounds.calls == 2 and len(clock.slept) == 1
    [line] = [r.getMessage() for r in caplog.records if r.name == "aml_app.pipeline"]
    assert f"cannot read the log of topic {TOPIC}" in line and "reading it again in" in line, line


def test_the_start_gives_up_once_the_outage_outlasts_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    bounds = Flaky(BOUNDS, no_answer(), failures=10**6, clock=clock)
    monkeypatch.setattr(kafka_source, "log_bounds", bounds)
    monkeypatch.setattr(identity, "log_identity", Flaky(LOG, no_answer(), 0))
    began = clock.now

    with pytest.raises(runner.LogUnavailable) as gave_up:
        runner.read_logs(CONFIG, [TOPIC], sleep=clock.sleep, clock=clock)

    # Each read costs the fake clock 1 s: the last one starts within the limit, none after it.
    assert clock.now - began <= runner.START_OUTAGE_LIMIT + 1.0, "read again past the limit"
    assert bounds.calls > 2, "gave up without reading again"
    message = str(gave_up.value)
    assert "\n" not in message and f"topic {TOPIC}" in message and "no fetch answered" in message
