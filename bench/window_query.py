"""C's window query on a store of the simulator's traffic: what a detector's batch costs PostgreSQL, by
batch size, and which accounts that time goes to.

The capacity benchmark finds C's window query at two thirds to three quarters of PostgreSQL's statement
time at saturation. This one takes the query alone: the simulator's traffic (`simulate`, seed 5, 500/s of
send rate at its default speed-up: merchants that hundreds pay, a few of them busy), applied to a fresh
store on an embedded PostgreSQL through the pipeline's own store code (`bench.api_latency.build_stores`,
without Spark and Kafka), then the questions a detector asks C about the last 2,000 payments (the payer's
and the payee's windows at the payment's time), in batches of 1, 10, 50 and 100 payments as one call
each, the way C's API runs them (`aggregates.windows_query`). Then the same questions one by one for
the first 600 of them, timed per account: the busiest accounts' share of the query's time and their flow
rows.

The figures are client wall time over a warm store (nothing else runs), the mean per batch over the
2,000 payments, best of --repeat rounds. A change to the query is measured by running this at both
commits (`machine.code_at_start` names the code), or, on a machine whose speed drifts, in one run with
`--against REV`: each round times the query as it stands and then C's store module at git revision REV
on the same store, batch size by batch size.

    .venv/bin/python -m bench.window_query [--payments 150000] [--repeat 3] [--against REV]
"""

from __future__ import annotations

import argparse
import collections
import time
import zlib
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from aml_app.dependencies import aggregates
from aml_app.harness.embedded_postgres import EmbeddedPostgres
from aml_app.kafka.broker import free_port
from aml_app.settings import DependencySettings, Settings
from aml_app.simulation.traffic import simulate
from bench.api_latency import PARTITIONS, build_stores
from bench.common import finish, machine, markdown_table, module_at, workfolder

NAME = "window_query"
BATCHES = (1, 10, 50, 100)
ASKED = 2_000  # the last payments, whose windows are asked about
ONE_BY_ONE = 600  # of them, asked one question at a time


def store_rows(count: int) -> list[tuple]:
    """The simulator's payments as `build_stores` takes them, each at the next offset of its partition."""
    simulation = simulate(5, count, 500.0, datetime(2026, 11, 30, tzinfo=UTC))
    offsets = [0] * PARTITIONS
    rows = []
    for p in simulation.payments:
        partition = zlib.crc32(p.payer.encode()) % PARTITIONS
        ts = datetime.fromisoformat(p.ts.replace("Z", "+00:00"))
        rows.append((partition, offsets[partition], p.payer, p.payee, p.currency, Decimal(p.amount), ts))
        offsets[partition] += 1
    return rows


def questions(payments: list[tuple]) -> list[tuple[str, datetime]]:
    """What a detector asks C about `payments`: the payer's and the payee's windows at each one's time."""
    return [(account, ts) for _p, _o, payer, payee, _c, _a, ts in payments for account in (payer, payee)]


def per_batch(rounds: list[float], batches: int) -> dict[str, Any]:
    """Milliseconds a batch: the best round's and every round's, from each round's seconds."""
    return {
        "ms_per_batch": round(1000 * min(rounds) / batches, 2),
        "ms_per_batch_every_round": [round(1000 * r / batches, 2) for r in rounds],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import psycopg

    info = machine()
    folder = workfolder(NAME)
    server = EmbeddedPostgres(folder / "postgres", free_port()).start()
    try:
        settings = Settings(dependencies=DependencySettings(store_url=server.url()))
        threshold = settings.dependencies.reporting_threshold
        band = settings.dependencies.threshold_band
        rows = store_rows(args.payments)
        stores = build_stores(settings, rows, vacuum=True)
        asked = rows[-ASKED:]
        by_batch: dict[str, Any] = {}
        against = module_at(args.against, "aml_app/dependencies/aggregates.py") if args.against else None
        with psycopg.connect(server.url()) as conn:

            def ask(qs: list[tuple[str, datetime]], module: Any = aggregates) -> float:
                started = time.perf_counter()
                conn.execute(*module.windows_query(module.SCHEMA, qs, threshold, band)).fetchall()
                return time.perf_counter() - started

            for size in BATCHES:
                batches = [questions(asked[i : i + size]) for i in range(0, len(asked), size)]
                rounds, rounds_against = [], []
                for _ in range(args.repeat):
                    rounds.append(sum(ask(qs) for qs in batches))
                    if against is not None:
                        rounds_against.append(sum(ask(qs, against) for qs in batches))
                repeats = collections.Counter(
                    n for qs in batches for n in collections.Counter(a for a, _ in qs).values()
                )
                by_batch[str(size)] = {
                    "batches": len(batches),
                    **per_batch(rounds, len(batches)),
                    "questions_about_one_account_in_a_batch": dict(sorted(repeats.items())),
                }
                if rounds_against:
                    by_batch[str(size)]["against"] = per_batch(rounds_against, len(batches))
            spent: collections.defaultdict[str, float] = collections.defaultdict(float)
            asked_about: collections.Counter[str] = collections.Counter()
            for account, at in questions(asked[:ONE_BY_ONE]):
                spent[account] += ask([(account, at)])
                asked_about[account] += 1
            total = sum(spent.values())
            busiest = []
            for account, seconds in sorted(spent.items(), key=lambda kv: -kv[1])[:5]:
                flows = conn.execute(
                    "SELECT count(*) FROM aggregates.flows WHERE payer = %s OR payee = %s", (account, account)
                ).fetchone()
                busiest.append(
                    {
                        "account": account,
                        "share": round(seconds / total, 3),
                        "questions": asked_about[account],
                        "ms_each": round(1000 * seconds / asked_about[account], 2),
                        "flow_rows": flows[0] if flows else None,
                    }
                )
    finally:
        server.stop()
    return {
        "benchmark": NAME,
        "machine": info,
        "params": vars(args),
        "store": stores,
        "by_batch_payments": by_batch,
        "one_by_one": {
            "questions": sum(asked_about.values()),
            "seconds": round(total, 3),
            "busiest": busiest,
        },
    }


def report(doc: dict[str, Any]) -> str:
    by_batch = doc["by_batch_payments"]
    against = doc["params"].get("against")
    table = markdown_table(
        [
            "payments a batch",
            "questions a batch",
            "ms a batch (best round)",
            "every round",
            *([f"at {against}: best", "every round"] if against else []),
            "repeats",
        ],
        [
            (
                size,
                2 * int(size),
                v["ms_per_batch"],
                v["ms_per_batch_every_round"],
                *(
                    (v["against"]["ms_per_batch"], v["against"]["ms_per_batch_every_round"])
                    if against
                    else ()
                ),
                v["questions_about_one_account_in_a_batch"],
            )
            for size, v in by_batch.items()
        ],
    )
    busiest = markdown_table(
        ["account", "share of the time", "questions", "ms each", "flow rows"],
        [
            (b["account"], b["share"], b["questions"], b["ms_each"], b["flow_rows"])
            for b in doc["one_by_one"]["busiest"]
        ],
    )
    return "\n\n".join(
        [
            f"store: {doc['store']}",
            table,
            f"one question at a time, {doc['one_by_one']['questions']} questions, "
            f"{doc['one_by_one']['seconds']} s; the busiest accounts:",
            busiest,
        ]
    )


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--payments", type=int, default=150_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=NAME, help="the results file's name in bench/results/")
    parser.add_argument("--against", help="a git revision whose window query is timed beside this one")
    args = parser.parse_args()
    doc = measure(args)
    finish(args.out, doc, report)


if __name__ == "__main__":
    cli()
