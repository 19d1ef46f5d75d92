"""`aml-app park P:O`: an operator's way past a payment that can never succeed, other than stopping its
partition for good.

The request goes to the service's `gate-park` GlobalTable, written straight to the table's changelog
topic (`<app id>-gate-park-changelog`, Faust's name for it) with the table's JSON key and value, so
every worker of the service sees it. The lane that fails on that payment next writes it to the review
topic with its error and attempts, and moves on; a payment that does not fail is never skipped.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import socket
import time

import click
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from aml_app.click_types import TIMEOUT
from aml_app.gate.options import ParkRequest
from aml_app.kafka.deadlines import DeadlineExceeded, close_within, within
from aml_app.kafka.reach import Unreachable, answering_admin
from aml_app.kafka.security import aiokafka_kwargs
from aml_app.settings import Settings, load_settings

TABLE = "gate-park"


def changelog_topic(settings: Settings) -> str:
    """Faust's changelog topic of the service's `gate-park` table."""
    return f"{settings.app_id}-{TABLE}-changelog"


def parse_where(text: str) -> tuple[int, int]:
    partition, sep, offset = text.partition(":")
    if not sep or not all(part.isascii() and part.isdigit() for part in (partition, offset)):
        raise click.BadParameter(f"{text!r} is not PARTITION:OFFSET, such as 0:1234", param_hint="P:O")
    return int(partition), int(offset)


def operator() -> str:
    """Who asks, for the review record: the login name, or the uid where the process has none (a
    container run under an arbitrary uid, without USER and no passwd entry: getuser raises)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


async def _changelog_exists(settings: Settings, topic: str, timeout: float) -> bool:
    """Whether `topic` exists, asked so that it is not created: a producer's (or an admin's
    describe_topics) metadata request lets the broker create a topic it does not have, which on a
    cluster that creates topics on request made a wrong AML_APP_ID a stray topic and a request no
    worker reads."""
    try:
        admin = await answering_admin(
            settings.kafka.bootstrap_servers, settings.kafka.security, timeout, "aml-park"
        )
    except Unreachable as exc:
        raise click.ClickException(str(exc)) from None
    try:
        return topic in await within(admin.list_topics(), timeout, "listing the topics")
    except (DeadlineExceeded, KafkaError) as exc:
        raise click.ClickException(f"no answer from the Kafka cluster: {type(exc).__name__}: {exc}") from None
    finally:
        await close_within(admin.close(), timeout, "closing the admin client")


async def request_park(settings: Settings, partition: int, offset: int, reason: str, timeout: float) -> str:
    """Write the request; return the topic it went to."""
    topic = changelog_topic(settings)
    if not await _changelog_exists(settings, topic, timeout):
        raise click.ClickException(
            f"topic {topic} does not exist: has a worker of {settings.app_id} run? (AML_APP_ID, or "
            "AML_SERVICE, names the service)"
        )
    producer = AIOKafkaProducer(
        bootstrap_servers=list(settings.kafka.bootstrap_servers),
        request_timeout_ms=int(timeout * 1000),
        **aiokafka_kwargs(settings.kafka.security),
    )
    try:
        await asyncio.wait_for(producer.start(), timeout)
        request = ParkRequest(
            by=f"{operator()}@{socket.gethostname()}", reason=reason, at=time.time()
        ).as_json()
        key = json.dumps(f"{partition}:{offset}").encode()
        await producer.send_and_wait(topic, json.dumps(request).encode(), key=key, partition=0)
    except (TimeoutError, KafkaError) as exc:
        raise click.ClickException(
            f"no answer from the Kafka cluster at {','.join(settings.kafka.bootstrap_servers)} within "
            f"{timeout:g} s ({type(exc).__name__}; is it up, and is topic {topic} there?)"
        ) from None
    finally:
        await producer.stop()  # also after a failed start: it closes what the start opened
    return topic


@click.command("park")
@click.argument("where", metavar="P:O")
@click.option("--reason", default="", help="Why, for the review topic's record.")
@click.option(
    "--timeout",
    type=TIMEOUT,
    default=10.0,
    show_default=True,
    help="Seconds to wait for Kafka.",
)
def park_command(where: str, reason: str, timeout: float) -> None:
    """Park payment P:O of this service (AML_SERVICE): at its next failure its lane writes it to the
    review topic with its error and moves on."""
    partition, offset = parse_where(where)
    settings = load_settings()
    if partition >= settings.kafka.partitions:
        # No lane would ever match the request, and the command said it was made.
        raise click.BadParameter(
            f"{settings.kafka.payments_topic} has partitions 0..{settings.kafka.partitions - 1} "
            f"(AML_PARTITIONS), not {partition}",
            param_hint="P:O",
        )
    topic = asyncio.run(request_park(settings, partition, offset, reason, timeout))
    click.echo(
        f"asked the {settings.app_id} workers (through {topic}) to park payment {partition}:{offset}: the "
        f"lane that fails on it next writes it to {settings.kafka.review_topic} and moves on"
    )
