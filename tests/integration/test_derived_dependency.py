"""A dependency group that reads a topic derived from payments, against the real broker and a real worker.

The test plays the derivation stage (filtering, splitting, merging, repartitioning, restarting and
writing records again, each record naming its payments in `aml-source` headers, sent in batches) and
the dependency group reading the derived topic; it commits both groups by hand, round after round. The
gate's reader (`DependencyOffsets` with `derived`) must give, on every payments partition, exactly the
first payment the group has not applied; the group's own offsets on the derived topic, read as the gate
reads a group of `payments`, must not.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka import derived as derived_reader
from aml_app.kafka.broker import EmbeddedBroker, TopicSpec, create_topics
from aml_app.kafka.derivation import SOURCE_HEADER
from aml_app.kafka.identity import LogIdentities
from aml_app.kafka.offsets import DependencyOffsets, OffsetReadError
from aml_app.kafka.security import PLAINTEXT
from aml_app.kafka.tools import GroupCommitter, produce
from tests.derivation import DERIVED, PAYMENTS, Stage, truth
from tests.harness import ends_of, payments_for, wait_until

pytestmark = pytest.mark.integration


async def test_a_derived_groups_position_is_the_first_payment_it_has_not_applied(
    broker: EmbeddedBroker,
) -> None:
    suffix = uuid.uuid4().hex[:8]
    payments, derived = f"payments-{suffix}", f"payments.enriched-{suffix}"
    stage_group, group = f"enrichment-{suffix}", f"aggregates-{suffix}"
    bootstrap = [broker.bootstrap]
    await create_topics(bootstrap, [payments], len(PAYMENTS))
    await create_topics(bootstrap, [derived], len(DERIVED))
    rng = random.Random(5)
    stage = Stage(rng, dict.fromkeys(PAYMENTS, 40))
    # Lingering puts several records in one batch, where the embedded broker's ListOffsets is short.
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=20)
    await producer.start()
    stage_commits = await GroupCommitter(bootstrap, stage_group, payments).start(PAYMENTS)
    group_commits = await GroupCommitter(bootstrap, group, derived).start(DERIVED)
    mapped = DependencyOffsets(
        bootstrap, payments, [group], security=PLAINTEXT, derived={group: (derived, stage_group)}
    )
    naive = DependencyOffsets(bootstrap, derived, [group], security=PLAINTEXT)
    written = dict.fromkeys(DERIVED, 0)
    group_committed = dict.fromkeys(DERIVED, 0)
    early = 0
    try:
        for _ in range(10):
            for _ in range(rng.randint(10, 40)):
                stage.step()
            sends = []
            for d in DERIVED:
                for record in stage.derived[d][written[d] :]:
                    headers = [(SOURCE_HEADER, f"{p}:{o}".encode()) for p, o in record]
                    sends.append(await producer.send(derived, b"{}", partition=d, headers=headers))
                written[d] = len(stage.derived[d])
            await asyncio.gather(*sends)  # the stage commits only what is written
            committed_by_stage = dict(stage.committed)
            await stage_commits.commit(committed_by_stage)
            group_committed = {d: rng.randint(group_committed[d], written[d]) for d in DERIVED}
            await group_commits.commit(group_committed)

            _, read = await mapped.read()
            expected = truth(stage, committed_by_stage, group_committed)
            assert read[group] == expected, (group_committed, committed_by_stage)

            _, on_derived = await naive.read()
            early += any((on_derived[group].get(p) or 0) > expected[p] for p in PAYMENTS)
        assert sum(written.values()) > 100
        assert early > 0, "the scenario never shows what a naive reading gets wrong"
        # Each derived record was read at most once (none the group had applied before it was read), not
        # once per refresh.
        assert 0 < mapped.derived_records_read <= sum(written.values())

        # A record that names no payment stops the mapping with one sentence, and the reading with it.
        await producer.send_and_wait(derived, b"{}", partition=0)
        await group_commits.commit({0: written[0]})
        refused = rf"offset {written[0]} of {derived}\[0\] has no aml-source header"
        with pytest.raises(OffsetReadError, match=refused):
            await mapped.read()
    finally:
        await mapped.close()
        await naive.close()
        await stage_commits.stop()
        await group_commits.stop()
        await producer.stop()


async def test_a_compacted_derived_topic_is_refused_with_one_sentence(broker: EmbeddedBroker) -> None:
    suffix = uuid.uuid4().hex[:8]
    payments, derived = f"payments-{suffix}", f"payments.latest-{suffix}"
    bootstrap = [broker.bootstrap]
    await create_topics(bootstrap, [payments], len(PAYMENTS))
    await create_topics(bootstrap, [TopicSpec(derived, len(DERIVED), 1, {"cleanup.policy": "compact"})])
    mapped = DependencyOffsets(
        bootstrap, payments, ["g"], security=PLAINTEXT, derived={"g": (derived, f"stage-{suffix}")}
    )
    try:
        with pytest.raises(OffsetReadError, match=rf"'{derived}' is compacted \(cleanup.policy=compact\)"):
            await mapped.read()
    finally:
        await mapped.close()


Records = dict[int, list[list[tuple[int, int]]]]


def derive(ends: dict[int, int], rng: random.Random) -> Records:
    """A stage's records per derived partition: payments filtered (1 in 6), split across both partitions
    (1 in 5), merged in pairs (1 in 6), the rest repartitioned by another key; interleaved across the
    payments partitions, each in order."""
    derived: Records = {d: [] for d in DERIVED}
    cursors = dict.fromkeys(ends, 0)
    merging: list[tuple[int, int]] = []
    while any(cursors[p] < ends[p] for p in ends):
        p = rng.choice([q for q in ends if cursors[q] < ends[q]])
        payment = (p, cursors[p])
        cursors[p] += 1
        roll = rng.random()
        if roll < 1 / 6:
            continue
        merging.append(payment)
        if roll < 2 / 6 and len(merging) < 2:
            continue
        for d in DERIVED if roll > 0.8 else [rng.choice(DERIVED)]:
            derived[d].append(list(merging))
        merging = []
    if merging:
        derived[0].append(merging)
    return derived


def applied(
    derived: dict[int, list[list[tuple[int, int]]]], stage: dict[int, int], group: dict[int, int]
) -> dict[int, int]:
    """Per payments partition, the first payment the derived group has not applied (brute force)."""
    pending = {x for d, records in derived.items() for o, r in enumerate(records) if o >= group[d] for x in r}
    first = {}
    for p, s in stage.items():
        o = 0
        while o < s and (p, o) not in pending:
            o += 1
        first[p] = o
    return first


@pytest.mark.parametrize("mapping", ["derived", "derived-event-time", "naive"])
async def test_no_payment_is_decided_before_the_stage_and_the_derived_group_applied_it(
    broker, names, producer, new_worker, deps, decision_log, mapping
):
    """The gate waits for B on payments and for C on a derived topic, whose offsets it maps; the naive
    set-up, which waits for the stage instead of C, decides payments C has not applied."""
    relations, aggregates = names.deps
    derived_topic, stage_group = f"payments.enriched-{names.suffix}", f"enrichment-{names.suffix}"
    bootstrap = [broker.bootstrap]
    await create_topics(bootstrap, [derived_topic], len(DERIVED))
    rng = random.Random(17)
    placed = await produce(producer, names.payments, payments_for(names.partitions, 8, "d"))
    ends = ends_of(placed)
    derived = derive(ends, rng)
    for d in DERIVED:  # written before the stage commits anything
        for record in derived[d]:
            headers = [(SOURCE_HEADER, f"{p}:{o}".encode()) for p, o in record]
            await producer.send_and_wait(derived_topic, b"{}", partition=d, headers=headers)
    env = (
        {"AML_DERIVED_DEPENDENCIES": f"{aggregates}:{derived_topic}:{stage_group}"}
        if mapping.startswith("derived")
        else {"AML_DEPENDS_ON": f"{relations},{stage_group}"}
    )
    if mapping == "derived-event-time":  # the cut reads the payment at each mapped position on payments
        env["AML_GATE_MODE"] = "event-time"
    worker = new_worker(**env)
    await worker.wait_ready(set(range(names.partitions)))
    stage = await GroupCommitter(bootstrap, stage_group, names.payments).start(range(names.partitions))
    group = await GroupCommitter(bootstrap, aggregates, derived_topic).start(DERIVED)
    timeline = CommitTimeline()
    stage_at, group_at = dict.fromkeys(ends, 0), dict.fromkeys(DERIVED, 0)

    def record_applied() -> None:
        for p, offset in applied(derived, stage_at, group_at).items():
            timeline.record(aggregates, p, offset)

    try:
        # B and the stage run ahead; C follows on the derived topic in random steps.
        steps = [("relations", p) for p in ends for _ in range(3)] + [
            ("stage", p) for p in ends for _ in range(3)
        ]
        rng.shuffle(steps)
        steps += [("wait", 0)] + [("group", d) for d in DERIVED for _ in range(6)]
        for kind, where in steps:
            if kind == "wait":
                if mapping == "naive":  # its first decisions come before C applied anything: see them
                    await wait_until(decision_log.poll, 30, "a decision of the naive set-up")
                continue
            if kind == "relations":
                offset = min(ends[where], timeline.committed(relations).get(where, 0) + rng.randint(1, 4))
                timeline.record(relations, where, offset)
                await deps[relations].commit({where: offset})
            elif kind == "stage":
                stage_at[where] = min(ends[where], stage_at[where] + rng.randint(1, 4))
                record_applied()
                timeline.record(stage_group, where, stage_at[where])
                await stage.commit({where: stage_at[where]})
            else:
                group_at[where] = min(len(derived[where]), group_at[where] + rng.randint(1, 4))
                record_applied()
                await group.commit({where: group_at[where]})
            if rng.random() < 0.3:
                await decision_log.poll(timeout=0.3)
        for p in ends:  # everything applied, by everyone
            timeline.record(relations, p, ends[p])
            timeline.record(stage_group, p, ends[p])
            await deps[relations].commit({p: ends[p]})
        stage_at, group_at = dict(ends), {d: len(derived[d]) for d in DERIVED}
        record_applied()
        await stage.commit(stage_at)
        await group.commit(group_at)

        await decision_log.wait_for(set(placed), timeout=60)
        made = decision_log.decisions()
        early = premature(made, (relations, aggregates), timeline)
        if mapping.startswith("derived"):
            assert early == []
            event_time = mapping == "derived-event-time"
            assert all((d.get("cut") is not None) == event_time for d in made), "the gate mode ran"
            assert len({d["payment_id"] for d in made}) == len(placed)
        else:
            assert premature(made, (relations, stage_group), timeline) == []
            assert early, "the naive set-up decided nothing before C applied it: the scenario shows nothing"
    finally:
        await stage.stop()
        await group.stop()


async def test_records_retention_deleted_before_the_group_read_them_are_refused(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded broker deletes no records (it has neither retention by time nor DeleteRecords), so
    the derived topic's log start is faked at the one call that reads it."""
    suffix = uuid.uuid4().hex[:8]
    payments, derived = f"payments-{suffix}", f"payments.enriched-{suffix}"
    bootstrap = [broker.bootstrap]
    await create_topics(bootstrap, [payments], len(PAYMENTS))
    await create_topics(bootstrap, [derived], len(DERIVED))

    async def gone_below_3(self: AIOKafkaConsumer, partitions: list[TopicPartition]) -> dict:
        return {tp: 3 if tp.topic == derived and tp.partition == 0 else 0 for tp in partitions}

    monkeypatch.setattr(AIOKafkaConsumer, "beginning_offsets", gone_below_3)
    mapped = DependencyOffsets(
        bootstrap, payments, ["g"], security=PLAINTEXT, derived={"g": (derived, f"stage-{suffix}")}
    )
    try:
        with pytest.raises(
            OffsetReadError, match=rf"never committed on {derived}\[0\], whose records below 3"
        ):
            await mapped.read()
    finally:
        await mapped.close()


async def test_a_coordinator_answering_without_the_derived_partitions_is_asked_again(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A moved or loading coordinator answers OffsetFetch without partitions (aiokafka hides the error);
    the embedded broker, one node, never does, so its one answer is faked: not read as a group that never
    committed (which would put it back at the topic's start), but an error, and the next read goes on."""
    suffix = uuid.uuid4().hex[:8]
    payments, derived = f"payments-{suffix}", f"payments.enriched-{suffix}"
    bootstrap = [broker.bootstrap]
    await create_topics(bootstrap, [payments], len(PAYMENTS))
    await create_topics(bootstrap, [derived], len(DERIVED))
    stage = await GroupCommitter(bootstrap, f"stage-{suffix}", payments).start(PAYMENTS)
    await stage.commit(dict.fromkeys(PAYMENTS, 4))
    await stage.stop()
    real = AIOKafkaAdminClient.list_consumer_group_offsets
    calls = {"derived": 0}

    async def moved_once(self: AIOKafkaAdminClient, group: str, **kwargs: object) -> dict:
        answer = await real(self, group, **kwargs)  # type: ignore[arg-type]
        if any(tp.topic == derived for tp in answer) and not calls["derived"]:
            calls["derived"] += 1
            return {}
        return answer

    monkeypatch.setattr(AIOKafkaAdminClient, "list_consumer_group_offsets", moved_once)
    mapped = DependencyOffsets(
        bootstrap, payments, ["g"], security=PLAINTEXT, derived={"g": (derived, f"stage-{suffix}")}
    )
    try:
        with pytest.raises(OffsetReadError, match=rf"answered without partitions 0-1 of '{derived}'"):
            await mapped.read()
        _, read = await mapped.read()
        assert read["g"] == dict.fromkeys(PAYMENTS, 4)  # nothing derived, nothing pending: S(p)
    finally:
        await mapped.close()


async def test_a_partition_added_to_the_derived_topic_holds_the_payments_written_there(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage writes to a partition of the derived topic added after the gate first mapped it: the
    record there names a payment below the stage's offsets that the group has not applied, so it holds W
    on its payments partition as a record on the first partition does. The embedded broker cannot add
    partitions (no CreatePartitions), so the topic has two from the start and the one call that
    describes it shows only the first until the test adds the second."""
    suffix = uuid.uuid4().hex[:8]
    payments, derived_topic = f"payments-{suffix}", f"payments.enriched-{suffix}"
    stage_group, group = f"enrichment-{suffix}", f"aggregates-{suffix}"
    bootstrap = [broker.bootstrap]
    await create_topics(bootstrap, [payments], len(PAYMENTS))
    await create_topics(bootstrap, [derived_topic], 2)
    visible = {"partitions": 1}
    described = derived_reader._partitions_of

    async def growing(admin: AIOKafkaAdminClient, topic: str) -> list[int]:
        return (await described(admin, topic))[: visible["partitions"]]

    monkeypatch.setattr(derived_reader, "_partitions_of", growing)
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap)
    await producer.start()

    async def write(partition: int, payment: tuple[int, int]) -> None:
        header = (SOURCE_HEADER, f"{payment[0]}:{payment[1]}".encode())
        await producer.send_and_wait(derived_topic, b"{}", partition=partition, headers=[header])

    stage = await GroupCommitter(bootstrap, stage_group, payments).start(PAYMENTS)
    applier = await GroupCommitter(bootstrap, group, derived_topic).start([0])
    mapped = DependencyOffsets(
        bootstrap, payments, [group], security=PLAINTEXT, derived={group: (derived_topic, stage_group)}
    )
    try:
        await write(0, (0, 0))
        await stage.commit(dict.fromkeys(PAYMENTS, 1))
        await applier.commit({0: 1})
        _, read = await mapped.read()
        assert read[group] == dict.fromkeys(PAYMENTS, 1)

        visible["partitions"] = 2  # the topic grows
        await write(1, (1, 1))  # payment (1, 1) goes to the new partition; the group has not read it
        await stage.commit(dict.fromkeys(PAYMENTS, 3))
        _, read = await mapped.read()
        assert read[group] == {0: 3, 1: 1, 2: 3}, "payment (1, 1) passed before the group applied it"
    finally:
        await mapped.close()
        await stage.stop()
        await applier.stop()
        await producer.stop()


async def test_the_derived_topics_log_is_read_with_the_payments_topics_and_checked(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded broker cannot delete a topic and create it again, so the one call that says which
    log a topic is answers with another topic id for the derived topic from the second `read` on."""
    suffix = uuid.uuid4().hex[:8]
    payments, derived_topic = f"payments-{suffix}", f"payments.enriched-{suffix}"
    bootstrap = [broker.bootstrap]
    await create_topics(bootstrap, [payments], len(PAYMENTS))
    await create_topics(bootstrap, [derived_topic], len(DERIVED))
    real, readings = LogIdentities.read_all, []

    def recreated_at_the_second(self: LogIdentities, topics: list[str], cluster_too: bool = True) -> dict:
        logs = real(self, topics, cluster_too)
        readings.append(topics)
        if len(readings) >= 3:  # a reader's first reading is made twice (DependencyOffsets.read_all)
            logs[derived_topic] += "-created-again"
        return logs

    monkeypatch.setattr(LogIdentities, "read_all", recreated_at_the_second)
    mapped = DependencyOffsets(
        bootstrap, payments, ["g"], security=PLAINTEXT, derived={"g": (derived_topic, f"stage-{suffix}")}
    )
    try:
        await mapped.read()
        with pytest.raises(OffsetReadError, match=rf"'{derived_topic}' was created again"):
            await mapped.read()
        await mapped.read()
        assert readings == [[payments, derived_topic]] * 4, "one request describes both topics"
    finally:
        await mapped.close()


async def test_reading_a_topic_that_does_not_exist_creates_none(broker: EmbeddedBroker) -> None:
    """A metadata request that names a topic lets a broker create it (Kafka does where
    auto.create.topics.enable is on, the embedded broker always): a worker started before `payments` was
    created, or after a derived topic was deleted, would make the topic itself, with the broker's
    default partition count, and gate on an empty log."""
    suffix = uuid.uuid4().hex[:8]
    payments, derived = f"payments-{suffix}", f"payments.enriched-{suffix}"
    bootstrap = [broker.bootstrap]
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    missing = DependencyOffsets(bootstrap, payments, ["g"], security=PLAINTEXT)
    mapped = DependencyOffsets(
        bootstrap, payments, ["g"], security=PLAINTEXT, derived={"g": (derived, f"stage-{suffix}")}
    )
    try:
        with pytest.raises(OffsetReadError, match=rf"topic '{payments}' does not exist \(yet\)"):
            await missing.read()
        assert payments not in await admin.list_topics()

        await create_topics(bootstrap, [payments], len(PAYMENTS))
        await create_topics(bootstrap, [derived], len(DERIVED))
        await mapped.read()  # the derived topic's configuration is checked once, here
        await admin.delete_topics([derived])
        await wait_until(lambda: _absent(admin, derived), 10, f"{derived} deleted")
        with pytest.raises(OffsetReadError, match=rf"topic '{derived}' does not exist \(yet\)"):
            await mapped.read()
        assert derived not in await admin.list_topics()
    finally:
        await missing.close()
        await mapped.close()
        await admin.close()


async def _absent(admin: AIOKafkaAdminClient, topic: str) -> bool:
    return topic not in await admin.list_topics()
