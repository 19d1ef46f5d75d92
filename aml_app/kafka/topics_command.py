"""`aml-app topics`: the system's topics and their configuration (`aml_app.kafka.topics`), and creating them.

Without options it prints the specs (name, partitions, replication, config, purpose): the reference for
whoever provisions a cluster. `--create` creates the missing ones on `KAFKA_BOOTSTRAP_SERVERS` with
their configs, through the same TLS/SASL settings as every other client; existing topics are left as
they are (a partition count that differs from the spec is reported, never changed). The compose file
runs it once as an init service before anything else starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import click
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import for_code

from aml_app.kafka.security import aiokafka_kwargs
from aml_app.kafka.topics import TopicSpec, topic_specs
from aml_app.settings import ConfigError, Settings, load_settings

TOPIC_ALREADY_EXISTS = 36


class TopicsError(RuntimeError):
    """The cluster could not be reached or refused a topic; the message is one sentence."""


@dataclass
class Outcome:
    created: list[str] = field(default_factory=list)
    existing: dict[str, int] = field(default_factory=dict)  # name -> its partition count


def spec_table(specs: Sequence[TopicSpec]) -> str:
    """The specs as an aligned text table."""
    rows = [("topic", "partitions", "replication", "config", "purpose")]
    for spec in specs:
        config = ",".join(f"{k}={v}" for k, v in sorted(spec.config.items())) or "-"
        rows.append((spec.name, str(spec.partitions), str(spec.replication_factor), config, spec.purpose))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)), row[-1]]).rstrip()
        for row in rows
    )


async def _connect(settings: Settings, timeout: float) -> AIOKafkaAdminClient:
    """An admin client once the cluster answers a metadata request (a fresh cluster takes a while)."""
    servers = ",".join(settings.bootstrap_servers)
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=list(settings.bootstrap_servers),
            client_id="aml-topics",
            request_timeout_ms=10_000,
            **aiokafka_kwargs(settings.kafka_security),
        )
        try:
            await admin.start()
            await admin.describe_cluster()
            return admin
        except Exception as exc:
            last = exc
            with contextlib.suppress(Exception):
                await admin.close()
            await asyncio.sleep(1.0)
    raise TopicsError(f"the Kafka cluster at {servers} did not answer within {timeout:g} s: {last!r}")


async def create_missing(settings: Settings, specs: Sequence[TopicSpec], timeout: float) -> Outcome:
    """Create the topics of `specs` that do not exist; report the others with their partition count."""
    admin = await _connect(settings, timeout)
    try:
        brokers = len((await admin.describe_cluster())["brokers"])
        needed = max(spec.replication_factor for spec in specs)
        if needed > brokers:
            raise TopicsError(
                f"AML_REPLICATION_FACTOR={needed} but the cluster has {brokers} broker(s); "
                f"set it to at most {brokers}."
            )
        outcome = Outcome()
        existing = set(await admin.list_topics())
        present = [spec.name for spec in specs if spec.name in existing]
        if present:
            for described in await admin.describe_topics(present):
                outcome.existing[described["topic"]] = len(described["partitions"])
        missing = [spec for spec in specs if spec.name not in existing]
        if missing:
            response = await admin.create_topics(
                [
                    NewTopic(
                        spec.name,
                        num_partitions=spec.partitions,
                        replication_factor=spec.replication_factor,
                        topic_configs=dict(spec.config),
                    )
                    for spec in missing
                ]
            )
            refused = []
            for entry in response.topic_errors:
                name, code = entry[0], entry[1]
                detail = entry[2] if len(entry) > 2 and entry[2] else for_code(code).__name__
                if code == 0:
                    outcome.created.append(name)
                elif code == TOPIC_ALREADY_EXISTS:  # created meanwhile (another init): fine
                    outcome.existing.setdefault(name, -1)
                else:
                    refused.append(f"{name} ({detail})")
            if refused:
                raise TopicsError(f"the cluster refused to create {', '.join(refused)}.")
        return outcome
    finally:
        await admin.close()


@click.command("topics")
@click.option(
    "--create",
    is_flag=True,
    help="Create the missing topics on KAFKA_BOOTSTRAP_SERVERS with their configs (existing ones are kept).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1, max=600),
    default=60.0,
    show_default=True,
    help="Seconds to wait for the cluster to answer (with --create).",
)
def topics_command(create: bool, timeout: float) -> None:
    """Print every topic of the system with its configuration; --create creates the missing ones."""
    try:
        settings = load_settings()
    except ConfigError as exc:
        raise click.ClickException(f"configuration error: {exc}") from None
    specs = topic_specs(settings)
    click.echo(spec_table(specs))
    if not create:
        return
    servers = ",".join(settings.bootstrap_servers)
    click.echo(f"\ncreating on {servers} ({settings.kafka_security.describe()})")
    try:
        outcome = asyncio.run(create_missing(settings, specs, timeout))
    except TopicsError as exc:
        raise click.ClickException(str(exc)) from None
    for spec in specs:
        if spec.name in outcome.created:
            click.echo(f"  created  {spec.name}")
        else:
            count = outcome.existing.get(spec.name, -1)
            note = (
                f" with {count} partitions, not {spec.partitions}; left as it is"
                if count not in (-1, spec.partitions)
                else ""
            )
            click.echo(f"  exists   {spec.name}{note}")
