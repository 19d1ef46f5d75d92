"""Service-A's AML rules: one pure function per laundering typology, `(evidence, thresholds) -> Hit | None`.

Why pure: the freshness gate guarantees the evidence already includes the payment being decided, so a
rule is a plain function of that evidence; it can be tested on hand-built answers and replayed on
simulated traffic without Kafka, Spark or HTTP.

Conventions shared by every rule:
- Windows are Service C's (at - w, at] at the payment's event time and include the payment itself.
- Amounts are compared in the reporting currency: every per-currency sum of Service C is converted with
  the configured rates (`thresholds.rates`), and an average is "converted sum / count of all payments in
  the window". A currency without a rate counts as nothing (it never causes a hit) and is named in the
  figures.
- Every comparison with a threshold is inclusive (>=), except Service C's "near the threshold" band,
  which is [threshold * (1 - band), threshold): exactly at the reporting threshold is reported anyway.
- Averages are compared by multiplication (sum >= minimum * count): exact, and no division by zero.

- The layering rules (gather_scatter's intake, scatter_gather, bipartite, stack, random) count only
  *heavy* flows: an edge whose average payment is at least `graph_min_average` (Service B filters its
  graph answers with it). Everyday payments (shops, friends) never make such a structure.

Typologies (names are part of the decision record): the eight patterns IBM's AMLworld data set labels
(fan_in, fan_out, gather_scatter, scatter_gather, cycle, random, bipartite, stack) and two classic ones
(structuring, pass_through). Each rule fires only on a payment that is part of its pattern. A stack is
two bipartite layers: its second layer is reported as stack (not as bipartite or scatter_gather); its
first layer cannot be told from a bipartite block when it is paid, and is reported as bipartite.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from aml_app.detection.evidence import Evidence
from aml_app.detection.thresholds import AmlThresholds

TYPOLOGIES = (
    "structuring",
    "fan_in",
    "fan_out",
    "gather_scatter",
    "scatter_gather",
    "cycle",
    "random",
    "bipartite",
    "stack",
    "pass_through",
)
FAN_WINDOW = "7d"  # fans and gathers spread over days: AMLworld's median fan spans about five
PASS_THROUGH_WINDOW = "1h"  # money that leaves within the hour it arrived


@dataclass(frozen=True)
class Hit:
    """One rule that fired on one payment, with the figures that made it fire."""

    rule: str
    typology: str
    reason: str
    figures: Mapping[str, str | int] = field(default_factory=dict)
    path: tuple[str, ...] = ()
    #: What ranks the alert in the analysts' queue: the learned model's score of the payment
    #: (`aml_app.detection.model`: its probability that the payment is not benign), or with the rules
    #: alone the rule's strength (`strengthened`); None where neither scored it.
    score: float | None = None

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


def _unconverted(thresholds: AmlThresholds, *sums: Mapping[str, Decimal]) -> dict[str, str]:
    """The figure naming the currencies of `sums` that have no rate (and so counted nothing), if any."""
    missing = sorted({c for amounts in sums for c in thresholds.rates.unconverted(amounts)})
    return {"unconverted": ", ".join(missing)} if missing else {}


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
    sums: Mapping[str, Decimal],
    min_counterparties: int,
    min_average: Decimal,
    typology: str,
    activity: str,
    thresholds: AmlThresholds,
) -> Hit | None:
    currency, total = thresholds.rates.reporting, thresholds.rates.total(sums)
    if counterparties < min_counterparties or count == 0 or total < min_average * count:
        return None
    if count > thresholds.fan_max_payments_per_counterparty * counterparties:
        return None
    mean = average(total, count)
    return Hit(
        rule=f"aml.{typology}",
        typology=typology,
        reason=(
            f"{account} {activity.format(count=count, counterparties=counterparties)} in {FAN_WINDOW}, "
            f"{money(mean)} {currency} on average."
        ),
        figures={
            "account": account,
            "counterparties": counterparties,
            "min_counterparties": min_counterparties,
            "payments": count,
            "total": money(total),
            "average": money(mean),
            "min_average": money(min_average),
            "max_payments_per_counterparty": money(thresholds.fan_max_payments_per_counterparty),
            "currency": currency,
            "window": FAN_WINDOW,
            **_unconverted(thresholds, sums),
        },
    )


def fan_in(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """Many distinct payers paying substantial amounts into the payee (collection account), each about
    once. The average keeps busy merchants, who receive many small payments, out; "about once" keeps out
    a business whose regular customers pay again and again."""
    window = evidence.payee_aggregates.window(FAN_WINDOW)
    return _fan(
        evidence,
        evidence.payee,
        window.received_counterparties,
        window.received_count,
        window.received,
        thresholds.fan_in_min_counterparties,
        thresholds.fan_in_min_average,
        "fan_in",
        "received {count} payments from {counterparties} distinct payers",
        thresholds,
    )


def fan_out(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """The payer spreads substantial amounts over many distinct payees (distribution account), each about
    once: a payroll or a supplier run pays the same payees again and again."""
    window = evidence.payer_aggregates.window(FAN_WINDOW)
    return _fan(
        evidence,
        evidence.payer,
        window.sent_counterparties,
        window.sent_count,
        window.sent,
        thresholds.fan_out_min_counterparties,
        thresholds.fan_out_min_average,
        "fan_out",
        "sent {count} payments to {counterparties} distinct payees",
        thresholds,
    )


def cycle(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """Money that left the payee comes back to it through this payment: Service B's `loop`, a cycle of
    `cycle_min_hops`..`cycle_max_hops` payments, each paid no earlier than the one before, that this payment
    closes. Time order keeps out a cycle that money could not have gone around (paid back before it was
    paid out); AMLworld's cycles run up to 13 payments over days."""
    found = evidence.payee_relations.loop
    if not found.found or not thresholds.cycle_min_hops <= found.hops <= thresholds.cycle_max_hops:
        return None
    if found.path[-2] != evidence.payer:
        return None
    return Hit(
        rule="aml.cycle",
        typology="cycle",
        reason=(
            f"Money from {evidence.payee} comes back to it in {found.hops} payments, each after the one "
            f"before, this one last: {' -> '.join(found.path)}."
        ),
        figures={"hops": found.hops, "max_hops": thresholds.cycle_max_hops},
        path=found.path,
    )


def pass_through(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """The payer received a large amount and sent about as much on within the same hour (a mule account):
    at least `pass_through_min_ratio` and at most `pass_through_max_ratio` of it. An account that pays
    out many times what came in spends its own money; it is not passing money through."""
    window = evidence.payer_aggregates.window(PASS_THROUGH_WINDOW)
    received = thresholds.rates.total(window.received)
    sent = thresholds.rates.total(window.sent)
    currency = thresholds.rates.reporting
    if received < thresholds.pass_through_min_received or sent < thresholds.pass_through_min_ratio * received:
        return None
    if sent > thresholds.pass_through_max_ratio * received:
        return None
    return Hit(
        rule="aml.pass_through",
        typology="pass_through",
        reason=(
            f"{evidence.payer} received {money(received)} {currency} and sent {money(sent)} on "
            f"within {PASS_THROUGH_WINDOW}."
        ),
        figures={
            "received": money(received),
            "sent": money(sent),
            "currency": currency,
            "min_received": money(thresholds.pass_through_min_received),
            "min_ratio": money(thresholds.pass_through_min_ratio),
            "max_ratio": money(thresholds.pass_through_max_ratio),
            "window": PASS_THROUGH_WINDOW,
            **_unconverted(thresholds, window.received, window.sent),
        },
    )


def gather_scatter(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """The payer collected substantial amounts from many payers and spreads money over many payees in the
    same week: a hub between two fans. Fires on the scatter side (the hub's payments)."""
    window = evidence.payer_aggregates.window(FAN_WINDOW)
    minimum = thresholds.gather_scatter_min_counterparties
    received = thresholds.rates.total(window.received)
    currency = thresholds.rates.reporting
    if window.received_counterparties < minimum or window.sent_counterparties < minimum:
        return None
    if window.received_count == 0 or received < thresholds.graph_min_average * window.received_count:
        return None
    return Hit(
        rule="aml.gather_scatter",
        typology="gather_scatter",
        reason=(
            f"{evidence.payer} received from {window.received_counterparties} distinct payers "
            f"({money(average(received, window.received_count))} {currency} on average) and sent to "
            f"{window.sent_counterparties} distinct payees in {FAN_WINDOW}."
        ),
        figures={
            "payers": window.received_counterparties,
            "payees": window.sent_counterparties,
            "min_counterparties": minimum,
            "received": money(received),
            "received_count": window.received_count,
            "min_average": money(thresholds.graph_min_average),
            "currency": currency,
            "window": FAN_WINDOW,
            **_unconverted(thresholds, window.received),
        },
    )


def _layered_sources(evidence: Evidence) -> dict[str, tuple[str, ...]]:
    """The sources that reach the payee in two heavy steps, this payment's payer among their
    intermediates (so the payment is one of the flow's second steps)."""
    return {s: via for s, via in evidence.payee_relations.sources.items() if evidence.payer in via}


def _stacked(layered: dict[str, tuple[str, ...]], thresholds: AmlThresholds) -> bool:
    """Enough layered sources (`_layered_sources`) for the payment to be a stack's second layer."""
    return len(layered) >= thresholds.stack_min_sources


def _flow_through_payer(evidence: Evidence, thresholds: AmlThresholds) -> tuple[str, ...]:
    """Service B's flow into the payee that this payment continues (its last edge the payer's), if the
    payment is heavy: at least the heavy minimum in its own currency, to the cent, as B was asked (a
    payment B counts heavy at its rounded minimum converted back fell a fraction of a cent short)."""
    chain = evidence.payee_relations.chain
    if len(chain) < 2 or chain[-2] != evidence.payer:
        return ()
    minimum = thresholds.rates.in_one(thresholds.graph_min_average, evidence.currency)
    if minimum is None or evidence.amount < minimum:
        return ()
    return chain


def stack(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """Money goes through two layers of accounts: several sources reach the payee through the same layer
    of intermediates, the payer among them (two bipartite layers stacked: sources -> intermediates ->
    destinations); or the payer relays what one heavy payment brought it (Service B's flow through the
    payer is two payments long, this one the second). AMLworld's stacks are mostly such relays: disjoint
    two-hop chains, each passing on 0.95-1.05 of what it got within days. A longer flow is a random walk."""
    layered = _layered_sources(evidence)
    if _stacked(layered, thresholds):
        intermediates = sorted({m for via in layered.values() for m in via})
        return Hit(
            rule="aml.stack",
            typology="stack",
            reason=(
                f"{len(layered)} sources reach {evidence.payee} through the same intermediates "
                f"({', '.join(intermediates)}), {evidence.payer} among them."
            ),
            figures={
                "sources": len(layered),
                "min_sources": thresholds.stack_min_sources,
                "intermediates": len(intermediates),
                "min_average": money(thresholds.graph_min_average),
            },
            path=(min(layered), evidence.payer, evidence.payee),
        )
    chain = _flow_through_payer(evidence, thresholds)
    if not 2 == len(chain) - 1 < thresholds.random_min_hops:
        return None
    return Hit(
        rule="aml.stack",
        typology="stack",
        reason=(
            f"{evidence.payer} passes on to {evidence.payee} about what {chain[0]} paid it before "
            f"(0.8-1.25 times, heavy): money relayed through two layers, {' -> '.join(chain)}."
        ),
        figures={"relayed_by": evidence.payer, "min_average": money(thresholds.graph_min_average)},
        path=chain,
    )


def scatter_gather(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """One source split money over several intermediates, which pass it on to the payee: the payee
    gathers what one source scattered. Not reported when the layers are a stack."""
    layered = _layered_sources(evidence)
    if not layered or _stacked(layered, thresholds):
        return None
    source = min(layered, key=lambda s: (-len(layered[s]), s))
    via = layered[source]
    if len(via) < thresholds.scatter_gather_min_intermediates:
        return None
    return Hit(
        rule="aml.scatter_gather",
        typology="scatter_gather",
        reason=(
            f"{source} reaches {evidence.payee} through {len(via)} intermediates ({', '.join(via)}), "
            f"{evidence.payer} among them."
        ),
        figures={
            "source": source,
            "intermediates": len(via),
            "min_intermediates": thresholds.scatter_gather_min_intermediates,
            "min_average": money(thresholds.graph_min_average),
        },
        path=(source, evidence.payer, evidence.payee),
    )


def bipartite(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """The payee belongs to a block of payees that share the same heavy payers, and the payer pays into
    that block: a many-to-many (bipartite) transfer between two groups. A stacked block is a stack."""
    if _stacked(_layered_sources(evidence), thresholds):
        return None
    paid = evidence.payer_relations.out
    block = sorted(
        account
        for account, shared in evidence.payee_relations.co_payees.items()
        if shared >= thresholds.bipartite_min_sources and account in paid
    )
    if len(block) + 1 < thresholds.bipartite_min_destinations:
        return None
    return Hit(
        rule="aml.bipartite",
        typology="bipartite",
        reason=(
            f"{evidence.payee} and {', '.join(block)} share {thresholds.bipartite_min_sources} or more heavy "
            f"payers, {evidence.payer} among them."
        ),
        figures={
            "destinations": len(block) + 1,
            "min_destinations": thresholds.bipartite_min_destinations,
            "min_sources": thresholds.bipartite_min_sources,
            "min_average": money(thresholds.graph_min_average),
        },
    )


def random_walk(evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """The payment continues a flow of heavy payments through distinct accounts (a layering walk that
    does not come back; a cycle is the cycle rule's): Service B's `chain` of the payee through this
    payer, in which each payment came after the one before and passed on 0.8-1.25 times what it got.
    Heavy payments between unrelated accounts chain up within days in any real traffic; money that is
    passed on keeps its amount and its order."""
    chain = _flow_through_payer(evidence, thresholds)
    hops = len(chain) - 1
    if hops < thresholds.random_min_hops:
        return None
    return Hit(
        rule="aml.random",
        typology="random",
        reason=f"Heavy payments pass money on {hops} times in a row: {' -> '.join(chain)}.",
        figures={
            "hops": hops,
            "min_hops": thresholds.random_min_hops,
            "min_average": money(thresholds.graph_min_average),
        },
        path=chain,
    )


AML_RULES: tuple[Callable[[Evidence, AmlThresholds], Hit | None], ...] = (
    structuring,
    fan_in,
    fan_out,
    gather_scatter,
    scatter_gather,
    cycle,
    random_walk,
    bipartite,
    stack,
    pass_through,
)


#: Each AML rule's strength, by which the rules alone rank their alerts (`strengthened`): the share of its
#: alerts that were laundering on the calibrated simulator's runs the shipped model learns from (AMLworld's
#: shapes and background, default thresholds; the shipped model file's `training.rule_precision`, which a
#: test holds it to). Structuring is no AMLworld typology: its alerts there are all benign.
RULE_STRENGTH: Mapping[str, float] = {
    "aml.structuring": 0.0,
    "aml.fan_in": 0.6753,
    "aml.fan_out": 0.6284,
    "aml.gather_scatter": 0.5594,
    "aml.scatter_gather": 1.0,
    "aml.cycle": 0.9273,
    "aml.random": 0.8892,
    "aml.bipartite": 0.6016,
    "aml.stack": 0.7242,
    "aml.pass_through": 0.9524,
}


def strengthened(hits: list[Hit]) -> list[Hit]:
    """The rules' hits, each scored by its rule's strength (`RULE_STRENGTH`): the rules alone have no
    model's probability to rank an analyst's queue by, but some of them are right far more often than
    others."""
    return [replace(hit, score=RULE_STRENGTH.get(hit.rule)) for hit in hits]


def aml_rules(evidence: Evidence, thresholds: AmlThresholds) -> list[Hit]:
    """Every AML rule that fires on this payment, in the order of TYPOLOGIES. A self-payment moves no
    money between parties, so it is part of no pattern and no rule is asked about it."""
    if evidence.payer == evidence.payee:
        return []
    return [hit for rule in AML_RULES if (hit := rule(evidence, thresholds)) is not None]
