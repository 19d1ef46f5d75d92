"""The payment contract, without Faust: validation shared by the gate and the Spark services.

Payments arrive as raw bytes and are validated here, not by a deserializer: a deserializer error would crash
the consumer (and Faust would ack, i.e. skip, the record). `validate_payment` turns every fault into an
`InvalidPayment` with a reason, which the caller sends to the dead-letter topic. Spark executors import this
module for every micro-batch, so it stays free of Faust and other heavy imports.

The contract is meant to be implemented twice and agree exactly: here (the worker, and the DLQ reasons) and as
Spark SQL expressions (`aml_app.pipeline.validation`, checked against this module record by record by
`tests/unit/test_validation_sql.py`). So it says nothing that depends on one library's behaviour: JSON that
two parsers could read differently (duplicate keys, NaN, lone surrogates) is refused, every size is bounded
here below the limits of Python's and Jackson's parsers, and `ts` is one fixed RFC 3339 profile rather than
whatever `datetime.fromisoformat` of this Python version accepts.

`ts` is bounded against the Kafka record's timestamp: a payment cannot happen after it was sent, so a `ts`
later than its record's timestamp plus the allowed clock skew (`AML_MAX_CLOCK_SKEW`) breaks the contract.
Without that bound one payment stamped years ahead (a producer's wrong clock, a typo) would hold its
partition under the event-time gate for as long as traffic flows, since no cut ever reaches it. There is no
bound for the past: backfills and replays are payments too. A record without a timestamp (-1) is not checked.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from aml_app.currencies import ISO_4217

REQUIRED = ("payment_id", "payer", "payee", "amount", "currency", "ts")
OPTIONAL = ("channel", "country")
MAX_ID_LENGTH = 128
MAX_OPTIONAL_LENGTH = 64
MAX_AMOUNT = Decimal("1e15")
# Portable JSON: bounds below every parser's own limit (Python: recursion limit, 4300-digit integers;
# Jackson, which Spark uses: depth 1000, 1000-digit numbers, 50000-character names), so that no record is
# refused by one implementation and accepted by the other. Depth counts the top-level object as 1.
MAX_JSON_DEPTH = 64
MAX_NUMBER_LENGTH = 100  # characters of a number as written, sign and exponent included
MAX_NAME_LENGTH = 1000  # characters (code points) of an object key, after unescaping
# ASCII digits only: Decimal() would also take "1_000", "1E+3", " 5 " or Arabic-Indic digits.
_DECIMAL = re.compile(r"-?[0-9]+(\.[0-9]+)?")
# `ts`, one RFC 3339 profile: YYYY-MM-DDTHH:MM:SS, optionally 1 to 6 fraction digits, then Z or +00:00;
# year 0001-9999, hours 00-23, seconds 00-59 (no leap second), and a day that exists in its month.
TIMESTAMP_FORMAT = "YYYY-MM-DDTHH:MM:SS[.ffffff]Z"
_TIMESTAMP = re.compile(
    r"(?!0000)[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r"T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|\+00:00)"
)
# Only to say why a timestamp was refused: the shape, whatever the ranges, with any offset or none.
_TIMESTAMP_SHAPE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,6})?(.*)")
_SURROGATE = re.compile("[\ud800-\udfff]")
# A lone surrogate can only come from a \uD800-\uDFFF escape (UTF-8 cannot encode one); this also matches
# escapes of U+D000-U+D7FF and an escaped backslash before "ud", which only costs a walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD]")
#: AML_MAX_CLOCK_SKEW's default, seconds: how far a payment's `ts` may be after its Kafka record's timestamp.
#: It is also the longest one future-dated payment can hold its partition under continuous traffic (the
#: event-time gate admits it once every partition is applied up to its `ts`), while NTP-synchronised clocks
#: differ by milliseconds (docs/contract.md).
DEFAULT_MAX_CLOCK_SKEW = 5.0
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


class InvalidPayment(ValueError):
    """A record on the payments topic that breaks the contract; the message is the DLQ reason."""


# --- JSON ---------------------------------------------------------------------------------------------------


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise InvalidPayment(f"value has the key {name[:40]!r} twice in one JSON object")
            seen.add(name)
    return doc


def _constant(name: str) -> Any:
    raise InvalidPayment(f"value contains {name}, which is not a JSON number")


def _number(text: str) -> str:
    if len(text) > MAX_NUMBER_LENGTH:
        raise InvalidPayment(f"value has a number longer than {MAX_NUMBER_LENGTH} characters")
    return text


# Numbers in extra fields are checked for length and then converted as json would; strings and the hot path
# (a flat object of strings) pay only for the duplicate-key check.
_JSON = json.JSONDecoder(
    object_pairs_hook=_object,
    parse_constant=_constant,
    parse_int=lambda text: int(_number(text)),
    parse_float=lambda text: float(_number(text)),
)


def _check_tree(node: dict[str, Any] | list[Any], depth: int) -> None:
    """Depth, key lengths and lone surrogates of a parsed document (only called when the bytes allow them)."""
    if depth > MAX_JSON_DEPTH:
        raise InvalidPayment(f"value nests JSON objects and arrays more than {MAX_JSON_DEPTH} levels deep")
    items: Iterable[Any]
    if isinstance(node, dict):
        for name in node:
            if len(name) > MAX_NAME_LENGTH:
                raise InvalidPayment(f"value has a JSON key longer than {MAX_NAME_LENGTH} characters")
            if _SURROGATE.search(name):
                raise InvalidPayment("value has a JSON key with an unpaired UTF-16 surrogate escape")
        items = node.values()
    else:
        items = node
    for item in items:
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise InvalidPayment("value has a JSON string with an unpaired UTF-16 surrogate escape")
        elif isinstance(item, (dict, list)):
            _check_tree(item, depth + 1)


def _document(value: bytes) -> Any:
    try:
        doc = _JSON.decode(value.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidPayment("key or value is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise InvalidPayment(f"value is not JSON: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise InvalidPayment(
            f"value nests JSON objects and arrays more than {MAX_JSON_DEPTH} levels deep"
        ) from None
    # Cheap tests on the bytes decide whether the document can break a rule that needs a walk over it: a
    # long key needs a long value, a lone surrogate an escape, depth brackets.
    if isinstance(doc, (dict, list)) and (
        len(value) > MAX_NAME_LENGTH
        or _SURROGATE_ESCAPE.search(value)
        or value.count(b"{") + value.count(b"[") > MAX_JSON_DEPTH
    ):
        _check_tree(doc, 1)
    return doc


# --- fields -------------------------------------------------------------------------------------------------


def _text_field(doc: dict, name: str, max_length: int = MAX_ID_LENGTH) -> str:
    value = doc[name]
    if not isinstance(value, str):
        raise InvalidPayment(f"field {name!r} must be a string, got {type(value).__name__}")
    if "\x00" in value:  # PostgreSQL's text, where B and C keep accounts, cannot hold one
        raise InvalidPayment(f"field {name!r} holds a NUL character (U+0000), which no text field may hold")
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
    match = _TIMESTAMP.fullmatch(raw)
    if match is None:
        shape = _TIMESTAMP_SHAPE.fullmatch(raw)
        if shape is None:
            raise InvalidPayment(f"field 'ts' is not an RFC 3339 timestamp {TIMESTAMP_FORMAT}: {raw!r}")
        if shape[1] not in ("Z", "+00:00"):
            raise InvalidPayment(f"field 'ts' must be in UTC (Z or +00:00): {raw!r}")
        raise InvalidPayment(f"field 'ts' is not a real date and time: {raw!r}")
    month, day = match.group(1, 2)
    if day > "28" and int(day) > calendar.monthrange(int(raw[:4]), int(month))[1]:
        raise InvalidPayment(f"field 'ts' is not a real date: {raw!r}")
    return raw


def skew_micros(seconds: float) -> int:
    """The allowed clock skew in whole microseconds, as both implementations of the contract compare it."""
    return round(seconds * 1_000_000)


def _instant(ms: int) -> str:
    return (_EPOCH + timedelta(milliseconds=ms)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _not_after_sending(ts: str, record_timestamp: int | None, max_clock_skew: float) -> None:
    """`ts` at most `max_clock_skew` seconds after the record's timestamp (ms since the epoch; None or
    negative: the record has none, nothing to check)."""
    if record_timestamp is None or record_timestamp < 0:
        return
    ts_us = (datetime.fromisoformat(ts) - _EPOCH) // _MICROSECOND
    if ts_us - record_timestamp * 1000 > skew_micros(max_clock_skew):
        raise InvalidPayment(
            f"field 'ts' {ts} is more than the allowed clock skew of {max_clock_skew:g} s "
            f"(AML_MAX_CLOCK_SKEW) after its Kafka record's timestamp {_instant(record_timestamp)}: "
            "a payment cannot happen after it was sent"
        )


def validate_payment(
    key: bytes | None,
    value: bytes | None,
    max_bytes: int,
    record_timestamp: int | None = None,
    max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW,
) -> dict[str, str]:
    """Validate one raw record against the contract and return its fields, or raise InvalidPayment.

    `record_timestamp` is the Kafka record's timestamp in milliseconds since the epoch (None or negative:
    none, and `ts` is not bounded); `ts` may be at most `max_clock_skew` seconds after it.
    """
    if value is None:
        raise InvalidPayment("value is empty (null)")
    if len(value) > max_bytes:
        raise InvalidPayment(f"value is {len(value)} bytes, over the limit of {max_bytes}")
    if key is None:
        raise InvalidPayment("key is missing (null); the key must be the payer account id")
    try:
        key_text = key.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidPayment("key or value is not UTF-8 text") from None
    doc = _document(value)
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
            optional[name] = _text_field(doc, name, MAX_OPTIONAL_LENGTH)
    fields = {
        "payment_id": _text_field(doc, "payment_id"),
        "payer": payer,
        "payee": _text_field(doc, "payee"),
        "amount": _amount(doc),
        "currency": currency,
        "ts": _timestamp(doc),
        **optional,
    }
    _not_after_sending(fields["ts"], record_timestamp, max_clock_skew)
    return fields


def origin_headers(
    prefix: str, reason: str, topic: str, partition: int, offset: int, origin: str, **more: object
) -> list[tuple[str, bytes]]:
    """Headers of a record set aside (`prefix`: `dlq` or `review`), as Kafka Connect writes a dead
    letter's: why, anything `more` to say, and where the original bytes were read."""
    return [
        (f"{prefix}.reason", reason.encode()),
        *((f"{prefix}.{name}", str(value).encode()) for name, value in more.items()),
        (f"{prefix}.topic", topic.encode()),
        (f"{prefix}.partition", str(partition).encode()),
        (f"{prefix}.offset", str(offset).encode()),
        (f"{prefix}.worker", origin.encode()),
    ]


#: The most bytes of a record's value one record set aside (a dead letter, a review copy) carries. A
#: record the contract refuses for its size can be larger than a producer's `max.request.size` or a
#: topic's `max.message.bytes` (1 MB by default): sent whole, it would be refused for ever and hold its
#: partition. A larger value goes in parts (`in_parts`).
SET_ASIDE_PART_BYTES = 512 * 1024

#: The largest value a valid payment may have (`AML_MAX_PAYMENT_BYTES` at most): with its key (the payer,
#: at most MAX_ID_LENGTH characters of up to 4 UTF-8 bytes) it fits in one record set aside.
MAX_VALID_PAYMENT_BYTES = SET_ASIDE_PART_BYTES - 4 * MAX_ID_LENGTH


#: The least a part carries, however long the key that goes with each part.
MIN_PART_BYTES = 4096


def in_parts(
    value: bytes | None,
    headers: Sequence[tuple[str, Any]],
    prefix: str,
    key: bytes | None = None,
    part_bytes: int = SET_ASIDE_PART_BYTES,
) -> list[tuple[bytes | None, bytes | None, list[tuple[str, Any]]]]:
    """The (key, value, headers) records that carry `value` with `key` and `headers`: itself, or when key
    and value together are larger than `part_bytes` the value's consecutive slices (each at most
    `part_bytes` less the key's length), each with `<prefix>.part` (`i/n`, from 1) and `<prefix>.bytes`
    (the whole value's length), so that a reader joins the parts of one origin in order into the
    original bytes. Every part carries the key, so a long key leaves less room for the value; a key
    longer than `part_bytes - MIN_PART_BYTES` would leave too little (a record of about 1 MB is refused
    at Kafka's defaults whatever its value), so it goes at the front of the value, named by
    `<prefix>.key-bytes` (its length), and each part's key is its SHA-256, which keeps the parts on one
    partition."""
    if key is not None and len(key) > part_bytes - MIN_PART_BYTES:
        headers = [*headers, (f"{prefix}.key-bytes", str(len(key)).encode())]
        value, key = key + (value or b""), b"sha256:" + hashlib.sha256(key).hexdigest().encode()
    room = part_bytes - len(key or b"")
    if value is None or len(value) <= room:
        return [(key, value, [*headers])]
    count = -(-len(value) // room)
    total = str(len(value)).encode()
    return [
        (
            key,
            value[i * room : (i + 1) * room],
            [*headers, (f"{prefix}.part", f"{i + 1}/{count}".encode()), (f"{prefix}.bytes", total)],
        )
        for i in range(count)
    ]


def dead_letter_headers(
    reason: str, topic: str, partition: int, offset: int, origin: str
) -> list[tuple[str, bytes]]:
    """A dead letter's headers: why, and where the original bytes were read."""
    return origin_headers("dlq", reason, topic, partition, offset, origin)
