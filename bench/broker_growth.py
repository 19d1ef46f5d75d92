"""Which broker operation gets dearer as the broker lives on, and with what?

In a long run at a steady 50 records/s the embedded broker's CPU per record more than doubled in five minutes,
and a refresh (OffsetFetch for two groups plus a fetch at a given offset on four partitions) went from 17 ms
to 147 ms. This script grows one factor at a time on a private broker and measures, at each step, every
request kind our services send: the client-side latency (mean/p50/p99) and the broker's CPU per request
(utime+stime of its process over a block of sequential requests, divided by their number).

Phases:
  log        a 4-partition topic grows from ~1k to ~100k records, produced in batches of 20 records;
  commits    one group commits offsets on 4 partitions, from 0 to 20k times;
  changelog  a compacted 4-partition topic is written with the same 10 keys over and over, 20k times.

Fetch, ListOffsets and OffsetCommit are sent as single protocol requests (aiokafka's own request classes, as
its consumer sends them), so one measured call is one broker request (`fetch_old`: one per partition, 4 in
all; `fetch_last` and `fetch_end`: one request for the 4 partitions); OffsetFetch goes through
AIOKafkaAdminClient.list_consumer_group_offsets with explicit partitions, as the refresh does (FindCoordinator
+ OffsetFetch); `getmany_end` is a consumer at the end of the topic (fetch_max_wait 100 ms) calling
getmany(timeout_ms=100). The machine is shared: compare rows within one run, not across runs.

Run: .venv/bin/python -m bench.broker_growth
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiokafka
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.commit import OffsetCommitRequest
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.protocol.offset import OffsetRequest

from aml_app.kafka.broker import EmbeddedBroker, broker_binary, free_port
from aml_app.kafka.deadlines import within
from bench.common import cpu_seconds, finish, machine

NAME = "broker_growth"
PARTITIONS = 4
DEADLINE = 15.0  # seconds allowed to any single await
BLOCK_SECONDS = 1.5  # each request kind is repeated for at least this long ...
BLOCK_CALLS = 10  # ... and at least this many times
SMALL_FETCH_BYTES = 16 * 1024  # per partition: a few batches, so the answer's size does not grow with the log
LATEST = -1  # ListOffsets timestamp meaning "the end"

LOG_STEPS = [1_000, 5_000, 10_000, 25_000, 50_000, 100_000]  # records in the topic
LOG_BATCH = 20  # records per produced batch
COMMIT_STEPS = [0, 1_000, 5_000, 10_000, 20_000]  # commits made by one group
CHANGELOG_STEPS = [100, 1_000, 5_000, 10_000, 20_000]  # single-record writes to the compacted topic
CHANGELOG_KEYS = 10

Call = Callable[[], Awaitable[Any]]


def broker_cpu(pid: int) -> float:
    """CPU seconds (user + system) the broker has used so far; it must still run."""
    used = cpu_seconds(pid)
    if used is None:
        raise RuntimeError(f"the broker (pid {pid}) is gone")
    return used


async def timely(awaitable: Awaitable[Any]) -> Any:
    """A request with the benchmark's deadline; a client stuck past it is left behind, not awaited."""
    return await within(awaitable, DEADLINE, "a request to the broker")


@dataclass
class Stats:
    """Latencies of one block of sequential calls, and the broker CPU the block cost."""

    latencies: list[float]
    cpu_seconds: float

    def row(self) -> dict[str, float]:
        ordered = sorted(self.latencies)
        n = len(ordered)
        return {
            "n": n,
            "mean_ms": round(1000 * statistics.fmean(ordered), 3),
            "p50_ms": round(1000 * ordered[n // 2], 3),
            "p99_ms": round(1000 * ordered[min(n - 1, int(0.99 * n))], 3),
            "cpu_ms_per_req": round(1000 * self.cpu_seconds / n, 3),
        }


async def measure(pid: int, call: Call) -> dict[str, float]:
    """Repeat `call` sequentially for a block; latency per call and broker CPU per call."""
    latencies: list[float] = []
    cpu_before, started = broker_cpu(pid), time.monotonic()
    while len(latencies) < BLOCK_CALLS or time.monotonic() - started < BLOCK_SECONDS:
        t0 = time.perf_counter()
        await timely(call())
        latencies.append(time.perf_counter() - t0)
    return Stats(latencies, broker_cpu(pid) - cpu_before).row()


class Bench:
    """One broker and the clients that talk to it; `ends` tracks each topic's end offset per partition."""

    def __init__(self, broker: EmbeddedBroker) -> None:
        assert broker.process is not None
        self.pid = broker.process.pid
        self.bootstrap = broker.bootstrap
        self.client = AIOKafkaClient(bootstrap_servers=self.bootstrap)
        self.admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        self.producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=0)
        self.tail = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, enable_auto_commit=False, fetch_max_wait_ms=100
        )
        self.node = 0
        self.ends: dict[str, list[int]] = {}
        self.value = (
            b'{"payment_id":"p","payer":"a","payee":"b","amount":"12.34","pad":"' + b"x" * 120 + b'"}'
        )

    async def start(self) -> None:
        for starting in (
            self.client.bootstrap(),
            self.admin.start(),
            self.producer.start(),
            self.tail.start(),
        ):
            await timely(starting)
        self.node = next(iter(self.client.cluster.brokers())).nodeId

    async def stop(self) -> None:
        await timely(self.tail.stop())
        await timely(self.producer.stop())
        await timely(self.admin.close())
        await timely(self.client.close())

    async def create(self, topic: str, config: dict[str, str] | None = None) -> None:
        await timely(self.admin.create_topics([NewTopic(topic, PARTITIONS, 1, topic_configs=config or {})]))
        self.ends[topic] = [0] * PARTITIONS

    # --- writes -------------------------------------------------------------------------------------------

    async def produce(self, topic: str, partition: int, keys: list[bytes]) -> None:
        """One record batch of len(keys) records on one partition; waits for the broker's answer."""
        batch = self.producer.create_batch()
        for key in keys:
            batch.append(key=key, value=self.value, timestamp=None)
        sent = await timely(self.producer.send_batch(batch, topic, partition=partition))
        meta = await timely(sent)
        self.ends[topic][partition] = meta.offset + len(keys)

    async def grow(self, topic: str, batches: int, keys: Callable[[int], list[bytes]]) -> dict[str, float]:
        """Produce `batches` batches round-robin over the partitions; the block's produce statistics."""
        latencies: list[float] = []
        cpu_before = broker_cpu(self.pid)
        for i in range(batches):
            t0 = time.perf_counter()
            await self.produce(topic, i % PARTITIONS, keys(i))
            latencies.append(time.perf_counter() - t0)
        return Stats(latencies, broker_cpu(self.pid) - cpu_before).row()

    async def commit(self, group: str, topic: str, offset: int) -> None:
        parts = [(p, offset, "") for p in range(PARTITIONS)]
        request = OffsetCommitRequest(group, -1, "", -1, [(topic, parts)])
        await self.client.send(self.node, request)

    # --- reads --------------------------------------------------------------------------------------------

    async def fetch(self, topic: str, offsets: list[int], max_wait_ms: int = 100) -> Any:
        parts = [(p, offset, SMALL_FETCH_BYTES) for p, offset in enumerate(offsets)]
        request = FetchRequest(max_wait_ms, 1, 4 * SMALL_FETCH_BYTES, 0, [(topic, parts)])
        return await self.client.send(self.node, request)

    async def fetch_each(self, topic: str, offsets: list[int]) -> None:
        """One single-partition fetch per partition, in turn.

        In one request Tansu lets the first partition with data take the request's whole max_bytes, so the
        other partitions of an old-offset fetch would not even be looked at; one request each reads them all.
        """
        for partition, offset in enumerate(offsets):
            parts = [(partition, offset, SMALL_FETCH_BYTES)]
            request = FetchRequest(100, 1, SMALL_FETCH_BYTES, 0, [(topic, parts)])
            await self.client.send(self.node, request)

    async def list_offsets(self, topic: str) -> dict[int, int]:
        request = OffsetRequest(-1, 0, [(topic, [(p, LATEST) for p in range(PARTITIONS)])])
        response = await self.client.send(self.node, request)
        return {part: info[-1] for _, parts in response.topics for part, _err, *info in parts}

    async def offset_fetch(self, group: str, topic: str) -> Any:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        return await self.admin.list_consumer_group_offsets(group, partitions=tps)

    async def getmany_end(self, topic: str) -> dict[str, float]:
        """A consumer at the end of `topic`, polling; paused again afterwards so it costs nothing later."""
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        if set(self.tail.assignment()) != set(tps):
            self.tail.assign(tps)
        for tp in tps:
            self.tail.seek(tp, self.ends[topic][tp.partition])
        self.tail.resume(*tps)
        try:
            return await measure(self.pid, lambda: self.tail.getmany(*tps, timeout_ms=100))
        finally:
            self.tail.pause(*tps)

    async def reads(self, topic: str, group: str) -> dict[str, dict[str, float]]:
        """Every read kind, and a commit, against `topic` as it is now."""
        ends = self.ends[topic]
        return {
            "list_offsets": await measure(self.pid, lambda: self.list_offsets(topic)),
            "fetch_old": await measure(self.pid, lambda: self.fetch_each(topic, halves(ends))),
            "fetch_last": await measure(self.pid, lambda: self.fetch(topic, lasts(ends))),
            "fetch_end": await measure(self.pid, lambda: self.fetch(topic, list(ends))),
            "getmany_end": await self.getmany_end(topic),
            "offset_fetch": await measure(self.pid, lambda: self.offset_fetch(group, topic)),
            "offset_commit": await measure(self.pid, lambda: self.commit(group, topic, ends[0] // 2)),
        }


def halves(ends: list[int]) -> list[int]:
    """An old offset on each partition: half-way into its log."""
    return [end // 2 for end in ends]


def lasts(ends: list[int]) -> list[int]:
    """The last record on each partition: what a tail consumer fetches when one batch has just arrived."""
    return [max(0, end - 1) for end in ends]


def key_of(i: int) -> bytes:
    return f"payer-{i:08d}".encode()


def batch_keys(i: int) -> list[bytes]:
    """The keys of the i-th batch of the log topic."""
    return [key_of(i * LOG_BATCH + j) for j in range(LOG_BATCH)]


def changelog_key(base: int, i: int) -> list[bytes]:
    """One record, its key one of CHANGELOG_KEYS, cycling."""
    return [f"key-{(base + i) % CHANGELOG_KEYS}".encode()]


async def log_phase(bench: Bench, topic: str) -> list[dict[str, Any]]:
    """The topic's log grows; every request kind is measured at each size."""
    await bench.create(topic)
    group = f"{topic}-g"
    steps, produced = [], 0
    for target in LOG_STEPS:
        batches = (target - produced) // LOG_BATCH
        produce = await bench.grow(topic, batches, batch_keys)
        produced = sum(bench.ends[topic])
        kinds = {"produce_batch": produce, **await bench.reads(topic, group)}
        latest = await timely(bench.list_offsets(topic))
        steps.append(
            {
                "records": produced,
                "batches_per_partition": produced // LOG_BATCH // PARTITIONS,
                "list_offsets_latest_equals_end": [latest[p] for p in range(PARTITIONS)] == bench.ends[topic],
                "kinds": kinds,
            }
        )
        print(f"  log: {produced} records measured", flush=True)
    return steps


async def commit_phase(bench: Bench, topic: str) -> list[dict[str, Any]]:
    """One group commits over and over; OffsetCommit and OffsetFetch are measured as its history grows."""
    group, control = f"{topic}-busy", f"{topic}-quiet"
    await bench.commit(control, topic, 1)
    steps, made = [], 0
    for target in COMMIT_STEPS:
        while made < target:
            made += 1
            await timely(bench.commit(group, topic, made))
        end = bench.ends[topic]
        kinds = {
            "offset_commit": await measure(bench.pid, functools.partial(bench.commit, group, topic, made)),
            "offset_fetch": await measure(bench.pid, functools.partial(bench.offset_fetch, group, topic)),
            "offset_fetch_quiet_group": await measure(
                bench.pid, functools.partial(bench.offset_fetch, control, topic)
            ),
            "fetch_last": await measure(bench.pid, functools.partial(bench.fetch, topic, lasts(end))),
        }
        steps.append({"commits": made, "kinds": kinds})
        print(f"  commits: {made} made, measured", flush=True)
        made += int(kinds["offset_commit"]["n"])
    return steps


async def changelog_phase(bench: Bench, topic: str, other: str) -> list[dict[str, Any]]:
    """A compacted topic takes the same few keys again and again; its reads, and another topic's, measured."""
    await bench.create(topic, {"cleanup.policy": "compact"})
    group = f"{topic}-g"
    steps, written = [], 0
    other_ends = bench.ends[other]
    for target in CHANGELOG_STEPS:
        kinds = {}
        if target > written:
            keys = functools.partial(changelog_key, written)
            kinds["produce_1_record"] = await bench.grow(topic, target - written, keys)
            written = target
        ends = bench.ends[topic]
        fetch = functools.partial(bench.fetch, topic)
        kinds |= {
            "list_offsets": await measure(bench.pid, functools.partial(bench.list_offsets, topic)),
            "fetch_old": await measure(bench.pid, functools.partial(bench.fetch_each, topic, halves(ends))),
            "fetch_last": await measure(bench.pid, functools.partial(fetch, lasts(ends))),
            "fetch_end": await measure(bench.pid, functools.partial(fetch, list(ends))),
            "offset_fetch": await measure(bench.pid, functools.partial(bench.offset_fetch, group, topic)),
            "other_topic_fetch_last": await measure(
                bench.pid, functools.partial(bench.fetch, other, lasts(other_ends))
            ),
        }
        steps.append({"writes": written, "kinds": kinds})
        print(f"  changelog: {written} writes measured", flush=True)
    return steps


def table(title: str, factor: str, steps: list[dict[str, Any]]) -> str:
    """One line per request kind: mean latency and CPU per request at each step, and late/early ratios."""
    kinds = list(dict.fromkeys(k for step in steps for k in step["kinds"]))
    head = f"{'kind':<26}" + "".join(f"{step[factor]:>14}" for step in steps) + f"{'x lat':>8}{'x cpu':>8}"
    lines = [f"\n{title} ({factor}; cell = mean ms / broker CPU ms per request)", head]
    for kind in kinds:
        cells = [step["kinds"].get(kind) for step in steps]
        text = "".join(
            f"{c['mean_ms']:>7.2f}/{c['cpu_ms_per_req']:<6.2f}" if c else f"{'-':>14}" for c in cells
        )
        present = [c for c in cells if c]
        first, last = present[0], present[-1]
        lat_x = last["mean_ms"] / first["mean_ms"] if first["mean_ms"] else float("nan")
        cpu_x = last["cpu_ms_per_req"] / first["cpu_ms_per_req"] if first["cpu_ms_per_req"] else float("nan")
        lines.append(f"{kind:<26}{text}{lat_x:>8.1f}{cpu_x:>8.1f}")
    return "\n".join(lines)


async def run(broker: EmbeddedBroker) -> dict[str, Any]:
    bench = Bench(broker)
    await bench.start()
    try:
        idle_before = broker_cpu(bench.pid)
        await asyncio.sleep(2)  # the broker's own idle cost, for reference
        idle = (broker_cpu(bench.pid) - idle_before) / 2
        stamp = int(time.time())
        log_topic, commit_topic = f"growth-log-{stamp}", f"growth-commits-{stamp}"
        print("phase log", flush=True)
        log = await log_phase(bench, log_topic)
        print("phase commits", flush=True)
        await bench.create(commit_topic)
        await bench.grow(commit_topic, 50, batch_keys)
        commits = await commit_phase(bench, commit_topic)
        print("phase changelog", flush=True)
        changelog = await changelog_phase(bench, f"growth-changelog-{stamp}", commit_topic)
    finally:
        await bench.stop()
    return {
        "at": time.time(),
        "broker": broker_binary(),
        "aiokafka": aiokafka.__version__,
        "idle_broker_cpu_ms_per_s": round(1000 * idle, 2),
        "block": {"min_seconds": BLOCK_SECONDS, "min_calls": BLOCK_CALLS},
        "phases": {"log": log, "commits": commits, "changelog": changelog},
    }


def report(doc: dict[str, Any]) -> str:
    phases = doc["phases"]
    return "\n".join(
        [
            f"idle broker CPU: {doc['idle_broker_cpu_ms_per_s']} ms/s; run {doc['run_seconds']} s",
            table("log grows", "records", phases["log"]),
            "ListOffsets(latest) == end offsets: "
            + str([step["list_offsets_latest_equals_end"] for step in phases["log"]]),
            table("one group's commits grow", "commits", phases["commits"]),
            table("compacted changelog grows (same 10 keys)", "writes", phases["changelog"]),
        ]
    )


def main() -> None:
    info = machine()
    broker = EmbeddedBroker(free_port()).start()
    try:
        started = time.monotonic()
        doc = asyncio.run(run(broker))
        doc["run_seconds"] = round(time.monotonic() - started, 1)
    finally:
        broker.stop()
    finish(NAME, {"benchmark": NAME, "machine": info, **doc}, report)


if __name__ == "__main__":
    main()
