"""One reporting currency for the AML rules: fixed exchange rates, configured at start-up.

Why: a hub that receives euros and pays out dollars moves the same money; compared currency by currency,
its intake and its output look unrelated and every amount threshold means something else in yen than in
dollars. The rules convert every sum into the reporting currency before comparing it.

Rates are units of a currency per one unit of the reporting currency (`JPY=105.4` with USD reporting).
The defaults are the fixed rates of IBM's AMLworld generator, whose data this project is scored on: the
euro's rate is read off AMLworld rows paid in dollars and received in euros (0.8534), and the yuan's,
yen's, rupee's and rouble's agree within 5 % with the rates its laundering hops show
(`tests/unit/test_exchange.py`). A deployment sets its treasury's rates with `AML_EXCHANGE_RATES`.

An amount in a currency without a rate is not converted and counts as nothing (it can never cause an
alert); the rules name such currencies in their figures, so an analyst sees what was left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from types import MappingProxyType

from aml_app.currencies import ISO_4217
from aml_app.errors import ConfigError
from aml_app.numbers import ascii_decimal

CENT = Decimal("0.01")
#: The range of a rate: amounts and thresholds converted with one stay within Decimal's 28 digits at the
#: cent (a rate of 1e30 made every conversion of 5,000 raise InvalidOperation at worker start).
LOWEST_RATE, HIGHEST_RATE = Decimal("1e-9"), Decimal("1e9")
REPORTING_VARIABLE = "AML_REPORTING_CURRENCY"
RATES_VARIABLE = "AML_EXCHANGE_RATES"

#: AMLworld's rates: units per US dollar.
AMLWORLD_RATES: Mapping[str, Decimal] = MappingProxyType(
    {
        "USD": Decimal("1"),
        "EUR": Decimal("0.8534"),
        "GBP": Decimal("0.7734"),
        "CHF": Decimal("0.9151"),
        "CAD": Decimal("1.3118"),
        "AUD": Decimal("1.4127"),
        "JPY": Decimal("105.4"),
        "CNY": Decimal("6.6976"),
        "INR": Decimal("73.44"),
        "RUB": Decimal("77.79"),
        "MXN": Decimal("21.1"),
        "BRL": Decimal("5.6498"),
        "SAR": Decimal("3.7515"),
        "ILS": Decimal("3.3527"),
    }
)


@dataclass(frozen=True)
class ExchangeRates:
    """Units of each currency per one unit of `reporting`; the reporting currency's own rate is 1."""

    reporting: str = "USD"
    per_unit: Mapping[str, Decimal] = field(default_factory=lambda: AMLWORLD_RATES)

    def __post_init__(self) -> None:
        if self.reporting not in ISO_4217:
            raise ConfigError(f"{REPORTING_VARIABLE}={self.reporting!r} is not an ISO 4217 currency code.")
        if self.per_unit.get(self.reporting) != 1:
            raise ConfigError(
                f"{RATES_VARIABLE} must give the reporting currency {self.reporting} the rate 1, "
                f"got {self.per_unit.get(self.reporting)}."
            )
        for currency, rate in self.per_unit.items():
            if currency not in ISO_4217:
                raise ConfigError(f"{RATES_VARIABLE} names {currency!r}, which is not an ISO 4217 code.")
            if not isinstance(rate, Decimal):
                raise ConfigError(
                    f"{RATES_VARIABLE} gives {currency} the rate {rate!r}; a rate is a Decimal."
                )
            if not rate.is_finite() or not LOWEST_RATE <= rate <= HIGHEST_RATE:
                raise ConfigError(
                    f"{RATES_VARIABLE} gives {currency} the rate {rate}; a rate is from {LOWEST_RATE:f} to "
                    f"{HIGHEST_RATE:f}."
                )

    def convert(self, amount: Decimal, currency: str) -> Decimal | None:
        """`amount` in the reporting currency, or None when `currency` has no rate."""
        rate = self.per_unit.get(currency)
        return None if rate is None else amount / rate

    def total(self, sums: Mapping[str, Decimal]) -> Decimal:
        """The sum of per-currency amounts in the reporting currency, to the cent; currencies without a
        rate count 0."""
        exact = Decimal(0)
        for currency, amount in sums.items():  # a loop, not generators: every rule and window calls it
            converted = self.convert(amount, currency)
            if converted is not None:
                exact += converted
        return exact.quantize(CENT, rounding=ROUND_HALF_EVEN)

    def in_each(self, amount: Decimal) -> dict[str, Decimal]:
        """`amount` (in the reporting currency) in every currency with a rate, to the cent: one question
        asked the same in each currency, as Service B's heavy edges."""
        return {c: _cents(amount * rate) for c, rate in self.per_unit.items()}

    def in_one(self, amount: Decimal, currency: str) -> Decimal | None:
        """`amount` (in the reporting currency) in `currency`, to the cent as `in_each` gives it; None
        without a rate."""
        rate = self.per_unit.get(currency)
        return None if rate is None else _cents(amount * rate)

    def unconverted(self, sums: Mapping[str, Decimal]) -> list[str]:
        """The currencies of `sums` that have no rate, sorted (named in a hit's figures)."""
        return sorted(c for c in sums if c not in self.per_unit)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ExchangeRates:
        """The rates of `AML_REPORTING_CURRENCY` (default USD) and `AML_EXCHANGE_RATES`.

        Without `AML_EXCHANGE_RATES`, the defaults restated against the reporting currency. With it, the
        whole table ("EUR=0.92,JPY=150": units per one unit of the reporting currency, which is 1 whether
        named or not): a table that mixed a treasury's rates with defaults of another day would be wrong
        in ways no one could see."""
        reporting = env.get(REPORTING_VARIABLE, "").strip().upper() or "USD"
        raw = env.get(RATES_VARIABLE, "").strip()
        if reporting not in ISO_4217:
            raise ConfigError(f"{REPORTING_VARIABLE}={reporting!r} is not an ISO 4217 currency code.")
        if not raw:
            base = AMLWORLD_RATES.get(reporting)
            if base is None:
                raise ConfigError(
                    f"{REPORTING_VARIABLE}={reporting} has no default rates; give every currency's rate "
                    f"against it in {RATES_VARIABLE}."
                )
            return cls(reporting, MappingProxyType({c: rate / base for c, rate in AMLWORLD_RATES.items()}))
        rates = {reporting: Decimal(1)}
        named: set[str] = set()
        for item in (part.strip() for part in raw.split(",")):
            if not item:
                continue
            currency, sep, text = item.partition("=")
            rate = ascii_decimal(text) if sep else None
            if rate is None or not LOWEST_RATE <= rate <= HIGHEST_RATE:
                raise ConfigError(
                    f"{RATES_VARIABLE} has {item!r}; expected CODE=RATE items such as EUR=0.92, "
                    f"a rate from {LOWEST_RATE:f} to {HIGHEST_RATE:f} units per one {reporting}."
                )
            code = currency.strip().upper()
            if code in named:
                raise ConfigError(f"{RATES_VARIABLE} names {code} twice; give each currency one rate.")
            named.add(code)
            rates[code] = rate
        if not named:
            raise ConfigError(
                f"{RATES_VARIABLE}={raw!r} names no currency; give CODE=RATE items such as EUR=0.92, or "
                "leave it unset for the default rates."
            )
        return cls(reporting, MappingProxyType(rates))


def _cents(amount: Decimal) -> Decimal:
    return amount.quantize(CENT, rounding=ROUND_HALF_EVEN)
