"""Sends a simulation to Kafka at a steady rate (aiokafka, key = payer, acks=all).

Pacing is scheduled against one monotonic start: payment n is due at start + n / rate, and each wake-up
sends every payment that is due, in one burst of at most `BURST_SECONDS` of the rate. A slow send or a
late wake-up therefore never shifts the schedule (no drift); the next burst is simply larger, up to that
bound, so that a producer slower than the rate still stops promptly and reports progress (and the run
reports the rate it reached). Every burst's deliveries are awaited before the next one, so
`placements` only lists payments the broker acknowledged, in send order.

The simulation (and so the ground truth) is built before anything is sent; the ground truth file is
written before the first send, so a consumer can score decisions while they arrive.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction

from aiokafka import AIOKafkaProducer

from aml_app.detection.rules import TYPOLOGIES
from aml_app.detection.thresholds import AmlThresholds
from aml_app.kafka.security import PLAINTEXT, KafkaSecurity
from aml_app.kafka.tools import started_producer
from aml_app.simulation.traffic import (
    DEFAULT_BAND,
    DEFAULT_SPEEDUP,
    DEFAULT_THRESHOLD,
    SimPayment,
    Simulation,
    default_start,
    simulate,
)

MIN_BURST_INTERVAL = 0.01  # seconds; at high rates, wake up at most this often and send what is due
BURST_SECONDS = 0.1  # a burst holds at most this much of the rate (and at least MIN_BURST payments)
MIN_BURST = 100


@dataclass
class SimulatorReport:
    """What was sent: counts, timing, and where each acknowledged payment landed."""

    topic: str
    planned: int
    simulation: Simulation
    ground_truth_path: str | None
    sent: int = 0
    payments_per_typology: dict[str, int] = field(default_factory=dict)
    instances_per_typology: dict[str, int] = field(default_factory=dict)
    first_sent_at: datetime | None = None
    last_sent_at: datetime | None = None
    elapsed: float = 0.0
    placements: dict[str, tuple[int, int]] = field(default_factory=dict)  # payment_id -> (partition, offset)
    stopped_early: bool = False

    @property
    def achieved_rate(self) -> float:
        return self.sent / self.elapsed if self.elapsed > 0 else 0.0


class GroundTruthError(Exception):
    """The ground truth file cannot be written (nothing was sent)."""


def payment_count(rate: float, duration: float) -> int:
    """Payments in a run of `duration` seconds at `rate` per second; ValueError if none or nonsense.

    Counted on the numbers as written (0.29/s for 100 s is 29 payments; their binary product is 28.99...).
    """
    if not (math.isfinite(rate) and math.isfinite(duration)) or not rate > 0 or not duration > 0:
        raise ValueError(
            f"rate and duration must be positive finite numbers, got rate={rate} and duration={duration}"
        )
    count = math.floor(Fraction(repr(rate)) * Fraction(repr(duration)))
    if count < 1:
        raise ValueError(f"rate {rate}/s for {duration} s sends no payment; send for longer or faster")
    return count


async def run_simulator(
    bootstrap: Sequence[str],
    topic: str,
    rate: float,
    duration: float,
    seed: int,
    ground_truth_path: str | None,
    *,
    start: datetime | None = None,
    speedup: float = DEFAULT_SPEEDUP,
    instances: int | None = None,
    reporting_threshold: Decimal = DEFAULT_THRESHOLD,
    threshold_band: Decimal = DEFAULT_BAND,
    thresholds: AmlThresholds | None = None,
    prefix: str | None = None,
    progress: Callable[[str], None] | None = None,
    progress_interval: float = 5.0,
    producer: AIOKafkaProducer | None = None,
    stop: asyncio.Event | None = None,
    on_sent: Callable[[SimPayment, int, int, float], None] | None = None,
    security: KafkaSecurity = PLAINTEXT,
) -> SimulatorReport:
    """Simulate `rate * duration` payments and send them at `rate` per second; see the module docstring.

    `start` is the first event time (default: `default_start`, which ends the simulated clock at the send
    time of the last payment, so that none is timestamped after it is sent). A given `producer` must be
    started and is left running; otherwise one is created with acks=all and stopped at the end. Setting
    `stop` ends the run after the current burst (`stopped_early` in the report). `on_sent(payment,
    partition, offset, sent_at)` is called for every acknowledged payment as it goes (sent_at: POSIX time
    of its burst). `security` (TLS/SASL) is used for the producer created here.
    """
    count = payment_count(rate, duration)
    simulation = simulate(
        seed,
        count,
        rate,
        default_start(count, rate, speedup, datetime.now(UTC)) if start is None else start,
        speedup=speedup,
        instances=instances,
        reporting_threshold=reporting_threshold,
        threshold_band=threshold_band,
        thresholds=thresholds,
        prefix=prefix,
    )
    if ground_truth_path is not None:
        try:
            simulation.write_ground_truth(ground_truth_path)
        except OSError as exc:
            raise GroundTruthError(
                f"could not write the ground truth to {ground_truth_path}: {exc.strerror or exc}; "
                "nothing was sent"
            ) from None
    report = SimulatorReport(
        topic=topic,
        planned=len(simulation.payments),
        simulation=simulation,
        ground_truth_path=ground_truth_path,
        payments_per_typology={t: 0 for t in (*TYPOLOGIES, "background")},
        instances_per_typology={t: len(simulation.instances_of(t)) for t in TYPOLOGIES},
    )
    owned = producer is None
    if producer is None:
        producer = await started_producer(bootstrap, "aml-simulator", security)
    try:
        await _send_paced(producer, report, rate, stop, progress, progress_interval, on_sent)
    finally:
        if owned:
            await producer.stop()
    return report


async def _send_paced(
    producer: AIOKafkaProducer,
    report: SimulatorReport,
    rate: float,
    stop: asyncio.Event | None,
    progress: Callable[[str], None] | None,
    progress_interval: float,
    on_sent: Callable[[SimPayment, int, int, float], None] | None = None,
) -> None:
    payments = report.simulation.payments
    most = max(MIN_BURST, int(rate * BURST_SECONDS))
    started = time.monotonic()
    next_progress = started + progress_interval
    while report.sent < len(payments):
        if stop is not None and stop.is_set():
            report.stopped_early = True
            break
        now = time.monotonic()
        due = min(len(payments), int((now - started) * rate) + 1, report.sent + most)  # n due at n / rate
        if due > report.sent:
            burst = payments[report.sent : due]
            sent_at = datetime.now(UTC)
            futures = [await producer.send(report.topic, key=p.key, value=p.value()) for p in burst]
            for payment, meta in zip(burst, await asyncio.gather(*futures), strict=True):
                report.placements[payment.payment_id] = (meta.partition, meta.offset)
                report.payments_per_typology[payment.typology or "background"] += 1
                if on_sent is not None:
                    on_sent(payment, meta.partition, meta.offset, sent_at.timestamp())
            report.first_sent_at = report.first_sent_at or sent_at
            report.last_sent_at = sent_at
            report.sent = due
            report.elapsed = time.monotonic() - started
        if progress is not None and report.sent < len(payments) and time.monotonic() >= next_progress:
            next_progress += progress_interval
            progress(_progress_line(report))
        if report.sent < len(payments):
            wait = started + report.sent / rate - time.monotonic()
            await _sleep(max(wait, MIN_BURST_INTERVAL), stop)
    report.elapsed = time.monotonic() - started
    if progress is not None:
        progress(_progress_line(report))


async def _sleep(seconds: float, stop: asyncio.Event | None) -> None:
    """Sleep, but wake at once when `stop` is set (a slow rate must not delay a stop by 1 / rate)."""
    if stop is None:
        await asyncio.sleep(seconds)
        return
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


def _progress_line(report: SimulatorReport) -> str:
    last = report.simulation.payments[report.sent - 1].ts if report.sent else "-"
    injected = sum(n for t, n in report.payments_per_typology.items() if t != "background")
    return (
        f"simulator: {report.sent}/{report.planned} payments sent in {report.elapsed:.1f} s "
        f"({report.achieved_rate:.1f}/s), {injected} of them injected; event time now {last}"
    )
