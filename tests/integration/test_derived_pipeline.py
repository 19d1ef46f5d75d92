"""Service C reading a topic derived from payments, in the real Spark pipeline, on the real broker.

A stage that restarts writes again what it wrote since its last commit (at-least-once; on a broker that
hands aborted transactions' records to read_committed readers, the embedded one, a transactional stage
too). The derived topic here is written as such a stage writes it: every payment on its payee's partition
with `aml-source`, and a stretch of it written a second time. C on that topic must answer exactly what C
on payments answers, account by account, at instants across its windows; its store and its group are of
the derived topic. The negative control skips no copy, and its answers differ.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiokafka import AIOKafkaProducer

from aml_app.dependencies.api import build_app
from aml_app.enrichment import payee_partition
from aml_app.harness.embedded_postgres import EmbeddedPostgres
from aml_app.kafka.broker import EmbeddedBroker, create_topics
from aml_app.kafka.derivation import SOURCE_HEADER
from aml_app.kafka.tools import payment_json, produce
from aml_app.pipeline import transforms
from aml_app.pipeline.progress import GroupProgress
from aml_app.pipeline.runner import kafka_config, start_pipeline
from aml_app.settings import Settings
from tests.harness import Names, ends_of, wait_until
from tests.integration.test_services_api import wait_for_check
from tests.pipelines import CATCH_UP, pipeline_settings
from tests.stores import aggregates_answers, without_as_of

pytestmark = pytest.mark.integration

DERIVED_PARTITIONS = 3
START = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)


def meta(url: str, schema: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        return dict(conn.execute(f"SELECT key, value FROM {schema}.meta").fetchall())


def payments(count: int, seed: int) -> list[tuple[int, bytes, bytes]]:
    """Payments among a few accounts over two days, amounts varied, on their payer's partition (the
    account's number modulo 4: every partition gets payers, in every interpreter)."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        payer, payee = rng.sample([f"acct-{n}" for n in range(12)], 2)
        at = START + timedelta(minutes=rng.randint(0, 2 * 24 * 60))
        amount = f"{rng.randint(100, 1_500_000) / 100:.2f}"
        value = payment_json(f"d-{seed}-{i}", payer, payee, amount, at.isoformat().replace("+00:00", "Z"))
        records.append((int(payer.removeprefix("acct-")) % 4, payer.encode(), value))
    return records


async def derive(
    bootstrap: str, topic: str, sent: list[tuple[int, bytes, bytes]], placed: list[tuple[int, int]]
) -> tuple[int, dict[int, int]]:
    """Write `topic` as a stage does, writing a middle stretch a second time (a restart); the records
    written and the topic's ends."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    copies = range(len(sent) // 3, len(sent) // 2)
    order = [*range(len(sent) // 2), *copies, *range(len(sent) // 2, len(sent))]
    ends = dict.fromkeys(range(DERIVED_PARTITIONS), 0)
    try:
        for i in order:
            _, key, value = sent[i]
            p, o = placed[i]
            d = payee_partition(json.loads(value)["payee"], DERIVED_PARTITIONS)
            headers = [(SOURCE_HEADER, f"{p}:{o}".encode())]
            sent_to = await producer.send_and_wait(topic, key=key, value=value, partition=d, headers=headers)
            ends[d] = max(ends[d], sent_to.offset + 1)
    finally:
        await producer.stop()
    return len(order), ends


async def run_c(spark: Any, settings: Settings, topic: str, want: dict[int, int], group: str) -> None:
    """C alone, until its group has committed `topic` up to `want`."""
    running = await asyncio.to_thread(start_pipeline, spark, settings, ["aggregates"])
    progress = GroupProgress(kafka_config(settings), topic, group)
    try:

        async def done() -> bool:
            failure = running.failure()
            assert failure is None, failure
            return await asyncio.to_thread(progress.committed, sorted(want)) == want

        await wait_until(done, CATCH_UP, f"{group} to commit {topic} up to {want}", interval=0.2)
    finally:
        await asyncio.to_thread(running.stop)
        progress.close()


@pytest.mark.parametrize("skip", [True, False], ids=["skips-copies", "naive-control"])
async def test_c_on_the_derived_topic_answers_as_c_on_payments(
    spark: Any,
    broker: EmbeddedBroker,
    names: Names,
    producer: Any,
    postgres: EmbeddedPostgres,
    store_url: str,
    monkeypatch: pytest.MonkeyPatch,
    skip: bool,
) -> None:
    derived = f"payments.enriched-{names.suffix}"
    await create_topics([broker.bootstrap], [derived], DERIVED_PARTITIONS)
    sent = payments(600, seed=7)
    placed = await produce(producer, names.payments, sent)
    written, derived_ends = await derive(broker.bootstrap, derived, sent, placed)
    assert written > len(sent), "the derived topic holds copies"

    direct_url = postgres.create_database(f"{store_url.rsplit('/', 1)[1]}_direct")
    direct = pipeline_settings(broker, names, direct_url)
    await run_c(spark, direct, names.payments, ends_of(placed), direct.aggregates_group)

    stage_group = f"enrichment-{names.suffix}"
    reader = replace(
        pipeline_settings(broker, names, store_url),
        derived_dependencies={direct.aggregates_group: (derived, stage_group)},
    )
    if not skip:
        monkeypatch.setattr(transforms, "find_repeats", lambda p, o, s, seen: (p < 0, {}))
    await run_c(spark, reader, derived, derived_ends, reader.aggregates_group)
    recorded = meta(store_url, "aggregates")
    assert recorded["topic"] == derived

    accounts = [f"acct-{n}" for n in range(12)]
    instants = [START + timedelta(hours=h) for h in (0.5, 6, 24, 30, 47, 49, 72)]
    mismatched = []
    for at in instants:
        queries = [(account, at) for account in accounts]
        want = await aggregates_answers(direct_url, queries, direct)
        got = await aggregates_answers(store_url, queries, reader)
        mismatched += [
            (account, at)
            for account, a, b in zip(accounts, want, got, strict=True)
            if without_as_of(a) != without_as_of(b)
        ]
    if skip:
        assert mismatched == []
        highest: dict[str, int] = {}
        for (_, _, value), (p, o) in zip(sent, placed, strict=True):
            pair = f"{payee_partition(json.loads(value)['payee'], DERIVED_PARTITIONS)}:{p}"
            highest[pair] = max(highest.get(pair, -1), o)
        assert json.loads(recorded["sources"]) == highest

        # C's API checks its store against C's group on the derived topic: a store that lost its
        # offsets there is behind it (on payments, where C's group commits nothing, it never would be).
        checked = replace(reader, kafka=replace(reader.kafka, bootstrap_servers=(broker.bootstrap,)))
        async with TestClient(TestServer(build_app("aggregates", checked), host="127.0.0.1")) as client:
            health = await wait_for_check(client, "ok")
            assert health["as_of"] == {str(d): o for d, o in derived_ends.items()}
            with psycopg.connect(store_url, autocommit=True) as conn:
                conn.execute("DELETE FROM aggregates.applied_offsets")
            health = await wait_for_check(client, "behind", timeout=60)
            assert "aml-app rebuild aggregates" in health["store_check"]["problem"]
    else:
        assert mismatched, "counting the copies changes C's answers"
