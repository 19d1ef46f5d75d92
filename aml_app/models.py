"""The payment and decision records of the Faust services; validation lives in `aml_app.contract`."""

from __future__ import annotations

from decimal import Decimal

import faust

from aml_app.contract import InvalidPayment, validate_payment

__all__ = ["Decision", "InvalidPayment", "Payment", "parse_payment"]


class Payment(faust.Record, serializer="json"):
    payment_id: str
    payer: str
    payee: str
    amount: str
    currency: str
    ts: str
    channel: str | None = None
    country: str | None = None

    @property
    def amount_decimal(self) -> Decimal:
        return Decimal(self.amount)


class Decision(faust.Record, serializer="json", include_metadata=False):
    """One per processed payment on `aml.decisions`, keyed by payment_id (plain JSON, no Faust metadata)."""

    payment_id: str
    partition: int
    offset: int
    verdict: str
    rules: list[str]
    note: str
    watermark: int
    dependencies: dict[str, int]
    waited_ms: float
    decided_at: str
    worker: str
    gated: bool


def parse_payment(key: bytes | None, value: bytes | None, max_bytes: int) -> Payment:
    """Validate one raw record against the contract, or raise InvalidPayment saying why."""
    return Payment(**validate_payment(key, value, max_bytes))
