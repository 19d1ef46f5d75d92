"""Service C's store: per-account payment sides over event time, and the windowed aggregates query.

Each payment is stored twice, once per side: the payer's row (direction 'out', counterparty = payee) and
the payee's row (direction 'in', counterparty = payer), keyed by the record's Kafka (partition, offset,
direction). Event time is the payment's `ts`.

Too-late rule (exactly): the store keeps `max_event_ts`, the largest ts of every payment applied so far.
When a batch is applied, max_event_ts is first raised to include the whole batch, and then every payment
of the batch with ts <= max_event_ts - 7 days is too late: it is not stored and `late_dropped` grows by
one. So within a batch the order does not matter; across batches the apply order does. Late payments
inside the 7-day horizon are stored and do count.

Pruning: whenever max_event_ts rises, rows with ts <= max_event_ts - 7d - 1h are deleted. A query at
instant `at` needs rows with at - 7d < ts <= at, so answers are exact (equal to a computation over every
non-late payment) for every `at >= max_event_ts - 1h`; earlier instants may miss pruned rows.

Window of length w at instant `at` = payments with at - w < ts <= at.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from aml_app.services.store import (
    DECIMAL,
    MICROSECOND,
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

HORIZON = timedelta(days=7)
PRUNE_SLACK = timedelta(hours=1)
WINDOWS = {"1h": timedelta(hours=1), "24h": timedelta(hours=24), "7d": timedelta(days=7)}
_HORIZON_US = HORIZON // MICROSECOND
_PRUNE_US = (HORIZON + PRUNE_SLACK) // MICROSECOND

SCHEMA = """
CREATE TABLE IF NOT EXISTS sides (
    partition INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    direction TEXT NOT NULL CHECK (direction IN ('in', 'out')),
    account TEXT NOT NULL,
    counterparty TEXT NOT NULL,
    payment_id TEXT NOT NULL,
    amount TEXT NOT NULL,
    currency TEXT NOT NULL,
    ts INTEGER NOT NULL,
    PRIMARY KEY (partition, offset, direction)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS sides_by_account_ts ON sides (account, ts);
CREATE INDEX IF NOT EXISTS sides_by_ts ON sides (ts);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value INTEGER NOT NULL
)
"""

_INSERT = """
INSERT INTO sides (partition, offset, direction, account, counterparty, payment_id, amount, currency, ts)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
"""


#: (partition, offset, payment_id, payer, payee, amount text, currency, ts in microseconds)
PreparedPayment = tuple[int, int, str, str, str, str, str, int]


@dataclass(frozen=True)
class PaymentRow:
    """One valid payment from Kafka record (partition, offset); `ts` is UTC-aware."""

    partition: int
    offset: int
    payment_id: str
    payer: str
    payee: str
    amount: Decimal
    currency: str
    ts: datetime


def _check(row: PaymentRow, spans: Mapping[int, tuple[int, int]]) -> tuple[int, str]:
    """(ts in microseconds, amount text) for a well-formed row inside the covered offsets."""
    for name in ("payment_id", "payer", "payee", "currency"):
        value = getattr(row, name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"PaymentRow.{name} must be a non-empty string, got {value!r}")
    span = spans.get(row.partition)
    if span is None or not span[0] <= row.offset < span[1]:
        raise ValueError(
            f"PaymentRow at partition {row.partition} offset {row.offset} is outside the covered offsets"
        )
    amount = money(row.amount)
    if amount <= 0:
        raise ValueError(f"PaymentRow.amount must be greater than zero, got {amount}")
    return to_micros(row.ts), money_text(amount)


def _meta(conn: sqlite3.Connection, key: str) -> int | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else int(row[0])


def _set_meta(conn: sqlite3.Connection, key: str, value: int) -> None:
    conn.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (key, value),
    )


UNITS = 10_000  # stored amounts have at most four decimal places


def to_units(amount: str) -> int:
    """Stored money text ("12.50", "0.0001") as an exact integer number of 0.0001 units."""
    whole, _, fraction = amount.partition(".")
    return int(whole) * UNITS + int((fraction + "0000")[:4])


def units_text(units: int) -> str:
    """The canonical money text (as `money_text`) of a number of 0.0001 units."""
    whole, fraction = divmod(units, UNITS)
    return f"{whole}.{f'{fraction:04d}'.rstrip('0').ljust(2, '0')}"


class _Window:
    """Counts, exact per-currency sums (0.0001 units) and counterparties of one window, row by row."""

    __slots__ = ("counts", "parties", "sums")

    def __init__(self) -> None:
        self.counts = {"out": 0, "in": 0}
        self.sums: dict[str, dict[str, int]] = {"out": {}, "in": {}}
        self.parties: dict[str, set[str]] = {"out": set(), "in": set()}

    def add(self, direction: str, counterparty: str, units: int, currency: str) -> None:
        self.counts[direction] += 1
        sums = self.sums[direction]
        sums[currency] = sums.get(currency, 0) + units
        self.parties[direction].add(counterparty)

    def as_json(self) -> dict[str, Any]:
        sums = {d: {c: units_text(self.sums[d][c]) for c in sorted(self.sums[d])} for d in ("out", "in")}
        out, into = self.parties["out"], self.parties["in"]
        return {
            "sent_count": self.counts["out"],
            "sent": sums["out"],
            "received_count": self.counts["in"],
            "received": sums["in"],
            "counterparties": len(out | into),
            "sent_counterparties": len(out),
            "received_counterparties": len(into),
        }


def _empty_window() -> dict[str, Any]:
    return {
        "sent_count": 0,
        "sent": {},
        "received_count": 0,
        "received": {},
        "counterparties": 0,
        "sent_counterparties": 0,
        "received_counterparties": 0,
    }


class AggregatesStore:
    """Service C's SQLite store. Writes go through one lazily opened writer connection (`apply`); every
    query opens its own read-only connection, so the API can run while another process writes, and
    answers empty until the file exists."""

    def __init__(self, path: str, reporting_threshold: Decimal, threshold_band: Decimal) -> None:
        self.path = path
        self.reporting_threshold = money(reporting_threshold)
        self.threshold_band = money(threshold_band)
        if self.reporting_threshold <= 0 or not 0 <= self.threshold_band < 1:
            raise ValueError("reporting_threshold must be > 0 and threshold_band in [0, 1)")
        # threshold * (1 - band) <= amount < threshold is "near the threshold".
        self.near_low = DECIMAL.multiply(self.reporting_threshold, DECIMAL.subtract(1, self.threshold_band))
        # The same bounds in 0.0001 units (Decimals: an int compares with them exactly).
        self.near_low_units = DECIMAL.multiply(self.near_low, UNITS)
        self.threshold_units = DECIMAL.multiply(self.reporting_threshold, UNITS)
        self._writer = Writer(path, SCHEMA)

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> AggregatesStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def apply(self, rows: Iterable[PaymentRow], covered: Mapping[int, tuple[int, int]]) -> None:
        """Store the batch's payments (minus too-late ones) and advance the covered offsets, in one
        transaction. Raises StaleBatch, or ValueError for a malformed or duplicate row; either way nothing
        changes."""
        spans = validate_covered(covered)
        prepared = []
        for row in rows:
            ts, amount = _check(row, spans)
            prepared.append(
                (row.partition, row.offset, row.payment_id, row.payer, row.payee, amount, row.currency, ts)
            )
        self.apply_prepared(prepared, spans)

    def apply_prepared(self, rows: Sequence[PreparedPayment], covered: Mapping[int, tuple[int, int]]) -> None:
        """`apply` for rows already in stored form, as the pipeline's parser makes them on the executors.

        A row is (partition, offset, payment_id, payer, payee, amount as canonical money text, currency,
        ts in microseconds). The contract was checked by the parser; this only checks that each row lies
        inside the covered offsets and appears once, so the driver does no per-row conversion.
        """
        spans = validate_covered(covered)
        with self._writer.transaction() as conn:
            claim_offsets(conn, spans)
            stored_max = _meta(conn, "max_event_ts")
            new_max = max(
                [row[7] for row in rows] + ([] if stored_max is None else [stored_max]), default=None
            )
            if new_max is None:
                return
            cutoff = new_max - _HORIZON_US
            late = 0
            seen: set[tuple[int, int]] = set()
            inserts = []
            for partition, offset, payment_id, payer, payee, amount, currency, ts in rows:
                span = spans.get(partition)
                if span is None or not span[0] <= offset < span[1]:
                    raise ValueError(
                        f"PaymentRow at partition {partition} offset {offset} is outside the covered offsets"
                    )
                if (partition, offset) in seen:
                    raise ValueError(f"PaymentRow at partition {partition} offset {offset} is given twice")
                seen.add((partition, offset))
                if ts <= cutoff:
                    late += 1
                    continue
                inserts.append((partition, offset, "out", payer, payee, payment_id, amount, currency, ts))
                inserts.append((partition, offset, "in", payee, payer, payment_id, amount, currency, ts))
            try:
                conn.executemany(_INSERT, inserts)  # one statement for the batch: the per-row cost is the row
            except sqlite3.IntegrityError as exc:
                raise ValueError(f"a PaymentRow of this batch is already stored: {exc}") from exc
            if late:
                _set_meta(conn, "late_dropped", (_meta(conn, "late_dropped") or 0) + late)
            if stored_max is None or new_max > stored_max:
                _set_meta(conn, "max_event_ts", new_max)
                conn.execute("DELETE FROM sides WHERE ts <= ?", (new_max - _PRUNE_US,))

    def applied_offsets(self) -> dict[int, int]:
        """partition -> next offset applied ({} before the first apply)."""
        return read_snapshot(self.path, read_offsets)

    def status(self) -> dict[str, Any]:
        """store_exists, as_of, late_dropped and max_event_ts (ISO text or None), from one snapshot."""

        def query(conn: sqlite3.Connection | None) -> dict[str, Any]:
            late, high = self._counters(conn)
            return {
                "store_exists": conn is not None,
                "as_of": as_of_json(read_offsets(conn)),
                "late_dropped": late,
                "max_event_ts": None if high is None else iso_text(high),
            }

        return read_snapshot(self.path, query)

    @staticmethod
    def _counters(conn: sqlite3.Connection | None) -> tuple[int, int | None]:
        if conn is None or not has_table(conn, "meta"):
            return 0, None
        return _meta(conn, "late_dropped") or 0, _meta(conn, "max_event_ts")

    def aggregates(self, account: str, at: datetime) -> dict[str, Any]:
        """The answer for one account at instant `at`."""
        return self.aggregates_many([(account, at)])[0]

    def aggregates_many(self, queries: Sequence[tuple[str, datetime]]) -> list[dict[str, Any]]:
        """Answers for several (account, at), all from ONE read snapshot: one `as_of` proves all of them.

        A detector asks about a payer and a payee, for a batch of payments at once: one connection, one
        transaction and one round trip instead of one per question.
        """
        instants = [(account, to_micros(at)) for account, at in queries]

        def query(conn: sqlite3.Connection | None) -> list[dict[str, Any]]:
            late, _ = self._counters(conn)
            as_of = as_of_json(read_offsets(conn))
            stored = conn is not None and has_table(conn, "sides")
            return [
                self._answer(conn if stored else None, account, at_us, as_of, late)
                for account, at_us in instants
            ]

        return read_snapshot(self.path, query)

    def _answer(
        self, conn: sqlite3.Connection | None, account: str, at_us: int, as_of: dict[str, int], late: int
    ) -> dict[str, Any]:
        answer: dict[str, Any] = {
            "account": account,
            "at": iso_text(at_us),
            "as_of": as_of,
            "windows": {name: _empty_window() for name in WINDOWS},
            "near_threshold_24h": 0,
            "reporting_threshold": format(self.reporting_threshold, "f"),
            "threshold_band": format(self.threshold_band, "f"),
            "late_dropped": late,
        }
        if conn is None:
            return answer
        windows, near = self._windows(conn, account, at_us)
        answer["windows"] = {name: w.as_json() for name, w in zip(WINDOWS, windows, strict=True)}
        answer["near_threshold_24h"] = near
        return answer

    def _windows(self, conn: sqlite3.Connection, account: str, at_us: int) -> tuple[list[_Window], int]:
        """The windows and the near-threshold count, in one pass over the account's rows of the last 7 d.

        Sums are exact integers of 0.0001 units (stored amounts have at most four decimal places); the
        windows are nested, so a row counts in its smallest window and every larger one. (Decimal
        arithmetic per row and window cost most of a query.)
        """
        rows = conn.execute(
            "SELECT direction, counterparty, amount, currency, ts FROM sides "
            "WHERE account = ? AND ts > ? AND ts <= ?",
            (account, at_us - _HORIZON_US, at_us),
        ).fetchall()
        bounds = [at_us - length // MICROSECOND for length in WINDOWS.values()]
        windows = [_Window() for _ in WINDOWS]
        near = 0
        for direction, counterparty, amount, currency, ts in rows:
            units = to_units(amount)
            for k in range(len(windows)):
                if ts > bounds[k]:
                    for window in windows[k:]:
                        window.add(direction, counterparty, units, currency)
                    break
            if direction == "out" and ts > bounds[1] and self.near_low_units <= units < self.threshold_units:
                near += 1
        return windows, near
