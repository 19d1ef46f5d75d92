"""API latency: requests/s and latency of Service B's and Service C's HTTP APIs on PostgreSQL stores.

The stores live in a fresh database on an embedded PostgreSQL server of our own (`EmbeddedPostgres`, a free
port). They are filled without Spark and without Kafka, but through the pipeline's own store code: N
payments (default 100k) over A accounts (default 10k), payer and payee each drawn from a heavy-tailed
(Zipf-like, exponent 0.8) distribution over the accounts, so a few hubs trade with thousands of
counterparties and the median account with a handful; event times spread over the last 6.5 days; 4
partitions. They are applied in micro-batches of 5,000 the way the pipeline applies its batches: each batch
becomes the Arrow tables that `aml_app.pipeline.transforms.batch_outputs` hands the driver (`edges` for B,
`flows` for C: same columns, types and grouping, computed here with Arrow's group-by instead of Spark's),
and `aml_app.pipeline.jobs.writer_for(service)` (`relations.write_edges`, `aggregates.write_batch`) writes
them with `Writer.apply`, in one transaction with the covered offsets.
Then `VACUUM (ANALYZE)` on both schemas, as autovacuum would have done by then on a long-running store
(`--no-vacuum` skips it: planner statistics and visibility map as right after a bulk load).

Then the real servers run as subprocesses (`aml-app serve relations|aggregates`, two replicas of each on
free ports, exactly as the deployment runs them; an embedded broker with the payments topic is there for
their store check, which reads the consumer groups every 2 s) and a load generator on loopback (aiohttp, one
connection per client) keeps C requests in flight for a fixed duration, each for a random account (uniform
over all accounts):

    relations:  GET /relations/{account}?hops=2                  (every part: the neighbourhood too)
                GET /relations/{account}?hops=3&parts=out,cycle  (B's detector query before loops)
                POST /relations, B queries like the one above
                GET /relations/{account}?parts=loop&closing=<random account>&at=<random instant>
                                                                 (the cycle a payment closes, 12 deep)
                GET /relations/{account}?hops=3&parts=chain&closing=<random account>&min_average=1000
                                                                 (the flow a payment continues, 3 deep)
                POST /relations, B/2 payments as a detector asks about them: the payer's out, the
                    payee's chain (through the payer), sources, co_payees and loop (min_average 1000);
                    and the same without the loop
    aggregates: GET /aggregates/{account}?at=<random instant inside the data's time range>  (C's window
                query: the 1 h, 24 h and 7 d windows of one account)
                POST /aggregates, B such queries

for C = 1 and 16 (B = --batch, 100), all against ONE replica of the API; then the two queries the detectors
make per payment (B's `hops=3&parts=out,cycle`, C's window query) again at C = 16 spread over TWO replicas
(clients alternate between them). Reported per (endpoint, C, replicas): requests/s, queries/s (B per
POST), latency p50/p99 (from sending the request to having read the whole body), mean response size,
errors, the API processes' CPU and PostgreSQL's CPU (the server and its backends) over the window. The
pipeline is NOT writing during the measurement (the stores are static). The load generator, the APIs and
PostgreSQL share the machine (2 cores here), so the C = 16 figures are a floor for what the servers alone
could do.

"Before" figures: when `bench/results/api_latency_sqlite.json` (the last run on the SQLite stores, kept) is
there, the report puts its p50/p99 and requests/s next to this run's, row by row.

    .venv/bin/python -m bench.api_latency [--payments 100000] [--accounts 10000] [--duration 10]
        [--concurrency 1 16] [--batch 100] [--replicas 2] [--no-vacuum] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
import uuid
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp

from aml_app import dependency_services as registry
from aml_app.dependencies import aggregates, relations
from aml_app.dependencies.client import PAYEE_PARTS, PAYER_PARTS
from aml_app.dependencies.relations import LOOP_HOPS
from aml_app.dependencies.store import Writer
from aml_app.harness.dependencies import ApiProcess
from aml_app.harness.embedded_postgres import EmbeddedPostgres
from aml_app.harness.verify import percentile
from aml_app.kafka.broker import EmbeddedBroker, create_topics, free_port, wait_until_answering
from aml_app.settings import DependencySettings, KafkaSettings, Settings
from bench.common import CLK_TCK, RESULTS, cpu_seconds, machine, markdown_table, write_results

NAME = "api_latency"
BEFORE = RESULTS / "api_latency_sqlite.json"
PARTITIONS = 4
BATCH = 5_000
ZIPF_EXPONENT = 0.8
SPAN = timedelta(days=6, hours=12)
WARMUP = 1.0
REQUEST_TIMEOUT = 30.0
#: (path, query parameters, JSON body or None for a GET, queries it asks)
Request = tuple[str, dict[str, str], dict[str, Any] | None, int]

COLUMNS = {
    "endpoint": "endpoint",
    "clients": "clients",
    "replicas": "replicas",
    "req_per_s": "req/s",
    "queries_per_s": "queries/s",
    "p50_ms": "p50 ms",
    "p99_ms": "p99 ms",
    "max_ms": "max ms",
    "mean_kb": "mean KB",
    "errors": "errors",
    "server_cpu": "API CPU (cores)",
    "db_cpu": "PostgreSQL CPU (cores)",
}


# --------------------------------------------------------------------------- the stores


def heavy_tailed(accounts: int, rng: random.Random) -> tuple[list[str], list[float]]:
    """Account names in a random order and cumulative Zipf-like weights (rank r has weight r^-s)."""
    names = [f"acct-{i:05d}" for i in range(accounts)]
    rng.shuffle(names)
    cumulative, total = [], 0.0
    for rank in range(1, accounts + 1):
        total += rank**-ZIPF_EXPONENT
        cumulative.append(total)
    return names, cumulative


def payments(count: int, accounts: int, end: datetime, seed: int = 7) -> list[tuple]:
    """`count` payments in event-time order, each (partition, offset, payer, payee, currency, amount, ts)
    at the next offset of partition crc32(payer) % 4."""
    rng = random.Random(seed)
    payers, payer_weights = heavy_tailed(accounts, rng)
    payees, payee_weights = heavy_tailed(accounts, rng)  # another order: hubs as payer and payee differ
    start = end - SPAN
    times = sorted(start + SPAN * rng.random() for _ in range(count))
    rows, next_offset = [], [0] * PARTITIONS
    for ts in times:
        payer = rng.choices(payers, cum_weights=payer_weights)[0]
        payee = rng.choices(payees, cum_weights=payee_weights)[0]
        while payee == payer:
            payee = rng.choices(payees, cum_weights=payee_weights)[0]
        partition = zlib.crc32(payer.encode()) % PARTITIONS
        offset, next_offset[partition] = next_offset[partition], next_offset[partition] + 1
        amount = Decimal(rng.randint(100, 2_500_000)) / 100
        rows.append((partition, offset, payer, payee, "EUR", amount, ts))
    return rows


def batch_outputs(batch: list[tuple], threshold: Decimal, band: Decimal) -> Any:
    """What `transforms.batch_outputs` gives the driver for one micro-batch of valid payments, as the same
    Arrow tables (columns, types, one row per group), grouped by Arrow instead of Spark."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from aml_app.pipeline.transforms import BatchOutputs

    partition, offset, payer, payee, currency, amount, ts = (list(c) for c in zip(*batch, strict=True))
    low, high = aggregates.near_bounds(threshold, band)
    money = pa.decimal128(19, 4)  # validation.AMOUNT_TYPE
    total = pa.decimal128(29, 4)  # Spark's sum of a decimal(19,4)
    instant = pa.timestamp("us", tz="UTC")  # Spark's TIMESTAMP under session time zone UTC
    valid = pa.table(
        {
            "partition": pa.array(partition, pa.int32()),
            "offset": pa.array(offset, pa.int64()),
            "payer": payer,
            "payee": payee,
            "currency": currency,
            "amount": pa.array(amount, money),
            "ts": pa.array(ts, instant),
            "near": pa.array([int(low <= a < high) for a in amount], pa.int64()),
        }
    )
    spans = (
        valid.group_by("partition", use_threads=False)
        .aggregate([("offset", "min"), ("offset", "max"), ("offset", "count")])
        .rename_columns(["partition", "first", "last", "records"])
    )
    edges = valid.group_by(["payer", "payee", "currency"], use_threads=False).aggregate(
        [
            *(("amount", "count"), ("amount", "sum"), ("ts", "min"), ("ts", "max")),
            *(("ts", "list"), ("amount", "list")),
        ]
    )
    several_paid = pc.greater(edges["amount_count"], 1)  # a row of one payment lists none, as Spark's

    def paid(name: str) -> Any:
        column = edges[name].combine_chunks()
        return pc.if_else(several_paid, column, pa.nulls(len(column), column.type))

    edges = pa.table(
        {
            "payer": edges["payer"],
            "payee": edges["payee"],
            "currency": edges["currency"],
            "payments": edges["amount_count"],
            "total": edges["amount_sum"].cast(total),
            "first_seen": edges["ts_min"],
            "last_seen": edges["ts_max"],
            "times": paid("ts_list"),
            "amounts": paid("amount_list"),
        }
    )
    keys = ["payer", "bucket", "payee", "currency"]
    grouped = (
        valid.append_column("bucket", pc.floor_temporal(valid["ts"], unit="minute"))
        .group_by(keys, use_threads=False)
        .aggregate(
            [
                *(("amount", "count"), ("amount", "sum"), ("near", "sum")),
                *(("ts", "list"), ("amount", "list"), ("ts", "min"), ("ts", "max")),
            ]
        )
    )
    several = pc.greater(grouped["amount_count"], 1)  # a row of one payment lists none, as Spark's

    def listed(name: str) -> Any:
        column = grouped[name].combine_chunks()
        return pc.if_else(several, column, pa.nulls(len(column), column.type))

    flows = pa.table(
        {
            **{k: grouped[k] for k in keys},
            "payments": grouped["amount_count"],
            "total": grouped["amount_sum"].cast(total),
            "near": grouped["near_sum"],
            "times": listed("ts_list"),
            "amounts": listed("amount_list"),
            "first_ts": grouped["ts_min"],
            "last_ts": grouped["ts_max"],
        }
    )
    rejects = pa.table({"partition": pa.array([], pa.int32()), "offset": pa.array([], pa.int64())})
    return BatchOutputs(spans, rejects, {"edges": edges, "flows": flows})


def schema_mb(url: str, schema: str) -> float:
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r'",
            (schema,),
        ).fetchone()
    return round(int(row[0]) / 1e6, 1) if row else float("nan")


def build_stores(settings: Settings, rows: list[tuple], vacuum: bool) -> dict[str, Any]:
    """Apply `rows` to fresh stores in micro-batches of BATCH, as the pipeline's batch handler does;
    returns what the stores hold."""
    import psycopg

    from aml_app.pipeline.jobs import writer_for

    started = time.monotonic()
    threshold, band = settings.dependencies.reporting_threshold, settings.dependencies.threshold_band
    writers = {
        name: Writer(settings.dependencies.store_url, dep.schema) for name, dep in registry.SERVICES.items()
    }
    applied: dict[str, dict[int, int]] = {}
    try:
        for service, writer in writers.items():
            writer.migrate()
            applied[service] = writer.applied_offsets()
        conn = writers["aggregates"].connection()
        with conn.transaction():
            aggregates.check_thresholds(conn, aggregates.SCHEMA, threshold, band)
        for i in range(0, len(rows), BATCH):
            outputs = batch_outputs(rows[i : i + BATCH], threshold, band)
            for service, writer in writers.items():
                covered = outputs.covered(applied[service])
                write = writer_for(service)

                def apply(conn: psycopg.Connection, write: Any = write, outputs: Any = outputs) -> None:
                    write(conn, outputs)

                writer.apply(covered, apply)
                applied[service].update({p: end for p, (_start, end) in covered.items()})
    finally:
        for writer in writers.values():
            writer.close()
    written = time.monotonic() - started
    if vacuum:
        with psycopg.connect(settings.dependencies.store_url, autocommit=True) as conn:
            for schema in (relations.SCHEMA, aggregates.SCHEMA):
                for table in ("edges",) if schema is relations.SCHEMA else ("flows",):
                    conn.execute(f'VACUUM (ANALYZE) "{schema.name}"."{table}"')
    out_degree: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        out_degree[row[2]].add(row[3])
    degrees = sorted(len(v) for v in out_degree.values())
    return {
        "seconds": round(written, 1),
        "vacuum_analyze_s": round(time.monotonic() - started - written, 1) if vacuum else None,
        "edges": sum(degrees),
        "payers": len(degrees),
        "out_degree_p50": percentile(degrees, 50),
        "out_degree_p99": percentile(degrees, 99),
        "out_degree_max": degrees[-1],
        "relations_mb": schema_mb(settings.dependencies.store_url, "relations"),
        "aggregates_mb": schema_mb(settings.dependencies.store_url, "aggregates"),
        "applied_offsets": applied["relations"],
    }


# --------------------------------------------------------------------------- CPU of PostgreSQL


def tree_cpu(pid: int) -> float | None:
    """CPU seconds of a process, its live descendants and its reaped children (PostgreSQL's backends)."""
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
            stats[int(entry.name)] = fields
    if pid not in stats:
        return None
    family, frontier = {pid}, [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier and p not in family]
        family.update(frontier)
    ticks = sum(int(stats[p][i]) for p in family & set(stats) for i in (11, 12, 13, 14))
    return ticks / CLK_TCK


def postmaster_pid(server: EmbeddedPostgres) -> int:
    return int((server.data / "postmaster.pid").read_text().split()[0])


# --------------------------------------------------------------------------- the load


async def wait_healthy(api: ApiProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while await api.health() is None:
        if not api.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the {api.name} did not come up; its log:\n{api.log_tail()}")
        await asyncio.sleep(0.2)


async def drive(
    apis: Sequence[ApiProcess],
    label: str,
    request: Any,
    clients: int,
    duration: float,
    rng: random.Random,
    db_pid: int,
) -> dict[str, Any]:
    """`clients` loops, each with one request in flight, for WARMUP + `duration` seconds; measures the
    last `duration`. Client k talks to `apis[k % len(apis)]`. `request(rng)` gives (path, query params,
    JSON body or None for a GET, queries)."""
    latencies: list[float] = []
    sizes: list[int] = []
    queries = 0
    errors = 0
    timeout = aiohttp.ClientTimeout(REQUEST_TIMEOUT)
    sessions = [
        aiohttp.ClientSession(api.url, connector=aiohttp.TCPConnector(limit=clients), timeout=timeout)
        for api in apis
    ]
    try:
        measure_from = time.monotonic() + WARMUP
        stop_at = measure_from + duration

        async def client(session: aiohttp.ClientSession) -> None:
            nonlocal errors, queries
            while (now := time.monotonic()) < stop_at:
                path, params, payload, asked = request(rng)
                call = (
                    session.get(path, params=params) if payload is None else session.post(path, json=payload)
                )
                try:
                    async with call as response:
                        body = await response.read()
                        ok = response.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    body, ok = b"", False
                if now >= measure_from:
                    latencies.append((time.monotonic() - now) * 1000)
                    sizes.append(len(body))
                    errors += not ok
                    queries += asked

        pids = [api.process.pid for api in apis if api.process is not None]
        tasks = [asyncio.create_task(client(sessions[k % len(sessions)])) for k in range(clients)]
        await asyncio.sleep(WARMUP)
        cpu_before = sum(cpu_seconds(pid) or 0.0 for pid in pids)
        db_before = tree_cpu(db_pid) or 0.0
        await asyncio.gather(*tasks)
        cpu_after = sum(cpu_seconds(pid) or 0.0 for pid in pids)
        db_after = tree_cpu(db_pid) or 0.0
    finally:
        for session in sessions:
            await session.close()
    window = duration + (time.monotonic() - stop_at)  # the last requests end after stop_at
    return {
        "endpoint": label,
        "clients": clients,
        "replicas": len(apis),
        "requests": len(latencies),
        "req_per_s": round(len(latencies) / window, 1),
        "queries_per_s": round(queries / window, 1),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "max_ms": round(max(latencies, default=float("nan")), 2),
        "mean_kb": round(sum(sizes) / max(len(sizes), 1) / 1000, 1),
        "errors": errors,
        "server_cpu": round((cpu_after - cpu_before) / window, 2),
        "db_cpu": round((db_after - db_before) / window, 2),
    }


def before_and_after(rows: list[dict[str, Any]]) -> str | None:
    """This run's rows next to the kept SQLite run's, matched by endpoint and clients (one replica)."""
    if not BEFORE.exists():
        return None
    old = json.loads(BEFORE.read_text())
    by_key = {(r["endpoint"], r["clients"]): r for r in old["runs"]}
    table = []
    for r in rows:
        was = by_key.get((r["endpoint"], r["clients"])) if r["replicas"] == 1 else None
        if was is None:
            continue
        table.append(
            [
                r["endpoint"],
                r["clients"],
                was["p50_ms"],
                r["p50_ms"],
                was["p99_ms"],
                r["p99_ms"],
                was["req_per_s"],
                r["req_per_s"],
            ]
        )
    headers = ["endpoint", "clients", "p50 ms SQLite", "p50 ms PG", "p99 ms SQLite", "p99 ms PG"]
    headers += ["req/s SQLite", "req/s PG"]
    code = old.get("machine", {}).get("code_at_start")
    return f"Before (SQLite stores, code {code}, {BEFORE.name}) and after (PostgreSQL, this run):\n\n" + (
        markdown_table(headers, table)
    )


def workfolder() -> Path:
    workdir = Path(tempfile.mkdtemp(prefix="aml-api-bench-"))
    workdir.chmod(0o755)  # a root run hands the PostgreSQL folder inside it to an unprivileged user
    return workdir


async def main(args: argparse.Namespace) -> None:
    workdir = workfolder()
    info = machine()
    suffix = uuid.uuid4().hex[:8]
    broker: EmbeddedBroker | None = None
    server: EmbeddedPostgres | None = None
    apis: dict[str, list[ApiProcess]] = {}
    ok = False
    rows: list[dict[str, Any]] = []
    try:
        server = await asyncio.to_thread(EmbeddedPostgres(workdir / "postgres", free_port()).start)
        broker = await asyncio.to_thread(EmbeddedBroker(free_port(), log_path=workdir / "broker.log").start)
        await wait_until_answering([broker.bootstrap])
        settings = Settings(
            kafka=KafkaSettings(bootstrap_servers=(broker.bootstrap,), payments_topic=f"payments-{suffix}"),
            dependencies=DependencySettings(
                endpoints={
                    name: replace(s.default_endpoint(), group=f"{name}-{suffix}")
                    for name, s in registry.SERVICES.items()
                },
                store_url=server.url(),
            ),
        )
        await create_topics([broker.bootstrap], [settings.kafka.payments_topic], PARTITIONS)
        end = datetime.now(UTC)
        print(f"building stores: {args.payments} payments over {args.accounts} accounts in {server.url()}")
        stores = await asyncio.to_thread(
            build_stores, settings, payments(args.payments, args.accounts, end), not args.no_vacuum
        )
        print(
            f"  {stores['seconds']} s (+ VACUUM ANALYZE {stores['vacuum_analyze_s']} s); {stores['edges']} "
            f"edges, out-degree p50 {stores['out_degree_p50']:.0f} / p99 {stores['out_degree_p99']:.0f} / "
            f"max {stores['out_degree_max']}; relations {stores['relations_mb']} MB, aggregates "
            f"{stores['aggregates_mb']} MB"
        )
        accounts = [f"acct-{i:05d}" for i in range(args.accounts)]
        span_s = SPAN.total_seconds()

        def instant(rng: random.Random) -> str:
            return (end - timedelta(seconds=span_s * rng.random())).isoformat().replace("+00:00", "Z")

        def relations_everything(rng: random.Random) -> Request:
            return f"/relations/{rng.choice(accounts)}", {"hops": "2"}, None, 1

        def relations_detector(rng: random.Random) -> Request:
            return f"/relations/{rng.choice(accounts)}", {"hops": "3", "parts": "out,cycle"}, None, 1

        def relations_loop(rng: random.Random) -> Request:
            closing, at = rng.choice(accounts), instant(rng)
            return (
                f"/relations/{rng.choice(accounts)}",
                {"parts": "loop", "closing": closing, "at": at},
                None,
                1,
            )

        def relations_chain(rng: random.Random) -> Request:
            payer, payee = rng.choice(accounts), rng.choice(accounts)
            query = {"hops": "3", "parts": "chain", "closing": payer, "min_average": "1000"}
            return f"/relations/{payee}", query, None, 1

        def relations_evidence(rng: random.Random, loops: bool = True) -> Request:
            queries = []
            for _ in range(args.batch // 2):
                payer, payee = rng.choice(accounts), rng.choice(accounts)
                common = {"hops": 3, "min_average": "1000"}
                queries.append({"account": payer, "parts": PAYER_PARTS, **common})
                if loops:
                    loop = {"closing": payer, "at": instant(rng), "loop_hops": LOOP_HOPS}
                    queries.append({"account": payee, "parts": PAYEE_PARTS, **common, **loop})
                else:
                    queries.append(
                        {"account": payee, "parts": "chain,sources,co_payees", "closing": payer, **common}
                    )
            return "/relations", {}, {"queries": queries}, len(queries)

        def relations_evidence_without_loops(rng: random.Random) -> Request:
            return relations_evidence(rng, loops=False)

        def aggregates_one(rng: random.Random) -> Request:
            return f"/aggregates/{rng.choice(accounts)}", {"at": instant(rng)}, None, 1

        def relations_batch(rng: random.Random) -> Request:
            body = {
                "queries": [
                    {"account": rng.choice(accounts), "hops": 3, "parts": "out,cycle"}
                    for _ in range(args.batch)
                ]
            }
            return "/relations", {}, body, args.batch

        def aggregates_batch(rng: random.Random) -> Request:
            body = {
                "queries": [{"account": rng.choice(accounts), "at": instant(rng)} for _ in range(args.batch)]
            }
            return "/aggregates", {}, body, args.batch

        detector_label = "GET /relations hops=3 parts=out,cycle"
        window_label = "GET /aggregates"
        endpoints = [
            ("relations", "GET /relations hops=2 (all parts)", relations_everything),
            ("relations", detector_label, relations_detector),
            (
                "relations",
                f"POST /relations, {args.batch} queries of hops=3 parts=out,cycle",
                relations_batch,
            ),
            ("relations", "GET /relations parts=loop (12 deep)", relations_loop),
            ("relations", "GET /relations parts=chain through a payer (a flow, 3 deep)", relations_chain),
            ("relations", f"POST /relations, {args.batch} queries as a detector asks", relations_evidence),
            (
                "relations",
                f"POST /relations, {args.batch} queries as a detector asks, no loop",
                relations_evidence_without_loops,
            ),
            ("aggregates", window_label, aggregates_one),
            ("aggregates", f"POST /aggregates, {args.batch} queries", aggregates_batch),
        ]
        replicated = [
            ("relations", detector_label, relations_detector),
            ("aggregates", window_label, aggregates_one),
        ]

        for kind in ("relations", "aggregates"):
            for replica in range(1, max(args.replicas, 1) + 1):
                port = free_port()
                own = settings.with_endpoint(kind, port=port)
                name = kind if replica == 1 else f"{kind}-{replica}"
                api = ApiProcess(kind, own, workdir / f"{name}-api.log", name=f"{name} API").start()
                apis.setdefault(kind, []).append(api)
        for api in (a for replicas in apis.values() for a in replicas):
            await wait_healthy(api)
        db_pid = postmaster_pid(server)
        rng = random.Random(11)

        async def run(kind: str, label: str, request: Any, clients: int, replicas: int) -> None:
            row = await drive(apis[kind][:replicas], label, request, clients, args.duration, rng, db_pid)
            print(
                f"  {label:<50} C={clients:<3} R={replicas} {row['req_per_s']:>8} req/s "
                f"({row['queries_per_s']} queries/s)  p50 {row['p50_ms']} ms  p99 {row['p99_ms']} ms  "
                f"errors {row['errors']}  API CPU {row['server_cpu']}  PostgreSQL CPU {row['db_cpu']}"
            )
            rows.append(row)

        for kind, label, request in endpoints:
            for clients in args.concurrency:
                await run(kind, label, request, clients, 1)
        if args.replicas > 1:
            for kind, label, request in replicated:
                await run(kind, label, request, max(args.concurrency), args.replicas)
        checks = {}  # the APIs' store check at the end: "ok" when it compared the store with the groups
        for api in (a for replicas in apis.values() for a in replicas):
            checks[api.name] = (await api.health() or {}).get("store_check")
        ok = True
    finally:
        for api in (a for replicas in apis.values() for a in replicas):
            await asyncio.to_thread(api.stop, 10)
        if broker is not None:
            await asyncio.to_thread(broker.stop)
        if server is not None:
            await asyncio.to_thread(server.stop)
        if args.keep or not ok:
            print(f"PostgreSQL folder and logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    doc: dict[str, Any] = {
        "machine": info,
        "at": time.time(),
        "config": {
            "payments": args.payments,
            "accounts": args.accounts,
            "zipf_exponent": ZIPF_EXPONENT,
            "partitions": PARTITIONS,
            "batch": BATCH,
            "duration_s": args.duration,
            "queries_per_batch": args.batch,
            "warmup_s": WARMUP,
            "replicas": args.replicas,
            "vacuum_analyze": not args.no_vacuum,
            "store": "PostgreSQL (embedded, Debian binaries), filled by the pipeline's store writers",
            "pipeline_writing": False,
            "client": "aiohttp on loopback, same machine as the APIs and PostgreSQL",
        },
        "stores": stores,
        "store_checks_at_end": checks,
        "runs": rows,
    }
    path = write_results(NAME, doc)
    print()
    print("API latency (static stores: the pipeline is not writing; client, APIs, PostgreSQL share the CPUs)")
    print(markdown_table(list(COLUMNS.values()), [[r[k] for k in COLUMNS] for r in rows]))
    comparison = before_and_after(rows)
    if comparison:
        print()
        print(comparison)
    load = doc["machine"]
    print(f"\nload average at start {load['loadavg_at_start']}, at end {load['loadavg_at_end']}")
    print(f"written to {path}")


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--payments", type=int, default=100_000)
    parser.add_argument("--accounts", type=int, default=10_000)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--batch", type=int, default=100, help="queries per POST (the detectors' batches)")
    parser.add_argument(
        "--replicas", type=int, default=2, help="API replicas for the extra rows (1: no extra rows)"
    )
    parser.add_argument("--no-vacuum", action="store_true", help="skip VACUUM (ANALYZE) after the build")
    parser.add_argument("--keep", action="store_true", help="keep the PostgreSQL folder and the logs")
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
