"""The reader of the dependency groups' committed offsets, against a fake admin client: the condition a
real cluster produces when a group's coordinator moves (a broker restart), which the embedded broker
(one node) cannot."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from aml_app.kafka.offsets import DependencyOffsets, OffsetReadError
from aml_app.kafka.security import PLAINTEXT

TOPIC = "payments"
GROUPS = ("relations", "aggregates")
Answer = Callable[[Sequence[TopicPartition]], dict[TopicPartition, OffsetAndMetadata]]


def committed(offset: int) -> Answer:
    return lambda tps: {tp: OffsetAndMetadata(offset, "") for tp in tps}


def top_level_error(tps: Sequence[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
    """What aiokafka returns for an OffsetFetch answered with NOT_COORDINATOR or
    COORDINATOR_LOAD_IN_PROGRESS: the response's error code is not read, and it has no partitions."""
    return {}


def without_partition_3(tps: Sequence[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
    return {tp: OffsetAndMetadata(7, "") for tp in tps if tp.partition != 3}


class FakeAdmin:
    """Just what the reader asks of aiokafka's admin client; each coordinator lookup names a new broker."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = answers
        self.lookups = 0
        self.asked: list[tuple[str, int]] = []

    async def _send_request(self, request: object) -> SimpleNamespace:  # the topic's metadata
        described = [{"topic": TOPIC, "error_code": 0, "partitions": [{"partition": p} for p in range(4)]}]
        return SimpleNamespace(to_object=lambda: {"topics": described})

    async def find_coordinator(self, group: str) -> int:
        self.lookups += 1
        return 100 + self.lookups

    async def list_consumer_group_offsets(
        self, group: str, group_coordinator_id: int, partitions: list[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        self.asked.append((group, group_coordinator_id))
        return self.answers.pop(0)(partitions)


def reader_with(admin: FakeAdmin) -> DependencyOffsets:
    reader = DependencyOffsets(["127.0.0.1:9"], TOPIC, GROUPS, security=PLAINTEXT)
    reader._client = admin  # type: ignore[assignment]  # the seam: the admin client it would open

    async def log(cluster_too: bool) -> str:
        return "cluster:topic-id"

    reader._read_log = log  # type: ignore[method-assign]  # and the log identity it would ask for
    reader._log_seen = "cluster:topic-id"  # a reading was made before, of the same log
    return reader


@pytest.mark.parametrize(
    "answer", [top_level_error, without_partition_3], ids=["no-partitions", "one-missing"]
)
async def test_an_answer_lacking_partitions_is_an_error_and_the_coordinator_is_looked_up_again(
    answer: Answer,
) -> None:
    admin = FakeAdmin([committed(5), answer, committed(9), committed(9)])
    reader = reader_with(admin)

    with pytest.raises(OffsetReadError, match=r"group 'aggregates'.*answered without partitions"):
        await reader.read()
    # Asked again, aggregates' coordinator is looked up anew; relations' is kept.
    partitions, offsets = await reader.read()
    assert partitions == [0, 1, 2, 3]
    assert offsets == {"relations": dict.fromkeys(range(4), 9), "aggregates": dict.fromkeys(range(4), 9)}
    assert admin.asked == [("relations", 101), ("aggregates", 102), ("relations", 101), ("aggregates", 103)]


async def test_a_group_that_never_committed_is_read_as_nothing_committed() -> None:
    """Every requested partition answered with -1 is a real answer: the group has committed nothing."""
    admin = FakeAdmin([committed(-1), committed(4)])
    _, offsets = await reader_with(admin).read()
    assert offsets == {"relations": dict.fromkeys(range(4)), "aggregates": dict.fromkeys(range(4), 4)}


class OverlapAdmin(FakeAdmin):
    """Answers an OffsetFetch only once every group's is in flight, or after a short wait: it counts
    how many were asked at once."""

    def __init__(self, groups: int) -> None:
        super().__init__([committed(3)] * groups)
        self.groups = groups
        self.in_flight = 0
        self.most = 0
        self.all_asked = asyncio.Event()

    async def list_consumer_group_offsets(
        self, group: str, group_coordinator_id: int, partitions: list[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight == self.groups:
            self.all_asked.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.all_asked.wait(), 0.5)
        self.in_flight -= 1
        return await super().list_consumer_group_offsets(group, group_coordinator_id, partitions)


async def test_the_groups_offsets_are_asked_for_side_by_side() -> None:
    """A refresh waits for one OffsetFetch round trip, not one per group: under load each wait on the
    leader's loop is a turn behind the lanes' callbacks."""
    admin = OverlapAdmin(len(GROUPS))
    reader = reader_with(admin)
    _, offsets = await reader.read()
    assert offsets == {g: dict.fromkeys(range(4), 3) for g in GROUPS}
    assert admin.most == len(GROUPS)
    assert reader.requests == 1 + 2 + len(GROUPS)  # the partitions, each coordinator, each group's offsets


async def test_offsets_read_before_the_log_became_another_are_not_given_its_name() -> None:
    """The topic is deleted and created again between a reading's offsets (the old log's: 1000) and its
    identity read after them (the new log's): the offsets must not go out as the new log's, where the
    groups have applied nothing yet. The reading is made again; the first one of a reader too."""
    admin = FakeAdmin([committed(1000)] * 4 + [committed(1000)] * 2 + [committed(0)] * 2)
    reader = reader_with(admin)
    reader._log_seen = None
    logs = iter(["cluster:old", "cluster:old", "cluster:new", "cluster:new"])

    async def log(cluster_too: bool) -> str:
        return next(logs)

    reader._read_log = log  # type: ignore[method-assign]
    reading = await reader.read_all("", operator_fields=False)
    assert reading.log == "cluster:old" and len(admin.asked) == 4, "a reader's first reading is made twice"
    reading = await reader.read_all("", operator_fields=False)
    assert reading.log == "cluster:new"
    assert reading.committed == {g: dict.fromkeys(range(4), 0) for g in GROUPS}, "the old log's offsets"
