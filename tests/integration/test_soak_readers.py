"""The chaos soak's own readers: what tells a payment the soak's reader missed from one the broker lost."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from aml_app.kafka.broker import EmbeddedBroker
from bench.chaos_soak import REFETCH_FOR, Seen, TopicReader, read_again
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


class Seeks:
    """The reader's consumer, as far as `keep` uses it: where it was told to read from next."""

    def __init__(self) -> None:
        self.seeks: list[tuple[TopicPartition, int]] = []

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))


def records(*offsets: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(partition=0, offset=o, key=None, value=b"", headers=()) for o in offsets]


async def test_a_reader_fetches_again_the_offsets_a_fetch_skipped() -> None:
    """Tansu takes a batch's offsets before it stores the batch; a fetch meanwhile returns a later batch
    another producer stored first. A reader that kept it lost the batch in between: 26 payments of a
    chaos soak had no decision to its reader, all on one partition of the decisions topic."""
    reader = TopicReader("localhost:9", "decisions", 1)
    consumer = reader.consumer = Seeks()  # type: ignore[assignment]
    tp = TopicPartition("decisions", 0)

    reader.keep(tp, records(0, 1, 4, 5), now=100.0)  # 2 and 3 not stored yet
    assert [r.offset for r in reader.records] == [0, 1] and consumer.seeks == [(tp, 2)]
    reader.keep(tp, records(4, 5), now=100.5)  # still not stored
    reader.keep(tp, records(2, 3, 4, 5), now=101.0)  # stored: fetched again from 2

    assert [r.offset for r in reader.records] == [0, 1, 2, 3, 4, 5]
    assert consumer.seeks == [(tp, 2), (tp, 2)] and reader.skipped() == 0

    # Offsets that never hold a record (a compacted topic) are passed after REFETCH_FOR.
    reader.keep(tp, records(8), now=200.0)
    reader.keep(tp, records(8), now=200.0 + REFETCH_FOR)
    assert [r.offset for r in reader.records][-1] == 8 and reader.skipped() == 2
