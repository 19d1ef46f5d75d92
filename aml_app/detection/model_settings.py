"""The settings a model's features are computed with: recorded in the model file, checked at start-up.

The model reads the rules' hits, amounts in the reporting currency and C's count of near-threshold
payments. A worker whose `AML_RULE_*` thresholds, reporting currency, exchange rates or C's
`AML_REPORTING_THRESHOLD`/`AML_THRESHOLD_BAND` differ from those the model was trained with feeds it
numbers it never learnt from, and its cut and alert budgets no longer mean what the file says: a model
trained in dollars and run in yen compares amounts 150 times too large. `aml-app train-model` replays a
history with the deployment's settings and records them (`training.settings`); a file without the record
was trained with the defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from decimal import Decimal

from aml_app.detection.exchange import RATES_VARIABLE, REPORTING_VARIABLE
from aml_app.detection.thresholds import AmlThresholds, variable

THRESHOLD_VARIABLE = "AML_REPORTING_THRESHOLD"
BAND_VARIABLE = "AML_THRESHOLD_BAND"
#: C's near-threshold definition by default (`aml_app.settings.DependencySettings`, the training replay).
DEFAULT_THRESHOLD, DEFAULT_BAND = Decimal("10000"), Decimal("0.1")


def _text(value: object) -> str:
    """One text per value: 1000, 1000.0 and 1E+3 are the same threshold."""
    if isinstance(value, Decimal):
        return format(value.normalize(), "f")
    return str(value)


def record(thresholds: AmlThresholds, threshold: Decimal, band: Decimal) -> dict[str, str]:
    """Each setting the features depend on, by the variable that sets it, as text."""
    settings = {
        variable(f.name): _text(getattr(thresholds, f.name))
        for f in dataclasses.fields(thresholds)
        if f.name != "rates"
    }
    rates = thresholds.rates
    settings[REPORTING_VARIABLE] = rates.reporting
    settings[RATES_VARIABLE] = ",".join(f"{c}={_text(r)}" for c, r in sorted(rates.per_unit.items()))
    settings[THRESHOLD_VARIABLE] = _text(threshold)
    settings[BAND_VARIABLE] = _text(band)
    return settings


#: What a model file without a record was trained with.
DEFAULTS = record(AmlThresholds(), DEFAULT_THRESHOLD, DEFAULT_BAND)


def trained_with(training: Mapping[str, object]) -> dict[str, str]:
    """The settings a model file's `training` section records; the defaults for one it does not name."""
    recorded = training.get("settings") or {}
    if not isinstance(recorded, Mapping):
        raise ValueError("its training.settings is not an object")
    return {**DEFAULTS, **{str(k): str(v) for k, v in recorded.items()}}


def mismatch(trained: Mapping[str, str], deployed: Mapping[str, str]) -> str | None:
    """The first setting the deployment gives otherwise than the model was trained with, as "trained
    with X=a, but this worker has X=b" (for the rates, the first currency that differs); None when they
    agree."""
    # The reporting currency first: where it differs, every rate and amount does.
    for name in sorted(trained.keys() | deployed.keys(), key=lambda name: (name != REPORTING_VARIABLE, name)):
        was, has = trained.get(name, "unset"), deployed.get(name, "unset")
        if was == has:
            continue
        if name == RATES_VARIABLE:
            before, after = _rates(was), _rates(has)
            differing = sorted(c for c in before.keys() | after.keys() if before.get(c) != after.get(c))
            if differing:
                currency = differing[0]
                return (
                    f"trained with {name} giving {currency} {before.get(currency, 'no rate')}, but this "
                    f"worker gives it {after.get(currency, 'no rate')}"
                )
        return f"trained with {name}={was}, but this worker has {name}={has}"
    return None


def _rates(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)
