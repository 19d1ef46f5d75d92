"""Service C's store: payments over event time, per-minute flows, and the windowed aggregates query.

Windows at an instant come from pre-aggregated per-minute buckets (the flows) plus the exact payments at
the window's edges (the idea of TimescaleDB's real-time continuous aggregates):

- `flows(payer, bucket, payee, currency)`: per minute of event time, the payments from payer to payee in
  one currency: how many, their exact total, and how many were near the reporting threshold. Spark builds
  one row per key for each micro-batch (`aml_app.pipeline.transforms.flows`); the store adds them up. A
  payment is one row, read from the payer's side through the primary key and from the payee's side
  through `flows_by_payee` (schema version 1 kept one row per side, `buckets`: twice the rows to write).
- `payments(payer, payee, currency, amount, ts)`: every payment, once, for the edges of a window.

A window (at - w, at] is the flows that lie wholly inside it plus the payments in the two partial minutes
at its ends, so an answer reads at most two minutes of payments per account and direction, and one row
per (minute, counterparty, currency) for the rest: exact, and equal to a computation over every payment
(tests/reference.py), without scanning every payment of a busy account.

Too-late rule: the store keeps `max_event_ts`, the largest ts applied so far. When a batch is applied,
max_event_ts first rises to include the whole batch; then every payment of the batch whose minute starts
before `max_event_ts - 7 days` (its ts < the start of that minute) is too late: not stored, counted in
`late_dropped`. Late payments inside the horizon are stored and do count. Whenever that minute boundary
moves, payments and flows before `max_event_ts - 7 d - 1 h` (its minute) are pruned, so answers are
exact for every `at >= max_event_ts - 1 h`.

Near the threshold: `threshold * (1 - band) <= amount < threshold`, counted over payments sent in 24 h.
Both numbers are part of the store (`meta`): the flows were counted with them, so a pipeline started
with other values refuses until the store is rebuilt, and the API reports the store's values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

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
PRUNE_SLACK = timedelta(hours=1)
BUCKET = timedelta(minutes=1)
#: The windows of an answer. The window query (`_WINDOWS`) spells out these three, in this order; each
#: is longer than a minute, so that its first whole minute comes before the minute that holds `at`.
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
    ],
)

#: The columns of a batch's payment and flow rows, as Spark makes them.
PAYMENT_COLUMNS = ("payer", "payee", "currency", "amount", "ts")
FLOW_COLUMNS = ("payer", "bucket", "payee", "currency", "payments", "total", "near")


def floor_bucket(when: datetime) -> datetime:
    """The start of the minute (of the epoch's minutes) that `when` falls in."""
    return when - (when - EPOCH) % BUCKET


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


def write_batch(conn: psycopg.Connection, schema: Schema, payments: Any, flows: Any) -> int:
    """Store a batch's payments and add its flow rows (Arrow tables), minus too-late ones; prune.

    Returns how many payments were too late. Runs inside the caller's transaction.
    """
    import pyarrow.compute as pc

    if payments.num_rows == 0:
        return 0
    meta = read_meta(conn, schema)
    stored_max = datetime.fromisoformat(meta["max_event_ts"]) if "max_event_ts" in meta else None
    batch_max = pc.max(payments["ts"]).as_py()
    new_max = batch_max if stored_max is None else max(stored_max, batch_max)
    cutoff = floor_bucket(new_max - HORIZON)
    on_time = pc.greater_equal(payments["ts"], cutoff)
    late = payments.num_rows - pc.sum(on_time).as_py()
    if late:
        payments = payments.filter(on_time)
        flows = flows.filter(pc.greater_equal(flows["bucket"], cutoff))
    copy_arrow(conn, f"{schema.name}.payments", payments, PAYMENT_COLUMNS)
    conn.execute(
        """
        CREATE TEMPORARY TABLE batch_flows (
            payer text COLLATE "C", bucket timestamptz, payee text COLLATE "C", currency text COLLATE "C",
            payments bigint, total numeric, near bigint
        ) ON COMMIT DROP
        """
    )
    copy_arrow(conn, "batch_flows", flows, FLOW_COLUMNS)
    conn.execute(
        sql.SQL(
            """
            INSERT INTO {flows} AS f SELECT * FROM batch_flows
            ON CONFLICT (payer, bucket, payee, currency) DO UPDATE SET
                payments = f.payments + excluded.payments,
                total = f.total + excluded.total,
                near = f.near + excluded.near
            """
        ).format(flows=sql.Identifier(schema.name, "flows"))
    )
    updates = {"max_event_ts": iso_text(new_max)}
    if late:
        updates["late_dropped"] = str(int(meta.get("late_dropped", "0")) + late)
    write_meta(conn, schema, updates)
    prune = floor_bucket(new_max - HORIZON - PRUNE_SLACK)
    if stored_max is not None and prune > floor_bucket(stored_max - HORIZON - PRUNE_SLACK):
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE ts < %s").format(sql.Identifier(schema.name, "payments")), (prune,)
        )
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE bucket < %s").format(sql.Identifier(schema.name, "flows")),
            (prune,),
        )
    return late


# --- the query ------------------------------------------------------------------------------------

# One pass per (account, at) serves all three windows, which nest: (at - 7 d, at] holds (at - 24 h, at],
# which holds (at - 1 h, at]. For window w, `lo_w` = at - w (excluded) and `fa_w` = the first minute that
# lies wholly inside it; `fb` = the minute that holds `at`, the same for every window. The rows read, each
# flagged with the windows it counts in (in_1h, in_24h, in_7d):
# - the flows of the minutes [fa_7d, fb): in window w when the minute starts at or after fa_w (read from
#   the payer's side through the primary key, from the payee's side through flows_by_payee);
# - the tail, the payments in [fb, at]: in every window;
# - each window's head, the payments of its partial first minute (lo_w, fa_w): in that window only (the
#   wider windows count that minute through its flow rows).
# Each range is an index scan of its own on (payer, ts) or (payee, ts), per query (LATERAL): a join of
# all queries at once let the planner hash whole tables on every call (BENCHMARKS.md, "End to end").
# The answers then come from hash aggregates with a FILTER per window: the totals per (direction,
# currency), the payments per direction, and the distinct counterparties per direction and overall,
# counted over rows first made unique per counterparty (DISTINCT aggregates would sort every group for
# every window: twice the CPU).
_WINDOWS = """
WITH q AS (
    SELECT i, account COLLATE "C" AS account, at,
        at - %(1h)s AS lo_1h, date_bin(%(bucket)s, at - %(1h)s, 'epoch') + %(bucket)s AS fa_1h,
        at - %(24h)s AS lo_24h, date_bin(%(bucket)s, at - %(24h)s, 'epoch') + %(bucket)s AS fa_24h,
        at - %(7d)s AS lo_7d, date_bin(%(bucket)s, at - %(7d)s, 'epoch') + %(bucket)s AS fa_7d,
        date_bin(%(bucket)s, at + interval '1 microsecond', 'epoch') AS fb
    FROM unnest(%(accounts)s::text[], %(ats)s::timestamptz[]) WITH ORDINALITY AS q(account, at, i)
), rows AS MATERIALIZED (
    SELECT q.i, r.* FROM q CROSS JOIN LATERAL (
        SELECT 'out' AS direction, f.payee AS counterparty, f.currency, f.payments, f.total, f.near,
            f.bucket >= q.fa_1h AS in_1h, f.bucket >= q.fa_24h AS in_24h, true AS in_7d
        FROM {flows} f WHERE f.payer = q.account AND f.bucket >= q.fa_7d AND f.bucket < q.fb
        UNION ALL
        SELECT 'in', f.payer, f.currency, f.payments, f.total, 0,
            f.bucket >= q.fa_1h, f.bucket >= q.fa_24h, true
        FROM {flows} f WHERE f.payee = q.account AND f.bucket >= q.fa_7d AND f.bucket < q.fb
        UNION ALL
        SELECT 'out', p.payee, p.currency, 1, p.amount, {near}, true, true, true
        FROM {payments} p WHERE p.payer = q.account AND p.ts >= q.fb AND p.ts <= q.at
        UNION ALL
        SELECT 'in', p.payer, p.currency, 1, p.amount, 0, true, true, true
        FROM {payments} p WHERE p.payee = q.account AND p.ts >= q.fb AND p.ts <= q.at
        UNION ALL
        SELECT 'out', p.payee, p.currency, 1, p.amount, {near}, true, false, false
        FROM {payments} p WHERE p.payer = q.account AND p.ts > q.lo_1h AND p.ts < q.fa_1h
        UNION ALL
        SELECT 'in', p.payer, p.currency, 1, p.amount, 0, true, false, false
        FROM {payments} p WHERE p.payee = q.account AND p.ts > q.lo_1h AND p.ts < q.fa_1h
        UNION ALL
        SELECT 'out', p.payee, p.currency, 1, p.amount, {near}, false, true, false
        FROM {payments} p WHERE p.payer = q.account AND p.ts > q.lo_24h AND p.ts < q.fa_24h
        UNION ALL
        SELECT 'in', p.payer, p.currency, 1, p.amount, 0, false, true, false
        FROM {payments} p WHERE p.payee = q.account AND p.ts > q.lo_24h AND p.ts < q.fa_24h
        UNION ALL
        SELECT 'out', p.payee, p.currency, 1, p.amount, {near}, false, false, true
        FROM {payments} p WHERE p.payer = q.account AND p.ts > q.lo_7d AND p.ts < q.fa_7d
        UNION ALL
        SELECT 'in', p.payer, p.currency, 1, p.amount, 0, false, false, true
        FROM {payments} p WHERE p.payee = q.account AND p.ts > q.lo_7d AND p.ts < q.fa_7d
    ) r
), sides AS (
    SELECT i, direction, counterparty,
        bool_or(in_1h) AS in_1h, bool_or(in_24h) AS in_24h, bool_or(in_7d) AS in_7d
    FROM rows GROUP BY i, direction, counterparty
)
SELECT i, 'total' AS kind, direction, currency, sum(total) FILTER (WHERE in_1h),
    sum(total) FILTER (WHERE in_24h), sum(total) FILTER (WHERE in_7d), NULL::numeric AS near_24h
FROM rows GROUP BY i, direction, currency
UNION ALL
SELECT i, 'count', direction, NULL, sum(payments) FILTER (WHERE in_1h),
    sum(payments) FILTER (WHERE in_24h), sum(payments) FILTER (WHERE in_7d), sum(near) FILTER (WHERE in_24h)
FROM rows GROUP BY i, direction
UNION ALL
SELECT i, 'counterparties', direction, NULL, count(*) FILTER (WHERE in_1h),
    count(*) FILTER (WHERE in_24h), count(*) FILTER (WHERE in_7d), NULL
FROM sides GROUP BY i, direction
UNION ALL
SELECT i, 'all counterparties', NULL, NULL, count(*) FILTER (WHERE in_1h),
    count(*) FILTER (WHERE in_24h), count(*) FILTER (WHERE in_7d), NULL
FROM (
    SELECT i, counterparty, bool_or(in_1h) AS in_1h, bool_or(in_24h) AS in_24h, bool_or(in_7d) AS in_7d
    FROM sides GROUP BY i, counterparty
) AS everyone GROUP BY i
"""
_NEAR = "(p.amount >= %(near_low)s AND p.amount < %(near_high)s)::int"


def empty_window() -> dict[str, Any]:
    return {
        "sent_count": 0,
        "sent": {},
        "received_count": 0,
        "received": {},
        "counterparties": 0,
        "sent_counterparties": 0,
        "received_counterparties": 0,
    }


async def aggregates_many(
    cur: Any,
    schema: Schema | None,
    queries: Sequence[tuple[str, datetime]],
    as_of: Mapping[int, int],
    meta: Mapping[str, str],
    defaults: tuple[Decimal, Decimal],
) -> list[dict[str, Any]]:
    """Answers for several (account, at), inside the caller's read snapshot (cursor `cur`).

    `meta` is the store's meta read in the same snapshot; `defaults` (threshold, band) are reported by a
    store that has none yet. `schema` None: the store has no tables, every answer is empty.
    """
    threshold = Decimal(meta.get("reporting_threshold", defaults[0]))
    band = Decimal(meta.get("threshold_band", defaults[1]))
    answers = [
        {
            "account": account,
            "at": iso_text(at),
            "as_of": as_of_json(as_of),
            "windows": {name: empty_window() for name in WINDOWS},
            "near_threshold_24h": 0,
            "reporting_threshold": format(threshold, "f"),
            "threshold_band": format(band, "f"),
            "late_dropped": int(meta.get("late_dropped", "0")),
        }
        for account, at in queries
    ]
    if schema is None or not queries:
        return answers
    low, high = near_bounds(threshold, band)
    await cur.execute(
        sql.SQL(_WINDOWS).format(
            flows=sql.Identifier(schema.name, "flows"),
            payments=sql.Identifier(schema.name, "payments"),
            near=sql.SQL(_NEAR),
        ),
        {
            "accounts": [a for a, _ in queries],
            "ats": [at for _, at in queries],
            "bucket": BUCKET,
            "near_low": low,
            "near_high": high,
            **WINDOWS,
        },
    )
    for i, kind, direction, currency, *per_window, near_24h in await cur.fetchall():
        answer = answers[i - 1]
        side = "sent" if direction == "out" else "received"
        for name, value in zip(WINDOWS, per_window, strict=True):
            if value is None:  # no row in this window
                continue
            window = answer["windows"][name]
            if kind == "total":
                window[side][currency] = money_text(value)
            elif kind == "count":  # the rest are counts, numeric like the totals in the same column
                window[f"{side}_count"] = int(value)
            elif kind == "counterparties":
                window[f"{side}_counterparties"] = int(value)
            else:
                window["counterparties"] = int(value)
        if kind == "count" and direction == "out" and near_24h is not None:
            answer["near_threshold_24h"] = int(near_24h)
    for answer in answers:
        for window in answer["windows"].values():
            for side in ("sent", "received"):
                window[side] = dict(sorted(window[side].items()))
    return answers
