"""`aml-app topics --create` on the embedded broker: creates what is missing, keeps what exists, refuses a
replication factor the cluster cannot hold with one sentence."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from aml_app.harness.child_process import aml_app_executable
from aml_app.kafka.broker import EmbeddedBroker

pytestmark = pytest.mark.integration


def topics(broker: EmbeddedBroker, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [aml_app_executable(), "topics", *args],
        env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def fresh_names(suffix: str) -> dict[str, str]:
    """This worker's topics under names of their own (the other service's keep their defaults)."""
    names = ("payments", "dlq", "decisions", "alerts", "review", "enriched")
    return {f"AML_{name.upper()}_TOPIC": f"{name}-{suffix}" for name in names}


async def test_create_makes_the_missing_topics_with_their_partitions(broker: EmbeddedBroker) -> None:
    suffix = uuid.uuid4().hex[:8]
    env = {**fresh_names(suffix), "AML_PARTITIONS": "3"}
    listed = topics(broker, **env)
    assert listed.returncode == 0, listed.stderr
    assert f"payments-{suffix}" in listed.stdout and "cleanup.policy=compact" in listed.stdout

    first = topics(broker, "--create", **env)
    assert first.returncode == 0, first.stderr
    mine = [f"payments-{suffix}", f"dlq-{suffix}", f"decisions-{suffix}", f"alerts-{suffix}"]
    for name in mine:
        assert f"created  {name}" in first.stdout
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        described = {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(mine)}
    finally:
        await admin.close()
    assert described == dict.fromkeys(mine, 3)

    again = topics(broker, "--create", **{**env, "AML_PARTITIONS": "5"})
    assert again.returncode == 0, again.stderr
    assert f"exists   payments-{suffix} with 3 partitions, not 5; left as it is" in again.stdout
    assert "created" not in again.stdout
    assert "note:" not in again.stdout  # one broker: one copy is all the cluster can hold


def test_grow_without_create_is_a_usage_error_not_a_silent_success(broker: EmbeddedBroker) -> None:
    result = topics(broker, "--grow")
    assert result.returncode == 2, result.stdout
    assert result.stdout == ""
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: --grow adds partitions while creating: use it with --create."
    )


def test_a_replication_factor_above_the_broker_count_is_one_sentence(broker: EmbeddedBroker) -> None:
    suffix = uuid.uuid4().hex[:8]
    result = topics(broker, "--create", AML_REPLICATION_FACTOR="3", AML_PAYMENTS_TOPIC=f"payments-{suffix}")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "Error: AML_REPLICATION_FACTOR=3 but the cluster has 1 broker(s); set it to at most 1."
    ]


def test_a_bad_security_setting_stops_it_before_connecting(broker: EmbeddedBroker) -> None:
    result = topics(broker, "--create", KAFKA_SECURITY_PROTOCOL="SASL_SSL", KAFKA_SASL_USERNAME="u")
    assert result.returncode != 0
    assert "KAFKA_SASL_PASSWORD" in result.stderr
    assert "Traceback" not in result.stderr


async def test_an_existing_topic_whose_config_differs_is_named_with_the_command_that_sets_it(
    broker: EmbeddedBroker,
) -> None:
    """A decisions topic made before they had a retention (compacted alone) grows for ever: `--create`
    leaves it as it is, but says so, with what to run; the topics it creates itself differ in nothing."""
    suffix = uuid.uuid4().hex[:8]
    env = fresh_names(suffix)
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(f"decisions-{suffix}", 4, 1, topic_configs={"cleanup.policy": "compact"})]
        )
    finally:
        await admin.close()
    first = topics(broker, "--create", **env)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    at = lines.index(f"  exists   decisions-{suffix}")
    assert lines[at + 1].strip() == (
        "its config differs: cleanup.policy=compact (the spec: compact,delete), "
        "retention.ms=(unset) (the spec: 2592000000); left as it is, to set it:"
    )
    assert lines[at + 2].strip() == (
        f"kafka-configs.sh --bootstrap-server {broker.bootstrap} --alter --entity-type topics "
        f"--entity-name decisions-{suffix} "
        "--add-config 'cleanup.policy=[compact,delete],retention.ms=2592000000'"
    )
    assert first.stdout.count("its config differs") == 1, first.stdout  # those it created agree
    assert "could not be read" not in first.stdout

    again = topics(broker, "--create", **env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("its config differs") == 1  # still there: left as it is
