"""The harness's readers of whole topics start at offset 0, whatever the broker says a log's start is."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.consumer.fetcher import Fetcher

from aml_app.harness.tails import RecordTail
from aml_app.kafka.broker import EmbeddedBroker
from tests.harness import Names, TopicReader, wait_until

pytestmark = pytest.mark.integration

EARLIEST = -2  # ListOffsets' timestamp for a log's start


@pytest.fixture
def start_said_to_be_4(monkeypatch: pytest.MonkeyPatch) -> None:
    """ListOffsets(earliest) answers 4 for every partition, as the embedded broker can when two
    producers' first batches to a partition race (it answered 1 or 4 for 1 of 150 fresh partitions)."""
    asked = Fetcher._proc_offset_request

    async def past_the_first_records(self: Fetcher, node_id: int, topic_data: dict[str, Any]) -> Any:
        found = await asked(self, node_id, topic_data)
        earliest = {(t, p) for t, parts in topic_data.items() for p, at in parts if at == EARLIEST}
        return {
            tp: (4, at) if (tp.topic, tp.partition) in earliest else (o, at) for tp, (o, at) in found.items()
        }

    monkeypatch.setattr(Fetcher, "_proc_offset_request", past_the_first_records)


async def test_readers_read_a_partition_from_offset_0(
    broker: EmbeddedBroker, names: Names, producer: AIOKafkaProducer, start_said_to_be_4: None
) -> None:
    for n in range(8):
        await producer.send(names.decisions, f'{{"payment_id": "p{n}"}}'.encode(), partition=0)
    await producer.flush()

    reader = await TopicReader(broker.bootstrap, names.decisions, names.partitions).start()
    tail = await RecordTail([broker.bootstrap], names.decisions).start(names.partitions)
    running = asyncio.create_task(tail.run())
    try:

        async def all_read() -> bool:
            await reader.poll(0.2)
            return len(reader.records) >= 8 and len(tail.ids) >= 8

        await wait_until(all_read, 30, "8 records read by each reader", interval=0)
    finally:
        tail.halt()
        await asyncio.wait_for(running, 10)
        await tail.stop()
        await reader.stop()
    assert sorted(r.offset for r in reader.records) == list(range(8))
    assert tail.ids == {f"p{n}" for n in range(8)}
