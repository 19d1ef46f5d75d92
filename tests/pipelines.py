"""Running the Spark pipeline in tests: in-process on the module's SparkSession (`Running`) or as the
`aml-app pipeline` command (`PipelineProcess`), watching its groups and stores (`Watch`), and checking its
stores against the naive reference."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from aml_app.dependencies import relations
from aml_app.dependencies.store import Writer
from aml_app.harness.child_process import AmlAppProcess
from aml_app.kafka.broker import EmbeddedBroker, free_port
from aml_app.pipeline.jobs import BatchReport
from aml_app.pipeline.progress import GroupProgress
from aml_app.pipeline.runner import Pipeline, kafka_config, start_pipeline
from aml_app.settings import DependencySettings, KafkaSettings, PipelineSettings, Settings
from aml_app.training.reference import exact_from, reference_aggregates, reference_relations
from tests.harness import Names, wait_until
from tests.payments import Produced
from tests.stores import aggregates_answers, relations_answers, schema_of, without_as_of

CATCH_UP = 120.0  # seconds for a pipeline to catch up with a few thousand payments on 2 busy cores


def pipeline_settings(broker: EmbeddedBroker, names: Names, store_url: str, **pipeline: Any) -> Settings:
    """The pipeline's settings on the test's topics and store; `pipeline` changes `PipelineSettings`."""
    relations_group, aggregates_group = names.deps
    return (
        Settings(
            kafka=KafkaSettings(
                bootstrap_servers=(broker.bootstrap,), payments_topic=names.payments, dlq_topic=names.dlq
            ),
            dependencies=DependencySettings(store_url=store_url),
            pipeline=PipelineSettings(**{"trigger_interval": 0.2, "metrics_port": free_port(), **pipeline}),
        )
        .with_endpoint("relations", group=relations_group)
        .with_endpoint("aggregates", group=aggregates_group)
    )


class Running:
    """A started pipeline plus what a test needs to watch it."""

    def __init__(self, spark: Any, settings: Settings) -> None:
        self.settings = settings
        self.reports: list[BatchReport] = []
        self.lock = threading.Lock()
        self.stopped = False
        self.pipeline: Pipeline = start_pipeline(spark, settings, on_batch=self._record)
        config = kafka_config(settings)
        self.progress = {
            g: GroupProgress(config, settings.kafka.payments_topic, g)
            for g in (settings.relations_group, settings.aggregates_group)
        }

    def _record(self, report: BatchReport) -> None:
        with self.lock:
            self.reports.append(report)

    def failure(self) -> str | None:
        return self.pipeline.failure()

    async def committed(self, partitions: Iterable[int]) -> dict[str, dict[int, int]]:
        return {g: await asyncio.to_thread(p.committed, partitions) for g, p in self.progress.items()}

    async def caught_up(self, ends: dict[int, int], timeout: float = CATCH_UP) -> None:
        async def done() -> bool:
            failure = self.failure()
            assert failure is None, failure
            committed = await self.committed(sorted(ends))
            return all(c == ends for c in committed.values())

        await wait_until(done, timeout, f"both groups to commit up to the log end {ends}", interval=0.2)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.pipeline.stop()
        for progress in self.progress.values():
            progress.close()


def log_ends(produced: Produced, partitions: int) -> dict[int, int]:
    ends = dict.fromkeys(range(partitions), 0)
    for p, o in [(r.partition, r.offset) for r in produced.valid] + [
        (p, o) for p, o, _ in produced.malformed
    ]:
        ends[p] = max(ends[p], o + 1)
    return ends


def merge(*batches: Produced) -> Produced:
    return Produced([r for b in batches for r in b.valid], [m for b in batches for m in b.malformed])


async def check_against_reference(settings: Settings, produced: Produced, batches: list[list[Any]]) -> None:
    """Every account's answers from both stores equal the naive reference, at instants across the windows."""
    start = exact_from(batches)
    assert start is not None
    instants = [start + timedelta(hours=h) for h in (0, 0.5, 1, 23.9, 24, 30)] + [
        r.ts for r in produced.valid[:20] if r.ts >= start
    ]
    accounts = [*produced.accounts, "acct-unknown"]
    for hops in (1, 2, 3):
        answers = await relations_answers(
            settings.dependencies.store_url, [(a, hops, relations.PARTS) for a in accounts]
        )
        for account, answer in zip(accounts, answers, strict=True):
            assert without_as_of(answer) == reference_relations(produced.valid, account, hops), (
                account,
                hops,
            )
    for at in instants:
        answers = await aggregates_answers(
            settings.dependencies.store_url, [(a, at) for a in accounts], settings
        )
        for account, answer in zip(accounts, answers, strict=True):
            expected = reference_aggregates(
                batches,
                account,
                at,
                settings.dependencies.reporting_threshold,
                settings.dependencies.threshold_band,
            )
            assert without_as_of(answer) == expected, (account, at)


class PipelineProcess(AmlAppProcess):
    """`aml-app pipeline` run as a user runs it; its log keeps the lines of earlier runs."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        super().__init__(["pipeline"], env, log_path, append=True)

    def signal(self, sig: int, wait: float = 30) -> None:
        """`sig` to its process group, then wait for it to end."""
        self.signal_group(sig)
        if self.process is not None:
            self.process.wait(wait)

    def stop(self, wait: float) -> int:
        """SIGTERM to its process group, as honcho or a shell stops it; its exit code, which must come
        within `wait` seconds."""
        self.signal_group(signal.SIGTERM)
        assert self.wait(wait), f"still running {wait:.0f} s after SIGTERM:\n{self.log_tail()}"
        assert self.returncode is not None
        return self.returncode


def pipeline_env(broker: EmbeddedBroker, names: Names, settings: Settings) -> dict[str, str]:
    return {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        "AML_PAYMENTS_TOPIC": names.payments,
        "AML_DLQ_TOPIC": names.dlq,
        "AML_RELATIONS_GROUP": settings.relations_group,
        "AML_AGGREGATES_GROUP": settings.aggregates_group,
        "AML_STORE_URL": settings.dependencies.store_url,
        "AML_TRIGGER_INTERVAL": "0.2",
        "AML_MAX_RECORDS_PER_TRIGGER": str(settings.pipeline.max_records_per_trigger),
        "AML_PIPELINE_METRICS_PORT": str(settings.pipeline.metrics_port),
    }


class Watch:
    """Samples each group's committed offsets, then its store's applied offsets (which only grow), and
    records every sample where a group was ahead of its store."""

    def __init__(self, broker: EmbeddedBroker, names: Names, settings: Settings) -> None:
        config = {"bootstrap.servers": broker.bootstrap}
        self.partitions = range(names.partitions)
        self.progress = {g: GroupProgress(config, names.payments, g) for g in names.deps}
        services = {settings.relations_group: "relations", settings.aggregates_group: "aggregates"}
        self.stores = {
            g: Writer(settings.dependencies.store_url, schema_of(services[g]), patience=5) for g in names.deps
        }
        self.ahead: list[tuple[str, dict[int, int], dict[int, int]]] = []
        self.samples = 0

    async def committed(self, group: str) -> dict[int, int]:
        return await asyncio.to_thread(self.progress[group].committed, self.partitions)

    async def sample(self) -> dict[str, int]:
        applied_total = {}
        for group, store in self.stores.items():
            committed = await self.committed(group)
            applied = await asyncio.to_thread(store.applied_offsets)
            self.samples += 1
            if any(o > applied.get(p, 0) for p, o in committed.items()):
                self.ahead.append((group, committed, applied))
            applied_total[group] = sum(applied.values())
        return applied_total

    async def caught_up(self, ends: dict[int, int]) -> bool:
        await self.sample()
        return all([await self.committed(g) == ends for g in self.progress])

    def close(self) -> None:
        for progress in self.progress.values():
            progress.close()
        for store in self.stores.values():
            store.close()


async def wait_caught_up(
    pipeline: PipelineProcess, watch: Watch, ends: dict[int, int], what: str, timeout: float = 300
) -> None:
    """Wait until both groups have committed up to `ends` (`what` says after what), failing at once with
    the end of the pipeline's log if it dies meanwhile."""

    async def caught_up() -> bool:
        assert pipeline.alive(), f"pipeline died:\n{pipeline.log_tail()}"
        return await watch.caught_up(ends)

    await wait_until(caught_up, timeout, f"both groups to reach the log end {what}")


#: The streaming reader's Python process: Spark starts one per query and waits 10 s for it to connect back.
STREAMING_READER = "pyspark.sql.streaming.python_streaming_source_runner"


def python_slow_to_start_a_reader(folder: Path) -> Path:
    """A Python for Spark's workers whose first streaming reader takes longer than Spark's 10 s wait to
    start, as on an overloaded host: it never connects back, and exits. The rest start as usual."""
    stalled, script = folder / "stalled", folder / "python"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$2" = "{STREAMING_READER}" ] && [ ! -e "{stalled}" ]; then\n'
        f'  : > "{stalled}"\n'
        "  sleep 11\n"
        "  exit 1\n"
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    script.chmod(0o755)
    return script
