"""The payment contract in Spark SQL (`aml_app.pipeline.validation`) against the Python contract, record by
record: a crafted corpus of hostile and boundary records (with their Kafka timestamps, against which `ts` is
bounded) plus hypothesis mutations of valid payments, all through one DataFrame. For every record Spark's
`valid` must be the Python verdict, and the typed fields of a valid record the fields Python returns. The
last tests weaken the SQL on purpose and require the comparison to notice, so a corpus that stopped
exercising a rule would fail here rather than pass quietly."""

from __future__ import annotations

import json
import random
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from aml_app.contract import (
    DEFAULT_MAX_CLOCK_SKEW,
    MAX_ID_LENGTH,
    MAX_JSON_DEPTH,
    MAX_NAME_LENGTH,
    MAX_NUMBER_LENGTH,
    MAX_OPTIONAL_LENGTH,
    InvalidPayment,
    skew_micros,
    validate_payment,
)
from aml_app.pipeline import expressions, validation
from aml_app.pipeline.kafka_source import LATEST_TIMESTAMP_MS

MAX = 65536  # the default AML_MAX_PAYMENT_BYTES
KEY = b"acct-1"
BASE: dict[str, Any] = {
    "payment_id": "pay-1",
    "payer": "acct-1",
    "payee": "acct-2",
    "amount": "12.50",
    "currency": "EUR",
    "ts": "2024-05-01T12:00:00Z",
}
_DROP = object()
SPACES = [chr(c) for c in range(0x110000) if chr(c).isspace()]
# Characters that look blank but are not whitespace to Python (so not to the contract either).
NOT_SPACES = ["\u200b", "\ufeff", "\u180e", "\u00ad", "\u2060", "\x00", "\x7f", "\u3164"]

Record = tuple[bytes | None, bytes | None]
#: A record with its Kafka timestamp: milliseconds since the epoch, None when it has none (the contract
#: also reads a negative one, Kafka's -1, as none).
Stamped = tuple[bytes | None, bytes | None, int | None]
#: The records' timestamp in the clock-skew faults: 2024-05-01T12:00:00.000Z, BASE's `ts`.
SENT_MS = 1_714_564_800_000
SKEW_US = skew_micros(DEFAULT_MAX_CLOCK_SKEW)


def doc(**overrides: Any) -> dict[str, Any]:
    merged = {**BASE, **overrides}
    return {k: v for k, v in merged.items() if v is not _DROP}


def enc(document: Any, **dumps: Any) -> bytes:
    return json.dumps(document, **dumps).encode()


def with_field(raw_value: str, name: str = "x", base: bytes | None = None) -> bytes:
    """A valid payment with `"name": <raw JSON text>` inserted first (raw: no escaping is done here)."""
    body = (base or enc(doc()))[1:]
    return b'{"' + name.encode() + b'": ' + raw_value.encode() + b", " + body


# --- the crafted corpus -------------------------------------------------------------------------------------


def raw_record_faults() -> Iterator[Record]:
    valid = enc(doc())
    yield KEY, valid
    yield None, valid
    yield KEY, None
    yield None, None
    yield KEY, b""
    yield b"", enc(doc(payer=""))
    padded = valid + b" " * (MAX - len(valid))
    yield KEY, padded  # exactly max_bytes
    yield KEY, padded + b" "  # one byte over
    yield KEY, valid + b" \t\r\n"  # trailing JSON whitespace is fine
    yield KEY, b" \t\r\n" + valid


def utf8_faults() -> Iterator[Record]:
    valid = enc(doc())
    bad = [
        b"\xff",
        b"\xfe\xff",
        b"\x80",  # lone continuation byte
        b"\xc3",  # truncated 2-byte sequence
        b"\xe2\x82",  # truncated 3-byte sequence
        b"\xc0\x80",  # overlong NUL
        b"\xc1\xbf",  # overlong
        b"\xe0\x80\xaf",  # overlong '/'
        b"\xf0\x80\x80\xaf",  # overlong '/'
        b"\xed\xa0\x80",  # encoded high surrogate (CESU-8)
        b"\xed\xbf\xbf",  # encoded low surrogate
        b"\xed\xa0\xbd\xed\xb8\x80",  # an encoded surrogate pair (CESU-8 emoji)
        b"\xf4\x90\x80\x80",  # above U+10FFFF
        b"\xf8\x88\x80\x80\x80",  # 5-byte form
        b"\xfc\x84\x80\x80\x80\x80",  # 6-byte form
    ]
    for chunk in bad:
        yield KEY, enc(doc(payee="acct-")).replace(b'"acct-"', b'"acct-' + chunk + b'"')
        yield KEY, valid + chunk
        yield chunk + b"1", enc(doc(payer="1"))
    # Well-formed but unusual: noncharacters, the last code point, a BOM inside a string (all valid).
    for text in ("\ufffe", "\uffff", "\U0010ffff", "\ufeff", "\U0001f600", "\x00"):
        yield KEY, enc(doc(payee="p" + text), ensure_ascii=False)
        yield KEY, enc(doc(payee="p" + text))
    # A BOM before the JSON, other encodings of a valid payment.
    yield KEY, b"\xef\xbb\xbf" + valid
    yield b"\xef\xbb\xbfacct-1", valid
    for encoding in ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be", "utf-8-sig"):
        yield KEY, valid.decode().encode(encoding)


TRAILING = [
    ",0",
    ", 0",
    ",1",
    ',"x"',
    ",{}",
    ",null",
    " x",
    "x",
    "}",
    "]",
    "}}",
    "]]",
    ",",
    ",0]",
    ",1]",
    ",0] junk",
    ",1] junk",
    ", 0 ]",
    ",0,1]",
    ",0]]",
    "] ,0]",
    "],[0]",
    ',"x"]',
    ",[0]]",
    ",{}]",
    ',{"a":0}]',
    ' {"a":1}',
    "{}",
    "[]",
    '"x"',
    "0",
    "\x00",
    "\x0b",
    "\x0c",
    "\u00a0",
    "\u2028",
    "\ufeff",
    "//",
    "// comment",
    "/* */",
    "#",
    "NaN",
    "]}",
    "}]",
    ",]",
    ",}",
    "\n{}",
    ",0]\n",
    " ,0 ] ,1]",
    ',"\\u0000"]',
]


def json_faults() -> Iterator[Record]:
    valid = enc(doc())
    text = valid.decode()
    for junk in TRAILING:
        yield KEY, (text + junk).encode()
        yield KEY, (text + " " + junk).encode()
        yield KEY, (junk + text).encode()
    yield KEY, (text + text).encode()
    yield KEY, (text + "," + text).encode()
    yield KEY, ("[" + text + "]").encode()
    yield KEY, ("[" + text + ",0]").encode()
    for ws in ("\x0b", "\x0c", "\u00a0", "\u2028", "\u3000", "\x1c", "\x85"):
        yield KEY, (ws + text).encode()
        yield KEY, text.replace(", ", "," + ws).encode()
    # Top-level values that are not objects.
    for raw in ("[]", "{}", "0", "-1.5", '"s"', "true", "false", "null", "[" + text + "]", '"' + text + '"'):
        yield KEY, raw.encode()
    # Duplicate keys, at every level and in every disguise.
    body = text[1:-1]
    yield KEY, ("{" + body + ', "payer": "acct-1"}').encode()  # same key, same value
    yield KEY, ("{" + body + ', "payer": "acct-2"}').encode()
    yield KEY, ("{" + body + ', "pay\\u0065r": "acct-1"}').encode()  # equal once unescaped
    yield KEY, ("{" + body + ', "x": 1, "x": 1}').encode()
    yield KEY, with_field('{"a": 1, "a": 1}')
    yield KEY, with_field('[{"a": 1}, {"b": 1, "b": 2}]')
    yield KEY, with_field('{"a": {"b": {"c": [{"d": 1, "d": 1}]}}}')
    yield KEY, with_field('{"a": 1, "\\u0061": 2}')
    yield KEY, with_field('{"a": 1, "A": 2}')  # not duplicates
    yield KEY, with_field('[{"a": 1}, {"a": 2}]')  # not duplicates either
    yield KEY, with_field('{"": 1, "": 2}')
    yield KEY, with_field('{"\\u00e9": 1, "\\u0065\\u0301": 2}')  # NFC vs NFD: different keys
    # Non-standard literals and malformed numbers.
    for raw in (
        "NaN",
        "-NaN",
        "Infinity",
        "-Infinity",
        "+Infinity",
        "nan",
        "inf",
        "[NaN]",
        '{"a": Infinity}',
        "01",
        "-01",
        "00",
        "1.",
        ".5",
        "+1",
        "1e",
        "1e+",
        "-",
        "0x10",
        "1_000",
        "1 2",
        "TRUE",
        "nul",
        "undefined",
        "'x'",
        '"\\x41"',
        '"\\U0041"',
        '"\\u12"',
        '"\\u12G4"',
        '"\\a"',
        '"\t"',
        '"\n"',
        '"\x00"',
        '"\x1f"',
        '"\x7f"',
        '"\\t\\n\\u0000\\/\\""',
        "[1,]",
        '{"a":1,}',
        "[1,,2]",
        "{a: 1}",
        '{"a" 1}',
        "[",
        "{",
        '"unterminated',
    ):
        yield KEY, with_field(raw)
    # Lone surrogates (invalid) and real pairs (valid), in values and keys, in extra and required fields.
    for escape, _ in (
        ("\\ud800", False),
        ("\\udc00", False),
        ("\\uDBFF", False),
        ("\\udc00\\ud800", False),
        ("\\ud800\\ud800\\udc00", False),
        ("\\ud800\\u0041", False),
        ("\\ud800x", False),
        ("\\ud83d\\ude00", True),
        ("\\uD83D\\uDE00", True),
        ("\\ud7ff\\ue000", True),
        ("\\\\ud800", True),  # an escaped backslash, then the letters "ud800"
        ("\\u00e9\\u4e2d", True),
    ):
        yield KEY, with_field('"' + escape + '"')
        yield KEY, with_field("1", name=escape)
        yield KEY, with_field('{"' + escape + '": ["' + escape + '"]}')
        yield KEY, enc(doc()).replace(b'"acct-2"', b'"acct-' + escape.encode() + b'"')
        payer = "acct-" + escape
        yield KEY, enc(doc()).replace(b'"acct-1"', b'"' + payer.encode() + b'"')
        yield (
            json.loads('"' + payer + '"').encode("utf-8", "surrogatepass"),
            enc(doc()).replace(b'"acct-1"', b'"' + payer.encode() + b'"'),
        )


def size_bound_faults() -> Iterator[Record]:
    """Numbers, depth and key lengths around the contract's bounds and around Python's and Jackson's."""
    for length in (MAX_NUMBER_LENGTH - 1, MAX_NUMBER_LENGTH, MAX_NUMBER_LENGTH + 1):
        yield KEY, with_field("1" * length)
        yield KEY, with_field("-" + "1" * (length - 1))
        yield KEY, with_field("0." + "1" * (length - 2))
        yield KEY, with_field("-1." + "0" * (length - 6) + "e+10")
        yield KEY, with_field("[1, [" + "2" * length + "]]")
        yield KEY, with_field('{"a": ' + "3" * length + "}")
        yield KEY, with_field('"' + "4" * length + '"')  # digits in a string are not a number
        yield KEY, with_field('"' + "-1e5" * length + '"')
    for raw in (
        "1e400",
        "-1e400",
        "1E400",
        "1e-400",
        "1e999999",
        "1e99999999999999999999",
        "-1e-99999999999999999999",
        "1e0000000000000000000001",
        "0e5",
        "-0.0e-0",
        "1.7976931348623157e308",
        "4.9e-324",
        "123456789012345678901234567890123456789",
        "0.12345678901234567890123456789012345678901",
    ):
        yield KEY, with_field(raw)
    for digits in (999, 1000, 1001, 4300, 4301, 5000):
        yield KEY, with_field("1" * digits)
        yield KEY, with_field("0." + "1" * digits)
    yield KEY, with_field('"' + "9" * 20000 + '"')
    # Depth: the top-level object is level 1, so a value nested n deep in a field is level n + 1.
    for levels in (MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1):
        yield KEY, with_field("[" * levels + "]" * levels)
        yield KEY, with_field('{"a":' * levels + "1" + "}" * levels)
        yield KEY, with_field("[{" * (levels // 2) + '"a":1' + "}]" * (levels // 2))
        yield KEY, with_field("[ " * levels + "1" + " ]" * levels)
        yield KEY, with_field('"' + "[" * levels + "{" * levels + '"')  # brackets in a string are text
        yield KEY, with_field("[" + "[]," * levels * 2 + "[]]")  # many brackets, little depth
    for levels in (998, 999, 1000, 1001, 5000, 30000):
        yield KEY, with_field("[" * levels + "]" * levels)
        yield KEY, ("[" * levels + "]" * levels).encode()
    # Key lengths (code points after unescaping).
    for length in (MAX_NAME_LENGTH - 1, MAX_NAME_LENGTH, MAX_NAME_LENGTH + 1):
        yield KEY, with_field("1", name="k" * length)
        yield KEY, with_field("1", name="\\u0041" * length)  # long text, same length once decoded
        yield KEY, with_field("1", name="\U0001f600" * length)  # one code point, two UTF-16 units each
        yield KEY, with_field("1", name="\\ud83d\\ude00" * length)
        yield KEY, with_field("1", name="\\\\" * length)
        yield KEY, with_field('{"' + "k" * length + '": 1}')
        yield KEY, with_field('[{"' + "k" * length + '" : 1}]')
        yield KEY, with_field('["' + "k" * length + '", ":"]')  # a long string followed by a colon in text
        yield KEY, with_field('"' + "v" * length + '"')  # long values are fine
        yield KEY, with_field('"' + 'v\\"' * length + '"')
    yield KEY, with_field('"' + '\\": ' * 400 + '"')
    yield KEY, with_field('["' + "a" * 1200 + '", "::"]')
    yield KEY, with_field('"' + "a" * 1200 + '"')
    yield KEY, with_field('{"' + '\\"' * 600 + '": 1}')
    for length in (25000, 50000, 50001):
        yield KEY, with_field("1", name="k" * length)
    yield KEY, with_field('"' + "s" * 60000 + '"')


def field_faults() -> Iterator[Record]:
    yield KEY, enc(doc(channel="web", country="DE"))
    yield KEY, enc(doc(channel=None, country=None))
    yield KEY, enc(doc(note="hello", n=1, f=1.5, b=True, z=None, a=[1, "x"], o={"k": "v"}))
    yield KEY, enc(doc(), ensure_ascii=False)
    yield KEY, enc(doc(), separators=(",", ":"))
    yield KEY, enc(doc(), indent=2)
    yield KEY, enc(dict(reversed(list(doc().items()))))
    yield KEY, enc({"wrapper": doc()})
    yield KEY, enc(doc()).replace(b'"payer"', b'"\\u0070ayer"')
    yield KEY, enc(doc()).replace(b'"acct-1"', b'"acct\\u002d1"')
    yield KEY, enc(doc(Payer="x"))
    yield KEY, enc({**doc(payer=_DROP), "Payer": "acct-1"})  # keys are case-sensitive
    yield KEY, enc({**doc(payer=_DROP), "PAYER": "acct-1", "payer ": "acct-1"})
    for name in ("payment_id", "payer", "payee", "amount", "currency", "ts", "channel", "country"):
        yield KEY, enc(doc(**{name: _DROP}))
        for value in (None, 1, 1.5, 0, True, False, [], ["x"], {}, {"a": "b"}, "", " "):
            yield KEY, enc(doc(**{name: value}))
        for space in SPACES:
            yield KEY, enc(doc(**{name: space}))
            yield KEY, enc(doc(**{name: space * 3}), ensure_ascii=False)
        for other in NOT_SPACES:
            yield KEY, enc(doc(**{name: other}))
            yield KEY, enc(doc(**{name: " " + other + " "}), ensure_ascii=False)
    # Lengths in code points.
    for name, limit in (("payment_id", MAX_ID_LENGTH), ("payee", MAX_ID_LENGTH), ("payer", MAX_ID_LENGTH)):
        for text in ("x" * limit, "x" * (limit + 1), "\U0001f600" * limit, "\U0001f600" * (limit + 1)):
            for ascii_only in (True, False):
                value = enc(doc(**{name: text}), ensure_ascii=ascii_only)
                yield (text.encode() if name == "payer" else KEY), value
        yield KEY, enc(doc(**{name: "e\u0301" * (limit // 2)}))  # combining marks count
        yield KEY, enc(doc(**{name: "e\u0301" * (limit // 2 + 1)}))
    for name in ("channel", "country"):
        for text in (
            "x" * MAX_OPTIONAL_LENGTH,
            "x" * (MAX_OPTIONAL_LENGTH + 1),
            "\u00e9" * MAX_OPTIONAL_LENGTH,
        ):
            yield KEY, enc(doc(**{name: text}))
    # A NUL anywhere in a text field (PostgreSQL's text cannot hold one).
    for name in ("payment_id", "payee", "channel", "country"):
        for text in ("a\x00", "\x00a", "a\x00b"):
            yield KEY, enc(doc(**{name: text}))
            yield KEY, enc(doc(**{name: text}), ensure_ascii=False)
    # Key against payer.
    for key, payer in (
        (b"acct-1", "acct-1 "),
        (b"acct-1 ", "acct-1"),
        (b"ACCT-1", "acct-1"),
        ("caf\u00e9".encode(), "caf\u00e9"),
        ("caf\u00e9".encode(), "cafe\u0301"),
        ("cafe\u0301".encode(), "cafe\u0301"),
        (b"a\x00b", "a\x00b"),
        (b"a", "a\x00"),
        (b"", ""),
        (b" ", " "),
        ("\U0001f600".encode(), "\U0001f600"),
    ):
        yield key, enc(doc(payer=payer))
        yield key, enc(doc(payer=payer), ensure_ascii=False)
    # A payer that is no string although its text is the key: only its JSON type refuses it.
    for key, payer in ((b"5", 5), (b"1.5", 1.5), (b"true", True)):
        yield key, enc(doc(payer=payer))
    # Currency.
    for currency in (
        "EUR",
        "USD",
        "JPY",
        "eur",
        "Eur",
        "EU",
        "EURO",
        " EUR",
        "EUR ",
        "XXX",
        "XTS",
        "E1R",
        "€",
    ):
        yield KEY, enc(doc(currency=currency))


AMOUNTS = [
    "12.50",
    "1",
    "0.0001",
    "0.00001",
    "1.50000",
    "1.5000",
    "0",
    "0.0000",
    "-0",
    "-0.0001",
    "-5",
    "00",
    "007",
    "000000000000000000000000000000000000000000000000001.5",
    "0" * 5000 + "1",
    "999999999999999.9999",
    "999999999999999.99999",
    "0999999999999999.9999",
    "1000000000000000",
    "1000000000000000.0000",
    "999999999999999",
    "1" * 15,
    "1" * 16,
    "9" * 40,
    "1.",
    ".5",
    "+5",
    "5e2",
    "1e15",
    "1E3",
    " 5",
    "5 ",
    "5\n",
    "\n5",
    "5\u00a0",
    "\u0665",
    "\uff15",
    "1,000",
    "1_000",
    "0x10",
    "NaN",
    "sNaN",
    "Infinity",
    "-Infinity",
    "twelve",
    "",
    "-",
    ".",
    "1..2",
    "1.2.3",
    "--1",
    "1-",
]
TIMESTAMPS = [
    "2024-05-01T12:00:00Z",
    "2024-05-01T12:00:00+00:00",
    "2024-05-01T12:00:00.5Z",
    "2024-05-01T12:00:00.123456Z",
    "2024-05-01T12:00:00.1234567Z",
    "2024-05-01T12:00:00.Z",
    "2024-05-01T12:00:00.000000+00:00",
    "2024-02-29T23:59:59.999999Z",
    "2023-02-29T00:00:00Z",
    "1900-02-29T00:00:00Z",
    "2000-02-29T00:00:00Z",
    "2100-02-29T00:00:00Z",
    "2024-04-31T00:00:00Z",
    "2024-06-30T00:00:00Z",
    "2024-06-31T00:00:00Z",
    "2024-12-31T23:59:59Z",
    "2024-12-32T00:00:00Z",
    "2024-00-10T00:00:00Z",
    "2024-13-01T00:00:00Z",
    "2024-01-00T00:00:00Z",
    "0000-01-01T00:00:00Z",
    "0001-01-01T00:00:00Z",
    "1582-10-10T00:00:00Z",
    "1969-12-31T23:59:59.999999Z",
    "9999-12-31T23:59:59.999999Z",
    "2024-05-01T24:00:00Z",
    "2024-05-01T23:60:00Z",
    "2024-05-01T23:59:60Z",
    "2016-12-31T23:59:60Z",
    "2024-05-01t12:00:00Z",
    "2024-05-01T12:00:00z",
    "2024-05-01 12:00:00Z",
    "2024-05-01_12:00:00Z",
    "2024-05-01T12:00:00-00:00",
    "2024-05-01T12:00:00+01:00",
    "2024-05-01T14:00:00+02:00",
    "2024-05-01T12:00:00+0000",
    "2024-05-01T12:00:00+00",
    "2024-05-01T12:00:00",
    "2024-05-01",
    "2024-05-01T12:00Z",
    "2024-05-01T12Z",
    "2024-05-01T12:00:00,5Z",
    "2024-W18-3T12:00:00Z",
    "2024-122T12:00:00Z",
    "20240501T120000Z",
    "10000-01-01T00:00:00Z",
    "+002024-05-01T12:00:00Z",
    "2024-5-1T12:00:00Z",
    "\uff12\uff10\uff12\uff14-05-01T12:00:00Z",
    "2024-05-01T12:00:00Z\n",
    " 2024-05-01T12:00:00Z",
    "2024-05-01T12:00:00ZZ",
    "2024-05-01T12:00:00Z+00:00",
    "2024-05-01T12:00:00.5+00:00Z",
    "2024-05-01T12:00:00.-5Z",
]


def value_faults() -> Iterator[Record]:
    for amount in AMOUNTS:
        yield KEY, enc(doc(amount=amount))
    for ts in TIMESTAMPS:
        yield KEY, enc(doc(ts=ts))


def instant(us: int, digits: int = 6, zone: str = "Z") -> str:
    """The `ts` text of `us` microseconds since the epoch, with `digits` fraction digits (0: none)."""
    text = (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=us)).strftime("%Y-%m-%dT%H:%M:%S.%f")
    return (text[: len(text) - 6 + digits] if digits else text[:-7]) + zone


def clock_skew_faults() -> Iterator[Stamped]:
    """`ts` against its record's timestamp around the allowed skew, in every spelling of the profile; far
    future and far past payments with every kind of record timestamp (none, Kafka's -1, the epoch, past
    year 9999); payments that break another rule too."""
    for sent in (SENT_MS, SENT_MS + 123):
        for delta in (-1, 0, 1, 999, 1000, SKEW_US - 1, SKEW_US, SKEW_US + 1, SKEW_US + 999, SKEW_US + 1000):
            us = sent * 1000 + delta
            for digits, zone in ((6, "Z"), (6, "+00:00"), (3, "Z"), (0, "Z")):
                if digits == 6 or us % 10 ** (6 - digits) == 0:
                    yield KEY, enc(doc(ts=instant(us, digits, zone))), sent
        yield KEY, enc(doc(ts=instant(sent * 1000 + SKEW_US + 1))), None  # no timestamp: not bounded
    for ts in (
        "2099-01-01T00:00:00Z",
        "9999-12-31T23:59:59.999999Z",
        "1971-01-01T00:00:00Z",
        "1970-01-01T00:00:00Z",
        "1969-12-31T23:59:59.999999Z",
        "0001-01-01T00:00:00Z",
    ):
        for sent in (None, -1, -2, -(2**62), 0, 1, SENT_MS, LATEST_TIMESTAMP_MS, LATEST_TIMESTAMP_MS + 1):
            yield KEY, enc(doc(ts=ts)), sent
        yield KEY, enc(doc(ts=ts)), 2**62
    for broken in (doc(amount="-1"), doc(payee=_DROP), doc(currency="XXQ")):
        yield KEY, enc({**broken, "ts": "2099-01-01T00:00:00Z"}), SENT_MS
    for ts in TIMESTAMPS:
        yield KEY, enc(doc(ts=ts)), SENT_MS


def simulated() -> Iterator[Record]:
    from aml_app.simulation.traffic import simulate

    run = simulate(seed=11, count=300, rate=50, start=datetime(2026, 3, 1, 9, tzinfo=UTC), instances=1)
    yield from run.records()


def corpus() -> list[Stamped]:
    unstamped = [
        *raw_record_faults(),
        *utf8_faults(),
        *json_faults(),
        *size_bound_faults(),
        *field_faults(),
        *value_faults(),
        *simulated(),
    ]
    return [*((key, value, None) for key, value in unstamped), *clock_skew_faults()]


# --- hypothesis: mutations of valid payments ----------------------------------------------------------------

text_chars = st.one_of(
    st.characters(codec="utf-8"),
    st.sampled_from([*SPACES, *NOT_SPACES, "\ud800", "\udfff", '"', "\\", "]", "[", "{", "}", ",", ":"]),
)
texts = st.text(text_chars, max_size=12)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**120), max_value=10**120),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=8,
)
digits = st.text("0123456789", min_size=0, max_size=3)
timestamps = st.builds(
    lambda y, mo, d, sep, h, mi, s, frac, zone: f"{y}-{mo}-{d}{sep}{h}:{mi}:{s}{frac}{zone}",
    st.one_of(st.sampled_from(["0000", "0001", "1900", "2000", "2023", "2024", "9999"]), digits),
    st.one_of(st.sampled_from(["00", "01", "02", "04", "12", "13"]), digits),
    st.one_of(st.sampled_from(["00", "01", "28", "29", "30", "31", "32"]), digits),
    st.sampled_from(["T", "T", "T", "t", " "]),
    st.one_of(st.sampled_from(["00", "23", "24"]), digits),
    st.one_of(st.sampled_from(["00", "59", "60"]), digits),
    st.one_of(st.sampled_from(["00", "59", "60"]), digits),
    st.one_of(st.just(""), st.text("0123456789", max_size=8).map(lambda f: "." + f)),
    st.sampled_from(["Z", "Z", "+00:00", "z", "-00:00", "+01:00", "", "+0000", "Z\n"]),
)
amounts = st.one_of(
    st.from_regex(r"\A-?[0-9]{1,17}(\.[0-9]{0,6})?\Z"),
    st.decimals(min_value=Decimal("-1"), max_value=Decimal("1e16"), places=5, allow_nan=False).map(str),
    st.text("0123456789.-+eE ", max_size=8),
)
field_values = {
    "amount": st.one_of(amounts, amounts, json_values),
    "ts": st.one_of(timestamps, timestamps, json_values),
    "currency": st.one_of(st.sampled_from(["EUR", "USD", "JPY", "eur", "EU", "XXX", "EURO"]), json_values),
}
names = st.sampled_from([*BASE, "channel", "country", "x", "Payer", "pay\\u0065r"])
TOKENS = [
    b"]",
    b",0]",
    b",1]",
    b"}",
    b"{",
    b"[",
    b",",
    b'"',
    b"\\",
    b"\\u",
    b"\\ud800",
    b"NaN",
    b"\x00",
    b"\xff",
    b"\xc0\x80",
    b"\xed\xa0\x80",
    b" ",
    b"\t",
    b"\x0b",
    b"\xc2\xa0",
    b"1e400",
    b"-",
]


@st.composite
def mutated_payment(draw: st.DrawFn) -> Record:
    document: dict[str, Any] = dict(BASE)
    if draw(st.booleans()):
        document["channel"] = draw(st.one_of(st.just("web"), json_values))
    for _ in range(draw(st.integers(0, 3))):
        name = draw(names)
        action = draw(st.sampled_from(["set", "set", "drop", "blank", "long"]))
        if action == "drop":
            document.pop(name, None)
        elif action == "blank":
            document[name] = draw(st.text(st.sampled_from(SPACES + NOT_SPACES), max_size=3))
        elif action == "long":
            document[name] = "y" * draw(st.sampled_from([63, 64, 65, 127, 128, 129]))
        else:
            document[name] = draw(field_values.get(name, st.one_of(texts, texts, json_values)))
    text = json.dumps(
        document,
        ensure_ascii=draw(st.booleans()),
        separators=draw(st.sampled_from([(", ", ": "), (",", ":")])),
    )
    payer = document.get("payer")
    duplicate = draw(st.sampled_from([None] * 6 + ["payer", "x"]))
    if duplicate is not None:
        text = text[:-1] + f', "{duplicate}": ' + json.dumps(document.get(duplicate, 1)) + "}"
    value = text.encode("utf-8", "surrogatepass")
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        at = draw(st.integers(0, len(value)))
        edit = draw(st.sampled_from(["insert", "delete", "replace", "append", "truncate"]))
        token = draw(st.one_of(st.sampled_from(TOKENS), st.binary(min_size=1, max_size=3)))
        if edit == "insert":
            value = value[:at] + token + value[at:]
        elif edit == "delete":
            value = value[:at] + value[at + draw(st.integers(1, 4)) :]
        elif edit == "replace":
            value = value[:at] + token + value[at + len(token) :]
        elif edit == "append":
            value = value + token
        else:
            value = value[:at]
    key_choice = draw(st.sampled_from(["payer"] * 8 + ["other", "none"]))
    if key_choice == "none":
        key = None
    elif key_choice == "other" or not isinstance(payer, str):
        key = draw(st.one_of(st.just(KEY), st.binary(max_size=8)))
    else:
        key = payer.encode("utf-8", "surrogatepass")
    return key, value


def generated(count: int, seed_value: int = 20261123) -> list[Stamped]:
    """`count` hypothesis examples, collected so that all of them go through one DataFrame (a fixed seed:
    the same records on every run); every third has a record timestamp (BASE's `ts`)."""
    found: list[Record] = []

    @seed(seed_value)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(mutated_payment())
    def collect(record: Record) -> None:
        found.append(record)

    collect()
    return [(key, value, SENT_MS if n % 3 == 0 else None) for n, (key, value) in enumerate(found)]


# --- one DataFrame, two verdicts ----------------------------------------------------------------------------


@dataclass
class Verdict:
    """What the Python contract says of one record: the fields, or the reason."""

    fields: dict[str, str] | None
    reason: str | None


def python_verdict(record: Stamped, skew: float = DEFAULT_MAX_CLOCK_SKEW) -> Verdict:
    key, value, sent = record
    try:
        return Verdict(validate_payment(key, value, MAX, sent, skew), None)
    except InvalidPayment as exc:
        return Verdict(None, str(exc))


@pytest.fixture(scope="module")
def records() -> list[Stamped]:
    return corpus() + generated(2500)


def kafka_frame(spark: Any, records: list[Stamped]) -> Any:
    """The records as the Kafka source hands them to Spark: a timestamp past year 9999 (past Spark's
    range, further on) reads as none (`LATEST_TIMESTAMP_MS`); a negative one goes through, as another
    source's -1 would, unless Spark cannot hold it either."""
    from pyspark.sql import functions as F

    rows = [
        (
            offset % 3,
            offset,
            None if sent is None or abs(sent) > LATEST_TIMESTAMP_MS else sent * 1000,
            key,
            value,
        )
        for offset, (key, value, sent) in enumerate(records)
    ]
    schema = "partition INT, offset BIGINT, sent BIGINT, key BINARY, value BINARY"
    return spark.createDataFrame(rows, schema).withColumn("timestamp", F.timestamp_micros("sent"))


@pytest.fixture(scope="module")
def frame(spark: Any, records: list[Stamped]) -> Any:
    return kafka_frame(spark, records).repartition(2).cache()


def spark_rows(frame: Any, skew: float = DEFAULT_MAX_CLOCK_SKEW) -> dict[int, Any]:
    from pyspark.sql import functions as F

    # Instants compared as microseconds: PySpark would turn year 1 into a local datetime and fail.
    out = validation.validated(frame, MAX, skew).withColumn("ts_micros", F.unix_micros("ts"))
    out = out.drop("ts", "timestamp")
    return {row.offset: row for row in out.collect()}


def disagreements(
    records: list[Stamped], rows: dict[int, Any], skew: float = DEFAULT_MAX_CLOCK_SKEW
) -> list[str]:
    """Every record where Spark and Python differ, described (empty when they agree on all)."""
    found = []
    for offset, record in enumerate(records):
        verdict, row = python_verdict(record, skew), rows[offset]
        what = f"#{offset} key={record[0]!r:.60} value={record[1]!r:.200} timestamp={record[2]}"
        if row.valid != (verdict.fields is not None):
            found.append(f"{what}: spark valid={row.valid}, python: {verdict.reason or 'valid'}")
            continue
        if verdict.fields is None:
            continue
        expected = verdict.fields
        actual = {name: getattr(row, name) for name in ("payment_id", "payer", "payee", "currency")}
        if actual != {name: expected[name] for name in actual}:
            found.append(f"{what}: fields {actual} != {expected}")
        if row.amount != Decimal(expected["amount"]):
            found.append(f"{what}: amount {row.amount} != {expected['amount']}")
        instant = datetime.fromisoformat(expected["ts"])
        micros = (instant - datetime(1970, 1, 1, tzinfo=UTC)) // datetime.resolution
        if row.ts_micros != micros:
            found.append(f"{what}: ts {row.ts_micros} != {micros} ({expected['ts']})")
        if (row.key, row.value) != record[:2]:
            found.append(f"{what}: key/value not carried through")
    return found


def test_spark_and_python_agree_on_every_record(frame: Any, records: list[Stamped]) -> None:
    rows = spark_rows(frame)
    assert len(rows) == len(records)
    problems = disagreements(records, rows)
    assert not problems, f"{len(problems)} disagreement(s):\n" + "\n".join(problems[:40])


@pytest.mark.parametrize("skew", [0.0, 0.25, 1e12])
def test_the_bound_is_the_clock_skew_given(spark: Any, skew: float) -> None:
    """Both implementations take the skew they are given, to the microsecond (1e12 s: the bound off)."""
    deltas = (0, 1, 249_999, 250_000, 250_001, SKEW_US + 1, 10**15)
    records: list[Stamped] = [(KEY, enc(doc(ts=instant(SENT_MS * 1000 + d))), SENT_MS) for d in deltas]
    verdicts = [python_verdict(record, skew).fields is not None for record in records]
    assert verdicts == [d <= skew_micros(skew) for d in deltas]
    assert not disagreements(records, spark_rows(kafka_frame(spark, records), skew), skew)


def test_the_corpus_reaches_both_verdicts_for_every_kind_of_fault(records: list[Stamped]) -> None:
    """A comparison only means something if both sides are exercised: many records of each verdict, and a
    rejection for each of the contract's reasons."""
    verdicts = [python_verdict(r) for r in records]
    valid = sum(v.fields is not None for v in verdicts)
    assert valid > 400 and len(records) - valid > 1500, (valid, len(records))
    reasons = " | ".join(v.reason for v in verdicts if v.reason)
    for fragment in (
        "over the limit",
        "key is missing",
        "not UTF-8",
        "Extra data",
        "twice in one JSON object",
        "not a JSON number",
        "unpaired UTF-16 surrogate",
        "number longer than",
        "levels deep",
        "key longer than",
        "must be a JSON object",
        "missing field",
        "must be a string",
        "is empty",
        "holds a NUL character",
        "longer than 128",
        "longer than 64",
        "does not match payer",
        "ISO 4217",
        "plain decimal digits",
        "greater than zero",
        "implausibly large",
        "more than 4 decimal places",
        "not an RFC 3339 timestamp",
        "must be in UTC",
        "not a real date",
        "clock skew of 5 s (AML_MAX_CLOCK_SKEW)",
    ):
        assert fragment in reasons, fragment


def test_the_generated_records_are_mostly_distinct(records: list[Stamped]) -> None:
    mutated = records[len(corpus()) :]
    assert len(set(mutated)) > 0.6 * len(mutated)


# --- the comparison catches a weakened rule -----------------------------------------------------------------


def _single_parse(text: Any, wrapped: Any) -> Any:
    from pyspark.sql import functions as F

    return (F.try_variant_get(wrapped, "$[1]", "int") == 0) & F.variant_get(
        wrapped, "$[2]", "variant"
    ).isNull()


def _two_or_more_elements(text: Any, wrapped: Any) -> Any:
    """The check without "exactly two elements": `{...},0` would pass as [{...}, 0, 0]."""
    from pyspark.sql import functions as F

    second = F.try_parse_json(F.concat(F.lit("["), text, F.lit(",1]")))
    return (F.try_variant_get(wrapped, "$[1]", "int") == 0) & (
        (F.instr(text, "]") == 0) | (F.try_variant_get(second, "$[1]", "int") == 1)
    )


def _unchecked(text: Any) -> Any:
    from pyspark.sql import functions as F

    return F.lit(True)


def _numbers_as_text() -> dict[str, tuple[str, ...]]:
    return {**ACCEPTED_TYPES, "payee": ("STRING", "BIGINT")}


def _skew_unchecked(ts: Any, sent: Any, max_skew_us: int) -> Any:
    from pyspark.sql import functions as F

    return F.lit(True)


def _skew_and_a_microsecond(ts: Any, sent: Any, max_skew_us: int) -> Any:
    return WITHIN_CLOCK_SKEW(ts, sent, max_skew_us + 1)


def _skew_in_milliseconds(ts: Any, sent: Any, max_skew_us: int) -> Any:
    from pyspark.sql import functions as F

    return sent.isNull() | (F.unix_millis(ts) - F.lit(max_skew_us // 1000) <= F.unix_millis(sent))


def _negative_timestamps_bounded(ts: Any, sent: Any, max_skew_us: int) -> Any:
    from pyspark.sql import functions as F

    return sent.isNull() | (F.unix_micros(ts) - F.lit(max_skew_us) <= F.unix_micros(sent))


def _no_timestamp_refused(ts: Any, sent: Any, max_skew_us: int) -> Any:
    return sent.isNotNull() & WITHIN_CLOCK_SKEW(ts, sent, max_skew_us)


ACCEPTED_TYPES = validation.accepted_types()
WITHIN_CLOCK_SKEW = validation._within_clock_skew
WEAKENED: dict[str, tuple[str, Any]] = {
    "trailing data checked by one parse only": ("_nothing_after_the_object", _single_parse),
    "trailing data without the element count": ("_nothing_after_the_object", _two_or_more_elements),
    "Java's \\s for blank": ("blank_pattern", lambda: r"\A\s*\z"),
    "a NUL character accepted in a text field": ("NUL_PATTERN", "(?!)"),
    "depth unchecked": ("_depth_ok", _unchecked),
    "number lengths unchecked": ("_numbers_ok", _unchecked),
    "key lengths unchecked": ("_names_ok", _unchecked),
    "a JSON number taken for a text field": ("accepted_types", _numbers_as_text),
    "-00:00 taken for UTC": (
        "TIMESTAMP_PATTERN",
        validation.TIMESTAMP_PATTERN.replace("(?:Z|\\+00:00)", "(?:Z|[+-]00:00)"),
    ),
    "five decimal places accepted": ("AMOUNT_PATTERN", validation.AMOUNT_PATTERN.replace("{1,4}", "{1,5}")),
    "ts unbounded by the record's timestamp": ("_within_clock_skew", _skew_unchecked),
    "a microsecond more than the clock skew accepted": ("_within_clock_skew", _skew_and_a_microsecond),
    "ts and the record's timestamp compared in milliseconds": ("_within_clock_skew", _skew_in_milliseconds),
    "a negative record timestamp (Kafka's -1) taken as one": (
        "_within_clock_skew",
        _negative_timestamps_bounded,
    ),
    "a record without a timestamp refused": ("_within_clock_skew", _no_timestamp_refused),
}


@pytest.mark.parametrize("weakening", sorted(WEAKENED))
def test_the_comparison_catches_a_weakened_rule(
    weakening: str, frame: Any, records: list[Stamped], monkeypatch: pytest.MonkeyPatch
) -> None:
    name, replacement = WEAKENED[weakening]
    monkeypatch.setattr(validation, name, replacement)
    # The expressions are built once per session (`built_once`): anew here, and the session's own after.
    monkeypatch.setattr(expressions, "_by_context", weakref.WeakKeyDictionary())
    assert disagreements(records, spark_rows(frame)), f"{weakening}: no record told the difference"


def test_a_session_time_zone_does_not_move_ts(spark: Any, frame: Any) -> None:
    from pyspark.sql import functions as F

    one = frame.limit(200)
    before = {
        r.offset: r.m
        for r in validation.validated(one, MAX).select("offset", F.unix_micros("ts").alias("m")).collect()
    }
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        after = {
            r.offset: r.m
            for r in validation.validated(one, MAX).select("offset", F.unix_micros("ts").alias("m")).collect()
        }
    finally:
        spark.conf.set("spark.sql.session.timeZone", "UTC")
    assert before == after


def test_random_payments_round_trip_their_fields(spark: Any) -> None:
    """Realistic payments (every amount scale, every fraction length) give back exactly their values."""
    rng = random.Random(5)
    records: list[Stamped] = []
    for i in range(300):
        fraction = "" if i % 7 == 0 else "." + str(rng.randrange(10**6)).zfill(6)[: rng.randint(1, 6)]
        date = f"{rng.randint(1, 9999):04d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        time = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
        ts = f"{date}T{time}{fraction}{rng.choice(['Z', '+00:00'])}"
        amount = str(Decimal(rng.randrange(1, 10**19)).scaleb(-rng.randint(0, 4)))
        records.append((KEY, enc(doc(payment_id=f"p{i}", amount=amount, ts=ts)), None))
    assert not disagreements(records, spark_rows(kafka_frame(spark, records)))
