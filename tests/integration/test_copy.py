"""Bulk loading Arrow tables with COPY (`aml_app.dependencies.copy`) against a real PostgreSQL server:
what arrives is exactly what Spark handed over, whatever the Arrow time zone, and lists become arrays."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import psycopg
import pyarrow as pa

from aml_app.dependencies.copy import copy_arrow

INSTANTS = [
    datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC),
    datetime(2026, 3, 29, 1, 30, tzinfo=UTC),  # the hour Paris skips
    datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
]


def test_instants_lists_and_text_arrive_exactly(store_url: str) -> None:
    rows = pa.table(
        {
            "name": ['a "quoted", text', "", None],
            # Arrow keeps instants in UTC whatever the column's zone; the zone only changes how it prints.
            "at": pa.array(INSTANTS, pa.timestamp("us", "Europe/Paris")),
            "total": pa.array(
                [Decimal("12.5"), Decimal("0.0001"), Decimal("99999999999999.9999")], pa.decimal128(19, 4)
            ),
            "times": pa.array(
                [INSTANTS, [INSTANTS[1]], [INSTANTS[2] + timedelta(microseconds=1)]],
                pa.list_(pa.timestamp("us", "UTC")),
            ),
            "amounts": pa.array(
                [[Decimal("1.5"), Decimal("2")], [Decimal("0.0001")], []], pa.list_(pa.decimal128(19, 4))
            ),
        }
    )
    with psycopg.connect(store_url) as conn:
        conn.execute("SET TIME ZONE 'America/New_York'")  # the session's zone must not matter
        conn.execute(
            "CREATE TEMPORARY TABLE loaded (name text, at timestamptz, total numeric, times timestamptz[],"
            " amounts numeric[])"
        )
        copy_arrow(conn, "loaded", rows, ("name", "at", "total", "times", "amounts"))
        found = conn.execute("SELECT name, at, total, times, amounts FROM loaded ORDER BY total").fetchall()
    assert found == [
        ("", INSTANTS[1], Decimal("0.0001"), [INSTANTS[1]], [Decimal("0.0001")]),
        (
            'a "quoted", text',
            INSTANTS[0],
            Decimal("12.5000"),
            INSTANTS,
            [Decimal("1.5000"), Decimal("2.0000")],
        ),
        (None, INSTANTS[2], Decimal("99999999999999.9999"), [INSTANTS[2] + timedelta(microseconds=1)], []),
    ]


def test_a_sliced_table_loads_its_own_rows_only(store_url: str) -> None:
    """An Arrow slice shares its parent's buffers (the lists' values among them): only its rows load."""
    times = pa.array(
        [[INSTANTS[0]], [INSTANTS[1], INSTANTS[2]], [INSTANTS[2]]], pa.list_(pa.timestamp("us", "UTC"))
    )
    rows = pa.table({"times": times}).slice(1, 1)
    with psycopg.connect(store_url) as conn:
        conn.execute("CREATE TEMPORARY TABLE loaded (times timestamptz[])")
        copy_arrow(conn, "loaded", rows, ("times",))
        assert conn.execute("SELECT times FROM loaded").fetchall() == [([INSTANTS[1], INSTANTS[2]],)]


def test_a_null_list_arrives_as_null_and_an_empty_one_as_an_empty_array(store_url: str) -> None:
    """C's flow rows of one payment carry no lists (null), and null must not become an empty array."""
    rows = pa.table(
        {
            "k": [1, 2, 3],
            "times": pa.array([None, [], [INSTANTS[0]]], pa.list_(pa.timestamp("us", "UTC"))),
            "amounts": pa.array([None, [], [Decimal("3")]], pa.list_(pa.decimal128(19, 4))),
        }
    )
    with psycopg.connect(store_url) as conn:
        conn.execute("CREATE TEMPORARY TABLE loaded (k int, times timestamptz[], amounts numeric[])")
        copy_arrow(conn, "loaded", rows, ("k", "times", "amounts"))
        found = conn.execute("SELECT k, times, amounts FROM loaded ORDER BY k").fetchall()
    assert found == [(1, None, None), (2, [], []), (3, [INSTANTS[0]], [Decimal("3.0000")])]
