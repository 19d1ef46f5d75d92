"""Every threshold of every detection rule, with defaults, read from `AML_RULE_<NAME>` variables.

Why one place: a rule's behaviour is its code plus these numbers; keeping them together (and out of the
rules) lets an operator tune detection without a release, and lets the simulator size its injected
patterns from the same values the rules use.

`LIMITS` holds each field's allowed range. `from_env` reads `AML_RULE_<FIELD NAME IN UPPER CASE>`
(e.g. `AML_RULE_FAN_IN_MIN_COUNTERPARTIES`); a blank variable keeps the default; a bad value raises
`ConfigError` with one sentence naming the variable, as `aml_app.settings` does. An `AML_RULE_*` variable
that names no threshold is refused too: a typo must not silently leave a default in force.

Amounts are in the reporting currency: the rules convert every sum with `rates`
(`aml_app.detection.exchange`, read from `AML_REPORTING_CURRENCY` and `AML_EXCHANGE_RATES`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TypeVar

from aml_app.detection.exchange import ExchangeRates
from aml_app.errors import ConfigError
from aml_app.numbers import DECIMAL_PLACES, WHOLE_TEXT, ascii_decimal, decimal_places

PREFIX = "AML_RULE_"

_T = TypeVar("_T")


@dataclass(frozen=True)
class AmlThresholds:
    """Thresholds of Service-A's AML rules (see `aml_app.detection.rules`)."""

    structuring_min_count: int = 3
    fan_in_min_counterparties: int = 4
    fan_in_min_average: Decimal = Decimal("1000")
    fan_out_min_counterparties: int = 4
    fan_out_min_average: Decimal = Decimal("1000")
    fan_max_payments_per_counterparty: Decimal = Decimal("1.25")
    cycle_min_hops: int = 2
    cycle_max_hops: int = 12
    pass_through_min_received: Decimal = Decimal("5000")
    pass_through_min_ratio: Decimal = Decimal("0.8")
    pass_through_max_ratio: Decimal = Decimal("1.2")
    graph_min_average: Decimal = Decimal("1000")
    gather_scatter_min_counterparties: int = 3
    scatter_gather_min_intermediates: int = 3
    bipartite_min_sources: int = 2
    bipartite_min_destinations: int = 2
    stack_min_sources: int = 2
    random_min_hops: int = 3
    rates: ExchangeRates = field(default_factory=ExchangeRates)

    def __post_init__(self) -> None:
        _check_ranges(self)
        if self.cycle_min_hops > self.cycle_max_hops:
            raise ConfigError(
                f"{PREFIX}CYCLE_MIN_HOPS={self.cycle_min_hops} is larger than "
                f"{PREFIX}CYCLE_MAX_HOPS={self.cycle_max_hops}; no cycle could ever match."
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AmlThresholds:
        """The thresholds with `AML_RULE_*` overrides from `env`; ConfigError names a bad variable."""
        return dataclasses.replace(_from_env(cls, env), rates=ExchangeRates.from_env(env))


@dataclass(frozen=True)
class FraudThresholds:
    """Thresholds of Service-A1's fraud rules (see `aml_app.detection.fraud_rules`)."""

    large_new_counterparty_min_amount: Decimal = Decimal("5000")
    velocity_min_count: int = 10
    velocity_multiple: Decimal = Decimal("5")
    rates: ExchangeRates = field(default_factory=ExchangeRates)

    def __post_init__(self) -> None:
        _check_ranges(self)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FraudThresholds:
        """The thresholds with `AML_RULE_*` overrides from `env`; ConfigError names a bad variable."""
        return dataclasses.replace(_from_env(cls, env), rates=ExchangeRates.from_env(env))


# field -> (lowest, highest, what it counts): the allowed range of every threshold, inclusive.
LIMITS: dict[str, tuple[Any, Any, str]] = {
    "structuring_min_count": (1, 1000, "near-threshold payments sent by the payer in 24h, this one included"),
    "fan_in_min_counterparties": (2, 100_000, "distinct payers of the payee in 7 days"),
    "fan_in_min_average": (Decimal(0), Decimal("1e12"), "average amount received by the payee in 7 days"),
    "fan_out_min_counterparties": (2, 100_000, "distinct payees of the payer in 7 days"),
    "fan_out_min_average": (Decimal(0), Decimal("1e12"), "average amount sent by the payer in 7 days"),
    "fan_max_payments_per_counterparty": (
        Decimal(1),
        Decimal(1000),
        "a fan's payments over its counterparties in 7 days (1: each exactly once)",
    ),
    "cycle_min_hops": (2, 16, "shortest cycle that counts, in payments (a self-payment is none)"),
    "cycle_max_hops": (2, 16, "longest cycle that counts, in payments; Service B looks at most 16 deep"),
    "pass_through_min_received": (Decimal("0.01"), Decimal("1e12"), "amount received by the payer in 1h"),
    "pass_through_min_ratio": (Decimal("0.01"), Decimal(1), "share of the 1h receipts sent on in that hour"),
    "pass_through_max_ratio": (Decimal(1), Decimal(1000), "the most sent in that hour per unit received"),
    "graph_min_average": (Decimal(0), Decimal("1e12"), "average payment of an edge the layering rules count"),
    "gather_scatter_min_counterparties": (2, 100_000, "distinct payers and payees of the hub in 7 days"),
    "scatter_gather_min_intermediates": (2, 100_000, "intermediates between one source and the payee"),
    "bipartite_min_sources": (2, 100_000, "heavy payers the payee shares with other payees"),
    "bipartite_min_destinations": (2, 11, "payees in the block, this one included (B lists 10 others)"),
    "stack_min_sources": (2, 10, "sources reaching the payee through 2 or more intermediates (B lists 10)"),
    "random_min_hops": (2, 3, "payments of a heavy flow ending with this payment (B looks 3 deep)"),
    "large_new_counterparty_min_amount": (Decimal("0.01"), Decimal("1e12"), "first payment to a payee"),
    "velocity_min_count": (1, 1_000_000, "payments sent by the payer in 1h"),
    # At most 168: the 7-day count includes the hour's, so the ratio never exceeds the week's hours.
    "velocity_multiple": (Decimal(1), Decimal(168), "1h count over the payer's 7-day hourly average"),
}


def variable(name: str) -> str:
    """The environment variable of threshold field `name`."""
    return PREFIX + name.upper()


def known_variables() -> frozenset[str]:
    """Every `AML_RULE_*` variable either rule set reads."""
    return frozenset(variable(f.name) for cls in (AmlThresholds, FraudThresholds) for f in _numbers(cls))


def _numbers(thresholds: Any) -> list[dataclasses.Field[Any]]:
    """The numeric thresholds (every field but the exchange rates, which have variables of their own)."""
    return [f for f in dataclasses.fields(thresholds) if f.name != "rates"]


def _check_ranges(thresholds: Any) -> None:
    """Refuse out-of-range values also when the dataclass is built in code, not only from the environment."""
    for f in _numbers(thresholds):
        value = getattr(thresholds, f.name)
        low, high, meaning = LIMITS[f.name]
        expected = int if isinstance(f.default, int) else Decimal
        if isinstance(value, bool) or not isinstance(value, expected):
            raise ConfigError(f"{variable(f.name)} must be a {_kind(f.default)}, got {value!r}.")
        if isinstance(value, Decimal) and not value.is_finite():
            raise ConfigError(f"{variable(f.name)}={value} is not a finite number.")
        if not low <= value <= high:
            raise ConfigError(
                f"{variable(f.name)}={_show(value)} is out of range; "
                f"expected {_show(low)}..{_show(high)} ({meaning})."
            )
        if isinstance(value, Decimal) and decimal_places(value) > DECIMAL_PLACES:
            # Compared exactly with sums of amounts of at most 4 places (`rules`), and printed in figures.
            raise ConfigError(
                f"{variable(f.name)}={_show(value)} has more than {DECIMAL_PLACES} decimal places."
            )


def _show(value: Any) -> str:
    """Plain text for a value in a message ("1000000000000", not "1E+12"); a number too long to read
    (or to print: "1e999999999" has a billion digits) in scientific notation."""
    if isinstance(value, Decimal):
        return format(value, "f") if -30 < value.adjusted() < 30 else format(value, ".6e")
    return str(value)


def _kind(default: Any) -> str:
    return "whole number" if isinstance(default, int) else "decimal number"


def _parse(f: dataclasses.Field[Any], raw: str) -> int | Decimal:
    name = variable(f.name)
    low, high = (_show(limit) for limit in LIMITS[f.name][:2])
    text = raw.strip()
    # ASCII digits only: int() and Decimal() also take "1_0" and other scripts' digits.
    if isinstance(f.default, int):
        if not WHOLE_TEXT.fullmatch(text):
            raise ConfigError(f"{name}={raw!r} is not a whole number; expected {low}..{high}.")
        return int(text)
    value = ascii_decimal(text)
    if value is None:
        raise ConfigError(f"{name}={raw!r} is not a decimal number; expected {low}..{high}.")
    return value


def _from_env(cls: type[_T], env: Mapping[str, str]) -> _T:
    unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in known_variables())
    if unknown:
        known = ", ".join(sorted(known_variables()))
        raise ConfigError(f"{unknown[0]} is not a detection threshold; the known ones are {known}.")
    values: dict[str, Any] = {}
    for f in _numbers(cls):
        raw = env.get(variable(f.name))
        if raw is not None and raw.strip():
            values[f.name] = _parse(f, raw)
    return cls(**values)
