"""What the enrichment stage makes of one record of `payments` (`aml_app.enrichment.derive`)."""

from __future__ import annotations

import json
from decimal import Decimal

from aml_app.detection.exchange import ExchangeRates
from aml_app.enrichment import AMOUNT_HEADER, derive, payee_partition
from aml_app.kafka.derivation import SOURCE_HEADER, source_positions

RATES = ExchangeRates("USD", {"USD": Decimal(1), "EUR": Decimal("0.5")})


def payment(**fields: str) -> bytes:
    doc = {"payment_id": "p1", "payer": "a", "payee": "b", "amount": "10.00", "currency": "EUR"}
    doc.update({"ts": "2026-11-29T10:00:00Z", **fields})
    return json.dumps(doc).encode()


def test_a_payment_goes_to_its_payees_partition_naming_its_source_and_reporting_amount() -> None:
    out = derive(b"a", payment(), ("payments", 3, 41, None), 8, RATES, 10_000, 300)
    assert out.partition == payee_partition("b", 8)
    assert source_positions([(k, v) for k, v in out.headers if isinstance(v, bytes)], "d", 0, 0) == [(3, 41)]
    assert (AMOUNT_HEADER, b"20.00 USD") in out.headers
    assert {payee_partition(f"payee-{i}", 8) for i in range(200)} == set(range(8)), "payees spread out"


def test_a_currency_without_a_rate_goes_on_without_a_reporting_amount() -> None:
    out = derive(b"a", payment(currency="JPY"), ("payments", 0, 7, None), 4, RATES, 10_000, 300)
    assert out.partition is not None
    assert [k for k, _ in out.headers] == [SOURCE_HEADER]


def test_a_record_that_breaks_the_contract_becomes_a_dead_letter_with_its_reason() -> None:
    out = derive(b"someone-else", payment(), ("payments", 2, 9, None), 4, RATES, 10_000, 300)
    assert out.partition is None
    headers = dict(out.headers)
    assert headers["dlq.reason"] == b"key 'someone-else' does not match payer 'a'"
    assert (headers["dlq.topic"], headers["dlq.partition"], headers["dlq.offset"]) == (
        b"payments",
        b"2",
        b"9",
    )
    assert headers["dlq.worker"] == b"enrichment"


def test_an_aborted_batch_is_read_again_from_the_commits_or_the_log_start() -> None:
    """After an aborted transaction the consumer goes back to where the batch started: the group's
    committed offset, or the log start of a partition it never committed (not where the batch ended)."""
    from confluent_kafka import OFFSET_BEGINNING, OFFSET_INVALID, TopicPartition

    from aml_app.enrichment import Stage

    class Consumer:
        seeks: list[tuple[int, int]] = []

        def assignment(self) -> list[TopicPartition]:
            return [TopicPartition("payments", 0), TopicPartition("payments", 1)]

        def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
            return [TopicPartition("payments", 0, 42), TopicPartition("payments", 1, OFFSET_INVALID)]

        def seek(self, tp: TopicPartition) -> None:
            self.seeks.append((tp.partition, tp.offset))

    stage = Stage.__new__(Stage)  # the seam: the consumer it would open
    stage.consumer = Consumer()  # type: ignore[assignment]
    stage._rewind()
    assert Consumer.seeks == [(0, 42), (1, OFFSET_BEGINNING)]
