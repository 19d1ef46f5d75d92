"""SQLite basics shared by the relations and aggregates stores.

Idempotency is "store the offsets with the results": every apply runs in ONE write transaction that also
checks and advances `applied_offsets(partition, next_offset)`. A batch says which offsets it covers,
`covered[p] = (start, end)` (start inclusive, end exclusive). It is accepted only if, for every partition,
the stored next offset equals `start` (or the partition has no row yet: the first batch may start at the
group's committed offset or at the log start). Otherwise it raises `StaleBatch` and changes nothing, so
a replayed batch can never be counted twice and a gap can never be papered over.

The writer connection uses WAL with synchronous=FULL: when the caller commits Kafka offsets after an
apply, the data and the offsets it claims are on disk. Readers open the file read-only (`mode=ro`) and
read inside an explicit transaction, so a query sees one snapshot and never blocks the writer.

Timestamps are stored as integer microseconds since the Unix epoch (UTC) and shown as
`2026-01-02T03:04:05.123456Z` (always six fractional digits). Money is exact `Decimal`, stored as TEXT,
and shown by `money_text`: at least two decimal places, more only when needed ("12.50", "0.0001", "100.00").
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from decimal import Context, Decimal, Inexact, InvalidOperation, Overflow
from pathlib import Path
from typing import TypeVar

BUSY_TIMEOUT_MS = 10_000
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)
# Sums of amounts (< 1e15, 4 decimal places) stay far inside 60 digits; rounding raises, never silent.
DECIMAL = Context(prec=60, traps=[Inexact, InvalidOperation, Overflow])
_CENT = Decimal("0.01")

T = TypeVar("T")

_OFFSETS_SCHEMA = """
CREATE TABLE IF NOT EXISTS applied_offsets (
    partition INTEGER PRIMARY KEY,
    next_offset INTEGER NOT NULL
)
"""


class StaleBatch(RuntimeError):
    """A batch whose covered offsets do not start where the store left off (a replay or a gap)."""


# --- values ---------------------------------------------------------------------------------------


def to_micros(when: datetime) -> int:
    """Microseconds since the epoch for a timezone-aware datetime; a naive one is a caller bug."""
    if not isinstance(when, datetime) or when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"timestamp must be a timezone-aware datetime, got {when!r}")
    return (when - EPOCH) // MICROSECOND


def from_micros(micros: int) -> datetime:
    return EPOCH + timedelta(microseconds=micros)


def iso_text(micros: int) -> str:
    """`2026-01-02T03:04:05.123456Z`: UTC, always six fractional digits."""
    return from_micros(micros).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def money(value: object) -> Decimal:
    """An exact, finite Decimal from a Decimal or a decimal string (never from a float)."""
    if isinstance(value, float) or isinstance(value, bool):
        raise ValueError(f"money must be a Decimal or a decimal string, not {type(value).__name__}")
    try:
        result = value if isinstance(value, Decimal) else Decimal(str(value))
    except InvalidOperation:
        raise ValueError(f"not a decimal number: {value!r}") from None
    if not result.is_finite():
        raise ValueError(f"not a finite decimal number: {value!r}")
    return result


def money_text(value: Decimal) -> str:
    """Canonical text for an amount: no exponent, at least two decimal places, trailing zeros beyond removed.

    The same number always gives the same text, whatever scale it was computed with
    ("12.5", "12.50" and "12.5000" all give "12.50"; "0.0001" stays "0.0001").
    """
    reduced = DECIMAL.plus(value).normalize(DECIMAL)
    exponent = reduced.as_tuple().exponent
    if isinstance(exponent, int) and exponent > -2:
        reduced = reduced.quantize(_CENT, context=DECIMAL)
    text = format(reduced, "f")
    return "0.00" if text in {"-0.00", "-0"} else text


def dec_add(a: str | None, b: str | None) -> str | None:
    """SQL function `dec_add(a, b)`: exact decimal addition of two TEXT amounts."""
    if a is None:
        return b
    if b is None:
        return a
    return money_text(DECIMAL.add(Decimal(a), Decimal(b)))


# --- connections and transactions -----------------------------------------------------------------


def connect(path: str, readonly: bool = False) -> sqlite3.Connection:
    """Open the store file.

    Writer (default): creates the parent folder and the file, WAL journal, synchronous=FULL, and the
    `dec_add` function. Reader (`readonly=True`): opens an existing file with `mode=ro`; it never creates
    the file (raises sqlite3.OperationalError if there is none). Both use `isolation_level=None`: every
    transaction is an explicit BEGIN ... COMMIT (see `write_transaction` and `read_transaction`).
    """
    if readonly:
        uri = Path(path).resolve().as_uri() + "?mode=ro"
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    else:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if not readonly:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"could not switch {path} to WAL journal mode (got {mode})")
            conn.execute("PRAGMA synchronous = FULL")
        conn.create_function("dec_add", 2, dec_add, deterministic=True)
    except BaseException:
        conn.close()
        raise
    return conn


@contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT; any exception (also from COMMIT) rolls everything back and propagates."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # SQLite may already have rolled back (e.g. disk full)
            conn.execute("ROLLBACK")
        raise


@contextmanager
def read_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN ... ROLLBACK (nothing to keep): every SELECT inside sees the same snapshot."""
    conn.execute("BEGIN")
    try:
        yield conn
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")


_readers = threading.local()


def _reader(path: str) -> sqlite3.Connection | None:
    """This thread's read-only connection to `path`, opened once and kept while the file stays the same.

    Opening a connection (and its pragmas and functions) cost more than a typical query; the APIs answer
    from a small pool of threads, so one kept connection per thread and file is enough. A file that was
    replaced (another inode) gets a fresh connection; a missing file gets None.
    """
    try:
        inode = os.stat(path).st_ino
    except FileNotFoundError:
        return None
    cache: dict[str, tuple[int, sqlite3.Connection]] = _readers.__dict__.setdefault("connections", {})
    kept = cache.get(path)
    if kept is not None and kept[0] == inode:
        return kept[1]
    if kept is not None:
        kept[1].close()
    try:
        conn = connect(path, readonly=True)
    except sqlite3.OperationalError:
        if not os.path.exists(path):  # removed between the check and the open
            return None
        raise
    cache[path] = (inode, conn)
    return conn


def read_snapshot(path: str, query: Callable[[sqlite3.Connection | None], T]) -> T:
    """Run `query(conn)` in one read transaction on this thread's read-only connection.

    If the store file does not exist yet, `query(None)` is called instead: the caller answers "empty".
    """
    conn = _reader(path)
    if conn is None:
        return query(None)
    try:
        with read_transaction(conn):
            return query(conn)
    except sqlite3.Error:
        # A broken connection is not kept: the next read opens a fresh one.
        _readers.__dict__.get("connections", {}).pop(path, None)
        conn.close()
        raise


def has_table(conn: sqlite3.Connection, name: str) -> bool:
    row = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone()
    return row is not None


class Writer:
    """One lazily opened writer connection, shared by threads under a lock (Spark calls from any thread)."""

    def __init__(self, path: str, schema: str) -> None:
        self.path = path
        self._schema = schema
        self._conn: sqlite3.Connection | None = None
        self.lock = threading.Lock()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction on the shared connection, under the lock. After an SQLite error the
        connection is closed, and the next transaction opens a fresh one."""
        with self.lock:
            conn = self._connection()
            try:
                with write_transaction(conn):
                    yield conn
            except sqlite3.Error:
                self._conn = None
                conn.close()
                raise

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = connect(self.path)
            try:
                with write_transaction(conn):
                    conn.execute(_OFFSETS_SCHEMA)
                    for statement in self._schema.split(";"):
                        if statement.strip():
                            conn.execute(statement)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def close(self) -> None:
        with self.lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


# --- applied offsets ------------------------------------------------------------------------------


def read_offsets(conn: sqlite3.Connection | None) -> dict[int, int]:
    """partition -> next offset applied; {} when the store (or its table) does not exist yet."""
    if conn is None or not has_table(conn, "applied_offsets"):
        return {}
    rows = conn.execute("SELECT partition, next_offset FROM applied_offsets ORDER BY partition")
    return {int(p): int(o) for p, o in rows}


def as_of_json(offsets: Mapping[int, int]) -> dict[str, int]:
    """`applied_offsets` with JSON keys: {"0": 12, "1": 7}, in partition order."""
    return {str(p): offsets[p] for p in sorted(offsets)}


def validate_covered(covered: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    checked: dict[int, tuple[int, int]] = {}
    for partition, span in covered.items():
        if isinstance(partition, bool) or not isinstance(partition, int) or partition < 0:
            raise ValueError(f"covered: partition must be a non-negative integer, got {partition!r}")
        start, end = span
        for name, value in (("start", start), ("end", end)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"covered[{partition}]: {name} offset must be a non-negative integer")
        if start > end:
            raise ValueError(f"covered[{partition}] = ({start}, {end}): start is after end")
        checked[partition] = (start, end)
    return checked


def claim_offsets(conn: sqlite3.Connection, covered: Mapping[int, tuple[int, int]]) -> None:
    """The optimistic check and the advance, inside the caller's write transaction.

    Raises StaleBatch (the caller's transaction then rolls back) unless every partition's stored next
    offset equals the batch's start; a partition without a row accepts any start. Then sets
    next_offset = end for every covered partition, including ones whose range held no rows.
    """
    problems = []
    for partition, (start, end) in sorted(covered.items()):
        row = conn.execute(
            "SELECT next_offset FROM applied_offsets WHERE partition = ?", (partition,)
        ).fetchone()
        if row is None or row[0] == start:
            continue
        stored = row[0]
        if stored > start:
            problems.append(
                f"partition {partition}: batch covers offsets {start}..{end - 1} but offsets up to "
                f"{stored - 1} are already applied (replay)"
            )
        else:
            problems.append(
                f"partition {partition}: batch starts at offset {start} but the store has applied only up "
                f"to {stored - 1}; offsets {stored}..{start - 1} would be skipped (gap)"
            )
    if problems:
        raise StaleBatch("stale batch, nothing applied: " + "; ".join(problems))
    conn.executemany(
        "INSERT INTO applied_offsets (partition, next_offset) VALUES (?, ?) "
        "ON CONFLICT(partition) DO UPDATE SET next_offset = excluded.next_offset",
        [(partition, end) for partition, (_, end) in sorted(covered.items())],
    )
