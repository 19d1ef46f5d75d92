"""Services B and C on real Spark (one local[2] session for the module), a real broker and real
PostgreSQL.

What must hold: the stores equal an independent computation over the same payments; a restart resumes
from the store (not from the group) and counts nothing twice; bad payments are dead-lettered and block
nothing; a committed offset is never ahead of what the API answers; after the last payment the committed
offsets reach the log end while the topic is idle (Spark's own `commit(end)` would leave the last batch
uncommitted).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from aml_app.broker import EmbeddedBroker
from aml_app.pipeline.jobs import BatchReport
from aml_app.pipeline.progress import GroupProgress
from aml_app.pipeline.runner import Pipeline, kafka_config, spark_session, start_pipeline
from aml_app.services import aggregates, relations
from aml_app.services.api import aggregates_app, relations_app
from aml_app.services.store import Reader
from aml_app.settings import Settings
from tests.harness import Names, wait_until
from tests.payments import Produced, produce_payments
from tests.reference import exact_from, reference_aggregates, reference_relations
from tests.stores import aggregates_answers, relations_answers, without_as_of

CATCH_UP = 120.0  # seconds for a pipeline to catch up with a few thousand payments on 2 busy cores


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session("local[2]")
    yield session
    session.stop()


def pipeline_settings(broker: EmbeddedBroker, names: Names, store_url: str, **overrides: Any) -> Settings:
    relations_group, aggregates_group = names.deps
    return replace(
        Settings(),
        bootstrap_servers=(broker.bootstrap,),
        payments_topic=names.payments,
        dlq_topic=names.dlq,
        relations_group=relations_group,
        aggregates_group=aggregates_group,
        store_url=store_url,
        trigger_interval=0.2,
        **overrides,
    )


class Running:
    """A started pipeline plus what a test needs to watch it."""

    def __init__(self, spark: Any, settings: Settings) -> None:
        self.settings = settings
        self.reports: list[BatchReport] = []
        self.lock = threading.Lock()
        self.stopped = False
        self.pipeline: Pipeline = start_pipeline(spark, settings, on_batch=self._record)
        config = kafka_config(settings)
        self.progress = {
            g: GroupProgress(config, settings.payments_topic, g)
            for g in (settings.relations_group, settings.aggregates_group)
        }

    def _record(self, report: BatchReport) -> None:
        with self.lock:
            self.reports.append(report)

    def failure(self) -> str | None:
        for query in self.pipeline.queries:
            if not query.isActive:
                return f"query {query.name} stopped: {query.exception()}"
        return None

    async def committed(self, partitions: range) -> dict[str, dict[int, int]]:
        return {g: await asyncio.to_thread(p.committed, partitions) for g, p in self.progress.items()}

    async def caught_up(self, ends: dict[int, int], timeout: float = CATCH_UP) -> None:
        async def done() -> bool:
            failure = self.failure()
            assert failure is None, failure
            committed = await self.committed(range(len(ends)))
            return all(c == ends for c in committed.values())

        await wait_until(done, timeout, f"both groups to commit up to the log end {ends}", interval=0.2)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.pipeline.stop()
        for progress in self.progress.values():
            progress.close()


@pytest.fixture
def run_pipeline(spark: Any, broker: EmbeddedBroker, names: Names, store_url: str) -> Iterator[Any]:
    started: list[Running] = []

    def start(**overrides: Any) -> Running:
        running = Running(spark, pipeline_settings(broker, names, store_url, **overrides))
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


def log_ends(produced: Produced, partitions: int) -> dict[int, int]:
    ends = dict.fromkeys(range(partitions), 0)
    for p, o in [(r.partition, r.offset) for r in produced.valid] + [
        (p, o) for p, o, _ in produced.malformed
    ]:
        ends[p] = max(ends[p], o + 1)
    return ends


def merge(*batches: Produced) -> Produced:
    return Produced([r for b in batches for r in b.valid], [m for b in batches for m in b.malformed])


async def check_against_reference(settings: Settings, produced: Produced, batches: list[list[Any]]) -> None:
    """Every account's answers from both stores equal the naive reference, at instants across the windows."""
    start = exact_from(batches)
    assert start is not None
    instants = [start + timedelta(hours=h) for h in (0, 0.5, 1, 23.9, 24, 30)] + [
        r.ts for r in produced.valid[:20] if r.ts >= start
    ]
    accounts = [*produced.accounts, "acct-unknown"]
    for hops in (1, 2, 3):
        answers = await relations_answers(settings.store_url, [(a, hops, relations.PARTS) for a in accounts])
        for account, answer in zip(accounts, answers, strict=True):
            assert without_as_of(answer) == reference_relations(produced.valid, account, hops), (
                account,
                hops,
            )
    for at in instants:
        answers = await aggregates_answers(settings.store_url, [(a, at) for a in accounts], settings)
        for account, answer in zip(accounts, answers, strict=True):
            expected = reference_aggregates(
                batches, account, at, settings.reporting_threshold, settings.threshold_band
            )
            assert without_as_of(answer) == expected, (account, at)


async def dead_letters(broker: EmbeddedBroker, topic: str, expected: int) -> list[Any]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    records: list[Any] = []
    try:

        async def enough() -> bool:
            batch = await consumer.getmany(timeout_ms=200)
            records.extend(r for rs in batch.values() for r in rs)
            return len(records) >= expected

        await wait_until(enough, 60, f"{expected} dead letters on {topic}", interval=0)
    finally:
        await consumer.stop()
    return records


async def test_stores_equal_the_reference_and_bad_payments_are_dead_lettered(
    run_pipeline: Any, names: Names, producer: AIOKafkaProducer, broker: EmbeddedBroker
) -> None:
    """Two waves with out-of-order event times and malformed records, under a read limit."""
    running = run_pipeline(max_records_per_trigger=400)
    first = await produce_payments(producer, names.payments, 1500, seed=1)
    await running.caught_up(log_ends(first, names.partitions))
    # The second wave arrives later but its event times reach back up to 6 days: late, inside the horizon.
    second = await produce_payments(producer, names.payments, 1000, seed=2, spread=timedelta(days=7))
    produced = merge(first, second)
    await running.caught_up(log_ends(produced, names.partitions))

    await check_against_reference(running.settings, produced, [first.valid, second.valid])
    with running.lock:
        reports = list(running.reports)
    for service in ("relations", "aggregates"):
        mine = [r for r in reports if r.service == service]
        assert sum(r.records for r in mine) == len(produced.valid) + len(produced.malformed)
        assert sum(r.dead_lettered for r in mine) == len(produced.malformed)
        assert max(r.records for r in mine) <= 400, "the read limit bounds every micro-batch"

    letters = await dead_letters(broker, names.dlq, 2 * len(produced.malformed))
    by_service: dict[str, set[tuple[int, int, bytes]]] = {}
    for record in letters:
        headers = {k: v.decode() for k, v in record.headers}
        assert headers["dlq.reason"], "every dead letter says why"
        place = (int(headers["dlq.partition"]), int(headers["dlq.offset"]), record.value)
        by_service.setdefault(headers["dlq.worker"], set()).add(place)
    assert by_service == {g: set(produced.malformed) for g in names.deps}, "original bytes, each service"


async def test_a_restart_resumes_from_the_store_not_from_the_group(
    spark: Any, run_pipeline: Any, names: Names, producer: AIOKafkaProducer
) -> None:
    """The groups reset to the start would make any Kafka consumer read everything again; the pipeline
    starts where its stores left off, counts nothing twice, and moves the groups back to the log end."""
    running = run_pipeline()
    produced = await produce_payments(producer, names.payments, 600, seed=3)
    ends = log_ends(produced, names.partitions)
    await running.caught_up(ends)
    settings = running.settings
    before = await relations_answers(settings.store_url, [("acct-1", 3, relations.PARTS)])
    running.stop()

    config = kafka_config(settings)
    for group in names.deps:
        reset = GroupProgress(config, names.payments, group)
        reset.commit(dict.fromkeys(range(names.partitions), 0))
        reset.close()
    again = Running(spark, settings)
    try:
        await again.caught_up(ends)
        assert await relations_answers(settings.store_url, [("acct-1", 3, relations.PARTS)]) == before
        await check_against_reference(settings, produced, [produced.valid])
        with again.lock:
            assert sum(r.records for r in again.reports) == 0, "nothing was read again"
    finally:
        again.stop()


async def test_commits_are_never_ahead_of_the_api_and_reach_the_log_end_when_idle(
    run_pipeline: Any, names: Names, producer: AIOKafkaProducer
) -> None:
    running = run_pipeline(max_records_per_trigger=300)
    settings = running.settings
    servers = {
        names.deps[0]: TestServer(relations_app(Reader(settings.store_url, relations.SCHEMA))),
        names.deps[1]: TestServer(aggregates_app(Reader(settings.store_url, aggregates.SCHEMA), settings)),
    }
    for server in servers.values():
        await server.start_server()
    samples: list[tuple[str, dict[int, int], dict[int, int]]] = []
    stop = asyncio.Event()

    async def sample(http: ClientSession) -> None:
        while not stop.is_set():
            # Committed first, then as_of: as_of only grows, so committed <= as_of must hold.
            committed = await running.committed(range(names.partitions))
            for group, server in servers.items():
                async with http.get(server.make_url("/health")) as response:
                    as_of = {int(p): o for p, o in (await response.json())["as_of"].items()}
                samples.append((group, committed[group], as_of))

    try:
        async with ClientSession() as http:
            sampler = asyncio.create_task(sample(http))
            waves = [
                await produce_payments(producer, names.payments, 300, seed=10 + i, malformed_every=0)
                for i in range(5)
            ]
            await running.caught_up(log_ends(merge(*waves), names.partitions))
            stop.set()
            await sampler
    finally:
        for server in servers.values():
            await server.close()

    ahead = [(g, c, a) for g, c, a in samples if any(o > a.get(p, 0) for p, o in c.items())]
    assert not ahead, f"committed ahead of as_of: {ahead[:3]}"
    moving = {tuple(sorted(c.items())) for _g, c, _a in samples}
    assert len(moving) > 3, "the sampler saw the commits move while payments flowed"
