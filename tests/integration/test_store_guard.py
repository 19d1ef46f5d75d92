"""The store-loss guard and the rebuild, through the commands a person runs.

A store that lost its history (here: its tables dropped while the groups have committed offsets) must
never be trusted again silently: `aml-app pipeline` refuses to start with one sentence saying what to do,
the API reports itself unhealthy and answers nothing, and `aml-app rebuild` replays the topic into a fresh
store that then equals the naive reference, after which everything is healthy again. The rebuild's first
streaming reader starts too late for Spark, which fails its query: the replay starts again.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
from aiohttp.test_utils import TestClient, TestServer
from aiokafka import AIOKafkaProducer

from aml_app.dependencies.api import build_app
from aml_app.harness.child_process import aml_app_executable
from aml_app.kafka.broker import EmbeddedBroker
from aml_app.settings import Settings
from tests.harness import Names
from tests.integration.test_services_api import wait_for_check
from tests.payments import produce_payments
from tests.pipelines import (
    Running,
    check_against_reference,
    log_ends,
    pipeline_settings,
    python_slow_to_start_a_reader,
)


def command(
    settings: Settings, *args: str, timeout: float = 300, **extra: str
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": ",".join(settings.kafka.bootstrap_servers),
        "AML_PAYMENTS_TOPIC": settings.kafka.payments_topic,
        "AML_DLQ_TOPIC": settings.kafka.dlq_topic,
        "AML_RELATIONS_GROUP": settings.relations_group,
        "AML_AGGREGATES_GROUP": settings.aggregates_group,
        "AML_STORE_URL": settings.dependencies.store_url,
        "AML_TRIGGER_INTERVAL": "0.2",
        "AML_PIPELINE_METRICS_PORT": "0",  # no /metrics: another process may hold the default port
        "PYSPARK_SUBMIT_ARGS": "--conf spark.ui.showConsoleProgress=false pyspark-shell",
        **extra,
    }
    return subprocess.run(
        [aml_app_executable(), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


async def test_a_lost_store_is_refused_reported_and_rebuilt(
    spark: Any,
    broker: EmbeddedBroker,
    names: Names,
    producer: AIOKafkaProducer,
    store_url: str,
    tmp_path: Path,
) -> None:
    settings = pipeline_settings(broker, names, store_url, max_records_per_trigger=500)
    produced = await produce_payments(producer, names.payments, 900, seed=31)
    ends = log_ends(produced, names.partitions)
    running = Running(spark, settings)
    try:
        await running.caught_up(ends)
    finally:
        running.stop()

    with psycopg.connect(store_url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA relations CASCADE")  # the disk that held it is gone

    refused = await asyncio.to_thread(command, settings, "pipeline", timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    sentence = refused.stderr.strip().splitlines()[-1]
    assert sentence.startswith("aml-app pipeline: the relations store is behind its consumer group"), sentence
    assert "aml-app rebuild relations" in sentence and "AML_STORE_URL" in sentence

    checked = replace(settings, kafka=replace(settings.kafka, bootstrap_servers=(broker.bootstrap,)))
    async with TestClient(TestServer(build_app("relations", checked), host="127.0.0.1")) as client:
        health = await wait_for_check(client, "behind")
        assert "aml-app rebuild relations" in health["store_check"]["problem"]
        assert (await client.get("/relations/acct-1")).status == 503

        started = time.monotonic()
        # Its first streaming reader starts after Spark's 10 s wait: the replay starts again, from the start.
        slow = str(python_slow_to_start_a_reader(tmp_path))
        rebuilt = await asyncio.to_thread(
            command, settings, "rebuild", "relations", "--yes", timeout=400, PYSPARK_PYTHON=slow
        )
        assert rebuilt.returncode == 0, rebuilt.stdout[-3000:] + rebuilt.stderr[-3000:]
        assert "the relations store is rebuilt" in rebuilt.stdout
        assert "starting the queries again where the stores stand (restart 1" in rebuilt.stderr
        assert time.monotonic() - started < 400
        await wait_for_check(client, "ok")
        assert (await client.get("/relations/acct-1")).status == 200

    await check_against_reference(settings, produced, [produced.valid])
    # The aggregates store was never lost: the rebuild left it alone; and the pipeline starts again.
    again = Running(spark, settings)
    try:
        await again.caught_up(ends)
        with again.lock:
            assert sum(r.records for r in again.reports) == 0
    finally:
        again.stop()


def test_rebuild_asks_before_dropping_a_store() -> None:
    answered = subprocess.run(
        [aml_app_executable(), "rebuild", "relations"],
        input="n\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert answered.returncode == 1 and "Aborted" in answered.stderr
    assert "Drop the relations store at" in answered.stdout
