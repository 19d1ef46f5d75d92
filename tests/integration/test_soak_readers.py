"""The chaos soak's own readers: what tells a payment the soak's reader missed from one the broker lost."""

from __future__ import annotations

import time

import pytest
from aiokafka import AIOKafkaProducer

from aml_app.kafka.broker import EmbeddedBroker
from bench.chaos_soak import Seen, TopicReader, read_again
from tests.harness import Names

pytestmark = pytest.mark.integration


async def test_a_new_reader_finds_every_record_the_broker_holds(
    broker: EmbeddedBroker, names: Names, producer: AIOKafkaProducer
) -> None:
    # A batch of ten records on each partition, then one more record on partition 0.
    for n in range(40):
        value, key = f"v{n}".encode(), f"k{n}".encode()
        await producer.send(names.decisions, value, key=key, partition=n % names.partitions)
    await producer.flush()
    await producer.send_and_wait(names.decisions, b"last", key=b"last", partition=0)

    records = await read_again(broker.bootstrap, names.decisions, names.partitions)

    assert sorted(r.value for r in records if r.value is not None) == sorted(
        [f"v{n}".encode() for n in range(40)] + [b"last"]
    )


async def test_a_reader_counts_the_offsets_it_never_read() -> None:
    reader = TopicReader("localhost:9", "decisions", 2)
    now = time.time()
    reader.records = [
        Seen(0, offset, None, b"", (), now)
        for offset in (0, 1, 2, 5, 6)  # 3 and 4 never read
    ] + [Seen(1, offset, None, b"", (), now) for offset in (0, 1, 1, 2)]  # one read twice, none missed

    assert reader.skipped() == 2
