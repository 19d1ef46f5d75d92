"""`aml-app simulate`: send simulated payments with injected laundering typologies to the payments topic.

Kafka servers, the payments topic, and the reporting threshold and band (which the injected structuring
must match, because Service C counts with them) come from the settings (`aml_app.settings`); detection
thresholds, which size the injected patterns, from the `AML_RULE_*` variables. Options are checked before
anything connects, and every fault is one sentence.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import click
from aiokafka.errors import KafkaError

from aml_app.click_types import POSITIVE, FiniteRange
from aml_app.detection.thresholds import AmlThresholds
from aml_app.settings import ConfigError, load_settings
from aml_app.simulation.producer import GroundTruthError, SimulatorReport, payment_count, run_simulator
from aml_app.simulation.traffic import DEFAULT_SPEEDUP, ahead_of_sending

MAX_RATE = 100_000.0
MAX_PAYMENTS = 10_000_000  # the whole simulation is built in memory first
SHORTFALL = 0.95  # a run reaching less of the asked rate says so


def parse_start(raw: str | None) -> datetime | None:
    """The first event time from ISO-8601 text with a timezone, or None (now)."""
    if raw is None:
        return None
    try:
        when = datetime.fromisoformat(raw.strip())
    except ValueError:
        raise click.BadParameter(
            f"{raw!r} is not an ISO-8601 instant such as 2026-03-01T09:00:00Z.", param_hint="--start"
        ) from None
    if when.tzinfo is None or when.utcoffset() is None:
        raise click.BadParameter(
            f"{raw!r} has no timezone; add Z or an offset such as +01:00.", param_hint="--start"
        )
    try:
        return when.astimezone(UTC)
    except OverflowError:
        raise click.BadParameter(
            f"{raw!r} is before year 1 or after 9999 in UTC.", param_hint="--start"
        ) from None


def check_start(
    raw: str, first: datetime, count: int, rate: float, speedup: float, skew: float, now: datetime
) -> None:
    """Refuse a --start that would timestamp payments more than `skew` seconds after they are sent, were the
    first sent `now` (sending starts later, which only moves every payment further behind its time)."""
    ahead = ahead_of_sending(first, count, rate, speedup, now)
    if ahead > skew:
        latest = (first - timedelta(seconds=ahead - skew)).replace(microsecond=0)
        raise click.BadParameter(
            f"{raw!r} would timestamp payments up to {ahead:,.0f} s after they are sent, more than "
            f"AML_MAX_CLOCK_SKEW ({skew:g} s), and every consumer would dead-letter them; start at or "
            f"before {latest.isoformat().replace('+00:00', 'Z')}, or leave --start out.",
            param_hint="--start",
        )


@click.command("simulate")
@click.option(
    "--rate",
    type=FiniteRange(min=0, min_open=True, max=MAX_RATE),
    default=50.0,
    show_default=True,
    help="Payments per second.",
)
@click.option(
    "--duration",
    type=POSITIVE,
    default=60.0,
    show_default=True,
    help="Seconds of sending; rate * duration payments in all.",
)
@click.option("--seed", type=int, default=1, show_default=True, help="Same seed, same payments.")
@click.option(
    "--ground-truth",
    "ground_truth",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write the injected instances here (JSON Lines) before sending.",
)
@click.option(
    "--start",
    default=None,
    help=(
        "First event time, ISO-8601 with a timezone (default: so that the simulated clock ends at the "
        "send time of the last payment). A start that would timestamp payments more than "
        "AML_MAX_CLOCK_SKEW after they are sent is refused: every consumer would dead-letter them."
    ),
)
@click.option(
    "--speedup",
    type=FiniteRange(min=0, min_open=True, max=1_000_000),
    default=DEFAULT_SPEEDUP,
    show_default=True,
    help="Simulated seconds per real second of sending.",
)
@click.option(
    "--instances",
    type=click.IntRange(min=0),
    default=None,
    help="Instances of each typology (default: one per 1000 payments, 1 to 20).",
)
@click.option("--prefix", default=None, help="Prefix of account and payment ids (default: sim<seed>).")
def simulate_command(
    rate: float,
    duration: float,
    seed: int,
    ground_truth: str | None,
    start: str | None,
    speedup: float,
    instances: int | None,
    prefix: str | None,
) -> None:
    """Send simulated payments with injected laundering typologies, paced at --rate per second."""
    first = parse_start(start)
    try:
        count = payment_count(rate, duration)
    except ValueError as exc:
        raise click.BadParameter(f"{exc}.", param_hint="--rate/--duration") from None
    if count > MAX_PAYMENTS:
        raise click.BadParameter(
            f"rate * duration is {count} payments; at most {MAX_PAYMENTS} per run.", param_hint="--duration"
        )
    if prefix is not None and (not prefix.strip() or len(prefix) > 64):
        raise click.BadParameter("must be 1 to 64 characters.", param_hint="--prefix")
    try:
        settings = load_settings()
        thresholds = AmlThresholds.from_env(os.environ)
    except ConfigError as exc:
        raise click.ClickException(f"configuration error: {exc}") from None
    if first is not None:
        check_start(
            start or "", first, count, rate, speedup, settings.kafka.max_clock_skew, datetime.now(UTC)
        )
    click.echo(
        f"simulator: {count} payments to {settings.kafka.payments_topic} at {rate:g}/s "
        f"(seed {seed}, event time x{speedup:g}) via {','.join(settings.kafka.bootstrap_servers)}"
    )
    try:
        report = asyncio.run(
            _until_signalled(
                lambda stop: run_simulator(
                    settings.kafka.bootstrap_servers,
                    settings.kafka.payments_topic,
                    rate,
                    duration,
                    seed,
                    ground_truth,
                    start=first,
                    speedup=speedup,
                    instances=instances,
                    reporting_threshold=settings.dependencies.reporting_threshold,
                    threshold_band=settings.dependencies.threshold_band,
                    thresholds=thresholds,
                    prefix=prefix,
                    progress=click.echo,
                    stop=stop,
                    security=settings.kafka.security,
                )
            )
        )
    except (ValueError, GroundTruthError) as exc:  # the run cannot hold the instances asked for
        raise click.ClickException(str(exc)) from None
    except (KafkaError, OSError) as exc:
        raise click.ClickException(
            f"could not send to Kafka at {','.join(settings.kafka.bootstrap_servers)}: {exc}"
        ) from None
    _summary(report, rate)


async def _until_signalled(send: Callable[[asyncio.Event], Awaitable[SimulatorReport]]) -> SimulatorReport:
    """Run `send` with Ctrl-C (and SIGTERM) turned into a clean stop after the current burst."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        return await send(stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _summary(report: SimulatorReport, rate: float) -> None:
    simulation = report.simulation
    state = "stopped early" if report.stopped_early else "done"
    click.echo(
        f"simulator {state}: {report.sent}/{report.planned} payments in {report.elapsed:.1f} s; "
        f"event time {simulation.payments[0].ts} .. {simulation.payments[-1].ts}"
    )
    if not report.stopped_early and report.sent > 1 and report.achieved_rate < SHORTFALL * rate:
        click.echo(
            f"  sent at {report.achieved_rate:,.0f}/s, below the {rate:,g}/s asked: the producer or the "
            "broker could not keep up"
        )
    for typology, instances in report.instances_per_typology.items():
        sent = report.payments_per_typology[typology]
        click.echo(f"  {typology:<13} {instances} instance(s), {sent} payment(s) sent")
    click.echo(f"  background    {report.payments_per_typology['background']} payment(s) sent")
    if report.ground_truth_path:
        click.echo(f"ground truth: {report.ground_truth_path}")
        unsent = [i for i in simulation.instances if not set(i.payment_ids) <= report.placements.keys()]
        if unsent:  # written whole before the first send
            click.echo(
                f"  it lists {len(unsent)} instance(s) not fully sent: score against the sent ones only"
            )
