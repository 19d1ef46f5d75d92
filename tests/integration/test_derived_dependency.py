"""A dependency group that reads a topic derived from payments, against the real broker.

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
from aiokafka import AIOKafkaProducer

from aml_app.kafka.broker import EmbeddedBroker, create_topics
from aml_app.kafka.derivation import SOURCE_HEADER
from aml_app.kafka.offsets import DependencyOffsets, OffsetReadError
from aml_app.kafka.security import PLAINTEXT
from aml_app.kafka.tools import GroupCommitter
from tests.derivation import DERIVED, PAYMENTS, Stage, truth

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
