"""`aml-app topics --create` names an existing topic whose config differs from its spec, with the command
that sets it: on Apache Kafka, which describes every value, and on brokers that describe only those set."""

from __future__ import annotations

from typing import Any

from aiokafka.errors import TopicAuthorizationFailedError

from aml_app.kafka.broker import TopicSpec
from aml_app.topics_command import Outcome, alter_command, config_drift, read_drift

DECISIONS = TopicSpec(
    "aml.decisions",
    4,
    3,
    {"cleanup.policy": "compact,delete", "retention.ms": "2592000000", "min.insync.replicas": "2"},
    "decisions",
)


def test_a_topic_as_its_spec_differs_in_nothing_whatever_the_order_of_its_policies() -> None:
    have = {"cleanup.policy": "delete,compact", "retention.ms": "2592000000", "min.insync.replicas": "2"}
    assert config_drift(DECISIONS, {**have, "segment.ms": "604800000"}) == {}


def test_each_differing_key_is_named_with_its_value_and_the_specs() -> None:
    have = {"cleanup.policy": "compact", "retention.ms": "604800000", "min.insync.replicas": "2"}
    assert config_drift(DECISIONS, have) == {
        "cleanup.policy": ("compact", "compact,delete"),
        "retention.ms": ("604800000", "2592000000"),
    }


def test_a_key_described_with_no_value_stands_at_kafkas_default() -> None:
    """Some brokers describe only what is set: an unset min.insync.replicas is 1, a retention 7 days."""
    one_copy = TopicSpec("payments", 4, 1, {"retention.ms": "604800000", "min.insync.replicas": "1"}, "")
    assert config_drift(one_copy, {}) == {}
    assert config_drift(DECISIONS, {"cleanup.policy": "compact,delete"}) == {
        "min.insync.replicas": (None, "2"),
        "retention.ms": (None, "2592000000"),
    }


def test_the_command_brackets_list_values_as_kafka_configs_takes_them() -> None:
    drift = {"cleanup.policy": ("compact", "compact,delete"), "retention.ms": (None, "2592000000")}
    assert alter_command("aml.decisions", drift, "k1:9092,k2:9092") == (
        "kafka-configs.sh --bootstrap-server k1:9092,k2:9092 --alter --entity-type topics "
        "--entity-name aml.decisions --add-config 'cleanup.policy=[compact,delete],retention.ms=2592000000'"
    )


class RefusingAdmin:
    """A cluster whose ACLs refuse DescribeConfigs (the embedded broker answers it)."""

    async def describe_configs(self, resources: list[Any]) -> list[Any]:
        raise TopicAuthorizationFailedError("describe_configs")


async def test_configs_the_cluster_will_not_describe_are_a_note_not_a_failure() -> None:
    outcome = Outcome()
    await read_drift(RefusingAdmin(), [DECISIONS], outcome)  # type: ignore[arg-type]
    assert outcome.drift == {}
    assert outcome.configs_unread.startswith("TopicAuthorizationFailedError")


async def test_a_kafka_error_after_the_first_answer_is_one_sentence(monkeypatch: Any) -> None:
    """Only an unreachable cluster was a sentence: a request that timed out later was a traceback."""
    import pytest
    from aiokafka.errors import RequestTimedOutError

    from aml_app import topics_command
    from aml_app.settings import load_settings
    from aml_app.topics import topic_specs

    class Admin:
        async def describe_cluster(self) -> dict[str, Any]:
            return {"brokers": [{"node_id": 1}]}

        async def list_topics(self) -> list[str]:
            raise RequestTimedOutError("the controller did not answer")

        async def close(self) -> None:
            pass

    async def answering(*args: Any) -> Admin:
        return Admin()

    monkeypatch.setattr(topics_command, "answering_admin", answering)
    settings = load_settings({})
    with pytest.raises(
        topics_command.TopicsError, match=r"^the Kafka cluster failed to answer: RequestTimedOutError"
    ):
        await topics_command.create_missing(settings, topic_specs(settings), 1.0)
