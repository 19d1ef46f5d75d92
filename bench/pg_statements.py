"""PostgreSQL's time by statement: which of B's and C's reads and the pipeline's writes the server's time
goes to, from PostgreSQL's own counters (pg_stat_statements, which `EmbeddedPostgres(statements=True)`
loads and every database it creates gets).

The counters are execution time (planning is not counted) summed over every backend, so they add up to
more than the wall time when statements run side by side; the shares are of that sum. Statements are told
apart by a piece of text only each holds (`KINDS`): a statement whose text changes so that no piece
matches counts as `OTHER`, and shows there.
"""

from __future__ import annotations

from typing import Any

import psycopg

#: (what the statement is, a piece of text only it holds); the first that matches names a statement.
KINDS = (
    ("C: the windows of an account at an instant", "lo_1h"),
    ("B: out and in lists", "WITH RECURSIVE budget"),
    ("B: cycles of 2 and 3", "min(e1.payee)"),
    ("B: chain (the heavy flow into an account)", "min(e3.payer)"),
    ("B: sources", "s.source, s.via"),
    ("B: co-payees", "c.account, c.shared"),
    ("B: loop, a forward step", "min(greatest(f.t"),
    ("B: loop, a backward step", "steps AS"),
    ("B: the pipeline's writes", "batch_edges"),
    ("C: the pipeline's writes", "batch_flows"),
)
OTHER = "other (snapshots, meta, checks)"

#: Per kind: (execution ms, calls) so far.
Counters = dict[str, tuple[float, int]]


def kind_of(query: str) -> str:
    return next((kind for kind, piece in KINDS if piece in query), OTHER)


async def read(url: str) -> Counters | None:
    """Execution ms and calls per kind since the server started; None where it does not count them (a
    server without the extension, or a role that may not read other roles' statements)."""
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=5) as conn:
            cursor = await conn.execute("SELECT query, total_exec_time, calls FROM pg_stat_statements")
            rows = await cursor.fetchall()
    except psycopg.Error:
        return None
    found: Counters = {}
    for query, ms, calls in rows:
        if query is None:  # another role's statement, hidden from this one
            return None
        kind = kind_of(query)
        total, count = found.get(kind, (0.0, 0))
        found[kind] = (total + float(ms), count + int(calls))
    return found


def between(start: Counters, end: Counters, payments: int) -> dict[str, Any]:
    """Per kind, over the time from `start` to `end`, largest first: execution ms, its share of all
    statements' time, calls, ms per call and per payment (of `payments`)."""
    spent = {}
    for kind, (ms, calls) in end.items():
        ms_before, calls_before = start.get(kind, (0.0, 0))
        spent[kind] = (ms - ms_before, calls - calls_before)
    whole = sum(ms for ms, _ in spent.values()) or float("nan")
    return {
        kind: {
            "ms": round(ms, 1),
            "share": round(ms / whole, 3),
            "calls": calls,
            "ms_per_call": round(ms / calls, 2) if calls else None,
            "ms_per_payment": round(ms / payments, 3) if payments else None,
        }
        for kind, (ms, calls) in sorted(spent.items(), key=lambda item: -item[1][0])
        if calls > 0
    }
