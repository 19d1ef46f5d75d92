"""Shared set-up for the benchmarks: one private broker, fresh names per run, worker processes.

Everything runs on a broker of our own on a free port, so a benchmark neither disturbs nor is
disturbed by topics of other people's test runs (the CPU is shared all the same: expect noise).
Workers are started through `tests.harness.Worker`, exactly as the integration tests start them; the
premature-decision check and `percentile` come from `aml_app.harness.verify`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from aml_app.harness.tails import from_the_start
from aml_app.kafka.broker import EmbeddedBroker, create_topics, free_port, wait_until_answering
from aml_app.kafka.tools import GroupCommitter
from tests.harness import Names, Worker, wait_until

if TYPE_CHECKING:
    from aml_app.harness.demo import Demo

RESULTS = Path(__file__).resolve().parent / "results"
PROJECT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class BenchEnv:
    """A private broker, one producer, and every worker started through it (stopped at the end)."""

    broker: EmbeddedBroker
    workdir: Path
    producer: AIOKafkaProducer
    workers: list[Worker] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap

    async def fresh_names(self, partitions: int) -> Names:
        """New payments/decisions/DLQ topics and group names, so runs never see each other."""
        names = Names(partitions=partitions)
        await create_topics(
            [self.bootstrap],
            [names.payments, names.decisions, names.alerts, names.dlq, names.review],
            partitions,
        )
        return names

    def start_worker(self, names: Names, **env: str) -> Worker:
        worker = Worker(self.bootstrap, names, self.workdir, **env).start()
        self.workers.append(worker)
        return worker

    async def stop_workers(self, workers: Sequence[Worker] | None = None) -> None:
        """SIGTERM (then SIGKILL) the given workers, or all of ours; in parallel, with a deadline."""
        chosen = list(self.workers if workers is None else workers)
        await asyncio.gather(*(asyncio.to_thread(w.stop, 20) for w in chosen))
        self.workers = [w for w in self.workers if w not in chosen]

    async def commit(self, names: Names, offsets: Mapping[int, int]) -> None:
        """Play every dependency group once: commit `offsets` for each, then let go."""
        for group in names.deps:
            committer = await GroupCommitter([self.bootstrap], group, names.payments).start(
                range(names.partitions)
            )
            try:
                await committer.commit(offsets)
            finally:
                await committer.stop()


@contextlib.asynccontextmanager
async def bench_env(keep: bool = False) -> AsyncIterator[BenchEnv]:
    """Start the broker and a producer; always stop the workers, the producer and the broker."""
    workdir = Path(tempfile.mkdtemp(prefix="aml-bench-"))
    broker = EmbeddedBroker(free_port(), log_path=workdir / "broker.log").start()
    producer: AIOKafkaProducer | None = None
    env: BenchEnv | None = None
    ok = False
    try:
        await wait_until_answering([broker.bootstrap])
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, max_request_size=4_000_000)
        await producer.start()
        env = BenchEnv(broker, workdir, producer)
        yield env
        ok = True
    finally:
        if env is not None:
            await env.stop_workers()
        if producer is not None:
            await producer.stop()
        broker.stop()
        if ok and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"worker and broker logs kept in {workdir}", file=sys.stderr)


async def states(workers: Sequence[Worker]) -> list[dict[str, Any] | None]:
    return list(await asyncio.gather(*(w.state() for w in workers)))


async def wait_owned(
    workers: Sequence[Worker], partitions: int, timeout: float = 90, settle: float = 3.0
) -> list[dict[str, Any]]:
    """Until the workers are recovered, see every watermark row, own all partitions disjointly,
    and the assignment has not changed for `settle` seconds (a late rebalance would skew a run)."""
    wanted = list(range(partitions))
    stable_since: float | None = None
    last: list[list[int]] | None = None

    async def ready() -> list[dict[str, Any]] | None:
        nonlocal stable_since, last
        now = await states(workers)
        good = all(s and not s["recovering"] and s["watermarks"] for s in now)
        owned = [sorted(s["assigned"]) for s in now if s] if good else None
        if not owned or sorted(p for ps in owned for p in ps) != wanted:
            stable_since, last = None, None
            return None
        if owned != last or stable_since is None:
            stable_since, last = time.monotonic(), owned
        return [s for s in now if s] if time.monotonic() - stable_since >= settle else None

    return await wait_until(ready, timeout, f"{len(workers)} workers to own {partitions} partitions")


async def admin_requests(workers: Sequence[Worker]) -> dict[str, Any]:
    """The admin-request and refresh counters summed over the workers, and who leads now."""
    now = await states(workers)
    if any(s is None for s in now):
        raise AssertionError("a worker did not answer /watermarks.json")
    return {
        "at": time.monotonic(),
        "admin_requests": sum(s["refresh"]["admin_requests"] for s in now if s),
        "derived_requests": sum(s["refresh"].get("derived_requests", 0) for s in now if s),
        "derived_records_read": sum(s["refresh"].get("derived_records_read", 0) for s in now if s),
        "refreshes": sum(s["refresh"]["refreshes"] for s in now if s),
        "leaders": [s["worker"] for s in now if s and s["is_leader"]],
        "rebalances": {s["worker"]: s["rebalances"] for s in now if s},
    }


class DecisionCounter:
    """Counts decisions by the topic's high watermarks, as fetch responses report them: cheap enough to
    poll while a worker runs. (ListOffsets would do on Apache Kafka, but Tansu answers it with the last
    record batch's base offset + 1, which undercounts once the worker's sends are batched.)"""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self.tps = [TopicPartition(topic, p) for p in range(partitions)]
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50
        )

    async def __aenter__(self) -> DecisionCounter:
        await self.consumer.start()
        self.consumer.assign(self.tps)
        await self.consumer.seek_to_end(*self.tps)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()

    async def count(self) -> int:
        await self.consumer.getmany(timeout_ms=100)
        return sum(self.consumer.highwater(tp) or 0 for tp in self.tps)


async def read_decisions(
    bootstrap: str, topic: str, partitions: int, expected: int, timeout: float = 60
) -> list[dict[str, Any]]:
    """Read the decisions topic from the beginning until `expected` records are in (or fail)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=8_000_000,
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        from_the_start(consumer, tps)
        out: list[dict[str, Any]] = []

        async def enough() -> bool:
            batch = await consumer.getmany(timeout_ms=200, max_records=10_000)
            out.extend(json.loads(r.value) for records in batch.values() for r in records)
            return len(out) >= expected

        await wait_until(enough, timeout, f"{expected} decisions on {topic}", interval=0)
        return out
    finally:
        await consumer.stop()


def stat_cpu(stat: str) -> float:
    """User+system CPU seconds in the text of a /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(pid: int) -> float | None:
    """User+system CPU of a process (not its children), or None when it is gone."""
    try:
        return stat_cpu(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each live thread of process `pid` by thread id: its name and user+system CPU seconds so far (none
    for a process that has ended)."""
    found: dict[int, tuple[str, float]] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found  # the process ended
    for task in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
        except OSError:
            continue  # the thread ended
        found[int(task)] = (stat[stat.index("(") + 1 : stat.rindex(")")], stat_cpu(stat))
    return found


def proc_table() -> tuple[dict[int, int], dict[int, list[str]]]:
    """Every live process: its parent, and the fields of its /proc/<pid>/stat after the name."""
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)] = int(fields[1])
            stats[int(entry)] = fields
    return parents, stats


def descendants(pid: int, parents: Mapping[int, int]) -> set[int]:
    """`pid` and every live process below it."""
    family, frontier = {pid}, [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier and p not in family]
        family.update(frontier)
    return family


def tree_cpu(
    pid: int, children: bool = True, table: tuple[dict[int, int], dict[int, list[str]]] | None = None
) -> float:
    """CPU seconds (user + system) of a process and (unless told not to) every live descendant and every
    reaped one (the children's times a process collects when it waits for them). `table`: a
    `proc_table()` read once for several calls."""
    parents, stats = table or proc_table()
    family = descendants(pid, parents) if children else {pid}
    columns = (11, 12, 13, 14) if children else (11, 12)
    return sum(int(stats[member][i]) for member in family & set(stats) for i in columns) / CLK_TCK


#: The benchmark's own process in `processes`: it runs the simulator, the readers and the commit watch.
OWN = "this process alone (simulator, readers, commit watch)"


def processes(demo: Demo) -> dict[str, int]:
    """Every process of the demo's system by name (each counted with its descendants by `cpu_of`), and
    this one."""
    system = demo.system
    found = {}
    if system.broker is not None and system.broker.process is not None:
        found["broker (Tansu)"] = system.broker.process.pid
    if system.pipeline is not None and system.pipeline.process is not None:
        found["pipeline (Spark: driver, JVM, Python workers)"] = system.pipeline.process.pid
    if system.postgres is not None and (system.postgres.data / "postmaster.pid").exists():
        pid = int((system.postgres.data / "postmaster.pid").read_text().split()[0])
        found["PostgreSQL (server and backends)"] = pid
    for name, api in system.apis.items():
        if api.process is not None:
            found[f"{name} API"] = api.process.pid
    for worker in system.all_workers:
        if worker.process is not None:
            found[f"worker {worker.worker_id}"] = worker.process.pid
    found[OWN] = os.getpid()
    return found


def cpu_of(name: str, pid: int, table: tuple[dict[int, int], dict[int, list[str]]] | None = None) -> float:
    """CPU seconds of one of `processes`: the other processes are children of this one (PostgreSQL
    aside), so this one is counted without them."""
    return tree_cpu(pid, children=name != OWN, table=table)


def workfolder(name: str = "e2e") -> Path:
    """A fresh folder for a run's system (logs, stores), readable by others."""
    folder = Path(tempfile.mkdtemp(prefix=f"aml-bench-{name}-"))
    folder.chmod(0o755)  # a root run hands the PostgreSQL folder inside it to an unprivileged user
    return folder


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def code_version() -> str:
    """A digest of the service's source: the workers run whatever is on disk when they start, and
    the code may change between two benchmark runs (or during one)."""
    digest = hashlib.sha256()
    for package in ("aml_app", "agents", "tables"):
        for path in sorted((PROJECT / package).rglob("*.py")):
            digest.update(str(path.relative_to(PROJECT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def speed_probe(rounds: int = 5) -> dict[str, float]:
    """CPU milliseconds of one fixed piece of pure-Python work on each CPU this process may run on, the
    best of `rounds` each.

    Why: two virtual machines of one kind (two cores) ran one code's capacity sweep at 50/s on 25.1-27.7
    and on 33.4-35.0 ms of CPU a payment (`capacity_rate50_quiet_ee1ae67*.json`), and on one machine the
    same work took 40-45 ms on one of its virtual CPUs and 60-75 on the other at times; a figure of how fast
    each CPU second is tells a slower machine from a slower change. This thread's CPU time, not wall
    time, so work competing for the cores lengthens it little; the best round, so a preemption or a cold
    cache does not count."""
    cpus = sorted(os.sched_getaffinity(0))
    found = {}
    try:
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            best = float("inf")
            for _ in range(rounds):
                start = time.thread_time()
                total, table = 0, {}
                for i in range(300_000):
                    total += i * i % 7
                    table[i & 1023] = total
                best = min(best, time.thread_time() - start)
            found[str(cpu)] = round(best * 1000, 1)
    finally:
        os.sched_setaffinity(0, cpus)
    return found


def cpu_ticks(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """The machine's CPU time so far in clock ticks, all of it and what the hypervisor stole (Linux's
    `/proc/stat`); None where it cannot be read."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks), ticks[7]


def machine() -> dict[str, Any]:
    """What the figures were measured on: the load average hints at competing work, the speed probe at
    how fast the machine is (`speed_probe`), the stolen CPU at other tenants of its host."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "speed_probe_ms_at_start": speed_probe(),
        "cpu_ticks_at_start": cpu_ticks(),
        "code_at_start": code_version(),
    }


def steal_share(start: Sequence[int] | None, end: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time between two `cpu_ticks` readings that the hypervisor stole."""
    if not start or not end or end[0] <= start[0]:
        return None
    return round((end[1] - start[1]) / (end[0] - start[0]), 4)


def module_at(rev: str, path: str) -> Any:
    """The module of file `path` (of this repository) as it stands at git revision `rev`, for a benchmark
    that times a change beside what it replaces in one run."""
    root = Path(__file__).resolve().parent.parent
    text = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"{Path(path).stem}_at_{rev}")
    sys.modules[module.__name__] = module  # its dataclasses and annotations look themselves up there
    exec(compile(text, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def machine_at_end(info: dict[str, Any]) -> None:
    """Add to `machine()`'s record what the run ends with: the load, the speed probe, the share of the
    machine's CPU time stolen since the start, and the code."""
    info["loadavg_at_end"] = os.getloadavg()
    info["speed_probe_ms_at_end"] = speed_probe()
    info["cpu_stolen_share"] = steal_share(info.get("cpu_ticks_at_start"), cpu_ticks())
    info["code_at_end"] = code_version()
    if info.get("code_at_start") != info["code_at_end"]:
        print("warning: the service's code changed during the benchmark", file=sys.stderr)


def write_results(name: str, doc: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    machine_at_end(doc.setdefault("machine", {}))
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


def finish(name: str, doc: dict[str, Any], report: Callable[[dict[str, Any]], str]) -> None:
    """The end of every benchmark's command: write the results, print the report and where they are."""
    path = write_results(name, doc)
    print()
    print(report(doc))
    print(f"\nresults: {path}")


def gate_on_and_off(
    name: str,
    args: Any,
    run: Callable[[Any, bool], Coroutine[Any, Any, dict[str, Any]]],
    report: Callable[[dict[str, Any]], str],
) -> None:
    """Run a benchmark's `run(args, gate)` gate on, then gate off, and finish with both in one document."""
    doc: dict[str, Any] = {"benchmark": name, "machine": machine(), "params": vars(args), "runs": {}}
    for gate in (True, False):
        doc["runs"]["gate on" if gate else "gate off"] = asyncio.run(run(args, gate))
    finish(name, doc, report)
