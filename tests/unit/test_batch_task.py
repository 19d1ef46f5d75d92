"""The per-task function of the Spark pipeline, run without Spark: Arrow records in, store-ready rows out."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from aml_app.kafka_tools import payment_json
from aml_app.pipeline.jobs import aggregates_rows, relations_rows
from aml_app.pipeline.parse import batch_task, money_texts
from aml_app.services.store import money_text, to_micros

amounts = st.decimals(min_value=Decimal("0.0001"), max_value=Decimal("999999999999999.9999"), places=4)


@settings(max_examples=500)
@given(st.lists(amounts, min_size=1, max_size=20))
def test_vectorized_money_text_equals_the_stores_money_text(values: list[Decimal]) -> None:
    array = pa.array(values, pa.decimal128(38, 4))
    assert money_texts(array).to_pylist() == [money_text(v) for v in values]


def records(rows: list[tuple[int, int, bytes | None, bytes | None]]) -> pa.RecordBatch:
    """A batch as the Kafka source makes it: partition, offset, timestamp, key, value."""
    return pa.RecordBatch.from_arrays(
        [
            pa.array([r[0] for r in rows], pa.int32()),
            pa.array([r[1] for r in rows], pa.int64()),
            pa.array([None] * len(rows), pa.timestamp("us", tz="UTC")),
            pa.array([r[2] for r in rows], pa.binary()),
            pa.array([r[3] for r in rows], pa.binary()),
        ],
        names=["partition", "offset", "timestamp", "key", "value"],
    )


def pay(i: int, payer: str, payee: str, amount: str, ts: str) -> tuple[bytes, bytes]:
    return payer.encode(), payment_json(f"p{i}", payer, payee, amount, ts)


TS1, TS2 = "2026-11-20T10:00:00Z", "2026-11-20T11:30:00.5Z"
BATCH = records(
    [
        (0, 5, *pay(5, "A", "B", "10.5", TS1)),
        (0, 6, *pay(6, "A", "B", "0.0001", TS2)),
        (1, 9, b"C", b"not json"),
        (1, 10, *pay(10, "C", "A", "100", TS1)),
    ]
)


def run(shape: str, applied: dict[int, int] | None = None) -> pa.Table:
    task = batch_task(65536, shape, applied)
    return pa.Table.from_batches(list(task(iter([BATCH]))))


def micros(ts: str) -> int:
    return to_micros(datetime.fromisoformat(ts).astimezone(UTC))


def test_payments_leave_the_task_in_stored_form() -> None:
    assert sorted(aggregates_rows(run("payments"))) == [
        (0, 5, "p5", "A", "B", "10.50", "EUR", micros(TS1)),
        (0, 6, "p6", "A", "B", "0.0001", "EUR", micros(TS2)),
        (1, 10, "p10", "C", "A", "100.00", "EUR", micros(TS1)),
    ]


def test_edges_are_summed_per_task_exactly() -> None:
    assert sorted(relations_rows(run("edges"))) == [
        ("A", "B", "EUR", 2, "10.5001", micros(TS1), micros(TS2)),
        ("C", "A", "EUR", 1, "100.00", micros(TS1), micros(TS1)),
    ]


def test_spans_and_rejects_cover_every_record() -> None:
    table = run("payments").to_pylist()
    spans = {r["partition"]: (r["offset"], r["last_offset"], r["n"]) for r in table if r["kind"] == "span"}
    assert spans == {0: (5, 6, 2), 1: (9, 10, 2)}
    [reject] = [r for r in table if r["kind"] == "reject"]
    assert (reject["partition"], reject["offset"], reject["key"], reject["value"]) == (
        1,
        9,
        b"C",
        b"not json",
    )
    assert reject["error"].startswith("value is not JSON")


def test_records_below_the_stores_offsets_are_skipped_on_the_executor() -> None:
    table = run("payments", applied={0: 6, 1: 11})
    assert aggregates_rows(table) == [(0, 6, "p6", "A", "B", "0.0001", "EUR", micros(TS2))]
    spans = [(r["partition"], r["offset"]) for r in table.to_pylist() if r["kind"] == "span"]
    assert spans == [(0, 6)]
