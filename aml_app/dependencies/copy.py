"""Bulk loading Arrow tables into PostgreSQL with COPY, without a Python loop over rows.

Arrow's CSV writer (C++) renders the batch; PostgreSQL's COPY parses it. Strings are always quoted by
Arrow and nulls are left empty and unquoted, which is exactly how COPY's CSV format tells NULL from ''.
Timestamps come out as `2026-01-02 03:04:05.123456Z`, decimals as plain digits: both parse exactly. A list
column (Arrow's CSV writer has none) is rendered first, with Arrow's compute functions, as the text of a
PostgreSQL array of its elements (`{2026-01-02 03:04:05.123456Z,2026-01-02 03:04:06.000000Z}`): the
elements must not need quoting in an array (no commas, braces, quotes, backslashes or empty strings),
which holds for numbers and instants.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql


def copy_arrow(conn: psycopg.Connection, table: str, rows: Any, columns: Sequence[str]) -> None:
    """COPY the Arrow table's `columns` (in that order) into `table`'s columns of the same names."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    selected = rows.select(list(columns))
    for i, field in enumerate(selected.schema):
        if pa.types.is_list(field.type):
            selected = selected.set_column(i, field.name, array_text(selected.column(i)))
    buffer = io.BytesIO()
    pa_csv.write_csv(selected, buffer, pa_csv.WriteOptions(include_header=False))
    statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
        sql.Identifier(*table.split(".")), sql.SQL(", ").join(map(sql.Identifier, columns))
    )
    with conn.cursor() as cur, cur.copy(statement) as copy:
        copy.write(buffer.getbuffer())


def array_text(lists: Any) -> Any:
    """A chunked Arrow list column as PostgreSQL array literals, one string per list (no null lists)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    chunks = []
    for chunk in lists.chunks:
        elements = pc.cast(chunk.values, pa.string())
        joined = pc.binary_join(pa.ListArray.from_arrays(chunk.offsets, elements), ",")
        chunks.append(pc.binary_join_element_wise("{", joined, "}", ""))
    return pa.chunked_array(chunks, pa.string())
