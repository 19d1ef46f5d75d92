"""Tells a hole in delivery (records the consumer skipped) from a gap in a partition's offsets.

Offsets in a Kafka partition are not always contiguous: transaction markers take an offset and
compaction removes records. So when a lane receives offset 140 right after 32, only the broker can
say whether 33..139 exist. This reads the partition directly, outside any group, from the first
missing offset and returns the offset of the first record there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiokafka import AIOKafkaConsumer, TopicPartition

from aml_app.kafka.security import KafkaSecurity, aiokafka_kwargs


async def first_offset_from(
    bootstrap_servers: Sequence[str],
    topic: str,
    partition: int,
    offset: int,
    timeout: float = 5.0,
    security: KafkaSecurity | None = None,
) -> int | None:
    """The offset of the first record at or after `offset` in the partition; None if none arrived in
    `timeout` seconds (the caller must then assume the records exist)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=list(bootstrap_servers),
        group_id=None,
        enable_auto_commit=False,
        client_id="aml-gate-holes",
        max_poll_records=1,
        **aiokafka_kwargs(security),
    )
    await asyncio.wait_for(consumer.start(), timeout)
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        records = await consumer.getmany(tp, timeout_ms=int(timeout * 1000), max_records=1)
        found = records.get(tp)
        return found[0].offset if found else None
    finally:
        await consumer.stop()
