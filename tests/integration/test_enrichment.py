"""The enrichment stage (`aml-app enrich`) on the real broker: payments -> payments.enriched.

A real `aml-app enrich` process derives a backlog of payments (some breaking the contract) and dies like
a kill -9 at the worst moment (`AML_FAILPOINT=enrichment-before-commit`: its first transaction's records
written, the transaction open); restarted with the same transactional id, it goes on. The derived topic
holds every valid payment, on its payee's partition, naming its source, and nothing else; the
dead-letter topic every bad record with its reason; the stage's group ends at the end of payments; and
the gate's reader, with a group that has read the whole derived topic, places that group at the end of
every payments partition.

The embedded broker hands the records of aborted transactions to read_committed readers too (Apache
Kafka does not), so a payment may appear twice here: once in the transaction the crash left open
(aborted by the restart) and once in the one that replaced it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from aml_app.enrichment import BATCH, payee_partition
from aml_app.harness.child_process import AmlAppProcess
from aml_app.harness.tails import from_the_start
from aml_app.kafka.broker import EmbeddedBroker, create_topics, free_port
from aml_app.kafka.derivation import SOURCE_HEADER
from aml_app.kafka.log_ends import fetched_log_ends
from aml_app.kafka.offsets import DependencyOffsets
from aml_app.kafka.security import PLAINTEXT
from aml_app.kafka.tools import GroupCommitter, produce
from aml_app.tokens import bearer
from tests.harness import Names, committed_offsets, ends_of, payments_for, wait_until
from tests.unit.test_stage_metrics import samples
from tests.unit.test_tokens import ask

pytestmark = pytest.mark.integration

DERIVED_PARTITIONS = 3


def stage(
    broker: EmbeddedBroker, names: Names, derived: str, workdir: Path, append: bool, **extra: str
) -> AmlAppProcess:
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        "AML_PAYMENTS_TOPIC": names.payments,
        "AML_ENRICHED_TOPIC": derived,
        "AML_DLQ_TOPIC": names.dlq,
        "AML_ENRICHMENT_GROUP": f"enrichment-{names.suffix}",
        "AML_ENRICHMENT_ID": f"enrichment-{names.suffix}-0",
        "AML_SESSION_TIMEOUT": "4",
        "AML_ENRICHMENT_METRICS_PORT": "0",
        **extra,
    }
    return AmlAppProcess(["enrich"], env, workdir / "enrich.log", workdir, append=append).start()


#: A tracing producer's header.
TRACED = [("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]


async def read_all(
    bootstrap: str, topic: str, partitions: int
) -> list[tuple[int, int, dict[str, bytes], int]]:
    """Every committed record of `topic`: (partition, offset, headers, timestamp)."""
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    client = {"bootstrap_servers": bootstrap}
    ends = await fetched_log_ends(client, {(topic, p): 0 for p in range(partitions)})
    consumer = AIOKafkaConsumer(
        **client, isolation_level="read_committed", enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    records = []
    try:
        consumer.assign(tps)
        from_the_start(consumer, tps)
        deadline = time.monotonic() + 30
        while any([await consumer.position(tp) < ends[(topic, tp.partition)] for tp in tps]):
            assert time.monotonic() < deadline, f"{topic} not read to {ends} in 30 s"
            for tp, messages in (await consumer.getmany(timeout_ms=200)).items():
                records += [(tp.partition, m.offset, dict(m.headers), m.timestamp) for m in messages]
    finally:
        await consumer.stop()
    return records


async def test_a_killed_stage_derives_every_payment_once_and_the_gate_places_its_reader(
    broker: EmbeddedBroker, names: Names, producer, tmp_path: Path
) -> None:
    derived = f"payments.enriched-{names.suffix}"
    await create_topics([broker.bootstrap], [derived], DERIVED_PARTITIONS)
    good = payments_for(names.partitions, 400, "e")
    bad = [(p, b"nobody", good[p][2]) for p in range(names.partitions)] + [(0, b"acct-0-0", b"not json")]
    # Larger than a producer sends at once: its dead letter goes in parts, or the stage stops there.
    bad.append((1, b"acct-1-0", b'{"payload": "' + b"A" * 1_500_000 + b'"}'))
    sent = good[:800] + bad + good[800:]
    placed = await produce(producer, names.payments, sent)
    # A bad record with headers of its own (a tracing producer's), which its dead letter keeps.
    traced = await (
        await producer.send(names.payments, key=b"acct-0-0", value=b"{traced", partition=0, headers=TRACED)
    )
    placed.append((traced.partition, traced.offset))
    ends = ends_of(placed)
    bad_at = set(placed[800 : 800 + len(bad)]) | {placed[-1]}
    payee_at = {
        position: json.loads(value)["payee"]
        for (_, _, value), position in zip(sent, placed[: len(sent)], strict=True)
        if position not in bad_at
    }
    group = f"enrichment-{names.suffix}"

    async def committed() -> int:
        offsets = await committed_offsets(broker.bootstrap, group, names.payments, names.partitions)
        return sum(max(o, 0) for o in offsets.values())

    async def all_of_it() -> bool:
        return await committed() == len(placed)

    first = stage(broker, names, derived, tmp_path, append=False, AML_FAILPOINT="enrichment-before-commit")
    again: AmlAppProcess | None = None
    try:
        assert first.wait(60), "the failpoint did not fire"
        assert first.returncode == 137, first.log_tail()
        assert await committed() == 0, "the open transaction's offsets were committed"
        port = free_port()
        again = stage(broker, names, derived, tmp_path, append=True, AML_ENRICHMENT_METRICS_PORT=str(port))
        await wait_until(all_of_it, 90, "the restarted stage to reach the end")
        # What it did shows on its /metrics: every valid payment derived (the killed one wrote none it
        # committed), the bad ones dead-lettered, at least one transaction, and a recent heartbeat.
        status, body = await asyncio.to_thread(
            ask, port, "/metrics", bearer(os.environ.get("AML_WEB_TOKEN", ""))
        )
        assert status == 200, body
        shown = samples(body.decode())
        assert shown["aml_enrichment_payments_derived_total"] == len(good)
        assert shown["aml_enrichment_dead_lettered_total"] == len(bad) + 1  # and the traced one
        assert shown["aml_enrichment_transactions_total"] >= 1
        assert time.time() - shown["aml_enrichment_last_progress_timestamp_seconds"] < 30
        again.signal_group(signal.SIGTERM)
        assert again.wait(20), again.log_tail()
    finally:
        first.kill()
        if again is not None:
            again.kill()

    assert await committed_offsets(broker.bootstrap, group, names.payments, names.partitions) == ends
    out = await read_all(broker.bootstrap, derived, DERIVED_PARTITIONS)
    sources = [_position(headers[SOURCE_HEADER]) for _, _, headers, _ in out]
    assert set(sources) == set(payee_at), "every valid payment, and nothing else"
    assert len(sources) - len(set(sources)) <= BATCH, "at most the one transaction the kill left open again"
    for partition, _, headers, _ in out:
        assert partition == payee_partition(payee_at[_position(headers[SOURCE_HEADER])], DERIVED_PARTITIONS)
    # Each derived record keeps its payment's record time, which C checks the payment's `ts` against as
    # every consumer of payments does: stamped with the stage's clock, C refused what A accepted.
    stamped = {(p, o): t for p, o, _, t in await read_all(broker.bootstrap, names.payments, names.partitions)}
    assert all(t == stamped[_position(h[SOURCE_HEADER])] for _, _, h, t in out)
    assert len({t for _, _, _, t in out}) > 1, "the payments were sent over more than one millisecond"
    letters = await read_all(broker.bootstrap, names.dlq, names.partitions)
    mine = [h for _, _, h, _ in letters if h.get("dlq.worker") == b"enrichment"]
    assert {(int(h["dlq.partition"]), int(h["dlq.offset"])) for h in mine} == bad_at
    assert all(h["dlq.reason"] for h in mine)
    [kept] = [h for h in mine if (int(h["dlq.partition"]), int(h["dlq.offset"])) == placed[-1]]
    assert kept["traceparent"] == dict(TRACED)["traceparent"], "the record's own headers"
    assert all(
        t == stamped[(int(h["dlq.partition"]), int(h["dlq.offset"]))] for _, _, h, t in letters if h in mine
    )

    # A group that has read the whole derived topic stands, on payments, at the end of every partition.
    reader = f"aggregates-{names.suffix}"
    derived_ends = await fetched_log_ends(
        {"bootstrap_servers": broker.bootstrap}, {(derived, d): 0 for d in range(DERIVED_PARTITIONS)}
    )
    committer = await GroupCommitter([broker.bootstrap], reader, derived).start(range(DERIVED_PARTITIONS))
    await committer.commit({d: derived_ends[(derived, d)] for d in range(DERIVED_PARTITIONS)})
    await committer.stop()
    mapped = DependencyOffsets(
        [broker.bootstrap], names.payments, [reader], security=PLAINTEXT, derived={reader: (derived, group)}
    )
    try:
        _, read = await mapped.read()
    finally:
        await mapped.close()
    assert read[reader] == ends


def _position(header: bytes) -> tuple[int, int]:
    partition, offset = header.decode().split(":")
    return int(partition), int(offset)


async def test_a_stage_without_its_derived_topic_stops_in_one_sentence(
    broker: EmbeddedBroker, names: Names, tmp_path: Path
) -> None:
    missing = f"payments.enriched-missing-{names.suffix}"
    process = stage(broker, names, missing, tmp_path, append=False)
    try:
        assert process.wait(60), process.log_tail()
    finally:
        process.kill()
    assert process.returncode == 1
    last = process.log_text().strip().splitlines()[-1]
    assert last == (
        f"aml-app enrich: the derived topic '{missing}' does not exist: create it (aml-app topics --create) "
        "or set AML_ENRICHED_TOPIC."
    ), process.log_tail()
