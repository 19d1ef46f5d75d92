"""The gate's reader of a derived topic, at the seam where the embedded broker cannot play the log.

Records that retention deleted past where the bookkeeping has read stop the mapping; they are never
skipped. The bookkeeping reads each partition of the derived topic D from where it last read. When
retention has deleted records from there on before they were read, aiokafka answers the fetch by
resetting its position as `auto_offset_reset` says, and its default is "latest": the reader would find
the partition at its end with nothing pending, and the payments in the deleted records (which the group
never read either, since its offset is below them) would pass the gate. The embedded broker deletes no
records, so a consumer that resets as aiokafka does sits at the reader's seam.

A reader that replaces another (the leader gives up clients that overran a refresh) goes on from what
the other has read, instead of reading the group's whole lag on D again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
from aiokafka.errors import OffsetOutOfRangeError

from aml_app.kafka import derived
from aml_app.kafka.derivation import SOURCE_HEADER, DerivationError
from aml_app.kafka.derived import DerivedTopic
from aml_app.kafka.offsets import DependencyOffsets
from aml_app.kafka.security import PLAINTEXT

TOPIC = "payments.enriched"


class Record:
    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.headers = [(SOURCE_HEADER, f"0:{offset}".encode())]  # record o comes from payment (0, o)


class Log:
    """The one partition of D: records `start`..`end - 1`, record o naming payment (0, o)."""

    start, end = 0, 5


class ResettingConsumer:
    """An `AIOKafkaConsumer` over `Log` that, like aiokafka, answers a fetch below the log start by
    resetting the position as `auto_offset_reset` says ("none": the fetch raises)."""

    def __init__(self, *args: Any, auto_offset_reset: str = "latest", **kwargs: Any) -> None:
        self.reset = auto_offset_reset
        self.at: dict[Any, int] = {}

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def assign(self, tps: list[Any]) -> None:
        self.at = dict.fromkeys(tps, 0)

    def pause(self, *tps: Any) -> None:
        pass

    def resume(self, *tps: Any) -> None:
        pass

    def seek(self, tp: Any, offset: int) -> None:
        self.at[tp] = offset

    async def end_offsets(self, tps: list[Any]) -> dict[Any, int]:
        return dict.fromkeys(tps, Log.end)

    async def beginning_offsets(self, tps: list[Any]) -> dict[Any, int]:
        return dict.fromkeys(tps, Log.start)

    async def position(self, tp: Any) -> int:
        return self.at[tp]

    def highwater(self, tp: Any) -> int:
        return Log.end

    async def getmany(self, tp: Any, timeout_ms: int = 0, max_records: int = 1) -> dict[Any, list[Record]]:
        if self.at[tp] < Log.start:
            if self.reset == "none":
                raise OffsetOutOfRangeError({tp: self.at[tp]})
            self.at[tp] = Log.start if self.reset == "earliest" else Log.end
        records = [Record(o) for o in range(self.at[tp], Log.end)][:max_records]
        self.at[tp] = Log.end
        return {tp: records} if records else {}


async def _one_partition(admin: Any, topic: str) -> list[int]:
    return [0]


async def _not_compacted(admin: Any, topic: str) -> None:
    pass


@contextmanager
def one_partition_of_d() -> Iterator[None]:
    """D is `Log`, read through `ResettingConsumer`."""
    with (
        mock.patch.object(derived, "AIOKafkaConsumer", ResettingConsumer),
        mock.patch.object(derived, "_partitions_of", _one_partition),
        mock.patch.object(derived, "_refuse_compacted", _not_compacted),
    ):
        yield


async def test_records_deleted_past_where_the_reader_stands_stop_the_mapping() -> None:
    Log.start, Log.end = 0, 5
    reader = DerivedTopic(TOPIC, "aggregates", "enrichment", {}, request_timeout=1.0)

    with one_partition_of_d():
        await reader.partitions(admin=None)  # type: ignore[arg-type]
        # The stage derived payments 0..4 (records 0..4) and the group applied them: W = S.
        assert await reader.positions([0], {0: 5}, {0: 5}) == {0: 5}
        # Records 5..9 are written (payments 5..9) and the stage commits 20; retention deletes up to
        # offset 8 before the gate or the group read them. The group has applied none of them.
        Log.start, Log.end = 8, 10
        with pytest.raises(
            DerivationError, match=r"committed 5 on payments\.enriched\[0\], but .* 5 to 8 are gone"
        ):
            await reader.positions([0], {0: 20}, {0: 5})
        # Once the group has committed past the deleted records, the mapping goes on from there.
        assert await reader.positions([0], {0: 20}, {0: 10}) == {0: 20}
    await reader.close()


async def test_a_reader_that_replaces_another_goes_on_from_what_it_read() -> None:
    Log.start, Log.end = 0, 5
    group = "aggregates"

    def offsets() -> DependencyOffsets:
        return DependencyOffsets(
            ["127.0.0.1:9"], "payments", [group], security=PLAINTEXT, derived={group: (TOPIC, "enrichment")}
        )

    old, new = offsets(), offsets()
    with one_partition_of_d():
        before = old._derived[group]
        await before.partitions(admin=None)  # type: ignore[arg-type]
        # The group has applied nothing: records 0..4 (payments 0..4) are pending.
        assert await before.positions([0], {0: 5}, {0: 0}) == {0: 0}
        assert old.derived_records_read == 5
        new.carry_over(old)  # the old reader's clients overran a refresh
        Log.end = 7
        after = new._derived[group]
        await after.partitions(admin=None)  # type: ignore[arg-type]
        assert await after.positions([0], {0: 7}, {0: 1}) == {0: 1}
        assert new.derived_records_read == 7, "the new reader read the group's lag on D again"
        await old.close()
        await new.close()


async def test_a_metadata_answer_that_misses_a_known_partition_does_not_drop_its_pending_records() -> None:
    """Brokers update their metadata apart: right after partitions are added to D, one broker can
    describe them and the next refresh's broker not yet. Partitions never leave a topic, so the ones
    known stay read; left out, a pending record there would no longer hold W."""
    Log.start, Log.end = 0, 5
    reader = DerivedTopic(TOPIC, "aggregates", "enrichment", {}, request_timeout=1.0)
    answers = [[0, 1], [0]]

    async def lagging(admin: Any, topic: str) -> list[int]:
        return answers.pop(0)

    with one_partition_of_d(), mock.patch.object(derived, "_partitions_of", lagging):
        await reader.partitions(admin=None)  # type: ignore[arg-type]
        # D[1]'s records name payments (0, 0..4), none applied by the group: W(0) = 0.
        assert await reader.positions([0], {0: 5}, {0: 5, 1: 0}) == {0: 0}
        assert await reader.partitions(admin=None) == [0, 1]  # type: ignore[arg-type]
        assert await reader.positions([0], {0: 5}, {0: 5, 1: 0}) == {0: 0}
    await reader.close()


async def test_a_derived_topic_created_again_is_read_again_from_the_groups_offsets() -> None:
    """The pending records are facts about one log. Read on as if the topic created again under the
    same name were the old one, the reader would go on from where it stood in the old log and skip the
    new log's records below it."""
    Log.start, Log.end = 0, 5
    reader = DerivedTopic(TOPIC, "aggregates", "enrichment", {}, request_timeout=1.0)
    with one_partition_of_d():
        await reader.partitions(admin=None)  # type: ignore[arg-type]
        assert await reader.positions([0], {0: 5}, {0: 5}) == {0: 5}
        reader.check_log("cluster:old-id")
        # D is deleted and created again; the stage writes records 0..7 (payments (0, 0..7)) and the
        # group applies two of them before the gate's next refresh.
        Log.end = 8
        await reader.partitions(admin=None)  # type: ignore[arg-type]
        await reader.positions([0], {0: 10}, {0: 2})  # read as the old log: records 2..4 skipped
        with pytest.raises(DerivationError, match=r"'payments\.enriched' was created again"):
            reader.check_log("cluster:new-id")
        await reader.partitions(admin=None)  # type: ignore[arg-type]
        assert await reader.positions([0], {0: 10}, {0: 2}) == {0: 2}, "payments (0, 2..4) passed"
        reader.check_log("cluster:new-id")
    await reader.close()


async def test_records_read_by_the_gate_not_the_group_refuse_the_mapping_once_deleted() -> None:
    """D[0] holds 0..9 (payments 0..9 of partition 0), read by the gate while G stands at 0; retention
    deletes 0..4. G's consumer would go on from 5 and commit 10 past payments 0..4 it never applied:
    the mapping is refused as it is for records nobody read (it went on, and W(0) became 10)."""
    with one_partition_of_d():
        Log.start, Log.end = 0, 10
        reader = DerivedTopic(TOPIC, "aggregates", "enrichment", {}, 1.0)
        await reader.partitions(admin=None)
        assert await reader.positions([0], {0: 10}, {0: 0}) == {0: 0}
        Log.start = 5
        with pytest.raises(
            DerivationError, match=r"committed 0 on .*\[0\], but the records from 0 to 5 are gone"
        ):
            await reader.positions([0], {0: 10}, {0: 0})


class _Configs:
    """An admin that answers DescribeConfigs with one resource: (error code, message, type, name, entries)."""

    def __init__(self, code: int, entries: list[tuple[Any, ...]]) -> None:
        self.code, self.entries = code, entries

    async def describe_configs(self, resources: list[Any]) -> list[Any]:
        message = "denied" if self.code else None
        return [mock.Mock(resources=[(self.code, message, 2, TOPIC, self.entries)])]


@pytest.mark.parametrize(
    ("code", "named"), [(29, "TopicAuthorizationFailedError"), (3, "UnknownTopicOrPartitionError")]
)
async def test_a_topic_whose_configuration_cannot_be_read_is_not_taken_for_uncompacted(
    code: int, named: str
) -> None:
    """A broker that will not describe the topic answers no entries: it passed as "not compacted" and was
    never asked again, so a compacted D could be mapped."""
    with pytest.raises(DerivationError, match=rf"cannot read 'payments\.enriched'.*: {named} \(denied\)"):
        await derived._refuse_compacted(_Configs(code, []), TOPIC)  # type: ignore[arg-type]
    compacted = [("cleanup.policy", "compact", False, 5, False)]
    with pytest.raises(DerivationError, match="is compacted"):
        await derived._refuse_compacted(_Configs(0, compacted), TOPIC)  # type: ignore[arg-type]
    await derived._refuse_compacted(_Configs(0, [("cleanup.policy", "delete", False, 5, False)]), TOPIC)  # type: ignore[arg-type]
