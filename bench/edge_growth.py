"""B's store over a long run: what a busy pair's edge costs a write and a question, its old payments
folded or not.

An edge row lists each payment's time and amount so that B answers as of an instant; a pair that pays
all day makes its row longer with every payment, and every write of it and every question that cuts it
at an instant reads the whole list. B folds the payments made more than `keep` (AML_AGGREGATES_RETENTION,
a day by default) before a batch's newest one into the row's count and total (`relations.fold_edges`).

Ten pairs each pay once a minute for --days days, beside --others accounts that pay a random one of
--others accounts once an hour; a batch is an hour of payments (690 by default), written the way the
pipeline writes one (`relations.write_edges` inside `Writer.apply`, the batch's edge rows made by
`bench.api_latency.batch_outputs` without Spark). Two databases on one embedded PostgreSQL take the
same batches, one after the other: one with a day's `keep`, one with none (nothing folded). At the end
of each day: the mean wall time of that day's writes, one detector batch of questions (the ten payees'
relations, every default part, as of a minute before the newest payment: their rows are cut there),
best of three, the longest list an edge row holds, and the size of B's tables and indexes.

    .venv/bin/python -m bench.edge_growth [--days 14] [--others 90]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from aml_app.dependencies import relations
from aml_app.dependencies.store import Reader, Writer
from aml_app.harness.embedded_postgres import EmbeddedPostgres
from aml_app.kafka.broker import free_port
from aml_app.settings import Settings
from bench.api_latency import batch_outputs, schema_mb
from bench.common import finish, machine, markdown_table, workfolder

NAME = "edge_growth"
PAIRS = 10
START = datetime(2026, 11, 1, tzinfo=UTC)
KEEP = timedelta(days=1)


def hour_of_payments(hour: int, others: int, rng: random.Random, offset: int) -> list[tuple]:
    """The payments of one hour, as `batch_outputs` takes them (one partition, offsets from `offset`)."""
    at = START + timedelta(hours=hour)
    rows = [
        (
            f"payer-{i}",
            f"payee-{i}",
            at + timedelta(minutes=m, seconds=i),
            Decimal(rng.randint(100, 99_999)) / 100,
        )
        for m in range(60)
        for i in range(PAIRS)
    ]
    rows += [
        (
            f"other-{i}",
            f"other-{rng.randrange(others)}",
            at + timedelta(seconds=rng.randrange(3600)),
            Decimal(250),
        )
        for i in range(others)
    ]
    rows.sort(key=lambda r: r[2])
    return [
        (0, offset + k, payer, payee, "EUR", amount, ts) for k, (payer, payee, ts, amount) in enumerate(rows)
    ]


async def ask(url: str, at: datetime) -> tuple[float, list[dict[str, Any]]]:
    """A detector's batch of questions about the ten payees as of `at`: the best of three, in seconds."""
    reader = Reader(url, relations.SCHEMA)
    await reader.open()
    try:
        queries = [relations.Query(f"payee-{i}", 2, relations.PARTS, at=at) for i in range(PAIRS)]
        best, answers = float("inf"), []
        for _ in range(3):
            started = time.perf_counter()
            async with reader.snapshot() as snap:
                answers = await relations.relations_many(
                    snap.cur, snap.schema, queries, snap.as_of, folded=relations.folded_before(snap.meta)
                )
            best = min(best, time.perf_counter() - started)
        return best, answers
    finally:
        await reader.close()


def write(conn: Any, edges: Any, keep: timedelta | None) -> None:
    relations.write_edges(conn, relations.SCHEMA, edges, keep)


def listed(url: str) -> int:
    """The longest list of payments an edge row holds."""
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT coalesce(max(cardinality(times)), 0) FROM relations.edges").fetchone()
    return int(row[0]) if row else 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    info = machine()
    folder = workfolder(NAME)
    server = EmbeddedPostgres(folder / "postgres", free_port()).start()
    settings = Settings()
    threshold, band = settings.dependencies.reporting_threshold, settings.dependencies.threshold_band
    variants = {"folded (keep 1 day)": KEEP, "not folded": None}
    urls = {name: server.create_database(f"edges_{i}") for i, name in enumerate(variants)}
    writers = {name: Writer(url, relations.SCHEMA) for name, url in urls.items()}
    days: list[dict[str, Any]] = []
    rng = random.Random(args.seed)
    try:
        for writer in writers.values():
            writer.migrate()
        offset = 0
        spent = dict.fromkeys(variants, 0.0)
        for hour in range(24 * args.days):
            rows = hour_of_payments(hour, args.others, rng, offset)
            offset += len(rows)
            edges = batch_outputs(rows, threshold, band).tables["edges"]
            for name, keep in variants.items():
                started = time.perf_counter()
                writers[name].apply(
                    {0: (rows[0][1], offset)}, functools.partial(write, edges=edges, keep=keep)
                )
                spent[name] += time.perf_counter() - started
            if (hour + 1) % 24 == 0:
                at = max(r[6] for r in rows) - timedelta(minutes=1)
                day: dict[str, Any] = {"day": (hour + 1) // 24, "payments": offset}
                answers = {}
                for name, url in urls.items():
                    seconds, answers[name] = asyncio.run(ask(url, at))
                    day[name] = {
                        "write_ms": round(1000 * spent[name] / 24, 2),
                        "question_ms": round(1000 * seconds, 2),
                        "longest_list": listed(url),
                        "edges_mb": schema_mb(url, "relations"),
                    }
                    spent[name] = 0.0
                day["same_answers"] = all(
                    {k: v for k, v in a.items() if k != "as_of"}
                    == {k: v for k, v in b.items() if k != "as_of"}
                    for a, b in zip(*answers.values(), strict=True)
                )
                days.append(day)
                print(day, flush=True)
    finally:
        for writer in writers.values():
            writer.close()
        server.stop()
    return {
        "benchmark": NAME,
        "machine": info,
        "params": vars(args),
        "batch_payments": PAIRS * 60 + args.others,
        "days": days,
    }


def report(doc: dict[str, Any]) -> str:
    names = [k for k in doc["days"][0] if isinstance(doc["days"][0][k], dict)]
    return markdown_table(
        [
            "day",
            *(f"{n}: {m}" for n in names for m in ("write ms", "question ms", "longest list", "MB")),
            "same answers",
        ],
        [
            (
                d["day"],
                *(
                    v
                    for n in names
                    for v in (d[n]["write_ms"], d[n]["question_ms"], d[n]["longest_list"], d[n]["edges_mb"])
                ),
                d["same_answers"],
            )
            for d in doc["days"]
        ],
    )


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--days", type=int, default=14)
    parser.add_argument("--others", type=int, default=90)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=NAME, help="the results file's name in bench/results/")
    args = parser.parse_args()
    finish(args.out, measure(args), report)


if __name__ == "__main__":
    cli()
