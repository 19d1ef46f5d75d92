"""Which log a topic's offsets belong to.

Offsets mean something only within one log: a topic deleted and created again under the same name, or
the same name on another cluster (a migration), starts again at offset 0 with other records. Everything
that compares offsets across services (the watermark rows, the `as_of` of B's and C's answers) carries
the identity of the log they were read from, and a mismatch stops the comparison: `cluster id:topic id`,
Kafka's topic id (KIP-516) where the broker reports one, else the topic's name (a broker without topic
ids still tells clusters apart).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from typing import Any

#: What a broker without topic ids reports in their place.
NO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"


class LogUnknown(RuntimeError):
    """The cluster did not say which log the topic is (unreachable, or no such topic)."""


def identity(cluster_id: str | None, topic: str, topic_id: str | None) -> str:
    """The identity string of a topic's log (see the module docstring)."""
    named = topic_id if topic_id and topic_id != NO_TOPIC_ID else f"name={topic}"
    return f"{cluster_id or 'unknown-cluster'}:{named}"


class LogIdentities:
    """Reads the identity of topics' logs with one admin client, kept across reads (librdkafka `config`:
    servers, TLS/SASL). The cluster id is read again when asked (`cluster_too`), the topic id each time.

    Blocking (confluent-kafka's admin client): call it from a thread in asyncio code."""

    def __init__(self, config: Mapping[str, Any], timeout: float = 10.0) -> None:
        from confluent_kafka.admin import AdminClient

        self.admin = AdminClient(dict(config))
        self.timeout = timeout
        self.cluster_id: str | None = None

    def read(self, topic: str, cluster_too: bool = True) -> str:
        return self.read_all([topic], cluster_too)[topic]

    def read_all(self, topics: list[str], cluster_too: bool = True) -> dict[str, str]:
        """The identities of `topics`' logs, described in one request."""
        from confluent_kafka import KafkaException, TopicCollection

        try:
            if cluster_too or self.cluster_id is None:
                cluster = self.admin.describe_cluster(request_timeout=self.timeout).result(self.timeout)
                self.cluster_id = cluster.cluster_id
            described = self.admin.describe_topics(TopicCollection(topics), request_timeout=self.timeout)
            topic_ids = {topic: described[topic].result(self.timeout).topic_id for topic in topics}
        except KafkaException as exc:
            raise LogUnknown(f"cannot tell which log topic {_names(topics)} is: {exc.args[0]}") from None
        except concurrent.futures.TimeoutError:  # the wait for librdkafka's answer ran out first
            raise LogUnknown(
                f"cannot tell which log topic {_names(topics)} is: no answer within {self.timeout:g} s"
            ) from None
        return {
            topic: identity(self.cluster_id, topic, None if topic_id is None else str(topic_id))
            for topic, topic_id in topic_ids.items()
        }


def _names(topics: list[str]) -> str:
    return " or ".join(repr(topic) for topic in topics)


def log_identity(config: Mapping[str, Any], topic: str, timeout: float = 10.0) -> str:
    """The identity of `topic`'s log, with a client of its own (blocking)."""
    return LogIdentities(config, timeout).read(topic)
