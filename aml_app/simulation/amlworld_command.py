"""`aml-app import-amlworld FILE [FILE]`: send IBM AMLworld's transactions to the payments topic
(docs/amlworld.md).

A file is a transactions CSV (`*_Trans.csv`) or a patterns file (`*_Patterns.txt`, its laundering attempts
only); given one of each, the attempts are replayed into the transactions' background, in one event-time
order. The files are parsed first (`aml_app.simulation.amlworld`), so a bad row sends nothing; then
payments go out in event-time order, keyed by payer, with the simulator's producer settings (acks=all,
the project's Kafka servers and TLS/SASL). Every fault is one sentence and a non-zero exit, as for
`simulate`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from datetime import datetime

import click
from aiokafka.errors import KafkaError

from aml_app.click_types import POSITIVE
from aml_app.dependencies.aggregates import HORIZON
from aml_app.kafka.security import PLAINTEXT, KafkaSecurity
from aml_app.kafka.tools import produce, started_producer
from aml_app.settings import ConfigError, load_settings
from aml_app.simulation.amlworld import (
    DEFAULT_PREFIX,
    AmlworldImport,
    AmlworldPayment,
    read_amlworld,
    read_patterns_import,
    transactions_and_patterns,
)

CHUNK = 5000  # payments per produce() call; each chunk's acknowledgements are awaited before the next
PACE_STEP = 0.5  # seconds of wall time a paced chunk covers


async def send_payments(
    bootstrap: Sequence[str],
    topic: str,
    payments: Sequence[AmlworldPayment],
    *,
    security: KafkaSecurity = PLAINTEXT,
    progress: Callable[[str], None] | None = None,
    progress_interval: float = 5.0,
    days_per_second: float | None = None,
) -> int:
    """Send `payments` in their order (key = payer) and return how many the broker acknowledged.

    Chunks are sent one after the other and each is acknowledged before the next, so a payer's payments
    reach its partition in the order given. `days_per_second` paces them by event time (that many days
    of it per second of wall time; None: as fast as the broker takes them). `security`: the cluster's
    TLS/SASL.
    """
    producer = await started_producer(bootstrap, "aml-amlworld-import", security)
    sent = 0
    started = time.monotonic()
    next_progress = started + progress_interval
    first = datetime.fromisoformat(payments[0].ts) if payments else None

    def due(payment: AmlworldPayment) -> float:
        """Seconds after the start at which the payment goes out."""
        if days_per_second is None or first is None:
            return 0.0
        return (datetime.fromisoformat(payment.ts) - first).total_seconds() / 86400 / days_per_second

    try:
        chunk: list[AmlworldPayment] = []
        for payment in [*payments, None]:
            ahead = payment is not None and due(payment) > time.monotonic() - started + PACE_STEP
            if chunk and (payment is None or len(chunk) >= CHUNK or ahead):
                await produce(producer, topic, [(None, p.key, p.value()) for p in chunk])
                sent += len(chunk)
                if progress is not None and sent < len(payments) and time.monotonic() >= next_progress:
                    next_progress += progress_interval
                    progress(f"amlworld: {sent}/{len(payments)} payments sent, event time now {chunk[-1].ts}")
                chunk = []
            if payment is not None:
                if ahead:  # the next step of event time: wait for it
                    await asyncio.sleep(max(0.0, due(payment) - (time.monotonic() - started)))
                chunk.append(payment)
    finally:
        await producer.stop()
    return sent


@click.command("import-amlworld")
@click.argument(
    "files", metavar="FILE [FILE]", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False)
)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help="Import only the first N data rows of the transactions file (the real files have millions).",
)
@click.option(
    "--prefix",
    default=DEFAULT_PREFIX,
    show_default=True,
    help="Payment ids are <prefix>-<line of the row> (<prefix>-pattern-<line> for a patterns file).",
)
@click.option(
    "--days-per-second",
    type=POSITIVE,
    default=None,
    help="Pace the payments by event time: this many days of it per second (default: as fast as the "
    "broker takes them). Service C counts a payment only within 7 days of the newest it has seen, so weeks "
    "of sparse payments sent at once can land in one micro-batch and lose their first weeks.",
)
@click.option(
    "--truth",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help='Write the laundering payments here before sending: JSON Lines {"payment_id": ..., '
    '"is_laundering": true}, with "typology" and "attempt" for a patterns file\'s payments.',
)
def import_amlworld_command(
    files: tuple[str, ...], limit: int | None, prefix: str, days_per_second: float | None, truth: str | None
) -> None:
    """Send IBM AMLworld data to the payments topic, in event-time order: a transactions CSV (*_Trans.csv),
    a patterns file (*_Patterns.txt), or one of each (the attempts replayed into the background)."""
    if not prefix.strip() or len(prefix) > 64:
        raise click.BadParameter("must be 1 to 64 characters.", param_hint="--prefix")
    try:
        settings = load_settings()
    except ConfigError as exc:
        raise click.ClickException(f"configuration error: {exc}") from None
    try:
        transactions, patterns = transactions_and_patterns(files)
        parts = []
        if transactions is not None:
            click.echo(f"amlworld: reading {transactions}")
            parts.append(read_amlworld(transactions, limit=limit, prefix=prefix, progress=click.echo))
        if patterns is not None:
            parts.append(read_patterns_import(patterns, prefix=f"{prefix}-pattern"))
        imported = parts[0] if len(parts) == 1 else parts[0].merged(parts[1])
        if truth is not None:
            imported.write_ground_truth(truth)
    except ValueError as exc:
        raise click.ClickException(f"{str(exc).rstrip('.')}; nothing was sent.") from None
    except OSError as exc:
        raise click.ClickException(f"could not read or write {exc.filename}: {exc.strerror}.") from None
    servers = ",".join(settings.kafka.bootstrap_servers)
    if days_per_second is None and imported.payments:
        span = datetime.fromisoformat(imported.payments[-1].ts) - datetime.fromisoformat(
            imported.payments[0].ts
        )
        if span >= HORIZON and len(imported.payments) < settings.pipeline.max_records_per_trigger:
            click.echo(
                f"amlworld: warning: {span.days} days of event time in {len(imported.payments)} payments, "
                "sent at once, may reach Service C in one micro-batch, which counts only the last "
                f"{HORIZON.days} days of it; pace them with --days-per-second 1"
            )
    click.echo(
        f"amlworld: {len(imported.payments)} payments from {imported.path} "
        f"to {settings.kafka.payments_topic} via {servers}"
    )
    started = time.monotonic()
    try:
        sent = asyncio.run(
            send_payments(
                settings.kafka.bootstrap_servers,
                settings.kafka.payments_topic,
                imported.payments,
                security=settings.kafka.security,
                progress=click.echo,
                days_per_second=days_per_second,
            )
        )
    except (KafkaError, OSError) as exc:
        raise click.ClickException(f"could not send to Kafka at {servers}: {exc}") from None
    _summary(imported, sent, settings.kafka.payments_topic, time.monotonic() - started, truth)


def _summary(imported: AmlworldImport, sent: int, topic: str, elapsed: float, truth: str | None) -> None:
    click.echo(
        f"amlworld import done: {imported.rows_read} row(s) read from {imported.path}, "
        f"{sent} payment(s) sent to {topic} in {elapsed:.1f} s"
    )
    for currency, rows in sorted(imported.skipped.items()):
        click.echo(f"  skipped: {rows} row(s) paid in {currency} (no ISO 4217 code, our contract refuses it)")
    if imported.skipped_laundering:
        click.echo(
            f"  skipped rows labelled laundering: {imported.skipped_laundering} "
            "(not sent, not in the ground truth)"
        )
    click.echo(f"  laundering: {len(imported.laundering)} payment(s) sent with Is Laundering = 1")
    if imported.attempts:
        click.echo(f"  attempts: {len(imported.attempts)} laundering attempt(s) of the patterns file")
    if imported.skipped_attempts:
        click.echo(
            f"  skipped attempts: {imported.skipped_attempts} (every row skipped; not in the ground truth)"
        )
    if imported.payments:
        click.echo(f"  event time {imported.payments[0].ts} .. {imported.payments[-1].ts}")
    if truth is not None:
        click.echo(f"ground truth: {truth}")
