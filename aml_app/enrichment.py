"""`aml-app enrich`: the derivation stage that writes `payments.enriched` from `payments`.

A Kafka transactional read-process-write, the field's way to run a stateless stage exactly once (Kafka
Streams does the same under `exactly_once_v2`): no state to keep, so no Spark job and no Faust table. It
reads `payments` in its own consumer group (`AML_ENRICHMENT_GROUP`, read_committed) and, per batch of
records, in one transaction:

- a payment that keeps the contract goes to the derived topic (`AML_ENRICHED_TOPIC`) with its original key
  and value, its amount in the reporting currency in the `aml-reporting-amount` header (absent when its
  currency has no rate), and the `aml-source: <partition>:<offset>` header the gate maps by
  (`aml_app.kafka.derivation`); it is partitioned by payee, so a reader finds each payee's payments on one
  partition (a repartition: each derived partition interleaves every payments partition);
- a record that breaks the contract goes to the dead-letter topic with its original bytes and the reason in
  headers, as every other reader of `payments` does;
- the group's offsets on `payments` (`send_offsets_to_transaction`): they move only with the records
  derived from what they pass, the one cooperation the gate asks of a stage.

Readers of the derived topic must read it read_committed. A failed transaction is aborted and the batch
read again from the group's offsets. The embedded broker (Tansu) hands aborted transactions' records to
read_committed readers too, so there a reader sees the payments of a transaction a crash left open twice:
the gate counts such records as pending until the group passes them (`aml_app.kafka.derivation`).
librdkafka runs the transactions (aiokafka's InitProducerId fails on the embedded broker). Each
instance needs its own `AML_ENRICHMENT_ID` (the transactional id: a restarted instance with the same id
fences its predecessor and ends its open transaction at once).
"""

from __future__ import annotations

import logging
import socket
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from aml_app.backoff import Backoff
from aml_app.contract import InvalidPayment, dead_letter_headers, in_parts, validate_payment
from aml_app.detection.exchange import ExchangeRates
from aml_app.failpoints import failpoint
from aml_app.kafka.derivation import SOURCE_HEADER
from aml_app.kafka.security import librdkafka_config
from aml_app.settings import Settings

log = logging.getLogger("aml_app.enrichment")

#: The header holding a payment's amount in the reporting currency: "<amount> <currency>".
AMOUNT_HEADER = "aml-reporting-amount"
#: Records read per transaction at most.
BATCH = 500
#: How long a transaction's calls may take (init, offsets, commit, abort).
TRANSACTION_TIMEOUT = 30.0
#: How many times a commit that timed out is asked again before the stage stops (10 x 30 s).
COMMIT_ATTEMPTS = 10
#: The pause after an aborted transaction, doubled after each one that follows, up to RETRY_MOST seconds.
RETRY_FIRST, RETRY_MOST = 0.1, 5.0


def payee_partition(payee: str, partitions: int) -> int:
    """The derived partition of a payee's payments: stable across processes and restarts."""
    return zlib.crc32(payee.encode()) % partitions


@dataclass(frozen=True)
class Derived:
    """What one record of `payments` becomes: a record of the derived topic, or a dead letter."""

    partition: int | None  # None: a dead letter
    headers: list[tuple[str, str | bytes | None]]


#: Who the stage's dead letters say wrote them (`dlq.worker`).
DEAD_LETTER_WORKER = "enrichment"


def derive(
    key: bytes | None,
    value: bytes | None,
    source: tuple[str, int, int, int | None],
    partitions: int,
    rates: ExchangeRates,
    max_bytes: int,
    max_clock_skew: float,
) -> Derived:
    """The derived record (or dead letter) of the record `source` = (topic, partition, offset, timestamp)."""
    topic, partition, offset, timestamp = source
    try:
        payment = validate_payment(key, value, max_bytes, timestamp, max_clock_skew)
    except InvalidPayment as exc:
        return Derived(None, [*dead_letter_headers(str(exc), topic, partition, offset, DEAD_LETTER_WORKER)])
    headers: list[tuple[str, str | bytes | None]] = [(SOURCE_HEADER, f"{partition}:{offset}".encode())]
    converted = rates.convert(Decimal(payment["amount"]), payment["currency"])
    if converted is not None:
        amount = converted.quantize(Decimal("0.01"))
        headers.append((AMOUNT_HEADER, f"{amount} {rates.reporting}".encode()))
    return Derived(payee_partition(payment["payee"], partitions), headers)


#: What a transaction that cannot end usually means, for the sentence the stage stops with.
FENCED_HINT = (
    "; another instance may run with the same AML_ENRICHMENT_ID (a restarted one fences its predecessor), "
    "or the cluster is gone"
)


class StageError(RuntimeError):
    """The stage cannot run; the message says why in one sentence."""


class Stage:
    """The read-process-write loop over librdkafka clients made from `settings`."""

    def __init__(self, settings: Settings, transactional_id: str, rates: ExchangeRates) -> None:
        from confluent_kafka import Consumer, Producer

        client = {
            "bootstrap.servers": ",".join(settings.kafka.bootstrap_servers),
            **librdkafka_config(settings.kafka.security),
        }
        self.settings, self.rates = settings, rates
        self.consumer = Consumer(
            {
                **client,
                "group.id": settings.kafka.enrichment_group,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
                "session.timeout.ms": int(settings.kafka.session_timeout * 1000),
            }
        )
        self.partitions = self._derived_partitions()
        try:
            self.producer = Producer({**client, "transactional.id": transactional_id})
            self.producer.init_transactions(TRANSACTION_TIMEOUT)
        except BaseException:  # a stage that cannot start leaves no consumer behind
            self.consumer.close()
            raise
        self.consumer.subscribe([settings.kafka.payments_topic])
        self.derived = self.dead_lettered = self.transactions = self.aborted = 0
        self.retry = Backoff(RETRY_FIRST, RETRY_MOST)
        #: The errors the last poll returned instead of records (logged when they change).
        self.poll_errors: list[str] = []
        #: When the last transaction committed, or the last poll found nothing (Unix time): what the
        #: stage's /metrics shows as its heartbeat.
        self.last_progress = time.time()

    def _derived_partitions(self) -> int:
        """The derived topic's partition count, or StageError: the topic must exist before the stage runs."""
        metadata = self.consumer.list_topics(self.settings.kafka.enriched_topic, timeout=TRANSACTION_TIMEOUT)
        topic = metadata.topics.get(self.settings.kafka.enriched_topic)
        if topic is None or topic.error is not None or not topic.partitions:
            self.consumer.close()
            raise StageError(
                f"the derived topic {self.settings.kafka.enriched_topic!r} does not exist: create it "
                "(aml-app topics --create) or set AML_ENRICHED_TOPIC"
            )
        return len(topic.partitions)

    def run_once(self, timeout: float = 0.5) -> int:
        """One transaction over the records one poll returns; how many records it read."""
        from confluent_kafka import KafkaException

        polled = self.consumer.consume(BATCH, timeout)
        messages = [m for m in polled if m.error() is None]
        if not messages:
            errors = sorted({str(m.error()) for m in polled})
            if errors:  # payments unreadable (no such topic, no right to read it): no progress to show
                if errors != self.poll_errors:
                    log.warning(
                        "enrichment: reading %s fails: %s", self.settings.kafka.payments_topic, errors
                    )
                self.poll_errors = errors
                return 0
            self.poll_errors = []
            self.last_progress = time.time()
            return 0
        self.poll_errors = []
        derived = dead_lettered = 0
        try:
            self.producer.begin_transaction()
            for message in messages:
                source = _source(message)
                # The payment's own record time, which C checks its `ts` against on the derived topic as
                # every consumer of payments does (the stage's clock would let C refuse what A accepts).
                # librdkafka's 0 is "now": a record without a time gets the stage's.
                stamp = source[3] or 0
                outcome = derive(
                    message.key(),
                    message.value(),
                    source,
                    self.partitions,
                    self.rates,
                    self.settings.kafka.max_payment_bytes,
                    self.settings.kafka.max_clock_skew,
                )
                if outcome.partition is None:
                    # The record's own headers first, as Kafka Connect keeps them; a value too large for
                    # one record (the producer's message.max.bytes) goes in parts.
                    kept = [*(message.headers() or ()), *outcome.headers]
                    for key, value, headers in in_parts(message.value(), kept, "dlq", message.key()):
                        self.producer.produce(
                            self.settings.kafka.dlq_topic,
                            key=key,
                            value=value,
                            headers=headers,
                            timestamp=stamp,
                        )
                else:
                    self.producer.produce(
                        self.settings.kafka.enriched_topic,
                        key=message.key(),
                        value=message.value(),
                        headers=outcome.headers,
                        partition=outcome.partition,
                        timestamp=stamp,
                    )
                derived += outcome.partition is not None
                dead_lettered += outcome.partition is None
            # The crash test's worst moment: records written, the transaction still open.
            failpoint("enrichment-before-commit")
            positions = [tp for tp in self.consumer.position(self.consumer.assignment()) if tp.offset >= 0]
            self.producer.send_offsets_to_transaction(
                positions, self.consumer.consumer_group_metadata(), TRANSACTION_TIMEOUT
            )
            self._commit()
        except KafkaException as exc:
            if exc.args and getattr(exc.args[0], "fatal", lambda: False)():
                raise StageError(f"the transactional producer failed for good ({exc}){FENCED_HINT}") from None
            log.warning("enrichment: transaction aborted (%s); reading the batch again", exc)
            self.aborted += 1
            try:
                self.producer.abort_transaction(TRANSACTION_TIMEOUT)
            except KafkaException as failed:  # fenced, or the cluster gone: this producer can do no more
                raise StageError(f"cannot abort the transaction ({failed}){FENCED_HINT}") from None
            self._rewind()
            # A batch that fails every time (a record the derived topic refuses, a topic gone) is read
            # again more and more slowly, up to RETRY_MOST seconds, while the heartbeat goes stale.
            time.sleep(self.retry.next())
            return 0
        self.retry = Backoff(RETRY_FIRST, RETRY_MOST)
        self.transactions += 1
        self.derived += derived
        self.dead_lettered += dead_lettered
        self.last_progress = time.time()
        return len(messages)

    def _commit(self) -> None:
        """Commit the open transaction. A commit that timed out is still pending in librdkafka, which
        refuses an abort then (retriable, not abortable): it is asked again, COMMIT_ATTEMPTS times in
        all, while the heartbeat goes stale; an error that needs an abort raises for the caller's."""
        from confluent_kafka import KafkaException

        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            try:
                self.producer.commit_transaction(TRANSACTION_TIMEOUT)
                return
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                pending = error is not None and error.retriable() and not error.txn_requires_abort()
                if not pending or getattr(error, "fatal", lambda: False)():
                    raise
                if attempt == COMMIT_ATTEMPTS:
                    raise StageError(
                        f"the transaction's commit did not finish in {COMMIT_ATTEMPTS} attempts of "
                        f"{TRANSACTION_TIMEOUT:g} s ({exc}): the cluster does not answer"
                    ) from None
                log.warning("enrichment: the commit is still pending (%s); asking again", exc)

    def _rewind(self) -> None:
        """Back to where the aborted batch started: the group's committed offsets, or the log start of a
        partition it never committed (the consumer starts there: auto.offset.reset is earliest)."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        for tp in self.consumer.committed(self.consumer.assignment(), TRANSACTION_TIMEOUT):
            offset = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
            self.consumer.seek(TopicPartition(tp.topic, tp.partition, offset))

    def run(self, stopped: Callable[[], bool], report_every: float = 10.0) -> None:
        """Until `stopped()`; a progress line every `report_every` seconds while records flow."""
        reported, last = time.monotonic(), (0, 0)
        while not stopped():
            self.run_once()
            now = time.monotonic()
            if now - reported >= report_every and (self.derived, self.dead_lettered) != last:
                log.info(
                    "enrichment: %d payments derived, %d dead-lettered, %d transactions",
                    self.derived,
                    self.dead_lettered,
                    self.transactions,
                )
                reported, last = now, (self.derived, self.dead_lettered)

    def close(self) -> None:
        # librdkafka bounds a consumer's close by about session.timeout.ms (rdkafka.h), which it waits
        # to leave the group; a cluster that never answers can hold it longer (librdkafka#3740).
        self.consumer.close()
        self.producer.flush(TRANSACTION_TIMEOUT)


#: The `service` label of the stage's metrics (the pipeline's carry relations and aggregates).
SERVICE_LABEL = "enrichment"


class StageMetrics:
    """The stage's Prometheus metrics, read from its counters at each scrape (`aml_app.metrics_server`
    serves them): what it derived, dead-lettered, committed and aborted, and its heartbeat."""

    def __init__(self, stage: Stage) -> None:
        from prometheus_client import CollectorRegistry, ProcessCollector

        self.stage = stage
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(self)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stage = self.stage
        for name, text, value in (
            ("aml_enrichment_payments_derived", "Payments written to the derived topic.", stage.derived),
            ("aml_enrichment_dead_lettered", "Records that broke the payment contract.", stage.dead_lettered),
            (
                "aml_enrichment_transactions",
                "Transactions committed (records with their offsets).",
                stage.transactions,
            ),
            ("aml_enrichment_aborted", "Transactions aborted (their batch read again).", stage.aborted),
        ):
            counter = CounterMetricFamily(name, text, labels=["service"])
            counter.add_metric([SERVICE_LABEL], value)
            yield counter
        heartbeat = GaugeMetricFamily(
            "aml_enrichment_last_progress_timestamp_seconds",
            "When the stage last committed a transaction or found nothing to read (Unix time).",
            labels=["service"],
        )
        heartbeat.add_metric([SERVICE_LABEL], stage.last_progress)
        yield heartbeat


def _source(message: Any) -> tuple[str, int, int, int | None]:
    """(topic, partition, offset, timestamp or None) of a record librdkafka read."""
    kind, value = message.timestamp()
    timestamp = value if kind != 0 and value >= 0 else None
    return message.topic(), message.partition(), message.offset(), timestamp


def default_transactional_id(settings: Settings) -> str:
    return f"{settings.kafka.enrichment_group}-{socket.gethostname()}"
