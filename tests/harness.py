"""Test harness: real worker processes, real broker, a deadline on every wait."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiokafka import AIOKafkaConsumer, TopicPartition

from aml_app.broker import free_port

AML_APP = str(Path(sys.executable).with_name("aml-app"))


async def wait_until(
    predicate: Callable[[], Awaitable[Any]] | Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.1,
) -> Any:
    """Poll `predicate` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


@dataclass
class Names:
    """Fresh topic and group names for one test."""

    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    partitions: int = 4

    @property
    def app_id(self) -> str:
        return f"aml-{self.suffix}"

    @property
    def payments(self) -> str:
        return f"payments-{self.suffix}"

    @property
    def decisions(self) -> str:
        return f"decisions-{self.suffix}"

    @property
    def dlq(self) -> str:
        return f"dlq-{self.suffix}"

    @property
    def deps(self) -> tuple[str, str]:
        return (f"relations-{self.suffix}", f"aggregates-{self.suffix}")


class Worker:
    """One `aml-app worker` process with its own web port and data directory."""

    def __init__(self, bootstrap: str, names: Names, workdir: Path, **env: str) -> None:
        self.port = free_port()
        self.worker_id = f"w{self.port}"
        self.log_path = workdir / f"worker-{self.port}.log"
        self.env = {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "AML_APP_ID": names.app_id,
            "AML_DEPENDS_ON": ",".join(names.deps),
            "AML_PAYMENTS_TOPIC": names.payments,
            "AML_DECISIONS_TOPIC": names.decisions,
            "AML_DLQ_TOPIC": names.dlq,
            "AML_PARTITIONS": str(names.partitions),
            "AML_SESSION_TIMEOUT": "4",
            "AML_REBALANCE_TIMEOUT": "4",
            "AML_COMMIT_INTERVAL": "0.5",
            "AML_REFRESH_INTERVAL": "1.0",
            "AML_FAST_REFRESH_INTERVAL": "0.1",
            "AML_WEB_PORT": str(self.port),
            "AML_DATA_DIR": str(workdir / "data"),
            "AML_WORKER_ID": self.worker_id,
            **env,
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.workdir = workdir

    def start(self) -> Worker:
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [AML_APP, "worker", "-l", "info"],
            env=self.env,
            cwd=self.workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def state(self) -> dict[str, Any] | None:
        """The worker's /watermarks.json, or None while it does not answer."""
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"worker {self.worker_id} is not running; log:\n{self.log_tail()}")
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{self.url}/watermarks.json", timeout=aiohttp.ClientTimeout(2)) as r,
            ):
                return await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def wait_ready(self, partitions: set[int] | None = None, timeout: float = 60) -> dict:
        """Until the worker is recovered, owns `partitions` (if given) and sees every watermark row."""

        async def ready() -> dict | None:
            state = await self.state()
            if not state or state["recovering"] or not state["watermarks"]:
                return None
            if partitions is not None and set(state["assigned"]) != partitions:
                return None
            return state

        return await wait_until(ready, timeout, f"worker {self.worker_id} to be ready")

    def kill(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self, timeout: float = 30) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_bytes().decode(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class TopicReader:
    """Reads a whole topic from the beginning, accumulating what it has seen."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self.topic = topic
        self.partitions = partitions
        self.consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        self.records: list[Any] = []

    async def start(self) -> TopicReader:
        await self.consumer.start()
        tps = [TopicPartition(self.topic, p) for p in range(self.partitions)]
        self.consumer.assign(tps)
        await self.consumer.seek_to_beginning(*tps)
        return self

    async def poll(self, timeout: float = 0.2) -> list[Any]:
        batch = await self.consumer.getmany(timeout_ms=int(timeout * 1000))
        new = [record for records in batch.values() for record in records]
        self.records.extend(new)
        return new

    async def stop(self) -> None:
        await self.consumer.stop()


class DecisionLog(TopicReader):
    """The decisions topic, parsed."""

    def decisions(self) -> list[dict[str, Any]]:
        return [json.loads(r.value) for r in self.records]

    def decided(self) -> set[tuple[int, int]]:
        return {(d["partition"], d["offset"]) for d in self.decisions()}

    async def wait_for(self, expected: set[tuple[int, int]], timeout: float) -> None:
        """Read until every (partition, offset) in `expected` has a decision."""

        async def covered() -> bool:
            await self.poll(0.2)
            return self.decided() >= expected

        try:
            await wait_until(covered, timeout, f"decisions for {len(expected)} payments", interval=0)
        except AssertionError as exc:
            missing = sorted(expected - self.decided())
            raise AssertionError(f"{exc}; {len(missing)} missing, first: {missing[:20]}") from None


class CommitTimeline:
    """When each dependency commit was *initiated*: a decision must come after the commit covering it."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, int, int]] = []

    async def commit(self, committers: dict[str, Any], offsets: dict[int, int]) -> None:
        """Commit `offsets` for every group in `committers` (group -> GroupCommitter), recording it."""
        for group, committer in committers.items():
            for p, o in offsets.items():
                self.record(group, p, o)
            await committer.commit(offsets)

    def record(self, group: str, partition: int, offset: int) -> None:
        self.events.append((time.time(), group, partition, offset))

    def covered_at(self, group: str, partition: int, offset: int) -> float | None:
        """Earliest time `group` was told to commit past `offset` on `partition`."""
        times = [t for t, g, p, o in self.events if g == group and p == partition and o > offset]
        return min(times) if times else None


def premature(decisions: list[dict[str, Any]], groups: tuple[str, ...], timeline: CommitTimeline) -> list:
    """Decisions made before every dependency had committed past the payment."""
    bad = []
    for d in decisions:
        decided = datetime.fromisoformat(d["decided_at"]).timestamp()
        for group in groups:
            covered = timeline.covered_at(group, d["partition"], d["offset"])
            if covered is None or covered > decided:
                bad.append((d["partition"], d["offset"], group, covered, decided))
    return bad


def payments_for(partitions: int, per_partition: int, tag: str) -> list[tuple[int, bytes, bytes]]:
    """Valid payments, `per_partition` on each partition, interleaved across partitions."""
    from aml_app.kafka_tools import payment_json

    records = []
    for i in range(per_partition):
        for p in range(partitions):
            payer = f"acct-{p}-{i % 3}"
            value = payment_json(f"{tag}-{p}-{i}", payer, f"acct-x{i}", "10.00", "2026-11-20T10:15:00Z")
            records.append((p, payer.encode(), value))
    return records


def ends_of(placed: list[tuple[int, int]]) -> dict[int, int]:
    """Log-end offset per partition after `placed` records."""
    ends: dict[int, int] = {}
    for p, o in placed:
        ends[p] = max(ends.get(p, 0), o + 1)
    return ends


async def committed_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    """A group's committed offsets on `topic` (-1: nothing committed), read like the gate reads them."""
    from aml_app.gate.offsets import DependencyOffsets

    reader = DependencyOffsets([bootstrap], topic, [group])
    try:
        _, committed = await reader.read()
    finally:
        await reader.close()
    return {p: (-1 if o is None else o) for p, o in committed[group].items() if p < partitions}
