"""Validation rate: the payment contract as Spark SQL (`validated`, local[2]) against the Python contract
(`validate_payment`, one record after the other), on the same records in the same run.

N realistic payments (`payment_json` shape, random accounts, amounts with 0-4 decimals, millisecond or
microsecond timestamps, optional channel and country on half of them; 1 % malformed, cycling through
faults of every kind) are generated once, written to Parquet and read back into a cached DataFrame, so
neither side reads Kafka or pays for generating its input.

a. spark: `validated(records, 65536)` written to Spark's `noop` sink (every output column is computed);
   one warm-up, then the median of the repeats. `scan` is the same write of the cached input alone: the
   price of moving the rows, with no validation.
b. python: `validate_payment` over the same (key, value) pairs in this process (one core); median of the
   repeats.
c. arrow (optional, `--arrow`): the pipeline's former path (`bench/arrow_parser.py`), the Python
   contract in `mapInArrow` (Python workers, Arrow transfer), once.

Both verdicts are counted and must agree (the number of valid records). Spark uses both cores of local[2],
Python one: the per-core rate of Spark is half its rate.

    .venv/bin/python -m bench.validation_rate [--payments 500000] [--repeats 5] [--arrow]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aml_app.contract import InvalidPayment, validate_payment
from aml_app.kafka.tools import payment_json
from bench.common import machine, markdown_table, write_results

NAME = "validation_rate"
ACCOUNTS = 5000
MAX_PAYMENT_BYTES = 65536
MALFORMED_EVERY = 100
CURRENCIES = ("EUR", "EUR", "EUR", "USD", "GBP", "CHF", "JPY")


def malformed(i: int, rng: random.Random, key: bytes, good: bytes) -> bytes:
    """A record that breaks the contract, a different way for consecutive calls."""
    text = good.decode()
    faults = [
        lambda: b"not json",
        lambda: b"[]",
        lambda: b"\xff\xfe" + good,
        lambda: good + b" trailing",
        lambda: good[:-1] + b', "payer": "acct-x"}',
        lambda: text.replace('"EUR"', '"EURO"').replace('"USD"', '"usd"').encode(),
        lambda: json.dumps({**json.loads(good), "amount": f"{rng.random() * 100:.5f}"}).encode(),
        lambda: json.dumps({**json.loads(good), "ts": "2026-02-30T10:00:00Z"}).encode(),
        lambda: json.dumps({**json.loads(good), "ts": "2026-11-20 10:00:00"}).encode(),
        lambda: json.dumps({**json.loads(good), "payee": 42}).encode(),
        lambda: json.dumps({k: v for k, v in json.loads(good).items() if k != "payee"}).encode(),
        lambda: good[:-1] + b', "x": NaN}',
    ]
    return faults[i // MALFORMED_EVERY % len(faults)]()


def payments(n: int, seed: int) -> list[tuple[bytes, bytes]]:
    rng = random.Random(seed)
    now = datetime(2026, 11, 20, 12, tzinfo=UTC)
    out = []
    for i in range(n):
        payer, payee = rng.sample(range(ACCOUNTS), 2)
        when = now - timedelta(microseconds=rng.randrange(86_400_000_000))
        spec = "microseconds" if i % 3 == 0 else "milliseconds"
        ts = when.isoformat(timespec=spec).replace("+00:00", "Z")
        amount = f"{rng.randrange(1, 2_000_000_000) / 10_000:.{rng.choice([0, 2, 2, 2, 4])}f}"
        amount = amount if amount.strip("0.") else "1"
        extra = {"channel": rng.choice(["web", "sepa", "card"]), "country": "DE"} if i % 2 else {}
        key = f"acct-{payer}".encode()
        value = payment_json(f"p-{i}", f"acct-{payer}", f"acct-{payee}", amount, ts, **extra)
        value = value.replace(b'"EUR"', json.dumps(rng.choice(CURRENCIES)).encode())
        if i % MALFORMED_EVERY == MALFORMED_EVERY - 1:
            value = malformed(i, rng, key, value)
        out.append((key, value))
    return out


def python_rate(records: list[tuple[bytes, bytes]], repeats: int) -> tuple[float, int, list[float]]:
    valid = 0
    times = []
    for _ in range(repeats):
        valid = 0
        start = time.perf_counter()
        for key, value in records:
            try:
                validate_payment(key, value, MAX_PAYMENT_BYTES)
                valid += 1
            except InvalidPayment:
                pass
        times.append(time.perf_counter() - start)
    return len(records) / statistics.median(times), valid, times


def spark_session() -> Any:
    """The pipeline's own session (`runner.spark_session`), with room for the cached input."""
    from aml_app.pipeline.runner import spark_session as pipeline_session

    return pipeline_session("local[2]", "bench-validation-rate", {"spark.driver.memory": "2g"})


def timed_noop(frame: Any) -> float:
    start = time.perf_counter()
    frame.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--payments", type=int, default=500_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--arrow", action="store_true", help="also time the mapInArrow parser (slow)")
    args = parser.parse_args()
    info = machine()

    import pyarrow as pa
    import pyarrow.parquet as pq

    records = payments(args.payments, args.seed)
    n = len(records)
    size = sum(len(v) for _, v in records)
    print(f"{n} records, {size / n:.0f} bytes per value on average", file=sys.stderr)

    py_rate, py_valid, py_times = python_rate(records, args.repeats)
    print(f"python: {py_rate:,.0f} records/s ({py_valid} valid)", file=sys.stderr)

    from pyspark.sql import functions as F

    from aml_app.pipeline.validation import validated
    from bench.arrow_parser import PARSED_SCHEMA, payment_parser

    spark = spark_session()
    with tempfile.TemporaryDirectory(prefix="aml-bench-") as tmp:
        path = Path(tmp) / "records.parquet"
        table = pa.table(
            {
                "partition": pa.array([i % 4 for i in range(n)], pa.int32()),
                "offset": pa.array(range(n), pa.int64()),
                "timestamp": pa.array([None] * n, pa.timestamp("us", tz="UTC")),
                "key": pa.array([k for k, _ in records], pa.binary()),
                "value": pa.array([v for _, v in records], pa.binary()),
            }
        )
        pq.write_table(table, path, row_group_size=50_000)
        source = spark.read.parquet(str(path)).repartition(2).cache()
        assert source.count() == n
        checked = validated(source, MAX_PAYMENT_BYTES)
        spark_valid = checked.where(F.col("valid")).count()
        scan_times = [timed_noop(source) for _ in range(args.repeats)]
        timed_noop(checked)  # warm-up: code generation, JIT
        spark_times = [timed_noop(checked) for _ in range(args.repeats)]
        arrow_times = []
        if args.arrow:
            arrow_times = [timed_noop(source.mapInArrow(payment_parser(MAX_PAYMENT_BYTES), PARSED_SCHEMA))]
    spark.stop()

    spark_rate = n / statistics.median(spark_times)
    scan_rate = n / statistics.median(scan_times)
    rows = [
        (
            "spark `validated` (local[2])",
            f"{spark_rate:,.0f}",
            f"{min(spark_times):.2f}-{max(spark_times):.2f}",
        ),
        ("python `validate_payment` (1 core)", f"{py_rate:,.0f}", f"{min(py_times):.2f}-{max(py_times):.2f}"),
        (
            "spark scan of the cached input alone",
            f"{scan_rate:,.0f}",
            f"{min(scan_times):.2f}-{max(scan_times):.2f}",
        ),
    ]
    if arrow_times:
        rows.append(
            ("spark `payment_parser` in mapInArrow", f"{n / arrow_times[0]:,.0f}", f"{arrow_times[0]:.2f}")
        )
    print(markdown_table(["what", "records/s (median)", "seconds per run (min-max)"], rows))
    print(
        f"\nratio spark / python: {spark_rate / py_rate:.2f}; "
        f"valid records: spark {spark_valid}, python {py_valid}"
    )
    if spark_valid != py_valid:
        print("warning: the two implementations counted different numbers of valid records", file=sys.stderr)
    path = write_results(
        NAME,
        {
            "machine": info,
            "payments": n,
            "malformed_every": MALFORMED_EVERY,
            "mean_value_bytes": size / n,
            "repeats": args.repeats,
            "valid": {"spark": spark_valid, "python": py_valid},
            "spark": {"records_per_s": spark_rate, "seconds": spark_times},
            "python": {"records_per_s": py_rate, "seconds": py_times},
            "scan": {"records_per_s": scan_rate, "seconds": scan_times},
            "arrow": {"records_per_s": n / arrow_times[0], "seconds": arrow_times} if arrow_times else None,
            "ratio_spark_to_python": spark_rate / py_rate,
        },
    )
    print(f"results: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
