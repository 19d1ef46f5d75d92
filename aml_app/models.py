"""The payment and decision records of the Faust services; validation lives in `aml_app.contract`."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import faust
import msgspec

from aml_app.contract import DEFAULT_MAX_CLOCK_SKEW, InvalidPayment, validate_payment

__all__ = ["Alert", "Decision", "InvalidPayment", "Payment", "parse_payment"]


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
    """One per processed payment on `<service>.decisions`, keyed by payment_id (plain JSON, no metadata).

    `fresh` says whether every dependency's answer included the payment (`evidence_as_of[dep] > offset`;
    null for a dependency reading a derived topic, whose `as_of` is of that topic);
    with the gate on a decision is only made on fresh evidence, so it is false only in the ungated
    comparison mode. `stale_reads` counts the rounds of answers that did not include the payment.
    """

    payment_id: str
    partition: int
    offset: int
    service: str
    verdict: str
    rules: list[str]
    typologies: list[str]
    note: str
    watermark: int
    dependencies: dict[str, int]
    waited_ms: float
    decided_at: str
    worker: str
    gated: bool
    fresh: bool = True
    stale_reads: int = 0
    evidence_as_of: dict[str, int | None] = {}
    #: The event-time gate's cut the payment was decided at: the instant, the frontier and every W(q)
    #: (aml_app.gate.event_time.decided_at); None under the per-partition gate or with the gate off.
    cut: dict[str, Any] | None = None
    #: Decided on the evidence there was after waiting past AML_MAX_WAIT (AML_WAIT_POLICY=decide-stale);
    #: the payment is on the review topic too.
    stale: bool = False


DECISION_DEFAULTS = {"fresh": True, "stale_reads": 0, "evidence_as_of": {}, "cut": None, "stale": False}


def decision_json(**fields: Any) -> bytes:
    """The JSON `Decision(**fields).dumps()` gives, without building the record, and encoded by msgspec
    in a ninth of json's time (the workers' and the probe's hot path; unit-tested against the record)."""
    return msgspec.json.encode({**fields, **{k: v for k, v in DECISION_DEFAULTS.items() if k not in fields}})


class Alert(faust.Record, serializer="json", include_metadata=False):
    """A flagged payment on `<service>.alerts`, keyed by payment_id, with the evidence that flagged it.

    Each hit: rule, typology, reason (a sentence), figures (the numbers that crossed a threshold), path.
    """

    payment_id: str
    partition: int
    offset: int
    service: str
    payer: str
    payee: str
    amount: str
    currency: str
    ts: str
    typologies: list[str]
    hits: list[dict]
    decided_at: str
    worker: str
    #: What analysts rank their queue by: the learned model's score of the payment (its probability that
    #: the payment is not benign), or with the AML rules alone the strongest of the rules that alerted
    #: (`aml_app.detection.rules.RULE_STRENGTH`); None for the fraud rules.
    score: float | None = None


def parse_payment(
    key: bytes | None,
    value: bytes | None,
    max_bytes: int,
    record_timestamp: int | None = None,
    max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW,
) -> Payment:
    """Validate one raw record against the contract, or raise InvalidPayment saying why.
    `record_timestamp`: the Kafka record's, in milliseconds (None: none)."""
    fields = validate_payment(key, value, max_bytes, record_timestamp, max_clock_skew)
    # faust.Record types __init__ with a keyword `__strict__: bool`, which mypy matches the str fields to.
    return Payment(**fields)  # type: ignore[arg-type]
