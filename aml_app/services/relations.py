"""Service B's store: directed payment edges between accounts, and the relations query.

An edge is keyed (payer, payee, currency) and holds count, exact total (TEXT, added with `dec_add`),
first_seen (min) and last_seen (max), as microseconds since the epoch. Spark pre-aggregates each
micro-batch into `EdgeDelta`s (several may hit the same edge); `apply` adds them and advances the
applied offsets in one transaction (see `aml_app.services.store`).

`relations(account, hops)` answers from one read snapshot:
- `out` / `in`: the account's direct counterparties, merged over currencies, sorted by counterparty;
- `neighbourhood`: accounts within `hops` edges ignoring direction (excluding the account itself), with
  their shortest distance, sorted by (hops, account);
- `cycle`: the shortest directed cycle from the account back to itself with at most `hops` edges (a
  self-payment is a 1-hop cycle); among equally short ones the lexicographically smallest path.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from aml_app.services.store import (
    DECIMAL,
    Writer,
    as_of_json,
    claim_offsets,
    has_table,
    iso_text,
    money,
    money_text,
    read_offsets,
    read_snapshot,
    to_micros,
    validate_covered,
)

MAX_HOPS = 3
PARTS = ("out", "in", "neighbourhood", "cycle")
_CHUNK = 500  # accounts per IN (...) list

SCHEMA = """
CREATE TABLE IF NOT EXISTS edges (
    payer TEXT NOT NULL,
    payee TEXT NOT NULL,
    currency TEXT NOT NULL,
    count INTEGER NOT NULL,
    total TEXT NOT NULL,
    first_seen INTEGER NOT NULL,
    last_seen INTEGER NOT NULL,
    PRIMARY KEY (payer, payee, currency)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS edges_by_payee ON edges (payee, payer)
"""

_UPSERT = """
INSERT INTO edges (payer, payee, currency, count, total, first_seen, last_seen)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (payer, payee, currency) DO UPDATE SET
    count = count + excluded.count,
    total = dec_add(total, excluded.total),
    first_seen = min(first_seen, excluded.first_seen),
    last_seen = max(last_seen, excluded.last_seen)
"""


#: (payer, payee, currency, count, total text, first seen us, last seen us)
PreparedEdge = tuple[str, str, str, int, str, int, int]


@dataclass(frozen=True)
class EdgeDelta:
    """What one micro-batch adds to one edge: `count` payments totalling `total` (datetimes UTC-aware)."""

    payer: str
    payee: str
    currency: str
    count: int
    total: Decimal
    first_seen: datetime
    last_seen: datetime


def _delta_row(delta: EdgeDelta) -> tuple[str, str, str, int, str, int, int]:
    for name in ("payer", "payee", "currency"):
        value = getattr(delta, name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"EdgeDelta.{name} must be a non-empty string, got {value!r}")
    if isinstance(delta.count, bool) or not isinstance(delta.count, int) or delta.count < 1:
        raise ValueError(f"EdgeDelta.count must be a positive integer, got {delta.count!r}")
    total = money(delta.total)
    first, last = to_micros(delta.first_seen), to_micros(delta.last_seen)
    if first > last:
        raise ValueError(f"EdgeDelta first_seen {delta.first_seen} is after last_seen {delta.last_seen}")
    return (delta.payer, delta.payee, delta.currency, delta.count, money_text(total), first, last)


def _chunks(items: list[str]) -> Iterable[list[str]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


def _neighbours(conn: sqlite3.Connection, accounts: list[str], column: str, other: str) -> set[str]:
    """Distinct `other` values of edges whose `column` is one of `accounts` (column/other are fixed names)."""
    found: set[str] = set()
    for chunk in _chunks(accounts):
        marks = ",".join("?" * len(chunk))
        rows = conn.execute(f"SELECT DISTINCT {other} FROM edges WHERE {column} IN ({marks})", chunk)
        found.update(r[0] for r in rows)
    return found


def _side(conn: sqlite3.Connection, account: str, column: str, other: str) -> list[dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    rows = conn.execute(
        f"SELECT {other}, currency, count, total, first_seen, last_seen FROM edges WHERE {column} = ?",
        (account,),
    )
    for counterparty, currency, count, total, first, last in rows:
        entry = merged.setdefault(
            counterparty, {"count": 0, "totals": {}, "first_seen": first, "last_seen": last}
        )
        entry["count"] += count
        entry["totals"][currency] = DECIMAL.add(entry["totals"].get(currency, Decimal(0)), Decimal(total))
        entry["first_seen"] = min(entry["first_seen"], first)
        entry["last_seen"] = max(entry["last_seen"], last)
    return [
        {
            "counterparty": name,
            "count": entry["count"],
            "totals": {c: money_text(entry["totals"][c]) for c in sorted(entry["totals"])},
            "first_seen": iso_text(entry["first_seen"]),
            "last_seen": iso_text(entry["last_seen"]),
        }
        for name, entry in sorted(merged.items())
    ]


def _neighbourhood(conn: sqlite3.Connection, account: str, hops: int) -> list[dict[str, Any]]:
    distance = {account: 0}
    frontier = [account]
    for step in range(1, hops + 1):
        if not frontier:
            break
        outgoing = _neighbours(conn, frontier, "payer", "payee")
        incoming = _neighbours(conn, frontier, "payee", "payer")
        frontier = sorted(a for a in outgoing | incoming if a not in distance)
        for name in frontier:
            distance[name] = step
    del distance[account]
    return [
        {"account": a, "hops": d} for a, d in sorted(distance.items(), key=lambda item: (item[1], item[0]))
    ]


def _cycle(conn: sqlite3.Connection, account: str, hops: int) -> dict[str, Any]:
    # Directed distance from every account to `account` (walking in-edges backwards), up to hops - 1.
    to_start = {account: 0}
    frontier = [account]
    for step in range(1, hops):
        frontier = sorted(a for a in _neighbours(conn, frontier, "payee", "payer") if a not in to_start)
        for name in frontier:
            to_start[name] = step
    firsts = _neighbours(conn, [account], "payer", "payee")
    lengths = [1 + to_start[v] for v in firsts if v in to_start]
    if not lengths:
        return {"found": False, "path": []}
    # The shortest closed walk from `account` is a simple cycle. Walk it greedily: at each step take the
    # smallest successor that is exactly the remaining distance from the start; equal lengths make the
    # greedy choice the lexicographically smallest path. Only a successor at exactly that distance can be
    # on a shortest cycle (one closer would give a shorter cycle).
    remaining = min(lengths)
    path = [account]
    here = account
    while remaining > 0:
        candidates = [
            v for v in _neighbours(conn, [here], "payer", "payee") if to_start.get(v) == remaining - 1
        ]
        here = min(candidates)
        path.append(here)
        remaining -= 1
    return {"found": True, "path": path}


class RelationsStore:
    """Service B's SQLite store. Writes go through one lazily opened writer connection (`apply`); every
    query opens its own read-only connection, so the API can run while another process writes, and
    answers empty until the file exists."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._writer = Writer(path, SCHEMA)

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> RelationsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def apply(self, rows: Iterable[EdgeDelta], covered: Mapping[int, tuple[int, int]]) -> None:
        """Add the deltas and advance the covered partitions' offsets in one transaction.

        Raises StaleBatch (and changes nothing) if a covered range does not start at the stored next
        offset; raises ValueError (and changes nothing) for a malformed delta or range.
        """
        self.apply_prepared([_delta_row(delta) for delta in rows], covered)

    def apply_prepared(self, rows: Sequence[PreparedEdge], covered: Mapping[int, tuple[int, int]]) -> None:
        """`apply` for deltas already in stored form, as the pipeline's tasks make them on the executors:
        (payer, payee, currency, count, total as canonical money text, first and last seen in
        microseconds). The driver then does no per-row conversion."""
        spans = validate_covered(covered)
        if rows and not any(start < end for start, end in spans.values()):
            raise ValueError("apply: rows were given without any covered offsets to store them with")
        with self._writer.transaction() as conn:
            claim_offsets(conn, spans)
            conn.executemany(_UPSERT, rows)

    def applied_offsets(self) -> dict[int, int]:
        """partition -> next offset applied ({} before the first apply)."""
        return read_snapshot(self.path, read_offsets)

    def status(self) -> dict[str, Any]:
        """store_exists and as_of, from one snapshot."""
        return read_snapshot(
            self.path,
            lambda conn: {"store_exists": conn is not None, "as_of": as_of_json(read_offsets(conn))},
        )

    def relations(self, account: str, hops: int, parts: Iterable[str] = PARTS) -> dict[str, Any]:
        """The answer for `account`, with only the `parts` asked for (all by default).

        A caller that needs the cycle but not the neighbourhood says so: a 3-hop neighbourhood of an account
        that paid a busy merchant is most of the graph, and the detectors ask once per payment.
        """
        return self.relations_many([(account, hops, tuple(parts))])[0]

    def relations_many(self, queries: Sequence[tuple[str, int, Sequence[str]]]) -> list[dict[str, Any]]:
        """Answers for several (account, hops, parts), all from ONE read snapshot (one `as_of`)."""
        for _account, hops, parts in queries:
            if isinstance(hops, bool) or not isinstance(hops, int) or not 1 <= hops <= MAX_HOPS:
                raise ValueError(f"hops must be an integer from 1 to {MAX_HOPS}, got {hops!r}")
            if not set(parts) <= set(PARTS):
                raise ValueError(f"parts must be among {', '.join(PARTS)}, got {sorted(parts)}")

        def query(conn: sqlite3.Connection | None) -> list[dict[str, Any]]:
            as_of = as_of_json(read_offsets(conn))
            stored = conn if conn is not None and has_table(conn, "edges") else None
            return [_answer(stored, account, hops, set(parts), as_of) for account, hops, parts in queries]

        return read_snapshot(self.path, query)


def _empty(part: str) -> Any:
    return {"found": False, "path": []} if part == "cycle" else []


def _answer(
    conn: sqlite3.Connection | None, account: str, hops: int, wanted: set[str], as_of: dict[str, int]
) -> dict[str, Any]:
    compute = {
        "out": lambda c: _side(c, account, "payer", "payee"),
        "in": lambda c: _side(c, account, "payee", "payer"),
        "neighbourhood": lambda c: _neighbourhood(c, account, hops),
        "cycle": lambda c: _cycle(c, account, hops),
    }
    answer: dict[str, Any] = {"account": account, "hops": hops, "as_of": as_of}
    for part in PARTS:
        if part in wanted:
            answer[part] = compute[part](conn) if conn is not None else _empty(part)
    return answer
