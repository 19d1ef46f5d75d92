"""Validating raw Kafka records into typed payment columns on the executors (Arrow in, Arrow out).

The same contract as the gate (`aml_app.contract`): a record that breaks it keeps its original bytes and
gets the reason in `error`, so the service can dead-letter it; valid rows carry typed fields and no bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
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
