"""The dependency services B and C seen from the outside: their processes, and their progress.

`ServiceProcess`/`ApiProcess` run them as a user does (`aml-app pipeline`, `aml-app serve
relations|aggregates`), like `aml_app.harness.workers` runs AML workers: each in a process group of its own (a
Ctrl-C in the caller's terminal does not reach it; `stop` reaches it and the JVM it started), with its own
log file, configured from a `Settings` spelled out in its environment rather than from whatever the
caller's environment says. `CommitWatch` follows their consumer groups' committed offsets on the broker,
the progress the gate reads, and dates it for the premature-decision check (`aml_app.harness.verify`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from aml_app import dependency_services as registry
from aml_app.harness.child_process import AmlAppProcess
from aml_app.harness.verify import CommitTimeline
from aml_app.harness.workers import settings_env
from aml_app.kafka.offsets import DependencyOffsets, OffsetReadError
from aml_app.kafka.security import KafkaSecurity
from aml_app.settings import Settings
from aml_app.tokens import bearer

# Spark draws progress bars on stderr with carriage returns: noise in a log file.
SPARK_SUBMIT_ARGS = "--conf spark.ui.showConsoleProgress=false pyspark-shell"
COMMIT_POLL_EVERY = 0.05


def services_env(settings: Settings) -> dict[str, str]:
    """`settings_env` plus everything the pipeline and the APIs read."""
    archives = settings.pipeline.class_archives  # from this process's working directory, not the child's
    return {
        **settings_env(settings),
        **{s.port_env: str(s.port(settings)) for s in registry.SERVICES.values()},
        "AML_STORE_URL": settings.dependencies.store_url,
        "AML_API_STORE_URL": settings.dependencies.api_store_url,
        "AML_SERVICES_HOST": settings.dependencies.services_host,
        "AML_REPORTING_THRESHOLD": str(settings.dependencies.reporting_threshold),
        "AML_THRESHOLD_BAND": str(settings.dependencies.threshold_band),
        "AML_SPARK_MASTER": settings.pipeline.spark_master,
        "AML_TRIGGER_INTERVAL": str(settings.pipeline.trigger_interval),
        "AML_MAX_RECORDS_PER_TRIGGER": str(settings.pipeline.max_records_per_trigger),
        "AML_SPARK_CLASS_ARCHIVES": "" if archives is None else str(archives.resolve()),
        "AML_MAX_PAYMENT_BYTES": str(settings.kafka.max_payment_bytes),
        "AML_MAX_CLOCK_SKEW": str(settings.kafka.max_clock_skew),
        "AML_API_CACHE_ANSWERS": str(settings.dependencies.api_cache_answers),
        "AML_PIPELINE_METRICS_PORT": str(settings.pipeline.metrics_port),
        "AML_ENRICHED_TOPIC": settings.kafka.enriched_topic,
        "AML_ENRICHMENT_GROUP": settings.kafka.enrichment_group,
        "AML_ENRICHMENT_METRICS_PORT": str(settings.pipeline.enrichment_metrics_port),
    }


class ServiceProcess(AmlAppProcess):
    """`aml-app <args>` in its own process group, stdout and stderr in `log_path` (emptied on start)."""

    def __init__(self, name: str, args: list[str], settings: Settings, log_path: Path, **env: str) -> None:
        environment = {**os.environ, **services_env(settings), **env}
        environment.setdefault("PYSPARK_SUBMIT_ARGS", SPARK_SUBMIT_ARGS)
        super().__init__(args, environment, log_path)
        self.name = name
        self.stopped = False  # a stop was asked for: the exit that follows is no crash

    def kill(self) -> None:
        """kill -9 the process and its group, on purpose (a crash test): not taken for a failure."""
        self.stopped = True
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.wait(10)

    def stop(self, grace: float = 30) -> bool:
        """SIGTERM the process itself, SIGKILL its group after `grace` seconds; False if it had to be killed.

        Only the process gets the SIGTERM: the pipeline stops its queries and Spark in order, which a JVM
        that got the same signal at the same moment would not let it do. Whatever of the group outlives
        it (a JVM that did not exit) is killed.
        """
        if self.process is None or self.stopped:
            return True
        # Set before the signal: a health check running meanwhile must not take this exit for a crash.
        self.stopped = True
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
        stopped = self.wait(grace)
        # The process when it did not stop, else what of its group outlived it, right away and once: a
        # group id is not handed out again while a member lives, and an empty group answers ESRCH.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if not stopped:
            self.wait(10)
        return stopped


class ApiProcess(ServiceProcess):
    """`aml-app serve relations|aggregates` on the port its settings name."""

    def __init__(self, kind: str, settings: Settings, log_path: Path, name: str = "", **env: str) -> None:
        super().__init__(name or f"{kind} API", ["serve", kind], settings, log_path, **env)
        self.kind = kind
        self.settings = settings
        port = registry.service(kind).port(settings)
        self.url = f"http://{settings.dependencies.services_host}:{port}"
        #: What a request to this replica carries: its token, when the APIs want one (AML_API_TOKEN).
        self.headers = bearer(settings.dependencies.api_token)

    async def get(self, path: str, params: dict[str, str] | None = None, timeout: float = 5) -> Any:
        """The JSON answer of GET `path`, or None when the service does not answer 200."""
        try:
            async with (
                aiohttp.ClientSession(headers=self.headers) as session,
                session.get(self.url + path, params=params, timeout=aiohttp.ClientTimeout(timeout)) as r,
            ):
                return await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def health(self) -> dict[str, Any] | None:
        answer = await self.get("/health", timeout=2)
        return answer if isinstance(answer, dict) and answer.get("status") == "ok" else None


def pipeline_process(settings: Settings, log_path: Path) -> ServiceProcess:
    """Both streaming queries in one `aml-app pipeline` (the store from `settings`)."""
    return ServiceProcess("pipeline", ["pipeline"], settings, log_path)


class CommitWatch:
    """Polls the dependency groups' committed offsets and dates every advance in a CommitTimeline.

    A poll that first sees an offset advanced dates it at the start of the previous successful poll,
    which did not see it: the commit became visible after that moment, so the recorded time is a lower
    bound and a decision before it is premature for certain. What the first poll finds was committed
    before the watch started, at an unknown time: it is dated 0 (the epoch).
    """

    def __init__(
        self,
        bootstrap: Sequence[str],
        topic: str,
        groups: Sequence[str],
        security: KafkaSecurity,
        derived: Mapping[str, tuple[str, str]] | None = None,
    ) -> None:
        self.groups = tuple(groups)
        # A group reading a topic derived from payments is placed on payments as the gate places it
        # (`aml_app.kafka.derivation`, checked against a record-by-record model in the unit tests).
        self.offsets = DependencyOffsets(bootstrap, topic, self.groups, security=security, derived=derived)
        self.timeline = CommitTimeline()
        self.polls = 0
        self.advances = 0
        self.failing_since: float | None = None
        self.last_error = ""
        self.polled = asyncio.Event()  # set and replaced after every successful poll
        self.closing = asyncio.Event()

    async def run(self) -> None:
        previous: float | None = None  # wall-clock start of the last successful poll
        while not self.closing.is_set():
            started = time.time()
            try:
                _, committed = await self.offsets.read()
            except OffsetReadError as exc:
                self.failing_since = self.failing_since or time.monotonic()
                self.last_error = str(exc)
            else:
                self.polls += 1
                self.failing_since = None
                self._take(committed, 0.0 if previous is None else previous)
                previous = started
                self.polled.set()
                self.polled = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.closing.wait(), COMMIT_POLL_EVERY)

    def _take(self, committed: dict[str, dict[int, int | None]], at: float) -> None:
        for group, offsets in committed.items():
            known = self.timeline.committed(group)
            for p, o in offsets.items():
                if o is not None and o > known.get(p, -1):
                    self.timeline.record(group, p, o, at)
                    self.advances += 1

    async def settle(self, timeout: float = 5.0) -> None:
        """Wait for a poll that starts now to complete: every commit made so far is then dated."""
        for _ in range(2):  # the poll under way may have started before now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.polled.wait(), timeout)

    def committed(self, group: str) -> dict[int, int]:
        return self.timeline.committed(group)

    def behind(self, group: str, ends: dict[int, int]) -> int:
        """Records of `ends` (partition -> log end) that `group` has not committed past yet."""
        done = self.committed(group)
        return sum(max(0, end - done.get(p, 0)) for p, end in ends.items())

    def status(self, ends: dict[int, int]) -> str:
        parts = [f"{g} {sum(self.committed(g).values())} (lag {self.behind(g, ends)})" for g in self.groups]
        if self.failing_since is not None and time.monotonic() - self.failing_since > 2:
            parts.append(f"[offset polls failing: {self.last_error}]")
        return "  ".join(parts)

    def halt(self) -> None:
        self.closing.set()

    async def stop(self) -> None:
        await self.offsets.close()
