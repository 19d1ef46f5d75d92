"""Bulk loading Arrow tables into PostgreSQL with COPY, without a Python loop over rows.

Arrow's CSV writer (C++) renders the batch; PostgreSQL's COPY parses it. Strings are always quoted by
Arrow and nulls are left empty and unquoted, which is exactly how COPY's CSV format tells NULL from ''.
Timestamps come out as `2026-01-02 03:04:05.123456Z`, decimals as plain digits: both parse exactly.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql


def copy_arrow(conn: psycopg.Connection, table: str, rows: Any, columns: Sequence[str]) -> None:
    """COPY the Arrow table's `columns` (in that order) into `table`'s columns of the same names."""
    import pyarrow.csv as pa_csv

    buffer = io.BytesIO()
    pa_csv.write_csv(rows.select(list(columns)), buffer, pa_csv.WriteOptions(include_header=False))
    statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
        sql.Identifier(*table.split(".")), sql.SQL(", ").join(map(sql.Identifier, columns))
    )
    with conn.cursor() as cur, cur.copy(statement) as copy:
        copy.write(buffer.getbuffer())
