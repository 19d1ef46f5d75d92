"""Gate overhead: decisions/s with the gate on (dependencies far ahead) over the gate off.

With every dependency already committed to the log end, the gate never makes a payment wait, so
any difference between the variants is the gate's own cost per payment (watermark lookup, the
per-partition condition, the table rows). Each run gets a fresh topic holding the same payments and
a fresh worker; variants alternate (gated, ungated, gated, ...) so slow drift in the machine's load
hits both alike. Throughput is measured from the first to the last decision's `decided_at`, so
worker start-up and recovery are not counted. The whole backlog is read at once, so AML_MAX_PENDING
is raised above a partition's payments in both variants (`--max-pending 1000` shows why).

    .venv/bin/python -m bench.gate_overhead [--payments 40000] [--partitions 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from aml_app.harness.verify import decided_at, percentile
from aml_app.kafka.tools import produce
from bench.common import (
    BenchEnv,
    DecisionCounter,
    bench_env,
    cpu_seconds,
    finish,
    machine,
    markdown_table,
    median,
    read_decisions,
)
from tests.harness import ends_of, payments_for

NAME = "gate_overhead"


async def one_run(
    env: BenchEnv, gated: bool, payments: int, partitions: int, tag: str, max_pending: int
) -> dict:
    """Produce the payments, let the dependencies catch up, then time one worker through them."""
    names = await env.fresh_names(partitions)
    placed = await produce(
        env.producer, names.payments, payments_for(partitions, payments // partitions, tag)
    )
    total = len(placed)
    # The dependencies are "far ahead": committed to the log end before the worker exists.
    await env.commit(names, ends_of(placed))
    started, started_wall = time.monotonic(), time.time()
    worker = env.start_worker(names, AML_GATE="on" if gated else "off", AML_MAX_PENDING=str(max_pending))
    assert worker.process is not None
    broker_pid = env.broker.process.pid if env.broker.process else None
    cpu: dict[str, Any] = {}
    deadline = started + 60 + total / 100
    async with DecisionCounter(env.bootstrap, names.decisions, partitions) as counter:
        seen = 0
        while seen < total:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {seen} of {total} decisions by the deadline")
            if worker.process.poll() is not None:
                raise AssertionError(f"worker exited; log:\n{worker.log_tail()}")
            seen = await counter.count()
            if seen and "first" not in cpu:
                # Sampled within one poll of the first decision: CPU spent in the measured window.
                cpu["first"] = (cpu_seconds(worker.process.pid), cpu_seconds(broker_pid or 0))
            await asyncio.sleep(0.25)
    cpu["last"] = (cpu_seconds(worker.process.pid), cpu_seconds(broker_pid or 0))
    state = await worker.state()
    await env.stop_workers([worker])

    decisions = await read_decisions(env.bootstrap, names.decisions, partitions, total)
    times = sorted(decided_at(d) for d in decisions)
    span = times[-1] - times[0]
    keys = {(d["partition"], d["offset"]) for d in decisions}
    waited = [d["waited_ms"] for d in decisions]
    worker_cpu = _delta(cpu["first"][0], cpu["last"][0])
    broker_cpu = _delta(cpu["first"][1], cpu["last"][1])
    return {
        "variant": "gated" if gated else "ungated",
        "payments": total,
        "decisions": len(decisions),
        "distinct_decisions": len(keys),
        "all_gated_flag": all(d["gated"] is gated for d in decisions),
        "span_s": span,
        "decisions_per_s": (len(decisions) - 1) / span if span > 0 else float("nan"),
        "start_to_first_decision_s": times[0] - started_wall,
        "waited_ms_p99": percentile(waited, 99),
        "waited_ms_max": max(waited),
        "worker_cpu_s_in_window": worker_cpu,
        # Less sensitive to other load on the machine than decisions/s (but sampled coarsely).
        "worker_cpu_us_per_decision": None if worker_cpu is None else worker_cpu / total * 1e6,
        "broker_cpu_s_in_window": broker_cpu,
        "rebalances": state["rebalances"] if state else None,
        "refreshes": state["refresh"]["refreshes"] if state else None,
        "admin_requests": state["refresh"]["admin_requests"] if state else None,
    }


def _delta(first: float | None, last: float | None) -> float | None:
    return None if first is None or last is None else last - first


async def main(
    payments: int, partitions: int, runs: int, max_pending: int | None, keep: bool
) -> dict[str, Any]:
    # The lanes' back-pressure (pause, then resume, of a partition past AML_MAX_PENDING queued
    # payments) crashes the worker: the lane resumes with the message's aiokafka TopicPartition,
    # Faust's resume_partitions adds it to its active set unconverted, and Faust's next look at that
    # set asserts every member is a Faust TP. So by default the limit is set out of reach.
    max_pending = max_pending or payments // partitions + 1
    doc: dict[str, Any] = {
        "benchmark": NAME,
        "machine": machine(),
        "params": {
            "payments": payments,
            "partitions": partitions,
            "runs_per_variant": runs,
            "max_pending": max_pending,
        },
        "runs": [],
    }
    async with bench_env(keep) as env:
        for i in range(runs):
            for gated in (True, False):
                tag = f"{'g' if gated else 'u'}{i}"
                run = await one_run(env, gated, payments, partitions, tag, max_pending)
                run["run"] = i + 1
                doc["runs"].append(run)
                print(
                    f"run {i + 1} {run['variant']:>8}: {run['decisions_per_s']:.0f} decisions/s "
                    f"over {run['span_s']:.1f}s",
                    flush=True,
                )
    gated_rates = [r["decisions_per_s"] for r in doc["runs"] if r["variant"] == "gated"]
    ungated_rates = [r["decisions_per_s"] for r in doc["runs"] if r["variant"] == "ungated"]
    pair_ratios = [g / u for g, u in zip(gated_rates, ungated_rates, strict=True)]
    # First to last decision favours the gated worker: it fetches into its lanes while it awaits its
    # first watermark, work before its window opens. From its start to its last decision counts that.
    totals = {
        variant: [
            r["start_to_first_decision_s"] + r["span_s"] for r in doc["runs"] if r["variant"] == variant
        ]
        for variant in ("gated", "ungated")
    }
    from_start = [u / g for g, u in zip(totals["gated"], totals["ungated"], strict=True)]
    doc["summary"] = {
        "pair_ratios": pair_ratios,
        "pair_ratios_from_start": from_start,
        "median_pair_ratio_from_start": median(from_start),
        "median_pair_ratio": median(pair_ratios),
        "ratio_of_medians": median(gated_rates) / median(ungated_rates),
        "median_gated_per_s": median(gated_rates),
        "median_ungated_per_s": median(ungated_rates),
        "goal": "gated / ungated >= 0.9",
        "goal_met": median(from_start) >= 0.9,
    }
    return doc


def report(doc: dict[str, Any]) -> str:
    rows = [
        (
            r["run"],
            r["variant"],
            r["decisions"],
            r["span_s"],
            round(r["decisions_per_s"]),
            r["worker_cpu_s_in_window"],
            r["worker_cpu_us_per_decision"],
            r["broker_cpu_s_in_window"],
            r["rebalances"],
        )
        for r in doc["runs"]
    ]
    runs = markdown_table(
        [
            "run",
            "variant",
            "decisions",
            "first→last (s)",
            "decisions/s",
            "worker CPU (s)",
            "worker CPU/decision (µs)",
            "broker CPU (s)",
            "rebalances",
        ],
        rows,
    )
    s = doc["summary"]
    summary = markdown_table(
        [
            "pair ratios, worker start to last decision",
            "first to last decision",
            "median pair ratio (from start)",
            "ratio of medians",
            "goal ≥ 0.9",
        ],
        [
            (
                ", ".join(f"{r:.3f}" for r in s["pair_ratios_from_start"]),
                ", ".join(f"{r:.3f}" for r in s["pair_ratios"]),
                s["median_pair_ratio_from_start"],
                s["ratio_of_medians"],
                "met" if s["goal_met"] else "NOT met",
            )
        ],
    )
    return f"{runs}\n\n{summary}"


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payments", type=int, default=40000, help="per run, over all partitions")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3, help="runs per variant, alternating")
    parser.add_argument(
        "--max-pending",
        type=int,
        default=None,
        help="AML_MAX_PENDING for the workers (default: more than a partition's payments)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the worker and broker logs")
    args = parser.parse_args()
    doc = asyncio.run(main(args.payments, args.partitions, args.runs, args.max_pending, args.keep))
    finish(NAME, doc, report)


if __name__ == "__main__":
    cli()
