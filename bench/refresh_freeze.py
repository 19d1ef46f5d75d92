"""Broker freezes at random phases of the leader's refresh: does the refresh always come back?

Two probe workers (the gate alone, event-time mode) read a four-partition `payments` topic on an embedded
broker of their own while payments arrive at `--rate` per second and two dependency groups commit about
half a second behind them, so every partition keeps waiting on the leader's fast refresh. The broker is
then frozen (SIGSTOP) `--freezes` times for 1-10 s each, at random moments, and continued (SIGCONT).

After each freeze the benchmark watches the leader's `/watermarks.json` until it shows a refresh completed
after the freeze (`refresh.refreshes` moved and `last_refresh_age_s` is small), and records how long that
took; a refresh that has not come back `--give-up` seconds after the freeze is a hang. At the end the
traffic stops, the dependencies commit to the log end and every payment must be decided.

    python -m bench.refresh_freeze [--freezes 20] [--rate 100] [--seed 1] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from aml_app.harness.tails import from_the_start
from aml_app.harness.workers import WorkerProcess
from aml_app.kafka.broker import EmbeddedBroker, create_topics, free_port, wait_until_answering
from aml_app.kafka.deadlines import within
from aml_app.kafka.tools import GroupCommitter, payment_json
from aml_app.settings import KafkaSettings, Settings
from bench.common import RESULTS

PARTITIONS = 4
#: How far behind the producer the dependency groups commit, in seconds.
DEPENDENCY_LAG = 0.5
WORKER_ENV = {
    "AML_GATE_MODE": "event-time",
    "AML_SESSION_TIMEOUT": "6",
    "AML_REBALANCE_TIMEOUT": "6",
    "AML_COMMIT_INTERVAL": "0.5",
    "AML_REFRESH_INTERVAL": "1.0",
    "AML_FAST_REFRESH_INTERVAL": "0.1",
}


class Traffic:
    """Payments at a steady rate; remembers when each acknowledged offset was sent."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, rate: float) -> None:
        self.producer = producer
        self.topic = topic
        self.rate = rate
        self.sent: list[tuple[float, int, int]] = []  # (sent at, partition, offset), acknowledged
        self.failed = 0
        self.n = 0

    async def run(self, stop: asyncio.Event) -> None:
        started = time.monotonic()
        pending: set[asyncio.Future[Any]] = set()
        while not stop.is_set():
            due = int((time.monotonic() - started) * self.rate)
            while self.n < due:
                payer = f"acct-{self.n % 40}"
                ts = datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
                value = payment_json(f"f-{self.n}", payer, f"acct-x{self.n % 97}", "10.00", ts)
                at = time.monotonic()
                future = await self.producer.send(self.topic, value=value, key=payer.encode())
                future.add_done_callback(lambda f, at=at: self._acked(f, at))
                pending.add(future)
                future.add_done_callback(pending.discard)
                self.n += 1
            await asyncio.sleep(0.02)
        if pending:
            await asyncio.wait(pending, timeout=60)

    def _acked(self, future: asyncio.Future[Any], at: float) -> None:
        if future.cancelled() or future.exception() is not None:
            self.failed += 1
            return
        meta = future.result()
        self.sent.append((at, meta.partition, meta.offset))

    def ends(self, before: float) -> dict[int, int]:
        """Per partition, the next offset after every payment acknowledged and sent before `before`."""
        ends: dict[int, int] = {}
        for at, p, o in self.sent:
            if at <= before:
                ends[p] = max(ends.get(p, 0), o + 1)
        return ends


async def commit_behind(committers: Sequence[GroupCommitter], traffic: Traffic, stop: asyncio.Event) -> None:
    """The dependencies: commit what was sent DEPENDENCY_LAG ago; a frozen broker only delays it."""
    while not stop.is_set():
        ends = traffic.ends(time.monotonic() - DEPENDENCY_LAG)
        for committer in committers:
            try:
                await within(committer.commit(ends), 5, "a dependency commit")
            except Exception:  # a frozen broker: the next round commits again
                pass
        await asyncio.sleep(0.2)


async def decided(
    bootstrap: str, topic: str, expected: set[tuple[int, int]], timeout: float
) -> set[tuple[int, int]]:
    """Read the decisions topic until every expected payment has a decision or `timeout` passes."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    seen: set[tuple[int, int]] = set()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        from_the_start(consumer, tps)
        deadline = time.monotonic() + timeout
        while not expected <= seen and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for records in batch.values():
                for r in records:
                    doc = json.loads(r.value)
                    seen.add((doc["partition"], doc["offset"]))
    finally:
        await consumer.stop()
    return seen


class Watch:
    """Polls every worker's /watermarks.json; remembers the leader's refresh counters."""

    def __init__(self, workers: Sequence[WorkerProcess]) -> None:
        self.workers = workers
        self.leader: dict[str, Any] | None = None
        self.leader_id: str | None = None

    async def poll(self) -> None:
        for worker in self.workers:
            state = await worker.state(timeout=2)
            if state and state.get("is_leader"):
                self.leader, self.leader_id = state["refresh"], worker.worker_id

    def refreshes(self) -> int:
        return -1 if self.leader is None else int(self.leader["refreshes"])


async def run(options: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(options.seed)
    folder = Path(tempfile.mkdtemp(prefix="refresh-freeze-"))
    suffix = uuid.uuid4().hex[:8]
    broker = EmbeddedBroker(free_port(), log_path=folder / "broker.log").start()
    workers: list[WorkerProcess] = []
    doc: dict[str, Any] = {"options": vars(options) | {"results": str(options.results)}, "freezes": []}
    try:
        await wait_until_answering([broker.bootstrap])
        names = {k: f"{k}-{suffix}" for k in ("payments", "decisions", "alerts", "dlq", "review")}
        await create_topics([broker.bootstrap], list(names.values()), PARTITIONS)
        deps = (f"relations-{suffix}", f"aggregates-{suffix}")
        settings = Settings(
            service="probe",
            app_id=f"freeze-{suffix}",
            depends_on=deps,
            kafka=KafkaSettings(
                bootstrap_servers=(broker.bootstrap,),
                payments_topic=names["payments"],
                decisions_topic=names["decisions"],
                alerts_topic=names["alerts"],
                dlq_topic=names["dlq"],
                review_topic=names["review"],
                partitions=PARTITIONS,
            ),
        )
        for _ in range(2):
            port = free_port()
            workers.append(
                WorkerProcess(
                    settings,
                    port=port,
                    worker_id=f"w{port}",
                    data_dir=folder / f"data-{port}",
                    log_path=folder / f"worker-{port}.log",
                    cwd=folder,
                    **WORKER_ENV,
                ).start()
            )
        producer = AIOKafkaProducer(
            bootstrap_servers=broker.bootstrap, linger_ms=5, request_timeout_ms=30_000
        )
        await producer.start()
        committers = [
            await GroupCommitter([broker.bootstrap], g, names["payments"]).start(range(PARTITIONS))
            for g in deps
        ]
        watch = Watch(workers)
        traffic = Traffic(producer, names["payments"], options.rate)
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(traffic.run(stop)),
            asyncio.create_task(commit_behind(committers, traffic, stop)),
        ]
        deadline = time.monotonic() + 120
        while watch.refreshes() < 5:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no leader refreshing within 120 s; logs in {folder}")
            await watch.poll()
            await asyncio.sleep(0.5)
        say(f"leader {watch.leader_id} refreshing; {options.freezes} freezes follow")
        hung = False
        for i in range(options.freezes):
            await asyncio.sleep(rng.uniform(2, 6))
            seconds = rng.uniform(1, 10)
            broker.pause()
            await asyncio.sleep(seconds)
            broker.resume()
            resumed = time.monotonic()
            await watch.poll()
            before = watch.refreshes()
            back: float | None = None
            while time.monotonic() - resumed < options.give_up:
                await watch.poll()
                age = None if watch.leader is None else watch.leader["last_refresh_age_s"]
                if watch.refreshes() > before and age is not None and age < 2:
                    back = time.monotonic() - resumed
                    break
                await asyncio.sleep(0.25)
            entry = {
                "freeze": i + 1,
                "seconds": round(seconds, 2),
                "refresh_back_after_s": None if back is None else round(back, 2),
                "leader": watch.leader_id,
                "refresh": watch.leader,
            }
            doc["freezes"].append(entry)
            say(f"freeze {i + 1}: {seconds:.1f} s; refresh back after {entry['refresh_back_after_s']} s")
            if back is None:
                hung = True
                say(f"the leader's refresh did not come back within {options.give_up:g} s: a hang")
                break
        stop.set()
        await asyncio.wait(tasks, timeout=90)
        final = traffic.ends(float("inf"))
        for committer in committers:
            await asyncio.wait_for(committer.commit(final), 30)
        expected = {(p, o) for _, p, o in traffic.sent}
        seen = await decided(broker.bootstrap, names["decisions"], expected, 60 if hung else 180)
        doc.update(
            hung=hung,
            sent=len(expected),
            send_failures=traffic.failed,
            undecided=len(expected - seen),
            leader_refresh=watch.leader,
            logs=str(folder),
        )
        await producer.stop()
        for committer in committers:
            await committer.stop()
        doc["ok"] = not hung and not doc["undecided"]
        return doc
    finally:
        for worker in workers:
            worker.stop(grace=10)
        broker.stop()


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--freezes", type=int, default=20)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--give-up", type=float, default=60.0, dest="give_up")
    parser.add_argument("--results", type=Path, default=RESULTS / "refresh_freeze.json")
    options = parser.parse_args(argv)
    doc = asyncio.run(run(options))
    options.results.parent.mkdir(parents=True, exist_ok=True)
    options.results.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    say(f"hung: {doc['hung']}; sent {doc['sent']}, undecided {doc['undecided']}; wrote {options.results}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
