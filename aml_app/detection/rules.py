"""Service-A's AML rules: one pure function per laundering typology, `(evidence, thresholds) -> Hit | None`.

Why pure: the freshness gate guarantees the evidence already includes the payment being decided, so a
rule is a plain function of that evidence; it can be tested on hand-built answers and replayed on
simulated traffic without Kafka, Spark or HTTP.

Conventions shared by every rule:
- Windows are Service C's (at - w, at] at the payment's event time and include the payment itself.
- Amounts are compared in the payment's own currency, with no FX conversion: sums in other currencies
  are ignored, and an average is "sum in this currency / count of all payments in the window" (payments
  in other currencies only make it smaller, so they never cause a hit).
- Every comparison with a threshold is inclusive (>=), except Service C's "near the threshold" band,
  which is [threshold * (1 - band), threshold): exactly at the reporting threshold is reported anyway.
- Averages are compared by multiplication (sum >= minimum * count): exact, and no division by zero.

Typologies (names are part of the decision record): structuring, fan_in, fan_out, cycle, pass_through.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from aml_app.detection.evidence import Evidence
from aml_app.detection.thresholds import AmlThresholds

TYPOLOGIES = ("structuring", "fan_in", "fan_out", "cycle", "pass_through")
FAN_WINDOW = "24h"  # fan-in/fan-out look at one day of activity
PASS_THROUGH_WINDOW = "1h"  # money that leaves within the hour it arrived


@dataclass(frozen=True)
class Hit:
    """One rule that fired on one payment, with the figures that made it fire."""

    rule: str
    typology: str
    reason: str
    figures: Mapping[str, str | int] = field(default_factory=dict)
    path: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The hit as it goes into a decision record."""
        return {
            "rule": self.rule,
            "typology": self.typology,
            "reason": self.reason,
            "figures": dict(self.figures),
            "path": list(self.path),
        }


def money(value: Decimal) -> str:
    """Plain decimal text for figures and reasons (no exponent)."""
    return format(value, "f")


def average(total: Decimal, count: int) -> Decimal:
    """Display value only; rules compare by multiplication."""
    return (total / count).quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN) if count else Decimal(0)


def structuring(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """The payment is just under the reporting threshold and the payer already did that several times in
    24h (this payment included): amounts split to stay under the reporting duty."""
    aggregates = evidence.payer_aggregates
    if not aggregates.is_near_threshold(evidence.amount):
        return None
    count = aggregates.near_threshold_24h
    if count < thresholds.structuring_min_count:
        return None
    low = aggregates.reporting_threshold * (1 - aggregates.threshold_band)
    return Hit(
        rule="aml.structuring",
        typology="structuring",
        reason=(
            f"{evidence.payer} sent {count} payments in 24h just under the reporting threshold "
            f"(from {money(low)} up to {money(aggregates.reporting_threshold)}), this one of "
            f"{money(evidence.amount)} {evidence.currency} included."
        ),
        figures={
            "near_threshold_24h": count,
            "min_count": thresholds.structuring_min_count,
            "amount": money(evidence.amount),
            "currency": evidence.currency,
            "reporting_threshold": money(aggregates.reporting_threshold),
            "threshold_band": money(aggregates.threshold_band),
        },
    )


def _fan(
    evidence: Evidence,
    account: str,
    counterparties: int,
    count: int,
    total: Decimal,
    min_counterparties: int,
    min_average: Decimal,
    typology: str,
    activity: str,
) -> Hit | None:
    if counterparties < min_counterparties or count == 0 or total < min_average * count:
        return None
    mean = average(total, count)
    return Hit(
        rule=f"aml.{typology}",
        typology=typology,
        reason=(
            f"{account} {activity.format(count=count, counterparties=counterparties)} in {FAN_WINDOW}, "
            f"{money(mean)} {evidence.currency} on average."
        ),
        figures={
            "account": account,
            "counterparties": counterparties,
            "min_counterparties": min_counterparties,
            "payments": count,
            "total": money(total),
            "average": money(mean),
            "min_average": money(min_average),
            "currency": evidence.currency,
            "window": FAN_WINDOW,
        },
    )


def fan_in(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """Many distinct payers paying substantial amounts into the payee (collection account). The average
    keeps busy merchants, who receive many small payments, out."""
    window = evidence.payee_aggregates.window(FAN_WINDOW)
    return _fan(
        evidence,
        evidence.payee,
        window.received_counterparties,
        window.received_count,
        window.received_in(evidence.currency),
        thresholds.fan_in_min_counterparties,
        thresholds.fan_in_min_average,
        "fan_in",
        "received {count} payments from {counterparties} distinct payers",
    )


def fan_out(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """The payer spreads substantial amounts over many distinct payees (distribution account)."""
    window = evidence.payer_aggregates.window(FAN_WINDOW)
    return _fan(
        evidence,
        evidence.payer,
        window.sent_counterparties,
        window.sent_count,
        window.sent_in(evidence.currency),
        thresholds.fan_out_min_counterparties,
        thresholds.fan_out_min_average,
        "fan_out",
        "sent {count} payments to {counterparties} distinct payees",
    )


def cycle(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """Money returns to the payer within a few hops, and this payment is the cycle's first edge (so the
    alert lands on a payment that is part of the loop, not on any payment of an account on a loop)."""
    found = evidence.payer_relations.cycle
    if not found.found or not thresholds.cycle_min_hops <= found.hops <= thresholds.cycle_max_hops:
        return None
    if found.path[1] != evidence.payee:
        return None
    return Hit(
        rule="aml.cycle",
        typology="cycle",
        reason=(
            f"Money from {evidence.payer} comes back to it in {found.hops} hops: {' -> '.join(found.path)}."
        ),
        figures={"hops": found.hops, "max_hops": thresholds.cycle_max_hops},
        path=found.path,
    )


def pass_through(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """The payer received a large amount and sent most of it on within the same hour (a mule account)."""
    window = evidence.payer_aggregates.window(PASS_THROUGH_WINDOW)
    received = window.received_in(evidence.currency)
    sent = window.sent_in(evidence.currency)
    if received < thresholds.pass_through_min_received or sent < thresholds.pass_through_min_ratio * received:
        return None
    return Hit(
        rule="aml.pass_through",
        typology="pass_through",
        reason=(
            f"{evidence.payer} received {money(received)} {evidence.currency} and sent {money(sent)} on "
            f"within {PASS_THROUGH_WINDOW}."
        ),
        figures={
            "received": money(received),
            "sent": money(sent),
            "currency": evidence.currency,
            "min_received": money(thresholds.pass_through_min_received),
            "min_ratio": money(thresholds.pass_through_min_ratio),
            "window": PASS_THROUGH_WINDOW,
        },
    )


AML_RULES: tuple[Callable[[Evidence, AmlThresholds], Hit | None], ...] = (
    structuring,
    fan_in,
    fan_out,
    cycle,
    pass_through,
)


def aml_rules(evidence: Evidence, thresholds: AmlThresholds) -> list[Hit]:
    """Every AML rule that fires on this payment, in the order of TYPOLOGIES."""
    return [hit for rule in AML_RULES if (hit := rule(evidence, thresholds)) is not None]
