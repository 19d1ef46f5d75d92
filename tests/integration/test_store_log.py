"""Services B and C carry the identity of the Kafka log their offsets are of (`aml_app.kafka.identity`).

On the embedded broker (which reports topic ids; a topic deleted and created again gets a new one) and
PostgreSQL: a store records the log it is built from and is refused once the topic is another log, until
it is rebuilt; a store from before logs were recorded takes the current one only when it passes the
other checks; every answer of the APIs carries the store's log; the planner stops at once when the topic
it reads is created again under it; and a Spark query whose topic is not the stores' log stops with the
sentence, which the pipeline reports (and exits 1 with).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from aiohttp.test_utils import TestClient, TestServer
from confluent_kafka.admin import AdminClient, NewTopic
from pyspark.sql.streaming.datasource import ReadAllAvailable

from aml_app.dependencies import aggregates, relations
from aml_app.dependencies.api import build_app
from aml_app.dependencies.store import Writer, redacted
from aml_app.kafka.broker import EmbeddedBroker
from aml_app.kafka.identity import log_identity
from aml_app.pipeline import kafka_source, runner
from aml_app.pipeline.kafka_source import LOG_CHECK_INTERVAL, KafkaStreamReader, LogChanged
from aml_app.pipeline.runner import StoreRefused, kafka_config, prepare, start_queries
from aml_app.settings import Settings
from tests.harness import Names, wait_until
from tests.pipelines import pipeline_settings

pytestmark = pytest.mark.integration

TIMEOUT = 30.0


def recreate(bootstrap: str, topic: str, partitions: int) -> None:
    """Delete `topic` and create it again with as many partitions (a new log under the same name)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics([topic], operation_timeout=TIMEOUT).values():
        future.result(TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while True:
        futures = admin.create_topics([NewTopic(topic, partitions, 1)], operation_timeout=TIMEOUT)
        try:
            futures[topic].result(TIMEOUT)
            return
        except Exception:  # still being deleted: ask again until the deadline
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def recreate_or_create(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)], operation_timeout=TIMEOUT)[topic].result(TIMEOUT)


def meta(url: str, schema: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        return dict(conn.execute(f"SELECT key, value FROM {schema}.meta").fetchall())


def opened(settings: Settings, services: list[str], rebuild: bool = False) -> runner.Pipeline:
    """`prepare` (no Spark), its stores, groups and producers closed again at once."""
    pipeline = prepare(settings, services, rebuild=rebuild)
    pipeline.stop()
    return pipeline


def hold(settings: Settings, service: str, offsets: dict[int, int]) -> None:
    """Make the store hold offsets 0..o-1 of each partition (no rows: the offsets are what matters)."""
    schema = relations.SCHEMA if service == "relations" else aggregates.SCHEMA
    writer = Writer(settings.dependencies.store_url, schema)
    try:
        writer.apply({p: (0, o) for p, o in offsets.items()}, lambda conn: None)
    finally:
        writer.close()


async def test_a_store_of_another_log_is_refused_until_rebuilt(
    broker: EmbeddedBroker, names: Names, store_url: str
) -> None:
    settings = pipeline_settings(broker, names, store_url)
    config = kafka_config(settings)
    first = await asyncio.to_thread(log_identity, config, names.payments)
    pipeline = await asyncio.to_thread(opened, settings, ["relations", "aggregates"])
    assert pipeline.logs == {names.payments: first}
    for schema in ("relations", "aggregates"):
        recorded = meta(store_url, schema)
        assert (recorded["topic"], recorded["log"]) == (names.payments, first)
    await asyncio.to_thread(recreate, broker.bootstrap, names.payments, names.partitions)
    second = await asyncio.to_thread(log_identity, config, names.payments)
    assert second != first

    with pytest.raises(StoreRefused) as refused:
        await asyncio.to_thread(prepare, settings, ["relations"])
    assert str(refused.value) == (
        f"the relations store at {redacted(store_url)} was built from log {first} of topic "
        f"{names.payments}, but {names.payments} is now log {second} (the topic was deleted and created "
        f"again, or the cluster changed): rebuild it (aml-app rebuild relations), or point AML_STORE_URL "
        "at this log's store"
    )
    assert meta(store_url, "relations")["log"] == first, "a refused store records nothing"

    rebuilt = await asyncio.to_thread(opened, settings, ["relations"], True)
    assert rebuilt.logs == {names.payments: second} and meta(store_url, "relations")["log"] == second
    await asyncio.to_thread(opened, settings, ["relations"])  # accepted from now on
    # The store that was not rebuilt is still refused.
    with pytest.raises(StoreRefused, match=r"^the aggregates store at .* was built from log "):
        await asyncio.to_thread(prepare, settings, ["aggregates"])


async def test_a_derived_topics_records_retention_deleted_before_the_store_read_them_refuse_it(
    broker: EmbeddedBroker, names: Names, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started at the log start, the group would commit past records that name payments still to decide,
    none of them in the store; on payments such records only warn (no worker can read them either).
    The embedded broker deletes no records: the log start is moved at the seam that reads it."""
    derived = f"payments.enriched-{names.suffix}"
    await asyncio.to_thread(recreate_or_create, broker.bootstrap, derived, names.partitions)
    direct = pipeline_settings(broker, names, store_url)
    settings = replace(
        direct, derived_dependencies={direct.aggregates_group: (derived, f"stage-{names.suffix}")}
    )
    await asyncio.to_thread(opened, settings, ["aggregates", "relations"])
    hold(settings, "aggregates", {0: 3})
    hold(settings, "relations", {0: 3})
    real = kafka_source.log_bounds
    monkeypatch.setattr(
        kafka_source,
        "log_bounds",
        lambda config, topic: {p: (5, 10) if p == 0 else b for p, b in real(config, topic).items()},
    )
    with pytest.raises(StoreRefused) as refused:
        await asyncio.to_thread(prepare, settings, ["aggregates"])
    assert str(refused.value).startswith(
        f"offsets 3..4 of partition 0 of topic {derived} were deleted by retention before aggregates "
        "read them"
    )
    await asyncio.to_thread(opened, settings, ["relations"])  # payments: a warning, as before


async def test_a_store_without_a_log_takes_the_current_one_only_when_accepted(
    broker: EmbeddedBroker, names: Names, store_url: str
) -> None:
    settings = pipeline_settings(broker, names, store_url)
    config = kafka_config(settings)
    await asyncio.to_thread(opened, settings, ["relations"])
    with psycopg.connect(store_url) as conn:
        conn.execute("DELETE FROM relations.meta WHERE key = 'log'")  # a store from before logs were kept
    await asyncio.to_thread(opened, settings, ["relations"])
    assert meta(store_url, "relations")["log"] == await asyncio.to_thread(
        log_identity, config, names.payments
    )

    # Such a store of a topic since deleted and created again is refused as ahead of the new log, and
    # does not take the new log's identity on the way.
    with psycopg.connect(store_url) as conn:
        conn.execute("DELETE FROM relations.meta WHERE key = 'log'")
    hold(settings, "relations", {0: 3})
    await asyncio.to_thread(recreate, broker.bootstrap, names.payments, names.partitions)
    with pytest.raises(StoreRefused, match="the topic was deleted and re-created"):
        await asyncio.to_thread(prepare, settings, ["relations"])
    assert "log" not in meta(store_url, "relations")


async def test_every_answer_carries_the_log_of_its_store(
    broker: EmbeddedBroker, names: Names, store_url: str
) -> None:
    settings = pipeline_settings(broker, names, store_url)
    await asyncio.to_thread(opened, settings, ["relations", "aggregates"])
    hold(settings, "relations", {0: 3, 1: 1})
    hold(settings, "aggregates", {0: 2})
    for kind, as_of in (("relations", {"0": 3, "1": 1}), ("aggregates", {"0": 2})):
        log = meta(store_url, kind)["log"]
        assert log == await asyncio.to_thread(log_identity, kafka_config(settings), names.payments)
        async with TestClient(TestServer(build_app(kind, settings, check=False), host="127.0.0.1")) as client:
            single = await (await client.get(f"/{kind}/A")).json()
            batch = await (
                await client.post(f"/{kind}", json={"queries": [{"account": "A"}, {"account": "B"}]})
            ).json()
            health = await (await client.get("/health")).json()
        for answer in [single, *batch["answers"], health]:
            assert answer["as_of"] == as_of and answer["log"] == log, (kind, answer)


async def test_the_planner_stops_at_once_when_its_topic_is_created_again(
    broker: EmbeddedBroker, names: Names, store_url: str
) -> None:
    """A plan that finds a partition ending below where the query stands asks which log the topic is
    without waiting for LOG_CHECK_INTERVAL, and stops before planning the new log's records."""
    settings = pipeline_settings(broker, names, store_url)
    config = kafka_config(settings)
    first = await asyncio.to_thread(log_identity, config, names.payments)
    reader = KafkaStreamReader(
        {
            "kafka.bootstrap.servers": broker.bootstrap,
            "subscribe": names.payments,
            "log": first,
            "services": "relations,aggregates",
            "store": redacted(store_url),
        }
    )
    try:
        start = await asyncio.to_thread(reader.initialOffset)
        assert await asyncio.to_thread(reader.latestOffset, start, ReadAllAvailable()) == start
        asked_at = reader._log_checked_at
        standing = {**start, "0": 5}  # where a query that read five records of partition 0 stands
        await asyncio.to_thread(recreate, broker.bootstrap, names.payments, names.partitions)
        second = await asyncio.to_thread(log_identity, config, names.payments)
        with pytest.raises(LogChanged) as stopped:
            await asyncio.to_thread(reader.latestOffset, standing, ReadAllAvailable())
        assert reader.clock() - asked_at < LOG_CHECK_INTERVAL, "the check waited for its interval"
        assert str(stopped.value).startswith(
            f"the relations and aggregates stores at {redacted(store_url)} were built from log {first} of "
            f"topic {names.payments}, but {names.payments} is now log {second} "
        )
    finally:
        reader.stop()


class SparkLeftRunning:
    """`_run_until_stopped` stops Spark last; the module's session stays for its fixture to stop."""

    def stop(self) -> None:
        pass


async def test_a_query_on_another_log_stops_with_the_sentence(
    spark: Any, broker: EmbeddedBroker, names: Names, store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = pipeline_settings(broker, names, store_url, trigger_interval=0.2)
    pipeline = await asyncio.to_thread(prepare, settings)
    # The stores are of log `old`; the topic, by the time the query starts, is another one.
    current = pipeline.logs[names.payments]
    old = pipeline.logs[names.payments] = "tansu_cluster:AAAAAAAAAAAAAAAAAAAAAQ"
    stopped = False
    try:
        await asyncio.to_thread(start_queries, spark, settings, pipeline)
        failure = await wait_until(pipeline.failure, 120, "the query to stop", interval=0.2)
        assert failure == (
            f"the relations and aggregates stores at {redacted(store_url)} were built from log "
            f"{old} of topic {names.payments}, but {names.payments} is now log {current} (the "
            "topic was deleted and created again, or the cluster changed): rebuild them (aml-app rebuild "
            "relations, aml-app rebuild aggregates), or point AML_STORE_URL at this log's stores"
        )
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            with caplog.at_level(logging.ERROR, logger="aml_app.pipeline"):
                stopped = True  # it stops the pipeline, whatever it returns
                assert runner._run_until_stopped(SparkLeftRunning(), pipeline) == 1
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        assert f"pipeline failed: {failure}" in caplog.messages
    finally:
        if not stopped:
            pipeline.stop()
