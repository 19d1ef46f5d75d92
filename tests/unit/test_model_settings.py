"""The settings a model is trained with, as its file records them and as a worker compares them."""

from __future__ import annotations

from decimal import Decimal

import pytest

from aml_app.detection.exchange import ExchangeRates
from aml_app.detection.model_settings import DEFAULTS, mismatch, record, trained_with
from aml_app.detection.thresholds import AmlThresholds
from aml_app.settings import load_settings


def test_the_defaults_agree_with_a_deployment_that_sets_nothing_or_writes_a_default_otherwise() -> None:
    assert dict(load_settings({}).model_settings()) == DEFAULTS
    written_otherwise = {
        "AML_RULE_FAN_IN_MIN_AVERAGE": "1000.00",
        "AML_REPORTING_THRESHOLD": "1E+4",
        "AML_THRESHOLD_BAND": "0.10",
        "AML_REPORTING_CURRENCY": "usd",
    }
    assert mismatch(DEFAULTS, dict(load_settings(written_otherwise).model_settings())) is None


def test_a_file_without_a_record_was_trained_with_the_defaults_and_a_bad_record_is_refused() -> None:
    assert trained_with({}) == DEFAULTS
    assert trained_with({"settings": {"AML_RULE_CYCLE_MAX_HOPS": 6}})["AML_RULE_CYCLE_MAX_HOPS"] == "6"
    with pytest.raises(ValueError, match=r"training\.settings is not an object"):
        trained_with({"settings": ["AML_RULE_CYCLE_MAX_HOPS"]})


@pytest.mark.parametrize(
    ("env", "sentence"),
    [
        (
            {"AML_RULE_CYCLE_MAX_HOPS": "6"},
            "trained with AML_RULE_CYCLE_MAX_HOPS=12, but this worker has AML_RULE_CYCLE_MAX_HOPS=6",
        ),
        (
            {"AML_THRESHOLD_BAND": "0.05"},
            "trained with AML_THRESHOLD_BAND=0.1, but this worker has AML_THRESHOLD_BAND=0.05",
        ),
        (
            {"AML_REPORTING_CURRENCY": "EUR"},
            "trained with AML_REPORTING_CURRENCY=USD, but this worker has AML_REPORTING_CURRENCY=EUR",
        ),
    ],
)
def test_the_first_setting_that_differs_is_named(env: dict[str, str], sentence: str) -> None:
    assert mismatch(DEFAULTS, dict(load_settings(env).model_settings())) == sentence


def test_a_table_of_rates_names_the_first_currency_it_gives_otherwise() -> None:
    treasury = ExchangeRates("USD", {"USD": Decimal(1), "EUR": Decimal("0.9"), "GBP": Decimal("0.8")})
    other_day = ExchangeRates("USD", {"USD": Decimal(1), "EUR": Decimal("0.90"), "GBP": Decimal("0.79")})
    fewer = ExchangeRates("USD", {"USD": Decimal(1), "EUR": Decimal("0.9")})
    trained = record(AmlThresholds(rates=treasury), Decimal(10000), Decimal("0.1"))
    assert mismatch(trained, record(AmlThresholds(rates=treasury), Decimal(10000), Decimal("0.1"))) is None
    assert mismatch(trained, record(AmlThresholds(rates=other_day), Decimal(10000), Decimal("0.1"))) == (
        "trained with AML_EXCHANGE_RATES giving GBP 0.8, but this worker gives it 0.79"
    )
    assert mismatch(trained, record(AmlThresholds(rates=fewer), Decimal(10000), Decimal("0.1"))) == (
        "trained with AML_EXCHANGE_RATES giving GBP 0.8, but this worker gives it no rate"
    )
