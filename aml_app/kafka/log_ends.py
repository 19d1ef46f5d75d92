"""A partition's log end as a fetch reports it, for whatever must read a partition to its end.

Some brokers (Tansu, the embedded broker) answer ListOffsets(latest) with the start of a partition's last
record batch + 1: with nine records written in batches, ListOffsets says 7 while a fetch's high watermark
says 9. Apache Kafka reports the true end, so nothing here depends on the broker: a fetch started at the
reported end carries the partition's high watermark, and the end is the larger of the two.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition

from aml_app.kafka.deadlines import close_within, within

#: A topic-partition pair: aiokafka's TopicPartition or Faust's TP (both named tuples of the same shape).
Key = TypeVar("Key", bound=tuple[str, int])


class LogEndUnknown(RuntimeError):
    """No fetch answered in time: the caller cannot know how far the log reaches."""


async def fetched_log_ends(
    client: Mapping[str, Any], reported: Mapping[Key, int], timeout: float = 10.0
) -> dict[Key, int]:
    """Each partition's end: the larger of `reported` (ListOffsets' answer) and the high watermark of a
    fetch started there. `client` holds the aiokafka client options (bootstrap servers, TLS/SASL)."""
    if not reported:
        return {}
    consumer = AIOKafkaConsumer(
        **client,
        group_id=None,
        enable_auto_commit=False,
        client_id="aml-log-ends",
        # The answer's high watermark is what counts, not its records.
        max_partition_fetch_bytes=1,
        fetch_max_wait_ms=100,
    )
    try:
        await within(consumer.start(), timeout, "starting the log end reader")
        tps = {key: TopicPartition(key[0], key[1]) for key in reported}
        consumer.assign(list(tps.values()))
        for key, tp in tps.items():
            consumer.seek(tp, reported[key])
        deadline = time.monotonic() + timeout
        while any(consumer.highwater(tp) is None for tp in tps.values()):
            if time.monotonic() > deadline:
                missing = sorted(
                    f"{tp.topic}:{tp.partition}" for tp in tps.values() if consumer.highwater(tp) is None
                )
                raise LogEndUnknown(f"no fetch answered within {timeout:g} s for {', '.join(missing)}")
            await consumer.getmany(timeout_ms=100)
        return {key: max(reported[key], consumer.highwater(tp) or 0) for key, tp in tps.items()}
    finally:
        await close_within(consumer.stop(), timeout, "stopping the log end reader")
