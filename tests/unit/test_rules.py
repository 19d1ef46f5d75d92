"""AML and fraud rules on hand-built answers of Services B and C: each threshold's boundary (inclusive
unless documented), other currencies converted (or ignored without a rate), empty answers quiet, parsing
faults, and the thresholds' environment variables.

The rules here report in EUR with one rate, 2 USD per EUR, so that converted figures stay readable."""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from aml_app.detection.evidence import Aggregates, Evidence, Relations
from aml_app.detection.exchange import ExchangeRates
from aml_app.detection.fraud_rules import fraud_rules, large_new_counterparty, velocity_spike
from aml_app.detection.rules import (
    TYPOLOGIES,
    Hit,
    aml_rules,
    bipartite,
    cycle,
    fan_in,
    fan_out,
    gather_scatter,
    pass_through,
    random_walk,
    scatter_gather,
    stack,
    structuring,
)
from aml_app.detection.thresholds import LIMITS, AmlThresholds, FraudThresholds, variable
from aml_app.settings import ConfigError

TS = "2026-03-02T12:00:00.000000Z"
AT = datetime(2026, 3, 2, 12, tzinfo=UTC)
RATES = ExchangeRates("EUR", {"EUR": Decimal(1), "USD": Decimal(2)})


def aml(**fields: Any) -> AmlThresholds:
    """Thresholds with the tests' exchange rates, unless given others."""
    return AmlThresholds(**{"rates": RATES, **fields})


AML = aml()
FRAUD = FraudThresholds()


def window(
    sent_count: int = 0,
    sent: dict[str, str] | None = None,
    received_count: int = 0,
    received: dict[str, str] | None = None,
    sent_counterparties: int = 0,
    received_counterparties: int = 0,
) -> dict[str, Any]:
    return {
        "sent_count": sent_count,
        "sent": sent or {},
        "received_count": received_count,
        "received": received or {},
        "counterparties": sent_counterparties + received_counterparties,
        "sent_counterparties": sent_counterparties,
        "received_counterparties": received_counterparties,
    }


def aggregates(
    account: str, near: int = 0, threshold: str = "10000", band: str = "0.1", **windows: dict[str, Any]
) -> dict[str, Any]:
    """Service C's answer; windows given as h1=, h24=, d7= (default empty)."""
    return {
        "account": account,
        "at": TS,
        "as_of": {"0": 12, "1": 7},
        "windows": {
            "1h": windows.get("h1", window()),
            "24h": windows.get("h24", window()),
            "7d": windows.get("d7", window()),
        },
        "near_threshold_24h": near,
        "reporting_threshold": threshold,
        "threshold_band": band,
        "late_dropped": 0,
    }


def edge(
    counterparty: str, count: int = 1, totals: dict[str, str] | None = None, first_seen: str = TS
) -> dict[str, Any]:
    return {
        "counterparty": counterparty,
        "count": count,
        "totals": totals or {"EUR": "10.00"},
        "first_seen": first_seen,
        "last_seen": TS,
    }


def relations(
    account: str,
    out: list[dict[str, Any]] | None = None,
    path: list[str] | None = None,
    chain: list[str] | None = None,
    sources: dict[str, list[str]] | None = None,
    co_payees: dict[str, int] | None = None,
    loop: list[str] | None = None,
) -> dict:
    return {
        "loop": {"found": loop is not None, "path": loop or [], "complete": True},
        "account": account,
        "hops": 3,
        "as_of": {"0": 12},
        "out": out or [],
        "in": [],
        "neighbourhood": [],
        "cycle": {"found": path is not None, "path": path or []},
        "chain": chain or [],
        "sources": [{"source": s, "via": via} for s, via in (sources or {}).items()],
        "co_payees": [{"account": a, "shared": n} for a, n in (co_payees or {}).items()],
    }


def evidence(
    amount: str = "100.00",
    currency: str = "EUR",
    payer: str = "a",
    payee: str = "b",
    payer_aggregates: dict[str, Any] | None = None,
    payee_aggregates: dict[str, Any] | None = None,
    payer_relations: dict[str, Any] | None = None,
    payee_relations: dict[str, Any] | None = None,
) -> Evidence:
    return Evidence.parse(
        payment_id="p-1",
        payer=payer,
        payee=payee,
        amount=Decimal(amount),
        currency=currency,
        ts=TS,
        payer_aggregates=payer_aggregates or aggregates(payer),
        payee_aggregates=payee_aggregates or aggregates(payee),
        payer_relations=payer_relations or relations(payer),
        payee_relations=payee_relations or relations(payee),
    )


# --------------------------------------------------------------------------- structuring


@pytest.mark.parametrize(
    ("amount", "near", "fires"),
    [
        ("9000.00", 3, True),  # threshold * (1 - band): the band's lower edge is inside
        ("8999.99", 3, False),  # one cent below the band
        ("9999.99", 3, True),
        ("10000.00", 3, False),  # at the threshold: reported anyway, not "just under"
        ("9500.00", 2, False),  # min_count - 1
        ("9500.00", 50, True),
    ],
)
def test_structuring_boundaries(amount: str, near: int, fires: bool) -> None:
    hit = structuring(evidence(amount, payer_aggregates=aggregates("a", near=near)), AML)
    assert (hit is not None) is fires
    if hit:
        assert (hit.rule, hit.typology, hit.path) == ("aml.structuring", "structuring", ())
        assert hit.figures["near_threshold_24h"] == near
        assert hit.figures["amount"] == amount
        assert amount in hit.reason


def test_structuring_uses_service_c_threshold_and_band_and_the_configured_count() -> None:
    answer = aggregates("a", near=4, threshold="5000", band="0.2")
    assert structuring(evidence("4000.00", payer_aggregates=answer), AML) is not None
    assert structuring(evidence("3999.99", payer_aggregates=answer), AML) is None
    assert structuring(evidence("9500.00", payer_aggregates=answer), AML) is None
    assert structuring(evidence("4500.00", payer_aggregates=answer), aml(structuring_min_count=5)) is None
    assert structuring(evidence("4500.00", payer_aggregates=answer), aml(structuring_min_count=4))


# --------------------------------------------------------------------------- fan-in / fan-out

FANS = [
    # rule, threshold fields, which answer (payer or payee), window keys (count, sums, counterparties)
    (fan_in, "fan_in", "payee", ("received_count", "received", "received_counterparties")),
    (fan_out, "fan_out", "payer", ("sent_count", "sent", "sent_counterparties")),
]


def fan_evidence(
    side: str, keys: tuple[str, str, str], count: int, sums: dict[str, str], parties: int
) -> Evidence:
    count_key, sums_key, parties_key = keys
    answer = aggregates(
        "a" if side == "payer" else "b",
        d7=window(**{count_key: count, sums_key: sums, parties_key: parties}),
    )
    return evidence(**{f"{side}_aggregates": answer}, currency="EUR")


@pytest.mark.parametrize(("rule", "name", "side", "keys"), FANS)
@pytest.mark.parametrize(
    ("count", "sums", "parties", "fires"),
    [
        (4, {"EUR": "4000.00"}, 4, True),  # 4 counterparties, average exactly 1000
        (4, {"EUR": "3999.99"}, 4, False),  # average one cent short
        (4, {"EUR": "40000.00"}, 3, False),  # one counterparty short
        (300, {"EUR": "15000.00"}, 250, False),  # a busy merchant: many, but small on average
        (4, {"EUR": "2000.00", "USD": "4000.00"}, 4, True),  # other currencies are converted...
        (4, {"EUR": "2000.00", "USD": "3999.98"}, 4, False),  # ...to the cent
        (4, {"EUR": "3999.99", "GBP": "100000.00"}, 4, False),  # a currency without a rate counts 0
        (5, {"EUR": "5000.00"}, 4, True),  # 1.25 payments per counterparty
        (6, {"EUR": "6000.00"}, 4, False),  # the same counterparties again and again: a business
        (0, {}, 0, False),  # unknown account
    ],
)
def test_fan_boundaries(
    rule: Any,
    name: str,
    side: str,
    keys: tuple[str, str, str],
    count: int,
    sums: dict,
    parties: int,
    fires: bool,
) -> None:
    hit = rule(fan_evidence(side, keys, count, sums, parties), AML)
    assert (hit is not None) is fires
    if hit:
        assert (hit.rule, hit.typology) == (f"aml.{name}", name)
        assert hit.figures["counterparties"] == parties
        assert (hit.figures["average"], hit.figures["currency"]) == ("1000.00", "EUR")
        assert hit.figures["account"] == ("b" if side == "payee" else "a")


@pytest.mark.parametrize(("rule", "name", "side", "keys"), FANS)
def test_fan_reads_the_right_account_in_the_reporting_currency(
    rule: Any, name: str, side: str, keys: tuple[str, str, str]
) -> None:
    other = "payer" if side == "payee" else "payee"
    assert rule(fan_evidence(other, keys, 10, {"EUR": "50000.00"}, 10), AML) is None
    usd = fan_evidence(side, keys, 10, {"EUR": "1.00", "USD": "50000.00"}, 10)
    assert rule(usd, AML) is not None
    hit = rule(dataclasses.replace(usd, currency="USD"), AML)
    assert hit is not None and hit.figures["total"] == "25001.00" and hit.figures["currency"] == "EUR"
    assert "unconverted" not in hit.figures
    assert rule(usd, aml(rates=ExchangeRates("EUR", {"EUR": Decimal(1)}))) is None
    gbp = fan_evidence(side, keys, 4, {"EUR": "4000.00", "GBP": "1.00"}, 4)
    assert rule(gbp, AML).figures["unconverted"] == "GBP"


@pytest.mark.parametrize(("rule", "name", "side", "keys"), FANS)
def test_fan_thresholds_are_configurable(rule: Any, name: str, side: str, keys: tuple[str, str, str]) -> None:
    small = fan_evidence(side, keys, 3, {"EUR": "30.00"}, 3)
    assert rule(small, AML) is None
    loose = aml(**{f"{name}_min_counterparties": 3, f"{name}_min_average": Decimal("10")})
    assert rule(small, loose) is not None
    again = fan_evidence(side, keys, 8, {"EUR": "80000.00"}, 4)
    assert rule(again, AML) is None
    assert rule(again, aml(fan_max_payments_per_counterparty=Decimal(2))) is not None


def test_fan_reads_seven_days() -> None:
    busy = window(received_count=20, received={"EUR": "40000.00"}, received_counterparties=20)
    assert fan_in(evidence(payee_aggregates=aggregates("b", h1=busy, h24=busy)), AML) is None
    assert fan_in(evidence(payee_aggregates=aggregates("b", d7=busy)), AML) is not None


# --------------------------------------------------------------------------- cycle


@pytest.mark.parametrize(
    ("loop", "payer", "thresholds", "fires"),
    [
        (["b", "c", "a", "b"], "a", AML, True),  # b -> c -> a, then this payment a -> b closes it
        (["b", "a", "b"], "a", AML, True),
        (["b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "a", "b"], "a", AML, True),  # 12 payments
        (["b", "c", "a", "b"], "c", AML, False),  # c is on the loop, but this payment is not its last
        (["b", "c", "a", "b"], "a", aml(cycle_max_hops=2), False),
        (["b", "a", "b"], "a", aml(cycle_min_hops=3), False),
        (None, "a", AML, False),
    ],
)
def test_cycle(loop: list[str] | None, payer: str, thresholds: AmlThresholds, fires: bool) -> None:
    payee_relations = relations("b", loop=loop)
    hit = cycle(evidence(payer=payer, payee="b", payee_relations=payee_relations), thresholds)
    assert (hit is not None) is fires
    if hit:
        assert hit.path == tuple(loop or ())
        assert hit.figures["hops"] == len(loop or ()) - 1
        assert " -> ".join(loop or ()) in hit.reason


def test_cycle_reads_the_loop_of_the_payee_not_the_shortest_cycle_of_the_payer() -> None:
    """B's `cycle` of the payer (any shortest cycle, in no time order) is not what the rule reads."""
    untimed = evidence(payer_relations=relations("a", path=["a", "b", "a"]))
    assert cycle(untimed, AML) is None


# --------------------------------------------------------------------------- pass-through


@pytest.mark.parametrize(
    ("received", "sent", "figures"),
    [
        ({"EUR": "5000.00"}, {"EUR": "4000.00"}, ("5000.00", "4000.00")),  # min received, ratio 0.8
        ({"EUR": "5000.00"}, {"EUR": "3999.99"}, None),
        ({"EUR": "4999.99"}, {"EUR": "4999.99"}, None),  # received one cent short
        ({"EUR": "50000.00"}, {"EUR": "60000.00"}, ("50000.00", "60000.00")),  # max ratio, 1.2
        ({"EUR": "50000.00"}, {"EUR": "60000.01"}, None),  # pays out more than it received: its own money
        ({"EUR": "5000.00"}, {"USD": "8000.00"}, ("5000.00", "4000.00")),  # sent in another currency
        ({"USD": "10000.00"}, {"EUR": "4000.00"}, ("5000.00", "4000.00")),  # received in another
        ({"GBP": "50000.00"}, {"EUR": "50000.00"}, None),  # no rate: the receipts count nothing
        ({}, {}, None),
    ],
)
def test_pass_through_boundaries(
    received: dict[str, str], sent: dict[str, str], figures: tuple[str, str] | None
) -> None:
    hour = window(sent_count=1, sent=sent, received_count=1, received=received)
    hit = pass_through(evidence(payer_aggregates=aggregates("a", h1=hour)), AML)
    assert (hit is not None) is (figures is not None)
    if hit:
        assert (hit.figures["received"], hit.figures["sent"], hit.figures["currency"]) == (*figures, "EUR")


def test_pass_through_max_ratio_is_configurable() -> None:
    hour = window(sent_count=3, sent={"EUR": "300000.00"}, received_count=1, received={"EUR": "10000.00"})
    spender = evidence(payer_aggregates=aggregates("a", h1=hour))
    assert pass_through(spender, AML) is None
    assert pass_through(spender, aml(pass_through_max_ratio=Decimal(30))) is not None


def test_pass_through_looks_at_one_hour_only_and_at_the_payer() -> None:
    day = window(sent_count=2, sent={"EUR": "9000.00"}, received_count=1, received={"EUR": "10000.00"})
    assert pass_through(evidence(payer_aggregates=aggregates("a", h24=day, d7=day)), AML) is None
    assert pass_through(evidence(payee_aggregates=aggregates("b", h1=day)), AML) is None
    assert pass_through(evidence(payer_aggregates=aggregates("a", h1=day)), AML) is not None


# --------------------------------------------------------------------------- the layering patterns


@pytest.mark.parametrize(
    ("payers", "payees", "received", "count", "fires"),
    [
        (3, 3, {"EUR": "3000.00"}, 3, True),  # 3 and 3 distinct, average exactly graph_min_average
        (2, 3, {"EUR": "9000.00"}, 3, False),
        (3, 2, {"EUR": "9000.00"}, 3, False),
        (3, 3, {"EUR": "2999.99"}, 3, False),  # one cent short of the average
        (3, 3, {"USD": "6000.00"}, 3, True),  # gathered in another currency, converted
        (3, 3, {"GBP": "9000.00"}, 3, False),  # gathered in a currency without a rate
        (6, 6, {"EUR": "6000.00"}, 5, True),
    ],
)
def test_gather_scatter_boundaries(
    payers: int, payees: int, received: dict[str, str], count: int, fires: bool
) -> None:
    day = window(
        sent_count=payees,
        sent={"EUR": "100.00"},
        sent_counterparties=payees,
        received_count=count,
        received=received,
        received_counterparties=payers,
    )
    hit = gather_scatter(evidence(payer_aggregates=aggregates("a", d7=day)), AML)
    assert (hit is not None) is fires
    if hit:
        assert (hit.figures["payers"], hit.figures["payees"]) == (payers, payees)
    # The hub is the payer: the same figures on the payee are not this payment's pattern.
    assert gather_scatter(evidence(payee_aggregates=aggregates("b", d7=day)), AML) is None
    # Seven days: the same figures over one day only are not enough.
    assert gather_scatter(evidence(payer_aggregates=aggregates("a", h24=day)), AML) is None


@pytest.mark.parametrize(
    ("sources", "fires"),
    [
        ({"s": ["a", "m", "n"]}, True),  # three intermediates, the payer one of them
        ({"s": ["m", "n", "o"]}, False),  # this payment is not a step of the flow
        ({"s": ["a", "m"]}, False),  # two intermediates
        ({"s": ["a", "m", "n"], "t": ["a", "o"]}, False),  # two sources through the payer: a stack
        ({"s": ["a", "m", "n"], "t": ["m", "o"]}, True),  # another source, not through the payer
    ],
)
def test_scatter_gather(sources: dict[str, list[str]], fires: bool) -> None:
    hit = scatter_gather(evidence(payee_relations=relations("b", sources=sources)), AML)
    assert (hit is not None) is fires
    if hit:
        assert hit.path == ("s", "a", "b") and hit.figures["intermediates"] == 3


@pytest.mark.parametrize(
    ("sources", "thresholds", "fires"),
    [
        ({"s": ["a", "m"], "t": ["a", "m"]}, AML, True),
        ({"s": ["a", "m"], "t": ["m", "n"]}, AML, False),  # the payer reaches b from one source only
        ({"s": ["a", "m"]}, AML, False),
        ({"s": ["a", "m"], "t": ["a", "m"]}, aml(stack_min_sources=3), False),
        ({"s": ["a", "m"], "t": ["a", "m"], "u": ["a", "n"]}, aml(stack_min_sources=3), True),
    ],
)
def test_stack(sources: dict[str, list[str]], thresholds: AmlThresholds, fires: bool) -> None:
    hit = stack(evidence(payee_relations=relations("b", sources=sources)), thresholds)
    assert (hit is not None) is fires
    if hit:
        assert hit.path == ("s", "a", "b")


@pytest.mark.parametrize(
    ("chain", "amount", "thresholds", "fires"),
    [
        (["x", "a", "b"], "1000.00", AML, True),  # a relays what x paid it: a flow of two payments
        (["x", "a", "b"], "999.99", AML, False),  # not heavy
        (["x", "a", "b"], "2000.00 USD", AML, True),  # heavy in the reporting currency
        (["w", "x", "a", "b"], "5000.00", AML, False),  # three payments: a random walk, not a relay
        (["x", "c", "b"], "5000.00", AML, False),  # a flow into the payee, but not through this payer
        (["x", "a", "b"], "5000.00", aml(random_min_hops=2), False),  # random takes two-payment flows
        (["a", "b"], "5000.00", AML, False),  # this payment alone
        ([], "5000.00", AML, False),
    ],
)
def test_stack_relay(chain: list[str], amount: str, thresholds: AmlThresholds, fires: bool) -> None:
    value, _, currency = amount.partition(" ")
    hit = stack(evidence(value, currency or "EUR", payee_relations=relations("b", chain=chain)), thresholds)
    assert (hit is not None) is fires
    if hit:
        assert (hit.rule, hit.typology, hit.path) == ("aml.stack", "stack", tuple(chain))
        assert hit.figures["relayed_by"] == "a" and "x -> a -> b" in hit.reason


@pytest.mark.parametrize(
    ("co_payees", "paid", "thresholds", "fires"),
    [
        ({"c": 2}, ["b", "c"], AML, True),  # b and c share 2 heavy payers, a pays both
        ({"c": 1}, ["b", "c"], AML, False),  # only one shared payer
        ({"c": 2}, ["b"], AML, False),  # the payer is not in c's block
        ({"c": 2}, ["b", "c"], aml(bipartite_min_destinations=3), False),
        ({"c": 2, "d": 3}, ["b", "c", "d"], aml(bipartite_min_destinations=3), True),
        ({"c": 2, "d": 2}, ["b", "c", "d"], aml(bipartite_min_sources=3), False),
    ],
)
def test_bipartite(
    co_payees: dict[str, int], paid: list[str], thresholds: AmlThresholds, fires: bool
) -> None:
    facts = evidence(
        payer_relations=relations("a", out=[edge(x) for x in paid]),
        payee_relations=relations("b", co_payees=co_payees),
    )
    hit = bipartite(facts, thresholds)
    assert (hit is not None) is fires
    stacked = dataclasses.replace(
        facts,
        payee_relations=Relations.from_json(
            relations("b", co_payees=co_payees, sources={"s": ["a", "m"], "t": ["a", "m"]})
        ),
    )
    assert bipartite(stacked, thresholds) is None  # a stacked block is a stack


@pytest.mark.parametrize(
    ("chain", "amount", "thresholds", "fires"),
    [
        (["x", "y", "a", "b"], "1000.00", AML, True),  # 2 payments flowed in, this one the 3rd, heavy
        (["x", "y", "a", "b"], "999.99", AML, False),  # this payment is not heavy
        (["x", "y", "a", "b"], "2000.00 USD", AML, True),  # heavy in the reporting currency: 1000 EUR
        (["x", "y", "a", "b"], "1999.98 USD", AML, False),
        (["x", "y", "a", "b"], "9000.00 GBP", AML, False),  # no rate: it counts as nothing
        (["y", "a", "b"], "5000.00", AML, False),  # 2 hops in all
        (["y", "a", "b"], "5000.00", aml(random_min_hops=2), True),
        (["x", "y", "c", "b"], "5000.00", AML, False),  # a flow into the payee, but not through this payer
        ([], "5000.00", AML, False),
    ],
)
def test_random_walk(chain: list[str], amount: str, thresholds: AmlThresholds, fires: bool) -> None:
    value, _, currency = amount.partition(" ")
    paid = evidence(value, currency or "EUR", payee_relations=relations("b", chain=chain))
    hit = random_walk(paid, thresholds)
    assert (hit is not None) is fires
    if hit:
        assert hit.path == tuple(chain) and hit.figures["hops"] == len(chain) - 1


def test_a_payment_is_heavy_as_b_was_asked_to_the_cent() -> None:
    """B is asked for edges of at least the heavy minimum in each currency to the cent (1171.78 USD for
    1000 EUR at AMLworld's rates); the rule converted the payment back (999.997 EUR) and found it short,
    so a walk B reported heavy did not fire."""
    amlworld = aml(rates=ExchangeRates.from_env({"AML_REPORTING_CURRENCY": "EUR"}))
    minimum = amlworld.rates.in_each(amlworld.graph_min_average)["USD"]
    assert minimum == Decimal("1171.78")
    walk = relations("b", chain=["x", "y", "a", "b"])
    assert random_walk(evidence(str(minimum), "USD", payee_relations=walk), amlworld) is not None
    below = str(minimum - Decimal("0.01"))
    assert random_walk(evidence(below, "USD", payee_relations=walk), amlworld) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"chain": ["x", "y"]}, "chain must end at 'a'"),
        ({"chain": ["a", "x", "a"]}, "no account twice"),
        ({"chain": ["w", "x", "y", "z", "a"]}, "with 1..3 edges"),
        ({"chain": "x"}, "chain must be a list"),
        ({"sources": [{"source": "s", "via": ["m"]}]}, "via must list at least 2 accounts"),
        ({"sources": [{"via": ["m", "n"]}]}, "lacks the field 'source'"),
        ({"co_payees": [{"account": "c", "shared": -1}]}, "must be a whole number >= 0"),
        ({"co_payees": {"c": 2}}, "co_payees must be a list"),
    ],
)
def test_malformed_layering_parts_raise_a_clear_value_error(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Relations.from_json({**relations("a"), **change})


# --------------------------------------------------------------------------- all rules together


def test_empty_answers_produce_no_hit_even_for_a_suspicious_looking_payment() -> None:
    for amount in ("0.01", "9500.00", "10000.00", "1000000.00"):
        quiet = evidence(amount)
        assert aml_rules(quiet, AML) == []
        assert fraud_rules(quiet, FRAUD) == []


def test_aml_rules_returns_every_hit_in_typology_order() -> None:
    hour = window(sent_count=9, sent={"EUR": "85500.00"}, received_count=1, received={"EUR": "90000.00"})
    day = window(
        sent_count=9,
        sent={"EUR": "85500.00"},
        sent_counterparties=9,
        received_count=4,
        received={"EUR": "90000.00"},
        received_counterparties=4,
    )
    payee_day = window(received_count=8, received={"EUR": "80000.00"}, received_counterparties=8)
    everything = evidence(
        "9500.00",
        payer_aggregates=aggregates("a", near=9, h1=hour, d7=day),
        payee_aggregates=aggregates("b", d7=payee_day),
        payer_relations=relations("a", out=[edge("b"), edge("c")]),
        payee_relations=relations(
            "b",
            chain=["x", "y", "a", "b"],
            sources={"s": ["a", "m", "n"]},
            co_payees={"c": 2},
            loop=["b", "a", "b"],
        ),
    )
    hits = aml_rules(everything, AML)
    # Every typology but stack, which excludes scatter_gather and bipartite (tested below).
    assert [h.typology for h in hits] == [t for t in TYPOLOGIES if t != "stack"]
    assert all(h.rule == f"aml.{h.typology}" for h in hits)
    stacked = dataclasses.replace(
        everything,
        payee_relations=Relations.from_json(relations("b", sources={"s": ["a", "m"], "t": ["a", "n"]})),
    )
    assert "stack" in [h.typology for h in aml_rules(stacked, AML)]
    # A self-payment is part of no pattern, whatever its account's answers say.
    self_payment = dataclasses.replace(
        everything,
        payee="a",
        payee_aggregates=everything.payer_aggregates,
        payee_relations=Relations.from_json(
            relations("a", sources={"s": ["a", "m", "n"]}, co_payees={"c": 2})
        ),
    )
    assert aml_rules(self_payment, AML) == []


def test_hit_as_json_is_plain_json() -> None:
    hit = Hit("aml.cycle", "cycle", "why", {"hops": 2}, ("a", "b", "a"))
    assert hit.as_json() == {
        "rule": "aml.cycle",
        "typology": "cycle",
        "reason": "why",
        "figures": {"hops": 2},
        "path": ["a", "b", "a"],
    }


# --------------------------------------------------------------------------- fraud rules


@pytest.mark.parametrize(
    ("amount", "currency", "out", "fires"),
    [
        ("5000.00", "USD", [edge("b", 1)], True),
        ("4999.99", "USD", [edge("b", 1)], False),
        ("5000.00", "USD", [edge("b", 2, first_seen="2026-03-02T11:59:00Z")], False),  # not the first to b
        # Two payments to b at the same instant (minute-stamped sources): each is a first.
        ("5000.00", "USD", [edge("b", 2)], True),
        ("5000.00", "USD", [edge("c", 1)], False),  # B has not seen this edge: no evidence
        ("5000.00", "USD", [], False),
        # In the reporting currency (USD): 5,000 yen is about 47 dollars, 4,999.99 pounds about 6,465.
        ("5000.00", "JPY", [edge("b", 1)], False),
        ("5000.00", "GBP", [edge("b", 1)], True),
        ("4999.99", "GBP", [edge("b", 1)], True),
        ("1000000.00", "XAU", [edge("b", 1)], False),  # a currency without a rate is never large
    ],
)
def test_large_new_counterparty(amount: str, currency: str, out: list[dict[str, Any]], fires: bool) -> None:
    hit = large_new_counterparty(evidence(amount, currency, payer_relations=relations("a", out=out)), FRAUD)
    assert (hit is not None) is fires
    if hit:
        assert (hit.rule, hit.typology, hit.figures["payments_to_payee"]) == (
            "fraud.large_new_counterparty",
            "large_new_counterparty",
            out[0]["count"],
        )


@pytest.mark.parametrize(
    ("last_hour", "week", "fires"),
    [
        (10, 10, True),  # a new account reaching the minimum count
        (9, 9, False),  # one short of the minimum
        (10, 336, True),  # 10 * 168 == 5 * 336: exactly the multiple
        (10, 337, False),
    ],
)
def test_velocity_spike(last_hour: int, week: int, fires: bool) -> None:
    answer = aggregates("a", h1=window(sent_count=last_hour), d7=window(sent_count=week))
    hit = velocity_spike(evidence(payer_aggregates=answer), FRAUD)
    assert (hit is not None) is fires
    if hit:
        assert (hit.figures["sent_1h"], hit.figures["sent_7d"]) == (last_hour, week)
        assert hit.figures["hourly_average_7d"] == str((Decimal(week) / 168).quantize(Decimal("0.01")))


def test_fraud_rules_reads_the_payers_answers_only() -> None:
    burst = aggregates("b", h1=window(sent_count=50), d7=window(sent_count=50))
    assert fraud_rules(evidence("9000.00", payee_aggregates=burst), FRAUD) == []
    both = evidence(
        "9000.00",
        payer_aggregates=aggregates("a", h1=window(sent_count=50), d7=window(sent_count=50)),
        payer_relations=relations("a", out=[edge("b")]),
    )
    assert [h.typology for h in fraud_rules(both, FRAUD)] == ["large_new_counterparty", "velocity_spike"]


def test_no_fraud_rule_is_asked_about_a_self_payment() -> None:
    """B lists the payer's edge to itself in `out`: a first large self-transfer was a payment to a "new
    counterparty", and a burst of them a velocity spike."""
    own = evidence(
        "9000.00",
        payee="a",
        payer_aggregates=aggregates("a", h1=window(sent_count=50), d7=window(sent_count=50)),
        payer_relations=relations("a", out=[edge("a")]),
        payee_aggregates=aggregates("a"),
        payee_relations=relations("a"),
    )
    assert large_new_counterparty(own, FRAUD) is not None  # the rule alone would
    assert fraud_rules(own, FRAUD) == []


# --------------------------------------------------------------------------- parsing


def test_parsing_gives_typed_values() -> None:
    parsed = evidence(
        "12.50",
        payer_aggregates=aggregates(
            "a", near=1, h1=window(sent_count=1, sent={"EUR": "12.50"}, sent_counterparties=1)
        ),
        payer_relations=relations(
            "a", out=[edge("b", 2, {"EUR": "20.00", "USD": "1.5"})], path=["a", "b", "a"]
        ),
    )
    assert parsed.ts == AT
    assert parsed.payer_aggregates.at == AT
    assert parsed.payer_aggregates.as_of == {0: 12, 1: 7}
    assert parsed.payer_aggregates.window("1h").sent_in("EUR") == Decimal("12.50")
    assert parsed.payer_aggregates.window("1h").sent_in("GBP") == 0
    assert parsed.payer_aggregates.reporting_threshold == Decimal("10000")
    assert parsed.payer_relations.out["b"].totals == {"EUR": Decimal("20.00"), "USD": Decimal("1.5")}
    assert parsed.payer_relations.out["b"].first_seen == AT
    assert parsed.payer_relations.cycle.path == ("a", "b", "a")
    assert Aggregates.from_json(aggregates("x")).windows["7d"].sent == {}
    assert Relations.from_json(relations("x")).cycle.found is False


def broken(change: Any) -> dict[str, Any]:
    answer = aggregates("a")
    change(answer)
    return answer


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (broken(lambda a: a["windows"].pop("24h")), "'24h'"),
        (broken(lambda a: a["windows"]["1h"].pop("sent_counterparties")), "'sent_counterparties'"),
        (broken(lambda a: a["windows"]["1h"].update(sent={"EUR": 12.5})), "decimal string"),
        (broken(lambda a: a["windows"]["1h"].update(sent={"EUR": "12,50"})), "not a decimal number"),
        (broken(lambda a: a["windows"]["1h"].update(sent={"EUR": "-1"})), ">= 0"),
        (broken(lambda a: a["windows"]["7d"].update(sent_count=-1)), "sent_count"),
        (broken(lambda a: a["windows"]["7d"].update(received_count=True)), "received_count"),
        (broken(lambda a: a.update(at="2026-03-02T12:00:00")), "no timezone"),
        (broken(lambda a: a.update(at="yesterday")), "not an ISO-8601"),
        (broken(lambda a: a.update(near_threshold_24h="3")), "near_threshold_24h"),
        (broken(lambda a: a.update(threshold_band="1.5")), "threshold_band"),
        (broken(lambda a: a.update(as_of={"zero": 1})), "as_of"),
        (broken(lambda a: a.pop("account")), "'account'"),
        ([], "JSON object"),
    ],
)
def test_malformed_aggregates_raise_a_clear_value_error(answer: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Aggregates.from_json(answer)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.update(cycle={"found": True, "path": ["b", "c", "b"]}), "must start and end at 'a'"),
        (lambda r: r.update(cycle={"found": True, "path": ["a", "b", "c", "d", "a"]}), "1..3 edges"),
        (lambda r: r.update(cycle={"found": False, "path": ["a", "b", "a"]}), "found is false"),
        (lambda r: r.update(cycle={"found": "yes", "path": []}), "true or false"),
        (lambda r: r.update(loop={"found": True, "path": ["b", "a"]}), "loop.path must start and end at 'a'"),
        (lambda r: r.update(loop={"found": True, "path": ["a", "b", "a", "b", "a"]}), "distinct accounts"),
        (lambda r: r.update(loop={"found": True, "path": ["a", *"bcdefghijklmnopq", "a"]}), "1..16 edges"),
        (lambda r: r.update(loop={"found": False, "path": [], "complete": "no"}), "loop.complete"),
        (lambda r: r.update(out=[{"counterparty": "b", "count": 1}]), "'totals'"),
        (lambda r: r.update(out={"b": 1}), "must be a list"),
        (lambda r: r.update(neighbourhood=[{"account": "b", "hops": -1}]), "hops"),
        (lambda r: r.update({"in": "nobody"}), "must be a list"),
    ],
)
def test_malformed_relations_raise_a_clear_value_error(change: Any, message: str) -> None:
    answer = relations("a")
    change(answer)
    with pytest.raises(ValueError, match=message):
        Relations.from_json(answer)


def test_instants_with_an_offset_are_read_in_utc() -> None:
    answer = {**aggregates("a"), "at": "2026-03-02T13:30:00+01:30"}
    at = Aggregates.from_json(answer).at
    assert at == AT and at.tzinfo is UTC
    seen = Relations.from_json(relations("a", out=[{**edge("b"), "first_seen": "2026-03-02T07:00:00-05:00"}]))
    assert seen.out["b"].first_seen == AT and seen.out["b"].first_seen.tzinfo is UTC


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        # Parsing builds a message only when a check fails: each still names the field's place.
        (
            relations("a", out=[edge("b", totals={"EUR": 1.5})]),  # type: ignore[dict-item]
            "relations answer for 'a'.out['b'].totals.EUR must be a decimal string",
        ),
        (
            relations("a", out=[edge("b", totals={"": "1.00"})]),
            "relations answer for 'a'.out['b'].totals currency must be a non-empty string",
        ),
        (
            relations("a", out=[{**edge("b"), "last_seen": "noon"}]),
            "relations answer for 'a'.out['b'].last_seen is not an ISO-8601 instant",
        ),
        (
            relations("a", out=[{k: v for k, v in edge("b").items() if k != "count"}]),
            "relations answer for 'a'.out['b'] lacks the field 'count'",
        ),
        (
            relations("a", sources={"s": ["s", ""]}),
            "relations answer for 'a'.sources['s'].via must be a non-empty string",
        ),
        (relations("a", loop=["a", 7, "a"]), "relations answer for 'a'.loop.path must be a non-empty string"),
        ({**relations("a"), "as_of": {"0": -1}}, "as_of[0] must be a whole number >= 0"),
        (
            aggregates("a", h1=window(sent={"EUR": "Infinity"})),
            "aggregates answer for 'a'.windows.1h.sent.EUR must be a finite amount",
        ),
        (
            aggregates("a", h24=window(received={"USD": "x"})),
            "aggregates answer for 'a'.windows.24h.received.USD is not a decimal number",
        ),
    ],
)
def test_malformed_answers_name_the_place_of_what_is_wrong(answer: dict[str, Any], message: str) -> None:
    parse = Relations.from_json if "hops" in answer else Aggregates.from_json
    with pytest.raises(ValueError, match=re.escape(message)):
        parse(answer)


def full_answers() -> list[dict[str, Any]]:
    """Answers with every part filled: what the fast parse and the field-by-field one must read alike."""
    busy = window(3, {"EUR": "12.50", "USD": "7"}, 2, {"GBP": "0.01"}, 2, 1)
    neighbours = [{"account": "n", "hops": 2}, {"account": "b", "hops": 1}]
    return [
        aggregates("a", near=2, h1=busy, h24=busy, d7=window(9, {"EUR": "1e3"}, 1, {}, 4, 0)),
        {**aggregates("a"), "at": "2026-03-02T13:30:00+01:30", "late_dropped": 4, "exact": False},
        {
            **relations(
                "a",
                out=[edge("b", 2, {"EUR": "20.00", "USD": "1.5"}), edge("c")],
                path=["a", "b", "a"],
                chain=["x", "y", "a"],
                sources={"s": ["s", "m", "a"]},
                co_payees={"c": 2},
                loop=["a", "b", "c", "a"],
            ),
            "in": [{**edge("d"), "first_seen": "2026-03-02T07:00:00-05:00"}],
            "neighbourhood": neighbours,
        },
        {**relations("a"), "loop": {"found": False, "path": [], "complete": False}},
        {"account": "a", "hops": 3},  # B asked for no part
    ]


#: Values put in place of one field of a well-formed answer.
ODD_VALUES = (
    None,
    -1,
    0,
    1,
    2.0,
    1.5,
    True,
    "",
    "x",
    "-1",
    "NaN",
    "Infinity",
    "1,5",
    "0",
    "1",
    "2026-03-02T12:00:00",
    "2026-03-02T12:00:00Z",
    [],
    ["a"],
    ["a", "a"],
    {},
    {"found": True, "path": ["a", "b", "a"]},
)


def places(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key and index of a JSON document, as paths from its root."""
    inner = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    return [step for key, value in inner for step in [(*path, key), *places(value, (*path, key))]]


def changed(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    """`doc` with the field at `path` set to `value` (removed, for a dict's field, when `value` is ...)."""
    copy = json.loads(json.dumps(doc))
    *parents, last = path
    target = copy
    for step in parents:
        target = target[step]
    if value is ... and isinstance(target, dict):
        del target[last]
    else:
        target[last] = None if value is ... else value
    return copy


def test_the_fast_parse_accepts_and_refuses_what_the_field_by_field_parse_does() -> None:
    # Every field of every full answer, removed or set to each odd value in turn (about 3,300 answers).
    tried = 0
    for answer in full_answers():
        parse = Relations if "hops" in answer else Aggregates
        for where in places(answer):
            for value in (..., *ODD_VALUES):
                odd = changed(answer, where, value)
                tried += 1
                try:
                    expected = parse.checked(odd)
                except ValueError as refused:
                    with pytest.raises(ValueError) as caught:
                        parse.from_json(odd)
                    assert str(caught.value) == str(refused), where  # the place of what is wrong, named
                    continue
                assert parse.from_json(odd) == expected, (where, value)
    assert tried > 3_000


@pytest.mark.parametrize("answer", full_answers())
def test_the_fast_parse_reads_well_formed_answers_as_the_field_by_field_parse(answer: dict[str, Any]) -> None:
    parse = Relations if "hops" in answer else Aggregates
    assert parse.from_json(answer) == parse.checked(answer)


def test_relations_asked_for_some_parts_only_read_the_others_as_empty() -> None:
    # The detectors ask B for `parts=out,cycle`: `in` and `neighbourhood` are absent from the answer.
    answer = relations("a")
    del answer["in"], answer["neighbourhood"]
    parsed = Relations.from_json(answer)
    assert parsed.in_ == {} and parsed.neighbourhood == {}
    assert parsed.out == Relations.from_json(relations("a")).out


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"payer_aggregates": aggregates("someone-else")}, "payer aggregates are for 'someone-else'"),
        ({"payee_aggregates": aggregates("a")}, "payee aggregates are for 'a'"),
        ({"payer_relations": relations("b")}, "payer relations are for 'b'"),
        ({"payee_relations": relations("a")}, "payee relations are for 'a'"),
        ({"payer_aggregates": {**aggregates("a"), "at": "2026-03-02T12:00:01Z"}}, "not at the payment's ts"),
        ({"amount": "0"}, "amount must be"),
    ],
)
def test_evidence_for_the_wrong_question_is_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        evidence(**kwargs)


# --------------------------------------------------------------------------- thresholds from the environment


def test_thresholds_defaults() -> None:
    assert AmlThresholds.from_env({}) == AmlThresholds()
    assert FraudThresholds.from_env({}) == FraudThresholds()
    assert (AML.structuring_min_count, AML.fan_in_min_counterparties, AML.fan_out_min_counterparties) == (
        3,
        4,
        4,
    )
    assert AML.fan_max_payments_per_counterparty == Decimal("1.25")
    assert (AML.fan_in_min_average, AML.fan_out_min_average) == (Decimal(1000), Decimal(1000))
    assert (AML.cycle_min_hops, AML.cycle_max_hops) == (2, 12)
    assert (AML.pass_through_min_received, AML.pass_through_min_ratio) == (Decimal(5000), Decimal("0.8"))
    assert AML.pass_through_max_ratio == Decimal("1.2")
    assert (FRAUD.large_new_counterparty_min_amount, FRAUD.velocity_min_count, FRAUD.velocity_multiple) == (
        Decimal(5000),
        10,
        Decimal(5),
    )


def test_thresholds_overrides_and_blank_values() -> None:
    env = {
        "AML_RULE_FAN_IN_MIN_AVERAGE": " 250.5 ",
        "AML_RULE_STRUCTURING_MIN_COUNT": "4",
        "AML_RULE_CYCLE_MAX_HOPS": "",
        "AML_RULE_VELOCITY_MULTIPLE": "2.5",
        "AML_GATE": "off",  # other variables are none of its business
    }
    aml = AmlThresholds.from_env(env)
    assert (aml.fan_in_min_average, aml.structuring_min_count, aml.cycle_max_hops) == (
        Decimal("250.5"),
        4,
        12,
    )
    assert FraudThresholds.from_env(env).velocity_multiple == Decimal("2.5")


@pytest.mark.parametrize("cls", [AmlThresholds, FraudThresholds])
def test_every_threshold_has_its_variable_and_range(cls: type) -> None:
    for f in [f for f in dataclasses.fields(cls) if f.name != "rates"]:
        low, high, _ = LIMITS[f.name]
        assert low <= f.default <= high, f.name
        at_the_limit = None
        if f.name != "cycle_min_hops":
            at_the_limit = cls.from_env({variable(f.name): str(high)})
        else:
            at_the_limit = cls.from_env({variable(f.name): str(high), "AML_RULE_CYCLE_MAX_HOPS": str(high)})
        assert getattr(at_the_limit, f.name) == high
        with pytest.raises(ConfigError, match=variable(f.name)):
            cls.from_env({variable(f.name): str(high + 1)})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"AML_RULE_FAN_IN_MIN_COUNTERPARTIES": "many"},
            r"AML_RULE_FAN_IN_MIN_COUNTERPARTIES='many' is not a whole",
        ),
        (
            {"AML_RULE_FAN_IN_MIN_COUNTERPARTIES": "8.5"},
            r"AML_RULE_FAN_IN_MIN_COUNTERPARTIES='8.5' is not a whole",
        ),
        ({"AML_RULE_FAN_OUT_MIN_AVERAGE": "lots"}, r"AML_RULE_FAN_OUT_MIN_AVERAGE='lots' is not a decimal"),
        ({"AML_RULE_FAN_OUT_MIN_AVERAGE": "-1"}, r"AML_RULE_FAN_OUT_MIN_AVERAGE=-1 is out of range"),
        (
            {"AML_RULE_PASS_THROUGH_MIN_RATIO": "nan"},
            r"AML_RULE_PASS_THROUGH_MIN_RATIO='nan' is not a decimal number",
        ),
        ({"AML_RULE_PASS_THROUGH_MIN_RATIO": "1.5"}, r"AML_RULE_PASS_THROUGH_MIN_RATIO=1.5 is out of range"),
        ({"AML_RULE_CYCLE_MAX_HOPS": "17"}, r"AML_RULE_CYCLE_MAX_HOPS=17 is out of range; expected 2..16"),
        (
            {"AML_RULE_FAN_IN_MIN_AVERAGE": "1e99999999999"},
            r"AML_RULE_FAN_IN_MIN_AVERAGE=1\.000000e\+99999999999 is out of range",
        ),
        (
            {"AML_RULE_CYCLE_MIN_HOPS": "3", "AML_RULE_CYCLE_MAX_HOPS": "2"},
            r"AML_RULE_CYCLE_MIN_HOPS=3 is larger",
        ),
        ({"AML_RULE_FANIN_MIN_AVERAGE": "10"}, r"AML_RULE_FANIN_MIN_AVERAGE is not a detection threshold"),
        # int() and Decimal() also read "1_0" and other scripts' digits as ten.
        ({"AML_RULE_FAN_IN_MIN_COUNTERPARTIES": "1_0"}, r"'1_0' is not a whole number"),
        ({"AML_RULE_FAN_IN_MIN_COUNTERPARTIES": "\u0661\u0660"}, r"is not a whole number"),
        ({"AML_RULE_FAN_IN_MIN_AVERAGE": "1_000"}, r"'1_000' is not a decimal number"),
        # Compared exactly with 4-place sums, and printed in every hit: a billion places took 1 GB.
        (
            {"AML_RULE_FAN_IN_MIN_AVERAGE": "1000.0000000000000000000000001"},
            r"AML_RULE_FAN_IN_MIN_AVERAGE=1000\.0000000000000000000000001 has more than 4 decimal places",
        ),
        (
            {"AML_RULE_FAN_IN_MIN_AVERAGE": "1e-99999999"},
            r"AML_RULE_FAN_IN_MIN_AVERAGE=1\.000000e-99999999 has more than 4 decimal places",
        ),
    ],
)
def test_a_bad_value_names_its_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AmlThresholds.from_env(env)


def test_fraud_thresholds_bad_values_and_code_built_values() -> None:
    with pytest.raises(ConfigError, match=r"AML_RULE_VELOCITY_MIN_COUNT=0 is out of range"):
        FraudThresholds.from_env({"AML_RULE_VELOCITY_MIN_COUNT": "0"})
    # The week's count includes the hour's: above 168 times the hourly average nothing could fire.
    with pytest.raises(
        ConfigError, match=r"AML_RULE_VELOCITY_MULTIPLE=169 is out of range; expected 1\.\.168"
    ):
        FraudThresholds.from_env({"AML_RULE_VELOCITY_MULTIPLE": "169"})
    most = FraudThresholds.from_env({"AML_RULE_VELOCITY_MULTIPLE": "168"})
    burst = aggregates("a", h1=window(sent_count=10), d7=window(sent_count=10))
    assert velocity_spike(evidence(payer_aggregates=burst), most) is not None, "a new account's burst"
    with pytest.raises(ConfigError, match="AML_RULE_VELOCITY_MULTIPLE must be a decimal number"):
        FraudThresholds(velocity_multiple=5.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="AML_RULE_STRUCTURING_MIN_COUNT must be a whole number"):
        AmlThresholds(structuring_min_count=True)
