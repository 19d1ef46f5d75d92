"""PostgreSQL basics shared by the stores of Services B (relations) and C (aggregates).

Each service keeps its tables in a schema of its own (`relations`, `aggregates`) of the database that
`AML_STORE_URL` names, next to three tables that every store has:

- `schema_version`: which of the service's migrations are applied. The pipeline applies the missing ones at
  start-up, under an advisory lock, so two starting pipelines cannot race; the APIs never change a schema.
- `applied_offsets(partition, next_offset)`: per Kafka partition, the next offset the store has applied.
  A micro-batch's results and these offsets are written in ONE transaction ("store the offsets with the
  results"), so the store says exactly which payments it holds: that is the `as_of` of every answer.
- `meta(key, value)`: facts about the store, e.g. the topic it was built from.

Writes (the pipeline, on the Spark driver) use a plain connection; reads (the APIs) use asyncio
connections in REPEATABLE READ, READ ONLY transactions, so an answer and its `as_of` come from one
snapshot. Instants are `timestamptz` (microseconds, shown as `2026-01-02T03:04:05.123456Z`); money is
`numeric`, exact, shown by `money_text` ("12.50", "0.0001").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from aml_app.backoff import Backoff

log = logging.getLogger("aml_app.store")

T = TypeVar("T")

_CENT = Decimal("0.01")
CONNECT_TIMEOUT = 5
# How long a write waits for the database to come back before giving up (the pipeline then fails).
UNAVAILABLE_PATIENCE = 600.0
#: Seconds a statement of the writer may run (a catch-up batch's COPY and merge take seconds), and wait
#: for a lock (another writer, a migration, an operator's LOCK): then the server cancels it, and the
#: write is retried within UNAVAILABLE_PATIENCE like a server that went away.
WRITE_TIMEOUT = 300.0
LOCK_TIMEOUT = 60.0
#: TCP liveness of the writer's connection, unless its URL sets them: a server that vanished (a host
#: down, a network partition) breaks the connection in about 30 s instead of holding a write for hours.
LIVENESS = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}

COMMON_TABLES = """
CREATE TABLE IF NOT EXISTS {schema}.applied_offsets (
    partition integer PRIMARY KEY,
    next_offset bigint NOT NULL CHECK (next_offset >= 0)
);
CREATE TABLE IF NOT EXISTS {schema}.meta (
    key text PRIMARY KEY,
    value text NOT NULL
)
"""


class StoreError(RuntimeError):
    """A store problem a person has to act on; the message says what to do."""


class StoreVersionMismatch(StoreError):
    """The store's schema is at another version than this program's (an upgrade in progress): reading
    it would fail or answer wrongly, so the APIs refuse with this sentence until the versions agree."""


class StaleBatch(StoreError):
    """A batch whose covered offsets do not start where the store left off (a replay or a gap)."""


# --- values ---------------------------------------------------------------------------------------


def money_text(value: Decimal) -> str:
    """Canonical text for an amount: no exponent, at least two decimal places, trailing zeros beyond removed.

    ("12.5", "12.50" and "12.5000" all give "12.50"; "0.0001" stays "0.0001").
    """
    text = format(value, "f")
    if text[-3:-2] == "." and text != "-0.00":  # in cents already, as most sums are: canonical as it is
        return text
    reduced = value.normalize()
    exponent = reduced.as_tuple().exponent
    if isinstance(exponent, int) and exponent > -2:
        reduced = reduced.quantize(_CENT)
    text = format(reduced, "f")
    return "0.00" if text in {"-0.00", "-0"} else text


def iso_text(when: datetime) -> str:
    """`2026-01-02T03:04:05.123456Z`: UTC, always four digits of year and six fractional digits (the
    year 1 too, which strftime writes as "1")."""
    return when.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def as_of_json(offsets: Mapping[int, int]) -> dict[str, int]:
    """`applied_offsets` with JSON keys: {"0": 12, "1": 7}, in partition order."""
    return {str(p): offsets[p] for p in sorted(offsets)}


# --- schema ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schema:
    """A service's tables: its PostgreSQL schema name and its migrations, in order (version = index + 1).

    A migration is SQL with `{schema}` where the schema name goes; applied migrations are never edited,
    a change is a new migration at the end.
    """

    name: str
    migrations: Sequence[str]

    @property
    def version(self) -> int:
        return len(self.migrations)

    def statements(self, migration: str) -> list[sql.Composed]:
        text = migration.replace("{schema}", "{}")
        return [
            sql.SQL(part.strip()).format(*[sql.Identifier(self.name)] * part.count("{}"))
            for part in text.split(";")
            if part.strip()
        ]


def newer_than_program(schema: Schema, version: int) -> str:
    """What to do about a store at `version`, newer than this program's schema (the pipeline and the APIs
    alike refuse it)."""
    return (
        f"the {schema.name} store has schema version {version}, newer than this program's "
        f"{schema.version}: run the newer version of aml-app, or rebuild the store"
    )


def migrate(conn: psycopg.Connection, schema: Schema) -> int:
    """Create the schema or bring it to the newest version; returns the version it had before (0: new).

    Runs in one transaction under an advisory lock named after the schema: concurrent starts wait for
    each other, and a failed migration leaves nothing half-done. A store newer than this code refuses.
    """
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"aml-schema:{schema.name}",))
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema.name)))
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {}.schema_version (version integer NOT NULL)").format(
                sql.Identifier(schema.name)
            )
        )
        row = conn.execute(
            sql.SQL("SELECT max(version) FROM {}.schema_version").format(sql.Identifier(schema.name))
        ).fetchone()
        before = int(row[0]) if row and row[0] is not None else 0
        if before > schema.version:
            raise StoreError(newer_than_program(schema, before))
        if before == 0:
            for statement in Schema(schema.name, [COMMON_TABLES]).statements(COMMON_TABLES):
                conn.execute(statement)
        for version in range(before + 1, schema.version + 1):
            for statement in schema.statements(schema.migrations[version - 1]):
                conn.execute(statement)
            conn.execute(
                sql.SQL("INSERT INTO {}.schema_version (version) VALUES (%s)").format(
                    sql.Identifier(schema.name)
                ),
                (version,),
            )
        if before < schema.version:
            log.info("%s store: schema version %d -> %d", schema.name, before, schema.version)
    return before


def drop(conn: psycopg.Connection, schema: Schema) -> None:
    """Remove the service's schema and everything in it (a rebuild starts from here)."""
    with conn.transaction():
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema.name)))


def version_table(schema: Schema) -> str:
    """The name of the service's `schema_version` table, for `to_regclass`: there when the tables are."""
    return f'"{schema.name}".schema_version'


def exists(conn: psycopg.Connection, schema: Schema) -> bool:
    """Whether the service's tables are there (at any version)."""
    row = conn.execute("SELECT to_regclass(%s)", (version_table(schema),)).fetchone()
    return bool(row and row[0] is not None)


# --- offsets --------------------------------------------------------------------------------------


def read_offsets(conn: psycopg.Connection, schema: Schema) -> dict[int, int]:
    """partition -> next offset applied; {} for a store without tables."""
    if not exists(conn, schema):
        return {}
    rows = conn.execute(
        sql.SQL("SELECT partition, next_offset FROM {}.applied_offsets").format(sql.Identifier(schema.name))
    ).fetchall()
    return {int(p): int(o) for p, o in rows}


def claim_offsets(conn: psycopg.Connection, schema: Schema, covered: Mapping[int, tuple[int, int]]) -> None:
    """The optimistic check and the advance, inside the caller's transaction.

    Locks the partitions' rows, then raises StaleBatch (the caller's transaction rolls back) unless every
    partition's stored next offset equals the batch's start; a partition without a row accepts any start.
    Then sets next_offset = end for every covered partition.
    """
    table = sql.SQL("{}.applied_offsets").format(sql.Identifier(schema.name))
    partitions = sorted(covered)
    stored: dict[int, int] = dict(
        conn.execute(
            sql.SQL("SELECT partition, next_offset FROM {} WHERE partition = ANY(%s) FOR UPDATE").format(
                table
            ),
            (partitions,),
        ).fetchall()
    )
    problems = []
    for p in partitions:
        start, end = covered[p]
        if not 0 <= start <= end:
            raise ValueError(f"covered[{p}] = ({start}, {end}) is not a range of offsets")
        have = stored.get(p)
        if have is None or have == start:
            continue
        if have > start:
            problems.append(f"partition {p}: offsets {start}..{end - 1} are already applied up to {have - 1}")
        else:
            problems.append(
                f"partition {p}: the batch starts at {start} but the store holds only up to {have - 1}"
            )
    if problems:
        raise StaleBatch(f"{schema.name}: stale batch, nothing applied: " + "; ".join(problems))
    with conn.cursor() as cur:
        cur.executemany(
            sql.SQL(
                "INSERT INTO {} (partition, next_offset) VALUES (%s, %s) "
                "ON CONFLICT (partition) DO UPDATE SET next_offset = excluded.next_offset"
            ).format(table),
            [(p, covered[p][1]) for p in partitions],
        )


def read_meta(conn: Any, schema: Schema) -> dict[str, str]:
    rows = conn.execute(
        sql.SQL("SELECT key, value FROM {}.meta").format(sql.Identifier(schema.name))
    ).fetchall()
    return dict(rows)


def write_meta(conn: psycopg.Connection, schema: Schema, values: Mapping[str, str]) -> None:
    with conn.cursor() as cur:
        cur.executemany(
            sql.SQL(
                "INSERT INTO {}.meta (key, value) VALUES (%s, %s) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
            ).format(sql.Identifier(schema.name)),
            list(values.items()),
        )


# --- the writer -----------------------------------------------------------------------------------

#: The planner's statistics must follow the tables as the pipeline fills them. Autovacuum analyzes a table
#: at most once a minute and only after 10 % of it changed, so a fresh store is read for its first minutes
#: with no statistics at all: B's chain query then took 1.7 s for 100 accounts instead of 2 ms (a plan of
#: sequential scans; BENCHMARKS.md, "End to end"). So the writer analyzes its tables after a batch once the
#: records applied since its last ANALYZE reach ANALYZE_GROWTH of what the store held then (and at least
#: ANALYZE_MIN), and after the first batch of its run.
ANALYZE_MIN = 1000
ANALYZE_GROWTH = 0.5


class Writer:
    """The pipeline's connection to one service's store: applies batches, waits out outages.

    One connection, opened lazily and reopened after a failure. A batch is applied in one transaction
    with its offsets (`apply`); if the server is unreachable, `apply` waits and tries again until the
    server is back (nothing is committed to Kafka meanwhile, and the Spark query simply pauses), unless
    the pipeline is stopping (`give_up`): a SIGTERM must not wait out an outage.
    """

    def __init__(self, url: str, schema: Schema, patience: float = UNAVAILABLE_PATIENCE) -> None:
        self.url = url
        self.schema = schema
        self.patience = patience
        self._conn: psycopg.Connection | None = None
        self.outages = 0
        #: Records (offsets) the store held at this run's last ANALYZE; None before the first.
        self._analyzed_at: int | None = None
        self.analyzes = 0
        self._giving_up = threading.Event()

    def give_up(self) -> None:
        """Stop waiting for an unavailable server: the wait under way, and any later one, raises StoreError
        (the batch is then not applied, and nothing of it is committed to Kafka)."""
        self._giving_up.set()

    def connection(self) -> psycopg.Connection:
        """The writer's connection, made on first use and after a failure, with the deadlines of a
        write: the statement and lock timeouts on the server, TCP liveness on the client."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            from psycopg.conninfo import conninfo_to_dict, make_conninfo

            given = conninfo_to_dict(self.url)
            liveness = {k: v for k, v in LIVENESS.items() if k not in given}
            url = make_conninfo(self.url, **liveness)
            conn = psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT, autocommit=True)
            try:
                for name, seconds in (("statement_timeout", WRITE_TIMEOUT), ("lock_timeout", LOCK_TIMEOUT)):
                    conn.execute("SELECT set_config(%s, %s, false)", (name, f"{round(seconds * 1000)}ms"))
                conn.autocommit = False
            except BaseException:  # not ours yet: `close` would not see it, and each retry would leave one
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def patiently(self, what: str, action: Callable[[psycopg.Connection], T]) -> T:
        """Run `action(conn)`; while the database is unavailable, reconnect and retry with backoff."""
        deadline = time.monotonic() + self.patience
        backoff = Backoff(0.2, 5.0)
        while True:
            try:
                return action(self.connection())
            except (psycopg.OperationalError, psycopg.errors.AdminShutdown) as exc:
                self.close()
                if self._giving_up.is_set():
                    raise StoreError(
                        f"the {self.schema.name} store at {redacted(self.url)} is unavailable ({exc}), and "
                        "the pipeline is stopping; the batch was not applied"
                    ) from exc
                delay = backoff.next()
                if time.monotonic() + delay > deadline:
                    raise StoreError(
                        f"the {self.schema.name} store at {redacted(self.url)} has been unavailable for "
                        f"{self.patience:.0f} s ({exc}); giving up"
                    ) from exc
                self.outages += 1
                log.warning(
                    "%s store unavailable while %s (%s); retrying in %.1f s",
                    self.schema.name,
                    what,
                    exc,
                    delay,
                )
                self._giving_up.wait(delay)

    def migrate(self) -> int:
        return self.patiently("migrating", lambda conn: migrate(conn, self.schema))

    def applied_offsets(self) -> dict[int, int]:
        def read(conn: psycopg.Connection) -> dict[int, int]:
            with conn.transaction():
                return read_offsets(conn, self.schema)

        return self.patiently("reading offsets", read)

    def apply(
        self, covered: Mapping[int, tuple[int, int]], write: Callable[[psycopg.Connection], None]
    ) -> None:
        """`write(conn)` and the offsets claim in one transaction; retried while the server is away.

        When the connection breaks during COMMIT, whether it committed is unknown: the retry then finds
        the store's offsets already at the batch's ends, which means it did, and stops there.
        """

        def attempt(conn: psycopg.Connection) -> int | None:
            with conn.transaction():
                stored: dict[int, int] = dict(
                    conn.execute(
                        sql.SQL("SELECT partition, next_offset FROM {}.applied_offsets").format(
                            sql.Identifier(self.schema.name)
                        )
                    ).fetchall()
                )
                if covered and all(stored.get(p) == end != start for p, (start, end) in covered.items()):
                    log.info(
                        "%s: this batch is already applied (its commit succeeded before a failure)",
                        self.schema.name,
                    )
                    return None
                claim_offsets(conn, self.schema, covered)
                write(conn)
                # What the store holds now, in records (offsets): what the statistics must follow.
                return sum({**stored, **{p: end for p, (_, end) in covered.items()}}.values())

        held = self.patiently("applying a batch", attempt)
        if held is not None:
            self._analyze_if_grown(held)

    def _analyze_if_grown(self, held: int) -> None:
        last = self._analyzed_at
        if last is not None and held - last < max(ANALYZE_MIN, ANALYZE_GROWTH * last):
            return

        def analyze(conn: psycopg.Connection) -> None:
            with conn.transaction():
                tables = conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY tablename",
                    (self.schema.name,),
                ).fetchall()
                for (table,) in tables:
                    conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(self.schema.name, table)))

        self.patiently("analyzing the tables", analyze)
        self._analyzed_at = held
        self.analyzes += 1


#: The connection parameters a message may show: where the store is and how it is reached. Every other
#: one (password, sslpassword, passfile, options, scram_*, oauth_*, sslkeylogfile, any parameter a later
#: libpq adds) is shown as "***": a secret, where one is kept, or free text that may hold one.
SHOWN_PARAMETERS = frozenset(
    """
    host hostaddr port dbname user service application_name fallback_application_name connect_timeout
    client_encoding target_session_attrs load_balance_hosts keepalives keepalives_idle keepalives_interval
    keepalives_count tcp_user_timeout replication sslmode sslnegotiation sslcompression sslcert sslkey
    sslcertmode sslrootcert sslcrl sslcrldir sslsni requirepeer require_auth channel_binding gssencmode
    gsslib gssdelegation krbsrvname min_protocol_version max_protocol_version ssl_min_protocol_version
    ssl_max_protocol_version
    """.split()
)


def redacted(url: str) -> str:
    """The URL for messages and /health: host, port, database, user and the parameters that say how the
    store is reached (`SHOWN_PARAMETERS`); every other parameter's value is "***"."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        parts = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "(unparsable store URL)"
    return make_conninfo("", **{k: v if k in SHOWN_PARAMETERS else "***" for k, v in parts.items()})


# --- the readers ----------------------------------------------------------------------------------

#: The pseudo meta key under which a snapshot reads the schema's version (no real key has this name).
_VERSION_KEY = "schema_version"
#: A snapshot's transaction, begun in the message of its first statement (`_begin`).
_BEGIN = sql.SQL("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; {}")


def _in_pipeline(conn: Any) -> bool:
    return not conn.closed and conn.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF


async def _out_of_pipeline(conn: Any) -> None:
    """The pool's check of a connection it hands out: one still in pipeline mode fails every snapshot
    it is given (its BEGIN goes in one message with a statement, which pipeline mode refuses), so it is
    closed, and the pool opens another. `Reader._snapshot` closes the one it knows to leave so (seen
    under a chaos soak's rebalances, which cancel questions whose worker left); this is the net for
    any other way."""
    if _in_pipeline(conn):
        log.warning("closing a store connection left in pipeline mode: %s", conn)
        await conn.close()
        raise psycopg.OperationalError("the connection was left in pipeline mode")


async def _begin(cur: Any, begin_and_first: sql.Composable) -> None:
    """Run `_BEGIN` with its first statement in one message (the simple query protocol, hence no
    parameters: the statement holds its values in its text), leaving the cursor on that statement's
    result."""
    await cur.execute(begin_and_first, prepare=False)
    cur.nextset()


@dataclass
class Snapshot:
    """One read transaction: a cursor, and what every answer needs from the same snapshot."""

    cur: Any
    #: The service's tables, or None while the store has none (every answer is then empty).
    schema: Schema | None
    as_of: dict[int, int]
    meta: dict[str, str]


class Sent:
    """Statements of one snapshot sent together, each on a cursor of its own, read once all are sent: in a
    snapshot (which runs in psycopg's pipeline mode) a request waits for the server once for them all
    rather than once each. Elsewhere each runs as it is sent. The cursors close with the block."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.cursors: list[Any] = []

    async def __aenter__(self) -> Sent:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for cur in self.cursors:
            await cur.close()

    async def send(self, query: Any, params: Mapping[str, Any]) -> Any:
        """Queue `query` on a new cursor, returned for its results."""
        cur = self.conn.cursor()
        self.cursors.append(cur)
        await cur.execute(query, params)
        return cur


#: How long a read statement may run by default (the APIs set their own bound, `AML_API_TIMEOUT`): the
#: server stops it even if no one is left to cancel it.
STATEMENT_TIMEOUT = 10.0
#: How long /health and the store check wait for their own connection, and how long their statements may
#: run: they must answer (or fail) quickly whatever the queries do.
HEALTH_TIMEOUT = 2.0


class Reader:
    """An API's pools of connections to one service's store; every read is one REPEATABLE READ snapshot.

    `pool` serves the questions (`snapshot`): `max_connections` at most, a request waits up to `timeout`
    for one, and every statement stops after `statement_timeout` seconds on the server. `health_pool`,
    of its own, serves /health and the store check (`health_snapshot`): questions that fill `pool` do
    not make the service look down to a load balancer, nor blind the store-loss guard.

    The pools open lazily and keep trying in the background, so an API starts (and answers 503 with a
    sentence) while the database is away, and serves again as soon as it is back. The connections name
    themselves in `pg_stat_activity` (`application_name` "aml-app <schema> API" and "... health", unless
    the URL gives one).
    """

    def __init__(
        self,
        url: str,
        schema: Schema,
        max_connections: int = 8,
        timeout: float = 5.0,
        statement_timeout: float = STATEMENT_TIMEOUT,
    ) -> None:
        self.url = url
        self.schema = schema
        self.statement_timeout = statement_timeout
        self.pool = self._pool(f"aml-app {schema.name} API", max_connections, timeout, statement_timeout)
        self.health_pool = self._pool(f"aml-app {schema.name} health", 2, HEALTH_TIMEOUT, HEALTH_TIMEOUT)
        #: Whether the last snapshot that looked found the store's tables.
        self.tables_seen = False
        # What a snapshot sends first: BEGIN in one message with the statement reading the store's state
        # (offsets, meta rows, schema version), or with the check that its tables are there.
        self._state = sql.SQL(
            "SELECT NULL::text, NULL::text, partition, next_offset FROM {0}.applied_offsets"
            " UNION ALL SELECT key, value, NULL, NULL FROM {0}.meta"
            " UNION ALL SELECT {1}, max(version)::text, NULL, NULL FROM {0}.schema_version"
        ).format(sql.Identifier(schema.name), sql.Literal(_VERSION_KEY))
        self._begin_state = _BEGIN.format(self._state)
        check = sql.SQL("SELECT to_regclass({})").format(sql.Literal(version_table(schema)))
        self._begin_check = _BEGIN.format(check)

    def _pool(self, name: str, size: int, timeout: float, statement_timeout: float) -> Any:
        from psycopg_pool import AsyncConnectionPool

        async def configure(conn: Any) -> None:
            # A session setting, so that it holds for every statement of every transaction.
            await conn.execute(
                "SELECT set_config('statement_timeout', %s, false)", (f"{round(statement_timeout * 1000)}ms",)
            )
            await conn.commit()
            # Each snapshot begins its own transaction (REPEATABLE READ, READ ONLY) in the message of its
            # first statement: psycopg must not begin one before it.
            await conn.set_autocommit(True)

        return AsyncConnectionPool(
            self.url,
            min_size=1,
            max_size=size,
            timeout=timeout,
            open=False,
            configure=configure,
            check=_out_of_pipeline,
            kwargs={"connect_timeout": CONNECT_TIMEOUT, "fallback_application_name": name},
        )

    async def open(self) -> None:
        await self.pool.open(wait=False)
        await self.health_pool.open(wait=False)

    async def close(self) -> None:
        await self.pool.close()
        await self.health_pool.close()

    def busy(self) -> bool:
        """Whether every connection the questions' pool may have is open and in use (rather than some
        missing because the store cannot be reached)."""
        stats = self.pool.get_stats()
        return bool(stats["pool_size"] >= stats["pool_max"] and stats["pool_available"] == 0)

    def snapshot(self) -> AbstractAsyncContextManager[Snapshot]:
        """One read transaction from the questions' pool."""
        return self._snapshot(self.pool)

    def health_snapshot(self) -> AbstractAsyncContextManager[Snapshot]:
        """One read transaction from the pool of /health and the store check."""
        return self._snapshot(self.health_pool)

    @asynccontextmanager
    async def _snapshot(self, pool: Any) -> AsyncIterator[Snapshot]:
        """A snapshot of the store as it is, in as few round trips as the store allows (a request waits
        for each of them, and more so on a busy machine, where each is two wake-ups: the server's
        backend, then this process): the transaction's BEGIN goes in one message with the statement
        that reads the store's state (offsets, meta, version). The answer's statements then run in
        psycopg's pipeline mode: those sent together (`Sent`) cost one round trip, and COMMIT goes with
        the pipeline's closing Sync. Once a snapshot has found the store's tables, the next ones read
        them without asking first whether they are there; one that finds them gone (a rebuild dropped
        them) looks again as the first one did."""
        async with pool.connection() as conn, conn.cursor() as cur:
            try:
                snapshot = await self._open(cur)
                async with conn.pipeline():
                    yield snapshot
                    await cur.execute("COMMIT")
            except BaseException:
                if _in_pipeline(conn):
                    # A cancellation that lands as psycopg enters pipeline mode (its wait yields once
                    # more after the mode is entered, on a loop busy for 5 ms) leaves the connection in
                    # it, with no exit to come. close() does not yield, so no second cancellation stops
                    # it; the pool discards a closed connection.
                    await conn.close()
                elif not conn.closed:  # a closed one the pool discards
                    with contextlib.suppress(psycopg.Error):
                        await cur.execute("ROLLBACK")
                raise

    async def _open(self, cur: Any) -> Snapshot:
        """Begin the snapshot's transaction on `cur` and read the store's state in it."""
        if self.tables_seen:
            try:
                await _begin(cur, self._begin_state)
                return self._snapshot_of(cur, await cur.fetchall())
            except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
                await cur.execute("ROLLBACK")
                self.tables_seen = False
        await _begin(cur, self._begin_check)
        row = await cur.fetchone()
        if row is None or row[0] is None:
            return Snapshot(cur, None, {}, {})
        await cur.execute(self._state, prepare=False)
        snapshot = self._snapshot_of(cur, await cur.fetchall())
        self.tables_seen = True
        return snapshot

    def _snapshot_of(self, cur: Any, state: list[tuple[Any, ...]]) -> Snapshot:
        """The snapshot from the rows of its state statement, read in it: a store seen at this program's
        version has its tables."""
        as_of: dict[int, int] = {}
        meta: dict[str, str] = {}
        for key, value, partition, offset in state:
            if key is None:
                as_of[int(partition)] = int(offset)
            else:
                meta[key] = value
        self.refuse_other_version(int(meta.pop(_VERSION_KEY) or 0))
        return Snapshot(cur, self.schema, as_of, meta)

    def refuse_other_version(self, version: int) -> None:
        """Raise `StoreVersionMismatch` unless the store is at this program's schema version."""
        name, ours = self.schema.name, self.schema.version
        if version < ours:
            raise StoreVersionMismatch(
                f"the {name} store has schema version {version} and this program reads version {ours}: "
                "the pipeline of this version migrates the store when it starts (aml-app pipeline); "
                "until then this API answers nothing."
            )
        if version > ours:
            raise StoreVersionMismatch(f"{newer_than_program(self.schema, version)}.")
