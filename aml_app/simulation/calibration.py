"""Measures of background traffic, to compare a simulator's with real AMLworld rows (pure, no Kafka).

Why: the detectors' benign alert rate depends on what ordinary traffic looks like: how often accounts
pay themselves, how large and how concentrated payments are, how often the same pair pays again. These
measures say it in a few numbers that any list of payment-like objects (`payer`, `payee`, `amount`,
`currency`, `ts`, `channel`) gives, so a simulator can be held to the real rows' values.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from aml_app.detection.exchange import ExchangeRates

QUANTILES = (0.1, 0.5, 0.9, 0.99)


@dataclass(frozen=True)
class BackgroundMeasures:
    """What a stretch of ordinary traffic looks like, in numbers."""

    payments: int
    hours: float
    self_share: float  # payments whose payer is their payee
    channels: Mapping[str, float]  # share of payments per channel (payment format)
    currencies: Mapping[str, float]  # share of payments per currency
    amounts: Mapping[str, float]  # quantiles of the amounts between two parties, reporting currency
    busiest_payer_share: float  # share of the payments between two parties made by the busiest payer
    top_percent_share: float  # the same for the busiest 1 % of payers
    repeat_ratio: float  # payments between two parties per distinct (payer, payee) pair
    per_payer_hour: float  # payments between two parties per paying account and hour

    def as_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def measure(payments: Iterable[Any], rates: ExchangeRates | None = None) -> BackgroundMeasures:
    """The measures of `payments` (at least one between two parties); amounts without a rate are left out
    of the quantiles."""
    rates = rates or ExchangeRates()
    rows = list(payments)
    between = [p for p in rows if p.payer != p.payee]
    if not between:
        raise ValueError("no payment between two parties to measure")
    times = [_instant(p.ts) for p in rows]
    hours = max((max(times) - min(times)).total_seconds() / 3600, 1 / 60)
    converted = sorted(
        float(amount)
        for p in between
        if (amount := rates.convert(Decimal(str(p.amount)), p.currency)) is not None
    )
    cuts = (
        statistics.quantiles(converted, n=100, method="inclusive") if len(converted) > 1 else converted * 99
    )
    by_payer = Counter(p.payer for p in between)
    ranked = [n for _, n in by_payer.most_common()]
    top = max(1, len(ranked) // 100)
    return BackgroundMeasures(
        payments=len(rows),
        hours=round(hours, 3),
        self_share=_ratio(len(rows) - len(between), len(rows)),
        channels=_shares(p.channel for p in rows),
        currencies=_shares(p.currency for p in rows),
        amounts={f"p{round(q * 100)}": round(cuts[round(q * 100) - 1], 2) for q in QUANTILES},
        busiest_payer_share=_ratio(ranked[0], len(between)),
        top_percent_share=_ratio(sum(ranked[:top]), len(between)),
        repeat_ratio=round(len(between) / len({(p.payer, p.payee) for p in between}), 3),
        per_payer_hour=round(len(between) / len(by_payer) / hours, 3),
    )


def _instant(ts: Any) -> datetime:
    return ts if isinstance(ts, datetime) else datetime.fromisoformat(str(ts))


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0


def _shares(values: Iterable[str]) -> dict[str, float]:
    counts = Counter(values)
    total = sum(counts.values())
    return {k: _ratio(n, total) for k, n in counts.most_common()}


@dataclass(frozen=True)
class PatternMeasures:
    """What one typology's laundering attempts look like, in numbers (medians over attempts unless said)."""

    attempts: int
    payments: float  # payments per attempt (a mean: sizes are bimodal, a median jumps between modes)
    largest: int  # payments of the largest attempt
    span_hours: float  # first to last payment
    single_currency: float  # share of attempts paid in one currency
    in_degree: float  # the most payments into one account of the attempt
    out_degree: float  # the most payments out of one account of the attempt
    forwarded: tuple[float, float, float] | None  # q10, q50, q90 of what a hop passes on / what it got
    hop_hours: float | None  # from a payment into an account to the next payment out of it
    ach: float  # share of payments in ACH

    def as_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def measure_patterns(
    attempts: Iterable[Any], payments: Iterable[Any], rates: ExchangeRates | None = None
) -> dict[str, PatternMeasures]:
    """Per typology, the measures of `attempts` (each with `typology` and `payment_ids`) whose payments
    are among `payments` (a patterns file's, `aml_app.simulation.amlworld.read_patterns`)."""
    rates = rates or ExchangeRates()
    by_id = {p.payment_id: p for p in payments}
    grouped: dict[str, list[list[Any]]] = {}
    for attempt in attempts:
        rows = sorted((by_id[pid] for pid in attempt.payment_ids if pid in by_id), key=lambda p: p.ts)
        if rows:
            grouped.setdefault(attempt.typology, []).append(rows)
    return {typology: _pattern(groups, rates) for typology, groups in sorted(grouped.items())}


def _pattern(groups: list[list[Any]], rates: ExchangeRates) -> PatternMeasures:
    forwarded: list[float] = []
    hops: list[float] = []
    for rows in groups:
        last_in: dict[str, tuple[datetime, Decimal | None]] = {}
        for p in rows:
            value = rates.convert(Decimal(str(p.amount)), p.currency)
            got = last_in.get(p.payer)
            if got is not None:
                hops.append((_instant(p.ts) - got[0]).total_seconds() / 3600)
                if got[1] and value is not None:
                    forwarded.append(float(value / got[1]))
            last_in[p.payee] = (_instant(p.ts), value)
    forwarded.sort()
    return PatternMeasures(
        attempts=len(groups),
        payments=round(statistics.mean(len(rows) for rows in groups), 1),
        largest=max(len(rows) for rows in groups),
        span_hours=round(
            statistics.median(
                (_instant(r[-1].ts) - _instant(r[0].ts)).total_seconds() / 3600 for r in groups
            ),
            1,
        ),
        single_currency=_ratio(sum(len({p.currency for p in rows}) == 1 for rows in groups), len(groups)),
        in_degree=statistics.median(max(Counter(p.payee for p in rows).values()) for rows in groups),
        out_degree=statistics.median(max(Counter(p.payer for p in rows).values()) for rows in groups),
        forwarded=(
            tuple(round(forwarded[int(q * (len(forwarded) - 1))], 3) for q in (0.1, 0.5, 0.9))  # type: ignore[arg-type]
            if forwarded
            else None
        ),
        hop_hours=round(statistics.median(hops), 1) if hops else None,
        ach=_ratio(sum(p.channel == "ach" for rows in groups for p in rows), sum(len(r) for r in groups)),
    )


#: How close a simulator's background must come to the real rows' (`background_gaps`): shares within an
#: absolute difference, amounts and rates within a factor.
BACKGROUND_BOUNDS = {
    "self_share": 0.02,
    "channels": 0.02,
    "amounts": 2.0,
    "amount_p99": 3.0,  # a hundredth of 2,000 real payments: a noisy figure
    "busiest_payer_share": 0.02,
    "top_percent_share": 0.03,
    "repeat_ratio": 0.2,
    "per_payer_hour": 1.3,
}
#: How close a simulator's attempts must come to a patterns file's, per typology (`pattern_gaps`).
PATTERN_BOUNDS = {
    "payments": 1.5,  # factor
    "largest": 3,  # payments, either way
    "span_hours": 1.4,  # factor
    "single_currency": 0.2,  # absolute
    "in_degree": 3,  # payments, either way
    "out_degree": 3,
    "forwarded": 0.06,  # absolute, each of q10, q50, q90
    "hop_hours": 1.6,  # factor
    "ach": 0.01,  # absolute
}


def _within_factor(real: float, simulated: float, factor: float) -> bool:
    return real / factor <= simulated <= real * factor if real > 0 else simulated == real


def background_gaps(real: BackgroundMeasures, simulated: BackgroundMeasures) -> list[str]:
    """The measures on which `simulated` is out of BACKGROUND_BOUNDS of `real`, one sentence each."""
    b = BACKGROUND_BOUNDS
    gaps = []
    for name in ("self_share", "busiest_payer_share", "top_percent_share", "repeat_ratio"):
        r, s = getattr(real, name), getattr(simulated, name)
        if abs(r - s) > b[name]:
            gaps.append(f"{name} is {s}, real {r} (within {b[name]})")
    for channel in sorted(set(real.channels) | set(simulated.channels)):
        r, s = real.channels.get(channel, 0.0), simulated.channels.get(channel, 0.0)
        if abs(r - s) > b["channels"]:
            gaps.append(f"channel {channel} has {s} of payments, real {r} (within {b['channels']})")
    for cut, r in real.amounts.items():
        s, factor = simulated.amounts.get(cut, 0.0), b["amount_p99" if cut == "p99" else "amounts"]
        if not _within_factor(r, s, factor):
            gaps.append(f"amount {cut} is {s}, real {r} (within a factor {factor})")
    if not _within_factor(real.per_payer_hour, simulated.per_payer_hour, b["per_payer_hour"]):
        gaps.append(
            f"per_payer_hour is {simulated.per_payer_hour}, real {real.per_payer_hour} "
            f"(within a factor {b['per_payer_hour']})"
        )
    return gaps


def pattern_gaps(real: Mapping[str, PatternMeasures], simulated: Mapping[str, PatternMeasures]) -> list[str]:
    """The typologies and measures on which `simulated` is out of PATTERN_BOUNDS of `real`."""
    b = PATTERN_BOUNDS
    gaps = []
    for typology, r in real.items():
        s = simulated.get(typology)
        if s is None:
            gaps.append(f"{typology}: no attempt simulated")
            continue
        for name in ("payments", "span_hours", "hop_hours"):
            rv, sv = getattr(r, name), getattr(s, name)
            if (rv is None) != (sv is None) or (rv is not None and not _within_factor(rv, sv, b[name])):
                gaps.append(f"{typology}: {name} is {sv}, real {rv} (within a factor {b[name]})")
        for name in ("largest", "single_currency", "in_degree", "out_degree", "ach"):
            rv, sv = getattr(r, name), getattr(s, name)
            if abs(rv - sv) > b[name]:
                gaps.append(f"{typology}: {name} is {sv}, real {rv} (within {b[name]})")
        if (r.forwarded is None) != (s.forwarded is None) or (
            r.forwarded is not None
            and s.forwarded is not None
            and typology != "gather_scatter"  # a hub's payments out are not its payments in passed on
            and any(abs(x - y) > b["forwarded"] for x, y in zip(r.forwarded, s.forwarded, strict=True))
        ):
            gaps.append(
                f"{typology}: forwarded is {s.forwarded}, real {r.forwarded} (within {b['forwarded']})"
            )
    return gaps
