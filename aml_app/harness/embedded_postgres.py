"""The embedded development PostgreSQL server: the store of Services B and C when nothing else is given.

It is Debian's PostgreSQL (`postgresql` package, installed by `.ci/system-deps`), run as a private
cluster in a folder of ours, the way `aml_app.kafka.broker` runs the embedded Kafka broker: `make demo` and
`make test` need nothing set up by hand. Nothing else in the code knows about it: the pipeline and the
APIs connect to `AML_STORE_URL`, so an existing server (managed, replicated, with TLS and passwords)
works unchanged.

PostgreSQL refuses to run as root. Started by root, the server runs as an unprivileged system user
(`postgres`, which Debian's package creates, else `nobody`) that owns the data folder; started by anyone
else, it runs as that user. It listens on 127.0.0.1 only and trusts local connections (a development
server, like the embedded broker, which has no authentication either). As root, a folder that the
server's user cannot reach (under a home folder of mode 700, say) is replaced by one of its own under the
system's temporary folder, named after the requested one, and the log says so.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from aml_app.kafka.broker import port_open

log = logging.getLogger(__name__)

SUPERUSER = "aml"
#: The roles of every database the server creates, with least privilege: the pipeline (WRITER) creates
#: and owns the stores' schemas; B's and C's APIs (READER) may connect and read them, nothing else.
WRITER = "aml_pipeline"
READER = "aml_api"
#: Run in the database. Default privileges give READER what WRITER creates from now on; the GRANTs
#: cover what it already created; whatever the superuser made is WRITER's from now on. Only a table
#: WRITER does not own yet is altered, and only one nobody reads or writes just then (NOWAIT; a busy
#: one is altered at the next provisioning): ALTER TABLE ... OWNER locks the table out, and on a
#: restarted server in use it would wait for every reader, and deadlock with one reading two tables
#: while the transaction holds the first.
LEAST_PRIVILEGE = f"""
REVOKE ALL ON DATABASE {{database}} FROM PUBLIC;
GRANT CONNECT, CREATE, TEMPORARY ON DATABASE {{database}} TO {WRITER};
GRANT CONNECT ON DATABASE {{database}} TO {READER};
ALTER DEFAULT PRIVILEGES FOR ROLE {WRITER} GRANT USAGE ON SCHEMAS TO {READER};
ALTER DEFAULT PRIVILEGES FOR ROLE {WRITER} GRANT SELECT ON TABLES TO {READER};
DO $$
DECLARE
    owned record;
BEGIN
    FOR owned IN
        SELECT n.nspname FROM pg_namespace n JOIN pg_roles r ON r.oid = n.nspowner
        WHERE r.rolname IN ('{SUPERUSER}', '{WRITER}') AND n.nspname IN ('relations', 'aggregates')
    LOOP
        EXECUTE format('ALTER SCHEMA %I OWNER TO {WRITER}', owned.nspname);
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO {READER}', owned.nspname);
        EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA %I TO {READER}', owned.nspname);
    END LOOP;
    FOR owned IN
        SELECT c.oid::regclass AS name FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname IN ('relations', 'aggregates') AND c.relkind IN ('r', 'p')
            AND pg_get_userbyid(c.relowner) <> '{WRITER}'
    LOOP
        BEGIN
            EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE NOWAIT', owned.name);
            EXECUTE format('ALTER TABLE %s OWNER TO {WRITER}', owned.name);
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE '% is in use: its owner changes at the next provisioning', owned.name;
        END;
    END LOOP;
END
$$
"""
DEFAULT_PORT = 5433
START_TIMEOUT = 60.0


#: Server settings for the stores' write load (docs/deployment.md recommends the same for a server of your
#: own). With PostgreSQL's defaults (max_wal_size 1GB, shared_buffers 128MB) the pipeline's catch-up
#: forced a checkpoint every 20-odd seconds ("checkpoints are occurring too frequently" in the server's
#: log), and each checkpoint makes the next change of every page write the whole page to the WAL again
#: (full-page writes): over 1.5 kB of WAL per payment (BENCHMARKS.md, "Pipeline throughput").
INGEST_SETTINGS = {
    "shared_buffers": "512MB",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "15min",
}


#: The extension that counts each statement's calls and time (`EmbeddedPostgres(statements=True)`).
STATEMENTS = "pg_stat_statements"


class PostgresError(RuntimeError):
    """The embedded PostgreSQL server could not be set up or started; the message says what to do."""


#: What a folder of PostgreSQL's server programs holds.
SERVER_PROGRAMS = ("initdb", "pg_ctl", "postgres")


def server_binaries() -> Path:
    """The folder with initdb, pg_ctl and postgres: $AML_PG_BIN, else PATH, else Debian's layout."""
    explicit = os.environ.get("AML_PG_BIN", "").strip()
    if explicit:  # named: used or refused, never passed over for another server's programs
        missing = [tool for tool in SERVER_PROGRAMS if not (Path(explicit) / tool).exists()]
        if missing:
            raise PostgresError(
                f"AML_PG_BIN={explicit!r} holds no {', '.join(missing)}; name the folder of "
                "PostgreSQL's server programs, or unset it to search PATH and Debian's layout"
            )
        return Path(explicit)
    candidates: list[Path] = []
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(os.path.realpath(on_path)).parent)
    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    candidates += [Path(p) for p in debian]
    for folder in candidates:
        if all((folder / tool).exists() for tool in SERVER_PROGRAMS):
            return folder
    raise PostgresError(
        "no PostgreSQL server programs found (initdb, pg_ctl): install Debian's postgresql package "
        "(`make test` and `make demo` do), set AML_PG_BIN to their folder, or point AML_STORE_URL at "
        "an existing PostgreSQL server"
    )


def server_user() -> str | None:
    """The system user the server runs as when we are root (None: run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise PostgresError(
        "running as root, and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL"
    )


class EmbeddedPostgres:
    """A private PostgreSQL cluster in `folder` (created on first start), on 127.0.0.1:`port`."""

    def __init__(
        self, folder: Path | str, port: int = DEFAULT_PORT, host: str = "127.0.0.1", statements: bool = False
    ) -> None:
        """`statements`: load PostgreSQL's pg_stat_statements, so that a benchmark can say which of the
        services' statements the server's time goes to (every database created gets the extension)."""
        self.port = port
        self.host = host
        self.statements = statements
        self.bin = server_binaries()
        self.user = server_user()
        self._place(Path(folder).resolve())
        #: Whether this object's `pg_ctl start` ran: `stop` never stops a server another one started in
        #: the same folder (whose port this one found taken).
        self._started = False

    def _place(self, folder: Path) -> None:
        self.folder = folder
        self.data = folder / "data"
        self.log_path = folder / "postgres.log"

    def url(self, database: str = "aml", role: str = SUPERUSER) -> str:
        """The URL of `database` as `role` (the superuser, WRITER or READER)."""
        return f"postgresql://{role}@{self.host}:{self.port}/{database}"

    def _run(
        self, *args: str, check: bool = True, timeout: float = START_TIMEOUT
    ) -> subprocess.CompletedProcess:
        command = [str(self.bin / args[0]), *args[1:]]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, check=check, timeout=timeout)

    def _reachable(self, folder: Path) -> bool:
        assert self.user is not None
        probe = ["runuser", "-u", self.user, "--", "test", "-w", str(folder)]
        return subprocess.run(probe, check=False).returncode == 0

    def _prepare_folder(self) -> None:
        """Create the folder; as root, hand it to the server's user (or use another it can reach)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.user is None:
            return
        account = pwd.getpwnam(self.user)
        os.chown(self.folder, account.pw_uid, account.pw_gid)
        if not self._reachable(self.folder):
            wanted = self.folder
            digest = hashlib.sha1(str(wanted).encode()).hexdigest()[:12]
            self._place(Path(tempfile.gettempdir()) / f"aml-postgres-{digest}")
            self.folder.mkdir(mode=0o700, exist_ok=True)
            os.chown(self.folder, account.pw_uid, account.pw_gid)
            log.warning(
                "the user %r that runs PostgreSQL cannot enter %s (a parent folder is closed to "
                "other users); the server's data is in %s instead",
                self.user,
                wanted,
                self.folder,
            )
            if not self._reachable(self.folder):
                raise PostgresError(
                    f"the user {self.user!r} that runs PostgreSQL can write neither {wanted} nor "
                    f"{self.folder}; choose a folder under one that others may enter"
                )
        if not self.log_path.exists():
            self.log_path.touch()
        os.chown(self.log_path, account.pw_uid, account.pw_gid)

    def start(self) -> EmbeddedPostgres:
        """Initialise the cluster if needed, start it, and wait until it accepts connections."""
        if port_open(self.host, self.port):
            raise PostgresError(
                f"port {self.port} on {self.host} is already in use; choose another port, or point "
                "AML_STORE_URL at the PostgreSQL server that is running there"
            )
        preload = self._statements_library()
        self._prepare_folder()
        if not (self.data / "PG_VERSION").exists():
            init = self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C.UTF-8",
                check=False,
            )
            if init.returncode != 0:
                raise PostgresError(
                    f"initdb failed for {self.data}: {init.stderr.strip() or init.stdout.strip()}"
                )
        options = " ".join(
            [
                f"-p {self.port}",
                f"-c listen_addresses={self.host}",
                f"-k {self.data}",  # the Unix socket stays inside our folder
                "-c max_connections=200",
                *(f"-c {name}={value}" for name, value in INGEST_SETTINGS.items()),
                *([f"-c shared_preload_libraries={STATEMENTS}"] if preload else []),
            ]
        )
        started = self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log_path),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
            check=False,
        )
        if started.returncode != 0:
            raise PostgresError(
                f"PostgreSQL did not start in {self.data}: {started.stdout.strip()} (log: {self.log_path})"
            )
        self._started = True
        self._wait_ready()
        self.create_database("aml")
        return self

    def _wait_ready(self) -> None:
        import psycopg

        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with psycopg.connect(self.url("postgres"), connect_timeout=2):
                    return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise PostgresError(
                        f"PostgreSQL on port {self.port} does not accept connections: {exc}"
                    ) from exc
                time.sleep(0.1)

    def _statements_library(self) -> bool:
        """Whether to load pg_stat_statements; refused in one sentence when asked for and not installed."""
        if not self.statements:
            return False
        library = self.bin.parent / "lib" / f"{STATEMENTS}.so"
        if not library.exists():
            raise PostgresError(
                f"{STATEMENTS} was asked for, but this PostgreSQL has no {library}: install the server's "
                "contrib modules (Debian's postgresql package has them)"
            )
        return True

    def create_database(self, name: str) -> str:
        """Create database `name` unless it exists; its URL."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if exists is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            for role in (WRITER, READER):
                if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None:
                    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        with psycopg.connect(self.url(name), autocommit=True) as conn:
            conn.execute(sql.SQL(LEAST_PRIVILEGE).format(database=sql.Identifier(name)))
            if self.statements:
                conn.execute(f"CREATE EXTENSION IF NOT EXISTS {STATEMENTS}")
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop database `name` if it exists (its connections are closed first)."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def running(self) -> bool:
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def stop(self, mode: str = "fast") -> None:
        """Stop the server this object started: `fast` rolls back open transactions and shuts down,
        `immediate` is a crash."""
        started, self._started = self._started, False
        if started and (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)
