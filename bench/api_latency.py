"""API latency: requests/s and latency of Service B's and Service C's HTTP APIs on realistic stores.

The stores are built directly, without Spark: N payments (default 100k) over A accounts (default 10k),
payer and payee each drawn from a heavy-tailed (Zipf-like, exponent 0.8) distribution over the accounts,
so a few hubs trade with thousands of counterparties and the median account with a handful; event times
spread over the last 6.5 days; 4 partitions; applied in batches of 5,000 the way the pipeline applies its
micro-batches (`RelationsStore.apply` with per-batch `EdgeDelta`s, `AggregatesStore.apply` with
`PaymentRow`s, each with its covered offsets).

Then the real servers run as subprocesses (`aml-app serve relations|aggregates` on those stores, free
ports) and a load generator on loopback (aiohttp, one connection per client) keeps C requests in flight
for a fixed duration, each for a random account (uniform over all accounts):

    relations:  GET /relations/{account}?hops=2                  (every part: the neighbourhood too)
                GET /relations/{account}?hops=3&parts=out,cycle  (what a detector asks per payment)
                POST /relations, B queries like the one above    (what a detector asks per batch)
    aggregates: GET /aggregates/{account}?at=<random instant inside the data's time range>
                POST /aggregates, B such queries

for C = 1 and 16 (B = --batch, 100). Reported per (endpoint, C): requests/s, queries/s (B per POST),
latency p50/p99 (from sending the request to
having read the whole body), mean response size, errors, and the server's CPU use over the window. The
pipeline is NOT writing during the measurement (the stores are static); while it writes, readers still
never block (WAL) but compete with it for the CPU. The load generator shares the machine (2 cores here)
with the server, so at C = 16 the figures are a floor for what the server alone could do.

    .venv/bin/python -m bench.api_latency [--payments 100000] [--accounts 10000] [--duration 10]
        [--concurrency 1 16] [--batch 100] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
import time
import zlib
from collections import defaultdict
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp

from aml_app.broker import free_port
from aml_app.dependency_services import ApiProcess
from aml_app.services.aggregates import AggregatesStore, PaymentRow
from aml_app.services.relations import EdgeDelta, RelationsStore
from aml_app.settings import Settings
from aml_app.verify import percentile
from bench.common import cpu_seconds, machine, markdown_table, write_results

NAME = "api_latency"
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
    "req_per_s": "req/s",
    "queries_per_s": "queries/s",
    "p50_ms": "p50 ms",
    "p99_ms": "p99 ms",
    "max_ms": "max ms",
    "mean_kb": "mean KB",
    "errors": "errors",
    "server_cpu": "server CPU (cores)",
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


def payments(count: int, accounts: int, end: datetime, seed: int = 7) -> list[PaymentRow]:
    """`count` payments in event-time order, each at the next offset of partition crc32(payer) % 4."""
    rng = random.Random(seed)
    payers, payer_weights = heavy_tailed(accounts, rng)
    payees, payee_weights = heavy_tailed(accounts, rng)  # another order: hubs as payer and payee differ
    start = end - SPAN
    times = sorted(start + SPAN * rng.random() for _ in range(count))
    rows, next_offset = [], [0] * PARTITIONS
    for n, ts in enumerate(times):
        payer = rng.choices(payers, cum_weights=payer_weights)[0]
        payee = rng.choices(payees, cum_weights=payee_weights)[0]
        while payee == payer:
            payee = rng.choices(payees, cum_weights=payee_weights)[0]
        partition = zlib.crc32(payer.encode()) % PARTITIONS
        offset, next_offset[partition] = next_offset[partition], next_offset[partition] + 1
        amount = Decimal(rng.randint(100, 2_500_000)) / 100
        rows.append(PaymentRow(partition, offset, f"pay-{n:07d}", payer, payee, amount, "EUR", ts))
    return rows


def edge_deltas(batch: list[PaymentRow]) -> list[EdgeDelta]:
    """What Spark's groupBy(payer, payee, currency) makes of one micro-batch."""
    edges: dict[tuple[str, str, str], list[Any]] = {}
    for row in batch:
        key = (row.payer, row.payee, row.currency)
        edge = edges.get(key)
        if edge is None:
            edges[key] = [1, row.amount, row.ts, row.ts]
        else:
            edge[0] += 1
            edge[1] += row.amount
            edge[2], edge[3] = min(edge[2], row.ts), max(edge[3], row.ts)
    return [EdgeDelta(*key, n, total, first, last) for key, (n, total, first, last) in edges.items()]


def build_stores(settings: Settings, rows: list[PaymentRow]) -> dict[str, Any]:
    """Apply `rows` to fresh stores in micro-batches of BATCH; returns what the stores hold."""
    started = time.monotonic()
    relations = RelationsStore(settings.relations_db)
    aggregates = AggregatesStore(
        settings.aggregates_db, settings.reporting_threshold, settings.threshold_band
    )
    applied: dict[int, int] = {}
    try:
        for i in range(0, len(rows), BATCH):
            batch = rows[i : i + BATCH]
            covered: dict[int, tuple[int, int]] = {}
            for row in batch:
                low, high = covered.get(row.partition, (applied.get(row.partition, row.offset), row.offset))
                covered[row.partition] = (low, max(high, row.offset + 1))
            relations.apply(edge_deltas(batch), covered)
            aggregates.apply(batch, covered)
            applied.update({p: end for p, (_, end) in covered.items()})
    finally:
        relations.close()
        aggregates.close()
    out_degree: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        out_degree[row.payer].add(row.payee)
    degrees = sorted(len(v) for v in out_degree.values())
    return {
        "seconds": round(time.monotonic() - started, 1),
        "edges": sum(degrees),
        "payers": len(degrees),
        "out_degree_p50": percentile(degrees, 50),
        "out_degree_p99": percentile(degrees, 99),
        "out_degree_max": degrees[-1],
        "relations_mb": round(Path(settings.relations_db).stat().st_size / 1e6, 1),
        "aggregates_mb": round(Path(settings.aggregates_db).stat().st_size / 1e6, 1),
    }


# --------------------------------------------------------------------------- the load


async def wait_healthy(api: ApiProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while await api.health() is None:
        if not api.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the {api.kind} API did not come up; its log:\n{api.log_tail()}")
        await asyncio.sleep(0.2)


async def drive(
    api: ApiProcess, label: str, request: Any, clients: int, duration: float, rng: random.Random
) -> dict[str, Any]:
    """`clients` loops, each with one request in flight, for WARMUP + `duration` seconds; measures the
    last `duration`. `request(rng)` gives (path, query params, JSON body or None for a GET, queries)."""
    latencies: list[float] = []
    sizes: list[int] = []
    queries = 0
    errors = 0
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    timeout = aiohttp.ClientTimeout(REQUEST_TIMEOUT)
    async with aiohttp.ClientSession(api.url, connector=connector, timeout=timeout) as session:
        measure_from = time.monotonic() + WARMUP
        stop_at = measure_from + duration

        async def client() -> None:
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

        assert api.process is not None
        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        await asyncio.sleep(WARMUP)
        cpu_before = cpu_seconds(api.process.pid) or 0.0
        await asyncio.gather(*tasks)
        cpu_after = cpu_seconds(api.process.pid) or 0.0
    window = duration + (time.monotonic() - stop_at)  # the last requests end after stop_at
    return {
        "endpoint": label,
        "clients": clients,
        "requests": len(latencies),
        "req_per_s": round(len(latencies) / window, 1),
        "queries_per_s": round(queries / window, 1),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "max_ms": round(max(latencies, default=float("nan")), 2),
        "mean_kb": round(sum(sizes) / max(len(sizes), 1) / 1000, 1),
        "errors": errors,
        "server_cpu": round((cpu_after - cpu_before) / window, 2),
    }


async def main(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="aml-api-bench-"))
    settings = replace(
        Settings(),
        store_dir=str(workdir / "stores"),
        relations_port=free_port(),
        aggregates_port=free_port(),
    )
    (workdir / "stores").mkdir()
    end = datetime.now(UTC)
    print(f"building stores: {args.payments} payments over {args.accounts} accounts in {settings.store_dir}")
    stores = build_stores(settings, payments(args.payments, args.accounts, end))
    print(
        f"  {stores['seconds']} s; {stores['edges']} edges, out-degree p50 {stores['out_degree_p50']:.0f} / "
        f"p99 {stores['out_degree_p99']:.0f} / max {stores['out_degree_max']}; relations "
        f"{stores['relations_mb']} MB, aggregates {stores['aggregates_mb']} MB"
    )
    accounts = [f"acct-{i:05d}" for i in range(args.accounts)]
    span_s = SPAN.total_seconds()

    def instant(rng: random.Random) -> str:
        return (end - timedelta(seconds=span_s * rng.random())).isoformat().replace("+00:00", "Z")

    def relations_everything(rng: random.Random) -> Request:
        return f"/relations/{rng.choice(accounts)}", {"hops": "2"}, None, 1

    def relations_detector(rng: random.Random) -> Request:
        return f"/relations/{rng.choice(accounts)}", {"hops": "3", "parts": "out,cycle"}, None, 1

    def aggregates_one(rng: random.Random) -> Request:
        return f"/aggregates/{rng.choice(accounts)}", {"at": instant(rng)}, None, 1

    def relations_batch(rng: random.Random) -> Request:
        body = {
            "queries": [
                {"account": rng.choice(accounts), "hops": 3, "parts": "out,cycle"} for _ in range(args.batch)
            ]
        }
        return "/relations", {}, body, args.batch

    def aggregates_batch(rng: random.Random) -> Request:
        body = {"queries": [{"account": rng.choice(accounts), "at": instant(rng)} for _ in range(args.batch)]}
        return "/aggregates", {}, body, args.batch

    endpoints = [
        ("relations", "GET /relations hops=2 (all parts)", relations_everything),
        ("relations", "GET /relations hops=3 parts=out,cycle", relations_detector),
        ("relations", f"POST /relations, {args.batch} queries of hops=3 parts=out,cycle", relations_batch),
        ("aggregates", "GET /aggregates", aggregates_one),
        ("aggregates", f"POST /aggregates, {args.batch} queries", aggregates_batch),
    ]

    apis = [ApiProcess(kind, settings, workdir / f"{kind}-api.log") for kind in ("relations", "aggregates")]
    rows = []
    info = machine()
    try:
        for api in apis:
            api.start()
        for api in apis:
            await wait_healthy(api)
        rng = random.Random(11)
        by_kind = {api.kind: api for api in apis}
        for kind, label, request in endpoints:
            for clients in args.concurrency:
                row = await drive(by_kind[kind], label, request, clients, args.duration, rng)
                print(
                    f"  {label:<50} C={clients:<3} {row['req_per_s']:>8} req/s ({row['queries_per_s']} "
                    f"queries/s)  p50 {row['p50_ms']} ms  p99 {row['p99_ms']} ms  errors {row['errors']}"
                )
                rows.append(row)
    finally:
        for api in apis:
            api.stop(10)
        if args.keep:
            print(f"stores and API logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    doc = {
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
            "pipeline_writing": False,
            "client": "aiohttp on loopback, same machine as the server",
        },
        "stores": stores,
        "runs": rows,
    }
    path = write_results(NAME, doc)
    print()
    print("API latency (stores static: the pipeline is not writing; client and server share the machine)")
    print(
        markdown_table(
            list(COLUMNS.values()),
            [[r[k] for k in COLUMNS] for r in rows],
        )
    )
    print(f"\nwritten to {path}")


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--payments", type=int, default=100_000)
    parser.add_argument("--accounts", type=int, default=10_000)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--batch", type=int, default=100, help="queries per POST (the detectors' batches)")
    parser.add_argument("--keep", action="store_true", help="keep the stores and the API logs")
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
