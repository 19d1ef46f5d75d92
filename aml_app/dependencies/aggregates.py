"""Service C's store: per-minute flows of payments over event time, and the windowed aggregates query.

Windows at an instant come from pre-aggregated per-minute buckets (the flows) plus the exact payments at
the window's edges (the idea of TimescaleDB's real-time continuous aggregates):

- `flows(payer, bucket, payee, currency)`: per minute of event time, the payments from payer to payee in
  one currency: how many, their exact total, how many were near the reporting threshold, the payments
  themselves (`times` and `amounts`, in the same order; none in a row of one payment, which is its
  `first_ts` and `total`) and the first and last of those times. Spark builds one row per key for each
  micro-batch (`aml_app.pipeline.transforms.flows`); the store adds them up. A payment is in one row,
  read from the payer's side through the primary key and from the payee's side through `flows_by_payee`.
  Schema version 1 kept one row per side (`buckets`: twice the rows to write), version 2 every payment
  once more in a table of its own with two indexes of its own (`payments`: three index entries more per
  payment to write, for what the flow rows already hold).

A window (at - w, at] is the flows that lie wholly inside it plus the payments of the two partial minutes
at its ends, read from those minutes' flow rows, so an answer reads one range of flow rows per account and
direction and unpacks only the rows that a window's edge cuts in two: exact, and equal to a computation
over every payment (aml_app/training/reference.py), without scanning every payment of a busy account.

Too-late rule: the store keeps `max_event_ts`, the largest ts applied so far. When a batch is applied,
max_event_ts first rises to include the whole batch; then every payment of the batch whose minute starts
before `max_event_ts - 7 days` (its ts < the start of that minute) is too late: not stored, counted in
`late_dropped`. Late payments inside the horizon are stored and do count. Whenever that minute boundary
moves, flows before `max_event_ts - 7 d - keep` (its minute; keep: `AML_AGGREGATES_RETENTION`, a day by
default) are pruned and the store records that minute if it deleted any (`pruned_before`), so answers
are exact for every `at >= max_event_ts - keep`: a partition of C may lag, or a replay run, that far
behind without changing an answer. An answer whose week reaches before `pruned_before` says
`exact: false`.

A self-payment (payer = payee) moves no money between parties: it is stored (both of its sides are the
one account) but no window counts it as sent or received.

Near the threshold: `threshold * (1 - band) <= amount < threshold`, counted over payments sent in 24 h.
Both numbers are part of the store (`meta`): the flows were counted with them, so a pipeline started
with other values refuses until the store is rebuilt, and the API reports the store's values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Protocol

import psycopg
from psycopg import sql

from aml_app.dependencies.copy import copy_arrow
from aml_app.dependencies.store import (
    Schema,
    StoreError,
    as_of_json,
    iso_text,
    money_text,
    read_meta,
    write_meta,
)

HORIZON = timedelta(days=7)
#: How long flows are kept past the longest window, before the newest event time (the default of
#: `AML_AGGREGATES_RETENTION`).
KEEP = timedelta(days=1)
BUCKET = timedelta(minutes=1)
#: The windows of an answer. The window query (`_WINDOWS`) spells out these three, in this order.
WINDOWS = {"1h": timedelta(hours=1), "24h": timedelta(hours=24), "7d": timedelta(days=7)}
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

SCHEMA = Schema(
    "aggregates",
    [
        """
        CREATE TABLE {schema}.payments (
            payer text COLLATE "C" NOT NULL,
            payee text COLLATE "C" NOT NULL,
            currency text COLLATE "C" NOT NULL,
            amount numeric NOT NULL,
            ts timestamptz NOT NULL
        );
        CREATE INDEX payments_by_payer ON {schema}.payments (payer, ts);
        CREATE INDEX payments_by_payee ON {schema}.payments (payee, ts);
        CREATE INDEX payments_by_ts ON {schema}.payments USING brin (ts);
        CREATE TABLE {schema}.buckets (
            account text COLLATE "C" NOT NULL,
            bucket timestamptz NOT NULL,
            direction text NOT NULL CHECK (direction IN ('out', 'in')),
            counterparty text COLLATE "C" NOT NULL,
            currency text COLLATE "C" NOT NULL,
            payments bigint NOT NULL,
            total numeric NOT NULL,
            near bigint NOT NULL,
            PRIMARY KEY (account, bucket, direction, counterparty, currency)
        );
        CREATE INDEX buckets_by_bucket ON {schema}.buckets USING brin (bucket)
        """,
        # 2: one row per payment's (payer, minute, payee, currency) instead of one per side; a bucket's
        # 'out' rows hold every payment once (and its near-threshold count), so they are the flows.
        """
        CREATE TABLE {schema}.flows (
            payer text COLLATE "C" NOT NULL,
            bucket timestamptz NOT NULL,
            payee text COLLATE "C" NOT NULL,
            currency text COLLATE "C" NOT NULL,
            payments bigint NOT NULL,
            total numeric NOT NULL,
            near bigint NOT NULL,
            PRIMARY KEY (payer, bucket, payee, currency)
        );
        CREATE INDEX flows_by_payee ON {schema}.flows (payee, bucket);
        CREATE INDEX flows_by_bucket ON {schema}.flows USING brin (bucket);
        INSERT INTO {schema}.flows
            SELECT account, bucket, counterparty, currency, payments, total, near
            FROM {schema}.buckets WHERE direction = 'out';
        DROP TABLE {schema}.buckets
        """,
        # 3: each flow row holds its payments (times and amounts) and its first and last time, for the
        # partial minutes of a window, instead of a payments table with two indexes of its own (a third of
        # the store's index entries).
        """
        ALTER TABLE {schema}.flows ADD COLUMN times timestamptz[], ADD COLUMN amounts numeric[],
            ADD COLUMN first_ts timestamptz, ADD COLUMN last_ts timestamptz;
        UPDATE {schema}.flows AS f
        SET times = p.times, amounts = p.amounts, first_ts = p.first_ts, last_ts = p.last_ts
        FROM (
            SELECT payer, date_bin('1 minute', ts, 'epoch') AS bucket, payee, currency,
                array_agg(ts ORDER BY ts, amount) AS times, array_agg(amount ORDER BY ts, amount) AS amounts,
                min(ts) AS first_ts, max(ts) AS last_ts
            FROM {schema}.payments GROUP BY 1, 2, 3, 4
        ) AS p
        WHERE (f.payer, f.bucket, f.payee, f.currency) = (p.payer, p.bucket, p.payee, p.currency);
        ALTER TABLE {schema}.flows ALTER COLUMN times SET NOT NULL, ALTER COLUMN amounts SET NOT NULL,
            ALTER COLUMN first_ts SET NOT NULL, ALTER COLUMN last_ts SET NOT NULL;
        DROP TABLE {schema}.payments
        """,
        # 4: a row of one payment keeps no arrays (that payment is its first_ts and its total, and a window's
        # edge never cuts it): almost every row holds one, and their arrays cost the writes a tenth of their
        # PostgreSQL CPU and the table a tenth of its size. Rows written before keep theirs (both forms are
        # read alike); a row of several payments must have them.
        """
        ALTER TABLE {schema}.flows ALTER COLUMN times DROP NOT NULL, ALTER COLUMN amounts DROP NOT NULL,
            ADD CONSTRAINT flows_payments_listed
                CHECK (payments = 1 OR times IS NOT NULL AND amounts IS NOT NULL) NOT VALID
        """,
    ],
)

#: The columns of a batch's flow rows, as Spark makes them (`times` and `amounts`: Arrow lists, null in a row
#: of one payment).
FLOW_COLUMNS = (
    *("payer", "bucket", "payee", "currency", "payments", "total", "near"),
    *("times", "amounts", "first_ts", "last_ts"),
)


def floor_bucket(when: datetime) -> datetime:
    """The start of the minute (of the epoch's minutes) that `when` falls in."""
    return when - (when - EPOCH) % BUCKET


def before(at: datetime, span: timedelta) -> datetime:
    """`at - span`, or the first instant there is when that is earlier (no payment is older: the
    contract's ts starts in year 1)."""
    earliest = datetime.min.replace(tzinfo=UTC)
    return at - span if at - earliest > span else earliest


def week_before(at: datetime) -> datetime:
    """`at - HORIZON`, or the first instant there is for an `at` in the first week of year 1."""
    return before(at, HORIZON)


def near_bounds(threshold: Decimal, band: Decimal) -> tuple[Decimal, Decimal]:
    """[low, high): the amounts counted as near the reporting threshold."""
    return threshold * (1 - band), threshold


def check_thresholds(conn: psycopg.Connection, schema: Schema, threshold: Decimal, band: Decimal) -> None:
    """Record the near-threshold definition in a new store; refuse a store counted with another one."""
    meta = read_meta(conn, schema)
    if "reporting_threshold" not in meta:
        write_meta(conn, schema, {"reporting_threshold": str(threshold), "threshold_band": str(band)})
        return
    stored = Decimal(meta["reporting_threshold"]), Decimal(meta["threshold_band"])
    if stored != (threshold, band):
        raise StoreError(
            f"the aggregates store counts near-threshold payments with AML_REPORTING_THRESHOLD={stored[0]} "
            f"and AML_THRESHOLD_BAND={stored[1]}, but this pipeline has {threshold} and {band}: set them "
            "back, or rebuild the store with the new values (aml-app rebuild aggregates)"
        )


def write_table(conn: psycopg.Connection, flows: Any, keep: timedelta) -> int:
    """The registry's write (`aml_app.dependency_services`): `write_batch` into the store."""
    return write_batch(conn, SCHEMA, flows, keep)


def check_store(conn: psycopg.Connection, schema: Schema, settings: Any) -> None:
    """The registry's check when the pipeline opens the store: the near-threshold definition."""
    check_thresholds(
        conn, schema, settings.dependencies.reporting_threshold, settings.dependencies.threshold_band
    )


def health(meta: Mapping[str, str]) -> dict[str, Any]:
    """What C's /health adds from its store's meta."""
    return {"late_dropped": int(meta.get("late_dropped", "0")), "max_event_ts": meta.get("max_event_ts")}


def write_batch(conn: psycopg.Connection, schema: Schema, flows: Any, keep: timedelta = KEEP) -> int:
    """Add a batch's flow rows (an Arrow table, one row per key), minus too-late ones; prune what is
    more than `keep` older than the longest window needs.

    Returns how many payments were stored (the too-late ones are counted in `late_dropped`). Runs inside
    the caller's transaction.
    """
    import pyarrow.compute as pc

    if flows.num_rows == 0:
        return 0
    meta = read_meta(conn, schema)
    stored_max = datetime.fromisoformat(meta["max_event_ts"]) if "max_event_ts" in meta else None
    batch_max = pc.max(flows["last_ts"]).as_py()
    new_max = batch_max if stored_max is None else max(stored_max, batch_max)
    cutoff = floor_bucket(week_before(new_max))
    # A payment is too late when its minute is: the cutoff is a minute's start.
    on_time = pc.greater_equal(flows["bucket"], cutoff)
    payments: int = pc.sum(flows["payments"]).as_py()
    late = payments - (pc.sum(pc.filter(flows["payments"], on_time)).as_py() or 0)
    if late:
        flows = flows.filter(on_time)
    conn.execute(
        """
        CREATE TEMPORARY TABLE batch_flows (
            payer text COLLATE "C", bucket timestamptz, payee text COLLATE "C", currency text COLLATE "C",
            payments bigint, total numeric, near bigint, times timestamptz[], amounts numeric[],
            first_ts timestamptz, last_ts timestamptz
        ) ON COMMIT DROP
        """
    )
    copy_arrow(conn, "batch_flows", flows, FLOW_COLUMNS, key=FLOW_COLUMNS[:4])
    conn.execute(
        sql.SQL(
            """
            INSERT INTO {flows} AS f SELECT * FROM batch_flows
            ON CONFLICT (payer, bucket, payee, currency) DO UPDATE SET
                payments = f.payments + excluded.payments,
                total = f.total + excluded.total,
                near = f.near + excluded.near,
                times = coalesce(f.times, ARRAY[f.first_ts])
                    || coalesce(excluded.times, ARRAY[excluded.first_ts]),
                amounts = coalesce(f.amounts, ARRAY[f.total])
                    || coalesce(excluded.amounts, ARRAY[excluded.total]),
                first_ts = least(f.first_ts, excluded.first_ts),
                last_ts = greatest(f.last_ts, excluded.last_ts)
            """
        ).format(flows=sql.Identifier(schema.name, "flows"))
    )
    updates = {"max_event_ts": iso_text(new_max)}
    if late:
        updates["late_dropped"] = str(int(meta.get("late_dropped", "0")) + late)
    prune = floor_bucket(before(new_max, HORIZON + keep))
    pruned = datetime.fromisoformat(meta["pruned_before"]) if "pruned_before" in meta else None
    if stored_max is not None and prune > floor_bucket(before(stored_max, HORIZON + keep)):
        deleted = conn.execute(
            sql.SQL("DELETE FROM {} WHERE bucket < %s").format(sql.Identifier(schema.name, "flows")),
            (prune,),
        ).rowcount
        if deleted and (pruned is None or prune > pruned):  # a flow that an answer could need is gone
            updates["pruned_before"] = iso_text(prune)
    write_meta(conn, schema, updates)
    return payments - late


# --- the query ------------------------------------------------------------------------------------

# One pass per (account, at) serves all three windows, which nest: (at - 7 d, at] holds (at - 24 h, at],
# which holds (at - 1 h, at]. For window w, `lo_w` = at - w (excluded). Per account of the call and side,
# one index range of flow rows (from the payer's side through the primary key, from the payee's side
# through flows_by_payee), read once for every question about that account (`base`): the minutes from the
# one that holds its earliest question's lo_7d to the one that holds its latest `at`. Each account's range
# is an index scan of its own (LATERAL): a join of all accounts at once let the planner hash whole tables
# on every call (BENCHMARKS.md, "End to end").
# A detector's batch asks about its busiest payees several times, at instants seconds apart (on the
# simulator's traffic the busiest merchant holds half of the query's time), so most of an account's range
# counts alike for all of its questions: a row is `shared` when it ends by the account's first `at` and, for
# each window, lies wholly before every question's lo_w or wholly after all of them. A shared row counts in
# the same windows for every question (from the smallest one that holds it, `w`: 1 for 1 h, 2 for 24 h, 3 for
# 7 d, on; none when it ends by every lo_7d: `shared` holds that w, 0 for none, and is null for a row that is
# not shared; the edges it is compared with are computed once per account), so it is aggregated once per
# account: per (direction, currency, w) its totals, payments and near-threshold payments, and per counterparty
# the smallest window in which it was paid, paid the account, or either. Only the other rows (`own`: those
# that reach between the account's first and last `at`, or between the first and last of an edge: a batch's
# seconds) go through each question: a row counts whole in window w when its first payment is after lo_w and
# its last at or before `at`; a row cut by an edge (`at` or a lo_w: its first and last time tell, without
# reading them; a cut row is never shared) is unpacked from its arrays, looked up apart in the minute of each
# edge (the four edges are hours apart: a row is cut by one at most), and its payments counted one by one. A
# question's answer adds its own rows' aggregates to the account's shared ones, in Python; its distinct
# counterparties are the shared ones plus those its own rows reach in a smaller window than the shared rows do
# (or only there), counted in one join of the account's own parties with its shared ones. Counting distinct
# counterparties by their smallest window, not with DISTINCT aggregates, keeps a window's count from sorting
# every group (twice the CPU).
# Aggregated per account, the hash tables hold one account's counterparties and stay in memory; the same
# aggregates over every account's rows at once held them all (tens of thousands for a batch about
# merchants), spilled them to temporary files and took 6-14 % longer on a store of the simulator's
# traffic. A FILTER per window on each aggregate instead cost about a tenth more of PostgreSQL's CPU on
# the end-to-end benchmark's traffic (BENCHMARKS.md, "End to end").
# The lists go as binary parameters (`%(name)b`): psycopg writes them several times faster than text
# arrays (relations.py gives the figures).
_WINDOWS = """
WITH q AS (
    SELECT i, account COLLATE "C" AS account, at, at - %(1h)s AS lo_1h, at - %(24h)s AS lo_24h,
        at - %(7d)s AS lo_7d
    FROM unnest(%(accounts)b::text[], %(ats)b::timestamptz[]) WITH ORDINALITY AS h(account, at, i)
), accounts AS (
    SELECT account, date_bin(%(bucket)s, min(at) - %(7d)s, 'epoch') AS first_minute,
        date_bin(%(bucket)s, max(at) + interval '1 microsecond', 'epoch') AS last_minute,
        min(at) AS first_at, min(lo_1h) AS first_1h, min(lo_24h) AS first_24h, min(lo_7d) AS first_7d,
        max(lo_1h) AS last_1h, max(lo_24h) AS last_24h, max(lo_7d) AS last_7d
    FROM q GROUP BY account
)
SELECT a.* FROM accounts g CROSS JOIN LATERAL (
    WITH base AS MATERIALIZED (
        SELECT s.*, CASE WHEN s.last_ts <= g.first_at
                AND (s.last_ts <= g.first_1h OR s.first_ts > g.last_1h)
                AND (s.last_ts <= g.first_24h OR s.first_ts > g.last_24h)
                AND (s.last_ts <= g.first_7d OR s.first_ts > g.last_7d)
            THEN CASE WHEN s.first_ts > g.last_1h THEN 1 WHEN s.first_ts > g.last_24h THEN 2
                WHEN s.first_ts > g.last_7d THEN 3 ELSE 0 END END AS shared
        FROM (
            SELECT 'out' AS direction, f.payee AS counterparty, f.currency, f.payments, f.total, f.near,
                f.first_ts, f.last_ts
            FROM {flows} f
            WHERE f.payer = g.account AND f.bucket >= g.first_minute AND f.bucket <= g.last_minute
                AND f.payee <> g.account
            UNION ALL
            SELECT 'in', f.payer, f.currency, f.payments, f.total, 0, f.first_ts, f.last_ts
            FROM {flows} f
            WHERE f.payee = g.account AND f.bucket >= g.first_minute AND f.bucket <= g.last_minute
                AND f.payer <> g.account
        ) s
    ), own AS MATERIALIZED (
        SELECT * FROM base s WHERE s.shared IS NULL
    ), shared_parties AS MATERIALIZED (
        SELECT counterparty, min(shared) FILTER (WHERE direction = 'out') AS sent,
            min(shared) FILTER (WHERE direction = 'in') AS received, min(shared) AS seen
        FROM base WHERE shared > 0 GROUP BY counterparty
    ), shared_totals AS MATERIALIZED (
        SELECT direction, currency, shared AS w, sum(total) AS total, sum(payments) AS payments,
            sum(near) AS near
        FROM base WHERE shared > 0 GROUP BY direction, currency, shared
    ), shared_counts AS MATERIALIZED (
        SELECT count(*) FILTER (WHERE sent <= 1), count(*) FILTER (WHERE sent <= 2),
            count(*) FILTER (WHERE sent <= 3), count(*) FILTER (WHERE received <= 1),
            count(*) FILTER (WHERE received <= 2), count(*) FILTER (WHERE received <= 3),
            count(*) FILTER (WHERE seen <= 1), count(*) FILTER (WHERE seen <= 2),
            count(*) FILTER (WHERE seen <= 3)
        FROM shared_parties
    ), mine AS MATERIALIZED (
        SELECT * FROM q WHERE q.account = g.account
    ), rows AS MATERIALIZED (
        SELECT q.i, s.direction, s.counterparty, s.currency, s.payments, s.total, s.near,
            CASE WHEN s.first_ts > q.lo_1h THEN 1 WHEN s.first_ts > q.lo_24h THEN 2 ELSE 3 END AS w
        FROM mine q JOIN own s
            ON s.first_ts > q.lo_7d AND s.last_ts <= q.at AND NOT (
                s.first_ts <= q.lo_1h AND s.last_ts > q.lo_1h
                OR s.first_ts <= q.lo_24h AND s.last_ts > q.lo_24h)
        UNION ALL
        SELECT q.i, s.direction, s.counterparty, s.currency, 1, p.amount,
            CASE WHEN s.direction = 'out' THEN {near} ELSE 0 END,
            CASE WHEN p.ts > q.lo_1h THEN 1 WHEN p.ts > q.lo_24h THEN 2 ELSE 3 END
        FROM mine q CROSS JOIN LATERAL unnest(ARRAY[q.at, q.lo_1h, q.lo_24h, q.lo_7d]) AS e(edge)
        CROSS JOIN LATERAL (
            SELECT 'out' AS direction, f.payee AS counterparty, f.currency, f.times, f.amounts
            FROM {flows} f WHERE f.payer = q.account AND f.bucket = date_bin(%(bucket)s, e.edge, 'epoch')
                AND f.payee <> q.account AND f.first_ts <= e.edge AND f.last_ts > e.edge
            UNION ALL
            SELECT 'in', f.payer, f.currency, f.times, f.amounts
            FROM {flows} f WHERE f.payee = q.account AND f.bucket = date_bin(%(bucket)s, e.edge, 'epoch')
                AND f.payer <> q.account AND f.first_ts <= e.edge AND f.last_ts > e.edge
        ) s CROSS JOIN LATERAL unnest(s.times, s.amounts) AS p(ts, amount)
        WHERE p.ts > q.lo_7d AND p.ts <= q.at
    ), parties AS (
        SELECT i, counterparty, min(w) FILTER (WHERE direction = 'out') AS sent,
            min(w) FILTER (WHERE direction = 'in') AS received, min(w) AS seen
        FROM rows GROUP BY i, counterparty
    )
    SELECT i, 'totals' AS kind, direction, currency, w, sum(total), sum(payments), sum(near),
        NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint
    FROM rows GROUP BY i, direction, currency, w
    UNION ALL
    SELECT q.i, 'totals', t.direction, t.currency, t.w, t.total, t.payments, t.near,
        NULL, NULL, NULL, NULL, NULL, NULL
    FROM mine q CROSS JOIN shared_totals t
    UNION ALL
    SELECT q.i, 'counterparties', NULL, NULL, NULL, c.* FROM mine q CROSS JOIN shared_counts c
    UNION ALL
    SELECT p.i, 'counterparties', NULL, NULL, NULL,
        count(*) FILTER (WHERE p.sent <= 1 AND coalesce(s.sent, 4) > 1),
        count(*) FILTER (WHERE p.sent <= 2 AND coalesce(s.sent, 4) > 2),
        count(*) FILTER (WHERE p.sent <= 3 AND coalesce(s.sent, 4) > 3),
        count(*) FILTER (WHERE p.received <= 1 AND coalesce(s.received, 4) > 1),
        count(*) FILTER (WHERE p.received <= 2 AND coalesce(s.received, 4) > 2),
        count(*) FILTER (WHERE p.received <= 3 AND coalesce(s.received, 4) > 3),
        count(*) FILTER (WHERE p.seen <= 1 AND coalesce(s.seen, 4) > 1),
        count(*) FILTER (WHERE p.seen <= 2 AND coalesce(s.seen, 4) > 2),
        count(*) FILTER (WHERE p.seen <= 3 AND coalesce(s.seen, 4) > 3)
    FROM parties p LEFT JOIN shared_parties s ON s.counterparty = p.counterparty
    GROUP BY p.i
) a
"""
_NEAR = "(p.amount >= %(near_low)s AND p.amount < %(near_high)s)::int"


class Rates(Protocol):
    """What an answer needs of the exchange rates (`aml_app.detection.exchange.ExchangeRates`)."""

    @property
    def reporting(self) -> str: ...

    def total(self, sums: Mapping[str, Decimal]) -> Decimal: ...

    def unconverted(self, sums: Mapping[str, Decimal]) -> list[str]: ...


def empty_window() -> dict[str, Any]:
    return {
        "sent_count": 0,
        "sent": {},
        "sent_total": "0.00",
        "received_count": 0,
        "received": {},
        "received_total": "0.00",
        "counterparties": 0,
        "sent_counterparties": 0,
        "received_counterparties": 0,
    }


def windows_query(
    schema: Schema, queries: Sequence[tuple[str, datetime]], threshold: Decimal, band: Decimal
) -> tuple[sql.Composed, dict[str, Any]]:
    """The window query for (account, at) `queries` and its parameters."""
    low, high = near_bounds(threshold, band)
    text = sql.SQL(_WINDOWS).format(flows=sql.Identifier(schema.name, "flows"), near=sql.SQL(_NEAR))
    params = {
        "accounts": [a for a, _ in queries],
        "ats": [at for _, at in queries],
        "bucket": BUCKET,
        "near_low": low,
        "near_high": high,
        **WINDOWS,
    }
    return text, params


async def aggregates_many(
    cur: Any,
    schema: Schema | None,
    queries: Sequence[tuple[str, datetime]],
    as_of: Mapping[int, int],
    meta: Mapping[str, str],
    defaults: tuple[Decimal, Decimal],
    rates: Rates,
) -> list[dict[str, Any]]:
    """Answers for several (account, at), inside the caller's read snapshot (cursor `cur`).

    `meta` is the store's meta read in the same snapshot (`log` in it: the log `as_of` is of, None for a
    store that records none); `defaults` (threshold, band) are reported by a store that has none yet.
    `rates` state each window's sums in one reporting currency too (`sent_total`, `received_total`),
    for readers that compare amounts across currencies; currencies without a rate count nothing there
    and are named in `unconverted`. `schema` None: the store has no tables, every answer is empty.
    """
    threshold = Decimal(meta.get("reporting_threshold", defaults[0]))
    band = Decimal(meta.get("threshold_band", defaults[1]))
    pruned = datetime.fromisoformat(meta["pruned_before"]) if "pruned_before" in meta else None
    answers: list[dict[str, Any]] = [
        {
            "account": account,
            "at": iso_text(at),
            "as_of": as_of_json(as_of),
            "log": meta.get("log"),
            "windows": {name: empty_window() for name in WINDOWS},
            "near_threshold_24h": 0,
            "reporting_threshold": format(threshold, "f"),
            "threshold_band": format(band, "f"),
            "late_dropped": int(meta.get("late_dropped", "0")),
            # The week before `at` is all there: its first minute was not pruned.
            "exact": pruned is None or floor_bucket(week_before(at)) >= pruned,
            "reporting_currency": rates.reporting,
            "unconverted": [],
        }
        for account, at in queries
    ]
    if schema is None or not queries:
        return answers
    await cur.execute(*windows_query(schema, queries, threshold, band))
    for i, kind, direction, currency, smallest, *values in await cur.fetchall():
        windows = answers[i - 1]["windows"]
        if kind == "totals":  # one direction, currency and smallest window: total, payments, near-threshold
            side = "sent" if direction == "out" else "received"
            total, count, near = values[0:3]
            for rank, (name, window) in enumerate(windows.items(), start=1):  # 1 h, 24 h, 7 d: they nest
                if smallest <= rank:
                    window[side][currency] = window[side].get(currency, 0) + total
                    window[f"{side}_count"] += int(count)
                    if name == "24h" and direction == "out":  # near-threshold payments count over 24 h
                        answers[i - 1]["near_threshold_24h"] += int(near)
        else:  # distinct counterparties (sent to, received from, either): shared, then those its own rows add
            for key, counts in zip(
                ("sent_counterparties", "received_counterparties", "counterparties"),
                (values[0:3], values[3:6], values[6:9]),
                strict=True,
            ):
                for name, count in zip(WINDOWS, counts, strict=True):
                    windows[name][key] += int(count)  # numeric, like the totals in its column
    for answer in answers:
        seen: dict[str, Decimal] = {}
        for window in answer["windows"].values():
            for side in ("sent", "received"):
                sums = window[side]
                seen.update(sums)
                window[f"{side}_total"] = money_text(rates.total(sums))
                window[side] = {currency: money_text(total) for currency, total in sorted(sums.items())}
        answer["unconverted"] = rates.unconverted(seen)
    return answers
