"""Spark column expressions built once per Spark context.

Building a column costs a call into the JVM per function and literal: about a second per micro-batch
for the payment contract's validation and 50 ms for C's aggregation, measured. The expressions name
columns only, so the same ones serve every batch of a session. They belong to the context's JVM: the
cache holds them by a weak reference to the context, so a stopped session's go with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

_by_context: weakref.WeakKeyDictionary[Any, dict[Hashable, Any]] = weakref.WeakKeyDictionary()


def built_once(context: object, key: Hashable, build: Callable[[], T]) -> T:
    """What `build()` makes, built once per Spark `context` and `key`."""
    built = _by_context.setdefault(context, {})
    if key not in built:
        built[key] = build()
    return built[key]  # type: ignore[no-any-return]
