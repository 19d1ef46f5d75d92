"""What Services B and C compute from one micro-batch, as Spark DataFrame operations (in the JVM).

Python touches no record here: the Kafka source hands Spark raw bytes, `validation.validated` parses and
checks them with Spark SQL, and the results leave Spark already aggregated, as Arrow tables:

- `spans`: per partition, the first and last offset and the number of records (what the batch covers);
- `rejects`: the records that break the payment contract, with their timestamps and original bytes (for
  the DLQ);
- relations: `edges`, one row per (payer, payee, currency) of the batch;
- aggregates: `flows`, one row per (payer, minute, payee, currency) with counts, exact totals,
  near-threshold counts, the payments' times and amounts (when there are several), and the first and
  last time.

The batch is parsed once and kept in memory while the services' jobs run (`persist`), so Kafka is read
and the contract checked once per batch, whatever the number of services and outputs; the streaming
query itself applies `validated` (`runner.start_queries`), so the contract's large plan is built once
per query rather than once per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from functools import partial
from typing import Any

from pyspark import InheritableThread, StorageLevel
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from aml_app import dependency_services as registry
from aml_app.contract import DEFAULT_MAX_CLOCK_SKEW
from aml_app.pipeline.expressions import built_once
from aml_app.pipeline.repeats import Seen, find_repeats
from aml_app.pipeline.validation import validated

SERVICES = registry.NAMES


@dataclass
class BatchOutputs:
    """One micro-batch's results on the driver, as Arrow tables (see the module docstring)."""

    spans: Any
    rejects: Any
    tables: dict[str, Any] = field(default_factory=dict)
    #: Records of a derived topic skipped as copies of payments applied before (`repeats`).
    repeated: int = 0
    #: A derived topic's batch: the highest payment offset applied per (derived partition, payments
    #: partition) once the batch is (`repeats`); None for a batch of payments.
    sources: Seen | None = None

    def covered(self, applied: dict[int, int]) -> dict[int, tuple[int, int]]:
        """Per partition, the offsets the batch covers: from where the store left off to its last record.

        From the store's offset rather than the first record: offsets may have holes (transaction markers,
        compaction) where a batch starts.
        """
        spans = self.spans.to_pydict()
        return {
            p: (min(first, applied.get(p, first)), last + 1)
            for p, first, last in zip(spans["partition"], spans["first"], spans["last"], strict=True)
        }

    @property
    def records(self) -> int:
        return sum(self.spans["records"].to_pylist())


def expressions(frame: DataFrame, name: Any, build: Callable[[], tuple[Column | str, ...]]) -> tuple:
    """The columns `build()` makes, built once per Spark context and `name` (`built_once`)."""
    return built_once(frame.sparkSession.sparkContext, ("transforms", name), build)


def edges(valid: DataFrame) -> DataFrame:
    """Service B: the batch's payments summed per directed edge and currency, with each payment's time
    and amount (in the same order) when there are several, so that B can answer as of any instant (one
    is first_seen and total)."""
    totals = expressions(
        valid,
        "edges",
        lambda: (
            F.count("*").alias("payments"),
            F.sum("amount").alias("total"),
            F.min("ts").alias("first_seen"),
            F.max("ts").alias("last_seen"),
            F.collect_list(F.struct("ts", "amount")).alias("paid"),
        ),
    )
    columns = expressions(
        valid,
        "edge columns",
        lambda: (
            *("payer", "payee", "currency", "payments", "total", "first_seen", "last_seen"),
            F.when(F.col("payments") > 1, F.col("paid.ts")).alias("times"),
            F.when(F.col("payments") > 1, F.col("paid.amount")).alias("amounts"),
        ),
    )
    return valid.groupBy("payer", "payee", "currency").agg(*totals).select(*columns)


def near_threshold(amount: Column, threshold: Decimal, band: Decimal) -> Column:
    """1 for an amount in [threshold * (1 - band), threshold), else 0 (exact decimal comparison)."""
    low = F.lit(threshold * (1 - band)).cast("decimal(38,8)")
    high = F.lit(threshold).cast("decimal(38,8)")
    return F.when((amount >= low) & (amount < high), 1).otherwise(0)


def flows(valid: DataFrame, threshold: Decimal, band: Decimal) -> DataFrame:
    """Service C: per payer, minute of event time, payee and currency, the payments between them: their
    number, exact total, near-threshold count, and each payment's time and amount (in the same order),
    for the partial minutes at a window's edges, when there are several (one is first_ts and total)."""
    keys = expressions(
        valid,
        "flow keys",
        lambda: ("payer", F.date_trunc("minute", "ts").alias("bucket"), "payee", "currency"),
    )
    totals = expressions(
        valid,
        ("flow totals", threshold, band),
        lambda: (
            F.count("*").alias("payments"),
            F.sum("amount").alias("total"),
            F.sum(near_threshold(F.col("amount"), threshold, band)).alias("near"),
            F.collect_list(F.struct("ts", "amount")).alias("paid"),
            F.min("ts").alias("first_ts"),
            F.max("ts").alias("last_ts"),
        ),
    )
    columns = expressions(
        valid,
        "flow columns",
        lambda: (
            "payer",
            "bucket",
            "payee",
            "currency",
            "payments",
            "total",
            "near",
            F.when(F.col("payments") > 1, F.col("paid.ts")).alias("times"),  # one: first_ts and total
            F.when(F.col("payments") > 1, F.col("paid.amount")).alias("amounts"),
            "first_ts",
            "last_ts",
        ),
    )
    return valid.groupBy(*keys).agg(*totals).select(*columns)


def trimmed(checked: DataFrame) -> DataFrame:
    """What the outputs read of a validated batch: the offsets, the verdict, a rejected record's timestamp
    and bytes (for its dead letter's reason and content) and a valid payment's fields. Not the valid
    records' bytes nor the payment ids, which no output reads: caching them cost the JVM a copy of each
    and a hash lookup per string for the cache's compression statistics (building the cache was a tenth
    of a warm batch's executor samples in Java Flight Recorder). The streaming query applies it once,
    with the contract (`runner.start_queries`): a projection built per micro-batch over the contract's
    large plan would be analysed again every batch. A `source` column (a derived topic's records) is kept
    for the batch handler, which skips a payment it applied before (`repeats`)."""

    def columns() -> tuple[Column | str, ...]:
        rejected = ~F.col("valid")
        return (
            "partition",
            "offset",
            "valid",
            # Milliseconds, Kafka's unit and the Python contract's: no time zone between here and there.
            F.when(rejected, F.unix_millis("timestamp")).alias("timestamp_ms"),
            F.when(rejected, F.col("key")).alias("key"),
            F.when(rejected, F.col("value")).alias("value"),
            "payer",
            "payee",
            "amount",
            "currency",
            "ts",
            *(["source"] if sourced else []),
        )

    sourced = "source" in checked.columns
    return checked.select(*expressions(checked, ("trimmed", sourced), columns))


@contextmanager
def kept(batch: DataFrame) -> Iterator[DataFrame]:
    """A batch (`trimmed`) cached in memory for the block (the batch's outputs read it once each)."""
    cached = batch.persist(StorageLevel.MEMORY_ONLY)
    try:
        yield cached
    finally:
        cached.unpersist()


def not_applied(frame: DataFrame, applied: Mapping[int, int]) -> DataFrame:
    """The records of `frame` at or past a store's offsets (all of them, normally)."""
    if not applied:
        return frame
    pairs = [F.lit(x) for p, o in sorted(applied.items()) for x in (p, o)]
    start = F.coalesce(F.element_at(F.create_map(*pairs), F.col("partition")), F.lit(0))
    return frame.where(F.col("offset") >= start)


def arrow_not_applied(rows: Any, applied: Mapping[int, int]) -> Any:
    """`not_applied` for the per-record Arrow rows on the driver."""
    if not applied or rows.num_rows == 0:
        return rows
    import pyarrow as pa
    import pyarrow.compute as pc

    highest = max(pc.max(rows["partition"]).as_py(), *applied)
    starts = pa.array([applied.get(p, 0) for p in range(highest + 1)], pa.int64())
    return rows.filter(pc.greater_equal(rows["offset"], pc.take(starts, rows["partition"])))


def batch_outputs(
    records: DataFrame,
    service: str,
    max_bytes: int,
    threshold: Decimal,
    band: Decimal,
    max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW,
) -> BatchOutputs:
    """Everything `service` needs from one micro-batch of Kafka records, collected to the driver."""
    with kept(trimmed(validated(records, max_bytes, max_clock_skew))) as checked:
        return outputs_by_service(checked, {service: {}}, threshold, band)[service]


def outputs_by_service(
    checked: DataFrame,
    applied: Mapping[str, Mapping[int, int]],
    threshold: Decimal,
    band: Decimal,
    seen: Mapping[str, Seen] | None = None,
) -> dict[str, BatchOutputs]:
    """Each service's outputs from one validated batch (`validation.validated`, then `trimmed`, best kept),
    skipping for each service the records its store already holds (`applied`: service -> its offsets)
    and, for a batch of a derived topic (a `source` column), the copies of payments it applied before
    (`seen`: service -> its state, `repeats`).

    One Spark job per output, because each job costs a fixed price that dominates small batches (most of
    it driver time: planning, scheduling): one narrow collect shared by the services (offsets and the
    rejected records' bytes), from which the driver takes each service's spans and rejects with Arrow;
    then the services' aggregations (edges, flows), run concurrently, each in one task without a
    shuffle (`in_one_task`).
    """
    if not applied or not set(applied) <= set(SERVICES):
        raise ValueError(f"services must be some of {', '.join(SERVICES)}, got {sorted(applied)}")
    if len({tuple(sorted(offsets.items())) for offsets in applied.values()}) == 1:
        # Every service holds the same offsets: the query started there and reads on, so no store holds
        # a record of this batch, and building the skip (about 20 ms per service and batch) is wasted.
        applied = {service: {} for service in applied}

    sourced = "source" in checked.columns
    per_record = (
        "partition",
        "offset",
        "valid",
        "timestamp_ms",
        "key",
        "value",
        *(["source"] if sourced else []),
    )
    valid = in_one_task(checked.where("valid"))
    aggregations = {
        service: partial(aggregation, service, not_applied(valid, offsets), threshold, band)
        for service, offsets in applied.items()
    }
    aggregated = concurrently(aggregations, lambda: checked.select(*per_record).toArrow())
    rows = aggregated.pop(None)
    outputs = {}
    for service, offsets in applied.items():
        mine = arrow_not_applied(rows, offsets)
        table = registry.service(service).table
        output = BatchOutputs(arrow_spans(mine), arrow_rejects(mine), {table: aggregated[service]})
        if sourced:
            again = partial(aggregation, service, threshold=threshold, band=band)
            unapplied = partial(not_applied, valid, offsets)
            _skip_repeats(output, mine, (seen or {}).get(service, {}), again, unapplied)
        outputs[service] = output
    return outputs


def _skip_repeats(
    output: BatchOutputs,
    rows: Any,
    seen: Mapping[tuple[int, int], int],
    aggregate: Callable[[DataFrame], Any],
    valid: Callable[[], DataFrame],
) -> None:
    """Leave a derived topic's copies of payments applied before (`repeats`) out of a service's outputs.

    The aggregation ran on the whole batch, side by side with the collect that finds the copies; copies
    are rare (a stage's restart), so it runs again, without them, only when there are some, on the
    batch's valid payments the store does not hold (`valid()`, built then). The spans still cover the
    copies: the service has read them.
    """
    import pyarrow as pa

    repeated, moved = find_repeats(
        rows["partition"].to_numpy(), rows["offset"].to_numpy(), rows["source"], seen
    )
    output.sources = {**seen, **moved}
    output.repeated = int(repeated.sum())
    if not output.repeated:
        return
    output.rejects = arrow_rejects(rows.filter(pa.array(~repeated)))
    copies = rows.filter(pa.array(repeated))
    names = [
        f"{p}:{o}" for p, o in zip(copies["partition"].to_pylist(), copies["offset"].to_pylist(), strict=True)
    ]
    table = next(iter(output.tables))
    output.tables[table] = aggregate(valid().where(~F.concat_ws(":", "partition", "offset").isin(names)))


def in_one_task(frame: DataFrame) -> DataFrame:
    """`frame` as one partition, so that grouping it needs no shuffle.

    A micro-batch is at most `maxRecordsPerTrigger` records (100,000 by default), which one task groups in
    a few hundred milliseconds; a shuffle costs a second stage, files and a scheduling round of its own, about
    100 ms per aggregation on local[2] whatever the batch's size (measured: 1,300-record batches 487 ->
    397 ms per micro-batch, 20,000-record batches no slower). The batch is still read and checked in
    parallel: only the aggregation's input is gathered, from the kept batch.
    """
    return frame.coalesce(1)


def edges_table(valid: DataFrame, threshold: Decimal, band: Decimal) -> Any:
    """B's table of a batch (`edges`), as Arrow."""
    return edges(valid).toArrow()


def flows_table(valid: DataFrame, threshold: Decimal, band: Decimal) -> Any:
    """C's table of a batch (`flows`), as Arrow."""
    return flows(valid, threshold, band).toArrow()


def aggregation(service: str, valid: DataFrame, threshold: Decimal, band: Decimal) -> Any:
    """The service's aggregated output of a batch's valid payments, as an Arrow table: the transform
    its registry entry names."""
    return registry.load(registry.service(service).transform)(valid, threshold, band)


def concurrently(jobs: Mapping[str, Callable[[], Any]], here: Callable[[], Any]) -> dict[str | None, Any]:
    """Run `jobs` in threads of their own and `here` in this thread; their results by name (`here`'s
    under None). Spark runs jobs submitted from several threads side by side, so the fixed costs of
    small jobs overlap; `InheritableThread` carries this thread's Spark properties (job group, scheduler
    pool) to the others. The first error is raised once all are done."""
    results: dict[str | None, Any] = {}
    errors: list[BaseException] = []

    def run(name: str | None, job: Callable[[], Any]) -> None:
        try:
            results[name] = job()
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [InheritableThread(target=run, args=(name, job), daemon=True) for name, job in jobs.items()]
    for thread in threads:
        thread.start()
    run(None, here)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def arrow_spans(rows: Any) -> Any:
    """`spans` of a batch's per-record Arrow rows (partition, offset)."""
    aggregations = [("offset", "min"), ("offset", "max"), ("offset", "count")]
    grouped = rows.group_by("partition").aggregate(aggregations)
    return grouped.rename_columns(
        {"offset_min": "first", "offset_max": "last", "offset_count": "records"}
    ).select(["partition", "first", "last", "records"])


def arrow_rejects(rows: Any) -> Any:
    import pyarrow.compute as pc

    # A derived topic's record keeps the payment it names (`source`) in its dead letter.
    columns = [
        "partition",
        "offset",
        "timestamp_ms",
        "key",
        "value",
        *(["source"] if "source" in rows.column_names else []),
    ]
    return rows.filter(pc.invert(rows["valid"])).select(columns)
