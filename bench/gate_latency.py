"""Gate latency and admin load: how soon a payment starts after its dependencies commit past it.

Payments arrive at a steady rate; two dependency groups, played here, each commit the log end every
50-200 ms (uniform jitter, independently), so the leader refreshes on the fast interval whenever a
payment waits. For each payment (p, o):

    latency = decided_at(p, o) - when the LAST dependency commit covering o was initiated

`decided_at` is stamped when the decision record is built, right after the gate opened (nothing in
between but building the record), so this is "commit -> payment starts". When the commit came first
it also includes the time the worker needs to *receive* the payment. The decision's `waited_ms` (the
time from the payment's arrival at the worker to the start of its processing: held by the gate, on
itself or on an earlier payment of its partition) splits the two: latency - waited_ms is "commit ->
arrival" (negative: the payment was already waiting when the commit started; the latency of those is
the gate's own response time). Payments of the first `--warmup` seconds are left out.

`--dep-delay D` makes the dependencies commit the log end as it was D seconds ago (they "take" D
seconds per payment); with D above the worker's fetch delay the payments are already waiting in
the gate when the covering commit starts, which isolates the gate's own response time.

Admin load is the sum over all workers of `refresh.admin_requests` from /watermarks.json, sampled
at the start and the end of the production window and divided by its length; only the leader
should make any. Every delay is measured with 1 and with 3 workers (3 workers own the partitions
disjointly, with a settled assignment, before payments start).

`--modes direct derived` runs each case twice, side by side: with both groups reading `payments`
(direct), and with the second group reading `payments.enriched` that a real `aml-app enrich` process
derives (derived; the workers get `AML_DERIVED_DEPENDENCIES`). That group reads the derived topic as it
grows and commits its positions there; a payment counts as covered by it from the first of its commits
past the payment's derived record (the stage commits its own offsets with that record). The refresh's
extra cost is the leader's `derived_requests` and `derived_records_read` per refresh.

    .venv/bin/python -m bench.gate_latency [--rate 100] [--duration 30] [--workers 1 3]
                                           [--dep-delays 0 1.0] [--modes direct derived]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from aml_app.harness.child_process import AmlAppProcess
from aml_app.harness.tails import from_the_start
from aml_app.harness.verify import CommitTimeline, decided_at, percentile
from aml_app.kafka.broker import create_topics
from aml_app.kafka.derivation import SOURCE_HEADER
from aml_app.kafka.tools import GroupCommitter, payment_json
from bench.common import (
    BenchEnv,
    admin_requests,
    bench_env,
    finish,
    machine,
    markdown_table,
    read_decisions,
    wait_owned,
)
from tests.harness import Names

NAME = "gate_latency"
REFRESH_INTERVAL = 1.0
FAST_REFRESH_INTERVAL = 0.1


@dataclass(frozen=True)
class Config:
    partitions: int = 4
    rate: float = 100.0
    duration: float = 30.0
    warmup: float = 3.0
    commit_min: float = 0.05
    commit_max: float = 0.2


class Scenario:
    """The producer and the dependency groups of one run, sharing the log ends acknowledged so far."""

    def __init__(self, env: BenchEnv, names: Names, config: Config, dep_delay: float) -> None:
        self.env = env
        self.names = names
        self.config = config
        self.dep_delay = dep_delay
        #: (monotonic time acknowledged, partition, new log end), in acknowledgement order.
        self.acks: list[tuple[float, int, int]] = []
        self.produced: dict[tuple[int, int], float] = {}  # (p, o) -> wall time acknowledged
        self.commits = CommitTimeline()
        self.commit_count = 0
        self.producing = True
        self.rng = random.Random(2026)

    async def produce(self) -> None:
        """One payment every 1/rate seconds on an absolute schedule, partitions round-robin."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        i = 0
        try:
            while (due := start + i / self.config.rate) < start + self.config.duration:
                await asyncio.sleep(max(0.0, due - loop.time()))
                p = i % self.names.partitions
                payer = f"acct-{p}-{i % 7}"
                value = payment_json(f"l-{i}", payer, f"acct-x{i}", "10.00", "2026-11-20T10:15:00Z")
                fut = await self.env.producer.send(
                    self.names.payments, value=value, key=payer.encode(), partition=p
                )
                meta = await fut
                self.produced[(meta.partition, meta.offset)] = time.time()
                self.acks.append((time.monotonic(), meta.partition, meta.offset + 1))
                i += 1
        finally:
            self.producing = False

    async def depend_derived(self, group: str, topic: str) -> None:
        """A dependency group reading the derived `topic` (read_committed, as it grows): every 50-200 ms it
        commits its positions there as of `dep_delay` seconds ago, and the payments whose derived records
        lie below them count as covered from that commit on, until every payment produced is covered."""
        partitions = range(self.names.partitions)
        committer = await GroupCommitter([self.env.bootstrap], group, topic).start(partitions)
        reader = AIOKafkaConsumer(
            bootstrap_servers=self.env.bootstrap,
            isolation_level="read_committed",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=20,
        )
        await reader.start()
        tps = [TopicPartition(topic, d) for d in partitions]
        reader.assign(tps)
        from_the_start(reader, tps)
        seen: list[tuple[float, int, int, int, int]] = []  # read at, derived partition and offset, source
        covered: dict[int, set[int]] = {p: set() for p in partitions}
        first_open = dict.fromkeys(partitions, 0)
        used = 0
        committed: dict[int, int] = {}
        try:
            while True:
                finished = not self.producing
                deadline = time.monotonic() + self.rng.uniform(self.config.commit_min, self.config.commit_max)
                while (left := deadline - time.monotonic()) > 0:
                    batches = await reader.getmany(timeout_ms=int(left * 1000) + 1)
                    now = time.monotonic()
                    for tp, messages in batches.items():
                        for m in messages:
                            p, o = (int(x) for x in dict(m.headers)[SOURCE_HEADER].decode().split(":"))
                            seen.append((now, tp.partition, m.offset, p, o))
                cutoff = time.monotonic() - self.dep_delay
                offsets = dict(committed)
                while used < len(seen) and seen[used][0] <= cutoff:
                    _, d, offset, p, o = seen[used]
                    offsets[d] = max(offsets.get(d, 0), offset + 1)
                    covered[p].add(o)
                    used += 1
                moved = {d: o for d, o in offsets.items() if o > committed.get(d, 0)}
                if moved:
                    for p in partitions:
                        while first_open[p] in covered[p]:
                            first_open[p] += 1
                        self.commits.record(group, p, first_open[p])
                    await committer.commit(moved)
                    committed.update(moved)
                    self.commit_count += 1
                elif finished and used == len(seen) == len(self.produced):
                    return
        finally:
            await reader.stop()
            await committer.stop()

    async def depend(self, group: str) -> None:
        """A dependency group: every 50-200 ms commit the log end as of `dep_delay` seconds ago,
        until it has committed everything produced."""
        committer = await GroupCommitter([self.env.bootstrap], group, self.names.payments).start(
            range(self.names.partitions)
        )
        seen = 0
        known: dict[int, int] = {}
        committed: dict[int, int] = {}
        try:
            while True:
                finished = not self.producing
                await asyncio.sleep(self.rng.uniform(self.config.commit_min, self.config.commit_max))
                cutoff = time.monotonic() - self.dep_delay
                while seen < len(self.acks) and self.acks[seen][0] <= cutoff:
                    _, p, end = self.acks[seen]
                    known[p] = max(known.get(p, 0), end)
                    seen += 1
                offsets = {p: o for p, o in known.items() if o > committed.get(p, 0)}
                if offsets:
                    await self.commits.commit({group: committer}, offsets)
                    committed.update(offsets)
                    self.commit_count += 1
                elif finished and seen == len(self.acks):
                    return
        finally:
            await committer.stop()


def summary(values: list[float]) -> dict[str, float]:
    """The percentiles the report uses (NaN for an empty list)."""
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else float("nan"),
        "min": min(values) if values else float("nan"),
    }


def start_stage(env: BenchEnv, names: Names, topic: str, stage_group: str) -> AmlAppProcess:
    """A real `aml-app enrich` deriving `topic` from this run's payments."""
    variables = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": env.bootstrap,
        "AML_PAYMENTS_TOPIC": names.payments,
        "AML_ENRICHED_TOPIC": topic,
        "AML_DLQ_TOPIC": names.dlq,
        "AML_ENRICHMENT_GROUP": stage_group,
        "AML_ENRICHMENT_ID": f"{stage_group}-0",
        "AML_SESSION_TIMEOUT": "4",
    }
    log_path = env.workdir / f"enrich-{names.suffix}.log"
    return AmlAppProcess(["enrich"], variables, log_path, env.workdir).start()


async def one_run(
    env: BenchEnv, workers: int, dep_delay: float, config: Config, mode: str = "direct"
) -> dict[str, Any]:
    names = await env.fresh_names(config.partitions)
    relations, aggregates = names.deps
    derived, stage_group = f"payments.enriched-{names.suffix}", f"enrichment-{names.suffix}"
    extra: dict[str, str] = {}
    stage = None
    if mode == "derived":
        await create_topics([env.bootstrap], [derived], config.partitions)
        stage = start_stage(env, names, derived, stage_group)
        extra["AML_DERIVED_DEPENDENCIES"] = f"{aggregates}:{derived}:{stage_group}"
    started = [
        env.start_worker(
            names,
            AML_REFRESH_INTERVAL=str(REFRESH_INTERVAL),
            AML_FAST_REFRESH_INTERVAL=str(FAST_REFRESH_INTERVAL),
            **extra,
        )
        for _ in range(workers)
    ]
    ready = await wait_owned(started, config.partitions, timeout=120)
    scenario = Scenario(env, names, config, dep_delay)
    before = await admin_requests(started)
    t0 = time.time()
    deps = [
        asyncio.create_task(scenario.depend(relations)),
        asyncio.create_task(
            scenario.depend_derived(aggregates, derived) if mode == "derived" else scenario.depend(aggregates)
        ),
    ]
    await scenario.produce()
    after = await admin_requests(started)
    t1 = time.time()
    await asyncio.wait_for(asyncio.gather(*deps), timeout=30 + dep_delay)
    total = len(scenario.produced)
    decisions = await read_decisions(env.bootstrap, names.decisions, config.partitions, total, timeout=60)
    final = await admin_requests(started)
    await env.stop_workers(started)
    if stage is not None:
        stage.kill()

    leaders = set(before["leaders"])
    latencies: list[float] = []
    held: list[float] = []  # waited_ms: arrival at the worker -> processing starts
    to_arrival: list[float] = []  # covering commit -> arrival at the worker (< 0: it was waiting)
    already_waiting: list[float] = []  # latency of payments that arrived before the commit started
    on_leader: list[float] = []
    on_follower: list[float] = []
    premature = unmeasured = 0
    by_worker: dict[str, int] = {}
    for d in decisions:
        by_worker[d["worker"]] = by_worker.get(d["worker"], 0) + 1
        key = (d["partition"], d["offset"])
        if scenario.produced.get(key, 0) < t0 + config.warmup:
            continue
        opened = scenario.commits.opened_at(names.deps, *key)
        if opened is None:
            unmeasured += 1
            continue
        latency = (decided_at(d) - opened) * 1000
        premature += latency < 0
        latencies.append(latency)
        held.append(d["waited_ms"])
        to_arrival.append(latency - d["waited_ms"])
        if latency - d["waited_ms"] < 0:
            already_waiting.append(latency)
        (on_leader if d["worker"] in leaders else on_follower).append(latency)
    window = after["at"] - before["at"]
    refreshes = after["refreshes"] - before["refreshes"]
    admin = after["admin_requests"] - before["admin_requests"]
    return {
        "mode": mode,
        "workers": workers,
        "dep_delay_s": dep_delay,
        "assignment": {s["worker"]: s["assigned"] for s in ready},
        "payments": total,
        "decisions": len(decisions),
        "distinct_decisions": len({(d["partition"], d["offset"]) for d in decisions}),
        "decisions_by_worker": by_worker,
        "produce_rate_per_s": total / (t1 - t0),
        "dependency_commits": scenario.commit_count,
        "measured_payments": len(latencies),
        "unmeasured": unmeasured,
        "premature": premature,
        "latency_ms": summary(latencies),
        "held_at_worker_ms": summary(held),
        "commit_to_arrival_ms": summary(to_arrival),
        "latency_already_waiting_ms": summary(already_waiting),
        "latency_on_leader_ms": summary(on_leader),
        "latency_on_followers_ms": summary(on_follower),
        "window_s": window,
        "admin_requests": admin,
        "admin_requests_per_s": admin / window,
        "refreshes_per_s": refreshes / window,
        "admin_requests_per_refresh": admin / max(refreshes, 1),
        "derived_requests_per_refresh": (after["derived_requests"] - before["derived_requests"])
        / max(refreshes, 1),
        "derived_records_read": after["derived_records_read"] - before["derived_records_read"],
        "leaders": before["leaders"],
        "leaders_after": final["leaders"],
        "rebalances_during_run": {
            w: final["rebalances"][w] - before["rebalances"].get(w, 0) for w in final["rebalances"]
        },
        "latencies_ms": [round(x, 3) for x in latencies],
    }


async def main(
    worker_counts: list[int],
    dep_delays: list[float],
    config: Config,
    keep: bool,
    modes: tuple[str, ...] = ("direct",),
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "benchmark": NAME,
        "machine": machine(),
        "params": {
            **asdict(config),
            "workers": worker_counts,
            "dep_delays_s": dep_delays,
            "modes": list(modes),
            "refresh_interval_s": REFRESH_INTERVAL,
            "fast_refresh_interval_s": FAST_REFRESH_INTERVAL,
        },
        "runs": [],
    }
    async with bench_env(keep) as env:
        for delay in dep_delays:
            for n in worker_counts:
                for mode in modes:  # side by side
                    run = await one_run(env, n, delay, config, mode)
                    doc["runs"].append(run)
                    lat = run["latency_ms"]
                    print(
                        f"{mode}, dep delay {delay:g}s, {n} worker(s): p50 {lat['p50']:.0f} ms, "
                        f"p99 {lat['p99']:.0f} ms, {run['admin_requests_per_s']:.1f} admin requests/s, "
                        f"{run['derived_requests_per_refresh']:.2f} derived requests per refresh",
                        flush=True,
                    )
    limit = REFRESH_INTERVAL * 1000

    def key(r: dict[str, Any]) -> str:
        return f"{r.get('mode', 'direct')}, delay {r['dep_delay_s']:g}s, {r['workers']} workers"

    doc["summary"] = {
        "goal": "p99 < refresh interval (1 s); admin requests/s not growing with workers",
        "p99_below_refresh_interval": {key(r): r["latency_ms"]["p99"] < limit for r in doc["runs"]},
        "admin_requests_per_s": {key(r): r["admin_requests_per_s"] for r in doc["runs"]},
    }
    return doc


def _pair(stats: dict[str, float]) -> str:
    return f"{stats['p50']:.0f} / {stats['p99']:.0f}" if stats["n"] else "-"


def report(doc: dict[str, Any]) -> str:
    headline = markdown_table(
        [
            "dependencies",
            "dep delay (s)",
            "workers",
            "payments measured",
            "p50 (ms)",
            "p90 (ms)",
            "p99 (ms)",
            "max (ms)",
            "premature",
            "admin req/s (sum, all workers)",
            "refreshes/s",
            "derived-topic requests per refresh",
            "window (s)",
            "rebalances",
        ],
        [
            (
                "C on payments.enriched" if r.get("mode") == "derived" else "both on payments",
                r["dep_delay_s"],
                r["workers"],
                r["measured_payments"],
                r["latency_ms"]["p50"],
                r["latency_ms"]["p90"],
                r["latency_ms"]["p99"],
                r["latency_ms"]["max"],
                r["premature"],
                r["admin_requests_per_s"],
                r["refreshes_per_s"],
                r.get("derived_requests_per_refresh", 0.0),
                r["window_s"],
                sum(r["rebalances_during_run"].values()),
            )
            for r in doc["runs"]
        ],
    )
    split = markdown_table(
        [
            "dep delay (s)",
            "workers",
            "commit→arrival p50/p99 (ms)",
            "held at worker (waited_ms) p50/p99",
            "arrived before commit: n, p50/p99 (ms)",
            "leader's partitions p50/p99 (ms)",
            "followers' partitions p50/p99 (ms)",
        ],
        [
            (
                r["dep_delay_s"],
                r["workers"],
                _pair(r["commit_to_arrival_ms"]),
                _pair(r["held_at_worker_ms"]),
                f"{r['latency_already_waiting_ms']['n']}: " + _pair(r["latency_already_waiting_ms"]),
                _pair(r["latency_on_leader_ms"]),
                _pair(r["latency_on_followers_ms"]),
            )
            for r in doc["runs"]
        ],
    )
    return f"{headline}\n\n{split}"


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 3])
    parser.add_argument(
        "--dep-delays",
        type=float,
        nargs="+",
        default=[0.0, 1.0],
        help="seconds the dependencies lag behind the log end (0: they commit the log end)",
    )
    parser.add_argument("--partitions", type=int, default=Config.partitions)
    parser.add_argument("--rate", type=float, default=Config.rate, help="payments per second")
    parser.add_argument("--duration", type=float, default=Config.duration, help="production (s)")
    parser.add_argument("--warmup", type=float, default=Config.warmup, help="not measured (s)")
    parser.add_argument("--commit-min", type=float, default=Config.commit_min)
    parser.add_argument("--commit-max", type=float, default=Config.commit_max)
    parser.add_argument("--keep", action="store_true", help="keep the worker and broker logs")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=("direct", "derived"),
        default=["direct"],
        help="both groups on payments, and/or the second on a derived topic (results: gate_latency_derived)",
    )
    args = parser.parse_args()
    config = Config(args.partitions, args.rate, args.duration, args.warmup, args.commit_min, args.commit_max)
    doc = asyncio.run(main(args.workers, args.dep_delays, config, args.keep, tuple(args.modes)))
    finish(NAME if args.modes == ["direct"] else f"{NAME}_derived", doc, report)


if __name__ == "__main__":
    cli()
