"""The payment contract as Spark SQL expressions: raw Kafka records in, a verdict and typed fields out, all in
the JVM (no Python UDF, no Arrow round trip).

`validated(records, max_bytes, max_clock_skew)` marks each record `valid` exactly when
`aml_app.contract.validate_payment` would accept it (given the record's Kafka timestamp), and carries the
fields the contract returns, typed. It says nothing about *why* a record is
invalid: the pipeline asks the Python contract for the reason of the (rare) rejected records on the driver,
so a dead letter carries the same sentence whichever service refused it. `tests/unit/test_validation_sql.py`
holds the two implementations to the same verdict, record by record, over a corpus of hostile input.

How each rule is checked here (Spark 4 runs with ANSI on, so only `try_` casts are used):

- UTF-8: `is_valid_utf8` on the key and the value (overlong forms, encoded surrogates, >U+10FFFF refused,
  as by Python's decoder).
- JSON: `try_parse_json` (Jackson into a VARIANT) refuses duplicate keys at any depth, NaN/Infinity and
  unpaired surrogate escapes, as the contract does. It ignores whatever follows the first JSON value, so the
  value is parsed wrapped as `[value,0]`, and the result must be exactly the two elements [object, 0]. When
  the value holds no `]` that proves there is nothing after the object: the array can only close at the
  `]` we appended, so all of it was parsed. Otherwise the junk could close the array itself
  (`{...},0] junk`), so it is parsed again as `[value,1]`: junk after the object would be the same second
  element in both parses, and it cannot be both 0 and 1.
- Depth, number and key-length bounds (`MAX_JSON_DEPTH`, `MAX_NUMBER_LENGTH`, `MAX_NAME_LENGTH`) are below
  Jackson's own limits, so Jackson parses every document that might break them and the bounds are checked
  here on the text, only for the records whose size or characters allow a breach: string literals are
  matched left to right with one pattern (in valid JSON no quote lies between two literals), which gives
  the text outside strings (numbers are its runs of number characters; depth is the bracket nesting,
  counted by removing innermost pairs) and the keys (literals followed by a colon, decoded by Jackson).
- Fields: `variant_get` with a check of the JSON type (`schema_of_variant`: a number is not a string);
  lengths in code points (`length`); "blank" is a class of exactly the characters Python's `str.isspace`
  accepts, generated from Python; a NUL anywhere refuses a text field; `ts` by one regular expression
  of the RFC 3339 profile and `try_make_timestamp` for the calendar (Feb 30 is null).
- `ts` against the record's timestamp: in whole microseconds since the epoch (`unix_micros`, exact), `ts`
  less the allowed clock skew (`skew_micros`) is not after the record's timestamp; a record without a
  timestamp (null, or before the epoch: Kafka's -1) is not checked.
"""

from __future__ import annotations

from functools import cache
from typing import cast

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from aml_app.contract import (
    DEFAULT_MAX_CLOCK_SKEW,
    MAX_ID_LENGTH,
    MAX_JSON_DEPTH,
    MAX_NAME_LENGTH,
    MAX_NUMBER_LENGTH,
    MAX_OPTIONAL_LENGTH,
    OPTIONAL,
    REQUIRED,
    skew_micros,
)
from aml_app.currencies import ISO_4217
from aml_app.pipeline.expressions import built_once

AMOUNT_TYPE = "decimal(19,4)"  # < 10^15 with 4 decimal places: 15 + 4 digits
VALIDATED_SCHEMA = (
    "partition INT, offset BIGINT, timestamp TIMESTAMP, key BINARY, value BINARY, valid BOOLEAN, "
    f"payment_id STRING, payer STRING, payee STRING, amount {AMOUNT_TYPE.upper()}, currency STRING, "
    "ts TIMESTAMP"
)

# Java regular expressions (java.util.regex), anchored with \A and \z (`$` would accept a final newline).
AMOUNT_PATTERN = r"\A-?[0-9]+(?:\.[0-9]{1,4})?\z"
TIMESTAMP_PATTERN = (
    r"\A(?!0000)[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
    r"T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|\+00:00)\z"
)
# One JSON string literal, for text already known to be valid JSON. Possessive quantifiers: Java matches
# them in a loop, not by recursion, so a literal of millions of escapes cannot overflow the stack.
STRING_LITERAL = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
# Every literal, so that matches follow each other literal by literal; group 1 is set only for a literal
# followed by a colon (a key) whose text, escapes included, is longer than MAX_NAME_LENGTH characters (a
# shorter text cannot decode to a longer key).
_NAME_PATTERN = (
    rf'"(?:[^"\\]|\\.){{0,{MAX_NAME_LENGTH}}}+"'
    rf"|({STRING_LITERAL})(?=[ \t\n\r]*+:)"
    rf"|{STRING_LITERAL}"
)
_NUMBER_RUN = rf"[-+.0-9eE]{{{MAX_NUMBER_LENGTH + 1}}}"
# The contract's fields of the top-level object, as text and as VARIANTs (for their JSON types).
FIELDS = (*REQUIRED, *OPTIONAL)
_AS_TEXT = "struct<" + ", ".join(f"{name}: string" for name in FIELDS) + ">"
_AS_VARIANTS = "struct<" + ", ".join(f"{name}: variant" for name in FIELDS) + ">"


def accepted_types() -> dict[str, tuple[str, ...]]:
    """Per field of a valid payment, the JSON types (`schema_of_variant`) it may have: a required field a
    string, an optional one a string or VOID (null or missing)."""
    return {**dict.fromkeys(REQUIRED, ("STRING",)), **dict.fromkeys(OPTIONAL, ("STRING", "VOID"))}


@cache
def blank_pattern() -> str:
    """A Java regex matching a string that Python's `str.strip()` empties: only `str.isspace()` characters.

    Java's `\\s` is a different set (it lacks U+0085, U+00A0, U+2000.., and has no U+001C..U+001F), so the
    class is generated from Python's own table.
    """
    spaces = "".join(f"\\x{{{code:X}}}" for code in range(0x110000) if chr(code).isspace())
    return rf"\A[{spaces}]*\z"


#: A Java regex found in a text that holds a NUL character, which PostgreSQL's text cannot store.
NUL_PATTERN = r"\x00"


def _not_blank(text: Column, max_length: int) -> Column:
    """The rest of `_text_field` once the type is known to be a string: not blank, no NUL, at most
    `max_length` code points (one pattern for the first two: each `rlike` is a pass over the text)."""
    return ~text.rlike(f"{blank_pattern()}|{NUL_PATTERN}") & (F.length(text) <= max_length)


def _nothing_after_the_object(text: Column, wrapped: Column) -> Column:
    """`wrapped` (the parse of `[text,0]`) holds exactly [first value, 0] and no data followed the first
    value (see the module's docstring)."""
    # `contains`, not `instr`: Spark's instr compares at every byte through a general array comparison,
    # contains looks for the first byte first (instr was 2-3 % of a warm batch's JVM samples).
    return (
        (F.try_variant_get(wrapped, "$[1]", "int") == 0)
        & F.variant_get(wrapped, "$[2]", "variant").isNull()
        & (
            ~text.contains("]")
            | (
                F.try_variant_get(F.try_parse_json(F.concat(F.lit("["), text, F.lit(",1]"))), "$[1]", "int")
                == 1
            )
        )
    )


def _outside_strings(text: Column) -> Column:
    """The text with every string literal emptied (`""`): what is left of valid JSON is structure, numbers and
    the literals true, false and null."""
    return F.regexp_replace(text, STRING_LITERAL, '""')


def _depth_ok(text: Column) -> Column:
    """No more than MAX_JSON_DEPTH nested objects and arrays (counted only when there are that many
    brackets at all). Each pass removes every innermost pair, so nesting d deep is gone after d passes."""
    brackets = F.regexp_replace(_outside_strings(text), r"[^\[\]{}]", "")
    flattened = F.aggregate(
        F.sequence(F.lit(1), F.lit(MAX_JSON_DEPTH)),
        brackets,
        lambda rest, _: F.regexp_replace(rest, r"\[\]|\{\}", ""),
    )
    opening = F.octet_length(text) - F.octet_length(
        F.replace(F.replace(text, F.lit("["), F.lit("")), F.lit("{"), F.lit(""))
    )
    return F.when(opening > MAX_JSON_DEPTH, flattened == "").otherwise(True)


def _numbers_ok(text: Column) -> Column:
    """No number longer than MAX_NUMBER_LENGTH characters: outside strings, a run of number characters is
    exactly one number (checked only when the text has such a run at all, strings included)."""
    return F.when(text.rlike(_NUMBER_RUN), ~_outside_strings(text).rlike(_NUMBER_RUN)).otherwise(True)


def _names_ok(text: Column) -> Column:
    """No key longer than MAX_NAME_LENGTH code points once unescaped (checked only for texts long enough to
    hold one): the keys whose text is longer are unescaped by parsing them as JSON strings."""
    long_keys = F.filter(F.regexp_extract_all(text, F.lit(_NAME_PATTERN), 1), lambda name: name != "")
    too_long = F.exists(
        long_keys,
        lambda name: F.length(F.variant_get(F.try_parse_json(name), "$", "string")) > MAX_NAME_LENGTH,
    )
    return F.when(F.octet_length(text) > MAX_NAME_LENGTH, ~too_long).otherwise(True)


def _within_clock_skew(ts: Column, record_timestamp: Column, max_skew_us: int) -> Column:
    """`ts` at most `max_skew_us` microseconds after the record's timestamp, or the record has none (null,
    or before the epoch, as Kafka's -1 would be: the Python contract's "negative")."""
    sent = F.unix_micros(record_timestamp)
    # The skew is taken from `ts` (years 1-9999), never added to the record's timestamp: a hostile one near
    # the end of Spark's range would overflow the sum, which ANSI mode raises as an error.
    return record_timestamp.isNull() | (sent < 0) | (F.unix_micros(ts) - F.lit(max_skew_us) <= sent)


def _within_json_bounds(text: Column) -> Column:
    """Depth, number lengths and key lengths of a text that parsed as JSON; most payments are decided by
    the cheap tests in front of each check."""
    return _depth_ok(text) & _numbers_ok(text) & _names_ok(text)


# The session settings the contract relies on (the defaults); `validated` refuses to run under others.
REQUIRED_SETTINGS = {
    "spark.sql.variant.allowDuplicateKeys": "false",
    "spark.sql.variant.validateUnicodeInJsonParsing": "true",
}


def _check_session(records: DataFrame) -> None:
    conf = records.sparkSession.conf
    # Every key here has a default in Spark, so get() returns a str (pyspark types it str | None).
    wrong = {k: conf.get(k) for k, v in REQUIRED_SETTINGS.items() if cast(str, conf.get(k)).lower() != v}
    if wrong:
        raise ValueError(f"payment validation needs {REQUIRED_SETTINGS}; this session has {wrong}")


def validated(
    records: DataFrame, max_bytes: int, max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW
) -> DataFrame:
    """Kafka records (`partition, offset, timestamp, key, value`) -> `VALIDATED_SCHEMA`.

    `valid` is true exactly when `validate_payment(key, value, max_bytes, timestamp, max_clock_skew)`
    returns (`timestamp` in milliseconds); the typed fields are those it returns (null when not valid).
    Timestamp, key and value are kept for the dead letters, and a `source` column (a derived topic's
    record naming its payment) is passed on as it is.
    """
    _check_session(records)
    frame = records
    context, sourced = records.sparkSession.sparkContext, "source" in records.columns
    for stage in _stages(context, max_bytes, skew_micros(max_clock_skew), sourced):
        frame = frame.select(*stage)
    return frame


def _stages(
    context: object, max_bytes: int, max_skew_us: int, sourced: bool = False
) -> list[list[Column | str]]:
    """The column expressions of `validated`, built once per Spark context, size limit, clock skew and
    whether a `source` column is passed on (`built_once`: hundreds of calls into the JVM each)."""
    key = ("validation", max_bytes, max_skew_us, sourced)
    return built_once(context, key, lambda: _build_stages(max_bytes, max_skew_us, sourced))


def _types_ok(json: str) -> Column:
    """Whether each of the contract's fields of the document in column `json` (parsed as `[value,0]`;
    the fields null when the document is no object) has a JSON type it may have. Field by field: the
    type of an object built of them all (`to_variant_object`) cost a third of the validation's time, for
    the same verdict. One SQL expression, parsed in the JVM: as Column calls it took hundreds of round
    trips to the JVM at every start."""
    accepted = accepted_types()
    variants = f"try_variant_get({json}, '$[0]', '{_AS_VARIANTS}')"
    checks = [  # a missing field is SQL null: VOID, as a JSON null
        f"coalesce(schema_of_variant({variants}.{name}), 'VOID') IN ({', '.join(map(repr, accepted[name]))})"
        for name in FIELDS
    ]
    return F.expr(" AND ".join(f"({check})" for check in checks))


def _in_currencies(expression: str) -> Column:
    """`expression` is an ISO 4217 code: one SQL IN of the codes, parsed in the JVM, rather than a Column
    per code (hundreds of calls into the JVM); Spark plans both as the same hash-set lookup."""
    codes = sorted(ISO_4217)
    if not all(code.isascii() and code.isalpha() for code in codes):  # quoted below as they are
        raise ValueError("ISO_4217 holds a code that is not letters")
    return F.expr(f"{expression} IN ({', '.join(repr(code) for code in codes)})")


def _build_stages(max_bytes: int, max_skew_us: int, sourced: bool = False) -> list[list[Column | str]]:
    value, key = F.col("value"), F.col("key")
    text = value.cast("string")
    readable = (
        value.isNotNull()
        & (F.octet_length(value) <= max_bytes)
        & key.isNotNull()
        & F.is_valid_utf8(key)
        & F.is_valid_utf8(value)
    )
    kept: list[Column | str] = ["partition", "offset", "timestamp", "key", "value"]
    if sourced:
        kept.append("source")
    # 1. One JSON parse per record (a second one, and the bounds, only where needed).
    parsed = [
        *kept,
        F.when(readable, F.try_parse_json(F.concat(F.lit("["), text, F.lit(",0]")))).alias("_json"),
    ]
    # 2. The contract's fields as text, and their JSON types (missing and null are both VOID; a path into
    # anything but an object gives null, as Python's `name in doc` would fail).
    json_ok = F.coalesce(
        F.col("_json").isNotNull()
        & _nothing_after_the_object(text, F.col("_json"))
        & _within_json_bounds(text),
        F.lit(False),
    )
    fields: list[Column | str] = [
        *kept,
        json_ok.alias("_json_ok"),
        F.try_variant_get("_json", "$[0]", _AS_TEXT).alias("_f"),
        _types_ok("_json").alias("_types_ok"),
    ]

    # Each field's column is built once: every Column call is a round trip to the JVM, and a cold one
    # (a pipeline's start) answers each in milliseconds.
    by_name = {name: F.col("_f").getField(name) for name in FIELDS}

    def field(name: str) -> Column:
        return by_name[name]

    # 3. Amount and instant, each computed once. The pattern fixes the timestamp's form (Z or +00:00 only),
    # so the cast only has the calendar left to judge (Feb 30 is null).
    typed: list[Column | str] = [
        "*",
        F.when(field("amount").rlike(AMOUNT_PATTERN), field("amount").try_cast(AMOUNT_TYPE)).alias("_amount"),
        F.when(field("ts").rlike(TIMESTAMP_PATTERN), field("ts").try_cast("timestamp")).alias("_ts"),
    ]
    checks = [
        F.col("_json_ok"),
        F.col("_types_ok"),
        _not_blank(field("payer"), MAX_ID_LENGTH),
        key.cast("string") == field("payer"),
        _in_currencies("_f.currency"),
        *(field(name).isNull() | _not_blank(field(name), MAX_OPTIONAL_LENGTH) for name in OPTIONAL),
        _not_blank(field("payment_id"), MAX_ID_LENGTH),
        _not_blank(field("payee"), MAX_ID_LENGTH),
        F.col("_amount") > 0,
        F.col("_ts").isNotNull(),
        _within_clock_skew(F.col("_ts"), F.col("timestamp"), max_skew_us),
    ]
    valid = checks[0]
    for check in checks[1:]:
        valid = valid & check
    checked: list[Column | str] = ["*", F.coalesce(valid, F.lit(False)).alias("valid")]

    # 4. The verdict, and the typed fields of valid records.
    def when_valid(column: Column, name: str) -> Column:
        return F.when(F.col("valid"), column).alias(name)

    verdict = [
        *kept,
        "valid",
        *(when_valid(field(name), name) for name in ("payment_id", "payer", "payee")),
        when_valid(F.col("_amount"), "amount"),
        when_valid(field("currency"), "currency"),
        when_valid(F.col("_ts"), "ts"),
    ]
    return [parsed, fields, typed, checked, verdict]
