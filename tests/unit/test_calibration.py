"""The background measures by their definitions on hand-built payments, and their values on the real
AMLworld rows the simulator is to be calibrated against (BENCHMARKS.md, "Calibration")."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest

from aml_app.detection.exchange import ExchangeRates
from aml_app.simulation.amlworld import read_amlworld
from aml_app.simulation.calibration import measure

REAL = Path(__file__).resolve().parents[1] / "data" / "amlworld" / "HI-Small_Trans_rows1-7500.csv"


@dataclass(frozen=True)
class Paid:
    payer: str
    payee: str
    amount: str
    currency: str
    ts: str
    channel: str = "ach"


def test_each_measure_says_what_its_name_says() -> None:
    rates = ExchangeRates("EUR", {"EUR": Decimal(1), "USD": Decimal(2)})
    payments = [
        Paid("a", "a", "5", "EUR", "2026-03-02T10:00:00Z", "reinvestment"),  # a self-payment
        Paid("a", "b", "10", "EUR", "2026-03-02T10:00:00Z"),
        Paid("a", "b", "20", "USD", "2026-03-02T10:30:00Z"),  # 10 EUR; the same pair again
        Paid("a", "c", "30", "EUR", "2026-03-02T11:00:00Z"),
        Paid("d", "b", "40", "GBP", "2026-03-02T12:00:00Z", "wire"),  # no rate: not in the quantiles
    ]
    found = measure(payments, rates)
    assert (found.payments, found.hours, found.self_share) == (5, 2.0, 0.2)
    assert found.channels == {"ach": 0.6, "reinvestment": 0.2, "wire": 0.2}
    assert found.currencies == {"EUR": 0.6, "USD": 0.2, "GBP": 0.2}
    assert found.amounts == {"p10": 10.0, "p50": 10.0, "p90": 26.0, "p99": 29.6}
    assert (found.busiest_payer_share, found.top_percent_share) == (0.75, 0.75)
    assert found.repeat_ratio == round(4 / 3, 3)  # 4 payments between two parties, 3 pairs
    assert found.per_payer_hour == 1.0  # 4 payments, 2 payers, 2 hours
    with pytest.raises(ValueError, match="no payment between two parties"):
        measure(payments[:1], rates)


def test_the_real_background_the_simulator_is_held_to() -> None:
    real = measure(p for p in read_amlworld(REAL).payments if not p.is_laundering)
    assert real.payments == 7494 and 0.72 < real.self_share < 0.73
    assert real.amounts["p50"] == pytest.approx(4961.09)
    assert 0.06 < real.busiest_payer_share < 0.08 and real.repeat_ratio > 1.5
