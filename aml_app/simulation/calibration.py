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
