"""The payment contract, without Faust: validation shared by the gate and the Spark services.

Payments arrive as raw bytes and are validated here, not by a deserializer: a deserializer error would crash
the consumer (and Faust would ack, i.e. skip, the record). `validate_payment` turns every fault into an
`InvalidPayment` with a reason, which the caller sends to the dead-letter topic. Spark executors import this
module for every micro-batch, so it stays free of Faust and other heavy imports.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation

from aml_app.currencies import ISO_4217

REQUIRED = ("payment_id", "payer", "payee", "amount", "currency", "ts")
OPTIONAL = ("channel", "country")
MAX_ID_LENGTH = 128
MAX_AMOUNT = Decimal("1e15")
# ASCII digits only: Decimal() would also take "1_000", "1E+3", " 5 " or Arabic-Indic digits.
_DECIMAL = re.compile(r"-?[0-9]+(\.[0-9]+)?")


class InvalidPayment(ValueError):
    """A record on the payments topic that breaks the contract; the message is the DLQ reason."""


def _text_field(doc: dict, name: str, max_length: int = MAX_ID_LENGTH) -> str:
    value = doc[name]
    if not isinstance(value, str):
        raise InvalidPayment(f"field {name!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidPayment(f"field {name!r} is empty")
    if len(value) > max_length:
        raise InvalidPayment(f"field {name!r} is longer than {max_length} characters")
    return value


def _amount(doc: dict) -> str:
    raw = doc["amount"]
    if not isinstance(raw, str):
        raise InvalidPayment(
            f"field 'amount' must be a decimal string such as \"12.50\", got {type(raw).__name__}"
        )
    if not _DECIMAL.fullmatch(raw):
        raise InvalidPayment(
            f"field 'amount' must be plain decimal digits such as \"12.50\", got {raw[:40]!r}"
        )
    try:
        value = Decimal(raw)
    except InvalidOperation:
        raise InvalidPayment(f"field 'amount' is not a decimal number: {raw[:40]!r}") from None
    if not value.is_finite():
        raise InvalidPayment("field 'amount' is not a finite number")
    if value <= 0:
        raise InvalidPayment(f"field 'amount' must be greater than zero, got {raw[:40]}")
    if value >= MAX_AMOUNT:
        raise InvalidPayment(f"field 'amount' is implausibly large: {raw[:40]}")
    exponent = value.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -4:
        raise InvalidPayment(f"field 'amount' has more than 4 decimal places: {raw[:40]}")
    return raw


def _timestamp(doc: dict) -> str:
    raw = _text_field(doc, "ts", 40)
    try:
        when = datetime.fromisoformat(raw)
    except ValueError:
        raise InvalidPayment(f"field 'ts' is not an ISO-8601 timestamp: {raw!r}") from None
    if when.tzinfo is None or when.utcoffset() != UTC.utcoffset(None):
        raise InvalidPayment(f"field 'ts' must be in UTC (Z or +00:00): {raw!r}")
    return raw


def validate_payment(key: bytes | None, value: bytes | None, max_bytes: int) -> dict[str, str]:
    """Validate one raw record against the contract and return its fields, or raise InvalidPayment."""
    if value is None:
        raise InvalidPayment("value is empty (null)")
    if len(value) > max_bytes:
        raise InvalidPayment(f"value is {len(value)} bytes, over the limit of {max_bytes}")
    if key is None:
        raise InvalidPayment("key is missing (null); the key must be the payer account id")
    try:
        key_text = key.decode("utf-8")
        doc = json.loads(value.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidPayment("key or value is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise InvalidPayment(f"value is not JSON: {exc.msg} at position {exc.pos}") from None
    except (ValueError, RecursionError) as exc:
        # Nesting too deep, or an integer longer than Python converts: hostile input, not a crash.
        raise InvalidPayment(f"value is not acceptable JSON: {type(exc).__name__}") from None
    if not isinstance(doc, dict):
        raise InvalidPayment(f"value must be a JSON object, got {type(doc).__name__}")
    missing = [name for name in REQUIRED if name not in doc]
    if missing:
        raise InvalidPayment(f"missing field(s): {', '.join(missing)}")
    payer = _text_field(doc, "payer")
    if key_text != payer:
        raise InvalidPayment(f"key {key_text[:40]!r} does not match payer {payer[:40]!r}")
    currency = _text_field(doc, "currency", 3)
    if currency not in ISO_4217:
        raise InvalidPayment(f"field 'currency' is not an ISO 4217 code: {currency!r}")
    optional = {}
    for name in OPTIONAL:
        if doc.get(name) is not None:
            optional[name] = _text_field(doc, name, 64)
    return {
        "payment_id": _text_field(doc, "payment_id"),
        "payer": payer,
        "payee": _text_field(doc, "payee"),
        "amount": _amount(doc),
        "currency": currency,
        "ts": _timestamp(doc),
        **optional,
    }
