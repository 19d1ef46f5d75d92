"""`aml-app demo`: the whole system end to end, on real processes.

The demo starts (or reuses) a broker, then Services B and C as a user runs them (`aml-app pipeline`, the
Spark streaming queries of both, and `aml-app serve relations|aggregates`, their APIs), the AML workers
(`aml-app worker`, gated on the groups `relations` and `aggregates`), produces payments with a few
malformed ones, and prints what happens every two seconds.

At the end it checks the one promise the gate makes: no payment is decided before every dependency group
committed past it (`aml_app.verify`, the check the integration tests make too). The dependencies commit
on their own, so the demo watches their committed offsets on the broker every 50 ms and dates each
advance conservatively (see `CommitWatch`): a decision it calls premature is premature for certain. It
also checks that both services caught up with the log, that every malformed record reached the
dead-letter topic from each of the three services, and asks the APIs about a few payments.
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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

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
from aml_app.dependency_services import (
    COMMIT_POLL_EVERY,
    ApiProcess,
    CommitWatch,
    ServiceProcess,
    pipeline_process,
)
from aml_app.kafka_tools import payment_json
from aml_app.settings import Settings
from aml_app.topics import topic_specs
from aml_app.verify import Premature, decided_at, percentile, premature
from aml_app.workers import WorkerProcess

DEMO_DIR = Path("var/demo")
ACCOUNTS = 200
MALFORMED_EVERY = 100  # one record in a hundred breaks the contract, so the DLQ shows up
PROGRESS_EVERY = 2.0
API_DEADLINE = 60.0
WORKER_DEADLINE = 90.0
PIPELINE_DEADLINE = 180.0  # Spark starts in 10-25 s on two cores, more when the machine is busy
FIRST_BATCH_DEADLINE = 180.0  # and compiles its first micro-batch in 10-30 s
DRAIN_DEADLINE = 60.0
WORKER_STOP_GRACE = 15.0
SERVICE_STOP_GRACE = 30.0
CLIENT_STOP_DEADLINE = 10.0
# Tansu holds a group join for about half the session timeout: keep it short so workers start fast.
WORKER_SESSION_TIMEOUT = "6"
SPOT_CHECKS = 5
PIPELINE_RUNNING = "pipeline running"  # the runner's log line once both queries are started


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
    """Seconds since payments started flowing."""

    def __init__(self) -> None:
        self.started: float | None = None

    def start(self) -> None:
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started


# --------------------------------------------------------------------------- what was produced


class Payment(NamedTuple):
    payment_id: str
    payer: str
    payee: str
    ts: str


@dataclass
class Ledger:
    """Every record this run produced and where it landed: the reference for the final check."""

    valid: dict[tuple[int, int], Payment] = field(default_factory=dict)
    sent_at: dict[str, float] = field(default_factory=dict)
    malformed: set[tuple[int, int]] = field(default_factory=set)
    ends: dict[int, int] = field(default_factory=dict)
    warm_up: set[str] = field(default_factory=set)  # ids of the payments that waited for Spark's start

    @property
    def produced(self) -> int:
        return len(self.valid) + len(self.malformed)

    def ids(self) -> set[str]:
        return {p.payment_id for p in self.valid.values()}

    def place(self, partition: int, offset: int, payment: Payment | None, sent_at: float) -> None:
        if payment is None:
            self.malformed.add((partition, offset))
        else:
            self.valid[(partition, offset)] = payment
            self.sent_at[payment.payment_id] = sent_at
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

    async def warm_up(self, partitions: Sequence[int]) -> None:
        """One valid payment on each partition, so each group has something to commit past."""
        records = [(p, *self._valid(f"pay-{self.run_tag}-warm-{p}")) for p in partitions]
        sent_at = time.time()
        futures = [
            await self.producer.send(self.topic, key=k, value=v, partition=p) for p, k, v, _ in records
        ]
        for fut, (_, _, _, payment) in zip(futures, records, strict=True):
            meta = await fut
            self.ledger.place(meta.partition, meta.offset, payment, sent_at)
            self.ledger.warm_up.add(payment.payment_id)

    async def run(self, stop: asyncio.Event) -> None:
        started = time.monotonic()
        while not stop.is_set():
            due = int((time.monotonic() - started) * self.rate)
            if due > self.count:
                await self._send([self._record(n) for n in range(self.count, due)])
                self.count = due
            await sleep_unless(stop, 0.05)

    async def _send(self, records: list[tuple[bytes, bytes, Payment | None]]) -> None:
        sent_at = time.time()
        futures = [await self.producer.send(self.topic, key=k, value=v) for k, v, _ in records]
        for fut, (_, _, payment) in zip(futures, records, strict=True):
            meta = await fut
            self.ledger.place(meta.partition, meta.offset, payment, sent_at)

    def _valid(self, payment_id: str) -> tuple[bytes, bytes, Payment]:
        payer, payee = self.rng.sample(range(ACCOUNTS), 2)
        cents = self.rng.randint(100, 2_500_000)
        payment = Payment(payment_id, f"acct-{payer:04d}", f"acct-{payee:04d}", utc_now_z())
        amount = f"{cents // 100}.{cents % 100:02d}"
        value = payment_json(payment.payment_id, payment.payer, payment.payee, amount, payment.ts)
        return payment.payer.encode(), value, payment

    def _record(self, n: int) -> tuple[bytes, bytes, Payment | None]:
        """(key, value, the payment or None when the record is deliberately malformed)."""
        key, value, payment = self._valid(f"pay-{self.run_tag}-{n:07d}")
        if n % MALFORMED_EVERY != MALFORMED_EVERY - 1:
            return key, value, payment
        return key, self._malformed(n // MALFORMED_EVERY, value), None

    @staticmethod
    def _malformed(kind: int, value: bytes) -> bytes:
        """Cycle through the three faults the dead-letter topic should show."""
        if kind % 3 == 0:
            return value[:-9]  # truncated: not JSON
        doc = json.loads(value)
        if kind % 3 == 1:
            doc["amount"] = "-" + doc["amount"]
        else:
            del doc["payee"]
        return json.dumps(doc).encode()


# --------------------------------------------------------------------------- what came out


class TopicTail:
    """Reads a whole topic from the beginning, without a consumer group."""

    def __init__(self, bootstrap: Sequence[str], topic: str) -> None:
        self.topic = topic
        servers = list(bootstrap)
        self.consumer = AIOKafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False)
        self.closing = False

    async def start(self, expected_partitions: int) -> TopicTail:
        await self.consumer.start()
        partitions = await partitions_of(self.consumer, self.topic, expected_partitions)
        tps = [TopicPartition(self.topic, p) for p in partitions]
        self.consumer.assign(tps)
        await self.consumer.seek_to_beginning(*tps)
        return self

    async def run(self) -> None:
        while not self.closing:
            batch = await self.consumer.getmany(timeout_ms=200)
            for records in batch.values():
                for record in records:
                    self.take(record)

    def take(self, record: Any) -> None:
        raise NotImplementedError

    def halt(self) -> None:
        self.closing = True

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
    """The dead-letter topic: original bytes as value, where it came from and why in the headers.

    Each service dead-letters a bad record itself: `dlq.worker` is the group name for B and C, the
    worker id for the AML worker(s), which are counted together as "aml".
    """

    def __init__(self, bootstrap: Sequence[str], topic: str, services: Sequence[str]) -> None:
        super().__init__(bootstrap, topic)
        self.services = set(services)
        self.origins: dict[str, dict[tuple[int, int], str]] = {}

    def take(self, record: Any) -> None:
        headers = {k: v.decode(errors="replace") for k, v in (record.headers or ())}
        source = headers.get("dlq.worker", "")
        with contextlib.suppress(KeyError, ValueError):
            origin = (int(headers["dlq.partition"]), int(headers["dlq.offset"]))
            found = self.origins.setdefault(source if source in self.services else "aml", {})
            found[origin] = headers.get("dlq.reason", "?")

    def of_run(self, source: str, malformed: set[tuple[int, int]]) -> dict[tuple[int, int], str]:
        return {o: reason for o, reason in self.origins.get(source, {}).items() if o in malformed}


def failure(name: str, process: WorkerProcess | ServiceProcess, what: str, lines: int = 25) -> str:
    """Why the demo gives up on a process, with the end of its log."""
    tail = "\n".join("    " + line for line in process.log_tail(lines).splitlines())
    return f"{name} {what}; the end of {process.log_path}:\n{tail}"


# --------------------------------------------------------------------------- the run


@dataclass
class Verdict:
    """The final check, computed from what was produced, committed, decided and answered."""

    valid: int
    malformed: int
    distinct: int
    records: int
    missing: int
    dead_lettered: dict[str, int]  # "aml" and each service group -> malformed records it dead-lettered
    reasons: Counter[str]
    premature: list[Premature]
    p50: float
    p99: float
    latency_p50: float
    latency_p99: float
    behind: dict[str, int]  # group -> records it has not committed past
    spot_failures: int

    @property
    def premature_decisions(self) -> int:
        """Distinct decisions made too early (one may be early for several dependencies)."""
        return len({(p, o) for p, o, *_ in self.premature})

    @property
    def ok(self) -> bool:
        return (
            not self.premature
            and not self.missing
            and all(n == self.malformed for n in self.dead_lettered.values())
            and not any(self.behind.values())
            and not self.spot_failures
        )


class Demo:
    """Owns everything the demo starts, so `cleanup` can always stop it."""

    def __init__(self, settings: Settings, duration: float, rate: float, workers: int) -> None:
        self.duration = duration
        self.rate = rate
        self.worker_count = workers
        self.folder = DEMO_DIR.resolve()
        groups = (settings.relations_group, settings.aggregates_group)
        if settings.depends_on != groups:
            ignored = ",".join(settings.depends_on)
            say(f"AML_DEPENDS_ON={ignored} ignored: the demo gates on {','.join(groups)}")
        self.settings = replace(
            settings,
            depends_on=groups,
            store_dir=str(self.folder / "services"),
            checkpoint_dir=str(self.folder / "checkpoints"),
        )
        self.controls = Controls()
        self.clock = RunClock()
        self.ledger = Ledger()
        self.broker: EmbeddedBroker | None = None
        self.bootstrap: list[str] = []
        self.workers: list[WorkerProcess] = []
        self.pipeline: ServiceProcess | None = None
        self.apis: list[ApiProcess] = []
        self.watch: CommitWatch | None = None
        self.decisions: DecisionTail | None = None
        self.dead_letters: DeadLetterTail | None = None
        self.producer: AIOKafkaProducer | None = None
        self.simulator: PaymentSimulator | None = None
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.producing: asyncio.Task[None] | None = None
        self.spot_lines: list[str] = []
        self.spot_failures = 0

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
            await self.spot_check()
            assert self.watch is not None
            await self.watch.settle()  # a decision already read must not find its commit undated
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
        s = self.settings = replace(self.settings, bootstrap_servers=tuple(self.bootstrap))
        await create_topics(self.bootstrap, topic_specs(s))
        self.start_services()
        self.start_workers()
        self.print_where_to_look()
        self.watch = CommitWatch(self.bootstrap, s.payments_topic, s.depends_on)
        self.tasks["commit watch"] = asyncio.create_task(self.watch.run())
        await self.wait_ready()
        await self.start_clients()
        await self.warm_up()

    async def start_broker(self) -> None:
        """Use KAFKA_BOOTSTRAP_SERVERS when given; otherwise an embedded broker of our own."""
        if os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip():
            self.bootstrap = list(self.settings.bootstrap_servers)
            say(f"using the Kafka cluster at {','.join(self.bootstrap)} (KAFKA_BOOTSTRAP_SERVERS)")
        else:
            port = self.free("AML_BROKER_PORT", "the embedded broker", self.settings.broker_port)
            log_path = self.folder / "broker.log"
            log_path.write_bytes(b"")
            # Worker state from an earlier run belongs to a broker that no longer exists.
            shutil.rmtree(self.folder / "data", ignore_errors=True)
            self.broker = EmbeddedBroker(port, log_path=log_path)
            await asyncio.to_thread(self.broker.start)
            self.bootstrap = [self.broker.bootstrap]
        await wait_until_answering(self.bootstrap)

    @staticmethod
    def free(variable: str, who: str, port: int) -> int:
        """`port`, or a free one when it is taken (said out loud)."""
        if not port_open("127.0.0.1", port):
            return port
        chosen = free_port()
        say(f"port {port} is busy ({variable}): {who} uses {chosen}")
        return chosen

    def start_services(self) -> None:
        """The pipeline (fresh stores and checkpoints: the groups are the only progress it resumes from)
        and the two APIs reading its stores."""
        s = self.settings
        for folder in (s.store_dir, s.checkpoint_dir):
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
        s = self.settings = replace(
            s,
            relations_port=self.free("AML_RELATIONS_PORT", "the relations API", s.relations_port),
            aggregates_port=self.free("AML_AGGREGATES_PORT", "the aggregates API", s.aggregates_port),
        )
        self.pipeline = pipeline_process(s, self.folder / "pipeline.log").start()
        for kind in ("relations", "aggregates"):
            self.apis.append(ApiProcess(kind, s, self.folder / f"{kind}-api.log").start())

    def start_workers(self) -> None:
        for i in range(self.worker_count):
            port = self.free("AML_WEB_PORT", f"worker demo-{i}", self.settings.web_port + i)
            worker = WorkerProcess(
                self.settings,
                port=port,
                worker_id=f"demo-{i}",
                data_dir=self.folder / "data",
                log_path=self.folder / f"worker-{i}.log",
                AML_SESSION_TIMEOUT=WORKER_SESSION_TIMEOUT,
                AML_REBALANCE_TIMEOUT=WORKER_SESSION_TIMEOUT,
            )
            self.workers.append(worker.start())

    def print_where_to_look(self) -> None:
        s = self.settings
        kind = "embedded Tansu broker" if self.broker else "KAFKA_BOOTSTRAP_SERVERS"
        say()
        say(f"AML demo: {self.worker_count} worker(s), {self.rate:g} payments/s")
        say(f"  duration      {self.duration:g} s of traffic, after the services are up")
        say(f"  Kafka         {','.join(self.bootstrap)} ({kind})")
        flow = f"{s.payments_topic} -> {s.decisions_topic}, dead letters {s.dlq_topic}"
        say(f"  topics        {flow}")
        say(f"                ({s.partitions} partitions)")
        say(f"  dependencies  groups {', '.join(s.depends_on)}: `aml-app pipeline` (Spark, {s.spark_master},")
        say(f"                trigger {s.trigger_interval:g} s), stores in {s.store_dir}")
        for api, service in zip(self.apis, "BC", strict=True):
            say(f"  {'APIs' if service == 'B' else '':<14}{service} {api.kind:<11}{api.url}/health")
        for worker in self.workers:
            say(f"  web view      {worker.state_url} (worker {worker.worker_id})")
        say(f"  logs          {self.folder}/")
        assert self.pipeline is not None
        say(f"                pipeline: {self.pipeline.log_path}")
        apis = ", ".join(a.log_path.name for a in self.apis)
        say(f"                {apis}, worker-<i>.log" + (", broker.log" if self.broker else ""))
        say("  Ctrl-C stops producing early, drains and prints the summary")
        say()

    async def wait_ready(self) -> None:
        """The APIs answer /health, every worker has recovered, the pipeline's queries run."""
        say(
            f"waiting for the services (APIs up to {API_DEADLINE:.0f} s, workers {WORKER_DEADLINE:.0f} s, "
            f"Spark {PIPELINE_DEADLINE:.0f} s)"
        )
        started = time.monotonic()

        async def until(
            what: str, ready: Callable[[], Awaitable[bool]], deadline: float, process: Any = None
        ) -> None:
            while not await ready():
                if self.controls.stop.is_set():
                    raise Interrupted
                self.check_processes()
                if time.monotonic() - started > deadline:
                    late = f"was not ready within {deadline:.0f} s"
                    raise DemoError(failure(what, process, late) if process else f"{what} {late}")
                await asyncio.sleep(0.25)
            say(f"  {what} ready after {time.monotonic() - started:.1f} s")

        for api in self.apis:
            await until(f"the {api.kind} API", lambda a=api: self._answers(a), API_DEADLINE, api)
        for w in self.workers:
            await until(f"worker {w.worker_id}", lambda w=w: self._recovered(w), WORKER_DEADLINE, w)
        pipeline = self.pipeline
        assert pipeline is not None
        await until("the pipeline", lambda: self._running(pipeline), PIPELINE_DEADLINE, pipeline)

    @staticmethod
    async def _answers(api: ApiProcess) -> bool:
        return await api.health() is not None

    @staticmethod
    async def _recovered(worker: WorkerProcess) -> bool:
        state = await worker.state()
        return state is not None and state.get("recovering") is False

    @staticmethod
    async def _running(pipeline: ServiceProcess) -> bool:
        return PIPELINE_RUNNING in await asyncio.to_thread(pipeline.log_text)

    async def start_clients(self) -> None:
        s = self.settings
        self.decisions = DecisionTail(self.bootstrap, s.decisions_topic)
        await self.decisions.start(s.partitions)
        self.dead_letters = DeadLetterTail(self.bootstrap, s.dlq_topic, s.depends_on)
        await self.dead_letters.start(s.partitions)
        self.tasks["decisions reader"] = asyncio.create_task(self.decisions.run())
        self.tasks["dead-letter reader"] = asyncio.create_task(self.dead_letters.run())
        self.producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=5)
        await self.producer.start()
        self.simulator = PaymentSimulator(self.producer, s.payments_topic, self.rate, self.ledger)

    async def warm_up(self) -> None:
        """One payment per partition; wait until every group committed past them (Spark's first batch)."""
        assert self.simulator is not None and self.watch is not None and self.decisions is not None
        watch = self.watch
        s = self.settings
        await self.simulator.warm_up(
            await partitions_of(self.decisions.consumer, s.payments_topic, s.partitions)
        )
        say(
            f"warm-up: {len(self.ledger.valid)} payment(s), one per partition; waiting for the pipeline's "
            f"first micro-batch (up to {FIRST_BATCH_DEADLINE:.0f} s)"
        )
        started = time.monotonic()
        pending = list(self.settings.depends_on)
        next_note = started + 10
        while pending:
            if self.controls.stop.is_set():
                raise Interrupted
            self.check_health()
            for group in [g for g in pending if not watch.behind(g, self.ledger.ends)]:
                say(f"  {group} committed past them after {time.monotonic() - started:.1f} s")
                pending.remove(group)
            if time.monotonic() - started > FIRST_BATCH_DEADLINE:
                assert self.pipeline is not None
                what = f"did not commit for {', '.join(pending)} within {FIRST_BATCH_DEADLINE:.0f} s"
                raise DemoError(failure("the pipeline", self.pipeline, what))
            if pending and time.monotonic() >= next_note:
                say(f"  still waiting for {', '.join(pending)} ({time.monotonic() - started:.0f} s)")
                next_note += 10
            await asyncio.sleep(0.1)

    # ---- the flow of payments

    async def flow(self) -> None:
        """Produce for `duration` seconds and report every two seconds."""
        assert self.simulator is not None
        self.clock.start()
        self.producing = asyncio.create_task(self.simulator.run(self.controls.stop))
        say(
            f"producing {self.rate:g} payments/s to {self.settings.payments_topic} "
            f"(dead-lettered by {'/'.join(self.sources)}; committed offsets summed over partitions)"
        )
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

    async def finish_producing(self) -> None:
        if self.producing is None:
            return
        try:
            await asyncio.wait_for(self.producing, CLIENT_STOP_DEADLINE)
        except TimeoutError:
            raise DemoError("the payment simulator did not stop within 10 s") from None
        except KafkaError as exc:
            raise DemoError(f"producing payments failed: {exc!r}") from exc

    def check_processes(self) -> None:
        """A dead worker, pipeline or API ends the run with the end of its log, not with a hang."""
        for worker in self.workers:
            if not worker.alive():
                raise DemoError(failure(f"worker {worker.worker_id}", worker, "exited"))
        if self.pipeline is not None and not self.pipeline.alive():
            code = self.pipeline.returncode
            raise DemoError(failure("the pipeline", self.pipeline, f"exited with code {code}", 40))
        for api in self.apis:
            if not api.alive():
                raise DemoError(failure(f"the {api.kind} API", api, f"exited with code {api.returncode}"))

    def check_health(self) -> None:
        """Processes alive, and no helper task crashed."""
        self.check_processes()
        tasks = dict(self.tasks)
        if self.producing is not None:
            tasks["payment simulator"] = self.producing
        for name, task in tasks.items():
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise DemoError(f"the {name} failed: {task.exception()!r}")

    # ---- progress

    async def report(self, prefix: str = "") -> None:
        """One progress line: counts, each dependency's committed offsets, the gate's waiting partitions."""
        assert self.decisions is not None and self.dead_letters is not None and self.watch is not None
        decided = self.decisions.of_run(self.ledger.ids())
        dlq = "/".join(
            str(len(self.dead_letters.of_run(source, self.ledger.malformed))) for source in self.sources
        )
        warm = self.ledger.warm_up
        p50 = percentile([float(d.get("waited_ms", 0)) for d in decided if d["payment_id"] not in warm], 50)
        say(
            f"{prefix}{self.clock.elapsed():6.1f}s  produced {self.ledger.produced}  "
            f"decided {len({d['payment_id'] for d in decided})}  dead-lettered {dlq}  "
            f"committed: {self.watch.status(self.ledger.ends)}  {await self.waiting_text()}  "
            f"wait p50 {fmt_ms(p50)}"
        )

    @property
    def sources(self) -> tuple[str, ...]:
        """Who dead-letters: the AML worker(s), then each service group."""
        return ("aml", *self.settings.depends_on)

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
        """Dependencies committed to the log end; every payment decided and dead-lettered by all."""
        assert self.decisions is not None and self.dead_letters is not None and self.watch is not None
        if any(self.watch.behind(g, self.ledger.ends) for g in self.settings.depends_on):
            return False
        ids = self.ledger.ids()
        if len({d["payment_id"] for d in self.decisions.of_run(ids)}) != len(ids):
            return False
        malformed = self.ledger.malformed
        return all(len(self.dead_letters.of_run(s, malformed)) == len(malformed) for s in self.sources)

    async def drain(self) -> None:
        say(
            f"stopped producing after {self.clock.elapsed():.1f} s ({self.ledger.produced} records); "
            f"letting the services and the worker(s) catch up (up to {DRAIN_DEADLINE:.0f} s)"
        )
        deadline = time.monotonic() + DRAIN_DEADLINE
        next_report = time.monotonic() + PROGRESS_EVERY
        while not self.caught_up():
            if self.controls.hurry.is_set():
                say("drain skipped")
                return
            if time.monotonic() > deadline:
                say(f"not everything was committed, decided and dead-lettered within {DRAIN_DEADLINE:.0f} s")
                return
            self.check_health()
            if time.monotonic() >= next_report:
                await self.report(prefix="drain ")
                next_report += PROGRESS_EVERY
            await sleep_unless(self.controls.hurry, 0.2)
        await self.report(prefix="done  ")

    async def spot_check(self) -> None:
        """Ask B and C about a few payments: their as_of covers it, B lists the payee, C counts it."""
        if self.controls.hurry.is_set() or not self.ledger.valid:
            return
        relations, aggregates = self.apis
        chosen = random.sample(sorted(self.ledger.valid.items()), min(SPOT_CHECKS, len(self.ledger.valid)))
        for (p, o), pay in sorted(chosen):
            rel, agg = await asyncio.gather(
                relations.get(f"/relations/{pay.payer}", {"hops": "2"}),
                aggregates.get(f"/aggregates/{pay.payer}", {"at": pay.ts}),
            )
            problems = []
            if rel is None or agg is None:
                problems.append("an API did not answer")
                rel, agg = rel or {}, agg or {}
            rel_upto = int(rel.get("as_of", {}).get(str(p), 0))
            agg_upto = int(agg.get("as_of", {}).get(str(p), 0))
            out = {c["counterparty"] for c in rel.get("out", [])}
            sent = agg.get("windows", {}).get("1h", {}).get("sent_count", 0)
            checks = [
                (rel_upto > o, f"B's as_of p{p}={rel_upto} does not cover it"),
                (pay.payee in out, f"B does not list {pay.payee} among the payer's out counterparties"),
                (agg_upto > o, f"C's as_of p{p}={agg_upto} does not cover it"),
                (sent >= 1, "C counts no payment sent in the hour up to its ts"),
            ]
            problems += [text for good, text in checks if not good]
            self.spot_failures += bool(problems)
            self.spot_lines.append(
                f"  p{p}:{o} {pay.payer} -> {pay.payee} at {pay.ts}: B as_of p{p}={rel_upto}, "
                f"{pay.payee} among {len(out)} out counterparties; C as_of p{p}={agg_upto}, "
                f"1h sent_count {sent}  " + ("OK" if not problems else "PROBLEM: " + "; ".join(problems))
            )

    def verdict(self) -> Verdict:
        assert self.decisions is not None and self.dead_letters is not None and self.watch is not None
        ids = self.ledger.ids()
        decided = self.decisions.of_run(ids)
        distinct = {d["payment_id"] for d in decided}
        dead = self.dead_letters.of_run("aml", self.ledger.malformed)
        # Wait and latency figures leave out the warm-up payments, which waited for Spark's first batch.
        steady = [d for d in decided if d["payment_id"] not in self.ledger.warm_up]
        waits = [float(d.get("waited_ms", 0)) for d in steady]
        latencies = end_to_end_ms(steady, self.ledger.sent_at)
        return Verdict(
            valid=len(ids),
            malformed=len(self.ledger.malformed),
            distinct=len(distinct),
            records=len(decided),
            missing=len(ids - distinct),
            dead_lettered={s: len(self.dead_letters.of_run(s, self.ledger.malformed)) for s in self.sources},
            reasons=Counter(reason_kind(reason) for reason in dead.values()),
            premature=premature(decided, self.settings.depends_on, self.watch.timeline),
            p50=percentile(waits, 50),
            p99=percentile(waits, 99),
            latency_p50=percentile(latencies, 50),
            latency_p99=percentile(latencies, 99),
            behind={g: self.watch.behind(g, self.ledger.ends) for g in self.settings.depends_on},
            spot_failures=self.spot_failures,
        )

    def print_summary(self, v: Verdict) -> None:
        assert self.watch is not None
        reasons = ", ".join(f"{reason} {n}" for reason, n in v.reasons.most_common())
        by = ", ".join(
            f"{n} by {'the AML worker(s)' if s == 'aml' else s}" for s, n in v.dead_lettered.items()
        )
        end = sum(self.ledger.ends.values())
        rows = [
            ("payments produced", f"{v.valid + v.malformed} (valid {v.valid}, malformed {v.malformed})"),
            ("decisions", f"{v.distinct} distinct payment ids ({v.records} records, {v.missing} missing)"),
            ("dead-lettered", by + (f" ({reasons})" if reasons else "")),
            ("premature decisions", f"{v.premature_decisions}"),
            ("gate wait p50 / p99", f"{fmt_ms(v.p50)} / {fmt_ms(v.p99)} (after warm-up)"),
            ("end-to-end p50 / p99", f"{fmt_ms(v.latency_p50)} / {fmt_ms(v.latency_p99)}"),
        ]
        for group, behind in v.behind.items():
            done = sum(self.watch.committed(group).values())
            state = "reached the log end" if not behind else f"{behind} records short of the log end"
            rows.append((f"{group} (Spark)", f"committed {done} of {end} offsets: {state}"))
        polls = f"{self.watch.polls} polls every {COMMIT_POLL_EVERY * 1000:.0f} ms"
        rows.append(("commit watch", f"{polls}, {self.watch.advances} advances seen"))
        checked = len(self.spot_lines)
        rows.append(("API spot check", f"{checked - v.spot_failures} of {checked} payments OK"))
        rows += [("web view", f"{w.state_url} (worker {w.worker_id})") for w in self.workers]
        rows += [(f"{a.kind} API", f"{a.url}") for a in self.apis]
        rows.append(("result", "OK" if v.ok else "PROBLEM"))
        if self.spot_lines:
            say()
            say("spot check: B GET /relations/{payer}?hops=2, C GET /aggregates/{payer}?at={payment ts}")
            for line in self.spot_lines:
                say(line)
        say()
        say("summary")
        say("-" * 72)
        for name, value in rows:
            say(f"  {name:<22}{value}")
        say("-" * 72)
        for p, o, group, covered, decided in v.premature[:10]:
            when = "never" if covered is None else f"{covered - decided:+.3f} s after the decision"
            say(f"  premature: {p}:{o} decided before {group} committed past it ({when})")
        for source, n in v.dead_lettered.items():
            if n != v.malformed:
                say(f"  {v.malformed - n} malformed record(s) never reached the DLQ from {source}")

    async def cleanup(self) -> None:
        """Stop everything we started, each step bounded, whatever happened before."""
        if self.producing is not None and not self.producing.done():
            self.producing.cancel()
        # Python 3.11's asyncio.wait_for can lose a cancellation (aiokafka and the gate's offset reader use
        # it), so the loops also stop on a flag, and the wait is bounded.
        for client in (self.watch, self.decisions, self.dead_letters):
            if client is not None:
                client.halt()
        for task in self.tasks.values():
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks.values(), timeout=CLIENT_STOP_DEADLINE)
        stops: list[tuple[str, Any, float]] = [
            (f"worker {w.worker_id}", w, WORKER_STOP_GRACE) for w in self.workers
        ]
        stops += [(f"the {a.kind} API", a, SERVICE_STOP_GRACE) for a in self.apis]
        if self.pipeline is not None:
            stops.append(("the pipeline", self.pipeline, SERVICE_STOP_GRACE))
        if stops:
            say(f"stopping {len(self.workers)} worker(s), the pipeline and the APIs")
            results = await asyncio.gather(*(asyncio.to_thread(p.stop, grace) for _, p, grace in stops))
            for (name, _, grace), stopped in zip(stops, results, strict=True):
                if not stopped:
                    say(f"{name} did not stop within {grace:.0f} s: killed it")
        clients: list[Any] = [self.watch, self.decisions, self.dead_letters, self.producer]
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
    """Run the demo; 0 when every payment was decided, none too early and the services caught up."""
    if duration < 0 or rate < 0 or workers < 1:
        say("demo: --duration and --rate must not be negative, --workers must be at least 1")
        return 1
    try:
        return asyncio.run(Demo(settings, duration, rate, workers).run())
    except KeyboardInterrupt:  # a Ctrl-C before our handler was installed
        return 130
