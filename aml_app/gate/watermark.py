"""Pure watermark arithmetic: no I/O, so every rule here is unit-tested in isolation.

Kafka's committed offset is the *next* offset a group will read, so a group whose committed offset on
partition p is c has finished every offset < c. The watermark W(p) is the minimum of that over all
dependency groups, and payment (p, o) is fresh exactly when o < W(p). A group with no committed offset
has finished nothing: its contribution is 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Row = dict[str, Any]


def watermark(committed: Mapping[str, int | None]) -> int:
    """Min of the dependency groups' committed offsets on one partition (None or negative => 0)."""
    if not committed:
        raise ValueError("a watermark needs at least one dependency group")
    return min(max(offset or 0, 0) for offset in committed.values())


def is_open(offset: int, row: Row | None) -> bool:
    """Whether payment at `offset` may start: strictly below the watermark."""
    return row is not None and offset < row["watermark"]


def build_rows(
    partitions: Iterable[int],
    committed_by_group: Mapping[str, Mapping[int, int | None]],
    refreshed_at: float,
) -> dict[int, Row]:
    """One table row per partition: the watermark and the offsets it was computed from."""
    rows: dict[int, Row] = {}
    for p in partitions:
        deps = {g: max(offsets.get(p) or 0, 0) for g, offsets in committed_by_group.items()}
        rows[p] = {
            "partition": p,
            "watermark": watermark(deps),
            "dependencies": deps,
            "refreshed_at": refreshed_at,
        }
    return rows


def live_demand(demand_entries: Iterable[Mapping[str, Any]], now: float, max_age: float) -> dict[int, int]:
    """Lowest waiting offset per partition over every worker whose demand entry is recent."""
    waiting: dict[int, int] = {}
    for entry in demand_entries:
        if now - float(entry.get("at", 0)) > max_age:
            continue
        for p, offset in entry.get("waiting", {}).items():
            p = int(p)
            waiting[p] = min(waiting.get(p, offset), offset)
    return waiting


def refresh_due(
    now: float,
    last_refresh: float | None,
    waiting: Mapping[int, int],
    rows: Mapping[int, Row],
    slow_interval: float,
    fast_interval: float,
) -> bool:
    """The leader refreshes on the slow interval, or on the fast one while some payment is blocked.

    This keeps admin load at one set of calls per slow interval when nothing waits, and unblocks a
    waiting partition within about one fast interval of its dependencies committing.
    """
    if last_refresh is None:
        return True
    age = now - last_refresh
    if age >= slow_interval:
        return True
    blocked = any(not is_open(offset, rows.get(p)) for p, offset in waiting.items())
    return blocked and age >= fast_interval
