"""The enrichment stage's transaction loop when a transaction cannot end: a fenced or failed producer
stops the stage with one sentence (`StageError`), never a traceback from inside the abort. librdkafka's
own errors, with the clients replaced at their narrowest seam (the stage's two attributes)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from aml_app import enrichment
from aml_app.backoff import Backoff
from aml_app.enrichment import Stage, StageError


class Consumer:
    def consume(self, count: int, timeout: float) -> list[Any]:
        return [Record()]

    def assignment(self) -> list[Any]:
        return []

    def committed(self, partitions: list[Any], timeout: float) -> list[Any]:
        return []

    def position(self, partitions: list[Any]) -> list[Any]:
        return []

    def consumer_group_metadata(self) -> object:
        return object()


class Record:
    def error(self) -> None:
        return None

    def key(self) -> bytes:
        return b"k"

    def value(self) -> bytes:
        return b"not a payment"

    def topic(self) -> str:
        return "payments"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 7

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)

    def headers(self) -> list[tuple[str, bytes]] | None:
        return None


class Producer:
    def __init__(self, commit: KafkaError, abort: KafkaError | None, fails: int = 1_000_000) -> None:
        """A producer whose commits fail with `commit` `fails` times, then succeed."""
        self.commit, self.abort, self.aborted, self.fails, self.commits = commit, abort, 0, fails, 0

    def begin_transaction(self) -> None:
        pass

    def produce(self, *args: Any, **kwargs: Any) -> None:
        pass

    def send_offsets_to_transaction(self, *args: Any) -> None:
        pass

    def commit_transaction(self, timeout: float) -> None:
        self.commits += 1
        if self.commits <= self.fails:
            raise KafkaException(self.commit)

    def abort_transaction(self, timeout: float) -> None:
        self.aborted += 1
        if self.abort is not None:
            raise KafkaException(self.abort)


def stage(producer: Producer) -> Stage:
    from aml_app.detection.exchange import ExchangeRates
    from aml_app.settings import load_settings

    made = object.__new__(Stage)
    made.settings, made.rates, made.partitions = load_settings({}), ExchangeRates.from_env({}), 3
    made.consumer, made.producer = Consumer(), producer  # type: ignore[assignment]
    made.derived = made.dead_lettered = made.transactions = made.aborted = 0
    made.retry, made.poll_errors, made.last_progress = Backoff(0.001, 0.002), [], 0.0
    return made


def test_a_transaction_that_fails_and_aborts_reads_the_batch_again() -> None:
    producer = Producer(KafkaError(KafkaError._INVALID_ARG, "refused", txn_requires_abort=True), None)
    ran = stage(producer)
    assert ran.run_once() == 0 and ran.aborted == 1 and producer.aborted == 1


def test_a_commit_that_timed_out_is_asked_again_not_aborted() -> None:
    """librdkafka keeps a commit that timed out pending and refuses an abort then (_CONFLICT): the stage
    stopped, saying another instance might share its id."""
    timed_out = KafkaError(KafkaError._TIMED_OUT, "commit timed out", retriable=True)
    producer = Producer(timed_out, KafkaError(KafkaError._CONFLICT, "commit in progress"), fails=2)
    ran = stage(producer)
    assert ran.run_once() == 1 and producer.commits == 3 and producer.aborted == 0
    assert ran.transactions == 1 and ran.aborted == 0
    hung = Producer(timed_out, None)
    with pytest.raises(StageError, match=r"commit did not finish in 10 attempts of 30 s .*does not answer"):
        stage(hung).run_once()
    assert hung.commits == 10 and hung.aborted == 0


def test_a_fenced_producer_stops_the_stage_with_one_sentence() -> None:
    """Another instance with the same AML_ENRICHMENT_ID: the abort itself fails (it timed out after 30 s
    and ended in a traceback)."""
    fenced = KafkaError(KafkaError._FENCED, "producer fenced")
    producer = Producer(fenced, KafkaError(KafkaError._TIMED_OUT, "abort timed out"))
    with pytest.raises(StageError, match=r"cannot abort the transaction .*same AML_ENRICHMENT_ID"):
        stage(producer).run_once()


def test_a_fatal_error_stops_the_stage_before_any_abort() -> None:
    producer = Producer(KafkaError(KafkaError._FENCED, "fatal", fatal=True), None)
    with pytest.raises(StageError, match="failed for good"):
        stage(producer).run_once()
    assert producer.aborted == 0


class Failing:
    """A poll that returns only an error (payments unknown, or not ours to read)."""

    def error(self) -> KafkaError:
        return KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "not authorized")


def test_a_poll_of_errors_alone_is_no_progress() -> None:
    """The heartbeat moved on such a poll, so the stalled alert never fired while nothing was derived."""
    ran = stage(Producer(KafkaError(KafkaError._TIMED_OUT, "unused"), None))
    ran.consumer.consume = lambda *args: [Failing()]  # type: ignore[method-assign]
    assert ran.run_once() == 0 and ran.last_progress == 0.0 and "not authorized" in ran.poll_errors[0]
    ran.consumer.consume = lambda *args: []  # type: ignore[method-assign]
    assert ran.run_once() == 0 and ran.last_progress > 0 and ran.poll_errors == []


def test_a_batch_that_fails_every_time_is_read_again_more_and_more_slowly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(enrichment.time, "sleep", slept.append)
    ran = stage(
        Producer(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "too large", txn_requires_abort=True), None)
    )
    ran.retry = Backoff(0.1, 0.4)
    for _ in range(4):
        ran.run_once()
    assert slept == [0.1, 0.2, 0.4, 0.4] and ran.aborted == 4


def test_a_stage_that_cannot_start_its_producer_closes_its_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    import confluent_kafka

    from aml_app.detection.exchange import ExchangeRates
    from aml_app.settings import load_settings

    closed: list[bool] = []

    class Topics:
        topics = {"payments.enriched": type("T", (), {"error": None, "partitions": {0: None}})()}

    class StartingConsumer:
        def __init__(self, config: dict[str, Any]) -> None:
            pass

        def list_topics(self, topic: str, timeout: float) -> Topics:
            return Topics()

        def close(self) -> None:
            closed.append(True)

    class RefusingProducer:
        def __init__(self, config: dict[str, Any]) -> None:
            pass

        def init_transactions(self, timeout: float) -> None:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "no coordinator"))

    monkeypatch.setattr(confluent_kafka, "Consumer", StartingConsumer)
    monkeypatch.setattr(confluent_kafka, "Producer", RefusingProducer)
    with pytest.raises(KafkaException):
        Stage(load_settings({}), "enrichment-test", ExchangeRates.from_env({}))
    assert closed == [True]
