"""Service B's store: directed payment edges between accounts, and the relations query, on PostgreSQL.

An edge is keyed (payer, payee, currency) and holds the number of payments, their exact total, and the
first and last event time. Spark aggregates each micro-batch into one row per edge (`aml_app.pipeline.
transforms.edges`); `apply` adds those rows to the stored edges and advances the applied offsets in one
transaction (an `INSERT ... ON CONFLICT DO UPDATE` from a temporary table filled by COPY).

`relations_many` answers, from one REPEATABLE READ snapshot and in a few statements for a whole batch:
- `out` / `in`: the account's direct counterparties, merged over currencies, sorted by counterparty;
- `neighbourhood`: accounts within `hops` edges ignoring direction (excluding the account itself), with
  their shortest distance, sorted by (hops, account);
- `cycle`: the shortest simple directed cycle from the account back to itself with 2 to `hops` edges,
  through distinct other accounts (a self-payment moves no money between parties: it makes no cycle and
  is part of none); among equally short ones the smallest path (code-point order). With at most 3 hops a
  cycle is one join per length, which PostgreSQL answers from the primary key.
- `loop` (answered only when asked, with `closing` and `at`): the shortest cycle that a payment from
  `closing` into the account at `at` closes, if money can have gone around it in time: a path account ->
  ... -> closing of at most `loop_hops` - 1 edges through distinct accounts, each edge paid no earlier
  than the one before and within LOOP_SPAN before `at`. Edges keep only their first and last times, so an
  edge is taken at max(the time reached, its first payment) if its last payment is not earlier: exact for
  edges of one payment, and never missing a loop otherwise. Found level by level from the account (one
  statement per level for the whole batch); an account is taken again at a deeper level only if reached
  earlier in time, which keeps every level's frontier to distinct accounts. AMLworld's cycles run to 13
  hops over days; B's `cycle` sees 3. {"found", "path": [account, ..., closing, account], "complete"};
  `complete` is false when a level reached more than LOOP_FRONTIER accounts and the search stopped.

The layering parts look only at *heavy* edges: an edge row (one currency) whose average payment is at
least the query's `min_average` (default 0: every edge). Laundering moves large sums through few hands;
the heavy filter keeps the everyday graph of small payments (shops, friends) out of these answers:
- `chain`: the longest simple directed path of heavy edges that ends at the account, with at most `hops`
  edges (all accounts distinct); among equally long ones the smallest path; `[]` when none comes in;
- `sources`: the two-step heavy flows into the account: every source s with at least 2 distinct
  intermediates m (s -> m -> account, s, m and the account all distinct), as {"source", "via"}, the most
  intermediates first, then by source; at most LISTED of them;
- `co_payees`: the accounts that share at least 2 distinct heavy payers with the account (a bipartite
  block), as {"account", "shared"}, the most shared first, then by account; at most LISTED of them.
An expression index on (payee, average payment) finds the heavy edges into an account without reading
its light ones (a busy shop has thousands), and serves every other lookup by payee too: an index per
lookup would cost each batch's write more than the queries gain.

Account ids compare in code-point order everywhere (`COLLATE "C"`), as Python compares strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from aml_app.dependencies.copy import copy_arrow
from aml_app.dependencies.store import Schema, as_of_json, iso_text, money_text

MAX_HOPS = 3
#: The parts answered when a query names none.
PARTS = ("out", "in", "neighbourhood", "cycle", "chain", "sources", "co_payees")
#: Every part a query may name: `loop` needs the closing payment's payer and time, so it is never a default.
ALL_PARTS = (*PARTS, "loop")
LOOP_MAX_HOPS = 16
LOOP_HOPS = 12
#: How far back before `at` a loop may start (AMLworld's laundering cycles span up to about a week).
LOOP_SPAN = timedelta(days=14)
#: The most accounts one level of a loop search may reach before it stops (`complete` false).
LOOP_FRONTIER = 5000
#: At most this many `sources` and `co_payees` in an answer, the strongest first.
LISTED = 10


class Query(NamedTuple):
    """One question to Service B: an account, how far to look, which parts, and what counts as heavy;
    for `loop`, the payment that would close it (its payer and time) and the longest loop."""

    account: str
    hops: int
    parts: Sequence[str]
    min_average: Decimal = Decimal(0)
    closing: str | None = None
    at: datetime | None = None
    loop_hops: int = LOOP_HOPS


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
        """,
        # 2: the heavy edges into an account, without reading its light ones (see `_HEAVY`).
        """
        CREATE INDEX edges_by_payee_average ON {schema}.edges (payee, (total / payments))
        """,
        # 3: one index by payee instead of two: the one by average, carrying the payer for the lookups
        # that read nothing else. Two cost a quarter of a batch write's PostgreSQL CPU (3.7 of 14.3 µs
        # per payment, measured).
        """
        DROP INDEX {schema}.edges_by_payee;
        DROP INDEX {schema}.edges_by_payee_average;
        CREATE INDEX edges_by_payee ON {schema}.edges (payee, (total / payments)) INCLUDE (payer)
        """,
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
    copy_arrow(conn, "batch_edges", edges, EDGE_COLUMNS, key=EDGE_COLUMNS[:3])
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


def check_query(
    hops: int,
    parts: Iterable[str],
    min_average: Decimal = Decimal(0),
    closing: str | None = None,
    at: datetime | None = None,
    loop_hops: int = LOOP_HOPS,
) -> None:
    if isinstance(hops, bool) or not isinstance(hops, int) or not 1 <= hops <= MAX_HOPS:
        raise ValueError(f"hops must be an integer from 1 to {MAX_HOPS}, got {hops!r}")
    parts = list(parts)
    if not set(parts) <= set(ALL_PARTS):
        raise ValueError(f"parts must be among {', '.join(ALL_PARTS)}, got {sorted(parts)}")
    if "loop" in parts:
        if not isinstance(closing, str) or not closing or not isinstance(at, datetime) or at.tzinfo is None:
            raise ValueError(
                "the loop part needs `closing` (an account) and `at` (an instant with a timezone)"
            )
        if (
            isinstance(loop_hops, bool)
            or not isinstance(loop_hops, int)
            or not 2 <= loop_hops <= LOOP_MAX_HOPS
        ):
            raise ValueError(f"loop_hops must be an integer from 2 to {LOOP_MAX_HOPS}, got {loop_hops!r}")
    if not isinstance(min_average, Decimal) or not min_average.is_finite() or min_average < 0:
        raise ValueError(f"min_average must be a finite Decimal >= 0, got {min_average!r}")


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

# The shortest simple cycle through each account, for lengths 2 and 3 (NULL where there is none): the
# smallest path of each length, in code-point order, through distinct accounts other than the asked one
# (a self-payment makes no cycle). Each length is a join along out-edges that ends with a primary-key
# lookup of the edge back to the account.
_CYCLES = """
SELECT q.i,
    (SELECT min(e1.payee) FROM {edges} e1
        JOIN {edges} e2 ON e2.payer = e1.payee AND e2.payee = q.account
        WHERE e1.payer = q.account AND e1.payee <> q.account AND %(hops)s >= 2) AS two,
    (SELECT ARRAY[e1.payee, e2.payee] FROM {edges} e1
        JOIN {edges} e2 ON e2.payer = e1.payee
        JOIN {edges} e3 ON e3.payer = e2.payee AND e3.payee = q.account
        WHERE e1.payer = q.account AND %(hops)s >= 3
            AND e1.payee <> q.account AND e2.payee <> q.account AND e2.payee <> e1.payee
        ORDER BY e1.payee, e2.payee LIMIT 1) AS three
FROM unnest(%(accounts)s::text[]) WITH ORDINALITY AS q(account, i)
"""

_NEIGHBOURS = """
SELECT payee FROM {edges} WHERE payer = ANY(%(frontier)s::text[])
UNION
SELECT payer FROM {edges} WHERE payee = ANY(%(frontier)s::text[])
"""

# A heavy edge row `e`: average payment >= %(min)s. The first test can use the expression index
# edges_by_payee; the second is the exact one (numeric division rounds, multiplication does not).
_HEAVY = "({e}.total / {e}.payments) >= %(min)s AND {e}.total >= %(min)s * {e}.payments"


def _heavy(*aliases: str) -> str:
    return " AND ".join(_HEAVY.format(e=a) for a in aliases)


# The longest simple heavy path into each account, for each length up to 3 (NULL where there is none):
# the smallest of each length, as the accounts before the asked one.
_CHAINS = f"""
SELECT q.i,
    (SELECT min(e3.payer) FROM {{edges}} e3
        WHERE e3.payee = q.account AND e3.payer <> q.account AND {_heavy("e3")}) AS one,
    (SELECT ARRAY[e2.payer, e3.payer] FROM {{edges}} e3
        JOIN {{edges}} e2 ON e2.payee = e3.payer
        WHERE e3.payee = q.account AND %(hops)s >= 2 AND {_heavy("e3", "e2")}
            AND e3.payer <> q.account AND e2.payer <> q.account AND e2.payer <> e3.payer
        ORDER BY e2.payer, e3.payer LIMIT 1) AS two,
    (SELECT ARRAY[e1.payer, e2.payer, e3.payer] FROM {{edges}} e3
        JOIN {{edges}} e2 ON e2.payee = e3.payer
        JOIN {{edges}} e1 ON e1.payee = e2.payer
        WHERE e3.payee = q.account AND %(hops)s >= 3 AND {_heavy("e3", "e2", "e1")}
            AND e3.payer <> q.account AND e2.payer <> q.account AND e1.payer <> q.account
            AND e2.payer <> e3.payer AND e1.payer <> e3.payer AND e1.payer <> e2.payer
        ORDER BY e1.payer, e2.payer, e3.payer LIMIT 1) AS three
FROM unnest(%(accounts)s::text[]) WITH ORDINALITY AS q(account, i)
"""

_SOURCES = f"""
SELECT q.i, s.source, s.via
FROM unnest(%(accounts)s::text[]) WITH ORDINALITY AS q(account, i)
CROSS JOIN LATERAL (
    SELECT e1.payer AS source, array_agg(DISTINCT e2.payer ORDER BY e2.payer) AS via
    FROM {{edges}} e2
    JOIN {{edges}} e1 ON e1.payee = e2.payer
    WHERE e2.payee = q.account AND {_heavy("e2", "e1")}
        AND e2.payer <> q.account AND e1.payer <> q.account AND e1.payer <> e2.payer
    GROUP BY e1.payer
    HAVING count(DISTINCT e2.payer) >= 2
    ORDER BY count(DISTINCT e2.payer) DESC, e1.payer
    LIMIT {LISTED}
) s
ORDER BY q.i, cardinality(s.via) DESC, s.source
"""

_CO_PAYEES = f"""
SELECT q.i, c.account, c.shared
FROM unnest(%(accounts)s::text[]) WITH ORDINALITY AS q(account, i)
CROSS JOIN LATERAL (
    SELECT e2.payee AS account, count(DISTINCT e1.payer) AS shared
    FROM {{edges}} e1
    JOIN {{edges}} e2 ON e2.payer = e1.payer
    WHERE e1.payee = q.account AND e2.payee <> q.account AND {_heavy("e1", "e2")}
    GROUP BY e2.payee
    HAVING count(DISTINCT e1.payer) >= 2
    ORDER BY count(DISTINCT e1.payer) DESC, e2.payee
    LIMIT {LISTED}
) c
ORDER BY q.i, c.shared DESC, c.account
"""


async def _chains(
    cur: Any, edges: sql.Composable, accounts: list[str], hops: int, min_average: Decimal
) -> dict[int, list[str]]:
    await cur.execute(
        sql.SQL(_CHAINS).format(edges=edges), {"accounts": accounts, "hops": hops, "min": min_average}
    )
    found = {}
    for i, one, two, three in await cur.fetchall():
        before = three or two or ([one] if one is not None else [])
        found[i] = [*before, accounts[i - 1]] if before else []
    return found


async def _listed(
    cur: Any, query: str, edges: sql.Composable, accounts: list[str], min_average: Decimal
) -> dict[int, list[tuple[Any, Any]]]:
    await cur.execute(sql.SQL(query).format(edges=edges), {"accounts": accounts, "min": min_average})
    found: dict[int, list[tuple[Any, Any]]] = {}
    for i, name, value in await cur.fetchall():
        found.setdefault(i, []).append((name, value))
    return found


async def _cycles(cur: Any, edges: sql.Composable, accounts: list[str], hops: int) -> dict[int, dict]:
    await cur.execute(sql.SQL(_CYCLES).format(edges=edges), {"accounts": accounts, "hops": hops})
    found = {}
    for i, two, three in await cur.fetchall():
        account = accounts[i - 1]
        if two is not None:
            path = [account, two, account]
        elif three is not None:
            path = [account, *three, account]
        else:
            path = []
        found[i] = {"found": bool(path), "path": path}
    return found


# One level of the loop searches of a batch: from each (search, account, time reached) of the frontier,
# the accounts its out-edges reach in time, with the earliest time each is reached (over the edge's
# currencies). An edge counts if it was paid at or before `at`, last paid no earlier than the time reached,
# and leads to another account than the search's start and the payer itself.
_LOOP_LEVEL = """
SELECT f.k, f.account, e.payee, min(greatest(f.reached, e.first_seen))
FROM unnest(%(searches)s::int[], %(accounts)s::text[], %(reached)s::timestamptz[], %(ats)s::timestamptz[],
    %(starts)s::text[]) AS f(k, account, reached, at, start)
JOIN {edges} e ON e.payer = f.account COLLATE "C"
WHERE e.last_seen >= f.reached AND e.first_seen <= f.at AND e.payee <> e.payer AND e.payee <> f.start
GROUP BY f.k, f.account, e.payee
"""

#: A search's label of an account: the earliest time money can have reached it, and the path that did.
Label = tuple[datetime, tuple[str, ...]]


def loop_level(
    frontier: Mapping[str, Label],
    steps: Iterable[tuple[str, str, datetime]],
    best: dict[str, datetime],
    closing: str,
) -> tuple[list[tuple[str, ...]], dict[str, Label]]:
    """One level of a loop search, given the steps (from, to, time reached) out of `frontier`: the paths
    that reach `closing` (the cheapest first: earliest, then smallest path) and the next frontier. `best`
    (account -> earliest time reached at any level so far) is updated: an account reached no earlier than
    before is not taken again, since whatever it could reach from there it reached already."""
    found: list[Label] = []
    nxt: dict[str, Label] = {}
    for source, target, reached in steps:
        path = (*frontier[source][1], target)
        if target == closing:
            found.append((reached, path))
        elif (target not in best or reached < best[target]) and (
            target not in nxt or (reached, path) < nxt[target]
        ):
            nxt[target] = (reached, path)
    for account, (reached, _path) in nxt.items():
        best[account] = reached
    return [path for _reached, path in sorted(found)], nxt


async def _loops(cur: Any, edges: sql.Composable, asked: Sequence[Query]) -> list[dict[str, Any]]:
    """The `loop` part of each query (see the module docstring), all searches one level at a time."""
    answers = [{"found": False, "path": [], "complete": True} for _ in asked]
    starts = {k: q.at - LOOP_SPAN for k, q in enumerate(asked) if q.at is not None}
    frontiers: dict[int, dict[str, Label]] = {
        k: {asked[k].account: (t, (asked[k].account,))} for k, t in starts.items()
    }
    bests: dict[int, dict[str, datetime]] = {k: {asked[k].account: t} for k, t in starts.items()}
    level = 0
    while frontiers:
        level += 1
        rows = [
            (k, account, label[0]) for k, frontier in frontiers.items() for account, label in frontier.items()
        ]
        await cur.execute(
            sql.SQL(_LOOP_LEVEL).format(edges=edges),
            {
                "searches": [k for k, _, _ in rows],
                "accounts": [a for _, a, _ in rows],
                "reached": [t for _, _, t in rows],
                "ats": [asked[k].at for k, _, _ in rows],
                "starts": [asked[k].account for k, _, _ in rows],
            },
        )
        steps: dict[int, list[tuple[str, str, datetime]]] = {k: [] for k in frontiers}
        for k, source, target, reached in await cur.fetchall():
            steps[k].append((source, target, reached))
        for k in list(frontiers):
            q = asked[k]
            found, nxt = loop_level(frontiers[k], sorted(steps[k]), bests[k], q.closing or "")
            if found:
                answers[k] = {"found": True, "path": [*found[0], q.account], "complete": True}
                del frontiers[k]
            elif not nxt or level + 1 >= q.loop_hops:
                del frontiers[k]
            elif len(nxt) > LOOP_FRONTIER:
                answers[k]["complete"] = False
                del frontiers[k]
            else:
                frontiers[k] = nxt
    return answers


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
    cur: Any,
    schema: Schema | None,
    queries: Sequence[Sequence[Any]],
    as_of: Mapping[int, int],
    log: str | None = None,
) -> list[dict[str, Any]]:
    """Answers for several queries (`Query`, or (account, hops, parts) tuples), inside the caller's read
    snapshot (cursor `cur`).

    `as_of` is the store's applied offsets and `log` the log they are of (its meta `log`; None for a store
    that records none), both read in the same snapshot; a store without tables answers every query empty
    (the caller passes `schema` None then).
    """
    asked = [Query(*q) for q in queries]
    for q in asked:
        check_query(q.hops, q.parts, q.min_average, q.closing, q.at, q.loop_hops)
    answers = []
    for q in asked:
        answer: dict[str, Any] = {
            "account": q.account,
            "hops": q.hops,
            "as_of": as_of_json(as_of),
            "log": log,
        }
        for part in ALL_PARTS:
            if part in q.parts:
                answer[part] = {"found": False, "path": []} if part == "cycle" else []
        if "loop" in q.parts:
            answer["loop"] = {"found": False, "path": [], "complete": True}
        answers.append(answer)
    if schema is None or not asked:
        return answers
    edges = sql.Identifier(schema.name, "edges")
    for part, own, other in (("out", "payer", "payee"), ("in", "payee", "payer")):
        wanted = [(i, q.account) for i, q in enumerate(asked) if part in q.parts]
        if wanted:
            await cur.execute(
                sql.SQL(_SIDE).format(edges=edges, own=sql.Identifier(own), other=sql.Identifier(other)),
                {"accounts": [a for _, a in wanted]},
            )
            sides = _sides(await cur.fetchall())
            for k, (i, _account) in enumerate(wanted, start=1):
                answers[i][part] = sides.get(k, [])
    for (hops, _min), indexes in _grouped(asked, "cycle", lambda q: (q.hops, None)).items():
        cycles = await _cycles(cur, edges, [asked[i].account for i in indexes], hops)
        for k, i in enumerate(indexes, start=1):
            answers[i]["cycle"] = cycles[k]
    looping = [i for i, q in enumerate(asked) if "loop" in q.parts]
    if looping:
        loops = await _loops(cur, edges, [asked[i] for i in looping])
        for i, loop in zip(looping, loops, strict=True):
            answers[i]["loop"] = loop
    for (hops, min_average), indexes in _grouped(asked, "chain", lambda q: (q.hops, q.min_average)).items():
        chains = await _chains(cur, edges, [asked[i].account for i in indexes], hops, min_average)
        for k, i in enumerate(indexes, start=1):
            answers[i]["chain"] = chains[k]
    for part, query, fields in (
        ("sources", _SOURCES, ("source", "via")),
        ("co_payees", _CO_PAYEES, ("account", "shared")),
    ):
        for (_hops, min_average), indexes in _grouped(asked, part, lambda q: (None, q.min_average)).items():
            listed = await _listed(cur, query, edges, [asked[i].account for i in indexes], min_average)
            for k, i in enumerate(indexes, start=1):
                answers[i][part] = [
                    {fields[0]: name, fields[1]: list(value) if isinstance(value, list) else int(value)}
                    for name, value in listed.get(k, [])
                ]
    for i, q in enumerate(asked):
        if "neighbourhood" in q.parts:
            answers[i]["neighbourhood"] = await _neighbourhood(cur, edges, q.account, q.hops)
    return answers


def _grouped(asked: Sequence[Query], part: str, key: Any) -> dict[Any, list[int]]:
    """The indexes of the queries that ask for `part`, grouped by what one statement can share."""
    groups: dict[Any, list[int]] = {}
    for i, q in enumerate(asked):
        if part in q.parts:
            groups.setdefault(key(q), []).append(i)
    return groups
