"""Spark's price of one micro-batch: what the pipeline's Spark work costs for a batch of n payments, and
what the two ways of doing it in fewer Spark jobs would cost instead.

At a bank's quiet rates a micro-batch holds tens of payments, and the pipeline's Spark work for it (the
contract check, B's and C's aggregations, the offsets and rejected records, all collected as Arrow) costs
the same few hundred milliseconds whatever n is. This benchmark isolates that work from Kafka and the
stores: one SparkSession (local[2], as the pipeline's), n payments in a local relation, and per round each
variant computes every service's outputs of that batch:

- `pipeline`: what the pipeline runs (`transforms.outputs_by_service` on the kept batch): three Spark
  jobs, started side by side from three threads;
- `grouping sets`: one job: the per-partition spans and rejects, B's edges and C's flows as three
  grouping sets of one aggregation over the batch (no cache);
- `union`: one job: the per-record rows, B's and C's aggregations unioned over the kept batch.

Every variant's outputs are checked equal to the pipeline's first (same rows, same Arrow types). Variants
run interleaved, `--block` batches each, for `--rounds` rounds; the first third of the rounds is left out
(the JIT is still compiling Spark's code). Per variant: median and p90 wall time per batch, and the JVM's
CPU per batch by thread kind (C2/C1 = the JIT compilers, `py4j` = the threads that run the driver's calls).

    .venv/bin/python -m bench.spark_batch_cost [--sizes 25,1000,20000] [--rounds 15] [--block 10]
        [--java-options=-XX:+UseParallelGC] [--conf spark.sql.adaptive.enabled=true]
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from aml_app.kafka.tools import payment_json
from aml_app.pipeline.transforms import (
    BatchOutputs,
    arrow_rejects,
    arrow_spans,
    edges,
    flows,
    in_one_task,
    kept,
    near_threshold,
    outputs_by_service,
    trimmed,
)
from aml_app.pipeline.validation import validated
from bench.common import code_version, finish, machine, markdown_table, thread_cpu

NAME = "spark_batch_cost"
THRESHOLD, BAND = Decimal(10_000), Decimal("0.1")
SERVICES = {"relations": "edges", "aggregates": "flows"}
PER_RECORD = ("partition", "offset", "valid", "timestamp_ms", "key", "value")
EDGE_COLUMNS = [
    "payer",
    "payee",
    "currency",
    "payments",
    "total",
    "first_seen",
    "last_seen",
    "times",
    "amounts",
]
FLOW_COLUMNS = [
    *("payer", "bucket", "payee", "currency", "payments", "total", "near", "times", "amounts"),
    *("first_ts", "last_ts"),
]
GROUPS = ("partition", "payer", "payee", "currency", "bucket")
#: grouping_id() of each grouping set over GROUPS (a bit set for every column left out, first = highest).
SPANS, EDGES, FLOWS = 0b01111, 0b10001, 0b10000


def batch(spark: Any, n: int) -> Any:
    """n payments as the query hands them to the pipeline, checked and trimmed; about 2 % break the
    contract (future-dated or not JSON), so every output has rows."""
    now = datetime.now(UTC)
    rows = []
    for i in range(n):
        ts = now - timedelta(seconds=(n - i) * 0.37) if i % 50 != 7 else now + timedelta(days=3)
        value = payment_json(
            f"p{i}", f"a{i % 97}", f"a{(i * 3) % 101}", f"{(i * 37) % 12_000}.50", ts.isoformat()
        )
        rows.append((i % 4, 1_000 + i, now, f"a{i % 97}".encode(), value if i % 61 != 3 else b"{not json"))
    schema = "partition INT, offset BIGINT, timestamp TIMESTAMP, key BINARY, value BINARY"
    return trimmed(validated(spark.createDataFrame(rows, schema), 100_000, 5.0))


def pipeline(checked: Any) -> dict[str, BatchOutputs]:
    with kept(checked) as batch:
        return outputs_by_service(batch, {service: {} for service in SERVICES}, THRESHOLD, BAND)


def grouping_sets(checked: Any) -> dict[str, BatchOutputs]:
    import pyarrow as pa
    import pyarrow.compute as pc
    from pyspark.sql import functions as F

    valid = F.col("valid")
    amount = F.col("amount")
    table = (
        checked.withColumn("bucket", F.when(valid, F.date_trunc("minute", "ts")))
        .coalesce(1)
        .groupingSets([["partition"], ["payer", "payee", "currency"], list(GROUPS[1:])], *GROUPS)
        .agg(
            F.grouping_id().alias("kind"),
            F.min("offset").alias("first"),
            F.max("offset").alias("last"),
            F.count("*").alias("records"),
            F.collect_list(F.when(~valid, F.struct("offset", "timestamp_ms", "key", "value"))).alias(
                "rejected"
            ),
            F.count_if(valid).alias("payments"),
            F.sum(F.when(valid, amount)).alias("total"),
            F.sum(F.when(valid, near_threshold(amount, THRESHOLD, BAND))).alias("near"),
            F.collect_list(F.when(valid, F.struct("ts", "amount"))).alias("paid"),
            F.min(F.when(valid, F.col("ts"))).alias("first_ts"),
            F.max(F.when(valid, F.col("ts"))).alias("last_ts"),
        )
        .select(
            *("kind", *GROUPS, "first", "last", "records", "rejected", "payments", "total", "near"),
            F.when(F.col("payments") > 1, F.col("paid.ts")).alias("times"),
            F.when(F.col("payments") > 1, F.col("paid.amount")).alias("amounts"),
            *("first_ts", "last_ts"),
        )
        .toArrow()
    )
    kind, aggregated = table["kind"], pc.greater(table["payments"], 0)
    spans = table.filter(pc.equal(kind, SPANS))
    rejected = spans["rejected"].combine_chunks()
    flat = pc.list_flatten(rejected)
    rejects = pa.table(
        {
            "partition": pc.take(spans["partition"], pc.list_parent_indices(rejected)),
            **{name: flat.field(name) for name in ("offset", "timestamp_ms", "key", "value")},
        }
    )
    spans = spans.select(["partition", "first", "last", "records"])
    edge_rows = table.filter(pc.and_(pc.equal(kind, EDGES), aggregated))
    edge_rows = edge_rows.select([*EDGE_COLUMNS[:5], "first_ts", "last_ts", "times", "amounts"])
    tables = {
        "edges": edge_rows.rename_columns(EDGE_COLUMNS),
        "flows": table.filter(pc.and_(pc.equal(kind, FLOWS), aggregated)).select(FLOW_COLUMNS),
    }
    return {service: BatchOutputs(spans, rejects, {t: tables[t]}) for service, t in SERVICES.items()}


def union(checked: Any) -> dict[str, BatchOutputs]:
    import pyarrow.compute as pc
    from pyspark.sql import functions as F

    with kept(checked) as batch:
        valid = in_one_task(batch.where("valid"))
        parts = [
            batch.select(*PER_RECORD).withColumn("kind", F.lit(0)),
            edges(valid).withColumn("kind", F.lit(1)),
            flows(valid, THRESHOLD, BAND).withColumn("kind", F.lit(2)),
        ]
        table = parts[0].unionByName(parts[1], allowMissingColumns=True)
        table = table.unionByName(parts[2], allowMissingColumns=True).toArrow()
    rows = table.filter(pc.equal(table["kind"], 0)).select(list(PER_RECORD))
    tables = {
        "edges": table.filter(pc.equal(table["kind"], 1)).select(EDGE_COLUMNS),
        "flows": table.filter(pc.equal(table["kind"], 2)).select(FLOW_COLUMNS),
    }
    spans, rejects = arrow_spans(rows), arrow_rejects(rows)
    return {service: BatchOutputs(spans, rejects, {t: tables[t]}) for service, t in SERVICES.items()}


VARIANTS: dict[str, Callable[[Any], dict[str, BatchOutputs]]] = {
    "pipeline": pipeline,
    "grouping sets": grouping_sets,
    "union": union,
}


def canonical(table: Any) -> tuple[list[tuple[str, str]], list[tuple[Any, ...]]]:
    """A table's field types and its rows in a fixed order (a collected list's order is Spark's choice:
    times and amounts are compared as sorted pairs)."""
    rows = []
    for row in table.to_pylist():
        if row.get("times") is not None:
            pairs = sorted(zip(row["times"], row["amounts"], strict=True))
            row["times"], row["amounts"] = [t for t, _ in pairs], [a for _, a in pairs]
        rows.append(tuple(sorted((k, str(v)) for k, v in row.items())))
    return [(f.name, str(f.type)) for f in table.schema], sorted(rows)


def same_outputs(a: dict[str, BatchOutputs], b: dict[str, BatchOutputs]) -> bool:
    return all(
        canonical(a[s].spans) == canonical(b[s].spans)
        and canonical(a[s].rejects) == canonical(b[s].rejects)
        and canonical(a[s].tables[t]) == canonical(b[s].tables[t])
        for s, t in SERVICES.items()
    )


def jvm_threads(pid: int) -> dict[str, float]:
    """CPU seconds of the JVM's threads by kind (thread names without their numbers)."""
    kinds: dict[str, float] = collections.defaultdict(float)
    for name, seconds in thread_cpu(pid).values():
        name = name.rstrip("0123456789 #-")
        kind = {"C2 CompilerThre": "JIT C2", "C1 CompilerThre": "JIT C1", "Thread": "py4j"}.get(name, name)
        kinds[kind] += seconds
    return kinds


def jvm_pid(spark: Any) -> int:
    """This session's driver JVM (not any other Spark JVM running on the machine)."""
    return int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())


def measure(spark: Any, n: int, rounds: int, block: int) -> dict[str, Any]:
    checked = batch(spark, n)
    reference = pipeline(checked)
    equal = {name: same_outputs(reference, variant(checked)) for name, variant in VARIANTS.items()}
    pid = jvm_pid(spark)
    walls: dict[str, list[float]] = collections.defaultdict(list)
    cpu: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for r in range(rounds):
        for name, variant in VARIANTS.items():
            before = jvm_threads(pid)
            for _ in range(block):
                started = time.perf_counter()
                variant(checked)
                if r >= rounds // 3:
                    walls[name].append(time.perf_counter() - started)
            if r >= rounds // 3:
                for kind, seconds in jvm_threads(pid).items():
                    cpu[name][kind] += seconds - before.get(kind, 0.0)
    result = {}
    for name in VARIANTS:
        wall = sorted(walls[name])
        count = len(wall)
        by_cost = sorted(cpu[name].items(), key=lambda item: -item[1])
        per_batch = {k: 1000 * v / count for k, v in by_cost if v > 0}
        result[name] = {
            "outputs_equal_pipeline": equal[name],
            "batches": count,
            "wall_ms_p50": 1000 * wall[count // 2],
            "wall_ms_p90": 1000 * wall[int(count * 0.9)],
            "jvm_cpu_ms_per_batch": sum(per_batch.values()),
            "jit_cpu_ms_per_batch": per_batch.get("JIT C2", 0.0) + per_batch.get("JIT C1", 0.0),
            "jvm_cpu_ms_by_thread": {k: round(v, 1) for k, v in list(per_batch.items())[:8]},
        }
    return result


def main(args: argparse.Namespace) -> dict[str, Any]:
    from aml_app.pipeline.runner import spark_session

    started = machine()  # the load before the measurement
    options = f"-Dlog4j.rootLogger=WARN {args.java_options}".strip()
    confs = dict(pair.split("=", 1) for pair in args.conf)
    spark = spark_session("local[2]", extra={"spark.driver.extraJavaOptions": options, **confs})
    try:
        sizes = {str(n): measure(spark, n, args.rounds, args.block) for n in args.sizes}
    finally:
        spark.stop()
    return {
        "benchmark": NAME,
        "code_version": code_version(),
        "machine": started,
        "java_options": args.java_options,
        "conf": args.conf,
        "rounds": args.rounds,
        "block": args.block,
        "sizes": sizes,
    }


def report(doc: dict[str, Any]) -> str:
    rows = [
        (
            n,
            name,
            "yes" if v["outputs_equal_pipeline"] else "NO",
            round(v["wall_ms_p50"]),
            round(v["wall_ms_p90"]),
            round(v["jvm_cpu_ms_per_batch"]),
            round(v["jit_cpu_ms_per_batch"]),
            ", ".join(f"{k} {round(ms)}" for k, ms in v["jvm_cpu_ms_by_thread"].items()),
        )
        for n, variants in doc["sizes"].items()
        for name, v in variants.items()
    ]
    headers = [
        "payments per batch",
        "variant",
        "outputs = pipeline's",
        "wall p50 ms",
        "wall p90 ms",
        "JVM CPU ms per batch",
        "of it JIT",
        "JVM CPU by thread (ms)",
    ]
    return markdown_table(headers, rows)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[25, 1_000, 20_000])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--java-options", default="", help="for the driver JVM, e.g. -XX:+UseParallelGC")
    parser.add_argument("--conf", action="append", default=[], help="a Spark setting KEY=VALUE (repeatable)")
    args = parser.parse_args()
    finish(NAME, main(args), report)


if __name__ == "__main__":
    cli()
