"""Describe topics without creating them.

aiokafka's `AIOKafkaAdminClient.describe_topics` sends a metadata request that lets the broker create a
topic it does not have (`allow_auto_topic_creation` is true unless set): on a Kafka cluster with
`auto.create.topics.enable`, and on the embedded broker always, a gate started before `payments` existed
made the topic itself, with the broker's default partition count. This sends the same request with
creation off, through the admin client's `_send_request`: the one aiokafka private name used outside
`aml_app.faust_internals`, kept here so the dependencies' APIs, which read offsets, need not import
Faust. It is checked when this module is imported.
"""

from __future__ import annotations

from typing import Any

import aiokafka
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.metadata import MetadataRequest


class IncompatibleAiokafka(ImportError):
    """The installed aiokafka lacks the private name this module relies on."""

    one_line = True


if not callable(getattr(AIOKafkaAdminClient, "_send_request", None)):
    raise IncompatibleAiokafka(
        f"aml-app was built for aiokafka 0.14.0, but the installed aiokafka {aiokafka.__version__} lacks "
        "AIOKafkaAdminClient._send_request: install the version pinned in pyproject.toml, or port "
        "aml_app/kafka/metadata.py"
    )


async def describe_existing(admin: AIOKafkaAdminClient, topics: list[str]) -> list[dict[str, Any]]:
    """`describe_topics`' answer, in which a missing topic stays missing (error code 3,
    UNKNOWN_TOPIC_OR_PARTITION, and no partitions)."""
    response = await admin._send_request(MetadataRequest(topics, allow_auto_topic_creation=False))
    described: list[dict[str, Any]] = response.to_object()["topics"]
    return described
