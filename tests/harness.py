"""Test harness: real worker processes, real broker, a deadline on every wait."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from confluent_kafka import Producer

from aml_app.harness.child_process import aml_app_executable
from aml_app.harness.tails import InOrder, from_the_start
from aml_app.harness.workers import WorkerProcess
from aml_app.kafka.broker import EmbeddedBroker, free_port
from aml_app.kafka.security import PLAINTEXT
from aml_app.settings import KafkaSettings, PipelineSettings, Settings

AML_APP = aml_app_executable()


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
    def alerts(self) -> str:
        return f"alerts-{self.suffix}"

    @property
    def dlq(self) -> str:
        return f"dlq-{self.suffix}"

    @property
    def review(self) -> str:
        return f"review-{self.suffix}"

    @property
    def deps(self) -> tuple[str, str]:
        return (f"relations-{self.suffix}", f"aggregates-{self.suffix}")

    def settings(self, bootstrap: str) -> Settings:
        """The service's settings for these names, as a worker started on them gets them."""
        return Settings(
            # The gate's tests run the probe service: the gate alone, dependencies played by the test.
            service="probe",
            app_id=self.app_id,
            depends_on=self.deps,
            kafka=KafkaSettings(
                bootstrap_servers=(bootstrap,),
                payments_topic=self.payments,
                decisions_topic=self.decisions,
                alerts_topic=self.alerts,
                dlq_topic=self.dlq,
                review_topic=self.review,
                partitions=self.partitions,
            ),
        )


#: Short timeouts and intervals, so a test sees rebalances, commits and refreshes within seconds.
TEST_ENV = {
    "AML_SESSION_TIMEOUT": "4",
    "AML_REBALANCE_TIMEOUT": "4",
    "AML_COMMIT_INTERVAL": "0.5",
    "AML_REFRESH_INTERVAL": "1.0",
    "AML_FAST_REFRESH_INTERVAL": "0.1",
}


class Worker(WorkerProcess):
    """A worker for one test: a free web port it is named after, its log and data in the test's folder."""

    def __init__(
        self, bootstrap: str, names: Names, workdir: Path, *, executable: str | None = None, **env: str
    ) -> None:
        """`executable`: the `aml-app` to run (default: the one beside this interpreter)."""
        port = free_port()
        super().__init__(
            names.settings(bootstrap),
            port=port,
            worker_id=f"w{port}",
            data_dir=workdir / "data",
            log_path=workdir / f"worker-{port}.log",
            cwd=workdir,
            executable=executable,
            **{**TEST_ENV, **env},
        )

    async def state(self, timeout: float = 2) -> dict[str, Any] | None:
        """The worker's /watermarks.json, or None while it does not answer; fails once it has exited."""
        if not self.alive():
            raise AssertionError(f"worker {self.worker_id} is not running; log:\n{self.log_tail()}")
        return await super().state(timeout)

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


class TopicReader:
    """Reads a whole topic from the beginning, accumulating what it has seen."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self.topic = topic
        self.partitions = partitions
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
        )
        self.records: list[Any] = []
        self.order = InOrder(lambda tp, offset: self.consumer.seek(tp, offset))

    async def start(self) -> TopicReader:
        await self.consumer.start()
        tps = [TopicPartition(self.topic, p) for p in range(self.partitions)]
        self.consumer.assign(tps)
        from_the_start(self.consumer, tps)
        return self

    async def poll(self, timeout: float = 0.2) -> list[Any]:
        """The records read since the last poll, each partition's in offset order (`InOrder`)."""
        batch = await self.consumer.getmany(timeout_ms=int(timeout * 1000))
        new = []
        for tp, records in batch.items():
            taken, _ = self.order.accept(tp, records)
            new.extend(taken)
        self.records.extend(new)
        return new

    async def stop(self) -> None:
        await self.consumer.stop()


async def read_records(
    bootstrap: str, topic: str, partitions: int, count: int, timeout: float = 60
) -> list[Any]:
    """At least `count` records of `topic`, read from its start; a wait that runs out says which
    (partition, offset) it found."""
    reader = await TopicReader(bootstrap, topic, partitions).start()
    try:

        async def enough() -> list[Any] | None:
            await reader.poll(0.2)
            return reader.records if len(reader.records) >= count else None

        try:
            result: list[Any] = await wait_until(enough, timeout, f"{count} records on {topic}", interval=0)
        except AssertionError as exc:
            seen = sorted((r.partition, r.offset) for r in reader.records)
            raise AssertionError(f"{exc}; found {len(seen)}: {seen}") from None
        return result
    finally:
        await reader.stop()


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


def payments_for(partitions: int, per_partition: int, tag: str) -> list[tuple[int, bytes, bytes]]:
    """Valid payments, `per_partition` on each partition, interleaved across partitions."""
    from aml_app.kafka.tools import payment_json

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
    from aml_app.kafka.offsets import DependencyOffsets

    reader = DependencyOffsets([bootstrap], topic, [group], security=PLAINTEXT)
    try:
        _, committed = await reader.read()
    finally:
        await reader.close()
    return {p: (-1 if o is None else o) for p, o in committed[group].items() if p < partitions}


def produce_in_transactions(
    bootstrap: str, names: Names, records: list[tuple[int, bytes, bytes]], rng: random.Random
) -> list[tuple[int, int]]:
    """Send the records in committed transactions of 1 to 5 records (with librdkafka: aiokafka's
    InitProducerId fails on Tansu); return their (partition, offset) in order."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"payments-{names.suffix}"})
    producer.init_transactions(30)
    delivered: list[tuple[int, int] | None] = [None] * len(records)

    def on_delivery(n: int):
        def done(err: Any, msg: Any) -> None:
            assert err is None, err
            delivered[n] = (msg.partition(), msg.offset())

        return done

    n = 0
    while n < len(records):
        size = rng.randint(1, 5)
        producer.begin_transaction()
        for p, key, value in records[n : n + size]:
            producer.produce(names.payments, value=value, key=key, partition=p, on_delivery=on_delivery(n))
            n += 1
        producer.commit_transaction(30)
    producer.flush(30)
    assert all(d is not None for d in delivered)
    return [d for d in delivered if d is not None]


def settings_for(broker: EmbeddedBroker, suffix: str) -> Settings:
    """Fresh topics and dependency groups on the session's broker."""
    groups = (f"relations-{suffix}", f"aggregates-{suffix}")
    kafka = KafkaSettings(
        bootstrap_servers=(broker.bootstrap,),
        payments_topic=f"payments-{suffix}",
        dlq_topic=f"dlq-{suffix}",
        enriched_topic=f"payments.enriched-{suffix}",
        enrichment_group=f"enrichment-{suffix}",
    )
    return (
        Settings(depends_on=groups, kafka=kafka, pipeline=PipelineSettings(trigger_interval=0.5))
        .with_endpoint("relations", group=groups[0])
        .with_endpoint("aggregates", group=groups[1])
    )
