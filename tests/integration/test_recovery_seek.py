"""The seek that starts Faust's table recovery, on the real broker, when a rebalance came between
recovery reading its changelog offsets and seeking them."""

from __future__ import annotations

import types
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from aml_app.faust_internals import seek_recovery_offsets, transport_with_fetch_wait
from aml_app.kafka.broker import EmbeddedBroker, create_topics

pytestmark = pytest.mark.integration


def consumer_thread(read_offset: dict[TopicPartition, int]) -> types.SimpleNamespace:
    """What Faust's `AIOKafkaConsumerThread._seek_wait` reads of its thread: its logger, the Faust
    consumer's read offsets and the request timeout."""
    return types.SimpleNamespace(
        log=types.SimpleNamespace(dev=lambda *args, **kwargs: None),
        consumer=types.SimpleNamespace(_read_offset=read_offset),
        app=types.SimpleNamespace(conf=types.SimpleNamespace(broker_request_timeout=10.0)),
    )


async def test_a_recovery_seek_overtaken_by_a_rebalance_seeks_the_partitions_it_has_offsets_for(
    broker: EmbeddedBroker,
) -> None:
    """Faust's recovery seeks `{partition: offset}` as its offsets table holds them when its seek task
    runs; a rebalance handled just before adds the partitions it assigns with None (their store has
    applied nothing) and starts the recovery again. Faust's own seek raised ValueError for the None
    and the worker crashed (a chaos soak, as a frozen worker came back): here the partitions with an
    offset are seeked and the others left to the recovery that follows."""
    topic = f"changelog-{uuid.uuid4().hex[:8]}"
    await create_topics([broker.bootstrap], [topic], partitions=2)
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap)
    await producer.start()
    try:
        for n in range(6):
            await producer.send_and_wait(topic, b"%d" % n, partition=n % 2)
    finally:
        await producer.stop()
    known, added = TopicPartition(topic, 0), TopicPartition(topic, 1)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=broker.bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        consumer.assign([known, added])
        read_offset: dict[TopicPartition, int] = {}
        offsets = {known: 2, added: None}

        await seek_recovery_offsets(consumer_thread(read_offset), consumer, offsets)

        assert await consumer.position(known) == 2
        assert read_offset == {known: 2}
        assert await consumer.position(added) == 0, "left where the consumer stood (its reset)"
        with pytest.raises(ValueError, match="Offset must be a positive integer"):
            consumer.seek(added, offsets[added])  # what Faust's seek does with it
    finally:
        await consumer.stop()


def test_the_worker_consumer_thread_seeks_recovery_offsets_so() -> None:
    assert transport_with_fetch_wait(100).Consumer.Thread._seek_wait is seek_recovery_offsets
