"""Publishing a service's progress as committed consumer-group offsets, and dead-lettering bad records.

Both run on the Spark driver at the end of a micro-batch, after the service's store transaction committed:
the committed offset of group `relations` past o on partition p then means payment (p, o) is visible
through Service-B's API. That is the promise the freshness gate reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aml_app.contract import dead_letter_headers, in_parts
from aml_app.kafka.derivation import SOURCE_HEADER

DELIVERY_TIMEOUT = 30.0
#: How often (seconds) a group's offsets are committed again unchanged. The group has no member, so
#: Kafka drops a partition's committed offset `offsets.retention.minutes` (7 days by default) after its
#: last commit: a partition without payments that long, or an idle topic, would read as nothing applied.
RECOMMIT_EVERY = 3600.0


class GroupProgress:
    """Commits offsets for one group without joining it (no member, no rebalance), like a simple consumer.

    A group's committed offsets never move backwards here: `floor` is what the group had committed when
    this started (read once), and `commit` only sends partitions past both it and our last commit. A
    store being rebuilt from the start of the topic therefore leaves the group alone until it has caught
    up, and the gate never sees a dependency's progress shrink. Every `recommit_every` seconds the
    commit, or `recommit` while the topic is idle, sends every partition again, so that the broker's
    offset expiry never takes back what was published.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        topic: str,
        group: str,
        partitions: Iterable[int] = (),
        recommit_every: float = RECOMMIT_EVERY,
    ) -> None:
        from confluent_kafka import Consumer

        self.topic, self.group = topic, group
        self.consumer = Consumer({**config, "group.id": group, "enable.auto.commit": False})
        wanted = list(partitions)
        self.floor: dict[int, int] = self.committed(wanted) if wanted else {}
        self.sent: dict[int, int] = dict(self.floor)
        self.recommit_every = recommit_every
        self.recommitted = time.monotonic()
        # A micro-batch commits on Spark's thread, `recommit` on the driver's main one: one at a time, so
        # an earlier offset never reaches the broker after a later one.
        self.lock = threading.Lock()

    def commit(self, offsets: Mapping[int, int]) -> dict[int, int]:
        """Commit `{partition: next offset}` where it moves the group forward, and every partition again
        when `recommit_every` has passed; returns what the group now has committed (as far as we know).
        Raises if the broker refuses, so the batch is retried."""
        from confluent_kafka import TopicPartition

        with self.lock:
            forward = {p: o for p, o in offsets.items() if o > self.sent.get(p, 0)}
            now = time.monotonic()
            due = now - self.recommitted >= self.recommit_every
            send = {**self.sent, **forward} if due else forward
            if send:
                tps = [TopicPartition(self.topic, p, o) for p, o in sorted(send.items())]
                for tp in self.consumer.commit(offsets=tps, asynchronous=False) or []:
                    if tp.error is not None:
                        raise RuntimeError(
                            f"commit of {self.group} {self.topic}[{tp.partition}] failed: {tp.error}"
                        )
                self.sent.update(forward)
            if due:
                self.recommitted = now
            return dict(sorted(self.sent.items()))

    def recommit(self) -> None:
        """What the driver calls while no micro-batch runs (an idle topic): every partition committed
        again once `recommit_every` has passed since the last time."""
        self.commit({})

    def committed(self, partitions: Iterable[int]) -> dict[int, int]:
        """The group's committed offsets as the broker has them now (partitions without any left out)."""
        from confluent_kafka import TopicPartition

        found = self.consumer.committed([TopicPartition(self.topic, p) for p in partitions], timeout=10)
        return {tp.partition: tp.offset for tp in found if tp.offset >= 0}

    def close(self) -> None:
        self.consumer.close()


@dataclass(frozen=True)
class Rejected:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    reason: str
    #: The record's timestamp (ms since the epoch; None or negative: none), which its dead letter keeps.
    timestamp: int | None = None
    #: A derived topic's `aml-source` header, which its dead letter keeps (None: none).
    source: str | None = None


class DeadLetters:
    """Sends rejected records to the DLQ with their original bytes; `send` returns once all are stored."""

    def __init__(self, config: Mapping[str, Any], topic: str, source_topic: str, service: str) -> None:
        from confluent_kafka import Producer

        self.topic, self.source_topic, self.service = topic, source_topic, service
        self.producer = Producer({**config, "enable.idempotence": True, "acks": "all"})

    def send(self, records: Iterable[Rejected]) -> int:
        failures: list[str] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                failures.append(str(err))

        sent = 0
        for record in records:
            headers = dead_letter_headers(
                record.reason, self.source_topic, record.partition, record.offset, self.service
            )
            if record.source is not None:
                headers.insert(0, (SOURCE_HEADER, record.source.encode()))
            # librdkafka's 0 is "now": a record without a time gets the producer's.
            stamp = max(record.timestamp or 0, 0)
            # A record too large for one (the producer's message.max.bytes) goes in parts.
            for key, value, part_headers in in_parts(record.value, headers, "dlq", record.key):
                self._produce(key, value, part_headers, delivered, stamp)
            sent += 1
        if sent:
            remaining = self.producer.flush(DELIVERY_TIMEOUT)
            if remaining or failures:
                raise RuntimeError(
                    f"{self.service}: {remaining} dead letters undelivered after {DELIVERY_TIMEOUT:.0f} s, "
                    f"errors: {failures[:3]}"
                )
        return sent

    def _produce(
        self,
        key: bytes | None,
        value: bytes | None,
        headers: list[Any],
        delivered: Callable[..., None],
        timestamp: int = 0,
    ) -> None:
        """Queue one record. librdkafka's queue holds `queue.buffering.max.messages` records and raises
        BufferError when full: serve delivery reports until it has room, for at most DELIVERY_TIMEOUT
        without any."""
        deadline = time.monotonic() + DELIVERY_TIMEOUT
        while True:
            try:
                self.producer.produce(
                    self.topic,
                    key=key,
                    value=value,
                    headers=headers,
                    on_delivery=delivered,
                    timestamp=timestamp,
                )
                break
            except BufferError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"{self.service}: the dead-letter producer's queue stayed full for "
                        f"{DELIVERY_TIMEOUT:.0f} s"
                    ) from None
                self.producer.poll(0.1)
        self.producer.poll(0)

    def close(self) -> None:
        self.producer.flush(DELIVERY_TIMEOUT)
        self.producer.close()
