"""Service B's store: directed payment edges between accounts, and the relations query, on PostgreSQL.

An edge is keyed (payer, payee, currency) and holds the number of payments, their exact total, the
first and last event time, and, when there are several, each payment's time and amount. Spark aggregates
each micro-batch into one row per edge (`aml_app.pipeline.transforms.edges`); `apply` adds those rows to
the stored edges and advances the applied offsets in one transaction (an `INSERT ... ON CONFLICT DO
UPDATE` from a temporary table filled by COPY).

A query with `at` is answered as of that instant: every part as if only the payments made by then had
been applied (an edge's count, total, last time and average over those), so the answer about a payment
at its own time does not depend on how far B has applied since; the detectors ask so. An edge lists its
payments for `keep` (AML_AGGREGATES_RETENTION) before a batch's newest, then folds them (`fold_edges`):
an answer as of an instant before the latest fold says `exact: false`.

`relations_many` answers, from one REPEATABLE READ snapshot and in a few statements for a whole batch:
- `out` / `in`: the account's direct counterparties, merged over currencies, sorted by counterparty;
- `neighbourhood`: accounts within `hops` edges ignoring direction (excluding the account itself), with
  their shortest distance, sorted by (hops, account);
  these three lists are bounded per call (`max_rows` of `relations_many`, `MAX_ROWS` by default): a list
  cut short says so (`truncated`), and `out` and `in` go on from a counterparty (`after`);
- `cycle`: the shortest simple directed cycle from the account back to itself with 2 to `hops` edges,
  through distinct other accounts (a self-payment moves no money between parties: it makes no cycle and
  is part of none); among equally short ones the smallest path (code-point order). With at most 3 hops a
  cycle is one join per length, which PostgreSQL answers from the primary key.
- `loop` (answered only when asked, with `closing` and `at`): the shortest cycle that a payment from
  `closing` into the account at `at` closes, if money can have gone around it in time: a path account ->
  ... -> closing of at most `loop_hops` - 1 edges through distinct accounts, each edge paid no earlier
  than the one before and within LOOP_SPAN before `at`. The search reads an edge's first and last times
  only, so an edge is taken at max(the time reached, its first payment) if its last is not earlier: exact for
  edges of one payment, and never missing a loop otherwise. Searched from both ends (`LoopSearch`: forward
  from the account, backward from the closing payer, one statement per direction and level for the
  whole batch), so each side goes about half as deep; an account in between that paid more than
  LOOP_MAX_PAYEES distinct accounts by `at` is not gone through (each write keeps those accounts, with
  the time they passed it, in `many_payees`). AMLworld's cycles run to 13 hops over days;
  B's `cycle` sees 3. {"found", "path": [account, ..., closing, account], "complete"}; `complete` is
  false when the two frontiers held more than LOOP_FRONTIER accounts and the search stopped.

The layering parts look only at *heavy* edges: an edge row (one currency) whose average payment is at
least the query's `min_average` (default 0: every edge), one amount for every currency or one per
currency (`{"USD": 1000, "EUR": 853.4}`: the same sum in each; a currency not named is never heavy), so a
detector that compares amounts in one reporting currency asks B the same question in every currency.
Laundering moves large sums through few hands; the heavy filter keeps the everyday graph of small
payments (shops, friends) out of these answers:
- `chain`: the longest flow of heavy edges that ends at the account, with at most `hops` edges: a path
  through distinct accounts along which money can have gone on, each edge's first payment no later than
  the next edge's last and each edge's average payment FLOW_RATIO (0.8-1.25) times the one before it
  (averages in units of the currency's `min_average`, so the same sum in every currency compares equal);
  with `closing`, only a flow whose last edge is closing -> account (the payment being decided); with
  `at` (its time), only edges paid within LOOP_SPAN before it. Among equally long
  ones the smallest path; `[]` when none comes in;
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

import asyncio
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from aml_app.dependencies.copy import copy_arrow
from aml_app.dependencies.store import (
    Schema,
    Sent,
    as_of_json,
    iso_text,
    money_text,
    read_meta,
    write_meta,
)

MAX_HOPS = 3
#: The parts answered when a query names none.
PARTS = ("out", "in", "neighbourhood", "cycle", "chain", "sources", "co_payees")
#: Every part a query may name: `loop` needs the closing payment's payer and time, so it is never a default.
ALL_PARTS = (*PARTS, "loop")
LOOP_MAX_HOPS = 16
LOOP_HOPS = 12
#: How far back before `at` a loop may start (AMLworld's laundering cycles span up to about a week).
LOOP_SPAN = timedelta(days=14)
EARLIEST = datetime.min.replace(tzinfo=UTC)
#: A loop does not go on through an account that paid more distinct accounts than this: a merchant or a
#: payment processor connects everyone in time, and laundering loops run through accounts of few payees.
#: The store keeps which accounts passed it, and when (`many_payees`): another value needs a migration that
#: counts them again (`count_many_payees`).
LOOP_MAX_PAYEES = 100
#: The most accounts one level of a loop search may reach before it stops (`complete` false).
LOOP_FRONTIER = 500
#: A loop search expands both of its sides in one round while neither frontier is larger than this.
LOOP_BOTH_SIDES = 16
#: At most this many `sources` and `co_payees` in an answer, the strongest first.
LISTED = 10
#: The most entries the `out` parts of one call of `relations_many` list together (edge rows: one per
#: counterparty and currency), the most its `in` parts list, and the most accounts its `neighbourhood`
#: parts list (the APIs' bound per request, `AML_API_MAX_ROWS`, by default).
MAX_ROWS = 50_000
#: A chain's edge passes money on: its average payment is this many times the edge's before it (AMLworld's
#: layering hops pass on 0.93-1.07 of what they got; an account's unrelated payments rarely match).
FLOW_RATIO = (Decimal("0.8"), Decimal("1.25"))


#: What a heavy edge is: one minimum average payment for every currency, or one per currency.
MinAverage = Decimal | Mapping[str, Decimal]


class CurrencyMinimums(Mapping[str, Decimal]):
    """A per-currency `min_average`, read-only, with its items in order kept as its key: a detector asks
    every question of a batch with the same one, and sorting it for each question's key cost B's API a
    twenty-fifth of its CPU."""

    __slots__ = ("_per", "key")

    def __init__(self, per: Mapping[str, Decimal]) -> None:
        self._per = dict(per)
        self.key = tuple(sorted(self._per.items()))

    def __getitem__(self, currency: str) -> Decimal:
        return self._per[currency]

    def __iter__(self) -> Iterator[str]:
        return iter(self._per)

    def __len__(self) -> int:
        return len(self._per)

    def __repr__(self) -> str:
        return f"CurrencyMinimums({self._per!r})"


class Query(NamedTuple):
    """One question to Service B: an account, how far to look, which parts, and what counts as heavy;
    for `loop`, the payment that would close it (its payer and time) and the longest loop; for `chain`,
    that payer and time too, if the chain must end with its edge and be paid before it; `after`, a
    counterparty: `out` and `in` list only those after it (the next page of a list cut short)."""

    account: str
    hops: int
    parts: Sequence[str]
    min_average: MinAverage = Decimal(0)
    closing: str | None = None
    at: datetime | None = None
    loop_hops: int = LOOP_HOPS
    after: str | None = None

    def key(self) -> tuple[Any, ...]:
        """The question as a hashable value, equal for two queries that ask the same: what an answer is
        kept under (cheaper than `repr`, which wrote out every currency's minimum)."""
        return (self.account, self.hops, tuple(self.parts), _heavy_key(self.min_average), *self[4:])


#: The payers among `{which}` that paid more than %(limit)s distinct other accounts, each with `since`: the
#: first payment to its (limit + 1)-th payee, from which on a loop does not go through it. Edges are only
#: ever added to, so an account in it stays, and its `since` can only move earlier.
_MANY_PAYEES = """
SELECT payer, (array_agg(first ORDER BY first))[%(limit)s::int + 1] AS since
FROM (
    SELECT e.payer, min(e.first_seen) AS first FROM {edges} e
    WHERE e.payee <> e.payer AND {which}
    GROUP BY e.payer, e.payee
) d
GROUP BY payer HAVING count(*) > %(limit)s
"""

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
        # 4: each edge of several payments holds them (`times` and `amounts`, in the same order), so that
        # an answer at an instant counts only the payments made by then (`_whole`). A row of one payment
        # keeps none: it is its first_seen and its total. A row of several written before keeps none and
        # is read whole at every instant; `aml-app rebuild relations` gives it its payments.
        """
        ALTER TABLE {schema}.edges ADD COLUMN times timestamptz[], ADD COLUMN amounts numeric[]
        """,
        # 5: the edges of several payments into an account, by their last payment. An edge is heavy as of
        # `at` by its average (found through the index by average) or, paid on both sides of `at` (so it
        # holds its payments), by its payments made by then (`_heavy`); with this index PostgreSQL finds
        # both kinds in one bitmap scan instead of reading every edge into the account. Edges of one
        # payment, almost all of them, are not in it.
        """
        CREATE INDEX edges_by_payee_last ON {schema}.edges (payee, last_seen) WHERE times IS NOT NULL
        """,
        # 6: the accounts a loop does not go through, and from when (`_MANY_PAYEES`), kept by each write
        # (`mark_many_payees`), so that a loop search looks an account up instead of counting its payees at
        # every step (a backward step from a merchant's payer asks about each of its hundreds of customers).
        """
        CREATE TABLE {schema}.many_payees (
            payer text COLLATE "C" PRIMARY KEY,
            since timestamptz NOT NULL
        );
        INSERT INTO {schema}.many_payees
        """
        + _MANY_PAYEES.replace("{edges}", "{schema}.edges")
        .replace("{which}", "true")
        .replace("%(limit)s", str(LOOP_MAX_PAYEES)),
    ],
)

#: The columns of a batch's edge rows, as Spark makes them (`times` and `amounts`: Arrow lists, null in a
#: row of one payment).
EDGE_COLUMNS = (
    *("payer", "payee", "currency", "payments", "total", "first_seen", "last_seen"),
    *("times", "amounts"),
)


def write_table(conn: psycopg.Connection, edges: Any, keep: timedelta) -> int:
    """The registry's write (`aml_app.dependency_services`): a batch's edges into the store, each edge's
    payments before the batch's newest time minus `keep` folded (`write_edges`). Returns the edge rows
    applied."""
    write_edges(conn, SCHEMA, edges, keep)
    return int(edges.num_rows)


def write_edges(conn: psycopg.Connection, schema: Schema, edges: Any, keep: timedelta | None = None) -> None:
    """Add a batch's edge rows (an Arrow table, one row per edge) to the stored edges; with `keep`, fold
    the payments of the batch's edges made before the batch's newest payment minus `keep` (`fold_edges`)."""
    if edges.num_rows == 0:
        return
    conn.execute(
        """
        CREATE TEMPORARY TABLE batch_edges (
            payer text COLLATE "C", payee text COLLATE "C", currency text COLLATE "C",
            payments bigint, total numeric, first_seen timestamptz, last_seen timestamptz,
            times timestamptz[], amounts numeric[]
        ) ON COMMIT DROP
        """
    )
    copy_arrow(conn, "batch_edges", edges, EDGE_COLUMNS, key=EDGE_COLUMNS[:3])
    # The edges that now list FOLD_FROM payments or more, the second of them before the fold's instant,
    # come back: only those may be folded (a list is in the order its batches came, near time order).
    fold = fold_instant(edges, keep)
    long_lists = conn.execute(
        sql.SQL(
            """
            WITH written AS (
            INSERT INTO {edges} AS e SELECT * FROM batch_edges
            ON CONFLICT (payer, payee, currency) DO UPDATE SET
                payments = e.payments + excluded.payments,
                total = e.total + excluded.total,
                first_seen = least(e.first_seen, excluded.first_seen),
                last_seen = greatest(e.last_seen, excluded.last_seen),
                times = CASE WHEN e.payments = 1 OR e.times IS NOT NULL THEN
                    coalesce(e.times, ARRAY[e.first_seen])
                        || coalesce(excluded.times, ARRAY[excluded.first_seen])
                    END,
                amounts = CASE WHEN e.payments = 1 OR e.times IS NOT NULL THEN
                    coalesce(e.amounts, ARRAY[e.total]) || coalesce(excluded.amounts, ARRAY[excluded.total])
                    END
            RETURNING payer, payee, currency, cardinality(times) AS listed, times[2] AS second
            )
            SELECT payer, payee, currency FROM written
            WHERE listed >= %(least)s AND second < %(fold)s::timestamptz
            """
        ).format(edges=sql.Identifier(schema.name, "edges")),
        {"least": FOLD_FROM, "fold": fold},
    ).fetchall()
    if fold is not None and long_lists:
        fold_edges(conn, schema, fold, long_lists)
    mark_many_payees(conn, schema)


# An edge row keeps each payment's time and amount so that an answer as of an instant counts the payments
# made by then; a pair that pays every day would make its row, and every write and every question about
# it, grow for as long as the store runs. So a write folds the payments of its edges made before the
# batch's newest payment minus `keep` (AML_AGGREGATES_RETENTION: how far behind its newest event time C
# answers exactly too) into the row's count and total, keeping their latest one listed: a row lists every
# payment made from the instant it was folded at, and the latest before it. An answer as of `at` counts
# what was paid after `at` and takes it from the row's count and total (`_count`, `_sum`), and finds the
# last payment by `at` among those listed (`_last`): exact for every `at` from that instant on. The store
# keeps the latest instant it folded at (meta `folded_before`); an answer as of an earlier one says
# `exact: false`. A row is folded only once it lists FOLD_FROM payments and a quarter of them can go, so
# a busy pair's row is rewritten by a fold about once in every quarter of its payments, not every batch;
# and counted only when its second listed payment is before the instant (lists grow in the order batches
# come, near time order), so a store younger than `keep` spends nothing on folds.
FOLD_FROM = 64

# Each edge asked about is found by its primary key; one is folded when a quarter of its list can go.
_FOLD = """
WITH asked AS (
    SELECT * FROM unnest(%(payers)b::text[], %(payees)b::text[], %(currencies)b::text[])
        AS k(payer, payee, currency)
), folding AS (
    SELECT e.payer, e.payee, e.currency, (
        SELECT o.i FROM unnest(e.times) WITH ORDINALITY AS o(t, i) WHERE o.t < %(fold)s
        ORDER BY o.t DESC, o.i DESC LIMIT 1
    ) AS latest
    FROM asked k JOIN {edges} e ON e.payer = k.payer AND e.payee = k.payee AND e.currency = k.currency
    WHERE 4 * (SELECT count(*) FROM unnest(e.times) AS o(t) WHERE o.t < %(fold)s) >= cardinality(e.times)
)
UPDATE {edges} AS e SET
    times = ARRAY(
        SELECT c.t FROM unnest(e.times) WITH ORDINALITY AS c(t, i)
        WHERE c.t >= %(fold)s OR c.i = f.latest ORDER BY c.i
    ),
    amounts = ARRAY(
        SELECT c.a FROM unnest(e.times, e.amounts) WITH ORDINALITY AS c(t, a, i)
        WHERE c.t >= %(fold)s OR c.i = f.latest ORDER BY c.i
    )
FROM folding f
WHERE e.payer = f.payer AND e.payee = f.payee AND e.currency = f.currency
"""


def fold_instant(edges: Any, keep: timedelta | None) -> datetime | None:
    """The batch's newest payment minus `keep`: what its edges' payments before are folded at (None: no
    `keep`, or one longer than the store's history)."""
    import pyarrow.compute as pc

    if keep is None:
        return None
    newest: datetime = pc.max(edges["last_seen"]).as_py()
    try:
        return newest - keep
    except OverflowError:
        return None


def fold_edges(
    conn: psycopg.Connection, schema: Schema, fold: datetime, listing: Sequence[Sequence[str]]
) -> None:
    """Fold the payments made before `fold` of the edges `listing` (payer, payee, currency: those that
    list FOLD_FROM or more), and record the instant in the store's meta (`folded_before`) when any row
    was folded."""
    payers, payees, currencies = (list(column) for column in zip(*listing, strict=True))
    folded = conn.execute(
        sql.SQL(_FOLD).format(edges=sql.Identifier(schema.name, "edges")),
        {"fold": fold, "payers": payers, "payees": payees, "currencies": currencies},
    ).rowcount
    if folded:
        latest = folded_before(read_meta(conn, schema))
        if latest is None or latest < fold:
            write_meta(conn, schema, {"folded_before": iso_text(fold)})


def folded_before(meta: Mapping[str, str]) -> datetime | None:
    """The latest instant the store folded edges at (from its meta; None: never): B answers as of any
    instant from it on exactly."""
    return datetime.fromisoformat(meta["folded_before"]) if "folded_before" in meta else None


def health(meta: Mapping[str, str]) -> dict[str, Any]:
    """What B's /health adds from its store's meta."""
    return {"folded_before": meta.get("folded_before")}


# A batch's payers whose `many_payees` may change: one not in it whose edge rows (over currencies and
# payees, a bound on its payees) now pass the limit, or one in it paid by the batch before its `since`
# (a payee first paid later leaves its (limit + 1)-th first payment where it is).
_BATCH_PAYERS = """
WITH batch AS (
    SELECT payer, min(first_seen) AS first FROM batch_edges WHERE payee <> payer GROUP BY payer
), changing AS (
    SELECT b.payer FROM batch b LEFT JOIN {many} m ON m.payer = b.payer
    WHERE CASE WHEN m.payer IS NULL THEN
            (SELECT count(*) FROM (SELECT FROM {edges} e WHERE e.payer = b.payer LIMIT %(limit)s + 1) n)
            > %(limit)s
        ELSE b.first < m.since END
)
"""


def mark_many_payees(conn: psycopg.Connection, schema: Schema) -> None:
    """Bring `many_payees` up to date with the batch of edges just added (`batch_edges`)."""
    many, edges = sql.Identifier(schema.name, "many_payees"), sql.Identifier(schema.name, "edges")
    conn.execute(
        sql.SQL(
            _BATCH_PAYERS
            + "INSERT INTO {many} AS m (payer, since)"
            + _MANY_PAYEES
            + "ON CONFLICT (payer) DO UPDATE SET since = excluded.since"
        ).format(many=many, edges=edges, which=sql.SQL("e.payer IN (SELECT payer FROM changing)")),
        {"limit": LOOP_MAX_PAYEES},
    )


def count_many_payees(conn: psycopg.Connection, schema: Schema) -> None:
    """Count `many_payees` again over every edge, for the current LOOP_MAX_PAYEES."""
    many, edges = sql.Identifier(schema.name, "many_payees"), sql.Identifier(schema.name, "edges")
    with conn.transaction():
        conn.execute(sql.SQL("DELETE FROM {}").format(many))
        conn.execute(
            sql.SQL("INSERT INTO {many} " + _MANY_PAYEES).format(
                many=many, edges=edges, which=sql.SQL("true")
            ),
            {"limit": LOOP_MAX_PAYEES},
        )


# --- queries --------------------------------------------------------------------------------------


def check_query(
    hops: int,
    parts: Iterable[str],
    min_average: MinAverage = Decimal(0),
    closing: str | None = None,
    at: datetime | None = None,
    loop_hops: int = LOOP_HOPS,
    after: str | None = None,
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
    if at is not None and (not isinstance(at, datetime) or at.tzinfo is None):
        raise ValueError(f"at must be an instant with a timezone, got {at!r}")
    if after is not None and not isinstance(after, str):
        raise ValueError(f"after must be an account id, got {after!r}")
    amounts = list(min_average.values()) if isinstance(min_average, Mapping) else [min_average]
    if isinstance(min_average, Mapping) and (
        not min_average or not all(isinstance(c, str) for c in min_average)
    ):
        raise ValueError(f"min_average per currency must name at least one currency, got {min_average!r}")
    if not all(isinstance(a, Decimal) and a.is_finite() and a >= 0 for a in amounts):
        raise ValueError(f"min_average must be finite Decimals >= 0, got {min_average!r}")


def _heavy_params(min_average: MinAverage) -> dict[str, Any]:
    """The parameters of `_HEAVY`: the lowest minimum (for the index), and the minimum per currency or
    the one for all."""
    if isinstance(min_average, Mapping):
        currencies = sorted(min_average)
        minimums = [min_average[c] for c in currencies]
        return {"min": min(minimums), "currencies": currencies, "minimums": minimums, "uniform": None}
    return {"min": min_average, "currencies": [], "minimums": [], "uniform": min_average}


def _heavy_key(min_average: MinAverage) -> Any:
    """`min_average` as a key for grouping queries that one statement can answer."""
    if isinstance(min_average, CurrencyMinimums):
        return min_average.key
    return tuple(sorted(min_average.items())) if isinstance(min_average, Mapping) else min_average


#: Rows an answer's Python work goes through between two yields to the event loop: a long list is
#: read and written out in slices, so that /health and other requests are served meanwhile.
SLICE = 1000


async def _rows(cur: Any) -> list[tuple[Any, ...]]:
    """The rows of the statement `cur` ran, converted SLICE at a time with a yield between two."""
    rows: list[tuple[Any, ...]] = []
    while chunk := await cur.fetchmany(SLICE):
        rows.extend(chunk)
        await asyncio.sleep(0)
    return rows


async def _sides(rows: Iterable[tuple[Any, ...]]) -> dict[int, tuple[list[dict[str, Any]], bool]]:
    """Per query index, the counterparties merged over currencies, sorted by counterparty, and whether
    the list is cut short (`_SIDE`'s rows: the query's edge rows `n`, then one row per edge row taken,
    and one more past them when it did not take all). A cut list holds whole counterparties only: the
    last one taken is left out when the row past the cut is another of its currencies."""
    merged: dict[int, dict[str, dict[str, Any]]] = {}
    sizes: dict[int, int] = {}
    taken: dict[int, int] = {}
    peeked: dict[int, str] = {}
    for k, (i, n, take, counterparty, currency, payments, total, first, last) in enumerate(rows, 1):
        if k % SLICE == 0:
            await asyncio.sleep(0)
        by_name = merged.setdefault(i, {})
        sizes[i] = n
        if counterparty is None:
            continue
        if taken.get(i, 0) == take:
            peeked[i] = counterparty  # the row past the cut
            continue
        taken[i] = taken.get(i, 0) + 1
        entry = by_name.setdefault(
            counterparty, {"count": 0, "totals": {}, "first_seen": first, "last_seen": last}
        )
        entry["count"] += payments
        entry["totals"][currency] = entry["totals"].get(currency, Decimal(0)) + total
        entry["first_seen"] = min(entry["first_seen"], first)
        entry["last_seen"] = max(entry["last_seen"], last)
    listed: dict[int, tuple[list[dict[str, Any]], bool]] = {}
    for i, by_name in merged.items():
        cut = taken.get(i, 0) < sizes[i]
        if cut and by_name and peeked.get(i) == max(by_name):
            del by_name[max(by_name)]
        entries = []
        for k, (name, e) in enumerate(sorted(by_name.items()), 1):
            if k % SLICE == 0:
                await asyncio.sleep(0)
            entries.append(
                {
                    "counterparty": name,
                    "count": e["count"],
                    "totals": {c: money_text(e["totals"][c]) for c in sorted(e["totals"])},
                    "first_seen": e["first_seen"],
                    "last_seen": e["last_seen"],
                }
            )
        listed[i] = (entries, cut)
    return listed


# --- an edge row as of an instant ------------------------------------------------------------------
# A query's `at` (NULL: none) cuts every edge row it reads: the row counts only the payments made by then.
# A row last paid by then (or of one payment) is read whole, straight from its columns; only a row with
# payments on both sides of `at` unpacks its `times` and `amounts`. An answer at `at` is so the answer over
# the payments up to `at`, however far the store has gone on: what makes a decision replay identically.


def _paid(e: str, at: str = "q.at") -> str:
    """Edge row `e` has a payment made by `at`."""
    return f"({at} IS NULL OR {e}.first_seen <= {at})"


def _whole(e: str, at: str) -> str:
    return f"({at} IS NULL OR {e}.last_seen <= {at} OR {e}.times IS NULL)"


def _count(e: str, at: str = "q.at") -> str:
    """The number of payments on `e` made by `at` (of a row that `_paid` holds for): its count less those
    listed after `at` (a folded row lists every payment after the instant it was folded at)."""
    return (
        f"(CASE WHEN {_whole(e, at)} THEN {e}.payments "
        f"ELSE {e}.payments - (SELECT count(*) FROM unnest({e}.times) AS c(t) WHERE c.t > {at}) END)"
    )


def _sum(e: str, at: str = "q.at") -> str:
    """Their total."""
    return (
        f"(CASE WHEN {_whole(e, at)} THEN {e}.total ELSE {e}.total - (SELECT coalesce(sum(c.a), 0) "
        f"FROM unnest({e}.times, {e}.amounts) AS c(t, a) WHERE c.t > {at}) END)"
    )


def _last(e: str, at: str = "q.at") -> str:
    """The last of them (a row folded after `at` may list none of them: then its first, in an answer
    that says it is not exact)."""
    return (
        f"(CASE WHEN {_whole(e, at)} THEN {e}.last_seen "
        f"ELSE (SELECT coalesce(max(c.t), {e}.first_seen) FROM unnest({e}.times) AS c(t) "
        f"WHERE c.t <= {at}) END)"
    )


# Every statement below takes its lists as binary parameters (`%(name)b`): psycopg writes a text array
# element by element in Python, 8.3 µs per timestamp and 1.5 per account id, against 0.5 and 0.4 in
# binary, and a batch's loop searches send thousands of them per round.

# An instant as `store.iso_text` writes it, written by the server: parsing each timestamptz and formatting
# it in Python took a sixth of B's Python CPU for a detector's batches. A side's first and last times
# merge over currencies as text, which orders as time does (UTC, fixed width).
_ISO = 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'

# The edge rows of each query's account on one side (out: it pays; in: it is paid), as of the query's
# `at` and past its `after` (a counterparty, for the next page of a list cut short), in (counterparty,
# currency) order, while the request's budget of %(rows)s rows lasts: in query order, each query takes all
# of its rows or what is left. `budget` goes through the queries one by one: it counts each one's rows,
# at most one more than the budget left (then it has more than there is room for), so a statement reads
# at most the budget and one row per query, whatever the accounts hold; `take` is the query's share. The
# rows fetched are what it takes, and one more past them when that is not all (it says whether the last
# counterparty taken has more currencies); none for a query that takes nothing (on the `in` side they
# would be sorted to be found). Each query's first row carries its count `n` and its share `take`; a
# query that takes nothing has one row of NULLs.
_SIDE_QUERY = """SELECT (%(accounts)b::text[])[{i}] AS account, (%(ats)b::timestamptz[])[{i}] AS at,
        (%(afters)b::text[])[{i}] AS after"""
_SIDE_ROWS = f"""SELECT * FROM {{edges}} e WHERE e.{{own}} = q.account COLLATE "C" AND {_paid("e")}
        AND (q.after IS NULL OR e.{{other}} > q.after COLLATE "C")"""
_SIDE = f"""
WITH RECURSIVE budget(i, n, take, left_) AS (
    SELECT 0::bigint, 0::bigint, 0::bigint, %(rows)s::bigint
    UNION ALL
    SELECT b.i + 1, c.n, least(c.n, b.left_), b.left_ - least(c.n, b.left_)
    FROM budget b
    CROSS JOIN LATERAL ({_SIDE_QUERY.format(i="b.i + 1")}) q
    CROSS JOIN LATERAL (SELECT count(*) AS n FROM ({_SIDE_ROWS}
        LIMIT b.left_ + 1) s) c
    WHERE b.i < cardinality(%(accounts)b::text[])
)
SELECT b.i, b.n, b.take, e.{{other}}, e.currency, {_count("e")}, {_sum("e")},
    to_char(e.first_seen AT TIME ZONE 'UTC', '{_ISO}'), to_char({_last("e")} AT TIME ZONE 'UTC', '{_ISO}')
FROM budget b
CROSS JOIN LATERAL ({_SIDE_QUERY.format(i="b.i")}) q
LEFT JOIN LATERAL ({_SIDE_ROWS}
    ORDER BY e.{{other}}, e.currency LIMIT CASE WHEN b.take > 0 THEN b.take + (b.take < b.n)::int ELSE 0 END
) e ON true
WHERE b.i > 0
ORDER BY b.i, e.{{other}}, e.currency
"""

# The shortest simple cycle through each account, for lengths 2 and 3 (NULL where there is none): the
# smallest path of each length, in code-point order, through distinct accounts other than the asked one
# (a self-payment makes no cycle). Each length is a join along out-edges that ends with a primary-key
# lookup of the edge back to the account.
_CYCLES = f"""
SELECT q.i,
    (SELECT min(e1.payee) FROM {{edges}} e1
        JOIN {{edges}} e2 ON e2.payer = e1.payee AND e2.payee = q.account
        WHERE e1.payer = q.account AND e1.payee <> q.account AND %(hops)s >= 2
            AND {_paid("e1")} AND {_paid("e2")}) AS two,
    (SELECT ARRAY[e1.payee, e2.payee] FROM {{edges}} e1
        JOIN {{edges}} e2 ON e2.payer = e1.payee
        JOIN {{edges}} e3 ON e3.payer = e2.payee AND e3.payee = q.account
        WHERE e1.payer = q.account AND %(hops)s >= 3
            AND e1.payee <> q.account AND e2.payee <> q.account AND e2.payee <> e1.payee
            AND {_paid("e1")} AND {_paid("e2")} AND {_paid("e3")}
        ORDER BY e1.payee, e2.payee LIMIT 1) AS three
FROM unnest(%(accounts)b::text[], %(ats)b::timestamptz[]) WITH ORDINALITY AS q(account, at, i)
"""

# The accounts one edge away from a frontier (either direction, paid by `at`) that are not among `seen`,
# the first %(limit)s in code-point order.
_NEIGHBOURS = """
SELECT n.account FROM (
    (SELECT payee AS account FROM {edges} WHERE payer = ANY(%(frontier)b::text[])
        AND (%(at)s::timestamptz IS NULL OR first_seen <= %(at)s::timestamptz)
    UNION
    SELECT payer FROM {edges} WHERE payee = ANY(%(frontier)b::text[])
        AND (%(at)s::timestamptz IS NULL OR first_seen <= %(at)s::timestamptz))
    EXCEPT
    SELECT unnest(%(seen)b::text[]) COLLATE "C"
) n
ORDER BY n.account LIMIT %(limit)s
"""

# Whether a frontier has any such account: what a neighbourhood with no room left needs to know (whether
# it is cut short), without reading every neighbour of the frontier to sort them.
_ANY_NEIGHBOUR = """
SELECT EXISTS (SELECT FROM {edges} WHERE payer = ANY(%(frontier)b::text[])
        AND (%(at)s::timestamptz IS NULL OR first_seen <= %(at)s::timestamptz)
        AND payee NOT IN (SELECT unnest(%(seen)b::text[]) COLLATE "C"))
    OR EXISTS (SELECT FROM {edges} WHERE payee = ANY(%(frontier)b::text[])
        AND (%(at)s::timestamptz IS NULL OR first_seen <= %(at)s::timestamptz)
        AND payer NOT IN (SELECT unnest(%(seen)b::text[]) COLLATE "C"))
"""

# A heavy edge row `e` as of the query's `at`: average payment >= the minimum of its currency
# (%(uniform)s for every currency, or the one `array_position` finds; none: NULL, never heavy). The first
# test, against the lowest minimum, can use the expression index edges_by_payee for a row read whole (a
# row cut at `at` has another average, and edges_by_payee_last finds those rows); the second is the exact
# one (numeric division rounds, multiplication does not).
_HEAVY = (
    "{paid} AND (({e}.total / {e}.payments) >= %(min)s OR NOT {whole}) AND {total} >= coalesce("
    "(%(minimums)b::numeric[])[array_position(%(currencies)b::text[], {e}.currency::text)], %(uniform)s)"
    " * {count}"
)


def _heavy(*aliases: str) -> str:
    return " AND ".join(
        _HEAVY.format(e=e, paid=_paid(e), whole=_whole(e, "q.at"), total=_sum(e), count=_count(e))
        for e in aliases
    )


# A heavy edge row's unit: its currency's minimum when each currency has one, else 1 (one minimum for
# all: averages compare as they are). Averages divided by their units compare across currencies.
_UNIT = "coalesce((%(minimums)b::numeric[])[array_position(%(currencies)b::text[], {e}.currency::text)], 1)"


def _recent(*aliases: str) -> str:
    """With the query's `at`, an edge row takes part in a flow only if it was paid within LOOP_SPAN
    before `at` (its payments after `at` are not there: a later payment cannot have carried this
    payment's money)."""
    return " AND ".join(f"(q.at IS NULL OR {_last(e)} >= q.at - %(span)s)" for e in aliases)


def _flows(before: str, after: str) -> str:
    """Money paid on edge row `before` can have gone on along `after`: `before`'s first payment is no
    later than `after`'s last, and `after`'s average is FLOW_RATIO times `before`'s (in units)."""
    on, back = (
        f"{_sum(after)} * {_count(before)} * {_UNIT.format(e=before)}",
        f"{_sum(before)} * {_count(after)} * {_UNIT.format(e=after)}",
    )
    return f"{before}.first_seen <= {_last(after)} AND {on} >= %(low)s * {back} AND {on} <= %(high)s * {back}"


# The longest flow of heavy edge rows into each account, for each length up to 3 (NULL where there is
# none): a simple path along which money can have gone on (`_flows`), through a query's `closing` last
# when it names one, of edges paid within LOOP_SPAN before its `at` when it names one (`_recent`); the
# smallest of each length, as the accounts before the asked one. `{last}` is the last edge's condition:
# one statement answers the queries that name `closing` (`_PINNED`: the edge closing -> account, found by
# the primary key) and another those that do not (`_OPEN`). One condition for both (closing IS NULL OR
# payer = closing) makes PostgreSQL read every edge into the account for each length: 15 times slower
# for a payee that hundreds pay.
_CHAINS = f"""
SELECT q.i,
    (SELECT min(e3.payer) FROM {{edges}} e3
        WHERE e3.payee = q.account AND e3.payer <> q.account AND {_heavy("e3")} AND {_recent("e3")}
            AND {{last}}) AS one,
    (SELECT ARRAY[e2.payer, e3.payer] FROM {{edges}} e3
        JOIN {{edges}} e2 ON e2.payee = e3.payer
        WHERE e3.payee = q.account AND %(hops)s >= 2 AND {_heavy("e3", "e2")} AND {_recent("e3", "e2")}
            AND {{last}}
            AND e3.payer <> q.account AND e2.payer <> q.account AND e2.payer <> e3.payer
            AND {_flows("e2", "e3")}
        ORDER BY e2.payer, e3.payer LIMIT 1) AS two,
    (SELECT ARRAY[e1.payer, e2.payer, e3.payer] FROM {{edges}} e3
        JOIN {{edges}} e2 ON e2.payee = e3.payer
        JOIN {{edges}} e1 ON e1.payee = e2.payer
        WHERE e3.payee = q.account AND %(hops)s >= 3 AND {_heavy("e3", "e2", "e1")}
            AND {_recent("e3", "e2", "e1")} AND {{last}}
            AND e3.payer <> q.account AND e2.payer <> q.account AND e1.payer <> q.account
            AND e2.payer <> e3.payer AND e1.payer <> e3.payer AND e1.payer <> e2.payer
            AND {_flows("e2", "e3")} AND {_flows("e1", "e2")}
        ORDER BY e1.payer, e2.payer, e3.payer LIMIT 1) AS three
FROM unnest(%(accounts)b::text[], %(closings)b::text[], %(ats)b::timestamptz[])
    WITH ORDINALITY AS q(account, closing, at, i)
"""

_SOURCES = f"""
SELECT q.i, s.source, s.via
FROM unnest(%(accounts)b::text[], %(ats)b::timestamptz[]) WITH ORDINALITY AS q(account, at, i)
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
FROM unnest(%(accounts)b::text[], %(ats)b::timestamptz[]) WITH ORDINALITY AS q(account, at, i)
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


_PINNED = sql.SQL("e3.payer = q.closing")
_OPEN = sql.SQL("q.closing IS NULL")


async def _send_chains(
    sent: Sent,
    edges: sql.Composable,
    accounts: list[str],
    closings: list[str | None],
    ats: list[datetime | None],
    hops: int,
    min_average: MinAverage,
) -> Any:
    """Send the `chain` part of queries that all name a `closing`, or all name none."""
    low, high = FLOW_RATIO
    pinned = closings[0] is not None
    assert all((c is not None) == pinned for c in closings), "closing named by some queries only"
    return await sent.send(
        sql.SQL(_CHAINS).format(edges=edges, last=_PINNED if pinned else _OPEN),
        {
            "accounts": accounts,
            "closings": closings,
            "ats": ats,
            "span": LOOP_SPAN,
            "hops": hops,
            "low": low,
            "high": high,
            **_heavy_params(min_average),
        },
    )


async def _read_chains(cur: Any, accounts: list[str]) -> dict[int, list[str]]:
    found = {}
    for i, one, two, three in await cur.fetchall():
        before = three or two or ([one] if one is not None else [])
        found[i] = [*before, accounts[i - 1]] if before else []
    return found


async def _send_listed(
    sent: Sent,
    query: str,
    edges: sql.Composable,
    accounts: list[str],
    ats: list[datetime | None],
    min_average: MinAverage,
) -> Any:
    return await sent.send(
        sql.SQL(query).format(edges=edges), {"accounts": accounts, "ats": ats, **_heavy_params(min_average)}
    )


async def _read_listed(cur: Any) -> dict[int, list[tuple[Any, Any]]]:
    found: dict[int, list[tuple[Any, Any]]] = {}
    for i, name, value in await cur.fetchall():
        found.setdefault(i, []).append((name, value))
    return found


async def _send_cycles(
    sent: Sent, edges: sql.Composable, accounts: list[str], ats: list[datetime | None], hops: int
) -> Any:
    return await sent.send(
        sql.SQL(_CYCLES).format(edges=edges), {"accounts": accounts, "ats": ats, "hops": hops}
    )


async def _read_cycles(cur: Any, accounts: list[str]) -> dict[int, dict[str, Any]]:
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


# The frontier of a round of loop searches: (search, account, time) with each search's payee (where its
# loop starts) and closing payer. An account in between passes only if it had paid at most
# LOOP_MAX_PAYEES distinct accounts by the search's `at` (`many_payees`).
_FRONTIER = """
WITH f AS (
    SELECT * FROM unnest(%(searches)b::int[], %(accounts)b::text[], %(times)b::timestamptz[],
        %(ats)b::timestamptz[], %(payees)b::text[], %(payers)b::text[]) AS f(k, account, t, at, payee, payer)
)
"""
_FEW_PAYEES = """
NOT EXISTS (SELECT FROM {many} m WHERE m.payer = {account} AND m.since <= {at})
"""

# Forward: from each frontier account (the time money reached it), the accounts its out-edges reach in
# time, with the earliest time each is reached (over the edge's currencies). An edge counts if it was
# paid at or before `at`, last paid (by `at`) no earlier than the time reached, and leads to another
# account than the payee.
_LOOP_FORWARD = (
    _FRONTIER
    + f"""
SELECT f.k, f.account, e.payee, min(greatest(f.t, e.first_seen))
FROM f JOIN {{edges}} e ON e.payer = f.account COLLATE "C"
WHERE {_last("e", "f.at")} >= f.t AND e.first_seen <= f.at AND e.payee <> e.payer AND e.payee <> f.payee
    AND (f.account = f.payee OR """
    + _FEW_PAYEES.format(many="{many}", account="f.account", at="f.at")
    + """)
GROUP BY f.k, f.account, e.payee
"""
)

# Backward: from each frontier account (the latest time money may be there and still reach the closing
# payer by `at`), the accounts whose out-edges into it keep that possible, with the latest time each may
# hold the money (over the edge's currencies). An edge counts if its first payment is no later than that
# time and its last within the span, and comes from another account than the closing payer.
_LOOP_BACKWARD = (
    _FRONTIER
    + f""", steps AS (
    SELECT f.k, f.account, e.payer AS source, f.payee, f.at, max(least(f.t, {_last("e", "f.at")})) AS latest
    FROM f JOIN {{edges}} e ON e.payee = f.account COLLATE "C"
    WHERE e.first_seen <= f.t AND {_last("e", "f.at")} >= f.at - %(span)s AND e.payer <> e.payee
        AND e.payer <> f.payer
    GROUP BY f.k, f.account, e.payer, f.payee, f.at
)
SELECT s.k, s.account, s.source, s.latest FROM steps s
WHERE s.source = s.payee OR """
    + _FEW_PAYEES.format(many="{many}", account="s.source", at="s.at")
)

#: A label of an account in one direction of a search: its level, the time (earliest reached forward,
#: latest to leave backward), and the path that gives it (from the start, or to the closing payer).
Label = tuple[int, datetime, tuple[str, ...]]


class LoopSearch:
    """One `loop` question, searched from both ends (the payee forward, the closing payer backward) one
    level at a time (`sides`). A label is kept only if it beats, in time, every label of its account at
    its level or below (a later arrival, or an earlier last departure, reaches nothing the better one
    does not); a path is found where a forward label arrives no later than a backward label of the same
    account may leave. Once the two sides' levels add up to the found path's length, no shorter one is
    left: every shorter path meets at a level already reached. Once either side's frontier is empty, that
    side has labelled every account it reaches in time, the other end among them (where it meets the
    other side's first label): every loop there is has been found, the shortest at its lowest level. The
    shortest is simple, since cutting a repeated account out would give a shorter one."""

    def __init__(self, query: Query) -> None:
        assert query.at is not None and query.closing is not None
        self.query = query
        # No payment is older than the first instant there is (the contract's ts starts in year 1).
        start = query.at - LOOP_SPAN if query.at - EARLIEST > LOOP_SPAN else EARLIEST
        self.labels: dict[str, dict[str, list[Label]]] = {
            "forward": {query.account: [(0, start, (query.account,))]},
            "backward": {query.closing: [(0, query.at, (query.closing,))]},
        }
        #: Per direction and account, the best time of its labels: a new label must beat it.
        self.best: dict[str, dict[str, datetime]] = {
            "forward": {query.account: start},
            "backward": {query.closing: query.at},
        }
        # A side never goes on from the other's start: the payee forward, the closing payer backward.
        self.ends = {"forward": query.closing, "backward": query.account}
        self.frontiers = {"forward": [query.account], "backward": [query.closing]}
        self.levels = {"forward": 0, "backward": 0}
        self.found: tuple[str, ...] | None = None
        self.complete = True
        if query.closing == query.account:  # a self-payment closes no cycle: it moves no money
            self.frontiers = {"forward": [], "backward": []}

    @property
    def done(self) -> bool:
        best = len(self.found) - 1 if self.found else self.query.loop_hops - 1
        return sum(self.levels.values()) >= best or not all(self.frontiers.values())

    def sides(self) -> list[str]:
        """The directions to expand next. First forward alone: the payee pays few accounts as a rule, and
        a search whose forward side dies there is done without reading the closing payer's payers (a
        merchant's are hundreds). Then both while neither frontier holds more than LOOP_BOTH_SIDES
        accounts (a round trip to the server costs more than a small step), else the smaller one."""
        if self.levels["forward"] == 0:
            return ["forward"]
        if all(len(f) <= LOOP_BOTH_SIDES for f in self.frontiers.values()):
            return ["forward", "backward"]
        return [min(("forward", "backward"), key=lambda d: len(self.frontiers[d]))]

    def asked(self, direction: str) -> list[tuple[str, datetime]]:
        """(account, time) of each frontier account's label at this level, to expand."""
        labels, level = self.labels[direction], self.levels[direction]
        return [(a, next(t for n, t, _ in labels[a] if n == level)) for a in self.frontiers[direction]]

    def advance(self, direction: str, steps: Iterable[tuple[str, str, datetime]]) -> None:
        """Take the steps (from, to, time) out of the frontier as the next level of `direction`."""
        forward = direction == "forward"
        mine, best = self.labels[direction], self.best[direction]
        other = self.labels["backward" if forward else "forward"]
        level = self.levels[direction]
        paths: dict[str, tuple[str, ...]] = {}  # each source's path at this level, looked up once

        new: dict[str, Label] = {}
        for source, target, when in steps:
            known = best.get(target)
            if known is not None and (known <= when if forward else known >= when):
                continue  # a label of the target reaches it as early (forward) or leaves as late
            head = paths.get(source)
            if head is None:
                head = paths[source] = next(p for n, _, p in mine[source] if n == level)
            path = (*head, target)
            old = new.get(target)
            if old is None or (
                (when <= old[1] if forward else when >= old[1]) and (when != old[1] or path < old[2])
            ):
                new[target] = (level + 1, when, path)
        for target, label in new.items():
            mine.setdefault(target, []).append(label)
            best[target] = label[1]  # it beat every label the target had
            for _, t, path in other.get(target, []):
                arrives, leaves = (label[1], t) if forward else (t, label[1])
                if arrives <= leaves:
                    self._meet(*((label[2], path) if forward else (path, label[2])))
        self.levels[direction] = level + 1
        self.frontiers[direction] = sorted(a for a in new if a != self.ends[direction])
        if sum(len(f) for f in self.frontiers.values()) > LOOP_FRONTIER:
            self.complete = False
            self.frontiers = {"forward": [], "backward": []}

    def _meet(self, head: tuple[str, ...], tail: tuple[str, ...]) -> None:
        """A path payee ... m (`head`, forward) joined to m ... closing payer (`tail`, built backward)."""
        path = (*head, *reversed(tail[:-1]))
        if len(path) <= self.query.loop_hops and (
            self.found is None or (len(path), path) < (len(self.found), self.found)
        ):
            self.found = path

    def answer(self) -> dict[str, Any]:
        """The `loop` part: the path found (with the payee again at its end), and whether the search ran
        to its end."""
        path = [*self.found, self.query.account] if self.found is not None else []
        return {"found": self.found is not None, "path": path, "complete": self.complete}


async def _loops(
    sent: Sent, edges: sql.Composable, many: sql.Composable, asked: Sequence[Query]
) -> list[dict[str, Any]]:
    """The `loop` part of each query (see the module docstring): every unfinished search takes a step
    per round on one side or both (`LoopSearch.sides`), in one statement per direction for the whole
    batch; a round's statements go to the server together, its first with whatever `sent` holds unread."""
    searches = [LoopSearch(q) for q in asked]
    while going := [(k, d) for k, s in enumerate(searches) if not s.done for d in s.sides()]:
        round_ = []
        for direction, statement in (("forward", _LOOP_FORWARD), ("backward", _LOOP_BACKWARD)):
            moving = [k for k, d in going if d == direction]
            if not moving:
                continue
            rows = [(k, a, t) for k in moving for a, t in searches[k].asked(direction)]
            cur = await sent.send(
                sql.SQL(statement).format(edges=edges, many=many),
                {
                    "searches": [k for k, _, _ in rows],
                    "accounts": [a for _, a, _ in rows],
                    "times": [t for _, _, t in rows],
                    "ats": [asked[k].at for k, _, _ in rows],
                    "payees": [asked[k].account for k, _, _ in rows],
                    "payers": [asked[k].closing for k, _, _ in rows],
                    "span": LOOP_SPAN,
                },
            )
            round_.append((direction, moving, cur))
        for direction, moving, cur in round_:
            steps: dict[int, list[tuple[str, str, datetime]]] = {k: [] for k in moving}
            for k, source, target, when in await cur.fetchall():
                steps[k].append((source, target, when))
            for k in moving:
                if not searches[k].done:  # its forward step may have found the shortest loop
                    searches[k].advance(direction, sorted(steps[k]))
    return [s.answer() for s in searches]


async def _neighbourhood(
    cur: Any, edges: sql.Composable, account: str, hops: int, at: datetime | None, room: int
) -> tuple[list[dict[str, Any]], bool]:
    """The accounts within `hops` edges of `account`, by (hops, account), at most `room` of them, and
    whether that cut the list short (then it is the start of the whole list: every nearer level, and
    the first accounts of the one it stops in)."""
    distance = {account: 0}
    frontier = [account]
    cut = False
    for step in range(1, hops + 1):
        if not frontier:
            break
        left = room - (len(distance) - 1)
        asked = {"frontier": frontier, "at": at, "seen": list(distance), "limit": left + 1}
        if left == 0:
            await cur.execute(sql.SQL(_ANY_NEIGHBOUR).format(edges=edges), asked)
            row = await cur.fetchone()
            cut = bool(row and row[0])
            break
        await cur.execute(sql.SQL(_NEIGHBOURS).format(edges=edges), asked)
        frontier = [a for (a,) in await cur.fetchall()]
        if len(frontier) > left:
            frontier, cut = frontier[:left], True
        for name in frontier:
            distance[name] = step
        if cut:
            break
    del distance[account]
    listed = [
        {"account": a, "hops": d} for a, d in sorted(distance.items(), key=lambda item: (item[1], item[0]))
    ]
    return listed, cut


async def relations_many(
    cur: Any,
    schema: Schema | None,
    queries: Sequence[Sequence[Any]],
    as_of: Mapping[int, int],
    log: str | None = None,
    max_rows: int = MAX_ROWS,
    folded: datetime | None = None,
) -> list[dict[str, Any]]:
    """Answers for several queries (`Query`, or (account, hops, parts) tuples), inside the caller's read
    snapshot (cursor `cur`).

    `as_of` is the store's applied offsets and `log` the log they are of (its meta `log`; None for a store
    that records none), both read in the same snapshot; a store without tables answers every query empty
    (the caller passes `schema` None then). `folded`: the instant the store last folded edges at
    (`folded_before`); an answer as of an earlier instant says `"exact": false` (others say nothing).

    The lists are bounded by `max_rows` for the whole call: the `out` parts list at most that many edge
    rows (one per counterparty and currency) together, the `in` parts as many, and the `neighbourhood`
    parts at most that many accounts together, taken by the queries in order (the first query takes all
    it has, up to the bound; the next what is left; ...); reading the `out` parts reads at most that
    many rows and one more per query, the `in` parts and the neighbourhood every edge of the account (or
    the frontier), sorted to be cut (docs/pipeline.md). A part cut short lists the start of its whole
    answer (whole counterparties only) and is named in the answer's `truncated`, with how many entries
    it lists (`{"out": 1000}`); an answer with nothing cut short has no `truncated`. A query's `after`
    gives the next page of its `out` and `in`: the counterparties after the last one listed.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows!r}")
    asked = [Query(*q) for q in queries]
    for q in asked:
        check_query(q.hops, q.parts, q.min_average, q.closing, q.at, q.loop_hops, q.after)
    answers = []
    for q in asked:
        answer: dict[str, Any] = {
            "account": q.account,
            "hops": q.hops,
            "as_of": as_of_json(as_of),
            "log": log,
        }
        if folded is not None and q.at is not None and q.at < folded:
            answer["exact"] = False
        for part in ALL_PARTS:
            if part in q.parts:
                answer[part] = {"found": False, "path": []} if part == "cycle" else []
        if "loop" in q.parts:
            answer["loop"] = {"found": False, "path": [], "complete": True}
        answers.append(answer)
    if schema is None or not asked:
        return answers
    edges = sql.Identifier(schema.name, "edges")
    async with Sent(cur.connection) as sent:
        many = sql.Identifier(schema.name, "many_payees")
        await _every_part_but_neighbourhood(sent, edges, many, asked, answers, max_rows)
    room = max_rows
    for i, q in enumerate(asked):
        if "neighbourhood" in q.parts:
            near, cut = await _neighbourhood(cur, edges, q.account, q.hops, q.at, room)
            answers[i]["neighbourhood"] = near
            room -= len(near)
            if cut:
                answers[i].setdefault("truncated", {})["neighbourhood"] = len(near)
    for answer in answers:
        if "truncated" in answer:  # in the order of the parts
            answer["truncated"] = {p: answer["truncated"][p] for p in PARTS if p in answer["truncated"]}
    return answers


async def _every_part_but_neighbourhood(
    sent: Sent,
    edges: sql.Composable,
    many: sql.Composable,
    asked: Sequence[Query],
    answers: list[dict[str, Any]],
    max_rows: int,
) -> None:
    """Fill in every part but `neighbourhood`: one statement per part (and group of queries that can
    share it) for the whole batch, all sent before any is read, so that in a snapshot they and the loop
    searches' first round cost one wait for the server."""
    sides = []
    for part, own, other in (("out", "payer", "payee"), ("in", "payee", "payer")):
        wanted = [(i, q.account) for i, q in enumerate(asked) if part in q.parts]
        if wanted:
            cur = await sent.send(
                sql.SQL(_SIDE).format(edges=edges, own=sql.Identifier(own), other=sql.Identifier(other)),
                {
                    "accounts": [a for _, a in wanted],
                    "ats": [asked[i].at for i, _ in wanted],
                    "afters": [asked[i].after for i, _ in wanted],
                    "rows": max_rows,
                },
            )
            sides.append((part, wanted, cur))
    cycles = []
    for (hops, _min), indexes in _grouped(asked, "cycle", lambda q: (q.hops, None)).items():
        accounts = [asked[i].account for i in indexes]
        cur = await _send_cycles(sent, edges, accounts, [asked[i].at for i in indexes], hops)
        cycles.append((indexes, accounts, cur))
    chains = []
    for (hops, _key, _pinned), indexes in _grouped(
        asked, "chain", lambda q: (q.hops, _heavy_key(q.min_average), q.closing is not None)
    ).items():
        accounts = [asked[i].account for i in indexes]
        cur = await _send_chains(
            sent,
            edges,
            accounts,
            [asked[i].closing for i in indexes],
            [asked[i].at for i in indexes],
            hops,
            asked[indexes[0]].min_average,
        )
        chains.append((indexes, accounts, cur))
    listed = []
    for part, query, fields in (
        ("sources", _SOURCES, ("source", "via")),
        ("co_payees", _CO_PAYEES, ("account", "shared")),
    ):
        for (_hops, _key), indexes in _grouped(
            asked, part, lambda q: (None, _heavy_key(q.min_average))
        ).items():
            cur = await _send_listed(
                sent,
                query,
                edges,
                [asked[i].account for i in indexes],
                [asked[i].at for i in indexes],
                asked[indexes[0]].min_average,
            )
            listed.append((part, fields, indexes, cur))
    looping = [i for i, q in enumerate(asked) if "loop" in q.parts]
    if looping:
        loops = await _loops(sent, edges, many, [asked[i] for i in looping])
        for i, loop in zip(looping, loops, strict=True):
            answers[i]["loop"] = loop
    for part, wanted, cur in sides:
        by_query = await _sides(await _rows(cur))
        for k, (i, _account) in enumerate(wanted, start=1):
            answers[i][part], cut = by_query.get(k, ([], False))
            if cut:
                answers[i].setdefault("truncated", {})[part] = len(answers[i][part])
    for indexes, accounts, cur in cycles:
        found = await _read_cycles(cur, accounts)
        for k, i in enumerate(indexes, start=1):
            answers[i]["cycle"] = found[k]
    for indexes, accounts, cur in chains:
        flows = await _read_chains(cur, accounts)
        for k, i in enumerate(indexes, start=1):
            answers[i]["chain"] = flows[k]
    for part, fields, indexes, cur in listed:
        rows = await _read_listed(cur)
        for k, i in enumerate(indexes, start=1):
            answers[i][part] = [
                {fields[0]: name, fields[1]: list(value) if isinstance(value, list) else int(value)}
                for name, value in rows.get(k, [])
            ]


def _grouped(asked: Sequence[Query], part: str, key: Any) -> dict[Any, list[int]]:
    """The indexes of the queries that ask for `part`, grouped by what one statement can share."""
    groups: dict[Any, list[int]] = {}
    for i, q in enumerate(asked):
        if part in q.parts:
            groups.setdefault(key(q), []).append(i)
    return groups
