"""Decimal settings read as people write them, and their places counted exactly.

Why: `Decimal()` also takes "1_0" (ten), other scripts' digits, "NaN" and "Infinity", so "EUR=0_92"
would be a rate of 92; and `normalize()` rounds to the context's 28 digits, so a value with 24 decimal
places can pass for a whole number. Settings are read here instead."""

from __future__ import annotations

import re
from decimal import Decimal

#: The most decimal places of a decimal setting or rule threshold: a payment's amount has at most 4.
DECIMAL_PLACES = 4

#: ASCII digits, an optional point and exponent: what a person or a config file writes.
DECIMAL_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
WHOLE_TEXT = re.compile(r"[+-]?[0-9]+")


def ascii_decimal(text: str) -> Decimal | None:
    """`text` (surrounding blanks ignored) as a Decimal, or None when it is not written in ASCII digits."""
    text = text.strip()
    return Decimal(text) if DECIMAL_TEXT.fullmatch(text) else None


def decimal_places(value: Decimal) -> int:
    """How many places after the point `value` needs, exactly: trailing zeros do not count, and no
    context rounds it (0 for an infinite or NaN value)."""
    _, digits, exponent = value.as_tuple()
    if not isinstance(exponent, int) or not any(digits):
        return 0
    trailing = len(digits) - len("".join(map(str, digits)).rstrip("0"))
    return max(0, -(exponent + trailing))
