"""Where the embedded PostgreSQL server's programs come from: `AML_PG_BIN`, when set, is used or refused
in one sentence, never passed over for whatever PATH or Debian's layout holds (another version's
server would then start, silently)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aml_app.harness.embedded_postgres import PostgresError, server_binaries


def test_a_named_folder_without_the_programs_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "initdb").touch()
    monkeypatch.setenv("AML_PG_BIN", str(tmp_path))
    with pytest.raises(PostgresError, match=r"AML_PG_BIN=.* holds no pg_ctl, postgres; name the folder"):
        server_binaries()


def test_a_named_folder_with_the_programs_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for tool in ("initdb", "pg_ctl", "postgres"):
        (tmp_path / tool).touch()
    monkeypatch.setenv("AML_PG_BIN", str(tmp_path))
    assert server_binaries() == tmp_path
