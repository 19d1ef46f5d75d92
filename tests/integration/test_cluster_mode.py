"""The pipeline on a Spark standalone cluster, not `local[2]`: a master and a worker started from the
PySpark wheel (tests/spark_cluster.py), `aml-app pipeline --master spark://...` as a user runs it, the
stores in PostgreSQL. The Kafka reads and the contract run in the cluster's executor, the store writes on
the driver; the stores must equal the naive reference as in local mode."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from aml_app.kafka.broker import EmbeddedBroker
from tests.harness import Names
from tests.payments import produce_payments
from tests.pipelines import (
    PipelineProcess,
    Watch,
    check_against_reference,
    log_ends,
    pipeline_env,
    pipeline_settings,
    wait_caught_up,
)
from tests.spark_cluster import StandaloneCluster


@pytest.fixture
def cluster(tmp_path: Path) -> StandaloneCluster:
    started = StandaloneCluster(tmp_path / "spark").start()
    yield started
    started.stop()


async def test_the_pipeline_on_a_standalone_cluster_equals_the_reference(
    broker: EmbeddedBroker,
    names: Names,
    producer: AIOKafkaProducer,
    store_url: str,
    tmp_path: Path,
    cluster: StandaloneCluster,
) -> None:
    settings = pipeline_settings(broker, names, store_url, max_records_per_trigger=1000)
    produced = await produce_payments(producer, names.payments, 1500, seed=41)
    ends = log_ends(produced, names.partitions)
    env = {**pipeline_env(broker, names, settings), "AML_SPARK_MASTER": cluster.master}
    pipeline = PipelineProcess(env, tmp_path / "pipeline.log").start()
    watch = Watch(broker, names, settings)
    try:
        await wait_caught_up(pipeline, watch, ends, "on the cluster")
        state = await asyncio.to_thread(cluster.state)
        apps = state.get("activeapps", [])
        assert [a["name"] for a in apps] == ["aml-pipeline"], state
        assert apps[0]["cores"] >= 1, "the application got the worker's cores"
    finally:
        pipeline.signal(signal.SIGTERM, wait=60)
        watch.close()
    assert not watch.ahead, f"committed ahead of the store: {watch.ahead[:3]}"
    await check_against_reference(settings, produced, [produced.valid])
    log = (tmp_path / "pipeline.log").read_text(errors="replace")
    assert f"on {cluster.master}" in log, "the pipeline ran on the cluster's master"
