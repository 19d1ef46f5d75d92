"""Publishing a service's progress as committed consumer-group offsets, and dead-lettering bad records.

Both run on the Spark driver at the end of a micro-batch, after the service's store transaction committed:
the committed offset of group `relations` past o on partition p then means payment (p, o) is visible
through Service-B's API. That is the promise the freshness gate reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DELIVERY_TIMEOUT = 30.0


class GroupProgress:
    """Commits offsets for one group without joining it (no member, no rebalance), like a simple consumer."""

    def __init__(self, config: Mapping[str, Any], topic: str, group: str) -> None:
        from confluent_kafka import Consumer

        self.topic, self.group = topic, group
        self.consumer = Consumer({**config, "group.id": group, "enable.auto.commit": False})

    def commit(self, offsets: Mapping[int, int]) -> None:
        """Commit `{partition: next offset}`; raises if the broker refuses, so the batch is retried."""
        from confluent_kafka import TopicPartition

        if offsets:
            tps = [TopicPartition(self.topic, p, o) for p, o in sorted(offsets.items())]
            for tp in self.consumer.commit(offsets=tps, asynchronous=False) or []:
                if tp.error is not None:
                    raise RuntimeError(
                        f"commit of {self.group} {self.topic}[{tp.partition}] failed: {tp.error}"
                    )

    def committed(self, partitions: Iterable[int]) -> dict[int, int]:
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
            headers = [
                ("dlq.reason", record.reason.encode()),
                ("dlq.topic", self.source_topic.encode()),
                ("dlq.partition", str(record.partition).encode()),
                ("dlq.offset", str(record.offset).encode()),
                ("dlq.worker", self.service.encode()),
            ]
            self.producer.produce(
                self.topic, key=record.key, value=record.value, headers=headers, on_delivery=delivered
            )
            sent += 1
        if sent:
            remaining = self.producer.flush(DELIVERY_TIMEOUT)
            if remaining or failures:
                raise RuntimeError(
                    f"{self.service}: {remaining} dead letters undelivered after {DELIVERY_TIMEOUT:.0f} s, "
                    f"errors: {failures[:3]}"
                )
        return sent

    def close(self) -> None:
        self.producer.flush(DELIVERY_TIMEOUT)
        self.producer.close()
