"""Horizontal scaling: decisions/s with 1, 2 and 3 workers when the worker is the bottleneck.

The probe service gets a per-payment cost (`AML_PROBE_COST_MS`, a benchmarking knob only; see
agents/probe.py), of one of three kinds:

- `cpu`: that much CPU time burnt per payment (rules that compute). Bounded by the machine's cores.
- `block`: a blocking sleep that holds the worker's event loop without using CPU (a synchronous call
  to something slow). The worker does one payment at a time, whatever its partitions: more workers,
  more payments in parallel, beyond the core count.
- `wait`: an awaited sleep (an asynchronous call). The worker's per-partition lanes already overlap
  these, so one worker runs as many at once as it owns partitions: the control that shows when more
  workers do *not* help.

Each run: fresh topics with 6 partitions (1, 2 and 3 workers own 6, 3 and 2 each), the payments
produced up-front round-robin over the partitions, then the workers started. The dependencies commit
nothing until the workers own the partitions with a settled assignment and every partition has a
payment waiting at its owner's gate; then both groups commit the log end at once and the clock starts:

    decisions/s = payments / (last decided_at - the commit)

so worker start-up, recovery and fetching are not counted. Admin requests/s is the sum over the workers
of `refresh.admin_requests` (/watermarks.json) over the held window (payments waiting: the fast refresh)
and over the processing window (nothing waits: the slow refresh). Rounds repeat 1, 2, 3 workers per
kind, so ratios to 1 worker come from runs made side by side.

    .venv/bin/python -m bench.scaling [--kinds cpu block wait] [--workers 1 2 3] [--cost-ms 4]
                                      [--payments 3600] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from aml_app.harness.verify import CommitTimeline, decided_at, premature
from aml_app.kafka.tools import payment_json
from bench.common import (
    BenchEnv,
    admin_requests,
    bench_env,
    cpu_seconds,
    finish,
    machine,
    markdown_table,
    read_decisions,
    states,
    wait_owned,
)
from tests.harness import Names, wait_until

NAME = "scaling"
STAGGER = 2.0  # seconds between worker starts


@dataclass(frozen=True)
class Config:
    partitions: int = 6
    payments: int = 3600
    cost_ms: float = 4.0
    held_window: float = 5.0


async def produce(env: BenchEnv, names: Names, payments: int) -> dict[int, int]:
    """`payments` valid payments round-robin over the partitions; the log end per partition."""
    futures = []
    for i in range(payments):
        p = i % names.partitions
        payer = f"acct-{p}-{i % 11}"
        value = payment_json(f"s-{i}", payer, f"acct-x{i}", "10.00", "2026-11-20T10:15:00Z")
        futures.append(await env.producer.send(names.payments, value=value, key=payer.encode(), partition=p))
    ends: dict[int, int] = {}
    for meta in await asyncio.gather(*futures):
        ends[meta.partition] = max(ends.get(meta.partition, 0), meta.offset + 1)
    return ends


async def one_run(env: BenchEnv, kind: str, workers: int, config: Config, round_: int) -> dict[str, Any]:
    names = await env.fresh_names(config.partitions)
    ends = await produce(env, names, config.payments)
    total = sum(ends.values())
    started = []
    for i in range(workers):
        if i:
            # Staggered: when workers join a fresh group all at once, one of them has been seen to stop
            # receiving some of its partitions (reported; `test_procfile_scaling` starts them together).
            await asyncio.sleep(STAGGER)
        started.append(
            env.start_worker(names, AML_PROBE_COST_MS=str(config.cost_ms), AML_PROBE_COST_KIND=kind)
        )
    ready = await wait_owned(started, config.partitions, timeout=150)
    assignment = {s["worker"]: sorted(s["assigned"]) for s in ready}

    async def all_waiting() -> bool:
        now = await states(started)
        waiting = {int(p) for s in now if s for p in s["waiting"]}
        return waiting == set(range(config.partitions))

    await wait_until(all_waiting, 60, "a payment waiting at the gate on every partition")
    held_start = await admin_requests(started)
    await asyncio.sleep(config.held_window)
    held_end = await admin_requests(started)

    pids = [w.process.pid for w in started if w.process is not None]
    cpu_before = [cpu_seconds(pid) or 0.0 for pid in pids]
    broker_pid = env.broker.process.pid if env.broker.process else None
    broker_before = cpu_seconds(broker_pid) if broker_pid else None
    # Both groups commit the log end at once: every decision must come after this moment.
    timeline = CommitTimeline()
    committed_at = time.time()
    for group in names.deps:
        for p, o in ends.items():
            timeline.record(group, p, o, committed_at)
    await env.commit(names, ends)
    # Read the decisions as they come (Tansu's ListOffsets undercounts a topic's end: the last batch's
    # base offset + 1, so counting by end offsets can miss the last records).
    budget = 60 + total * config.cost_ms / 1000 * 2
    try:
        decisions = await read_decisions(
            env.bootstrap, names.decisions, config.partitions, total, timeout=budget
        )
    except AssertionError:
        # Not a throughput figure: record what happened, and go on with the next run.
        now = await states(started)
        await env.stop_workers(started)
        return {
            "kind": kind,
            "workers": workers,
            "round": round_,
            "payments": total,
            "stalled": True,
            "assignment": assignment,
            "processed": {s["worker"]: s["processed"] for s in now if s},
        }
    finished_at = time.time()
    cpu_after = [cpu_seconds(pid) or 0.0 for pid in pids]
    broker_after = cpu_seconds(broker_pid) if broker_pid else None
    processed_end = await admin_requests(started)
    await env.stop_workers(started)

    last = max(decided_at(d) for d in decisions)
    elapsed = last - committed_at
    by_worker: dict[str, int] = {}
    for d in decisions:
        by_worker[d["worker"]] = by_worker.get(d["worker"], 0) + 1
    held = held_end["at"] - held_start["at"]
    processing = processed_end["at"] - held_end["at"]
    shares = [len(ps) for ps in assignment.values()]
    return {
        "kind": kind,
        "workers": workers,
        "round": round_,
        "payments": total,
        "decisions": len(decisions),
        "distinct_decisions": len({(d["partition"], d["offset"]) for d in decisions}),
        "premature": len(premature(decisions, names.deps, timeline)),
        "assignment": assignment,
        "balanced": max(shares) == -(-config.partitions // workers),
        "decisions_by_worker": by_worker,
        "seconds": elapsed,
        "decisions_per_s": total / elapsed,
        "worker_cpu_cores": (sum(cpu_after) - sum(cpu_before)) / max(finished_at - committed_at, 1e-9),
        "broker_cpu_cores": (
            (broker_after - broker_before) / max(finished_at - committed_at, 1e-9)
            if broker_after is not None and broker_before is not None
            else None
        ),
        "admin_requests_per_s_held": (held_end["admin_requests"] - held_start["admin_requests"]) / held,
        "admin_requests_per_s_processing": (processed_end["admin_requests"] - held_end["admin_requests"])
        / processing,
        "leaders": held_start["leaders"],
    }


async def main(kinds: list[str], worker_counts: list[int], rounds: int, config: Config, keep: bool) -> dict:
    doc: dict[str, Any] = {
        "benchmark": NAME,
        "machine": machine(),
        "params": {**asdict(config), "kinds": kinds, "workers": worker_counts, "rounds": rounds},
        "runs": [],
    }
    async with bench_env(keep) as env:
        for round_ in range(1, rounds + 1):
            for kind in kinds:
                for n in worker_counts:
                    run = await one_run(env, kind, n, config, round_)
                    doc["runs"].append(run)
                    if run.get("stalled"):
                        print(
                            f"round {round_}, {kind}, {n} worker(s): STALLED, not all {run['payments']} "
                            f"decisions by the deadline; processed {run['processed']}",
                            flush=True,
                        )
                        continue
                    print(
                        f"round {round_}, {kind}, {n} worker(s): {run['decisions_per_s']:.0f} decisions/s, "
                        f"worker CPU {run['worker_cpu_cores']:.2f} cores, admin req/s "
                        f"{run['admin_requests_per_s_held']:.1f} held, "
                        f"{run['admin_requests_per_s_processing']:.1f} processing, "
                        f"assignment {list(run['assignment'].values())}",
                        flush=True,
                    )
    doc["summary"] = summarise(doc["runs"], worker_counts)
    doc["params"]["stagger_s"] = STAGGER
    return doc


def summarise(runs: list[dict[str, Any]], worker_counts: list[int]) -> dict[str, Any]:
    """Per kind and worker count: decisions/s of each round, its ratio to 1 worker in the same round."""
    out: dict[str, Any] = {}
    stalled = [r for r in runs if r.get("stalled")]
    runs = [r for r in runs if not r.get("stalled")]
    if stalled:
        out["stalled_runs"] = [(r["kind"], r["workers"], r["round"]) for r in stalled]
    for kind in dict.fromkeys(r["kind"] for r in runs):
        rows = {}
        for n in worker_counts:
            mine = [r for r in runs if r["kind"] == kind and r["workers"] == n]
            ratios = []
            for r in mine:
                base = next(
                    (b for b in runs if b["kind"] == kind and b["round"] == r["round"] and b["workers"] == 1),
                    None,
                )
                if base is not None:
                    ratios.append(r["decisions_per_s"] / base["decisions_per_s"])
            rows[str(n)] = {
                "decisions_per_s": [r["decisions_per_s"] for r in mine],
                "ratio_to_1": ratios,
                "median_ratio_to_1": statistics.median(ratios) if ratios else float("nan"),
                "worker_cpu_cores": [r["worker_cpu_cores"] for r in mine],
                "admin_requests_per_s_held": [r["admin_requests_per_s_held"] for r in mine],
                "admin_requests_per_s_processing": [r["admin_requests_per_s_processing"] for r in mine],
                "premature": sum(r["premature"] for r in mine),
                "all_balanced": all(r["balanced"] for r in mine),
            }
        out[kind] = rows
    return out


def report(doc: dict[str, Any]) -> str:
    def many(values: list[float], fmt: str = "{:.0f}") -> str:
        return " / ".join(fmt.format(v) for v in values)

    rows = []
    for kind, per_count in doc["summary"].items():
        if kind == "stalled_runs":
            continue
        for n, row in per_count.items():
            rows.append(
                (
                    kind,
                    n,
                    many(row["decisions_per_s"]),
                    many(row["ratio_to_1"], "{:.2f}"),
                    many(row["worker_cpu_cores"], "{:.2f}"),
                    many(row["admin_requests_per_s_held"], "{:.1f}"),
                    many(row["admin_requests_per_s_processing"], "{:.1f}"),
                    row["premature"],
                    "yes" if row["all_balanced"] else "no",
                )
            )
    return markdown_table(
        [
            "cost kind",
            "workers",
            "decisions/s (per round)",
            "ratio to 1 worker (same round)",
            "worker CPU (cores)",
            "admin req/s, held",
            "admin req/s, processing",
            "premature",
            "balanced",
        ],
        rows,
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kinds", nargs="+", default=["cpu", "block", "wait"], choices=["cpu", "block", "wait"]
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=Config.partitions)
    parser.add_argument("--payments", type=int, default=Config.payments)
    parser.add_argument("--cost-ms", type=float, default=Config.cost_ms, help="per-payment cost (ms)")
    parser.add_argument(
        "--held-window", type=float, default=Config.held_window, help="seconds held (admin load)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the worker and broker logs")
    args = parser.parse_args()
    if 1 not in args.workers:
        parser.error("--workers must include 1: ratios are to one worker")
    config = Config(args.partitions, args.payments, args.cost_ms, args.held_window)
    doc = asyncio.run(main(args.kinds, args.workers, args.rounds, config, args.keep))
    finish(NAME, doc, report)


if __name__ == "__main__":
    cli()
