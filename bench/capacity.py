"""Capacity: how long a payment waits for its verdict, and how many payments/s the whole system decides.

The whole system runs as in the demo (`aml_app.harness.demo.Demo` on `aml_app.harness.system.System`: the
embedded broker, the embedded PostgreSQL, the Spark pipeline of Services B and C, `--api-replicas` (two)
replicas of each API, `--aml-workers` AML workers with the learned model on (`AML_MODEL=amlworld`) and one
fraud worker), started once. A prelude (`--prelude-rate` for `--prelude-seconds`, not measured) lets Spark
compile its code for batches of real payments: the first ones take seconds each. The simulator then sends
at each rate of `--rates` in turn, `--step-seconds` per rate (each step a run of the simulator of its own,
with its own accounts, and the demo's one malformed record per hundred), and before the next step the
system catches up with everything sent (at most `--drain-seconds`). Each step's simulation is built
before its first send, while the system is idle (20-45 s for 120,000 payments). The first
`--warm-up` seconds of each step (a quarter by default) are left out of its figures: the pipeline's
micro-batches, the workers' lanes and the APIs' connection pools settle into the new rate there.

Per rate, over the payments sent after the warm-up:

- produced -> decided, p50/p95/p99/max, for AML and for fraud: the decision record's `decided_at`
  minus the simulator's send time of the payment (the start of the burst it went out in; the broker
  acknowledged it within that burst). `decided_at` is stamped by the worker once the rules ran, on the
  same clock; the decision's arrival at our reader would add the reader's own polling (a fetch held up
  to its wait on the embedded broker), which is not the system's. A payment decided twice counts at
  its first decision, and one never decided as infinitely late;
- the gate's own share: `decided_at` minus the instant both dependency groups' commits covered the
  payment, the floor no gated consumer can beat. The instants come from the pipeline's log
  (`pipeline_commits`): each batch's line, written once its commit returned, gives the offsets the
  group has committed and the commit call's duration, so the call's start is dated to the millisecond
  and the share is overstated by at most the call (about a millisecond). The same share against the
  demo's commit watch (polled every 50 ms, dated at the poll before the one that saw a commit, so
  overstated by up to one poll interval) is given beside it, and the premature decisions are counted
  against both. For AML's event-time gate the share is also given from that gate's own floor
  (`event_time_covered`): the instant both groups had committed every payment of every partition sent
  by then and timestamped up to the payment's event time, which comes later than the payment's own
  commit when a micro-batch ended before some of them reached the broker. The share is split at the
  instant the leader published the first row of its gate's table (AML: the event-time cut; fraud: the
  partition's watermark) that opens the gate on the payment, the row's broker timestamp on the table's
  changelog (`published_at`): before it, the leader's refresh; after it, per worker, the changelog hop
  to a follower, the lane, the evidence and the rules;
- the pipeline's commit latency: that instant minus the send time;
- every payment of the step decided by both services at the end of the run, 0 premature decisions
  (`aml_app.harness.verify.premature`, as the demo checks) and 0 freshness violations;
- CPU seconds of every process of the system between two samples (the end of the warm-up and the
  last send), divided by the payments both detectors decided in between (`bench.common.processes`;
  the pipeline split into its Python driver, its JVM and Spark's Python workers). This process (the
  simulator, the readers, the commit watch) is given apart and is not counted as the system;
- held: the producer reached the rate (at least 95 % of it over the measured part) and each service
  kept up: its backlog (payments sent and not yet decided), averaged over the last 5 s of the step, is
  at most half a second of traffic above its average over the first 5 s after the warm-up;
- the highest rate held with AML's p99 at most 2 s.

Where the time goes, per stage, from what the system already reports: the pipeline's per-batch lines
in its log (`<service> batch N: ... (spark .. dead_letters .. store .. commit ..)`), the leaders'
refresh durations (`aml_admin_refresh_seconds` in `/metrics`), each worker's handler split
(`detector` in `/watermarks.json`: evidence over HTTP from B and C, rules with the model for AML,
handing alerts and decisions to the producer) and the gate's hold (`waited_ms`); and PostgreSQL's
execution time by statement (`bench.pg_statements`: the embedded server runs with pg_stat_statements
here), per payment decided by both. With `--profile SECONDS`, inside each Python process too: py-spy's
samples of every worker, API replica and the pipeline's driver over the measured part split each one's
CPU per payment by function and by source file (`bench.py_profile`).

    .venv/bin/python -m bench.capacity [--rates 50,150,250,350,500,1000,2000] [--step-seconds 60]
        [--warm-up 15] [--aml-workers 2] [--api-replicas 2] [--prelude-rate 500] [--prelude-seconds 30]
        [--drain-seconds 120] [--stages-rate 1000] [--seed 5] [--profile 45]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import re
import statistics
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from aml_app import dependency_services as registry
from aml_app.gate.event_time import Cut, admits, micros
from aml_app.harness.demo import PROGRESS_EVERY, Demo, Options, sleep_unless
from aml_app.harness.report import say
from aml_app.harness.system import Layout, SystemFailure, service_settings
from aml_app.harness.tails import TopicTail
from aml_app.harness.verdict import Sent, Verdict
from aml_app.harness.verify import CommitTimeline, decided_at, percentile, premature
from aml_app.kafka.broker import EmbeddedBroker, free_port
from aml_app.settings import Settings, load_settings
from aml_app.simulation.producer import SimulatorReport, run_simulator
from aml_app.simulation.traffic import SimPayment
from bench import broker_census, pg_statements, py_profile
from bench.common import (
    CLK_TCK,
    OWN,
    cpu_of,
    descendants,
    finish,
    machine,
    markdown_table,
    proc_table,
    processes,
    thread_cpu,
    workfolder,
)

NAME = "capacity"
DEFAULT_RATES = (50.0, 150.0, 250.0, 350.0, 500.0, 1000.0, 2000.0)
P99_BOUND_S = 2.0  # the latency a rate must keep to count as the system's capacity
HELD_RATE_SHARE = 0.95  # the producer reached the rate
BACKLOG_EDGE_S = 5.0  # seconds averaged at each end of a step for the backlog's growth
BACKLOG_GROWTH_S = 0.5  # at most this many seconds of traffic more backlog at the end than at the start
BACKLOG_EVERY_S = 0.1
NEVER = float("inf")  # the latency of a payment never decided
PIPELINE = "pipeline (Spark: driver, JVM, Python workers)"
PIPELINE_PARTS = ("pipeline: Python driver", "pipeline: JVM", "pipeline: Spark's Python workers")
#: Part of "pipeline: JVM" (not added to the system's CPU again): the JIT's threads, HotSpot's compilers and
#: its code-cache sweeper. Spark runs thousands of methods a few times per micro-batch, so at low rates
#: they reach the compilers' thresholds over minutes, and compiling them is much of the JVM's CPU early on.
JIT = "pipeline: JVM, of it the JIT (at least)"
#: Each detector's gate (its service's default `AML_GATE_MODE`): the event-time gate's share is also given
#: from its own floor (`event_time_covered`).
GATE_MODES = {"aml": "event-time", "fraud": "partition"}
JIT_THREADS = re.compile(r"^(C[12] CompilerThre|Sweeper thread)")
GOALS = {
    "p99_at_50_s": 1.0,
    "p99_at_1000_s": 2.0,
    "highest_rate_p99_2s": 2000.0,
    "gate_share_p99_ms": 150.0,
    "pipeline_p99_at_2000_ms": 500.0,
    "cpu_us_per_payment": 800.0,
}
#: The detector's handler steps (`aml_app.worker.detector.DetectorStats`), as the report names them.
HANDLER_STEPS = {
    "evidence": "evidence (HTTP to B and C)",
    "rules": "rules",
    "alert": "produce alerts",
    "decision": "produce decisions",
}
BATCH_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ INFO (\w+) batch (\d+): (\d+) records, "
    r"(\d+) dead-lettered, ([\d.]+) s \(([^)]*)\)(?:, committed (\{[^}]*\}))?"
)
COMMITTED = re.compile(r"(\d+): (\d+)")
METRIC_LINE = re.compile(
    r"^(aml_admin_refresh_seconds|aml_gate_wait_seconds)_(sum|count)(?:\{[^}]*\})? ([0-9.eE+-]+)$"
)


@dataclass
class Sample:
    """What the system had used and counted at one instant."""

    at: float
    cpu: dict[str, float]
    states: dict[str, dict[str, Any] | None]
    metrics: dict[str, dict[str, float]]
    polls: int  # the commit watch's successful polls so far
    caches: dict[str, dict[str, int]] = field(default_factory=dict)  # each API replica's answer cache
    statements: pg_statements.Counters | None = None  # PostgreSQL's time by statement so far
    jit: dict[int, float] = field(default_factory=dict)  # CPU seconds so far of each JIT thread (`JIT`)
    #: Each API replica's time answering its batch route so far: "sum" (seconds) and "count".
    api_batches: dict[str, dict[str, float]] = field(default_factory=dict)
    #: With `--census`: the broker's requests so far (`bench.broker_census`), and who made them.
    census: dict[tuple[int | None, str, str], dict[str, Any]] | None = None
    census_names: dict[int, str] = field(default_factory=dict)


@dataclass
class Step:
    """One rate: what was sent, when, and the samples at both ends of its measured part."""

    rate: float
    seconds: float
    warm_up: float
    ids: list[str] = field(default_factory=list)
    first_sent: float | None = None
    last_sent: float | None = None
    samples: dict[str, Sample] = field(default_factory=dict)
    report: SimulatorReport | None = None
    caught_up_after: float | None = None  # seconds from the last send until everything was decided
    stopped_early: bool = False
    #: py-spy's summary of each Python process over the measured part (`--profile`), by process name.
    profile: dict[str, dict[str, Any]] = field(default_factory=dict)


def system_cpu(demo: Demo) -> tuple[dict[str, float], dict[int, float]]:
    """CPU seconds so far of every process of `processes`, the pipeline split into its parts, and of each
    JIT thread of the pipeline's JVM (`jit_threads`); one read of /proc for all processes."""
    table = proc_table()
    parents, stats = table
    used = {}
    jit: dict[int, float] = {}
    for name, pid in processes(demo).items():
        if name != PIPELINE:
            used[name] = cpu_of(name, pid, table)
            continue
        family = descendants(pid, parents) & set(stats)
        comm = {member: _comm(member) for member in family}
        jvms = {member for member in family if comm[member] == "java"}
        under_jvm = set().union(*(descendants(j, parents) for j in jvms)) - jvms if jvms else set()
        jit = jit_threads(jvms)
        parts = dict.fromkeys(PIPELINE_PARTS, 0.0)
        for member in family:
            own, reaped = (
                sum(int(stats[member][i]) for i in columns) / CLK_TCK for columns in ((11, 12), (13, 14))
            )
            part = 1 if member in jvms else 2 if member in under_jvm else 0
            parts[PIPELINE_PARTS[part]] += own
            # The JVM's children are Spark's Python workers: one that ended took its CPU into the JVM's
            # reaped children's times, which count as theirs (else the part falls when a worker ends).
            parts[PIPELINE_PARTS[2 if member in jvms else part]] += reaped
        used.update(parts)
    return used, jit


def python_processes(demo: Demo) -> dict[str, int]:
    """The system's Python processes by the names their CPU has in `system_cpu`: the workers, the API
    replicas and the pipeline's driver (the Spark JVM and Spark's short-lived Python workers aside)."""
    every = processes(demo)
    found = {name: pid for name, pid in every.items() if name.startswith("worker ") or name.endswith(" API")}
    if PIPELINE in every:
        found[PIPELINE_PARTS[0]] = every[PIPELINE]
    return found


def jit_threads(jvms: Iterable[int]) -> dict[int, float]:
    """CPU seconds so far of each JIT thread of `jvms` (by thread id). HotSpot starts and stops compiler
    threads as its queue grows and shrinks: a thread that ended between two readings takes its CPU with
    it, so the difference of two readings over the threads of the later one is a lower bound."""
    return {
        task: seconds
        for jvm in jvms
        for task, (name, seconds) in thread_cpu(jvm).items()
        if JIT_THREADS.match(name)
    }


def jit_used(start: Sample, end: Sample) -> float:
    """The JIT threads' CPU between two samples, at least (see `jit_threads`)."""
    return sum(seconds - start.jit.get(task, 0.0) for task, seconds in end.jit.items())


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


#: An API replica's time answering batch requests (`POST /relations`, `POST /aggregates`), from the
#: middleware's start to the response: what the worker's HTTP time adds to it is queueing and transport.
API_BATCH_LINE = re.compile(
    r'^aml_api_request_seconds_(sum|count)\{(?=[^}]*route="POST /[a-z]+")[^}]*\} ([0-9.eE+-]+)$'
)


async def metrics_text(url: str, headers: dict[str, str]) -> str:
    """A process's /metrics text (`headers`: its token); empty when it does not answer."""
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{url}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(5)) as r,
        ):
            text = await r.text() if r.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError):
        text = ""
    return text


async def scrape_api_batches(url: str, headers: dict[str, str]) -> dict[str, float]:
    """The sum and count of an API replica's batch-route histogram (`API_BATCH_LINE`)."""
    return api_batch_sums(await metrics_text(url, headers))


def api_batch_sums(text: str) -> dict[str, float]:
    """The batch routes' histogram sum and count in a replica's /metrics text, summed over the routes."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if match := API_BATCH_LINE.match(line):
            found[match[1]] = found.get(match[1], 0.0) + float(match[2])
    return found


def api_kind(name: str) -> str:
    """The API an API replica's name is of (`relations-2-api` -> relations)."""
    return "relations" if name.startswith("relations") else "aggregates"


def api_batch_ms(start: Sample, end: Sample) -> dict[str, float | None]:
    """Per API kind, over the measured part: the mean time a replica took to answer a batch request."""
    spent: dict[str, list[float]] = {}
    for name, b1 in end.api_batches.items():
        b0 = start.api_batches.get(name) or {}
        kind = api_kind(name)
        entry = spent.setdefault(kind, [0.0, 0.0])
        entry[0] += b1.get("sum", 0.0) - b0.get("sum", 0.0)
        entry[1] += b1.get("count", 0.0) - b0.get("count", 0.0)
    return {kind: round(1000 * total / n, 1) if n else None for kind, (total, n) in spent.items()}


async def scrape_metrics(url: str, headers: dict[str, str]) -> dict[str, float]:
    """The sums and counts of the gate-wait and refresh histograms of a worker's /metrics (`headers`:
    its token)."""
    found = {}
    for line in (await metrics_text(url, headers)).splitlines():
        if match := METRIC_LINE.match(line):
            found[f"{match[1]}_{match[2]}"] = float(match[3])
    return found


class GateTableTail(TopicTail):
    """The changelog of the table a service's gate opens on (AML's event-time cut, fraud's per-partition
    watermarks), with each write's broker timestamp: when the leader published what it read."""

    def __init__(self, bootstrap: Sequence[str], topic: str) -> None:
        super().__init__(bootstrap, topic)
        self.rows: list[tuple[float, dict[str, Any]]] = []

    def take(self, record: Any) -> None:
        with contextlib.suppress(TypeError, ValueError):
            doc = json.loads(record.value)
            if isinstance(doc, dict):
                self.rows.append((record.timestamp / 1000, doc))


def gate_table(app_id: str, mode: str) -> str:
    """The changelog topic (Faust's `<app id>-<table>-changelog`) of the table a gate mode opens on."""
    return f"{app_id}-{'gate-cut' if mode == 'event-time' else 'watermarks'}-changelog"


def published_at(
    rows: Sequence[tuple[float, Mapping[str, Any]]], mode: str, lateness_us: int
) -> Callable[[int, int, int, float], float | None]:
    """For payment (partition, offset, event time µs, sent at): when the leader first wrote a row that
    opens the gate on it (the row's broker timestamp), None if none did. The rows in write order."""
    times = [at for at, _ in rows]
    cuts = [Cut.from_json(doc) if mode == "event-time" else None for _, doc in rows]

    def opens(i: int, partition: int, offset: int, event_us: int) -> bool:
        cut, doc = cuts[i], rows[i][1]
        if cut is not None:
            return admits(cut, partition, offset, event_us, lateness_us)
        return doc.get("partition") == partition and int(doc.get("watermark", 0)) > offset

    def first(partition: int, offset: int, event_us: int, sent: float) -> float | None:
        # No row written before the payment was sent can open on it (its offset did not exist).
        for i in range(bisect.bisect_left(times, sent - CLOCK_SLACK_S), len(rows)):
            if opens(i, partition, offset, event_us):
                return times[i]
        return None

    return first


#: A row's broker timestamp is cut to the millisecond, and the send time is taken on this side of the
#: producer: rows up to this much before the send are read too (none of them can open on the payment).
CLOCK_SLACK_S = 0.002


class CapacityDemo(Demo):
    """The demo, with its flow of payments replaced by steps of rising rate in the same system."""

    def __init__(
        self, settings: Settings, options: Options, args: argparse.Namespace, worker_env: Mapping[str, str]
    ) -> None:
        super().__init__(settings, options, worker_env=worker_env)
        self.system.layout = replace(self.system.layout, postgres_statements=True)
        self.args = args
        self.steps: list[Step] = []
        self.step_over = asyncio.Event()
        self.gate_tables: dict[str, GateTableTail] = {}
        self.gate_table_tasks: list[asyncio.Task[None]] = []
        self.census: broker_census.Census | None = None

    async def flow(self) -> None:
        self.started = time.monotonic()
        args = self.args
        for svc, mode in GATE_MODES.items():
            app_id = service_settings(self.settings, svc, self.system.layout.suffix).app_id
            tail = GateTableTail(self.system.bootstrap, gate_table(app_id, mode))
            await tail.start(1)
            self.gate_tables[svc] = tail
            self.gate_table_tasks.append(asyncio.create_task(tail.run()))
        try:
            await self.steps_of_rates(args)
        except BaseException:
            # The tails read the broker, which the demo stops next: they stop first.
            await self.stop_gate_tables()
            raise

    async def drain(self) -> None:
        """The demo's drain; the gate tables are read until every payment is decided."""
        try:
            await super().drain()
        finally:
            await self.stop_gate_tables()

    async def run(self) -> Verdict | None:
        try:
            return await super().run()
        finally:
            await self.stop_gate_tables()

    async def stop_gate_tables(self) -> None:
        tasks, self.gate_table_tasks = self.gate_table_tasks, []
        for tail in self.gate_tables.values():
            tail.halt()
        await asyncio.gather(*tasks, return_exceptions=True)
        if tasks:
            for tail in self.gate_tables.values():
                await tail.stop()

    async def steps_of_rates(self, args: argparse.Namespace) -> None:
        rates: list[float] = args.rates
        done = []
        if args.prelude_seconds > 0:
            say(
                f"prelude: {args.prelude_rate:g} payments/s for {args.prelude_seconds:g} s, not measured "
                "(Spark compiles its code for the shapes of real batches); building the simulation"
            )
            prelude = await self.run_step("prelude", args.prelude_rate, args.prelude_seconds, None, seed=-1)
            done.append(prelude)
            await self.catch_up(prelude, args.drain_seconds)
        for index, rate in enumerate(rates):
            if self.controls.stop.is_set():
                break
            say(
                f"step {index + 1} of {len(rates)}: {rate:g} payments/s for {args.step_seconds:g} s "
                f"(the first {args.warm_up:g} s are warm-up); building the simulation"
            )
            step = await self.run_step(str(index), rate, args.step_seconds, args.warm_up, seed=index)
            self.steps.append(step)
            done.append(step)
            if not self.controls.stop.is_set() and index < len(rates) - 1:
                await self.catch_up(step, args.drain_seconds)
        self.report = merged_report(done, self.ground_truth)
        self.controls.stop.set()

    async def run_step(
        self, label: str, rate: float, seconds: float, warm_up: float | None, *, seed: int
    ) -> Step:
        """Send at `rate` for `seconds` (the simulator's seed: the run's plus `seed`); sampled after
        `warm_up` seconds and at the end (None: not measured)."""
        o, s = self.options, self.settings
        o.rate = rate  # the malformed records follow the step's rate
        step = Step(rate, seconds, warm_up or 0.0)
        self.step_over = asyncio.Event()
        first = asyncio.Event()

        def on_sent(payment: SimPayment, partition: int, offset: int, sent_at: float) -> None:
            self.ledger.on_sent(payment, partition, offset, sent_at)
            step.ids.append(payment.payment_id)
            if step.first_sent is None:
                step.first_sent = sent_at
                first.set()
            step.last_sent = sent_at

        simulator = asyncio.create_task(
            run_simulator(
                self.system.bootstrap,
                s.kafka.payments_topic,
                rate,
                seconds,
                o.seed + seed,
                None,  # one ground truth for the whole run, written at its end
                reporting_threshold=s.dependencies.reporting_threshold,
                threshold_band=s.dependencies.threshold_band,
                thresholds=s.detection.aml_thresholds,
                prefix=f"cap{o.seed}-{label}-{uuid.uuid4().hex[:4]}",
                producer=self.producer,
                stop=self.controls.stop,
                on_sent=on_sent,
            )
        )
        self.tasks["payment simulator"] = simulator
        self.tasks["malformed records"] = asyncio.create_task(self.send_malformed())
        if warm_up is not None:
            self.tasks["step sampler"] = asyncio.create_task(self.sample_step(step, first, simulator))
        next_report = self.elapsed() + PROGRESS_EVERY
        while not simulator.done() and not self.controls.stop.is_set():
            await sleep_unless(self.controls.stop, 0.5)
            self.system.check_health(self.tasks)
            if self.elapsed() >= next_report:
                await self.progress(prefix=f"{rate:>6g}/s ")
                next_report = self.elapsed() + PROGRESS_EVERY
        self.step_over.set()
        try:
            step.report = await simulator
            await self.tasks["malformed records"]
            if warm_up is not None:
                await self.tasks.pop("step sampler")
        except Exception as exc:
            raise SystemFailure(f"the {rate:g}/s step failed: {str(exc) or repr(exc)}") from exc
        step.stopped_early = step.report.stopped_early
        return step

    async def progress(self, prefix: str = "") -> None:
        """One line, cheap: the demo's own line also reads every decision so far for its wait percentile,
        which grows with the run and would hold up the commit watch's polls in this event loop."""
        system = self.system
        assert system.watch is not None
        sent = len(self.ledger.ids()) - len(self.ledger.warm_up)
        decided = " ".join(f"{svc} {len(t.ids)}" for svc, t in system.decisions.items())
        lag = " ".join(f"{g} {system.watch.behind(g, self.ledger.ends)}" for g in system.groups)
        held, _, _ = await system.waiting()
        say(f"{prefix}{self.elapsed():6.1f}s  sent {sent}  decided {decided}  lag {lag}  held {held}")

    async def _stopped_within(self, seconds: float) -> bool:
        """The malformed records stop with their step."""
        await sleep_unless(self.step_over, seconds)
        return self.step_over.is_set() or self.controls.stop.is_set()

    async def sample_step(self, step: Step, first: asyncio.Event, simulator: asyncio.Task[Any]) -> None:
        """Samples at the end of the step's warm-up and at its last send."""
        await first.wait()
        assert step.first_sent is not None
        await asyncio.sleep(max(0.0, step.first_sent + step.warm_up - time.time()))
        if simulator.done():
            if self.controls.stop.is_set():
                return
            raise SystemFailure(f"the {step.rate:g}/s step ended within its warm-up")
        step.samples["start"] = await self.sample()
        profiling = None
        if self.args.profile > 0:
            seconds = min(self.args.profile, step.first_sent + step.seconds - time.time())
            profiling = asyncio.create_task(py_profile.record(python_processes(self), seconds))
        await asyncio.wait([simulator])
        step.samples["end"] = await self.sample()
        if profiling is not None:
            step.profile = await profiling

    async def sample(self) -> Sample:
        at = time.time()
        cpu, jit = await asyncio.to_thread(system_cpu, self)
        workers = self.system.all_workers
        states = await asyncio.gather(*(w.state(timeout=5) for w in workers))
        metrics = await asyncio.gather(*(scrape_metrics(w.url, w.headers) for w in workers))
        apis = list(self.system.apis.values())
        healths = await asyncio.gather(*(api.health() for api in apis))
        batches = await asyncio.gather(*(scrape_api_batches(api.url, api.headers) for api in apis))
        postgres = self.system.postgres
        statements = None if postgres is None else await pg_statements.read(postgres.url("aml"))
        assert self.system.watch is not None
        census, names = None, {}
        if self.census is not None:
            census = self.census.snapshot()
            names = await asyncio.to_thread(broker_census.owners, {k[0] for k in census}, processes(self))
        return Sample(
            at,
            cpu,
            {w.worker_id: s for w, s in zip(workers, states, strict=True)},
            {w.worker_id: m for w, m in zip(workers, metrics, strict=True)},
            self.system.watch.polls,
            {api.name: (h or {}).get("answer_cache") or {} for api, h in zip(apis, healths, strict=True)},
            statements,
            jit=jit,
            api_batches={api.name: b for api, b in zip(apis, batches, strict=True)},
            census=census,
            census_names=names,
        )

    async def catch_up(self, step: Step, deadline_s: float) -> None:
        """Until every payment so far is committed, decided and dead-lettered (at most `deadline_s`)."""
        deadline = time.monotonic() + deadline_s
        next_report = time.monotonic() + PROGRESS_EVERY
        while not self.caught_up():
            if self.controls.stop.is_set():
                return
            if time.monotonic() > deadline:
                say(f"the {step.rate:g}/s step was not caught up within {deadline_s:g} s: going on")
                return
            self.system.check_health(self.tasks)
            if time.monotonic() >= next_report:
                await self.progress(prefix="catch-up ")
                next_report += PROGRESS_EVERY
            await asyncio.sleep(0.5)
        assert step.last_sent is not None
        step.caught_up_after = time.time() - step.last_sent
        say(f"caught up {step.caught_up_after:.1f} s after the step's last send")


def merged_report(steps: Sequence[Step], ground_truth: Path) -> SimulatorReport | None:
    """One report for the demo's verdict (its detection scores) over every step; writes its ground truth."""
    reports = [step.report for step in steps if step.report is not None]
    if not reports:
        return None
    first = reports[0]
    simulation = replace(
        first.simulation,
        payments=(),
        instances=tuple(i for r in reports for i in r.simulation.instances),
    )
    simulation.write_ground_truth(ground_truth)
    return SimulatorReport(
        topic=first.topic,
        planned=sum(r.planned for r in reports),
        simulation=simulation,
        ground_truth_path=str(ground_truth),
        sent=sum(r.sent for r in reports),
        placements={k: v for r in reports for k, v in r.placements.items()},
        stopped_early=any(r.stopped_early for r in reports),
    )


# ---- the figures, from what the run recorded


def quantiles(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | int]:
    """p50/p95/p99/max and the count, `values` (seconds) times `scale` (ms by default)."""
    ordered = sorted(v * scale for v in values)
    out: dict[str, float | int] = {
        f"p{q}": round(percentile(ordered, q), 1) if ordered else float("nan") for q in (50, 95, 99)
    }
    out["max"] = round(ordered[-1], 1) if ordered else float("nan")
    out["n"] = len(ordered)
    return out


def by_worker(
    decided: Mapping[Any, Mapping[str, Any]], since: Mapping[Any, float | None]
) -> dict[str, dict[str, float | int]]:
    """Per worker that decided any of `decided`, the quantiles of its decisions' time after `since` (a
    payment with no such instant is left out)."""
    return {
        worker: quantiles(
            [
                decided_at(d) - at
                for pid, d in decided.items()
                if d.get("worker") == worker and (at := since.get(pid)) is not None
            ]
        )
        for worker in sorted({str(d.get("worker")) for d in decided.values()})
    }


def first_decisions(records: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Each payment's earliest decision record."""
    first: dict[str, Mapping[str, Any]] = {}
    for d in records:
        pid = d.get("payment_id")
        if isinstance(pid, str) and (pid not in first or decided_at(d) < decided_at(first[pid])):
            first[pid] = d
    return first


def backlog(
    sent: Sequence[float], done: Sequence[float], start: float, end: float
) -> list[tuple[float, int]]:
    """(t, payments sent by t and not yet decided by t) every BACKLOG_EVERY_S from `start` to `end`;
    both lists sorted."""
    points = []
    t = start
    while t <= end:
        points.append((t, bisect.bisect_right(sent, t) - bisect.bisect_right(done, t)))
        t += BACKLOG_EVERY_S
    return points


def mean_over(points: Sequence[tuple[float, int]], start: float, end: float) -> float:
    values = [n for t, n in points if start <= t <= end]
    return statistics.fmean(values) if values else float("nan")


def batch_lines(text: str) -> list[dict[str, Any]]:
    """The pipeline's per-batch lines (its log's `text`): when each ended, its service, records, phases
    (seconds) and what the service's group had committed after it (partition -> next offset)."""
    out = []
    for line in text.splitlines():
        if match := BATCH_LINE.match(line):
            phases = match[7].split()
            out.append(
                {
                    "at": datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp(),
                    "service": match[2],
                    "records": int(match[4]),
                    "seconds": float(match[6]),
                    "phases": {k: float(v) for k, v in zip(phases[::2], phases[1::2], strict=False)},
                    "committed": {int(p): int(o) for p, o in COMMITTED.findall(match[8] or "")},
                }
            )
    return out


def pipeline_commits(lines: Sequence[Mapping[str, Any]], group_of: Mapping[str, str]) -> CommitTimeline:
    """When each dependency group's commits were made, as the pipeline logged them: a batch's line is
    written once its commit returned, with the commit's duration, so the commit call's start is dated
    to the log's millisecond. A gated consumer cannot see a commit before the call that makes it, so
    the gate's share measured from these instants is overstated by at most the call's duration."""
    timeline = CommitTimeline()
    for line in lines:
        at = line["at"] - line["phases"].get("commit", 0.0)
        for partition, offset in line["committed"].items():
            timeline.record(group_of.get(line["service"], line["service"]), partition, offset, at)
    return timeline


def event_time_covered(
    valid: Mapping[tuple[int, int], Sent],
    sent_at: Mapping[str, float],
    timeline: CommitTimeline,
    groups: Iterable[str],
) -> Callable[[int, int], float | None]:
    """The floor of the event-time gate (`aml_app.gate.event_time`, no allowed lateness): for payment
    (p, o) with event time t, the instant both groups' commits covered every valid payment of every
    partition that was sent no later than it (in its burst or before) and is timestamped at or before
    t; None while one is not covered.

    The per-partition floor (`CommitTimeline.opened_at`) covers the payment alone. The event-time gate
    also waits for the payments of other partitions up to its time that reached the log before it,
    which a micro-batch that ended before they reached the broker leaves to the next one: that wait is
    the guarantee's, and measured from this floor the gate's share is its own mechanics (refresh,
    changelog, evidence). A payment sent later with an earlier time (each step of a run starts its
    event time again) is late: the gate does not wait for it, nor does this floor."""
    groups = tuple(groups)
    by_partition: dict[int, list[tuple[int, float, int]]] = {}
    for (p, o), sent in valid.items():
        by_partition.setdefault(p, []).append((o, sent_at[sent.payment_id], micros(sent.ts)))
    # Per partition in offset order (the order it was sent in): send times, and runs of offsets whose
    # event times do not go back, each with its times, for a bisection.
    sends: dict[int, list[float]] = {}
    offsets: dict[int, list[int]] = {}
    runs: dict[int, list[tuple[int, list[int]]]] = {}  # (index of the run's first payment, its times)
    for p, rows in by_partition.items():
        rows.sort()
        offsets[p] = [o for o, _, _ in rows]
        sends[p] = list(itertools.accumulate((at for _, at, _ in rows), max))
        mine: list[tuple[int, list[int]]] = []
        for i, (_, _, t) in enumerate(rows):
            if not mine or t < mine[-1][1][-1]:
                mine.append((i, []))
            mine[-1][1].append(t)
        runs[p] = mine

    def last_at_or_before(p: int, sent: float, t: int) -> int | None:
        """The highest offset of partition p sent by `sent` and timestamped at or before t."""
        end = bisect.bisect_right(sends[p], sent)  # payments [0, end) were sent by then
        for first, times in reversed(runs[p]):
            if first >= end:
                continue
            i = bisect.bisect_right(times, t, 0, min(len(times), end - first))
            if i:
                return offsets[p][first + i - 1]
        return None

    def covered(partition: int, offset: int) -> float | None:
        sent = valid[(partition, offset)]
        t, at = micros(sent.ts), sent_at[sent.payment_id]
        instants = [timeline.opened_at(groups, partition, offset)]
        for p in offsets:
            if (o := last_at_or_before(p, at, t)) is not None:
                instants.append(timeline.opened_at(groups, p, o))
        return None if any(c is None for c in instants) else max(c for c in instants if c is not None)

    return covered


def pipeline_stages(lines: Sequence[Mapping[str, Any]], start: float, end: float) -> dict[str, Any]:
    """Per service, the micro-batches that ended within [start, end]."""
    out: dict[str, Any] = {}
    for service in sorted({line["service"] for line in lines}):
        mine = [line for line in lines if line["service"] == service and start <= line["at"] <= end]
        if not mine:
            continue
        ends = [line["at"] for line in mine]
        gaps = [b - a for a, b in itertools.pairwise(ends)]
        phases = sorted({k for line in mine for k in line["phases"]})
        out[service] = {
            "batches": len(mine),
            "records_per_batch": round(statistics.fmean(line["records"] for line in mine), 1),
            "batch_ms": quantiles([line["seconds"] for line in mine]),
            "batch_mean_ms": round(1000 * statistics.fmean(line["seconds"] for line in mine), 1),
            "phase_mean_ms": {
                k: round(1000 * statistics.fmean(line["phases"].get(k, 0.0) for line in mine), 1)
                for k in phases
            },
            "between_batches_mean_ms": round(1000 * statistics.fmean(gaps), 1) if gaps else None,
        }
    return out


def worker_stages(
    samples: Mapping[str, Sample], services: Mapping[str, str], seconds: float
) -> dict[str, dict[str, Any]]:
    """Per service, over the measured part: the leaders' refreshes, the gate's hold and the handler's
    split, summed over its workers (differences of the two samples)."""
    start, end = samples["start"], samples["end"]
    out: dict[str, dict[str, Any]] = {}
    for worker, service in services.items():
        entry = out.setdefault(
            service,
            {"refreshes": 0.0, "refresh_s": 0.0, "held": 0.0, "held_s": 0.0, "decisions": 0, "requests": 0}
            | {"http_s": 0.0, "steps_s": {}, "refresh_phase_s": {}},
        )
        m0, m1 = start.metrics.get(worker) or {}, end.metrics.get(worker) or {}

        def diff(key: str, a: Mapping[str, float] = m0, b: Mapping[str, float] = m1) -> float:
            return b.get(key, 0.0) - a.get(key, 0.0)

        entry["refreshes"] += diff("aml_admin_refresh_seconds_count")
        entry["refresh_s"] += diff("aml_admin_refresh_seconds_sum")
        entry["held"] += diff("aml_gate_wait_seconds_count")
        entry["held_s"] += diff("aml_gate_wait_seconds_sum")
        p0 = ((start.states.get(worker) or {}).get("refresh") or {}).get("phase_s") or {}
        p1 = ((end.states.get(worker) or {}).get("refresh") or {}).get("phase_s") or {}
        for k, v in p1.items():
            phases = entry["refresh_phase_s"]
            phases[k] = phases.get(k, 0.0) + v - p0.get(k, 0.0)
        d0 = (start.states.get(worker) or {}).get("detector") or {}
        d1 = (end.states.get(worker) or {}).get("detector") or {}
        entry["decisions"] += d1.get("decisions", 0) - d0.get("decisions", 0)
        for k, v in (d1.get("seconds") or {}).items():
            entry["steps_s"][k] = entry["steps_s"].get(k, 0.0) + v - (d0.get("seconds") or {}).get(k, 0.0)
        h0, h1 = d0.get("http") or {}, d1.get("http") or {}
        requests = (h1.get("requests") or 0) - (h0.get("requests") or 0)
        entry["requests"] += requests
        entry["http_s"] += ((h1.get("mean_ms") or 0) * (h1.get("requests") or 0)) / 1000 - (
            (h0.get("mean_ms") or 0) * (h0.get("requests") or 0)
        ) / 1000
    for entry in out.values():
        decisions, batches = max(entry["decisions"], 1), max(entry["requests"] / 2, 1)
        entry["refreshes_per_s"] = round(entry["refreshes"] / seconds, 2)
        entry["refresh_mean_ms"] = (
            round(1000 * entry["refresh_s"] / entry["refreshes"], 1) if entry["refreshes"] else None
        )
        entry["refresh_phase_mean_ms"] = {
            k: round(1000 * v / entry["refreshes"], 1) if entry["refreshes"] else None
            for k, v in entry["refresh_phase_s"].items()
        }
        entry["held_mean_ms"] = round(1000 * entry["held_s"] / entry["held"], 1) if entry["held"] else None
        # A batch asks B and C once each: two requests per batch, retries aside.
        entry["batches"] = round(batches)
        entry["payments_per_batch"] = round(entry["decisions"] / batches, 1)
        entry["handler_ms_per_batch"] = {k: round(1000 * v / batches, 2) for k, v in entry["steps_s"].items()}
        entry["handler_us_per_payment"] = {
            k: round(1e6 * v / decisions, 1) for k, v in entry["steps_s"].items()
        }
        entry["http_mean_ms"] = (
            round(1000 * entry["http_s"] / entry["requests"], 1) if entry["requests"] else None
        )
    return out


def answer_caches(start: Sample, end: Sample) -> dict[str, Any]:
    """Per API kind, over the measured part: the questions its replicas answered from their answer
    caches (hits), with the answer another request was computing (joined) and from the store (misses),
    summed over the replicas."""
    out: dict[str, dict[str, Any]] = {}
    for name, c1 in end.caches.items():
        c0 = start.caches.get(name) or {}
        kind = api_kind(name)
        entry = out.setdefault(kind, {"hits": 0, "joined": 0, "misses": 0})
        for k in ("hits", "joined", "misses"):
            entry[k] += c1.get(k, 0) - c0.get(k, 0)
    for entry in out.values():
        asked = entry["hits"] + entry["joined"] + entry["misses"]
        entry["hit_share"] = round(entry["hits"] / asked, 3) if asked else None
        entry["not_computed_share"] = round((entry["hits"] + entry["joined"]) / asked, 3) if asked else None
    return out


def analyse(demo: CapacityDemo) -> list[dict[str, Any]]:
    """Every step's figures (see the module docstring)."""
    system, ledger, settings = demo.system, demo.ledger, demo.settings
    watch = system.watch
    assert watch is not None and system.pipeline is not None
    place = {sent.payment_id: (p, o) for (p, o), sent in ledger.valid.items()}
    groups = settings.depends_on
    firsts = {svc: first_decisions(tail.records) for svc, tail in system.decisions.items()}
    records = {svc: tail.records for svc, tail in system.decisions.items()}
    services = {w.worker_id: svc for svc, workers in system.workers.items() for w in workers}
    log_path = system.pipeline.log_path
    lines = batch_lines(log_path.read_text(errors="replace") if log_path.exists() else "")
    commits = pipeline_commits(lines, {svc: registry.service(svc).group(settings) for svc in registry.NAMES})
    cover_in_event_time = event_time_covered(ledger.valid, ledger.sent_at, commits, groups)
    lateness_us = round(settings.gate.allowed_lateness * 1_000_000)
    published = {
        svc: published_at(tail.rows, GATE_MODES[svc], lateness_us) for svc, tail in demo.gate_tables.items()
    }
    out = []
    for step in demo.steps:
        if step.first_sent is None or step.last_sent is None or set(step.samples) != {"start", "end"}:
            continue
        start, end = step.first_sent + step.warm_up, step.last_sent
        span = end - start
        ids = set(step.ids)
        measured = [pid for pid in step.ids if start <= ledger.sent_at[pid] <= end]
        committed = {pid: commits.opened_at(groups, *place[pid]) for pid in measured}
        watched = {pid: watch.timeline.opened_at(groups, *place[pid]) for pid in measured}
        in_event_time = {pid: cover_in_event_time(*place[pid]) for pid in measured}
        sent_sorted = sorted(ledger.sent_at[pid] for pid in step.ids)
        doc: dict[str, Any] = {
            "rate": step.rate,
            "measured_from_s": step.warm_up,
            "measured_s": round(span, 2),
            "sent": len(step.ids),
            "sent_measured": len(measured),
            "achieved_rate": round(len(measured) / span, 1) if span > 0 else None,
            "stopped_early": step.stopped_early,
            "caught_up_after_s": None if step.caught_up_after is None else round(step.caught_up_after, 2),
            "pipeline_commit_ms": quantiles(
                [c - ledger.sent_at[pid] for pid, c in committed.items() if c is not None]
            ),
            "never_committed": sum(1 for c in committed.values() if c is None),
            "services": {},
        }
        doc["producer_held"] = (
            doc["achieved_rate"] is not None and doc["achieved_rate"] >= HELD_RATE_SHARE * step.rate
        )
        for svc, first in firsts.items():
            mine = {pid: first[pid] for pid in measured if pid in first}
            done_sorted = sorted(decided_at(first[pid]) for pid in step.ids if pid in first)
            points = backlog(sent_sorted, done_sorted, start, end)
            at_start = mean_over(points, start, start + BACKLOG_EDGE_S)
            at_end = mean_over(points, end - BACKLOG_EDGE_S, end)
            step_records = [d for d in records[svc] if d.get("payment_id") in ids]
            early = premature(step_records, groups, watch.timeline)

            def share(
                covered: Mapping[str, float | None],
                mine: Mapping[str, Any] = mine,
                measured: Sequence[str] = measured,
            ) -> dict[str, Any]:
                """Decided minus the instant both groups' commits covered each payment (`covered`)."""
                return quantiles(
                    [
                        decided_at(mine[pid]) - c if pid in mine else NEVER
                        for pid in measured
                        if (c := covered[pid]) is not None
                    ]
                )

            # The share in two: until the leader published a row opening the gate on the payment (its
            # refresh), and from then to the decision (the changelog hop to a follower, the lane, the
            # evidence, the rules).
            opened = {
                pid: published[svc](*place[pid], micros(ledger.valid[place[pid]].ts), ledger.sent_at[pid])
                for pid in mine
                if svc in published
            }
            floor = in_event_time if GATE_MODES.get(svc) == "event-time" else committed
            split = {
                "gate_published_ms": quantiles(
                    [o - c for pid, o in opened.items() if o is not None and (c := floor[pid]) is not None]
                ),
                "gate_after_published_ms": quantiles(
                    [decided_at(mine[pid]) - o for pid, o in opened.items() if o is not None]
                ),
                "gate_after_published_by_worker_ms": by_worker(mine, opened),
                "never_published": sum(1 for o in opened.values() if o is None),
            }
            doc["services"][svc] = {
                # A payment never decided counts as infinitely late: the percentiles then say so.
                "latency_ms": quantiles(
                    [
                        decided_at(mine[pid]) - ledger.sent_at[pid] if pid in mine else NEVER
                        for pid in measured
                    ]
                ),
                "gate_share_ms": share(committed),
                # The event-time gate's share from its own floor, and how much later than the payment
                # alone that floor came (waiting for other partitions' payments up to its time).
                **(
                    {
                        "gate_share_event_time_ms": share(in_event_time),
                        "event_time_floor_after_own_ms": quantiles(
                            [
                                e - c
                                for pid in measured
                                if (e := in_event_time[pid]) is not None and (c := committed[pid]) is not None
                            ]
                        ),
                        # Payments of other partitions at or before its time that reached the broker
                        # after the gate read them let it decide before this floor: not waited for.
                        "decided_before_event_time_floor": sum(
                            1
                            for pid, d in mine.items()
                            if (e := in_event_time[pid]) is not None and decided_at(d) < e
                        ),
                    }
                    if GATE_MODES.get(svc) == "event-time"
                    else {}
                ),
                # The same against the demo's commit watch (polled, dated at the poll before the one that
                # saw a commit): the share as earlier runs of this benchmark measured it.
                "gate_share_watch_ms": share(watched),
                # Per worker: the leader sees its own refresh at once, the others through the changelog.
                "gate_share_by_worker_ms": by_worker(mine, committed),
                **(split if opened else {}),
                "undecided_measured": len(measured) - len(mine),
                "gate_hold_ms": quantiles([float(d.get("waited_ms", 0)) / 1000 for d in mine.values()]),
                "backlog_start": round(at_start, 1),
                "backlog_end": round(at_end, 1),
                "kept_up": at_end - at_start <= BACKLOG_GROWTH_S * step.rate,
                "backlog_every_s": [n for t, n in points][:: round(1 / BACKLOG_EVERY_S)],
                "missing": len(ids - set(first)),
                "decided_twice": len(step_records) - len({d["payment_id"] for d in step_records}),
                "premature": len({(p, o) for p, o, *_ in early}),
                "premature_by_pipeline_log": len(
                    {(p, o) for p, o, *_ in premature(step_records, groups, commits)}
                ),
                "freshness_violations": sum(int(d.get("stale_reads", 0)) for d in step_records),
            }
        s0, s1 = step.samples["start"], step.samples["end"]
        both = [
            pid
            for pid in ledger.ids()
            if all(pid in first for first in firsts.values())
            and s0.at <= max(decided_at(first[pid]) for first in firsts.values()) <= s1.at
        ]
        used = {k: s1.cpu[k] - s0.cpu.get(k, 0.0) for k in s1.cpu}
        system_s = sum(v for k, v in used.items() if k != OWN)
        used[JIT] = jit_used(s0, s1)  # a part of the JVM's, not added to the system's
        n_both = len(both) or float("nan")  # nothing decided by both: no cost per payment to give
        doc["cpu"] = {
            "seconds": round(s1.at - s0.at, 2),
            "decided_by_both": len(both),
            "decided_by_both_per_s": round(len(both) / (s1.at - s0.at), 1),
            "cpu_seconds": {k: round(v, 2) for k, v in used.items()},
            "us_per_payment": {k: round(v / n_both * 1e6, 1) for k, v in used.items()},
            "system_us_per_payment": round(system_s / n_both * 1e6, 1),
            "system_cores": round(system_s / (s1.at - s0.at), 2),
        }
        # How finely the commit watch dated the commits: a gate share is overstated by up to one interval.
        doc["commit_watch_poll_ms"] = round(1000 * (s1.at - s0.at) / max(s1.polls - s0.polls, 1), 1)
        doc["held"] = doc["producer_held"] and all(s["kept_up"] for s in doc["services"].values())
        doc["stages"] = {
            "pipeline": pipeline_stages(lines, start, end),
            "workers": worker_stages(step.samples, services, s1.at - s0.at),
            "answer_caches": answer_caches(s0, s1),
            "api_batch_ms": api_batch_ms(s0, s1),
        }
        if s0.statements is not None and s1.statements is not None:
            doc["stages"]["postgres"] = pg_statements.between(s0.statements, s1.statements, len(both))
        if s0.census is not None and s1.census is not None:
            diff = broker_census.difference(s0.census, s1.census)
            doc["broker_census"] = broker_census.rows(diff, s1.census_names, s1.at - s0.at, len(both))
        if step.profile:
            us = doc["cpu"]["us_per_payment"]
            doc["profile"] = {
                name: found
                | {
                    "us_per_payment": py_profile.per_payment(found, us.get(name)),
                    "files_us_per_payment": py_profile.per_payment(found, us.get(name), "files"),
                }
                for name, found in step.profile.items()
            }
        out.append(doc)
    return out


def capacity(steps: Sequence[Mapping[str, Any]], services: Sequence[str]) -> float | None:
    """The highest rate held whose p99 (of each of `services`) is within P99_BOUND_S."""
    good = [
        s["rate"]
        for s in steps
        if s["held"]
        and all(s["services"][svc]["latency_ms"]["p99"] <= P99_BOUND_S * 1000 for svc in services)
    ]
    return max(good) if good else None


def goals(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each goal of the issue with the figure that decides it (None: the run has no step for it)."""
    at = {s["rate"]: s for s in steps}
    services = sorted({svc for s in steps for svc in s["services"]})

    def p99s(rate: float, key: str = "latency_ms") -> dict[str, float] | None:
        step = at.get(rate)
        return None if step is None else {svc: step["services"][svc][key]["p99"] for svc in services}

    out: dict[str, Any] = {}
    for rate, bound, name in (
        (50.0, GOALS["p99_at_50_s"], "p99_at_50"),
        (1000.0, GOALS["p99_at_1000_s"], "p99_at_1000"),
    ):
        figures = p99s(rate)
        held = at[rate]["held"] if rate in at else None
        met = None if figures is None else held and all(v <= bound * 1000 for v in figures.values())
        out[name] = {"goal_ms": bound * 1000, "p99_ms": figures, "held": held, "met": met}
    highest = capacity(steps, ["aml"])
    out["highest_rate_aml_p99_2s"] = {
        "goal": GOALS["highest_rate_p99_2s"],
        "rate": highest,
        "rate_both_services": capacity(steps, services),
        "met": highest is not None and highest >= GOALS["highest_rate_p99_2s"],
    }
    for rate in (50.0, 1000.0):
        figures = p99s(rate, "gate_share_ms")
        step = at.get(rate)
        event_time = (
            None
            if step is None
            else {
                svc: v["gate_share_event_time_ms"]["p99"]
                for svc, v in step["services"].items()
                if "gate_share_event_time_ms" in v
            }
        )
        out[f"gate_share_p99_at_{rate:g}"] = {
            "goal_ms": GOALS["gate_share_p99_ms"],
            "p99_ms": figures,
            "met": None
            if figures is None
            else figures.get("aml", float("inf")) <= GOALS["gate_share_p99_ms"],
            # The goal is the event-time gate's (AML's); measured from that gate's own floor too.
            "p99_ms_event_time_floor": event_time,
            "met_from_event_time_floor": None
            if not event_time
            else event_time.get("aml", float("inf")) <= GOALS["gate_share_p99_ms"],
        }
    step = at.get(2000.0)
    figure = None if step is None else step["pipeline_commit_ms"]["p99"]
    out["pipeline_p99_at_2000"] = {
        "goal_ms": GOALS["pipeline_p99_at_2000_ms"],
        "p99_ms": figure,
        "met": None if figure is None else figure <= GOALS["pipeline_p99_at_2000_ms"],
    }
    held = [s for s in steps if s["held"]]
    top = max(held, key=lambda s: s["rate"]) if held else None
    cpu = None if top is None else top["cpu"]["system_us_per_payment"]
    out["cpu_at_highest_rate_held"] = {
        "goal_us": GOALS["cpu_us_per_payment"],
        "rate": None if top is None else top["rate"],
        "us_per_payment": cpu,
        "met": None if cpu is None else cpu <= GOALS["cpu_us_per_payment"],
    }
    return out


async def census_broker(log_path: Path, proxy_port: int) -> tuple[EmbeddedBroker, broker_census.Census]:
    """An embedded broker that names `proxy_port` in its metadata, and the census listening there in
    front of it. A census that cannot listen stops the broker again: no system owns it yet."""
    broker = EmbeddedBroker(free_port(), log_path=log_path, advertised_port=proxy_port)
    await asyncio.to_thread(broker.start)
    census = broker_census.Census(proxy_port, (broker.host, broker.port))
    try:
        await census.start()
    except BaseException:
        await asyncio.to_thread(broker.stop)
        raise
    return broker, census


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    info = machine()
    settings = load_settings()
    folder = workfolder(NAME)
    options = Options(
        duration=args.step_seconds,
        rate=args.rates[0],
        aml_workers=args.aml_workers,
        fraud_workers=1,
        seed=args.seed,
        folder=folder,
        drain_deadline=args.drain_seconds,
    )
    demo = CapacityDemo(settings, options, args, worker_env={"AML_MODEL": "amlworld"})
    demo.system.layout = replace(demo.system.layout, api_replicas=args.api_replicas)
    if args.census:
        # The broker names the census's port in its metadata, so every client's connection passes it; the
        # system counts the broker as its own (its CPU, its stop), as it counts an embedded one.
        broker, demo.census = await census_broker(folder / "broker.log", free_port())
        demo.system.broker = broker
        demo.system.layout = replace(demo.system.layout, bootstrap=(f"{broker.host}:{demo.census.port}",))
    say(
        f"capacity: {', '.join(f'{r:g}' for r in args.rates)} payments/s, {args.step_seconds:g} s each "
        f"after a prelude of {args.prelude_seconds:g} s at {args.prelude_rate:g}/s; the demo's own header "
        "below names the first rate only"
    )
    try:
        verdict = await demo.run()
    finally:
        if demo.census is not None:
            await demo.census.stop()
    if verdict is None or not demo.steps:
        raise RuntimeError("the run did not complete")
    steps = analyse(demo)
    watch = demo.system.watch
    assert watch is not None
    return {
        "benchmark": NAME,
        "machine": info,
        "params": vars(args) | {"folder": str(folder)},
        "layout": {
            "aml_workers": args.aml_workers,
            "fraud_workers": 1,
            "api_replicas": demo.system.layout.api_replicas,
            "aml_model": "amlworld",
            "gate_modes": GATE_MODES,
            "partitions": demo.settings.kafka.partitions,
            "trigger_interval_s": demo.settings.pipeline.trigger_interval,
        },
        "definitions": {
            "produced": "the simulator's send time (start of the payment's burst)",
            "decided": "the first decision record's decided_at",
            "gate_share": "decided_at - when both dependency groups' commits covered the payment",
            "held": f"producer >= {HELD_RATE_SHARE} x rate and every service's backlog, averaged over "
            f"the last {BACKLOG_EDGE_S:g} s, at most {BACKLOG_GROWTH_S:g} s of traffic above its average "
            f"over the first {BACKLOG_EDGE_S:g} s after the warm-up",
            "cpu": "CPU of every process of the system over the measured part / payments both services "
            "decided in it",
        },
        "commit_watch_polls": watch.polls,
        "steps": steps,
        "goals": goals(steps),
        "checks": {
            svc: {
                "premature": v.premature_decisions,
                "freshness_violations": v.freshness_violations,
                "missing": v.missing,
                "alerted_twice": v.duplicate_alerts,
            }
            for svc, v in verdict.services.items()
        }
        | {"ok": verdict.ok},
        "detection": {t: {"recall": s.recall, "precision": s.precision} for t, s in verdict.scores.items()},
    }


def report(doc: dict[str, Any]) -> str:
    steps = doc["steps"]
    rows = []
    for s in steps:
        aml, fraud = s["services"].get("aml", {}), s["services"].get("fraud", {})

        def lat(v: Mapping[str, Any]) -> str:
            q = v.get("latency_ms", {})
            return f"{q.get('p50')} / {q.get('p95')} / {q.get('p99')} / {q.get('max')}"

        rows.append(
            (
                f"{s['rate']:g}",
                f"{s['achieved_rate']}",
                lat(aml),
                lat(fraud),
                f"{aml['gate_share_ms']['p50']} / {aml['gate_share_ms']['p99']}",
                f"{fraud['gate_share_ms']['p50']} / {fraud['gate_share_ms']['p99']}",
                f"{s['pipeline_commit_ms']['p50']} / {s['pipeline_commit_ms']['p99']}",
                s["cpu"]["decided_by_both_per_s"],
                s["cpu"]["system_us_per_payment"],
                f"{'yes' if s['held'] else 'NO'} (backlog AML {aml['backlog_start']:g} → "
                f"{aml['backlog_end']:g}, fraud {fraud['backlog_start']:g} → {fraud['backlog_end']:g})",
                " ".join(
                    f"{svc}: {v['missing']} missing, {v['premature']} premature"
                    for svc, v in s["services"].items()
                ),
            )
        )
    main = markdown_table(
        [
            "rate /s",
            "sent /s",
            "AML p50 / p95 / p99 / max (ms)",
            "fraud p50 / p95 / p99 / max (ms)",
            "AML gate share p50 / p99 (ms)",
            "fraud gate share p50 / p99 (ms)",
            "produced → both committed p50 / p99 (ms)",
            "decided by both /s",
            "CPU µs per payment",
            "held",
            "checks",
        ],
        rows,
    )
    names = sorted({k for s in steps for k in s["cpu"]["us_per_payment"]})
    cpu = markdown_table(
        ["process (tree)", *(f"{s['rate']:g}/s" for s in steps)],
        [(k, *(s["cpu"]["us_per_payment"].get(k, "") for s in steps)) for k in names]
        + [("system (all but this process)", *(s["cpu"]["system_us_per_payment"] for s in steps))]
        + [("system cores busy", *(s["cpu"]["system_cores"] for s in steps))],
    )
    parts = [
        main,
        "CPU µs per payment decided by both detectors, over each step's measured part:",
        cpu,
        stages_report(steps, doc["params"].get("stages_rate")),
        *(
            f"the broker's requests at {s['rate']:g}/s (`--census`):\n"
            + broker_census.table(s["broker_census"])
            for s in steps
            if "broker_census" in s
        ),
        "goals (met: None when the run has no step for it):\n"
        + "\n".join(f"- {k}: {json.dumps(v)}" for k, v in doc["goals"].items()),
        f"checks over the whole run: {doc['checks']}",
        "gate share p50 / p99 against the commit watch instead of the pipeline's log (ms): "
        + ", ".join(
            f"{s['rate']:g}/s "
            + " ".join(
                f"{svc} {v['gate_share_watch_ms']['p50']} / {v['gate_share_watch_ms']['p99']}"
                for svc, v in s["services"].items()
            )
            for s in steps
        ),
        "AML's gate share p50 / p99 from the event-time gate's own floor (every partition's payments up to "
        "its time committed), that floor after the payment's own commit p50 / p99, decided before it (ms): "
        + ", ".join(
            f"{s['rate']:g}/s "
            + " ".join(
                f"{svc} {v['gate_share_event_time_ms']['p50']} / {v['gate_share_event_time_ms']['p99']}, "
                f"{v['event_time_floor_after_own_ms']['p50']} / {v['event_time_floor_after_own_ms']['p99']}, "
                f"{v['decided_before_event_time_floor']}"
                for svc, v in s["services"].items()
                if "gate_share_event_time_ms" in v
            )
            for s in steps
        ),
        "gate share p50 / p99 per worker (ms): "
        + ", ".join(
            f"{s['rate']:g}/s "
            + " ".join(
                f"{worker} {q['p50']} / {q['p99']}"
                for v in s["services"].values()
                for worker, q in v["gate_share_by_worker_ms"].items()
            )
            for s in steps
        ),
        "gate share split, p50 / p99 (ms): covered -> the leader published a row opening the gate; "
        "then -> decided, per worker: "
        + ", ".join(
            f"{s['rate']:g}/s "
            + " ".join(
                f"{svc} {v['gate_published_ms']['p50']} / {v['gate_published_ms']['p99']}; "
                + " ".join(
                    f"{worker} {q['p50']} / {q['p99']}"
                    for worker, q in v["gate_after_published_by_worker_ms"].items()
                )
                for svc, v in s["services"].items()
                if "gate_published_ms" in v
            )
            for s in steps
        ),
        "commit watch, mean poll interval per step (ms): "
        + ", ".join(f"{s['rate']:g}/s {s['commit_watch_poll_ms']}" for s in steps),
        "premature against the pipeline's logged commits: "
        + ", ".join(
            f"{s['rate']:g}/s "
            + " ".join(f"{svc} {v['premature_by_pipeline_log']}" for svc, v in s["services"].items())
            for s in steps
        ),
        f"load average at start {doc['machine']['loadavg_at_start']}, "
        f"at end {doc['machine'].get('loadavg_at_end')}",
        *(profile_report(s) for s in steps if s.get("profile")),
    ]
    return "\n\n".join(parts)


def profile_report(step: Mapping[str, Any], shown: int = 12) -> str:
    """Each Python process's costliest functions at one rate (`--profile`): µs of CPU a payment,
    inclusive of what they call, with the process's busy samples."""
    rows = []
    for name, found in step["profile"].items():
        if "error" in found:
            rows.append((name, f"not sampled: {found['error']}", ""))
            continue
        rows.append((name, f"{found['busy']} busy samples, {found['idle']} idle", ""))
        top = list(found["us_per_payment"].items())[:shown]
        rows.extend(("", function, us) for function, us in top)
        files = list(found.get("files_us_per_payment", {}).items())[: shown // 2]
        rows.extend(("", f"file {file}", us) for file, us in files)
    return f"py-spy at {step['rate']:g}/s, µs of CPU a payment by function (inclusive):\n\n" + markdown_table(
        ["process", "function", "µs a payment"], rows
    )


def representative(steps: Sequence[Mapping[str, Any]], wanted: float | None) -> Mapping[str, Any] | None:
    """The step of `wanted`, else the highest held one, else the first."""
    chosen = (
        [s for s in steps if s["rate"] == wanted] or [s for s in steps if s["held"]][-1:] or list(steps[:1])
    )
    return chosen[0] if chosen else None


def stages_report(steps: Sequence[Mapping[str, Any]], wanted: float | None) -> str:
    step = representative(steps, wanted)
    if step is None:
        return ""
    rows: list[tuple[Any, ...]] = []
    for service, p in sorted(step["stages"]["pipeline"].items(), reverse=True):  # relations first
        phases = ", ".join(f"{k} {v}" for k, v in p["phase_mean_ms"].items())
        every = p["between_batches_mean_ms"]
        rows.append(
            (
                f"pipeline batch ({service})",
                f"{p['batches']} batches of {p['records_per_batch']} records"
                + (f", one every {every} ms" if every is not None else "")
                + f"; p50 {p['batch_ms']['p50']}, "
                f"p99 {p['batch_ms']['p99']} ms; mean {p['batch_mean_ms']} ms = {phases}",
            )
        )
    rows.append(
        (
            "produced → both committed",
            f"p50 {step['pipeline_commit_ms']['p50']}, p99 {step['pipeline_commit_ms']['p99']} ms",
        )
    )
    for service, w in step["stages"]["workers"].items():
        share = step["services"][service]["gate_share_ms"]
        hold = step["services"][service]["gate_hold_ms"]
        rows.append(
            (
                f"{service}: gate refresh (leader)",
                f"{w['refreshes_per_s']} refreshes/s, mean {w['refresh_mean_ms']} ms: "
                + ", ".join(f"{k} {v}" for k, v in w.get("refresh_phase_mean_ms", {}).items()),
            )
        )
        rows.append((f"{service}: both committed → decided", f"p50 {share['p50']}, p99 {share['p99']} ms"))
        rows.append((f"{service}: held at the gate (waited_ms)", f"p50 {hold['p50']}, p99 {hold['p99']} ms"))
        names = HANDLER_STEPS | ({"rules": "rules and model"} if service == "aml" else {})
        steps_ms = ", ".join(f"{names.get(k, k)} {v}" for k, v in w["handler_ms_per_batch"].items())
        rows.append(
            (
                f"{service}: handler per batch",
                f"{w['batches']} batches of {w['payments_per_batch']} payments: {steps_ms} ms "
                f"(HTTP to B and C mean {w['http_mean_ms']} ms)",
            )
        )
    for kind, ms in sorted(step["stages"].get("api_batch_ms", {}).items(), reverse=True):
        rows.append((f"{kind} API: a batch request answered", f"mean {ms} ms (the replicas' own histogram)"))
    for kind, cache in sorted(step["stages"].get("answer_caches", {}).items(), reverse=True):
        rows.append(
            (
                f"{kind} API: answer cache",
                f"{cache['hits']} questions kept, {cache.get('joined', 0)} joined, {cache['misses']} read "
                f"from the store (share not computed {cache.get('not_computed_share')})",
            )
        )
    for kind, spent in step["stages"].get("postgres", {}).items():
        rows.append(
            (
                f"PostgreSQL: {kind}",
                f"{spent['share']:.1%} of its statements' time, {spent['ms_per_payment']} ms per payment "
                f"decided by both ({spent['calls']} calls, {spent['ms_per_call']} ms each)",
            )
        )
    return f"where the time goes at {step['rate']:g}/s:\n\n" + markdown_table(["stage", "figure"], rows)


def rates(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("--rates takes positive payments/s, comma-separated")
    return values


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates", type=rates, default=list(DEFAULT_RATES), help="payments/s, comma-separated"
    )
    parser.add_argument("--step-seconds", type=float, default=60.0, help="seconds of sending per rate")
    parser.add_argument(
        "--warm-up", type=float, default=None, help="seconds of each step left out (default: a quarter)"
    )
    parser.add_argument("--aml-workers", type=int, default=2)
    parser.add_argument(
        "--api-replicas", type=int, default=Layout.api_replicas, help="replicas of each of B's and C's APIs"
    )
    parser.add_argument("--prelude-rate", type=float, default=500.0, help="payments/s before the steps")
    parser.add_argument(
        "--prelude-seconds", type=float, default=30.0, help="seconds of sending before the steps (0: none)"
    )
    parser.add_argument(
        "--drain-seconds", type=float, default=120.0, help="catching up after a step, at most"
    )
    parser.add_argument("--stages-rate", type=float, default=1000.0, help="the rate whose stages are printed")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument(
        "--profile",
        type=float,
        default=0.0,
        help="seconds of py-spy samples of every Python process in each step's measured part (0: none)",
    )
    parser.add_argument(
        "--census",
        action="store_true",
        help="count the broker's requests by process and API through a proxy (bench.broker_census); "
        "the results go to capacity_census.json",
    )
    args = parser.parse_args()
    if args.warm_up is None:
        args.warm_up = args.step_seconds / 4
    if args.api_replicas < 1:
        parser.error("--api-replicas must be at least 1")
    if args.warm_up + 5 >= args.step_seconds:
        parser.error("--step-seconds must exceed --warm-up by more than 5 s")
    if args.profile > 0 and py_profile.available() is None:
        parser.error("--profile needs py-spy (pip install py-spy; the dev extra has it)")
    try:
        doc = asyncio.run(measure(args))
    except SystemFailure as exc:
        say(f"capacity failed: {exc}")
        raise SystemExit(1) from None
    if args.census:
        finish(f"{NAME}_census", doc, report)
        return
    finish(NAME, doc, report)
    from bench.plot import plot_capacity  # matplotlib only once there are figures

    print(f"plot: {plot_capacity(doc)}")


if __name__ == "__main__":
    cli()
