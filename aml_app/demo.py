"""`aml-app demo`: the gated AML worker end to end, with simulated dependency groups.

The demo starts (or reuses) a broker, starts the AML workers as real `aml-app worker` processes,
plays the dependency services itself (one aiokafka consumer group each, committing after a simulated
delay), produces payments with a few malformed ones, and prints what happens every two seconds.
At the end it checks the one promise the gate makes: no payment is decided before every dependency
was told to commit past it (`aml_app.verify`, the check the integration tests make too). Later
issues replace the simulated groups with the real Spark services.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from aml_app.broker import (
    BrokerError,
    EmbeddedBroker,
    create_topics,
    free_port,
    port_open,
    wait_until_answering,
)
from aml_app.kafka_tools import payment_json
from aml_app.settings import Settings
from aml_app.verify import CommitTimeline, Premature, decided_at, percentile, premature
from aml_app.workers import WorkerProcess

DEMO_DIR = Path("var/demo")
ACCOUNTS = 200
MALFORMED_EVERY = 100  # one record in a hundred breaks the contract, so the DLQ shows up
PROGRESS_EVERY = 2.0
READY_DEADLINE = 90.0
DRAIN_DEADLINE = 30.0
WORKER_STOP_GRACE = 15.0
CLIENT_STOP_DEADLINE = 10.0
# Tansu holds a group join for about half the session timeout: keep it short so workers start fast.
WORKER_SESSION_TIMEOUT = "6"
FAST_COMMIT_EVERY = 0.2
SLOW_COMMIT_EVERY = 0.5
STALL_SECONDS = 5.0
STALL_PARTITION = 0
STALLING_GROUP = "aggregates"


class DemoError(RuntimeError):
    """Something the demo depends on failed; the message says what, the caller prints it."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived before the system was up."""


def say(line: str = "") -> None:
    print(line, flush=True)


def utc_now_z() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def fmt_ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.1f} ms"


async def sleep_unless(event: asyncio.Event, seconds: float) -> None:
    """Sleep, but wake at once when `event` is set (a stop request)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), max(seconds, 0))


async def partitions_of(consumer: AIOKafkaConsumer, topic: str, expected: int) -> list[int]:
    """The topic's partitions from the broker (an existing topic may have its own count)."""
    await consumer.topics()
    found = consumer.partitions_for_topic(topic)
    return sorted(found) if found else list(range(expected))


@dataclass
class Controls:
    """First Ctrl-C/SIGTERM stops producing and drains; a second one skips the drain."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)

    def on_signal(self) -> None:
        if self.stop.is_set():
            if not self.hurry.is_set():
                say("second stop request: skipping the drain, cleaning up")
            self.hurry.set()
        else:
            say("stop requested: finishing up (press Ctrl-C again to skip the drain)")
            self.stop.set()


class RunClock:
    """Seconds since payments started flowing; the stall is scheduled on it."""

    def __init__(self) -> None:
        self.started: float | None = None

    def start(self) -> None:
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started


# --------------------------------------------------------------------------- what was produced


@dataclass
class Ledger:
    """Every record this run produced and where it landed: the reference for the final check."""

    valid: dict[tuple[int, int], str] = field(default_factory=dict)
    sent_at: dict[str, float] = field(default_factory=dict)
    malformed: set[tuple[int, int]] = field(default_factory=set)
    ends: dict[int, int] = field(default_factory=dict)

    @property
    def produced(self) -> int:
        return len(self.valid) + len(self.malformed)

    def place(self, partition: int, offset: int, payment_id: str | None, sent_at: float) -> None:
        if payment_id is None:
            self.malformed.add((partition, offset))
        else:
            self.valid[(partition, offset)] = payment_id
            self.sent_at[payment_id] = sent_at
        self.ends[partition] = max(self.ends.get(partition, 0), offset + 1)


class PaymentSimulator:
    """Produces `rate` payments per second, keyed by payer; every 100th breaks the contract."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, rate: float, ledger: Ledger) -> None:
        self.producer = producer
        self.topic = topic
        self.rate = rate
        self.ledger = ledger
        self.run_tag = uuid.uuid4().hex[:6]  # payment ids stay unique on a shared cluster
        self.rng = random.Random()
        self.count = 0

    async def run(self, stop: asyncio.Event) -> None:
        started = time.monotonic()
        while not stop.is_set():
            due = int((time.monotonic() - started) * self.rate)
            if due > self.count:
                await self._send([self._record(n) for n in range(self.count, due)])
                self.count = due
            await sleep_unless(stop, 0.05)

    async def _send(self, records: list[tuple[bytes, bytes, str | None]]) -> None:
        sent_at = time.time()
        futures = [await self.producer.send(self.topic, key=k, value=v) for k, v, _ in records]
        for fut, (_, _, payment_id) in zip(futures, records, strict=True):
            meta = await fut
            self.ledger.place(meta.partition, meta.offset, payment_id, sent_at)

    def _record(self, n: int) -> tuple[bytes, bytes, str | None]:
        """(key, value, payment id or None when the record is deliberately malformed)."""
        payer, payee = self.rng.sample(range(ACCOUNTS), 2)
        cents = self.rng.randint(100, 2_500_000)
        fields = {
            "payment_id": f"pay-{self.run_tag}-{n:07d}",
            "payer": f"acct-{payer:04d}",
            "payee": f"acct-{payee:04d}",
            "amount": f"{cents // 100}.{cents % 100:02d}",
            "ts": utc_now_z(),
        }
        key = fields["payer"].encode()
        if n % MALFORMED_EVERY != MALFORMED_EVERY - 1:
            return key, payment_json(**fields), fields["payment_id"]
        return key, self._malformed(n // MALFORMED_EVERY, fields), None

    @staticmethod
    def _malformed(kind: int, fields: dict[str, str]) -> bytes:
        """Cycle through the three faults the dead-letter topic should show."""
        if kind % 3 == 0:
            return payment_json(**fields)[:-9]  # truncated: not JSON
        if kind % 3 == 1:
            return payment_json(**{**fields, "amount": "-" + fields["amount"]})
        doc = json.loads(payment_json(**fields))
        del doc["payee"]
        return json.dumps(doc).encode()


# --------------------------------------------------------------------------- the dependencies


@dataclass(frozen=True)
class Stall:
    """Once, `partition` gets no commit from `start` to `start + seconds` on the run clock.

    It plays a slow batch in one dependency: the gate must hold that partition only.
    """

    partition: int
    start: float
    seconds: float

    def holds(self, partition: int, elapsed: float) -> bool:
        return partition == self.partition and self.start <= elapsed < self.start + self.seconds

    def over(self, elapsed: float) -> bool:
        return elapsed >= self.start + self.seconds


class SimulatedDependency:
    """Plays one dependency service: reads payments, 'processes' them, commits what it finished.

    It owns every partition through manual assignment (the group id is for the commits only), so it
    starts at once instead of waiting for a consumer-group join.
    """

    def __init__(
        self,
        bootstrap: Sequence[str],
        topic: str,
        group: str,
        commit_every: float,
        commits: CommitTimeline,
        clock: RunClock,
        stall: Stall | None = None,
    ) -> None:
        self.topic = topic
        self.group = group
        self.commit_every = commit_every
        self.commits = commits
        self.clock = clock
        self.stall = stall
        self.read: dict[int, int] = {}
        self.stall_announced = False
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=list(bootstrap),
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )

    async def start(self, expected_partitions: int) -> SimulatedDependency:
        await self.consumer.start()
        partitions = await partitions_of(self.consumer, self.topic, expected_partitions)
        self.consumer.assign([TopicPartition(self.topic, p) for p in partitions])
        return self

    async def run(self) -> None:
        next_commit = time.monotonic() + self.commit_every
        while True:
            batch = await self.consumer.getmany(timeout_ms=50)
            for tp, records in batch.items():
                if records:
                    self.read[tp.partition] = records[-1].offset + 1
            if time.monotonic() >= next_commit:
                await self._commit(self.clock.elapsed())
                next_commit = time.monotonic() + self.commit_every

    async def _commit(self, elapsed: float) -> None:
        self._announce_stall(elapsed)
        done = self.commits.committed(self.group)
        offsets = {
            p: o
            for p, o in self.read.items()
            if o > done.get(p, 0) and not (self.stall and self.stall.holds(p, elapsed))
        }
        if not offsets:
            return
        initiated = time.time()
        try:
            tps = {TopicPartition(self.topic, p): o for p, o in offsets.items()}
            await self.consumer.commit(tps)
        except KafkaError as exc:  # try again on the next tick; nothing recorded, nothing claimed
            say(f"  {self.group}: commit failed, retrying: {exc!r}")
            return
        for p, o in offsets.items():
            self.commits.record(self.group, p, o, initiated)

    def _announce_stall(self, elapsed: float) -> None:
        if self.stall is None:
            return
        if not self.stall_announced and self.stall.holds(self.stall.partition, elapsed):
            self.stall_announced = True
            say(
                f"  {self.group}: slow batch on partition {self.stall.partition}, no commit there "
                f"for {self.stall.seconds:.0f} s: the gate holds it, the others keep flowing"
            )
        elif self.stall_announced and self.stall.over(elapsed):
            partition, self.stall, self.stall_announced = self.stall.partition, None, False
            say(f"  {self.group}: partition {partition} committed again, its payments are released")

    async def stop(self) -> None:
        await self.consumer.stop()


def plan_dependencies(settings: Settings, duration: float) -> dict[str, tuple[float, Stall | None]]:
    """Group -> (commit interval, stall): `aggregates` is the slow one and stalls mid-run."""
    plan: dict[str, tuple[float, Stall | None]] = {}
    for group in settings.depends_on:
        if group == STALLING_GROUP:
            partition = min(STALL_PARTITION, settings.partitions - 1)
            start = max(0.0, duration / 2 - STALL_SECONDS / 2)
            plan[group] = (SLOW_COMMIT_EVERY, Stall(partition, start, STALL_SECONDS))
        else:
            plan[group] = (FAST_COMMIT_EVERY, None)
    return plan


# --------------------------------------------------------------------------- what came out


class TopicTail:
    """Reads a whole topic from the beginning, without a consumer group."""

    def __init__(self, bootstrap: Sequence[str], topic: str) -> None:
        self.topic = topic
        servers = list(bootstrap)
        self.consumer = AIOKafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False)

    async def start(self, expected_partitions: int) -> TopicTail:
        await self.consumer.start()
        partitions = await partitions_of(self.consumer, self.topic, expected_partitions)
        tps = [TopicPartition(self.topic, p) for p in partitions]
        self.consumer.assign(tps)
        await self.consumer.seek_to_beginning(*tps)
        return self

    async def run(self) -> None:
        while True:
            batch = await self.consumer.getmany(timeout_ms=200)
            for records in batch.values():
                for record in records:
                    self.take(record)

    def take(self, record: Any) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        await self.consumer.stop()


class DecisionTail(TopicTail):
    """The decisions topic, parsed; a record that is not JSON is skipped, not fatal."""

    def __init__(self, bootstrap: Sequence[str], topic: str) -> None:
        super().__init__(bootstrap, topic)
        self.decisions: list[dict[str, Any]] = []

    def take(self, record: Any) -> None:
        with contextlib.suppress(TypeError, ValueError):
            self.decisions.append(json.loads(record.value))

    def of_run(self, ids: set[str]) -> list[dict[str, Any]]:
        """Decisions for this run's payments (a shared cluster may hold older ones)."""
        return [d for d in self.decisions if d.get("payment_id") in ids]


class DeadLetterTail(TopicTail):
    """The dead-letter topic: original bytes as value, where it came from and why in the headers."""

    def __init__(self, bootstrap: Sequence[str], topic: str) -> None:
        super().__init__(bootstrap, topic)
        self.origins: dict[tuple[int, int], str] = {}

    def take(self, record: Any) -> None:
        headers = {k: v.decode(errors="replace") for k, v in (record.headers or ())}
        with contextlib.suppress(KeyError, ValueError):
            origin = (int(headers["dlq.partition"]), int(headers["dlq.offset"]))
            self.origins[origin] = headers.get("dlq.reason", "?")

    def of_run(self, malformed: set[tuple[int, int]]) -> dict[tuple[int, int], str]:
        return {o: reason for o, reason in self.origins.items() if o in malformed}


def failure(worker: WorkerProcess, what: str) -> str:
    """Why the demo gives up on a worker, with the end of its log."""
    tail = "\n".join("    " + line for line in worker.log_tail(25).splitlines())
    return f"worker {worker.worker_id} {what}; the end of {worker.log_path}:\n{tail}"


# --------------------------------------------------------------------------- the run


@dataclass
class Verdict:
    """The final check, computed from what was produced, committed and decided."""

    valid: int
    malformed: int
    distinct: int
    records: int
    missing: int
    dead_lettered: int
    reasons: Counter[str]
    premature: list[Premature]
    p50: float
    p99: float
    latency_p50: float
    latency_p99: float

    @property
    def premature_decisions(self) -> int:
        """Distinct decisions made too early (one may be early for several dependencies)."""
        return len({(p, o) for p, o, *_ in self.premature})

    @property
    def ok(self) -> bool:
        return not self.premature and not self.missing and self.dead_lettered == self.malformed


class Demo:
    """Owns everything the demo starts, so `cleanup` can always stop it."""

    def __init__(self, settings: Settings, duration: float, rate: float, workers: int) -> None:
        self.settings = settings
        self.duration = duration
        self.rate = rate
        self.worker_count = workers
        self.folder = DEMO_DIR.resolve()
        self.controls = Controls()
        self.clock = RunClock()
        self.ledger = Ledger()
        self.commits = CommitTimeline()
        self.broker: EmbeddedBroker | None = None
        self.bootstrap: list[str] = []
        self.workers: list[WorkerProcess] = []
        self.dependencies: list[SimulatedDependency] = []
        self.decisions: DecisionTail | None = None
        self.dead_letters: DeadLetterTail | None = None
        self.producer: AIOKafkaProducer | None = None
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.producing: asyncio.Task[None] | None = None

    # ---- the whole run

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.controls.on_signal)
        try:
            try:
                await self.start()
            except Interrupted:
                say("interrupted during start-up")
                return 130
            await self.flow()
            await self.drain()
            verdict = self.verdict()
            self.print_summary(verdict)
            return 0 if verdict.ok else 1
        except (DemoError, BrokerError, KafkaError, OSError) as exc:
            say(f"demo failed: {exc}")
            return 1
        finally:
            await self.cleanup()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    # ---- start-up

    async def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        await self.start_broker()
        if self.controls.stop.is_set():
            raise Interrupted
        s = self.settings
        topics = [s.payments_topic, s.decisions_topic, s.dlq_topic]
        await create_topics(self.bootstrap, topics, s.partitions, s.replication_factor)
        self.start_workers()
        self.print_where_to_look()
        await self.wait_workers_ready()

    async def start_broker(self) -> None:
        """Use KAFKA_BOOTSTRAP_SERVERS when given; otherwise an embedded broker of our own."""
        if os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip():
            self.bootstrap = list(self.settings.bootstrap_servers)
            say(f"using the Kafka cluster at {','.join(self.bootstrap)} (KAFKA_BOOTSTRAP_SERVERS)")
        else:
            port = self.settings.broker_port
            if port_open("127.0.0.1", port):
                busy, port = port, free_port()
                say(f"port {busy} is busy (AML_BROKER_PORT): the embedded broker uses {port}")
            log_path = self.folder / "broker.log"
            log_path.write_bytes(b"")
            # Worker state from an earlier run belongs to a broker that no longer exists.
            shutil.rmtree(self.folder / "data", ignore_errors=True)
            self.broker = EmbeddedBroker(port, log_path=log_path)
            await asyncio.to_thread(self.broker.start)
            self.bootstrap = [self.broker.bootstrap]
        await wait_until_answering(self.bootstrap)

    def start_workers(self) -> None:
        settings = replace(self.settings, bootstrap_servers=tuple(self.bootstrap))
        for i in range(self.worker_count):
            port = self.settings.web_port + i
            if port_open("127.0.0.1", port):
                busy, port = port, free_port()
                say(f"web port {busy} is busy: worker demo-{i} serves on {port}")
            worker = WorkerProcess(
                settings,
                port=port,
                worker_id=f"demo-{i}",
                data_dir=self.folder / "data",
                log_path=self.folder / f"worker-{i}.log",
                AML_SESSION_TIMEOUT=WORKER_SESSION_TIMEOUT,
                AML_REBALANCE_TIMEOUT=WORKER_SESSION_TIMEOUT,
            )
            self.workers.append(worker.start())

    async def wait_workers_ready(self) -> None:
        """Every worker answers /watermarks.json and has finished recovering its tables."""
        say(f"waiting for {len(self.workers)} worker(s) to be ready (up to {READY_DEADLINE:.0f} s)")
        started = time.monotonic()
        for worker in self.workers:
            while True:
                if self.controls.stop.is_set():
                    raise Interrupted
                if not worker.alive():
                    raise DemoError(failure(worker, "exited"))
                state = await worker.state()
                if state is not None and state.get("recovering") is False:
                    say(f"  worker {worker.worker_id} ready after {time.monotonic() - started:.1f} s")
                    break
                if time.monotonic() - started > READY_DEADLINE:
                    raise DemoError(failure(worker, f"was not ready within {READY_DEADLINE:.0f} s"))
                await asyncio.sleep(0.25)

    def print_where_to_look(self) -> None:
        s = self.settings
        plan = plan_dependencies(s, self.duration)
        deps = []
        for group, (every, stall) in plan.items():
            text = f"{group}: commits every {every} s"
            if stall is not None:
                text += f", no commit on partition {stall.partition} for {stall.seconds:.0f} s"
                text += f" from t={stall.start:.1f} s"
            deps.append(text)
        kind = "embedded Tansu broker" if self.broker else "KAFKA_BOOTSTRAP_SERVERS"
        say()
        say(f"AML demo: {self.worker_count} worker(s), {self.rate:g} payments/s")
        say(f"  duration      {self.duration:g} s")
        say(f"  Kafka         {','.join(self.bootstrap)} ({kind})")
        flow = f"{s.payments_topic} -> {s.decisions_topic}, dead letters {s.dlq_topic}"
        say(f"  topics        {flow}")
        say(f"                ({s.partitions} partitions)")
        say("  dependencies  simulated in this process (consumer groups committing offsets)")
        for text in deps:
            say(f"                {text}")
        for worker in self.workers:
            say(f"  web view      {worker.state_url} (worker {worker.worker_id})")
        files = "broker.log, worker-<i>.log" if self.broker else "worker-<i>.log"
        say(f"  logs          {self.folder}/ ({files})")
        say("  Ctrl-C stops producing early, drains and prints the summary")
        say()

    # ---- the flow of payments

    async def flow(self) -> None:
        """Start the dependencies, the readers and the simulator; report until time is up."""
        await self.start_clients()
        self.clock.start()
        for dep in self.dependencies:
            self.tasks[f"dependency {dep.group}"] = asyncio.create_task(dep.run())
        assert self.decisions is not None and self.dead_letters is not None
        self.tasks["decisions reader"] = asyncio.create_task(self.decisions.run())
        self.tasks["dead-letter reader"] = asyncio.create_task(self.dead_letters.run())
        assert self.producer is not None
        topic = self.settings.payments_topic
        simulator = PaymentSimulator(self.producer, topic, self.rate, self.ledger)
        self.producing = asyncio.create_task(simulator.run(self.controls.stop))
        say(f"producing {self.rate:g} payments/s to {self.settings.payments_topic}")
        next_report = PROGRESS_EVERY
        while not self.controls.stop.is_set() and self.clock.elapsed() < self.duration:
            wake = min(next_report, self.duration) - self.clock.elapsed()
            await sleep_unless(self.controls.stop, wake)
            self.check_health()
            if self.clock.elapsed() >= next_report:
                await self.report()
                next_report += PROGRESS_EVERY
        self.controls.stop.set()
        await self.finish_producing()

    async def start_clients(self) -> None:
        s = self.settings
        for group, (every, stall) in plan_dependencies(s, self.duration).items():
            dep = SimulatedDependency(
                self.bootstrap, s.payments_topic, group, every, self.commits, self.clock, stall
            )
            self.dependencies.append(dep)
            await dep.start(s.partitions)
        self.decisions = DecisionTail(self.bootstrap, s.decisions_topic)
        await self.decisions.start(s.partitions)
        self.dead_letters = DeadLetterTail(self.bootstrap, s.dlq_topic)
        await self.dead_letters.start(s.partitions)
        self.producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=5)
        await self.producer.start()

    async def finish_producing(self) -> None:
        if self.producing is None:
            return
        try:
            await asyncio.wait_for(self.producing, CLIENT_STOP_DEADLINE)
        except TimeoutError:
            raise DemoError("the payment simulator did not stop within 10 s") from None
        except KafkaError as exc:
            raise DemoError(f"producing payments failed: {exc!r}") from exc

    def check_health(self) -> None:
        """A dead worker or a crashed helper task ends the run with a message, not a hang."""
        for worker in self.workers:
            if not worker.alive():
                raise DemoError(failure(worker, "exited"))
        tasks = dict(self.tasks)
        if self.producing is not None:
            tasks["payment simulator"] = self.producing
        for name, task in tasks.items():
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise DemoError(f"the {name} failed: {task.exception()!r}")

    # ---- progress

    async def report(self, prefix: str = "") -> None:
        """One progress line: counts, each dependency's progress, the gate's waiting partitions."""
        ids = set(self.ledger.valid.values())
        assert self.decisions is not None and self.dead_letters is not None
        decided = self.decisions.of_run(ids)
        dlq = len(self.dead_letters.of_run(self.ledger.malformed))
        deps = "  ".join(f"{g} {sum(self.commits.committed(g).values())}" for g in self.settings.depends_on)
        p50 = percentile([float(d.get("waited_ms", 0)) for d in decided], 50)
        say(
            f"{prefix}{self.clock.elapsed():6.1f}s  produced {self.ledger.produced}  "
            f"decided {len({d['payment_id'] for d in decided})}  dead-lettered {dlq}  "
            f"committed: {deps}  {await self.waiting_text()}  wait p50 {fmt_ms(p50)}"
        )

    async def waiting_text(self) -> str:
        """How many partitions have a payment held by the gate, and the longest hold."""
        states = await asyncio.gather(*(w.state() for w in self.workers))
        waiting: set[str] = set()
        since: dict[str, float] = {}
        for state in states:
            if state:
                waiting |= set(state.get("waiting", {}))
                since.update(state.get("blocked_since", {}))
        if any(s is None for s in states):
            return f"waiting {len(waiting)}+? (a worker did not answer)"
        text = f"waiting {len(waiting)}"
        if since:
            partition, t = min(since.items(), key=lambda item: item[1])
            held = time.time() - t
            if held >= 1.0:
                text += f" (p{partition} held {held:.1f}s)"
        return text

    # ---- the end

    def caught_up(self) -> bool:
        """Dependencies committed to the log end; every payment decided or dead-lettered."""
        assert self.decisions is not None and self.dead_letters is not None
        for group in self.settings.depends_on:
            done = self.commits.committed(group)
            if any(done.get(p, 0) < end for p, end in self.ledger.ends.items()):
                return False
        ids = set(self.ledger.valid.values())
        decided = {d["payment_id"] for d in self.decisions.of_run(ids)}
        dead = self.dead_letters.of_run(self.ledger.malformed)
        return len(decided) == len(ids) and len(dead) == len(self.ledger.malformed)

    async def drain(self) -> None:
        say(
            f"stopped producing after {self.clock.elapsed():.1f} s ({self.ledger.produced} "
            f"records); letting the dependencies and the worker(s) catch up "
            f"(up to {DRAIN_DEADLINE:.0f} s)"
        )
        deadline = time.monotonic() + DRAIN_DEADLINE
        next_report = time.monotonic() + PROGRESS_EVERY
        while not self.caught_up():
            if self.controls.hurry.is_set():
                say("drain skipped")
                return
            if time.monotonic() > deadline:
                say(f"not everything was decided within {DRAIN_DEADLINE:.0f} s")
                return
            self.check_health()
            if time.monotonic() >= next_report:
                await self.report(prefix="drain ")
                next_report += PROGRESS_EVERY
            await sleep_unless(self.controls.hurry, 0.2)
        await self.report(prefix="done  ")

    def verdict(self) -> Verdict:
        assert self.decisions is not None and self.dead_letters is not None
        ids = set(self.ledger.valid.values())
        decided = self.decisions.of_run(ids)
        distinct = {d["payment_id"] for d in decided}
        dead = self.dead_letters.of_run(self.ledger.malformed)
        waits = [float(d.get("waited_ms", 0)) for d in decided]
        latencies = end_to_end_ms(decided, self.ledger.sent_at)
        return Verdict(
            valid=len(ids),
            malformed=len(self.ledger.malformed),
            distinct=len(distinct),
            records=len(decided),
            missing=len(ids - distinct),
            dead_lettered=len(dead),
            reasons=Counter(reason_kind(reason) for reason in dead.values()),
            premature=premature(decided, self.settings.depends_on, self.commits),
            p50=percentile(waits, 50),
            p99=percentile(waits, 99),
            latency_p50=percentile(latencies, 50),
            latency_p99=percentile(latencies, 99),
        )

    def print_summary(self, v: Verdict) -> None:
        reasons = ", ".join(f"{reason} {n}" for reason, n in v.reasons.most_common())
        rows = [
            ("payments produced", f"{v.valid + v.malformed} (valid {v.valid}, malformed {v.malformed})"),
            ("decisions", f"{v.distinct} distinct payment ids ({v.records} records, {v.missing} missing)"),
            ("dead-lettered", f"{v.dead_lettered}" + (f" ({reasons})" if reasons else "")),
            ("premature decisions", f"{v.premature_decisions}"),
            ("gate wait p50 / p99", f"{fmt_ms(v.p50)} / {fmt_ms(v.p99)}"),
            ("end-to-end p50 / p99", f"{fmt_ms(v.latency_p50)} / {fmt_ms(v.latency_p99)}"),
            ("dependency commits", f"{self.commits.count}"),
        ]
        rows += [("web view", f"{w.state_url} (worker {w.worker_id})") for w in self.workers]
        rows.append(("result", "OK" if v.ok else "PROBLEM"))
        say()
        say("summary")
        say("-" * 72)
        for name, value in rows:
            say(f"  {name:<22}{value}")
        say("-" * 72)
        for p, o, group, covered, decided in v.premature[:10]:
            when = "never" if covered is None else f"{covered - decided:+.3f} s after the decision"
            say(f"  premature: {p}:{o} decided before {group} committed past it ({when})")
        if v.dead_lettered != v.malformed:
            say(f"  {v.malformed - v.dead_lettered} malformed record(s) never reached the DLQ")

    async def cleanup(self) -> None:
        """Stop everything we started, each step bounded, whatever happened before."""
        if self.producing is not None and not self.producing.done():
            self.producing.cancel()
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self.workers:
            say(f"stopping {len(self.workers)} worker(s)")
            stops = (asyncio.to_thread(w.stop, WORKER_STOP_GRACE) for w in self.workers)
            for worker, stopped in zip(self.workers, await asyncio.gather(*stops), strict=True):
                if not stopped:
                    say(f"worker {worker.worker_id} did not stop within {WORKER_STOP_GRACE:.0f} s: killed it")
        clients: list[Any] = [*self.dependencies, self.decisions, self.dead_letters, self.producer]
        for client in clients:
            if client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.stop(), CLIENT_STOP_DEADLINE)
        if self.broker is not None:
            say("stopping the embedded broker")
            await asyncio.to_thread(self.broker.stop)


def reason_kind(reason: str) -> str:
    """A DLQ reason without its particulars, so equal faults count together."""
    return reason.split(":")[0].split(", got")[0]


def end_to_end_ms(decisions: Sequence[dict[str, Any]], sent_at: dict[str, float]) -> list[float]:
    """From handing a payment to the producer to its decision (same host, same wall clock)."""
    return [
        (decided_at(d) - sent_at[d["payment_id"]]) * 1000 for d in decisions if d["payment_id"] in sent_at
    ]


def run_demo(settings: Settings, *, duration: float, rate: float, workers: int) -> int:
    """Run the demo; 0 when every payment was decided and none too early, 1 otherwise."""
    if duration < 0 or rate < 0 or workers < 1:
        say("demo: --duration and --rate must not be negative, --workers must be at least 1")
        return 1
    try:
        return asyncio.run(Demo(settings, duration, rate, workers).run())
    except KeyboardInterrupt:  # a Ctrl-C before our handler was installed
        return 130
