"""The broker census (`bench.broker_census`): every client's requests pass it and are counted by the
process, client id and API that made them, without changing what the clients read and write."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer
from confluent_kafka import TopicPartition as RdTopicPartition

from aml_app.kafka.broker import EmbeddedBroker, create_topics, free_port, port_open, wait_until_answering
from bench.broker_census import Census, difference, owners, rows
from bench.capacity import census_broker
from tests.harness import wait_until

pytestmark = pytest.mark.integration

TOPIC = "census"


@pytest.fixture
async def census(tmp_path: Path) -> AsyncIterator[tuple[Census, str]]:
    """A broker of its own that advertises the census's port, so every connection after the first
    goes through the census too."""
    broker, counting = await census_broker(tmp_path / "broker.log", free_port())
    bootstrap = f"{broker.host}:{counting.port}"
    try:
        await wait_until_answering([bootstrap])
        await create_topics([bootstrap], [TOPIC], partitions=2)
        yield counting, bootstrap
    finally:
        await counting.stop()
        broker.stop()


async def test_every_client_is_counted_by_process_client_and_api(census: tuple[Census, str]) -> None:
    counting, bootstrap = census
    before = counting.snapshot()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, client_id="census-producer")
    await producer.start()
    try:
        for n in range(6):
            await producer.send_and_wait(TOPIC, f"a{n}".encode(), partition=n % 2)
    finally:
        await producer.stop()

    def librdkafka_writes() -> None:
        plain = Producer({"bootstrap.servers": bootstrap, "client.id": "census-rdkafka"})
        for n in range(4):
            plain.produce(TOPIC, f"b{n}".encode(), partition=n % 2)
        assert plain.flush(20) == 0

    await asyncio.to_thread(librdkafka_writes)

    consumer = AIOKafkaConsumer(
        TOPIC, bootstrap_servers=bootstrap, client_id="census-reader", auto_offset_reset="earliest"
    )
    await consumer.start()
    read: list[bytes] = []
    try:

        async def all_read() -> bool:
            batch = await consumer.getmany(timeout_ms=200)
            read.extend(r.value for records in batch.values() for r in records if r.value is not None)
            return len(read) >= 10

        await wait_until(all_read, 30, "10 records read through the census", interval=0)
    finally:
        await consumer.stop()

    def librdkafka_reads() -> list[bytes]:
        plain = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "client.id": "census-rdkafka-reader",
                "group.id": "census",
                "enable.auto.commit": False,
            }
        )
        plain.assign([RdTopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in (0, 1)])
        got: list[bytes] = []
        for _ in range(100):
            message = plain.poll(0.2)
            value = None if message is None or message.error() is not None else message.value()
            if value is not None:
                got.append(value)
            if len(got) >= 10:
                break
        plain.close()
        return got

    again = await asyncio.to_thread(librdkafka_reads)

    # What passed the census is what was written.
    expected = sorted([f"a{n}".encode() for n in range(6)] + [f"b{n}".encode() for n in range(4)])
    assert sorted(read) == expected
    assert sorted(again) == expected

    diff = difference(before, counting.snapshot())
    me = os.getpid()
    assert diff[(me, "census-producer", "Produce")]["answered"] == 6
    assert diff[(me, "census-rdkafka", "Produce")]["answered"] >= 1
    fetches = diff[(me, "census-reader", "Fetch")]
    assert fetches["answered"] >= 1 and fetches["partitions"][TOPIC] >= 2
    assert diff[(me, "census-reader", "ListOffsets")]["partitions"][TOPIC] == 2
    # librdkafka asks by topic id from Fetch v13 on: counted, named by the id's first bytes.
    rdkafka_fetches = diff[(me, "census-rdkafka-reader", "Fetch")]
    assert rdkafka_fetches["answered"] >= 1 and sum(rdkafka_fetches["partitions"].values()) >= 2

    found = rows(diff, owners({me}, {"this test": me}), seconds=1.0, payments=10)
    mine = {(r["process"], r["client_id"], r["api"]) for r in found}
    assert ("this test", "census-producer", "Produce") in mine


async def test_a_census_that_cannot_listen_stops_its_broker(tmp_path: Path) -> None:
    """Until the system takes the broker over, nothing else would stop it: it would outlive the run."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    started: list[EmbeddedBroker] = []
    real_start = EmbeddedBroker.start

    def start(self: EmbeddedBroker, timeout: float = 20.0) -> EmbeddedBroker:
        started.append(self)
        return real_start(self, timeout)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(EmbeddedBroker, "start", start)
            with pytest.raises(OSError):
                await census_broker(tmp_path / "broker.log", taken.getsockname()[1])
    finally:
        taken.close()
    [broker] = started
    assert broker.process is None  # stopped, and its process waited for
    assert not port_open(broker.host, broker.port)
