"""Service-A1's fraud rules: different questions on the same gated evidence as the AML rules.

Why a separate rule set: fraud looks for a payer being abused (an account takeover paying a new
beneficiary, a burst of payments), AML for a payer abusing the system; both need the payment itself
already in Services B and C, which the freshness gate guarantees. Inclusive thresholds and amounts in the
reporting currency, as the AML rules: `large_new_counterparty_min_amount` is converted into the
payment's currency to the cent (`ExchangeRates.in_one`), so 5,000 yen is not a large payment where the
reporting currency is the dollar, and a currency without a rate is never large. As there, a self-payment
moves no money between parties: no rule is asked about it (B's graph counts it as an edge to the payer
itself, a "new counterparty" the first time).
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal

from aml_app.detection.evidence import Evidence
from aml_app.detection.rules import Hit, average, money
from aml_app.detection.thresholds import FraudThresholds

FRAUD_TYPOLOGIES = ("large_new_counterparty", "velocity_spike")
HOURS_PER_WEEK = 7 * 24


def large_new_counterparty(evidence: Evidence, thresholds: FraudThresholds) -> Hit | None:
    """A large payment that is the payer's first ever to this payee: B's edge to it, as of the payment's
    time, begins at the payment's time (its count would also take another payment of the same instant,
    and neither would be first). No edge at all means B has not seen it: no evidence, no hit."""
    least = thresholds.rates.in_one(thresholds.large_new_counterparty_min_amount, evidence.currency)
    if least is None or evidence.amount < least:
        return None
    edge = evidence.payer_relations.out.get(evidence.payee)
    if edge is None or edge.first_seen != evidence.ts:
        return None
    return Hit(
        rule="fraud.large_new_counterparty",
        typology="large_new_counterparty",
        reason=(
            f"{evidence.payer} paid {money(evidence.amount)} {evidence.currency} to {evidence.payee}, "
            "its first payment to that payee."
        ),
        figures={
            "amount": money(evidence.amount),
            "currency": evidence.currency,
            "min_amount": money(least),  # in the payment's currency
            "min_amount_reporting": money(thresholds.large_new_counterparty_min_amount),
            "reporting_currency": thresholds.rates.reporting,
            "payments_to_payee": edge.count,
        },
    )


def velocity_spike(evidence: Evidence, thresholds: FraudThresholds) -> Hit | None:
    """The payer sent far more payments in the last hour than its hourly average over 7 days.

    The 7-day window includes the last hour, and the average is over all 168 hours, whatever the account's
    age: an account with no history is a spike as soon as it reaches the minimum count. Compared exactly:
    count_1h * 168 >= multiple * count_7d.
    """
    aggregates = evidence.payer_aggregates
    last_hour = aggregates.window("1h").sent_count
    week = aggregates.window("7d").sent_count
    if last_hour < thresholds.velocity_min_count:
        return None
    if last_hour * HOURS_PER_WEEK < thresholds.velocity_multiple * week:
        return None
    hourly = money(average(Decimal(week), HOURS_PER_WEEK))
    return Hit(
        rule="fraud.velocity_spike",
        typology="velocity_spike",
        reason=(
            f"{evidence.payer} sent {last_hour} payments in the last hour against {hourly} per hour on "
            "average over 7 days."
        ),
        figures={
            "sent_1h": last_hour,
            "sent_7d": week,
            "hourly_average_7d": hourly,
            "min_count": thresholds.velocity_min_count,
            "multiple": money(thresholds.velocity_multiple),
        },
    )


FRAUD_RULES: tuple[Callable[[Evidence, FraudThresholds], Hit | None], ...] = (
    large_new_counterparty,
    velocity_spike,
)


def fraud_rules(evidence: Evidence, thresholds: FraudThresholds) -> list[Hit]:
    """Every fraud rule that fires on this payment, in the order of FRAUD_TYPOLOGIES; none on a
    self-payment."""
    if evidence.payer == evidence.payee:
        return []
    return [hit for rule in FRAUD_RULES if (hit := rule(evidence, thresholds)) is not None]
