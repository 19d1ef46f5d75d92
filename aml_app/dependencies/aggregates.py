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

# For each (account, at) and window: `lo` = at - w (excluded) and `hi` = at (included); the flows whose
# minute starts at or after `fa` and before `fb` lie wholly inside the window (read from the payer's side
# through the primary key, from the payee's side through flows_by_payee); the payments in the head (lo,
# head_end) and the tail [tail_start, hi] are its partial minutes (when no bucket fits, the head is the
# whole window and the tail is empty). Each range is its own index scan on (payer, ts) or (payee, ts),
# per window (LATERAL): a join of all windows at once let the planner hash whole tables on every call
# (1.5x slower at 20,000 payments, and growing with the store; BENCHMARKS.md, "End to end").
_WINDOWS = """
WITH q AS (
    SELECT * FROM unnest(%(accounts)s::text[], %(ats)s::timestamptz[]) WITH ORDINALITY AS q(account, at, i)
), bounds AS (
    SELECT q.i, q.account COLLATE "C" AS account, v.name, q.at - v.width AS lo, q.at AS hi,
        date_bin(%(bucket)s, q.at - v.width, 'epoch') + %(bucket)s AS fa,
        date_bin(%(bucket)s, q.at + interval '1 microsecond', 'epoch') AS fb
    FROM q CROSS JOIN (VALUES ('1h', interval '1 hour'), ('24h', interval '24 hours'),
                              ('7d', interval '7 days')) AS v(name, width)
), w AS (
    SELECT *, least(fa, hi + interval '1 microsecond') AS head_end, greatest(fa, fb) AS tail_start
    FROM bounds
), rows AS (
    SELECT w.i, w.name, r.direction, r.counterparty, r.currency, r.payments, r.total, r.near
    FROM w CROSS JOIN LATERAL (
        SELECT 'out' AS direction, f.payee AS counterparty, f.currency, f.payments, f.total, f.near
        FROM {flows} f WHERE f.payer = w.account AND f.bucket >= w.fa AND f.bucket < w.fb
        UNION ALL
        SELECT 'in', f.payer, f.currency, f.payments, f.total, 0
        FROM {flows} f WHERE f.payee = w.account AND f.bucket >= w.fa AND f.bucket < w.fb
        UNION ALL
        SELECT 'out', p.payee, p.currency, 1, p.amount, {near}
        FROM {payments} p WHERE p.payer = w.account AND p.ts > w.lo AND p.ts < w.head_end
        UNION ALL
        SELECT 'out', p.payee, p.currency, 1, p.amount, {near}
        FROM {payments} p WHERE p.payer = w.account AND p.ts >= w.tail_start AND p.ts <= w.hi
        UNION ALL
        SELECT 'in', p.payer, p.currency, 1, p.amount, 0
        FROM {payments} p WHERE p.payee = w.account AND p.ts > w.lo AND p.ts < w.head_end
        UNION ALL
        SELECT 'in', p.payer, p.currency, 1, p.amount, 0
        FROM {payments} p WHERE p.payee = w.account AND p.ts >= w.tail_start AND p.ts <= w.hi
    ) r
)
SELECT i, name, direction, currency, sum(payments)::bigint, sum(total), sum(near)::bigint,
    count(DISTINCT counterparty), grouping(direction, currency)
FROM rows GROUP BY GROUPING SETS ((i, name, direction, currency), (i, name, direction), (i, name))
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
        },
    )
    for i, name, direction, currency, payments, total, near, parties, level in await cur.fetchall():
        answer = answers[i - 1]
        window = answer["windows"][name]
        side = "sent" if direction == "out" else "received"
        if level == 0:
            window[side][currency] = money_text(total)
        elif level == 1:
            window[f"{side}_count"] = payments
            window[f"{side}_counterparties"] = parties
            if name == "24h" and direction == "out":
                answer["near_threshold_24h"] = near
        else:
            window["counterparties"] = parties
    for answer in answers:
        for window in answer["windows"].values():
            for side in ("sent", "received"):
                window[side] = dict(sorted(window[side].items()))
    return answers
