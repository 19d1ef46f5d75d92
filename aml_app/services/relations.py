"""Service B's store: directed payment edges between accounts, and the relations query, on PostgreSQL.

An edge is keyed (payer, payee, currency) and holds the number of payments, their exact total, and the
first and last event time. Spark aggregates each micro-batch into one row per edge (`aml_app.pipeline.
transforms.edges`); `apply` adds those rows to the stored edges and advances the applied offsets in one
transaction (an `INSERT ... ON CONFLICT DO UPDATE` from a temporary table filled by COPY).

`relations_many` answers, from one REPEATABLE READ snapshot and in a few statements for a whole batch:
- `out` / `in`: the account's direct counterparties, merged over currencies, sorted by counterparty;
- `neighbourhood`: accounts within `hops` edges ignoring direction (excluding the account itself), with
  their shortest distance, sorted by (hops, account);
- `cycle`: the shortest directed cycle from the account back to itself with at most `hops` edges (a
  self-payment is a 1-hop cycle); among equally short ones the smallest path (code-point order). With at
  most 3 hops a cycle is one join per length, which PostgreSQL answers from the primary key.

Account ids compare in code-point order everywhere (`COLLATE "C"`), as Python compares strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql

from aml_app.services.copy import copy_arrow
from aml_app.services.store import Schema, as_of_json, iso_text, money_text

MAX_HOPS = 3
PARTS = ("out", "in", "neighbourhood", "cycle")

SCHEMA = Schema(
    "relations",
    [
        """
        CREATE TABLE {schema}.edges (
            payer text COLLATE "C" NOT NULL,
            payee text COLLATE "C" NOT NULL,
            currency text COLLATE "C" NOT NULL,
            payments bigint NOT NULL,
            total numeric NOT NULL,
            first_seen timestamptz NOT NULL,
            last_seen timestamptz NOT NULL,
            PRIMARY KEY (payer, payee, currency)
        );
        CREATE INDEX edges_by_payee ON {schema}.edges (payee, payer)
        """
    ],
)

#: The columns of a batch's edge rows, as Spark makes them.
EDGE_COLUMNS = ("payer", "payee", "currency", "payments", "total", "first_seen", "last_seen")


def write_edges(conn: psycopg.Connection, schema: Schema, edges: Any) -> None:
    """Add a batch's edge rows (an Arrow table, one row per edge) to the stored edges."""
    if edges.num_rows == 0:
        return
    conn.execute(
        """
        CREATE TEMPORARY TABLE batch_edges (
            payer text COLLATE "C", payee text COLLATE "C", currency text COLLATE "C",
            payments bigint, total numeric, first_seen timestamptz, last_seen timestamptz
        ) ON COMMIT DROP
        """
    )
    copy_arrow(conn, "batch_edges", edges, EDGE_COLUMNS)
    conn.execute(
        sql.SQL(
            """
            INSERT INTO {edges} AS e SELECT * FROM batch_edges
            ON CONFLICT (payer, payee, currency) DO UPDATE SET
                payments = e.payments + excluded.payments,
                total = e.total + excluded.total,
                first_seen = least(e.first_seen, excluded.first_seen),
                last_seen = greatest(e.last_seen, excluded.last_seen)
            """
        ).format(edges=sql.Identifier(schema.name, "edges"))
    )


# --- queries --------------------------------------------------------------------------------------


def check_query(hops: int, parts: Iterable[str]) -> None:
    if isinstance(hops, bool) or not isinstance(hops, int) or not 1 <= hops <= MAX_HOPS:
        raise ValueError(f"hops must be an integer from 1 to {MAX_HOPS}, got {hops!r}")
    if not set(parts) <= set(PARTS):
        raise ValueError(f"parts must be among {', '.join(PARTS)}, got {sorted(parts)}")


def _sides(rows: Iterable[tuple]) -> dict[int, list[dict[str, Any]]]:
    """Per query index, the counterparties merged over currencies, sorted by counterparty."""
    merged: dict[int, dict[str, dict[str, Any]]] = {}
    for i, counterparty, currency, payments, total, first, last in rows:
        entry = merged.setdefault(i, {}).setdefault(
            counterparty, {"count": 0, "totals": {}, "first_seen": first, "last_seen": last}
        )
        entry["count"] += payments
        entry["totals"][currency] = entry["totals"].get(currency, Decimal(0)) + total
        entry["first_seen"] = min(entry["first_seen"], first)
        entry["last_seen"] = max(entry["last_seen"], last)
    return {
        i: [
            {
                "counterparty": name,
                "count": e["count"],
                "totals": {c: money_text(e["totals"][c]) for c in sorted(e["totals"])},
                "first_seen": iso_text(e["first_seen"]),
                "last_seen": iso_text(e["last_seen"]),
            }
            for name, e in sorted(by_name.items())
        ]
        for i, by_name in merged.items()
    }


_SIDE = """
SELECT q.i, e.{other}, e.currency, e.payments, e.total, e.first_seen, e.last_seen
FROM unnest(%(accounts)s::text[]) WITH ORDINALITY AS q(account, i)
JOIN {edges} e ON e.{own} = q.account COLLATE "C"
"""

# The shortest cycle through each account, for every length up to 3 (NULL where there is none): the
# smallest path of each length, in code-point order. Each length is a join along out-edges that ends with
# a primary-key lookup of the edge back to the account.
_CYCLES = """
SELECT q.i,
    EXISTS (SELECT 1 FROM {edges} e WHERE e.payer = q.account AND e.payee = q.account) AS one,
    (SELECT min(e1.payee) FROM {edges} e1
        JOIN {edges} e2 ON e2.payer = e1.payee AND e2.payee = q.account
        WHERE e1.payer = q.account AND %(hops)s >= 2) AS two,
    (SELECT ARRAY[e1.payee, e2.payee] FROM {edges} e1
        JOIN {edges} e2 ON e2.payer = e1.payee
        JOIN {edges} e3 ON e3.payer = e2.payee AND e3.payee = q.account
        WHERE e1.payer = q.account AND %(hops)s >= 3
        ORDER BY e1.payee, e2.payee LIMIT 1) AS three
FROM unnest(%(accounts)s::text[]) WITH ORDINALITY AS q(account, i)
"""

_NEIGHBOURS = """
SELECT payee FROM {edges} WHERE payer = ANY(%(frontier)s::text[])
UNION
SELECT payer FROM {edges} WHERE payee = ANY(%(frontier)s::text[])
"""


async def _cycles(cur: Any, edges: sql.Composable, accounts: list[str], hops: int) -> dict[int, dict]:
    await cur.execute(sql.SQL(_CYCLES).format(edges=edges), {"accounts": accounts, "hops": hops})
    found = {}
    for i, one, two, three in await cur.fetchall():
        account = accounts[i - 1]
        if one:
            path = [account, account]
        elif two is not None:
            path = [account, two, account]
        elif three is not None:
            path = [account, *three, account]
        else:
            path = []
        found[i] = {"found": bool(path), "path": path}
    return found


async def _neighbourhood(cur: Any, edges: sql.Composable, account: str, hops: int) -> list[dict[str, Any]]:
    distance = {account: 0}
    frontier = [account]
    for step in range(1, hops + 1):
        if not frontier:
            break
        await cur.execute(sql.SQL(_NEIGHBOURS).format(edges=edges), {"frontier": frontier})
        frontier = sorted(a for (a,) in await cur.fetchall() if a not in distance)
        for name in frontier:
            distance[name] = step
    del distance[account]
    return [
        {"account": a, "hops": d} for a, d in sorted(distance.items(), key=lambda item: (item[1], item[0]))
    ]


async def relations_many(
    cur: Any, schema: Schema, queries: Sequence[tuple[str, int, Sequence[str]]], as_of: Mapping[int, int]
) -> list[dict[str, Any]]:
    """Answers for several (account, hops, parts), inside the caller's read snapshot (cursor `cur`).

    `as_of` is the store's applied offsets read in the same snapshot; a store without tables answers every
    query empty (the caller passes `schema` None then).
    """
    for _account, hops, parts in queries:
        check_query(hops, parts)
    answers = []
    for account, hops, parts in queries:
        answer: dict[str, Any] = {"account": account, "hops": hops, "as_of": as_of_json(as_of)}
        for part in PARTS:
            if part in parts:
                answer[part] = {"found": False, "path": []} if part == "cycle" else []
        answers.append(answer)
    if schema is None or not queries:
        return answers
    edges = sql.Identifier(schema.name, "edges")
    for part, own, other in (("out", "payer", "payee"), ("in", "payee", "payer")):
        wanted = [(i, q[0]) for i, q in enumerate(queries) if part in q[2]]
        if wanted:
            await cur.execute(
                sql.SQL(_SIDE).format(edges=edges, own=sql.Identifier(own), other=sql.Identifier(other)),
                {"accounts": [a for _, a in wanted]},
            )
            sides = _sides(await cur.fetchall())
            for k, (i, _account) in enumerate(wanted, start=1):
                answers[i][part] = sides.get(k, [])
    by_hops: dict[int, list[int]] = {}
    for i, (_account, hops, parts) in enumerate(queries):
        if "cycle" in parts:
            by_hops.setdefault(hops, []).append(i)
    for hops, indexes in by_hops.items():
        cycles = await _cycles(cur, edges, [queries[i][0] for i in indexes], hops)
        for k, i in enumerate(indexes, start=1):
            answers[i]["cycle"] = cycles[k]
    for i, (account, hops, parts) in enumerate(queries):
        if "neighbourhood" in parts:
            answers[i]["neighbourhood"] = await _neighbourhood(cur, edges, account, hops)
    return answers
