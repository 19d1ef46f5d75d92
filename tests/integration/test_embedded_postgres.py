"""The embedded PostgreSQL server started by root from a folder its unprivileged user cannot enter (a home
folder of mode 700, pytest's own temporary folder): it runs from a folder of its own instead, the same one
each time, and keeps its data across restarts."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psycopg
import pytest

from aml_app.harness.embedded_postgres import EmbeddedPostgres
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
