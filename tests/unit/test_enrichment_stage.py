"""The enrichment stage's transaction loop when a transaction cannot end: a fenced or failed producer
stops the stage with one sentence (`StageError`), never a traceback from inside the abort. librdkafka's
own errors, with the clients replaced at their narrowest seam (the stage's two attributes)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

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


class Producer:
    def __init__(self, commit: KafkaError, abort: KafkaError | None) -> None:
        self.commit, self.abort, self.aborted = commit, abort, 0

    def begin_transaction(self) -> None:
        pass

    def produce(self, *args: Any, **kwargs: Any) -> None:
        pass

    def send_offsets_to_transaction(self, *args: Any) -> None:
        pass

    def commit_transaction(self, timeout: float) -> None:
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
    return made


def test_a_transaction_that_fails_and_aborts_reads_the_batch_again() -> None:
    producer = Producer(KafkaError(KafkaError._TIMED_OUT, "slow", retriable=True), None)
    ran = stage(producer)
    assert ran.run_once() == 0 and ran.aborted == 1 and producer.aborted == 1


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
