"""The embedded PostgreSQL server started by root from a folder its unprivileged user cannot enter (a home
folder of mode 700, pytest's own temporary folder): it runs from a folder of its own instead, the same one
each time, and keeps its data across restarts. Its roles: the pipeline writes, the APIs only read."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import psycopg
import pytest

from aml_app import dependency_services as registry
from aml_app.dependencies.store import Reader, Writer
from aml_app.harness.embedded_postgres import READER, WRITER, EmbeddedPostgres, PostgresError
from aml_app.kafka.broker import free_port


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the server to another user")
def test_a_closed_folder_moves_the_server_to_one_it_can_reach(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    wanted = closed / "var" / "postgres"
    first = EmbeddedPostgres(wanted, free_port())
    try:
        first.start()
        assert first.folder != wanted and first.running()
        with psycopg.connect(first.url()) as conn:
            conn.execute("CREATE TABLE kept (x int)")
    finally:
        first.stop()
    again = EmbeddedPostgres(wanted, free_port())
    try:
        again.start()
        assert again.folder == first.folder
        with psycopg.connect(again.url()) as conn:
            assert conn.execute("SELECT count(*) FROM kept").fetchone() == (0,)
    finally:
        again.stop()
        shutil.rmtree(again.folder, ignore_errors=True)


async def test_the_pipeline_owns_the_stores_and_the_apis_may_only_read_them(
    postgres: EmbeddedPostgres,
) -> None:
    """Least privilege on the embedded server: the pipeline's role (WRITER) creates and owns the schemas;
    the APIs' role (READER) reads them and can change nothing, not even a temporary table. A store the
    superuser made before the roles existed becomes WRITER's."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    postgres.create_database(name)
    with psycopg.connect(postgres.url(name), autocommit=True) as conn:  # as an older version did
        conn.execute("CREATE SCHEMA aggregates")
        conn.execute("CREATE TABLE aggregates.old (x int)")
    postgres.create_database(name)  # again: provisions the roles over what exists
    for service in registry.SERVICES.values():
        Writer(postgres.url(name, WRITER), service.schema).migrate()
    with psycopg.connect(postgres.url(name, WRITER), autocommit=True) as conn:
        owners = conn.execute(
            "SELECT DISTINCT pg_get_userbyid(c.relowner) FROM pg_class c JOIN pg_namespace n"
            " ON n.oid = c.relnamespace WHERE n.nspname IN ('relations', 'aggregates') AND c.relkind = 'r'"
        ).fetchall()
        assert owners == [(WRITER,)]
        conn.execute("INSERT INTO relations.applied_offsets VALUES (0, 7)")

    for service in registry.SERVICES.values():
        reader = Reader(postgres.url(name, READER), service.schema, statement_timeout=5)
        await reader.open()
        try:
            async with reader.snapshot() as snapshot:
                assert snapshot.as_of == ({0: 7} if service.schema.name == "relations" else {})
        finally:
            await reader.close()
    forbidden = [
        "INSERT INTO relations.applied_offsets VALUES (1, 1)",
        "DELETE FROM aggregates.meta",
        "DROP TABLE aggregates.old",
        "CREATE SCHEMA elsewhere",
        "CREATE TABLE relations.mine (x int)",
        "CREATE TEMPORARY TABLE scratch (x int)",
    ]
    with psycopg.connect(postgres.url(name, READER), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM aggregates.old").fetchone() == (0,)
        for statement in forbidden:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)


def test_provisioning_a_server_in_use_waits_for_no_store_table(postgres: EmbeddedPostgres) -> None:
    """A restarted server is provisioned again while the pipeline and the APIs read the stores: the
    tables already WRITER's are left alone, so provisioning takes no lock a reader holds (an ALTER of
    their owner waits for every reader and can deadlock with one reading two tables)."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    postgres.create_database(name)
    for service in registry.SERVICES.values():
        Writer(postgres.url(name, WRITER), service.schema).migrate()
    with psycopg.connect(postgres.url(name, READER)) as reading:
        reading.execute("SELECT count(*) FROM relations.applied_offsets").fetchone()  # holds its lock
        with psycopg.connect(postgres.url("postgres"), autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {name} SET lock_timeout = '5s'")
        postgres.create_database(name)  # fails on the lock timeout where it waits for the reader
        reading.rollback()


def _owners(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT c.oid::regclass::text, pg_get_userbyid(c.relowner) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname IN ('relations', 'aggregates') AND c.relkind IN ('r', 'p')"
        ).fetchall()
    return dict(rows)


def test_provisioning_a_server_in_use_leaves_a_busy_table_of_another_owner_for_later(
    postgres: EmbeddedPostgres,
) -> None:
    """Stores the superuser created (a pipeline given the superuser's URL, as the chaos soak's) are
    WRITER's after a restart; a table someone reads just then is left as it is, not waited for (an ALTER
    of its owner would wait for the reader, and deadlock with one reading two tables), and is WRITER's
    at the next provisioning."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    postgres.create_database(name)
    for service in registry.SERVICES.values():
        Writer(postgres.url(name), service.schema).migrate()
    busy = "relations.applied_offsets"
    assert set(_owners(postgres.url(name)).values()) == {"aml"}
    with psycopg.connect(postgres.url(name)) as reading:
        reading.execute(f"SELECT count(*) FROM {busy}").fetchone()  # holds its lock
        with psycopg.connect(postgres.url("postgres"), autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {name} SET lock_timeout = '5s'")
        postgres.create_database(name)  # fails on the lock timeout where it waits for the reader
        owners = _owners(postgres.url(name))
        assert owners.pop(busy) == "aml"
        assert set(owners.values()) == {WRITER}
        # Provisioning holds no table now: the reader reads another one at once.
        reading.execute("SET lock_timeout = '1s'")
        reading.execute("SELECT count(*) FROM aggregates.applied_offsets").fetchone()
        reading.rollback()
    postgres.create_database(name)
    assert set(_owners(postgres.url(name)).values()) == {WRITER}


def test_a_server_that_did_not_start_stops_nothing(postgres: EmbeddedPostgres) -> None:
    """Its port taken by the server already running in its folder: its stop (a demo's cleanup, the
    command's) stopped that other server, whose postmaster.pid it found there."""
    second = EmbeddedPostgres(postgres.folder, postgres.port)
    with pytest.raises(PostgresError, match="already in use"):
        second.start()
    second.stop()
    assert postgres.running()
