"""Crash the Spark pipeline and restart it from its checkpoint: nothing lost, nothing counted twice, and at
no sample is a committed offset ahead of what the stores (the APIs' data) hold.

First at the worst moment on purpose (the `after-store-write` failpoint: the store holds a batch that
neither the group nor Spark's checkpoint recorded as done, so the restart replays it), then with `kill -9`
of the whole process group (Python driver and JVM) at a random moment of a batch."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
from pathlib import Path

from aiokafka import AIOKafkaProducer

from aml_app.broker import EmbeddedBroker
from aml_app.pipeline.progress import GroupProgress
from aml_app.services.aggregates import AggregatesStore
from aml_app.services.relations import RelationsStore
from aml_app.workers import aml_app_executable
from tests.harness import Names, wait_until
from tests.integration.test_pipeline import check_against_reference, log_ends, pipeline_settings
from tests.payments import produce_payments


class PipelineProcess:
    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env, self.log_path = env, log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> PipelineProcess:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [aml_app_executable(), "pipeline"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int, wait: float = 30) -> None:
        if self.alive():
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            self.process.wait(wait)

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])


async def test_kill_minus_nine_mid_batch_then_restart_from_the_checkpoint(
    broker: EmbeddedBroker, names: Names, producer: AIOKafkaProducer, tmp_path: Path
) -> None:
    settings = pipeline_settings(broker, names, tmp_path, max_records_per_trigger=150)
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        "AML_PAYMENTS_TOPIC": names.payments,
        "AML_DLQ_TOPIC": names.dlq,
        "AML_RELATIONS_GROUP": settings.relations_group,
        "AML_AGGREGATES_GROUP": settings.aggregates_group,
        "AML_STORE_DIR": settings.store_dir,
        "AML_CHECKPOINT_DIR": settings.checkpoint_dir,
        "AML_TRIGGER_INTERVAL": "0.2",
        "AML_MAX_RECORDS_PER_TRIGGER": "150",
    }
    produced = await produce_payments(producer, names.payments, 2400, seed=7)
    ends = log_ends(produced, names.partitions)
    total = sum(ends.values())
    config = {"bootstrap.servers": broker.bootstrap}
    progress = {g: GroupProgress(config, names.payments, g) for g in names.deps}
    stores = {
        names.deps[0]: RelationsStore(settings.relations_db),
        names.deps[1]: AggregatesStore(
            settings.aggregates_db, settings.reporting_threshold, settings.threshold_band
        ),
    }
    ahead: list[tuple[str, dict[int, int], dict[int, int]]] = []
    samples = 0

    async def sample() -> dict[str, int]:
        """Committed first, then the store's offsets (which only grow): committed <= applied must hold."""
        nonlocal samples
        applied_total = {}
        for group, store in stores.items():
            committed = await asyncio.to_thread(progress[group].committed, range(names.partitions))
            applied = store.applied_offsets()
            samples += 1
            if any(o > applied.get(p, 0) for p, o in committed.items()):
                ahead.append((group, committed, applied))
            applied_total[group] = sum(applied.values())
        return applied_total

    log = tmp_path / "pipeline.log"
    pipeline = PipelineProcess({**env, "AML_FAILPOINT": "after-store-write"}, log).start()
    rng = random.Random(7)
    try:
        assert pipeline.process is not None
        code = await asyncio.to_thread(pipeline.process.wait, 180)
        assert code == 137, f"the failpoint did not fire:\n{pipeline.log_tail()}"
        await sample()
        behind = [
            g
            for g in names.deps
            if sum((await asyncio.to_thread(progress[g].committed, range(names.partitions))).values())
            < sum(stores[g].applied_offsets().values())
        ]
        assert behind, "the crash left a store ahead of its group (the replay case)"
        pipeline = PipelineProcess(env, log).start()
        for crash in range(1):
            # Wait until relations has applied a little more, then kill at a random moment of a batch.
            floor = (await sample())[names.deps[0]]

            async def moved(floor: int = floor, running: PipelineProcess = pipeline) -> bool:
                assert running.alive(), f"pipeline died:\n{running.log_tail()}"
                return (await sample())[names.deps[0]] > floor

            await wait_until(moved, 180, f"the pipeline to apply a batch before crash {crash + 1}")
            await asyncio.sleep(rng.uniform(0.0, 0.4))
            pipeline.signal(signal.SIGKILL)
            reached = await sample()
            assert reached[names.deps[0]] < total, "the crash came before the end (else it tests nothing)"
            pipeline = PipelineProcess(env, log).start()

        async def caught_up() -> bool:
            assert pipeline.alive(), f"pipeline died:\n{pipeline.log_tail()}"
            await sample()
            committed = [
                await asyncio.to_thread(p.committed, range(names.partitions)) for p in progress.values()
            ]
            return all(c == ends for c in committed)

        await wait_until(caught_up, 240, "both groups to commit up to the log end after the restarts")
    finally:
        pipeline.signal(signal.SIGTERM)
        for p in progress.values():
            p.close()

    assert not ahead, f"committed ahead of the store: {ahead[:3]}"
    assert samples > 20
    check_against_reference(settings, produced, [produced.valid])
    assert "StaleBatch" not in log.read_text(errors="replace"), "a batch was applied twice"
