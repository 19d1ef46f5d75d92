"""End to end: the AML service's throughput against its slowest dependency's, in the same run.

The whole system runs as in the demo (`aml_app.harness.demo.Demo` on `aml_app.harness.system.System` with
its default `Layout`: an embedded broker, an embedded PostgreSQL server with a fresh database for the
stores, the Spark pipeline of Services B and C writing to it, two replicas of each API reading it, and one
gated AML worker spreading its requests over the replicas) and the simulator sends N payments as fast as
it can (plus the demo's malformed records, nominally one per hundred). Then, from the same run:

- each dependency's throughput = records / (when its group's commits covered the last record - first
  send), dated by the demo's commit watch (polls every 50 ms);
- the AML service's throughput = records / (its last decision - first send);
- ratio = AML / the slower dependency: 1.0 means the gated service keeps up with the physical limit
  (it can never decide a payment before its dependencies have committed it). Goal >= 0.8, with the
  shipped model on (`--model amlworld`, the default; `--model off`: the rules alone).

When: the payments sent, covered by both groups' commits and decided by AML, every 0.25 s (`progress`).

Where the time goes: CPU seconds of every process over the run, per record: each process with its
descendants, live and reaped (the pipeline's JVM and Python workers; PostgreSQL's server with its backends,
found from its `postmaster.pid` since `pg_ctl` detaches it from us), and this process alone; and the AML
worker's own split of its handler time (evidence from B and C over HTTP, rules, alert, decision) from
`/watermarks.json`.

    .venv/bin/python -m bench.end_to_end [--payments 20000] [--rate 4000] [--fraud-workers 0]
        [--api-replicas 2] [--seed 3] [--timeout 600] [--model amlworld|off]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from aml_app.harness.demo import Demo, Options
from aml_app.harness.verify import CommitTimeline, decided_at
from aml_app.settings import load_settings
from bench.common import cpu_of, finish, machine, markdown_table, processes, workfolder
from tests.harness import wait_until

NAME = "end_to_end"
GOAL = 0.8
STEP_S = 0.25


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    cpu: dict[str, dict[str, float]] = {"start": {}, "end": {}}
    states: dict[str, Any] = {}

    async def sample(demo: Demo) -> None:
        for name, pid in processes(demo).items():
            cpu["start"][name] = cpu_of(name, pid)
        simulator = demo.tasks["payment simulator"]
        await wait_until(
            lambda: simulator.done() and demo.caught_up(), args.timeout, "everything decided", interval=0.1
        )
        for name, pid in processes(demo).items():
            cpu["end"][name] = cpu_of(name, pid)
        for worker in demo.system.all_workers:
            states[worker.worker_id] = await worker.state()

    info = machine()  # the load average and the code before the run
    settings = load_settings()
    folder = workfolder()
    options = Options(
        duration=args.payments / args.rate,
        rate=args.rate,
        aml_workers=1,
        fraud_workers=args.fraud_workers,
        seed=args.seed,
        folder=folder,
        drain_deadline=args.timeout,
    )
    demo = Demo(settings, options, script=sample, worker_env={"AML_MODEL": args.model})
    demo.system.layout = replace(demo.system.layout, api_replicas=args.api_replicas)
    verdict = await demo.run()
    if verdict is None or not cpu["end"]:
        raise RuntimeError("the run did not complete")
    ledger, watch = demo.ledger, demo.system.watch
    assert watch is not None
    steady = {pid for pid in ledger.ids() if pid not in ledger.warm_up}
    first_sent = min(ledger.sent_at[p] for p in steady)
    n = len(steady) + len(ledger.malformed)
    done_at = {}
    for group in demo.system.groups:
        times = [watch.timeline.covered_at(group, p, end - 1) for p, end in ledger.ends.items()]
        if any(t is None for t in times):
            raise RuntimeError(f"{group} never covered the log end")
        done_at[group] = max(t for t in times if t is not None)
    decisions = demo.system.decisions["aml"].of_run(steady)
    done_at["aml"] = max(decided_at(d) for d in decisions)
    series = progress(
        [ledger.sent_at[p] - first_sent for p in steady],
        [_covered(watch.timeline, demo.system.groups, d) - first_sent for d in decisions],
        [decided_at(d) - first_sent for d in decisions],
    )
    rates = {who: n / (at - first_sent) for who, at in done_at.items()}
    slowest = min(rates[g] for g in demo.system.groups)
    used = {k: cpu["end"][k] - cpu["start"].get(k, 0.0) for k in cpu["end"]}
    aml_state = states.get("aml-0") or {}
    detector = aml_state.get("detector") or {}
    return {
        "benchmark": NAME,
        "machine": info,
        # The pipeline's read limit (AML_MAX_RECORDS_PER_TRIGGER) sets how a catch-up is cut into batches.
        "params": vars(args)
        | {"folder": str(folder), "max_records_per_trigger": settings.pipeline.max_records_per_trigger},
        "records": n,
        "valid": len(steady),
        "seconds": {who: at - first_sent for who, at in done_at.items()},
        "records_per_s": rates,
        "ratio_aml_to_slowest_dependency": rates["aml"] / slowest,
        "goal": f"AML throughput / slowest dependency's >= {GOAL}",
        "goal_met": rates["aml"] / slowest >= GOAL,
        "progress": series,
        "cpu_seconds": used,
        "cpu_us_per_record": {k: v / n * 1e6 for k, v in used.items()},
        "detector": detector,
        "checks": {
            "premature": verdict.services["aml"].premature_decisions,
            "freshness_violations": verdict.services["aml"].freshness_violations,
            "missing": verdict.services["aml"].missing,
            "ok": verdict.ok,
        },
    }


def _covered(timeline: CommitTimeline, groups: Sequence[str], decision: Mapping[str, Any]) -> float:
    """When both groups' commits covered a decided payment (it was decided, so they did)."""
    at = timeline.opened_at(groups, decision["partition"], decision["offset"])
    if at is None:
        raise RuntimeError(f"a decision on {decision['partition']}/{decision['offset']} was never covered")
    return at


def progress(
    sent: Sequence[float], covered: Sequence[float], decided: Sequence[float], step: float = STEP_S
) -> dict[str, list[float]]:
    """Payments sent, covered by both dependencies' commits and decided by AML by each `step` seconds
    after the first send: where the gated service falls behind, while its dependencies run or after."""
    end = max([*sent, *covered, *decided])
    ticks = [round(i * step, 3) for i in range(int(end / step) + 2)]

    def counts(times: Sequence[float]) -> list[float]:
        ordered = sorted(times)
        return [bisect.bisect_right(ordered, t) for t in ticks]

    return {"seconds": ticks, "sent": counts(sent), "covered": counts(covered), "decided": counts(decided)}


def report(doc: dict[str, Any]) -> str:
    rates = markdown_table(
        ["who", "done after (s)", "records/s"],
        [(who, doc["seconds"][who], round(rate)) for who, rate in doc["records_per_s"].items()],
    )
    goal = "met" if doc["goal_met"] else "NOT met"
    cpu = markdown_table(
        ["process (tree)", "CPU s", "CPU µs per record"],
        [(k, v, round(doc["cpu_us_per_record"][k])) for k, v in sorted(doc["cpu_seconds"].items())],
    )
    split = doc["detector"].get("seconds", {})
    decisions = max(doc["detector"].get("decisions", 0), 1)
    handler = markdown_table(
        ["AML handler step", "seconds (sum over payments)", "ms per payment"],
        [(k, v, v / decisions * 1000) for k, v in split.items()],
    )
    http = doc["detector"].get("http", {})
    load = doc["machine"]
    return "\n\n".join(
        [
            rates,
            f"ratio AML / slowest dependency: {doc['ratio_aml_to_slowest_dependency']:.3f} "
            f"(goal >= {GOAL}: {goal}); checks {doc['checks']}",
            cpu,
            handler,
            f"AML worker's HTTP requests to B and C: {http.get('requests')} "
            f"({http.get('failures')} failed), mean {http.get('mean_ms')} ms",
            f"load average at start {load['loadavg_at_start']}, at end {load.get('loadavg_at_end')}",
        ]
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payments", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=4000, help="the simulator's send rate (payments/s)")
    parser.add_argument("--fraud-workers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--api-replicas", type=int, default=2, help="replicas of each API (the layout's 2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to catch up after sending")
    parser.add_argument(
        "--model", default="amlworld", help="the AML worker's AML_MODEL (off: the rules alone)"
    )
    args = parser.parse_args()
    doc = asyncio.run(measure(args))
    finish(NAME, doc, report)


if __name__ == "__main__":
    cli()
