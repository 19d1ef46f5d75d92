"""`aml-app topics`: the system's topics and their configuration (`aml_app.topics`), and creating them.

Without options it prints the specs (name, partitions, replication, config, purpose): the reference for
whoever provisions a cluster. `--create` creates the missing ones on `KAFKA_BOOTSTRAP_SERVERS` with
their configs, through the same TLS/SASL settings as every other client; an existing topic whose
partition count differs from `AML_PARTITIONS` is reported and left as it is, unless `--grow` adds
partitions to those with fewer, the payments topic last (its alerts topics are the changelogs of
tables partitioned like it). An existing topic whose config differs from its spec (made by an older
release, or by hand) is named with the `kafka-configs.sh` command that sets it, and left as it is: the
cluster's operators own a live topic's config. The compose file runs it once as an init service before
anything else starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import click
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, for_code

from aml_app.click_types import FiniteRange
from aml_app.kafka.broker import TopicSpec
from aml_app.kafka.reach import Unreachable, answering_admin
from aml_app.settings import ConfigError, Settings, load_settings
from aml_app.topics import DAY_MS, topic_specs

TOPIC_ALREADY_EXISTS = 36


class TopicsError(RuntimeError):
    """The cluster could not be reached or refused a topic; the message is one sentence."""


@dataclass
class Outcome:
    created: list[str] = field(default_factory=list)
    existing: dict[str, int] = field(default_factory=dict)  # name -> its partition count
    grown: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (partitions before, after)
    brokers: int = 0  # in the cluster
    #: Existing topic -> {config key: (its value, None when unset; the spec's)} where the two differ.
    drift: dict[str, dict[str, tuple[str | None, str]]] = field(default_factory=dict)
    #: Why the existing topics' configs could not be read (empty when they were).
    configs_unread: str = ""


#: The replication factor production Kafka clusters use (and Kafka's docs recommend): a topic survives
#: the loss of a broker, and with min.insync.replicas=2 a write acknowledged by all is on two of them.
RECOMMENDED_REPLICATION = 3


def replication_note(replication: int, brokers: int) -> str | None:
    """A sentence when topics get fewer copies than the cluster could give them (none on one broker)."""
    could = min(RECOMMENDED_REPLICATION, brokers)
    if replication >= could:
        return None
    return (
        f"AML_REPLICATION_FACTOR={replication} on a cluster of {brokers} brokers: losing a broker loses "
        f"the data of its partitions; set it to {could} for production."
    )


def growth_order(specs: Sequence[TopicSpec], existing: dict[str, int], payments: str) -> list[TopicSpec]:
    """The existing topics with fewer partitions than their spec, in the order to grow them: the payments
    topic last, so it never has more partitions than an alerts topic (the changelog of a table that is
    partitioned like the payments), which workers refuse to run on."""
    short = [spec for spec in specs if 0 < existing.get(spec.name, 0) < spec.partitions]
    return sorted(short, key=lambda spec: spec.name == payments)


#: Apache Kafka's defaults of the keys our specs set: what a key a broker describes no value for stands at.
KAFKA_DEFAULTS = {
    "cleanup.policy": "delete",
    "retention.ms": str(7 * DAY_MS),
    "min.insync.replicas": "1",
}


def config_drift(spec: TopicSpec, have: dict[str, str]) -> dict[str, tuple[str | None, str]]:
    """The keys of the spec's config whose value on the topic differs: key -> (its value, None when
    unset; the spec's). `have` is what the cluster describes: every value on Apache Kafka, only those
    set on some brokers, for which an unset key stands at Kafka's default."""

    def same(key: str, value: str | None, wanted: str) -> bool:
        if value is None:
            return False
        if key == "cleanup.policy":  # a list: compact,delete is delete,compact
            return sorted(value.split(",")) == sorted(wanted.split(","))
        return value == wanted

    return {
        k: (have.get(k), v)
        for k, v in sorted(spec.config.items())
        if not same(k, have.get(k, KAFKA_DEFAULTS.get(k)), v)
    }


def alter_command(name: str, drift: dict[str, tuple[str | None, str]], servers: str) -> str:
    """The Kafka CLI command that sets the spec's values of `drift` on topic `name` (list values bracketed,
    as kafka-configs.sh takes them)."""
    values = ",".join(f"{k}=[{v}]" if "," in v else f"{k}={v}" for k, (_, v) in drift.items())
    return (
        f"kafka-configs.sh --bootstrap-server {servers} --alter --entity-type topics --entity-name {name} "
        f"--add-config '{values}'"
    )


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


async def create_missing(
    settings: Settings, specs: Sequence[TopicSpec], timeout: float, grow: bool = False
) -> Outcome:
    """Create the topics of `specs` that do not exist; report the others with their partition count, and
    with `grow` add partitions to those with fewer than their spec (`growth_order`)."""
    try:
        admin = await answering_admin(
            settings.kafka.bootstrap_servers, settings.kafka.security, timeout, "aml-topics"
        )
    except Unreachable as exc:
        raise TopicsError(str(exc)) from None
    try:
        brokers = len((await admin.describe_cluster())["brokers"])
        needed = max(spec.replication_factor for spec in specs)
        if needed > brokers:
            raise TopicsError(
                f"AML_REPLICATION_FACTOR={needed} but the cluster has {brokers} broker(s); "
                f"set it to at most {brokers}."
            )
        outcome = Outcome(brokers=brokers)
        existing = set(await admin.list_topics())
        present = [spec.name for spec in specs if spec.name in existing]
        if present:
            for described in await admin.describe_topics(present):
                outcome.existing[described["topic"]] = len(described["partitions"])
            await read_drift(admin, [spec for spec in specs if spec.name in existing], outcome)
        missing = [spec for spec in specs if spec.name not in existing]
        if missing:
            response = await admin.create_topics([spec.new_topic() for spec in missing])
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
        for spec in growth_order(specs, outcome.existing, settings.kafka.payments_topic) if grow else []:
            before = outcome.existing[spec.name]
            try:
                await admin.create_partitions({spec.name: NewPartitions(total_count=spec.partitions)})
            except Exception as exc:
                name, text = type(exc).__name__, str(exc)
                reason = text if text.startswith(name) else f"{name}: {text}".rstrip(": ")
                raise TopicsError(
                    f"the cluster refused to add partitions to {spec.name} ({before} -> {spec.partitions}): "
                    f"{reason}"
                ) from exc
            outcome.grown[spec.name] = (before, spec.partitions)
        return outcome
    except KafkaError as exc:  # after the first answer: one sentence, not a traceback
        raise TopicsError(
            f"the Kafka cluster failed to answer: {type(exc).__name__}: {exc}".rstrip(": ")
        ) from None
    finally:
        await admin.close()


async def read_drift(admin: AIOKafkaAdminClient, specs: Sequence[TopicSpec], outcome: Outcome) -> None:
    """Fill `outcome.drift` for the existing topics of `specs`; a cluster that will not describe them
    (an ACL, an old broker) is said in `outcome.configs_unread`, not an error: creating goes on."""
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, spec.name) for spec in specs]
        )
    except Exception as exc:
        outcome.configs_unread = f"{type(exc).__name__}: {exc}".rstrip(": ")
        return
    by_name = {spec.name: spec for spec in specs}
    for response in responses:
        # Every version: (error_code, error_message, resource_type, resource_name, entries), and each
        # entry starts (name, value).
        for code, message, _, name, entries in response.resources:
            if code != 0:
                outcome.configs_unread = f"{name}: {message or for_code(code).__name__}"
                continue
            drift = config_drift(by_name[name], {entry[0]: entry[1] for entry in entries})
            if drift:
                outcome.drift[name] = drift


@click.command("topics")
@click.option(
    "--create",
    is_flag=True,
    help="Create the missing topics on KAFKA_BOOTSTRAP_SERVERS with their configs; existing ones are "
    "reported and left as they are (see --grow).",
)
@click.option(
    "--grow",
    is_flag=True,
    help="With --create, add partitions to existing topics with fewer than AML_PARTITIONS, the payments "
    "topic last (a topic never loses partitions, and a key's partition changes for new records).",
)
@click.option(
    "--timeout",
    type=FiniteRange(min=1, max=600),
    default=60.0,
    show_default=True,
    help="Seconds to wait for the cluster to answer (with --create).",
)
def topics_command(create: bool, grow: bool, timeout: float) -> None:
    """Print every topic of the system with its configuration; --create creates the missing ones (and
    --grow adds partitions to the short ones)."""
    if grow and not create:
        raise click.UsageError("--grow adds partitions while creating: use it with --create.")
    try:
        settings = load_settings()
    except ConfigError as exc:
        raise click.ClickException(f"configuration error: {exc}") from None
    specs = topic_specs(settings)
    click.echo(spec_table(specs))
    if not create:
        return
    servers = ",".join(settings.kafka.bootstrap_servers)
    click.echo(f"\ncreating on {servers} ({settings.kafka.security.describe()})")
    try:
        outcome = asyncio.run(create_missing(settings, specs, timeout, grow))
    except TopicsError as exc:
        raise click.ClickException(str(exc)) from None
    for spec in specs:
        if spec.name in outcome.created:
            click.echo(f"  created  {spec.name}")
        elif spec.name in outcome.grown:
            before, after = outcome.grown[spec.name]
            click.echo(f"  grown    {spec.name} from {before} to {after} partitions")
        else:
            count = outcome.existing.get(spec.name, -1)
            note = ""
            if count not in (-1, spec.partitions):
                how = " (--grow adds the missing ones)" if count < spec.partitions else ""
                note = f" with {count} partitions, not {spec.partitions}; left as it is{how}"
            click.echo(f"  exists   {spec.name}{note}")
            drift = outcome.drift.get(spec.name)
            if drift:
                differs = ", ".join(
                    f"{k}={have if have is not None else '(unset)'} (the spec: {want})"
                    for k, (have, want) in drift.items()
                )
                click.echo(f"           its config differs: {differs}; left as it is, to set it:")
                click.echo(f"           {alter_command(spec.name, drift, servers)}")
    if outcome.configs_unread:
        click.echo(f"\nnote: the existing topics' configs could not be read ({outcome.configs_unread}).")
    warning = replication_note(min(spec.replication_factor for spec in specs), outcome.brokers)
    if warning:
        click.echo(f"\nnote: {warning}")
