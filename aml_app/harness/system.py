"""The whole system as real processes: broker, PostgreSQL, Spark pipeline (B and C), their APIs (two
replicas each), gated workers.

`System` starts what a user would start, each as its own process (`aml-app broker` and `aml-app postgres`
are replaced by embedded server objects, or `KAFKA_BOOTSTRAP_SERVERS` and `AML_STORE_URL` name a cluster
and a database), watches it, reads what it writes (`aml_app.harness.tails`) and stops everything, each step
bounded, whatever happened. The demo, the end-to-end tests and the benchmarks share it, so each of them
runs the system exactly as the others do.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aml_app import dependency_services as registry
from aml_app.enrichment import DEAD_LETTER_WORKER
from aml_app.harness.dependencies import ApiProcess, CommitWatch, ServiceProcess
from aml_app.harness.embedded_postgres import READER, WRITER, EmbeddedPostgres
from aml_app.harness.tails import DeadLetterTail, RecordTail
from aml_app.harness.workers import WorkerProcess
from aml_app.kafka.broker import EmbeddedBroker, create_topics, free_port, port_free, wait_until_answering
from aml_app.settings import Settings
from aml_app.topics import review_topic, service_topics, topic_specs

API_DEADLINE = 60.0
WORKER_DEADLINE = 90.0
PIPELINE_DEADLINE = 180.0  # Spark starts in 10-25 s on two cores, more when the machine is busy
WORKER_STOP_GRACE = 15.0
SERVICE_STOP_GRACE = 30.0
CLIENT_STOP_DEADLINE = 10.0
PORT_PICKS = 50  # random ports tried for a server whose own port is taken
# Tansu holds a group join for about half the session timeout: keep it short so workers start fast.
WORKER_SESSION_TIMEOUT = "6"
PIPELINE_RUNNING = "pipeline running"  # the runner's log line once both queries are started


def _locked(path: Path) -> int | None:
    """An open descriptor holding an exclusive lock on `path` (until it is closed), or None when another
    holds it. OSError when the file cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class SystemFailure(RuntimeError):
    """Something the system depends on failed; the message says what (with the end of a log)."""


class Interrupted(Exception):
    """A stop was requested before the system was up."""


def failure(name: str, process: WorkerProcess | ServiceProcess, what: str, lines: int = 25) -> str:
    """Why we give up on a process: its log's first error, when the end of its log does not show it."""
    end = process.log_tail(lines)
    tail = "\n".join("    " + line for line in end.splitlines())
    first = process.first_error()
    error = f"; its first error:\n    {first}\n  and" if first is not None and first not in end else ";"
    return f"{name} {what}{error} the end of {process.log_path}:\n{tail}"


def service_settings(settings: Settings, service: str, suffix: str = "") -> Settings:
    """The settings of one detecting service's workers: its own group and topics, the rest shared.

    `suffix` goes into the group and topic names, so that runs sharing a broker (tests) never share a
    Faust app's internal topics (its watermark table, its dedupe table).
    """
    decisions, alerts = service_topics(service, suffix)
    kafka = replace(
        settings.kafka,
        decisions_topic=decisions,
        alerts_topic=alerts,
        review_topic=review_topic(service, suffix),
    )
    return replace(settings, service=service, app_id=f"{service}{suffix}", kafka=kafka)


@dataclass
class Layout:
    """What to run: worker counts per service, the gate, and per-service trigger intervals of Spark."""

    workers: Mapping[str, int] = field(default_factory=lambda: {"aml": 1, "fraud": 1})
    gate: bool = True
    triggers: Mapping[str, float] = field(default_factory=dict)
    worker_env: Mapping[str, str] = field(default_factory=dict)
    #: Appended to the services' group and topic names (tests on a shared broker).
    suffix: str = ""
    #: An existing broker to use (tests); else KAFKA_BOOTSTRAP_SERVERS, else an embedded one.
    bootstrap: tuple[str, ...] = ()
    #: An existing, empty database for the stores (tests); else, with KAFKA_BOOTSTRAP_SERVERS,
    #: AML_STORE_URL; else an embedded PostgreSQL server of our own with a fresh database.
    store_url: str = ""
    #: Replicas of each API; the workers spread their requests over them.
    api_replicas: int = 2
    #: Load pg_stat_statements into an embedded PostgreSQL server (benchmarks: its time by statement).
    postgres_statements: bool = False


class System:
    """Owns every process and client it starts, so `cleanup` can always stop them."""

    def __init__(
        self,
        settings: Settings,
        folder: Path,
        layout: Layout,
        say: Callable[[str], None] = print,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.layout = layout
        self.folder = folder.resolve()
        self.say = say
        self.stop_requested = stop or asyncio.Event()
        # The APIs and the workers' web servers answer only with a token, as a deployment's should: one
        # made up for this run unless AML_API_TOKEN / AML_WEB_TOKEN gives one (the workers, the
        # harness's own checks and the printed page addresses carry them).
        api_token = settings.dependencies.api_token or secrets.token_urlsafe(24)
        self.settings = replace(
            settings,
            dependencies=replace(settings.dependencies, api_token=api_token),
            web=replace(settings.web, token=settings.web.token or secrets.token_urlsafe(24)),
        )
        self.broker: EmbeddedBroker | None = None
        self.postgres: EmbeddedPostgres | None = None
        self.bootstrap: list[str] = []
        self.pipeline: ServiceProcess | None = None
        #: The enrichment stage (`aml-app enrich`), run when a dependency reads the topic it derives.
        self.stage: ServiceProcess | None = None
        self.apis: dict[str, ApiProcess] = {}
        self.workers: dict[str, list[WorkerProcess]] = {}
        self.watch: CommitWatch | None = None
        self.decisions: dict[str, RecordTail] = {}
        self.alerts: dict[str, RecordTail] = {}
        self.dead_letters: DeadLetterTail | None = None
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.killed: set[str] = set()  # worker ids killed on purpose
        #: Open files whose locks reserve the ports this system's servers were given (`reserve`).
        self.reserved: list[int] = []

    # ---- start-up

    @property
    def groups(self) -> tuple[str, ...]:
        """Every group the watch follows: what the gate waits for, and the pipeline's own groups."""
        s = self.settings
        return tuple(dict.fromkeys((*s.depends_on, s.relations_group, s.aggregates_group)))

    @property
    def services(self) -> list[str]:
        return [service for service, n in self.layout.workers.items() if n > 0]

    async def start(self) -> None:
        """Broker, topics, pipeline, APIs, workers, then the commit watch and the topic readers."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.hold_folder()
        await self.start_broker()
        if self.stop_requested.is_set():
            raise Interrupted
        kafka = replace(self.settings.kafka, bootstrap_servers=tuple(self.bootstrap))
        self.settings = replace(self.settings, kafka=kafka)
        await self.start_store()
        await create_topics(self.bootstrap, topic_specs(self.settings, self.layout.suffix))
        self.start_services()
        self.start_workers()
        s = self.settings
        self.watch = CommitWatch(
            self.bootstrap, s.kafka.payments_topic, self.groups, s.kafka.security, s.derived_dependencies
        )
        self.tasks["commit watch"] = asyncio.create_task(self.watch.run())
        await self.start_tails()

    async def start_broker(self) -> None:
        """The layout's broker, else KAFKA_BOOTSTRAP_SERVERS when given, else an embedded one of our own."""
        if self.layout.bootstrap:
            self.bootstrap = list(self.layout.bootstrap)
        elif os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip():
            if self.settings.kafka.security.protocol != "PLAINTEXT":
                # Its topic set-up and readers speak plaintext: one sentence, not 20 s to "unreachable".
                raise SystemFailure(
                    f"KAFKA_SECURITY_PROTOCOL={self.settings.kafka.security.protocol}: the demo and the "
                    "test systems reach a plaintext cluster only; leave KAFKA_BOOTSTRAP_SERVERS unset "
                    "for an embedded broker"
                )
            self.bootstrap = list(self.settings.kafka.bootstrap_servers)
            self.say(f"using the Kafka cluster at {','.join(self.bootstrap)} (KAFKA_BOOTSTRAP_SERVERS)")
        else:
            port = self.free("AML_BROKER_PORT", "the embedded broker", self.settings.kafka.broker_port)
            log_path = self.folder / "broker.log"
            log_path.write_bytes(b"")
            # Worker state from an earlier run belongs to a broker that no longer exists.
            shutil.rmtree(self.folder / "data", ignore_errors=True)
            self.broker = EmbeddedBroker(port, log_path=log_path)
            await asyncio.to_thread(self.broker.start)
            self.bootstrap = [self.broker.bootstrap]
        await wait_until_answering(self.bootstrap)

    async def start_store(self) -> None:
        """The layout's database, else AML_STORE_URL with a cluster of the user's, else a fresh database on
        an embedded PostgreSQL server of our own (an embedded broker starts empty: so must the stores)."""
        if self.layout.store_url:
            dependencies = replace(self.settings.dependencies, store_url=self.layout.store_url)
            self.settings = replace(self.settings, dependencies=dependencies)
        elif self.broker is None and os.environ.get("AML_STORE_URL", "").strip():
            self.say("using the PostgreSQL database at AML_STORE_URL")
        else:
            from psycopg.conninfo import conninfo_to_dict

            wanted = int(conninfo_to_dict(self.settings.dependencies.store_url).get("port") or 5433)
            port = self.free("AML_STORE_URL's port", "the embedded PostgreSQL server", wanted)
            self.postgres = EmbeddedPostgres(
                self.folder / "postgres", port, statements=self.layout.postgres_statements
            )
            await asyncio.to_thread(self.postgres.start)
            await asyncio.to_thread(self.postgres.drop_database, "aml")
            await asyncio.to_thread(self.postgres.create_database, "aml")
            # Least privilege: the pipeline writes as the stores' owner, the APIs may only read.
            dependencies = replace(
                self.settings.dependencies,
                store_url=self.postgres.url("aml", WRITER),
                api_store_url=self.postgres.url("aml", READER),
            )
            self.settings = replace(self.settings, dependencies=dependencies)

    def hold_folder(self) -> None:
        """Take the run's folder for this system until `cleanup`: a second run there would empty the
        first's logs and worker state and stop its PostgreSQL server (one data directory, one
        postmaster.pid)."""
        fd = _locked(self.folder / ".lock")
        if fd is None:
            raise SystemFailure(
                f"{self.folder} is in use by another run (a demo or a test's system): wait for it to end"
            )
        self.reserved.append(fd)

    def free(self, variable: str, who: str, port: int) -> int:
        """`port`, or a free one when it is taken (said out loud); reserved until `cleanup`."""
        if self.reserve(port):
            return port
        chosen = self.any_free(who, f"{variable}: {port} is busy")
        self.say(f"port {port} is busy ({variable}): {who} uses {chosen}")
        return chosen

    def any_free(self, who: str, why: str = "") -> int:
        """A free port, reserved until `cleanup`."""
        for _ in range(PORT_PICKS):
            chosen = free_port()
            if self.reserve(chosen):
                return chosen
        raise SystemFailure(f"no free port for {who} after {PORT_PICKS} tries" + (f" ({why})" if why else ""))

    def reserve(self, port: int) -> bool:
        """Take `port` for one of this system's servers if it is free and no other system holds it.

        A server binds its port seconds after the harness chose it (Spark's start, initdb), so two systems
        starting side by side (two demos, tests on two processes) would both find a default port free.
        Each reservation is an exclusive lock on a file named for the port, held until `cleanup` (or this
        process's end)."""
        try:
            fd = _locked(Path(tempfile.gettempdir()) / f"aml-app-port-{port}.lock")
        except OSError:  # another user's lock file
            return False
        if fd is None:
            return False
        if not port_free("127.0.0.1", port):
            os.close(fd)
            return False
        self.reserved.append(fd)
        return True

    @property
    def dead_letter_sources(self) -> tuple[str, ...]:
        """Who dead-letters a malformed payment besides the gated services: B's and C's groups, or the
        enrichment stage for a group that reads the topic it derives (which holds valid payments only)."""
        s = self.settings
        return tuple(
            DEAD_LETTER_WORKER if self.runs_stage and group in s.derived_dependencies else group
            for group in (s.relations_group, s.aggregates_group)
        )

    @property
    def runs_stage(self) -> bool:
        """Whether a dependency reads the topic the enrichment stage derives (AML_DERIVED_DEPENDENCIES)."""
        s = self.settings
        return (s.kafka.enriched_topic, s.kafka.enrichment_group) in s.derived_dependencies.values()

    def start_services(self) -> None:
        """The enrichment stage when a dependency reads its topic, the pipeline and the replicas of the
        two APIs reading its stores."""
        port = self.settings.pipeline.metrics_port
        if port:
            port = self.free("AML_PIPELINE_METRICS_PORT", "the pipeline's /metrics", port)
            self.settings = replace(
                self.settings, pipeline=replace(self.settings.pipeline, metrics_port=port)
            )
        if self.runs_stage and self.settings.pipeline.enrichment_metrics_port:
            port = self.free(
                "AML_ENRICHMENT_METRICS_PORT",
                "the enrichment stage's /metrics",
                self.settings.pipeline.enrichment_metrics_port,
            )
            pipeline = replace(self.settings.pipeline, enrichment_metrics_port=port)
            self.settings = replace(self.settings, pipeline=pipeline)
        s = self.settings
        if self.runs_stage:
            self.stage = self._start_stage(self.folder / "enrich.log")
        args = ["pipeline"] + [f"--trigger={svc}={sec:g}" for svc, sec in self.layout.triggers.items()]
        self.pipeline = ServiceProcess("pipeline", args, s, self.folder / "pipeline.log").start()
        for kind, service in registry.SERVICES.items():
            first = service.port(s)
            for replica in range(1, self.layout.api_replicas + 1):
                name = kind if replica == 1 else f"{kind}-{replica}"
                # Every replica's port is reserved: a system starting beside this one must not take it.
                port = (
                    self.free(f"the port of {name}", f"the {name} API", first)
                    if replica == 1
                    else self.any_free(f"the {name} API")
                )
                own = service.with_port(s, port)
                self.apis[name] = ApiProcess(
                    kind, own, self.folder / f"{name}-api.log", name=f"{name} API"
                ).start()

    def _start_stage(self, log_path: Path) -> ServiceProcess:
        s = self.settings
        return ServiceProcess(
            "enrichment",
            ["enrich"],
            s,
            log_path,
            # The same transactional id across restarts: a new stage fences off (aborts) what the old
            # one left open.
            AML_ENRICHMENT_ID=f"{s.kafka.enrichment_group}-0",
            AML_SESSION_TIMEOUT=WORKER_SESSION_TIMEOUT,
        ).start()

    def restart_stage(self) -> ServiceProcess:
        """Start the enrichment stage again after it stopped or was killed (a crash test)."""
        old = self.stage
        if old is None or old.alive():
            raise RuntimeError("the enrichment stage is not stopped")
        self.stage = self._start_stage(old.log_path.with_suffix(".restarted.log"))
        return self.stage

    def live_api(self, kind: str) -> ApiProcess:
        """A running replica of `kind` (the first one, when none runs)."""
        replicas = [api for api in self.apis.values() if api.kind == kind]
        return next((api for api in replicas if api.alive()), replicas[0])

    def api_urls(self, kind: str) -> str:
        """AML_RELATIONS_URL / AML_AGGREGATES_URL for the workers: every replica of `kind`."""
        return ",".join(api.url for api in self.apis.values() if api.kind == kind)

    def start_workers(self) -> None:
        port = self.settings.web.port
        for service in self.services:
            for _ in range(self.layout.workers[service]):
                self.add_worker(service, port)
                port += 1

    def add_worker(self, service: str, port: int | None = None) -> WorkerProcess:
        """Start one more worker of `service` (also after start-up: scaling, or a restart after a kill)."""
        running = self.workers.setdefault(service, [])
        worker_id = f"{service}-{len(running)}"
        port = self.free("AML_WEB_PORT", f"worker {worker_id}", port or free_port())
        worker = WorkerProcess(
            service_settings(self.settings, service, self.layout.suffix),
            port=port,
            worker_id=worker_id,
            data_dir=self.folder / "data",
            log_path=self.folder / f"worker-{worker_id}.log",
            AML_SESSION_TIMEOUT=WORKER_SESSION_TIMEOUT,
            AML_REBALANCE_TIMEOUT=WORKER_SESSION_TIMEOUT,
            AML_GATE="on" if self.layout.gate else "off",
            # Environment variables only: mypy cannot rule out that the mappings fill cwd or executable.
            **{dep.urls_env: self.api_urls(kind) for kind, dep in registry.SERVICES.items()},  # type: ignore[arg-type]
            **self.layout.worker_env,  # type: ignore[arg-type]
        )
        running.append(worker.start())
        if self.dead_letters is not None:
            self.dead_letters.worker_services[worker_id] = service
        return worker

    async def start_tails(self) -> None:
        s = self.settings
        for service in self.services:
            own = service_settings(s, service, self.layout.suffix)
            self.decisions[service] = RecordTail(self.bootstrap, own.kafka.decisions_topic)
            self.alerts[service] = RecordTail(self.bootstrap, own.kafka.alerts_topic)
        self.dead_letters = DeadLetterTail(self.bootstrap, s.kafka.dlq_topic, self.groups)
        for service, workers in self.workers.items():
            for worker in workers:
                self.dead_letters.worker_services[worker.worker_id] = service
        tails = {
            **{f"{svc} decisions reader": t for svc, t in self.decisions.items()},
            **{f"{svc} alerts reader": t for svc, t in self.alerts.items()},
            "dead-letter reader": self.dead_letters,
        }
        for name, tail in tails.items():
            await tail.start(s.kafka.partitions)
            self.tasks[name] = asyncio.create_task(tail.run())

    @property
    def all_workers(self) -> list[WorkerProcess]:
        return [w for workers in self.workers.values() for w in workers]

    async def wait_ready(self) -> None:
        """The APIs answer /health, every worker has recovered, the pipeline's queries run."""
        self.say(
            f"waiting for the services (APIs up to {API_DEADLINE:.0f} s, workers {WORKER_DEADLINE:.0f} s, "
            f"Spark {PIPELINE_DEADLINE:.0f} s)"
        )
        started = time.monotonic()

        async def until(
            what: str, ready: Callable[[], Awaitable[bool]], deadline: float, process: Any
        ) -> None:
            while not await ready():
                if self.stop_requested.is_set():
                    raise Interrupted
                self.check_processes()
                if time.monotonic() - started > deadline:
                    raise SystemFailure(failure(what, process, f"was not ready within {deadline:.0f} s"))
                await asyncio.sleep(0.25)
            self.say(f"  {what} ready after {time.monotonic() - started:.1f} s")

        for api in self.apis.values():
            await until(f"the {api.name}", functools.partial(self._answers, api), API_DEADLINE, api)
        for w in self.all_workers:
            await until(f"worker {w.worker_id}", functools.partial(self.recovered, w), WORKER_DEADLINE, w)
        pipeline = self.pipeline
        assert pipeline is not None
        await until("the pipeline", lambda: self._running(pipeline), PIPELINE_DEADLINE, pipeline)

    @staticmethod
    async def _answers(api: ApiProcess) -> bool:
        return await api.health() is not None

    @staticmethod
    async def recovered(worker: WorkerProcess) -> bool:
        state = await worker.state()
        return state is not None and state.get("recovering") is False

    @staticmethod
    async def _running(pipeline: ServiceProcess) -> bool:
        return PIPELINE_RUNNING in await asyncio.to_thread(pipeline.log_text)

    # ---- while it runs

    def check_processes(self) -> None:
        """A dead worker, pipeline or API ends the run with the end of its log, not with a hang."""
        for worker in self.all_workers:
            if worker.process is not None and not worker.alive() and worker.worker_id not in self.killed:
                raise SystemFailure(failure(f"worker {worker.worker_id}", worker, "exited"))
        if self.pipeline is not None and not self.pipeline.alive() and not self.pipeline.stopped:
            code = self.pipeline.returncode
            raise SystemFailure(failure("the pipeline", self.pipeline, f"exited with code {code}", 40))
        if self.stage is not None and not self.stage.alive() and not self.stage.stopped:
            code = self.stage.returncode
            raise SystemFailure(failure("the enrichment stage", self.stage, f"exited with code {code}"))
        for api in self.apis.values():
            if not api.alive() and not api.stopped:
                raise SystemFailure(failure(f"the {api.name}", api, f"exited with code {api.returncode}"))

    def check_health(self, extra: Mapping[str, asyncio.Task[Any]] | None = None) -> None:
        """Processes alive, and no reader or helper task crashed."""
        self.check_processes()
        for name, task in {**self.tasks, **(extra or {})}.items():
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise SystemFailure(f"the {name} failed: {task.exception()!r}")

    def restart_api(self, name: str) -> ApiProcess:
        """Start a stopped API replica again on the same port (an outage test)."""
        old = self.apis[name]
        if old.alive():
            raise RuntimeError(f"the {name} API is still running")
        log_path = old.log_path.with_suffix(".restarted.log")
        self.apis[name] = ApiProcess(old.kind, old.settings, log_path, name=old.name).start()
        return self.apis[name]

    def kill_worker(self, worker: WorkerProcess) -> None:
        """kill -9 a worker on purpose (a crash test): the health check then leaves it alone."""
        self.killed.add(worker.worker_id)
        worker.kill()

    async def waiting(self) -> tuple[int, float, bool]:
        """(partitions held by a gate, the longest hold in seconds, whether every worker answered)."""
        live = [w for w in self.all_workers if w.alive()]
        states = await asyncio.gather(*(w.state() for w in live))
        waiting: set[tuple[str, str]] = set()
        oldest = time.time()
        for worker, state in zip(live, states, strict=True):
            if state:
                service = worker.env.get("AML_SERVICE", "")
                waiting |= {(service, p) for p in state.get("waiting", {})}
                oldest = min([oldest, *state.get("blocked_since", {}).values()])
        return len(waiting), time.time() - oldest, all(s is not None for s in states)

    # ---- the end

    async def cleanup(self) -> None:
        """Stop everything we started, each step bounded, whatever happened before."""
        readers: list[Any] = [self.watch, *self.decisions.values(), *self.alerts.values(), self.dead_letters]
        # Python 3.11's asyncio.wait_for can lose a cancellation (aiokafka and the offset reader use it),
        # so the loops also stop on a flag, and the wait is bounded.
        for client in readers:
            if client is not None:
                client.halt()
        for task in self.tasks.values():
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks.values(), timeout=CLIENT_STOP_DEADLINE)
        stops: list[tuple[str, Any, float]] = [
            (f"worker {w.worker_id}", w, WORKER_STOP_GRACE) for w in self.all_workers
        ]
        stops += [(f"the {name} API", a, SERVICE_STOP_GRACE) for name, a in self.apis.items()]
        if self.pipeline is not None:
            stops.append(("the pipeline", self.pipeline, SERVICE_STOP_GRACE))
        if self.stage is not None:
            stops.append(("the enrichment stage", self.stage, SERVICE_STOP_GRACE))
        if stops:
            self.say(f"stopping {len(self.all_workers)} worker(s), the pipeline and the APIs")
            results = await asyncio.gather(*(asyncio.to_thread(p.stop, grace) for _, p, grace in stops))
            for (name, _, grace), stopped in zip(stops, results, strict=True):
                if not stopped:
                    self.say(f"{name} did not stop within {grace:.0f} s: killed it")
        for client in readers:
            if client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.stop(), CLIENT_STOP_DEADLINE)
        if self.broker is not None:
            self.say("stopping the embedded broker")
            await asyncio.to_thread(self.broker.stop)
        if self.postgres is not None:
            self.say("stopping the embedded PostgreSQL server")
            await asyncio.to_thread(self.postgres.stop)
        reserved, self.reserved = self.reserved, []
        for fd in reserved:
            os.close(fd)
