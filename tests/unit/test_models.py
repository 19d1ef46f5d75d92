"""parse_payment: the payment contract, one InvalidPayment reason per fault."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aml_app.contract import REQUIRED
from aml_app.models import InvalidPayment, Payment, parse_payment

MAX = 65536
KEY = b"acct-1"
_DROP = object()


def doc(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "payment_id": "pay-1",
        "payer": "acct-1",
        "payee": "acct-2",
        "amount": "12.50",
        "currency": "EUR",
        "ts": "2024-05-01T12:00:00Z",
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not _DROP}


def encode(document: Any) -> bytes:
    return json.dumps(document).encode()


def parse(document: Any, key: bytes | None = KEY, max_bytes: int = MAX) -> Payment:
    return parse_payment(key, encode(document), max_bytes)


def rejects(reason: str, key: bytes | None = KEY, value: bytes | None = None) -> str:
    with pytest.raises(InvalidPayment) as info:
        parse_payment(key, value, MAX)
    message = str(info.value)
    assert reason in message, f"{reason!r} not in {message!r}"
    return message


# --- accepted ---------------------------------------------------------------------------------


def test_valid_payment_without_optional_fields() -> None:
    p = parse(doc())
    assert isinstance(p, Payment)
    assert (p.payment_id, p.payer, p.payee) == ("pay-1", "acct-1", "acct-2")
    assert p.amount == "12.50"
    assert str(p.amount_decimal) == "12.50"
    assert (p.currency, p.ts) == ("EUR", "2024-05-01T12:00:00Z")
    assert p.channel is None
    assert p.country is None


def test_valid_payment_with_optional_fields() -> None:
    p = parse(doc(channel="sepa", country="DE"))
    assert p.channel == "sepa"
    assert p.country == "DE"


def test_optional_fields_may_be_null() -> None:
    p = parse(doc(channel=None, country=None))
    assert p.channel is None and p.country is None


def test_utc_offset_zero_is_accepted() -> None:
    assert parse(doc(ts="2024-05-01T12:00:00+00:00")).ts == "2024-05-01T12:00:00+00:00"


def test_unknown_extra_fields_do_not_break_parsing() -> None:
    assert parse(doc(note="hello")).payment_id == "pay-1"


# --- raw record faults --------------------------------------------------------------------------


def test_null_value() -> None:
    rejects("null", value=None)


def test_oversize_value() -> None:
    rejects("over the limit", value=b" " * (MAX + 1))


def test_null_key() -> None:
    rejects("key is missing", key=None, value=encode(doc()))


def test_non_utf8_value() -> None:
    rejects("not UTF-8", value=b'{"payer": "\xff\xfe"}')


def test_non_utf8_key() -> None:
    rejects("not UTF-8", key=b"\xc3\x28", value=encode(doc()))


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"a": 1', b"NaNa", b'{"a": NaN}', b"[Infinity]"])
def test_invalid_json(raw: bytes) -> None:
    """NaN and Infinity are not JSON (RFC 8259), though Python's json reads them: refused by name."""
    rejects("NaN" if b"NaN" in raw else "Infinity" if b"Infinity" in raw else "not JSON", value=raw)


@pytest.mark.parametrize(
    ("raw", "type_name"),
    [
        (b"[1, 2]", "list"),
        (b"42", "int"),
        (b"4.2", "float"),
        (b'"s"', "str"),
        (b"null", "NoneType"),
    ],
)
def test_json_that_is_not_an_object(raw: bytes, type_name: str) -> None:
    rejects(f"must be a JSON object, got {type_name}", value=raw)


# --- contract faults ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", REQUIRED)
def test_each_missing_required_field(name: str) -> None:
    rejects(f"missing field(s): {name}", value=encode(doc(**{name: _DROP})))


def test_all_missing_fields_are_listed() -> None:
    rejects("missing field(s): payee, ts", value=encode(doc(payee=_DROP, ts=_DROP)))


def test_amount_as_number() -> None:
    rejects("field 'amount' must be a decimal string", value=encode(doc(amount=12.5)))


@pytest.mark.parametrize(
    ("name", "value", "type_name"),
    [
        ("payer", 42, "int"),
        ("payee", None, "NoneType"),
        ("payment_id", ["x"], "list"),
        ("currency", 978, "int"),
        ("ts", 1714564800, "int"),
        ("channel", 7, "int"),
        ("country", {"c": "DE"}, "dict"),
    ],
)
def test_wrong_types(name: str, value: Any, type_name: str) -> None:
    rejects(f"field {name!r} must be a string, got {type_name}", value=encode(doc(**{name: value})))


@pytest.mark.parametrize(
    "name", ["payment_id", "payer", "payee", "amount", "currency", "ts", "channel", "country"]
)
@pytest.mark.parametrize("blank", ["", "   "])
def test_empty_strings(name: str, blank: str) -> None:
    # amount has its own check; the others go through the text-field check
    reason = "field 'amount'" if name == "amount" else f"field {name!r} is empty"
    rejects(reason, value=encode(doc(**{name: blank})))


def test_id_length_limit() -> None:
    assert parse(doc(payment_id="x" * 128)).payment_id == "x" * 128
    rejects("longer than 128", value=encode(doc(payment_id="x" * 129)))


@pytest.mark.parametrize(
    ("amount", "reason"),
    [
        ("0", "greater than zero"),
        ("0.00", "greater than zero"),
        ("-0", "greater than zero"),
        ("-5", "greater than zero"),
        ("NaN", "plain decimal digits"),
        ("sNaN", "plain decimal digits"),
        ("Infinity", "plain decimal digits"),
        ("-Infinity", "plain decimal digits"),
        ("twelve", "plain decimal digits"),
        ("12,50", "plain decimal digits"),
        ("1.23456", "more than 4 decimal places"),
        ("1e15", "plain decimal digits"),
        ("1000000000000000", "implausibly large"),
        ("1_000", "plain decimal digits"),
        (" 5 ", "plain decimal digits"),
        ("\u0661\u0662", "plain decimal digits"),
        ("1e999999999999999999", "plain decimal digits"),
    ],
)
def test_bad_amounts(amount: str, reason: str) -> None:
    rejects(reason, value=encode(doc(amount=amount)))


def test_amount_just_below_the_limit_is_accepted() -> None:
    assert parse(doc(amount="999999999999999.9999")).amount == "999999999999999.9999"


def test_amount_decimal_places_boundary() -> None:
    assert parse(doc(amount="0.0001")).amount == "0.0001"
    rejects("more than 4 decimal places", value=encode(doc(amount="0.00001")))


@pytest.mark.parametrize("currency", ["EUX", "eur", "XXX", "E1R"])
def test_currency_not_iso_4217(currency: str) -> None:
    rejects("not an ISO 4217 code", value=encode(doc(currency=currency)))


def test_currency_longer_than_three_letters() -> None:
    rejects("field 'currency' is longer than 3", value=encode(doc(currency="EURO")))


@pytest.mark.parametrize("ts", ["yesterday", "01/05/2024 12:00", "2024-05-01", "2024-05-01 12:00:00Z"])
def test_ts_not_rfc3339(ts: str) -> None:
    rejects("not an RFC 3339 timestamp", value=encode(doc(ts=ts)))


@pytest.mark.parametrize("ts", ["2024-13-01T00:00:00Z", "2023-02-29T00:00:00Z", "2024-04-31T12:00:00Z"])
def test_ts_not_a_real_date(ts: str) -> None:
    rejects("not a real date", value=encode(doc(ts=ts)))


def test_ts_leap_day_accepted() -> None:
    assert parse_payment(KEY, encode(doc(ts="2024-02-29T23:59:59.999999Z")), MAX)


@pytest.mark.parametrize("ts", ["2024-05-01T12:00:00", "2024-05-01T12:00:00.5"])
def test_ts_without_timezone(ts: str) -> None:
    rejects("must be in UTC", value=encode(doc(ts=ts)))


@pytest.mark.parametrize("ts", ["2024-05-01T14:00:00+02:00", "2024-05-01T07:00:00-05:00"])
def test_ts_with_non_utc_offset(ts: str) -> None:
    rejects("must be in UTC", value=encode(doc(ts=ts)))


def test_key_different_from_payer() -> None:
    rejects("does not match payer", key=b"acct-9", value=encode(doc()))


# --- ts against the record's timestamp ------------------------------------------------------------

SENT_MS = 1_714_564_800_000  # 2024-05-01T12:00:00.000Z, the record's timestamp
SKEW_TS = [  # ts at the default clock skew (5 s) after SENT_MS, written every way the profile allows
    "2024-05-01T12:00:05Z",
    "2024-05-01T12:00:05.000000Z",
    "2024-05-01T12:00:05.0+00:00",
    "2024-05-01T12:00:04.999999Z",
]


@pytest.mark.parametrize(
    "ts", [*SKEW_TS, "2024-05-01T12:00:00Z", "1971-01-01T00:00:00Z", "0001-01-01T00:00:00Z"]
)
def test_ts_up_to_the_clock_skew_after_the_records_timestamp_is_accepted(ts: str) -> None:
    assert parse_payment(KEY, encode(doc(ts=ts)), MAX, SENT_MS).ts == ts


@pytest.mark.parametrize(
    "ts", ["2024-05-01T12:00:05.000001Z", "2024-05-01T12:00:06Z", "2099-01-01T00:00:00Z"]
)
def test_ts_past_the_clock_skew_is_rejected_naming_both_instants_and_the_bound(ts: str) -> None:
    with pytest.raises(InvalidPayment) as info:
        parse_payment(KEY, encode(doc(ts=ts)), MAX, SENT_MS)
    assert str(info.value) == (
        f"field 'ts' {ts} is more than the allowed clock skew of 5 s (AML_MAX_CLOCK_SKEW) after its Kafka "
        "record's timestamp 2024-05-01T12:00:00.000Z: a payment cannot happen after it was sent"
    )


def test_the_clock_skew_is_a_parameter_and_a_record_without_a_timestamp_is_not_bounded() -> None:
    late = encode(doc(ts="2024-05-01T12:00:00.250001Z"))
    assert parse_payment(KEY, encode(doc(ts="2024-05-01T12:00:00.25Z")), MAX, SENT_MS, 0.25)
    with pytest.raises(InvalidPayment, match=r"clock skew of 0\.25 s"):
        parse_payment(KEY, late, MAX, SENT_MS, 0.25)
    with pytest.raises(InvalidPayment, match=r"clock skew of 0 s .* 2024-05-01T12:00:00\.000Z"):
        parse_payment(KEY, encode(doc(ts="2024-05-01T12:00:00.000001Z")), MAX, SENT_MS, 0)
    far = encode(doc(ts="9999-12-31T23:59:59.999999Z"))
    for none in (None, -1, -2):  # Kafka's "no timestamp" is -1
        assert parse_payment(KEY, far, MAX, none).ts == "9999-12-31T23:59:59.999999Z"
    assert parse_payment(KEY, far, MAX, 2**62)  # a record timestamp past year 9999 bounds nothing
    # The other rules come first: a payment that breaks one is refused for it.
    rejects_ts = encode(doc(ts="2099-01-01T00:00:00Z", amount="-1"))
    with pytest.raises(InvalidPayment, match="greater than zero"):
        parse_payment(KEY, rejects_ts, MAX, SENT_MS)


# --- size boundary ------------------------------------------------------------------------------


def test_value_of_exactly_max_bytes_is_accepted() -> None:
    raw = encode(doc())
    limit = len(raw) + 50
    padded = raw + b" " * (limit - len(raw))  # trailing whitespace is valid JSON
    assert len(padded) == limit
    assert parse_payment(KEY, padded, limit).payment_id == "pay-1"
    with pytest.raises(InvalidPayment, match=f"over the limit of {limit}"):
        parse_payment(KEY, padded + b" ", limit)


# --- property -----------------------------------------------------------------------------------


_json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)
)


def _mutated_payload() -> st.SearchStrategy[bytes]:
    """Payment-shaped objects whose fields hold arbitrary JSON scalars or text."""
    fields = st.dictionaries(st.sampled_from([*REQUIRED, "channel", "country"]), _json_scalars, max_size=8)
    return st.builds(lambda d: json.dumps({**doc(), **d}).encode(), fields)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.one_of(st.none(), st.just(KEY), st.binary(max_size=16)),
    value=st.one_of(st.none(), st.binary(max_size=512), _mutated_payload()),
)
def test_arbitrary_bytes_only_ever_raise_invalid_payment(key: bytes | None, value: bytes) -> None:
    try:
        result = parse_payment(key, value, 1024)
    except InvalidPayment as exc:
        assert str(exc)  # every rejection carries a reason
    else:
        assert isinstance(result, Payment)
        assert key is not None and key.decode() == result.payer


# --- hostile JSON that once escaped as RecursionError / ValueError -------------------------------


def test_deeply_nested_json_is_rejected_as_invalid() -> None:
    value = b"[" * 5000 + b"]" * 5000
    assert len(value) <= MAX
    with pytest.raises(InvalidPayment):
        parse_payment(KEY, value, MAX)


def test_huge_json_integer_is_rejected_as_invalid() -> None:
    value = b"1" * 5000
    with pytest.raises(InvalidPayment):
        parse_payment(KEY, value, MAX)


def test_the_probes_decision_bytes_are_the_decision_records_json() -> None:
    import json

    from aml_app.models import Decision, decision_json

    fields = {
        "payment_id": "p-1",
        "partition": 2,
        "offset": 7,
        "service": "probe",
        "verdict": "clear",
        "rules": [],
        "typologies": [],
        "note": "n",
        "watermark": 9,
        "dependencies": {"relations": 9, "aggregates": 12},
        "waited_ms": 1.5,
        "decided_at": "2026-11-20T10:15:00.000001+00:00",
        "worker": "w1",
        "gated": True,
    }
    assert json.loads(decision_json(**fields)) == json.loads(Decision(**fields).dumps())
