"""Small Kafka helpers shared by the demo, the tests and the benchmarks (plain aiokafka, no Faust)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from aml_app.kafka.security import PLAINTEXT, KafkaSecurity, aiokafka_kwargs


class GroupCommitter:
    """Commits offsets for one consumer group, as a dependency service does after its work is durable."""

    def __init__(self, bootstrap: Sequence[str], group: str, topic: str) -> None:
        self.topic = topic
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=list(bootstrap), group_id=group, enable_auto_commit=False
        )

    async def start(self, partitions: Iterable[int]) -> GroupCommitter:
        await self.consumer.start()
        self.consumer.assign([TopicPartition(self.topic, p) for p in partitions])
        return self

    async def commit(self, offsets: Mapping[int, int]) -> None:
        await self.consumer.commit({TopicPartition(self.topic, p): o for p, o in offsets.items()})

    async def stop(self) -> None:
        await self.consumer.stop()


async def end_offsets(bootstrap: Sequence[str], topic: str, partitions: Iterable[int]) -> dict[int, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=list(bootstrap))
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in partitions]
        ends = await consumer.end_offsets(tps)
        return {tp.partition: offset for tp, offset in ends.items()}
    finally:
        await consumer.stop()


class PaymentRecord:
    """What a payment dataclass becomes on `payments`: keyed by payer, so each payer's payments stay in
    one partition in order, and the contract's JSON as the value (optional fields only when set)."""

    __slots__ = ()
    payment_id: str
    payer: str
    payee: str
    amount: str
    currency: str
    ts: str
    channel: str | None
    country: str | None

    @property
    def key(self) -> bytes:
        return self.payer.encode()

    def value(self) -> bytes:
        optional = {name: getattr(self, name, None) for name in ("channel", "country")}
        return payment_json(
            self.payment_id,
            self.payer,
            self.payee,
            self.amount,
            self.ts,
            currency=self.currency,
            **{name: value for name, value in optional.items() if value is not None},
        )


def payment_json(payment_id: str, payer: str, payee: str, amount: str, ts: str, **extra: Any) -> bytes:
    doc = {
        "payment_id": payment_id,
        "payer": payer,
        "payee": payee,
        "amount": amount,
        "currency": "EUR",
        "ts": ts,
        **extra,
    }
    return json.dumps(doc).encode()


async def started_producer(
    bootstrap: Sequence[str], client_id: str, security: KafkaSecurity = PLAINTEXT
) -> AIOKafkaProducer:
    """A started producer for payments (acks=all, a short linger) with `security`'s TLS/SASL. A failed
    start is stopped before it raises: it leaves connections and tasks behind otherwise."""
    producer = AIOKafkaProducer(
        bootstrap_servers=list(bootstrap),
        acks="all",
        linger_ms=5,
        client_id=client_id,
        **aiokafka_kwargs(security),
    )
    try:
        await producer.start()
    except BaseException:
        await producer.stop()
        raise
    return producer


async def produce(
    producer: AIOKafkaProducer,
    topic: str,
    records: Iterable[tuple[int | None, bytes | None, bytes | None]],
) -> list[tuple[int, int]]:
    """Send (partition, key, value) records; return their (partition, offset) in order."""
    futures = [
        await producer.send(topic, value=value, key=key, partition=partition)
        for partition, key, value in records
    ]
    placed = []
    for fut in futures:
        meta = await fut
        placed.append((meta.partition, meta.offset))
    return placed
