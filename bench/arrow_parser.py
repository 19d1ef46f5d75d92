"""The pipeline's former validation, kept as the benchmark's "before": the Python contract per record in
`mapInArrow` (Python workers, Arrow transfer). The pipeline now validates in Spark SQL
(`aml_app.pipeline.validation`).

The same contract as the gate (`aml_app.contract`): a record that breaks it keeps its original bytes and
gets the reason in `error`, so the service can dead-letter it; valid rows carry typed fields and no bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import datetime
from decimal import Decimal
from functools import partial
from typing import Any

PARSED_SCHEMA = (
    "partition INT, offset BIGINT, payment_id STRING, payer STRING, payee STRING, amount DECIMAL(20,4), "
    "currency STRING, ts TIMESTAMP, error STRING, key BINARY, value BINARY"
)


def _parse_batches(batches: Iterator[Any], max_bytes: int) -> Iterator[Any]:
    import pyarrow as pa

    from aml_app.contract import InvalidPayment, validate_payment

    names = ["payment_id", "payer", "payee", "amount", "currency", "ts", "error", "key", "value"]
    for batch in batches:
        out: dict[str, list[Any]] = {name: [] for name in names}
        for key, value in zip(
            batch.column("key").to_pylist(), batch.column("value").to_pylist(), strict=True
        ):
            try:
                fields = validate_payment(key, value, max_bytes)
            except InvalidPayment as exc:
                for name in names[:6]:
                    out[name].append(None)
                out["error"].append(str(exc))
                out["key"].append(key)
                out["value"].append(value)
                continue
            out["payment_id"].append(fields["payment_id"])
            out["payer"].append(fields["payer"])
            out["payee"].append(fields["payee"])
            out["amount"].append(Decimal(fields["amount"]))
            out["currency"].append(fields["currency"])
            out["ts"].append(datetime.fromisoformat(fields["ts"]))
            out["error"].append(None)
            out["key"].append(None)
            out["value"].append(None)
        yield pa.RecordBatch.from_arrays(
            [
                batch.column("partition"),
                batch.column("offset"),
                pa.array(out["payment_id"], pa.string()),
                pa.array(out["payer"], pa.string()),
                pa.array(out["payee"], pa.string()),
                pa.array(out["amount"], pa.decimal128(20, 4)),
                pa.array(out["currency"], pa.string()),
                pa.array(out["ts"], pa.timestamp("us", tz="UTC")),
                pa.array(out["error"], pa.string()),
                pa.array(out["key"], pa.binary()),
                pa.array(out["value"], pa.binary()),
            ],
            names=["partition", "offset", *names],
        )


def payment_parser(max_bytes: int) -> Any:
    """The function for `DataFrame.mapInArrow(payment_parser(n), PARSED_SCHEMA)`."""
    return partial(_parse_batches, max_bytes=max_bytes)


# --- One Spark job per micro-batch -------------------------------------------------------------------------
# Each task parses its Kafka range and returns, in one Arrow schema, everything the driver needs: the span of
# offsets it covered, the rejected records (with their bytes), and the service's rows: one per payment
# (aggregates) or edge deltas pre-aggregated within the task (relations; the store adds deltas up). One
# `toArrow()` then brings the batch to the driver: no shuffle, no cache, no second pass over Kafka.

# Rows leave the executors in the stores' own form (money as canonical text, instants as microseconds), so
# the driver, whose Python is shared by both services' handlers, converts nothing per row.
BATCH_SCHEMA = (
    "kind STRING, partition INT, offset BIGINT, last_offset BIGINT, n BIGINT, payment_id STRING, "
    "payer STRING, payee STRING, currency STRING, amount STRING, first_us BIGINT, "
    "last_us BIGINT, error STRING, key BINARY, value BINARY"
)
SHAPES = ("payments", "edges")


def _arrow_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("kind", pa.string()),
            ("partition", pa.int32()),
            ("offset", pa.int64()),
            ("last_offset", pa.int64()),
            ("n", pa.int64()),
            ("payment_id", pa.string()),
            ("payer", pa.string()),
            ("payee", pa.string()),
            ("currency", pa.string()),
            ("amount", pa.string()),
            ("first_us", pa.int64()),
            ("last_us", pa.int64()),
            ("error", pa.string()),
            ("key", pa.binary()),
            ("value", pa.binary()),
        ]
    )


def money_texts(amounts: Any) -> Any:
    """Canonical money text (`aml_app.dependencies.store.money_text`) of an Arrow decimal array, vectorized.

    A decimal cast to string keeps its scale ("12.5000"); the canonical form keeps at least two decimal
    places and drops the trailing zeros beyond ("12.50", "12.345", "0.0001", "100.00").
    """
    import pyarrow.compute as pc

    return pc.replace_substring_regex(
        amounts.cast("string"), pattern=r"(\.[0-9]{2}[0-9]*?)0+$", replacement=r"\1"
    )


def micros(instants: Any) -> Any:
    """Microseconds since the epoch of an Arrow timestamp("us") array."""
    return instants.cast("int64")


def _kind_batch(schema: Any, kind: str, length: int, columns: dict[str, Any]) -> Any:
    import pyarrow as pa

    arrays = []
    for field in schema:
        if field.name == "kind":
            arrays.append(pa.array([kind] * length, pa.string()))
        elif field.name in columns:
            column = columns[field.name]
            if isinstance(column, pa.ChunkedArray):
                column = column.combine_chunks()
            arrays.append(column.cast(field.type))
        else:
            arrays.append(pa.nulls(length, field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _unapplied(batches: Iterator[Any], applied: Mapping[int, int]) -> Iterator[Any]:
    """Only the records at or past the store's next offset of their partition (a replay is dropped)."""
    import pyarrow.compute as pc

    for batch in batches:
        keep = None
        for p, floor in applied.items():
            replayed = pc.and_(pc.equal(batch.column("partition"), p), pc.less(batch.column("offset"), floor))
            keep = pc.invert(replayed) if keep is None else pc.and_(keep, pc.invert(replayed))
        yield batch if keep is None else batch.filter(keep)


def _batch_task(
    batches: Iterator[Any], max_bytes: int, shape: str, applied: Mapping[int, int]
) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.compute as pc

    parsed = list(_parse_batches(_unapplied(batches, applied), max_bytes))
    if not parsed:
        return
    table = pa.Table.from_batches(parsed).combine_chunks()
    schema = _arrow_schema()
    spans = table.group_by("partition").aggregate([("offset", "min"), ("offset", "max"), ("offset", "count")])
    yield _kind_batch(
        schema,
        "span",
        spans.num_rows,
        {
            "partition": spans["partition"],
            "offset": spans["offset_min"],
            "last_offset": spans["offset_max"],
            "n": spans["offset_count"],
        },
    )
    bad = pc.is_valid(table["error"])
    rejected = table.filter(bad)
    if rejected.num_rows:
        yield _kind_batch(
            schema, "reject", rejected.num_rows, {c: rejected[c] for c in rejected.column_names}
        )
    valid = table.filter(pc.invert(bad))
    if not valid.num_rows:
        return
    if shape == "payments":
        columns = {c: valid[c] for c in ("partition", "offset", "payment_id", "payer", "payee", "currency")}
        amounts = money_texts(valid["amount"])
        yield _kind_batch(
            schema, "payment", valid.num_rows, {**columns, "amount": amounts, "first_us": micros(valid["ts"])}
        )
        return
    edges = valid.group_by(["payer", "payee", "currency"]).aggregate(
        [("amount", "sum"), ("amount", "count"), ("ts", "min"), ("ts", "max")]
    )
    yield _kind_batch(
        schema,
        "edge",
        edges.num_rows,
        {
            "payer": edges["payer"],
            "payee": edges["payee"],
            "currency": edges["currency"],
            "amount": money_texts(edges["amount_sum"]),
            "n": edges["amount_count"],
            "first_us": micros(edges["ts_min"]),
            "last_us": micros(edges["ts_max"]),
        },
    )


def batch_task(max_bytes: int, shape: str, applied: Mapping[int, int] | None = None) -> Any:
    """The function for `DataFrame.mapInArrow(batch_task(n, shape, applied), BATCH_SCHEMA)`.

    Records below `applied` (partition -> the store's next offset) are skipped on the executors. Filtering
    here rather than with a Spark expression keeps every micro-batch's plan identical, so Spark does not
    generate and compile new code for each batch (that cost about half a second of JVM time per batch).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    return partial(_batch_task, max_bytes=max_bytes, shape=shape, applied=dict(applied or {}))
