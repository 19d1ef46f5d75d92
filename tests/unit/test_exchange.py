"""The reporting currency: configuration, conversion, and the default rates checked against real AMLworld
data (the rates its generator used show in its rows)."""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

import pytest

from aml_app.detection.exchange import AMLWORLD_RATES, ExchangeRates
from aml_app.detection.thresholds import AmlThresholds
from aml_app.settings import ConfigError
from aml_app.simulation.amlworld import CURRENCIES, read_patterns

DATA = Path(__file__).resolve().parents[1] / "data" / "amlworld"


def test_defaults_are_amlworld_rates_in_dollars() -> None:
    rates = ExchangeRates.from_env({})
    assert rates.reporting == "USD" and rates.per_unit == AMLWORLD_RATES
    assert AmlThresholds().rates == rates == AmlThresholds.from_env({}).rates
    assert rates.convert(Decimal("105.4"), "JPY") == 1
    assert rates.convert(Decimal(1), "XAU") is None


def test_another_reporting_currency_restates_the_defaults() -> None:
    rates = ExchangeRates.from_env({"AML_REPORTING_CURRENCY": " eur "})
    assert rates.reporting == "EUR" and rates.per_unit["EUR"] == 1
    assert rates.total({"USD": Decimal(100)}) == Decimal("85.34")
    assert rates.total({"JPY": Decimal("105.4"), "EUR": Decimal(1)}) == Decimal("1.85")


def test_a_table_replaces_the_defaults_whole() -> None:
    rates = ExchangeRates.from_env(
        {"AML_REPORTING_CURRENCY": "GBP", "AML_EXCHANGE_RATES": "eur=1.15, USD=1.27"}
    )
    assert dict(rates.per_unit) == {"GBP": 1, "EUR": Decimal("1.15"), "USD": Decimal("1.27")}
    assert rates.convert(Decimal("105.4"), "JPY") is None  # no default slips in


def test_total_converts_rounds_to_the_cent_and_names_what_it_left_out() -> None:
    rates = ExchangeRates("EUR", {"EUR": Decimal(1), "USD": Decimal(3)})
    sums = {"EUR": Decimal("1.00"), "USD": Decimal("1.00"), "GBP": Decimal("500")}
    assert rates.total(sums) == Decimal("1.33")
    assert rates.unconverted(sums) == ["GBP"]
    assert rates.total({}) == 0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"AML_EXCHANGE_RATES": "EUR"}, "AML_EXCHANGE_RATES has 'EUR'; expected CODE=RATE"),
        ({"AML_EXCHANGE_RATES": "EUR=abc"}, "AML_EXCHANGE_RATES has 'EUR=abc'"),
        ({"AML_EXCHANGE_RATES": "EUR=0"}, "a rate from 0.000000001 to 1000000000"),
        ({"AML_EXCHANGE_RATES": "EUR=-1"}, "a rate from 0.000000001 to 1000000000"),
        ({"AML_EXCHANGE_RATES": "EUR=inf"}, "a rate from 0.000000001 to 1000000000"),
        # Conversions at 1e30 overran Decimal's 28 digits at worker start (InvalidOperation).
        ({"AML_EXCHANGE_RATES": "JPY=1e30"}, "a rate from 0.000000001 to 1000000000"),
        # Decimal() reads "0_92" as 92.
        ({"AML_EXCHANGE_RATES": "EUR=0_92"}, "AML_EXCHANGE_RATES has 'EUR=0_92'"),
        # Set but naming nothing: every currency but the reporting one counted as nothing.
        ({"AML_EXCHANGE_RATES": ","}, "AML_EXCHANGE_RATES=',' names no currency"),
        ({"AML_EXCHANGE_RATES": "EURO=0.9"}, "names 'EURO', which is not an ISO 4217 code"),
        ({"AML_EXCHANGE_RATES": "USD=2"}, "must give the reporting currency USD the rate 1"),
        ({"AML_EXCHANGE_RATES": "eur=0.9,EUR=0.8"}, "AML_EXCHANGE_RATES names EUR twice"),
        ({"AML_REPORTING_CURRENCY": "DOLLAR"}, "AML_REPORTING_CURRENCY='DOLLAR' is not an ISO 4217"),
        ({"AML_REPORTING_CURRENCY": "NOK"}, "NOK has no default rates"),
    ],
)
def test_bad_configuration_is_one_sentence(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AmlThresholds.from_env(env)


def test_the_euro_rate_is_the_one_amlworld_rows_show() -> None:
    """Rows paid in one currency and received in another carry the generator's rate to five digits."""
    with (DATA / "HI-Small_Trans_rows1-7500.csv").open(encoding="utf-8-sig") as f:
        rows = [r for r in list(csv.reader(f))[1:] if (r[8], r[6]) == ("US Dollar", "Euro")]
    assert rows
    for row in rows:
        assert Decimal(row[5]) / Decimal(row[7]) == pytest.approx(
            AMLWORLD_RATES["EUR"], abs=Decimal("0.0001")
        )


def test_every_default_rate_agrees_with_amlworld_laundering_hops() -> None:
    """An account that forwards money received in dollars pays out about `rate * amount * f` in currency
    X, and one that receives X and pays dollars about `amount * f / rate`, where f is the forwarding
    factor (a share kept). The geometric mean of the two median ratios cancels f: sqrt(m1 / m2) = rate.
    Every currency with ten or more hops each way must be within 5 % of its default."""
    patterns = read_patterns(DATA / "LI-Medium_Patterns.txt")
    by_id = {p.payment_id: p for p in patterns.payments}
    ratios: dict[tuple[str, str], list[float]] = defaultdict(list)
    for attempt in patterns.attempts:
        payments = [by_id[i] for i in attempt.payment_ids]
        for into in payments:
            for onward in payments:
                if (
                    into.payee == onward.payer != onward.payee
                    and into.payer != into.payee
                    and onward.ts >= into.ts
                ):
                    ratios[(into.currency, onward.currency)].append(float(onward.amount) / float(into.amount))
    checked = []
    for currency in sorted(set(CURRENCIES.values()) - {"USD"}):
        there, back = ratios[("USD", currency)], ratios[(currency, "USD")]
        if min(len(there), len(back)) < 10:
            continue
        estimate = math.sqrt(statistics.median(there) / statistics.median(back))
        assert estimate == pytest.approx(float(AMLWORLD_RATES[currency]), rel=0.05), currency
        checked.append(currency)
    assert len(checked) >= 5, checked  # the data speaks for most of the table


def test_one_sum_in_every_currency_asks_service_b_the_same_question() -> None:
    each = ExchangeRates(
        "EUR", {"EUR": Decimal(1), "USD": Decimal("1.17178"), "JPY": Decimal("123.5")}
    ).in_each(Decimal(1000))
    assert each == {"EUR": Decimal("1000.00"), "USD": Decimal("1171.78"), "JPY": Decimal("123500.00")}
