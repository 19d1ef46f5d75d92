"""Crash the Spark pipeline, and take its database away, while it runs: nothing lost, nothing counted twice,
and at no sample is a committed offset ahead of what the stores (the APIs' data) hold.

First at the worst moment on purpose (the `after-store-write` failpoint: the store holds a batch that the
group has not committed, so the restart must publish it and change nothing), then with `kill -9` of the
process group at a random moment of a batch (the Python driver; its JVM, in a session of its own, exits
when the driver's pipe closes). Then PostgreSQL stopped and started under a running pipeline: it waits,
commits nothing meanwhile, and resumes; and a SIGTERM to the group during an outage stops it cleanly.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from aiokafka import AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from aml_app.harness.embedded_postgres import EmbeddedPostgres
from aml_app.kafka.broker import EmbeddedBroker
from aml_app.settings import Settings, WebSettings
from aml_app.tokens import bearer
from tests.harness import Names, wait_until
from tests.payments import produce_payments
from tests.pipelines import (
    PipelineProcess,
    Watch,
    check_against_reference,
    log_ends,
    merge,
    pipeline_env,
    pipeline_settings,
    python_slow_to_start_a_reader,
    wait_caught_up,
)


async def test_kill_minus_nine_mid_batch_then_restart_from_the_store(
    broker: EmbeddedBroker, names: Names, producer: AIOKafkaProducer, tmp_path: Path, store_url: str
) -> None:
    settings = pipeline_settings(broker, names, store_url, max_records_per_trigger=150)
    env = pipeline_env(broker, names, settings)
    produced = await produce_payments(producer, names.payments, 2400, seed=7)
    ends = log_ends(produced, names.partitions)
    total = sum(ends.values())
    watch = Watch(broker, names, settings)
    log = tmp_path / "pipeline.log"
    pipeline = PipelineProcess({**env, "AML_FAILPOINT": "after-store-write"}, log).start()
    rng = random.Random(7)
    try:
        assert pipeline.process is not None
        code = await asyncio.to_thread(pipeline.process.wait, 240)
        assert code == 137, f"the failpoint did not fire:\n{pipeline.log_tail()}"
        await watch.sample()
        behind = [
            g
            for g in names.deps
            if sum((await watch.committed(g)).values())
            < sum((await asyncio.to_thread(watch.stores[g].applied_offsets)).values())
        ]
        assert behind, "the crash left a store ahead of its group (the case the restart must publish)"
        pipeline = PipelineProcess(env, log).start()
        # Wait until relations has applied a little more, then kill at a random moment of a batch.
        floor = (await watch.sample())[names.deps[0]]

        async def moved() -> bool:
            assert pipeline.alive(), f"pipeline died:\n{pipeline.log_tail()}"
            return (await watch.sample())[names.deps[0]] > floor

        await wait_until(moved, 240, "the pipeline to apply a batch before the kill")
        await asyncio.sleep(rng.uniform(0.0, 0.4))
        pipeline.signal(signal.SIGKILL)
        reached = await watch.sample()
        assert reached[names.deps[0]] < total, "the crash came before the end (else it tests nothing)"
        pipeline = PipelineProcess(env, log).start()

        await wait_caught_up(pipeline, watch, ends, "after the restarts")
    finally:
        pipeline.signal(signal.SIGTERM)
        watch.close()

    assert not watch.ahead, f"committed ahead of the store: {watch.ahead[:3]}"
    assert watch.samples > 20
    await check_against_reference(settings, produced, [produced.valid])
    assert "StaleBatch" not in log.read_text(errors="replace"), "a batch was applied twice"


async def test_the_database_stopped_and_started_under_a_running_pipeline(
    broker: EmbeddedBroker,
    names: Names,
    producer: AIOKafkaProducer,
    tmp_path: Path,
    own_postgres: EmbeddedPostgres,
) -> None:
    """While PostgreSQL is down the pipeline keeps running, waits, and commits nothing new; once it is back
    everything is applied once and the groups reach the log end."""
    settings = replace(
        pipeline_settings(broker, names, own_postgres.url(), max_records_per_trigger=300),
        web=WebSettings(token=secrets.token_urlsafe(24)),
    )
    log = tmp_path / "pipeline.log"
    env = {**pipeline_env(broker, names, settings), "AML_WEB_TOKEN": settings.web.token}
    pipeline = PipelineProcess(env, log).start()
    watch = Watch(broker, names, settings)
    waves: list[Any] = []
    try:
        waves.append(await produce_payments(producer, names.payments, 600, seed=21))

        async def applied_some() -> bool:
            assert pipeline.alive(), f"pipeline died:\n{pipeline.log_tail()}"
            return min((await watch.sample()).values()) > 0

        await wait_until(applied_some, 240, "both services to apply a first batch")
        await asyncio.to_thread(own_postgres.stop)
        waves.append(await produce_payments(producer, names.payments, 600, seed=22))
        # A batch whose transaction committed just before the stop may still commit to Kafka: give it
        # a moment, then nothing may move while the database is away.
        await asyncio.sleep(2)  # a grace period for that in-flight commit, not a wait for an outcome
        frozen = {g: await watch.committed(g) for g in names.deps}
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            assert pipeline.alive(), f"the pipeline died while the database was away:\n{pipeline.log_tail()}"
            for group in names.deps:
                assert await watch.committed(group) == frozen[group], "committed while the store was down"
            await asyncio.sleep(0.5)
        assert any(
            sum(frozen[g].values()) < sum(log_ends(merge(*waves), names.partitions).values()) for g in frozen
        )
        await asyncio.to_thread(own_postgres.start)
        produced = merge(*waves)
        ends = log_ends(produced, names.partitions)

        await wait_caught_up(pipeline, watch, ends, "once the database is back")
        assert "store unavailable" in log.read_text(errors="replace"), "the pipeline noticed the outage"
        await check_against_reference(settings, produced, [w.valid for w in waves])
        await check_pipeline_metrics(settings, ends)

        # A stop asked for during an outage: the waiting batch gives up, nothing of it is committed, and
        # the pipeline exits cleanly at once, however long the database would have stayed away.
        await asyncio.to_thread(own_postgres.stop)
        waiting_before = log.read_text(errors="replace").count(WAITING_FOR_A_BATCH)
        await produce_payments(producer, names.payments, 300, seed=23)

        async def a_batch_waits() -> bool:
            assert pipeline.alive(), f"pipeline died:\n{pipeline.log_tail()}"
            return log.read_text(errors="replace").count(WAITING_FOR_A_BATCH) > waiting_before

        await wait_until(a_batch_waits, 120, "a batch to wait for the database")
        code = pipeline.stop(30)
        assert code == 0, f"SIGTERM during an outage stopped the pipeline uncleanly:\n{pipeline.log_tail()}"
        assert "pipeline stopped" in log.read_text(errors="replace")
        for group in names.deps:
            assert await watch.committed(group) == ends, "committed a batch the store did not take"
    finally:
        pipeline.signal(signal.SIGTERM)
        watch.close()
    assert not watch.ahead, f"committed ahead of the store: {watch.ahead[:3]}"


WAITING_FOR_A_BATCH = "store unavailable while applying a batch"


async def test_a_reader_that_does_not_connect_back_in_time_restarts_the_queries(
    broker: EmbeddedBroker, names: Names, producer: AIOKafkaProducer, tmp_path: Path, store_url: str
) -> None:
    """Spark fails a query whose streaming reader's Python process has not connected back within 10 s, a
    wait no setting changes. The pipeline starts its queries again where the stores stand, says so in its
    log and its metrics, and applies everything once."""
    settings = replace(
        pipeline_settings(broker, names, store_url, max_records_per_trigger=200),
        web=WebSettings(token=secrets.token_urlsafe(24)),
    )
    env = {
        **pipeline_env(broker, names, settings),
        "AML_WEB_TOKEN": settings.web.token,
        "PYSPARK_PYTHON": str(python_slow_to_start_a_reader(tmp_path)),
    }
    produced = await produce_payments(producer, names.payments, 600, seed=41)
    ends = log_ends(produced, names.partitions)
    log = tmp_path / "pipeline.log"
    pipeline = PipelineProcess(env, log).start()
    watch = Watch(broker, names, settings)
    try:
        await wait_caught_up(pipeline, watch, ends, "after the reader's failure")
        text = log.read_text(errors="replace")
        assert "Python worker failed to connect back" in text, "the reader's start did not fail"
        assert "starting the queries again where the stores stand (restart 1 of at most 3" in text
        await check_pipeline_metrics(settings, ends, restarts=1)
        assert pipeline.stop(30) == 0, pipeline.log_tail()
    finally:
        pipeline.signal(signal.SIGTERM)
        watch.close()
    assert not watch.ahead, f"committed ahead of the store: {watch.ahead[:3]}"
    await check_against_reference(settings, produced, [produced.valid])


async def check_pipeline_metrics(settings: Settings, ends: dict[int, int], restarts: int = 0) -> None:
    """The pipeline's /metrics (AML_PIPELINE_METRICS_PORT) agree with the groups: each service's committed
    offsets are the log ends, its batches hold every record, the store's time is counted, and its queries
    were started again `restarts` times. They answer only with AML_WEB_TOKEN, but /health."""
    url = f"http://127.0.0.1:{settings.pipeline.metrics_port}"
    async with aiohttp.ClientSession() as session:
        for headers in ({}, bearer("another-token-of-24-chars")):
            async with session.get(f"{url}/metrics", headers=headers) as response:
                assert response.status == 401, headers
                assert "AML_WEB_TOKEN" in (await response.json())["error"]
        async with session.get(f"{url}/health") as response:
            assert response.status == 200
        async with session.get(f"{url}/metrics", headers=bearer(settings.web.token)) as response:
            assert response.status == 200
            text = await response.text()
    samples = [
        s for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("aml_")
    ]
    for service in ("relations", "aggregates"):
        mine = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for s in samples
            if s.labels["service"] == service
        }
        committed = {
            int(dict(labels)["partition"]): value
            for (name, labels), value in mine.items()
            if name == "aml_pipeline_committed_offset"
        }
        assert committed == ends, (service, committed, ends)
        one = (("service", service),)
        assert mine[("aml_pipeline_records_total", one)] >= sum(ends.values())
        assert mine[("aml_pipeline_batches_total", one)] >= 2
        assert mine[("aml_pipeline_batch_seconds_count", one)] == mine[("aml_pipeline_batches_total", one)]
        assert mine[("aml_pipeline_phase_seconds_total", (("phase", "store"), ("service", service)))] > 0
        assert mine.get(("aml_pipeline_restarts_total", one), 0) == restarts
