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
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from aiokafka import AIOKafkaProducer

from aml_app.dependencies import aggregates, relations
from aml_app.dependencies.api import aggregates_app, relations_app
from aml_app.dependencies.store import Reader
from aml_app.kafka.broker import EmbeddedBroker
from aml_app.kafka.tools import payment_json, produce
from aml_app.pipeline import jobs, kafka_source
from aml_app.pipeline.progress import GroupProgress
from aml_app.pipeline.runner import kafka_config
from tests.harness import Names, ends_of, read_records
from tests.payments import FUTURE, NUL_PAYEE, produce_payments
from tests.pipelines import Running, check_against_reference, log_ends, merge, pipeline_settings
from tests.stores import relations_answers


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


@pytest.fixture(params=["written in turn", "overlapped"])
def overlap(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every batch is written before the next is computed (small batches), or every batch's writes
    overlap the next batch's Spark work (as a catch-up's large batches do)."""
    if request.param == "overlapped":
        monkeypatch.setattr(jobs, "OVERLAP_FROM_RECORDS", 1)
    return request.param


async def test_stores_equal_the_reference_and_bad_payments_are_dead_lettered(
    run_pipeline: Any, names: Names, producer: AIOKafkaProducer, broker: EmbeddedBroker, overlap: str
) -> None:
    """Two waves with out-of-order event times and malformed records (a payment stamped in 2099 among them),
    under a read limit."""
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

    letters = await read_records(broker.bootstrap, names.dlq, names.partitions, 2 * len(produced.malformed))
    everything = len(produced.valid) + len(produced.malformed)
    sent_at = {
        (r.partition, r.offset): r.timestamp
        for r in await read_records(broker.bootstrap, names.payments, names.partitions, everything)
    }
    by_service: dict[str, set[tuple[int, int, bytes]]] = {}
    for record in letters:
        headers = {k: v.decode() for k, v in record.headers}
        assert headers["dlq.reason"], "every dead letter says why"
        # The Python contract's reason: Spark and Python agree (given the record's timestamp too).
        assert headers["dlq.reason"] != jobs.DISAGREEMENT
        if record.value == FUTURE:
            assert "2099-01-01T00:00:00Z is more than the allowed clock skew of 5 s" in headers["dlq.reason"]
        if record.value == NUL_PAYEE:
            assert "field 'payee' holds a NUL character" in headers["dlq.reason"]
        place = (int(headers["dlq.partition"]), int(headers["dlq.offset"]), record.value)
        assert record.timestamp == sent_at[place[:2]], "the record's own time"
        by_service.setdefault(headers["dlq.worker"], set()).add(place)
    assert by_service == {g: set(produced.malformed) for g in names.deps}, "original bytes, each service"
    assert {FUTURE, NUL_PAYEE} <= {value for _, _, value in produced.malformed}


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
    before = await relations_answers(settings.dependencies.store_url, [("acct-1", 3, relations.PARTS)])
    running.stop()

    config = kafka_config(settings)
    for group in names.deps:
        reset = GroupProgress(config, names.payments, group)
        reset.commit(dict.fromkeys(range(names.partitions), 0))
        reset.close()
    again = Running(spark, settings)
    try:
        await again.caught_up(ends)
        assert (
            await relations_answers(settings.dependencies.store_url, [("acct-1", 3, relations.PARTS)])
            == before
        )
        await check_against_reference(settings, produced, [produced.valid])
        with again.lock:
            assert sum(r.records for r in again.reports) == 0, "nothing was read again"
    finally:
        again.stop()


async def test_commits_are_never_ahead_of_the_api_and_reach_the_log_end_when_idle(
    run_pipeline: Any, names: Names, producer: AIOKafkaProducer, overlap: str
) -> None:
    running = run_pipeline(max_records_per_trigger=300)
    settings = running.settings
    servers = {
        names.deps[0]: TestServer(relations_app(Reader(settings.dependencies.store_url, relations.SCHEMA))),
        names.deps[1]: TestServer(
            aggregates_app(Reader(settings.dependencies.store_url, aggregates.SCHEMA), settings)
        ),
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


async def test_an_idle_pipeline_rides_out_a_broker_frozen_past_the_planners_timeout(
    run_pipeline: Any, broker: EmbeddedBroker, names: Names, producer: AIOKafkaProducer
) -> None:
    """The broker frozen (SIGSTOP) while the topic is idle, longer than a plan waits for the cluster's
    metadata: the planner plans nothing until the broker answers again and the queries go on. Spark stops
    a query whose planner raises, and the pipeline exits with it (the chaos soak's 15 s freeze)."""
    running = run_pipeline()
    first = await produce_payments(producer, names.payments, 40, seed=21, malformed_every=0)
    await running.caught_up(log_ends(first, names.partitions))
    broker.pause()
    try:
        # The fault's length, not a wait for a condition: an idle query plans every trigger, so a plan
        # is under way when the freeze begins or starts within the trigger interval, and waits it out.
        await asyncio.sleep(kafka_source.METADATA_TIMEOUT + 3)
    finally:
        broker.resume()
    assert running.failure() is None, running.failure()
    second = await produce_payments(producer, names.payments, 40, seed=22, malformed_every=0)
    await running.caught_up(log_ends(merge(first, second), names.partitions))


def test_spark_real_time_mode_refuses_the_python_kafka_source_and_foreach_batch(
    spark: Any, broker: EmbeddedBroker, names: Names, tmp_path: Any
) -> None:
    """Why the pipeline runs micro-batches: Spark's real-time mode (`trigger(realTime=...)`, Spark 4.1+)
    reads only sources written for it in the JVM, and writes only to allow-listed sinks. It stops a query
    on this source (a Python data source) and refuses `foreachBatch`, the sink that writes each batch to
    the stores before committing. If a Spark release lifts either, this test fails: time to measure it."""
    stream = (
        spark.readStream.format("aml-kafka")
        .option("kafka.bootstrap.servers", broker.bootstrap)
        .option("subscribe", names.payments)
        .load()
    )
    query = (
        stream.writeStream.format("console")
        .outputMode("update")
        .option("checkpointLocation", str(tmp_path / "source"))
        .trigger(realTime="5 seconds")
        .start()
    )
    try:
        with pytest.raises(Exception, match="INPUT_STREAM_NOT_SUPPORTED") as stopped:
            query.awaitTermination(60)
        assert "PythonMicroBatchStream" in str(stopped.value)
    finally:
        query.stop()
    with pytest.raises(Exception, match=r"OPERATOR_OR_SINK_NOT_IN_ALLOWLIST.*ForeachBatchSink"):
        spark.readStream.format("rate").load().writeStream.foreachBatch(lambda frame, batch: None).option(
            "checkpointLocation", str(tmp_path / "sink")
        ).outputMode("update").trigger(realTime="5 seconds").start()


async def test_a_payment_too_large_for_one_record_holds_neither_dependency(
    run_pipeline: Any, names: Names, producer: AIOKafkaProducer, broker: EmbeddedBroker
) -> None:
    """1.5 MB on partition 0 between valid payments: both groups commit past it, and each dead-letters
    it in parts that join into its bytes."""
    huge = b'{"payload": "' + b"A" * 1_500_000 + b'"}'
    records = [(0, b"acct-1", payment_json("before", "acct-1", "acct-2", "1.00", "2026-11-20T10:15:00Z"))]
    records.append((0, b"acct-1", huge))
    records += [
        (p, b"acct-1", payment_json(f"after-{p}", "acct-1", "acct-2", "2.00", "2026-11-20T10:16:00Z"))
        for p in range(names.partitions)
    ]
    placed = await produce(producer, names.payments, records)
    running = run_pipeline()
    await running.caught_up({p: ends_of(placed).get(p, 0) for p in range(names.partitions)})
    parts = await read_records(broker.bootstrap, names.dlq, names.partitions, 6)
    joined: dict[str, list[tuple[int, bytes]]] = {}
    for record in parts:
        headers = {k: v.decode() for k, v in record.headers}
        assert (headers["dlq.partition"], headers["dlq.offset"]) == ("0", str(placed[1][1]))
        joined.setdefault(headers["dlq.worker"], []).append((int(headers["dlq.part"][0]), record.value))
    assert sorted(joined) == sorted(names.deps)
    assert all(b"".join(v for _, v in sorted(p)) == huge for p in joined.values())
