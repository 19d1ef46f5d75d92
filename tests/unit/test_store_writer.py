"""The stores' writer when a connection fails between its connect and its set-up (the server restarting
just then): the new connection is closed, not left open for each retry of an outage. psycopg's connect
replaced at its narrowest seam; the real server's behaviour is `tests/integration/test_stores.py`'s."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from aml_app.dependencies.relations import SCHEMA
from aml_app.dependencies.store import Writer


class Connection:
    closed = broken = False
    autocommit = True

    def execute(self, *args: Any) -> None:
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    def close(self) -> None:
        self.closed = True


def test_a_connection_whose_set_up_fails_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Connection] = []
    monkeypatch.setattr(psycopg, "connect", lambda *args, **kwargs: made.append(Connection()) or made[-1])
    writer = Writer("postgresql://aml_pipeline@127.0.0.1:1/aml", SCHEMA, patience=0)
    for _ in range(3):
        with pytest.raises(psycopg.OperationalError):
            writer.connection()
    assert len(made) == 3 and all(conn.closed for conn in made)
