"""Chaos soak: the whole system under a seeded schedule of crashes and outages, judged from the outside.

One run starts what a user starts (an embedded broker and PostgreSQL server of its own, `aml-app topics
--create`, `aml-app pipeline`, two replicas of each API, two AML workers; the processes through
`aml_app.harness.system.System`), sends `aml-app simulate` traffic at `--rate` payments/s plus one
malformed record per hundred of its own, and injects faults 15-20 s apart in an order drawn from
`--seed`: kill -9 of each AML worker (one started again each time), kill -9 of the pipeline (restarted),
kill -9 of an API replica (restarted), PostgreSQL stopped hard for 5-10 s, PostgreSQL slow (a lock held on
both stores' main tables for 5-10 s), the broker frozen with SIGSTOP for 5 s and for 15 s (past the
workers' session timeout), an AML worker frozen with SIGSTOP while it holds partitions and continued once
they moved to the others, a payment stamped 2099 (dead-lettered by every consumer) and one stamped 1971
(decided), and the workers scaled 2 -> 3 -> 2. Adding partitions is not injected: Tansu does not
implement CreatePartitions.

The verdict comes from clients of this module's own, which share no code with the demo's verdict: readers
of the payments, decisions, alerts and dead-letter topics that note when each record arrived here, a
poller of the groups' committed offsets (explicit partitions, as Tansu needs) keeping a timeline, and log
ends from a fetch's high watermark (Tansu's ListOffsets answers the start of the last batch + 1). A
decision is premature when its payment's offset is at or past a dependency group's committed offset in
the first poll that started after the decision arrived: the commits were not there even then. Each
reader fetches again the offsets a fetch skipped (Tansu takes a batch's offsets before it stores the
batch, and a fetch meanwhile returns a later batch another producer stored first), and a payment still
without a decision is read for again by a new reader, so the verdict says whether the broker lacks its
decision or the soak's reader missed it.

    .venv/bin/python -m bench.chaos_soak --seed 7 --duration 240 [--rate 100]
        [--faults kill-worker,kill-worker,kill-pipeline,kill-api,postgres-stop,postgres-slow,broker-freeze,
                  broker-freeze-long,freeze-worker,odd-timestamps,scale]
        [--gap 15,20] [--catch-up 300] [--commit-grace 10] [--sample 50] [--results PATH] [--keep]
        [--no-gate] [--live-code]

Every process of a run imports a copy of `aml_app`, `agents` and `tables` taken when the run starts (first
on PYTHONPATH), so a process restarted by a fault runs the same code as the others while people edit the
checkout; `--live-code` runs the checkout as it is. `--no-gate` runs the workers ungated: a negative
control, whose premature decisions the verdict must report.

Exit code 0 when every promise held, 1 when one did not (premature, lost, alerted twice, stores that
disagree with the payments, a group short of the log end, a malformed record not dead-lettered by all
three consumers or decided, a committed offset seen going back, a process that died on its own, a fault
not injected), 2 when the system could not be started.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from aml_app import dependency_services as registry
from aml_app.enrichment import DEAD_LETTER_WORKER
from aml_app.harness.child_process import AmlAppProcess, aml_app_executable
from aml_app.harness.demo import with_derived_aggregates
from aml_app.harness.dependencies import ServiceProcess, services_env
from aml_app.harness.embedded_postgres import EmbeddedPostgres
from aml_app.harness.system import Layout, System, service_settings
from aml_app.harness.workers import WorkerProcess
from aml_app.kafka.broker import EmbeddedBroker, free_port
from aml_app.kafka.deadlines import close_within, within
from aml_app.kafka.derivation import SOURCE_HEADER
from aml_app.settings import KafkaSettings, Settings, WebSettings
from aml_app.simulation.producer import payment_count
from aml_app.simulation.traffic import DEFAULT_SPEEDUP, default_start
from bench.common import PROJECT, RESULTS, machine, machine_at_end

NAME = "chaos_soak"
PARTITIONS = 4
MALFORMED_EVERY = 100  # one malformed record per this many payments
FULL_SCHEDULE = (
    "kill-worker",
    "kill-worker",
    "kill-pipeline",
    "kill-api",
    "postgres-stop",
    "postgres-slow",
    "broker-freeze",
    "broker-freeze-long",
    "freeze-worker",
    "odd-timestamps",
    "scale",  # 2 -> 3, then 3 -> 2 one gap later
)
#: With `--derived` (Service C reads the enrichment stage's topic): the stage is killed -9 too.
DERIVED_SCHEDULE = (*FULL_SCHEDULE, "kill-stage")
FAULT_KINDS = frozenset(DERIVED_SCHEDULE)
NOT_INJECTED = {
    "add-partitions": "the embedded broker (Tansu) does not implement CreatePartitions, so a topic "
    "cannot grow partitions",
}
API_REPLICAS = tuple(f"{name}{r}" for name in registry.NAMES for r in ("", "-2"))  # System's replica names
FIRST_FAULT = 10.0  # seconds of traffic before the first fault
LAST_FAULT_MARGIN = 10.0  # the last fault starts at least this long before the traffic ends
POSTGRES_OUTAGE = (5.0, 10.0)
FREEZE_SECONDS = 5.0
LONG_FREEZE_SECONDS = 15.0  # past the workers' session timeout (WORKER_SESSION_TIMEOUT, 6 s)
#: How long a frozen worker's partitions may take to move to the others before it is continued anyway
#: (and the fault fails): a session timeout, a rebalance and the others' recovery.
MOVE_DEADLINE = 90.0
#: Payment times far from the traffic's: one after any allowed clock skew, one long before every window.
FUTURE_TS, PAST_TS = "2099-01-01T00:00:00Z", "1971-01-01T00:00:00Z"
POLL_EVERY = 0.2
REQUEST_TIMEOUT = 5.0
PROGRESS_EVERY = 10.0
WARM_UP_DEADLINE = 240.0  # Spark compiles its first micro-batch in 10-30 s, more on a busy machine
SIMULATOR_SLACK = 180.0  # beyond --duration: sends held up by a frozen broker or a busy machine
FAULTS_DEADLINE = 180.0
STOP_DEADLINE = 15.0
#: How long a reader fetches again the offsets a fetch skipped (s). Tansu takes a batch's offsets before
#: it stores the batch, and a fetch meanwhile returns a later batch that another producer stored first.
REFETCH_FOR = 5.0
#: How long the checks wait for the derived topic's reader to reach the topic's end (s).
DERIVED_READ_DEADLINE = 60.0
HTTP_TIMEOUT = 15.0
COMMIT_PATIENCE = 30.0  # after the grace, how much longer to watch a group that has not reached the end


class SoakError(RuntimeError):
    """The soak itself could not go on (a reader died, the system did not start)."""


@dataclass
class Options:
    seed: int = 7
    duration: float = 240.0
    rate: float = 100.0
    faults: tuple[str, ...] = FULL_SCHEDULE
    gap: tuple[float, float] = (15.0, 20.0)
    catch_up: float = 300.0
    commit_grace: float = 10.0
    sample: int = 50
    results: Path | None = None  # default: bench/results/chaos_soak_seed<seed>_<duration>s.json
    keep: bool = False  # keep the PostgreSQL data folder (the logs are always kept)
    gate: bool = True  # off: the negative control, whose premature decisions the verdict must catch
    live_code: bool = False  # run the checkout as it is, not a copy taken at the start
    derived: bool = False  # Service C reads payments.enriched, which the enrichment stage derives


@dataclass
class Fault:
    """One planned fault, and what happened when it was injected."""

    kind: str  # one of FULL_SCHEDULE, "scale" being two steps: scale-up, scale-down
    at: float  # planned, seconds after the traffic started
    seconds: float = 0.0  # how long the outage lasts (postgres-stop/-slow, broker-freeze(-long))
    target: str = ""  # the API replica of kill-api; the worker of the others, once chosen
    started: float | None = None  # wall clock
    ended: float | None = None
    what: str = ""
    error: str = ""
    #: freeze-worker: the wall clock just before SIGSTOP and just after SIGCONT.
    frozen: tuple[float, float] | None = None


def plan(options: Options) -> tuple[list[Fault], list[str]]:
    """The seeded schedule: the faults in a drawn order, a drawn gap apart; what did not fit is skipped."""
    rng = random.Random(options.seed)
    kinds = list(options.faults)
    rng.shuffle(kinds)
    faults: list[Fault] = []
    skipped: list[str] = []
    at = FIRST_FAULT
    for kind in kinds:
        steps = ["scale-up", "scale-down"] if kind == "scale" else [kind]
        if at + (len(steps) - 1) * options.gap[1] > options.duration - LAST_FAULT_MARGIN:
            skipped.append(kind)
            continue
        for step in steps:
            fault = Fault(step, round(at, 1))
            if step == "kill-api":
                fault.target = rng.choice(API_REPLICAS)
            elif step in ("postgres-stop", "postgres-slow"):
                fault.seconds = round(rng.uniform(*POSTGRES_OUTAGE), 1)
            elif step == "broker-freeze":
                fault.seconds = FREEZE_SECONDS
            elif step == "broker-freeze-long":
                fault.seconds = LONG_FREEZE_SECONDS
            faults.append(fault)
            at += rng.uniform(*options.gap)
    return faults, skipped


def snapshot_code(folder: Path) -> tuple[Path, str]:
    """A copy of the service's code as it is now, laid out as installed (`agents` and `tables` inside
    `aml_app`), and its digest. Put first on PYTHONPATH, it is what every process of the run imports,
    restarted ones included, however the shared checkout changes meanwhile."""
    target = folder / "code"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PROJECT / "aml_app", target / "aml_app", ignore=skip)
    for name in ("agents", "tables"):
        shutil.copytree(PROJECT / name, target / "aml_app" / name, ignore=skip)
    # Digested as bench.common.code_version digests the checkout, so equal code gives an equal digest.
    copied = target / "aml_app"
    digest = hashlib.sha256()
    for package, folder in (
        ("aml_app", copied),
        ("agents", copied / "agents"),
        ("tables", copied / "tables"),
    ):
        for path in sorted(folder.rglob("*.py")):
            inner = path.relative_to(folder)
            if package == "aml_app" and inner.parts[0] in ("agents", "tables"):
                continue
            digest.update(str(Path(package) / inner).encode())
            digest.update(path.read_bytes())
    return target, digest.hexdigest()[:12]


# ---- our own clients of the broker


@dataclass(frozen=True)
class Seen:
    """A record as read here, with the wall-clock time it arrived and, when the broker kept the producer's
    timestamp (CreateTime), the wall-clock time its producer created it."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    arrived: float
    created: float | None = None


def created_at(record: Any) -> float | None:
    """When the producer created a consumed record, in seconds of `time.time()`: its timestamp when of
    type CreateTime (0), else None (a broker's LogAppendTime says nothing of the producer)."""
    if getattr(record, "timestamp_type", None) != 0 or record.timestamp is None or record.timestamp < 0:
        return None
    return float(record.timestamp) / 1000


class TopicReader:
    """Reads a whole topic from offset 0 without a group, keeping every record (duplicates too), each
    partition's in offset order: offsets a fetch skipped are fetched again for `refetch_for` seconds."""

    def __init__(self, bootstrap: str, topic: str, partitions: int, refetch_for: float = REFETCH_FOR) -> None:
        self.topic = topic
        self.refetch_for = refetch_for
        self.tps = [TopicPartition(topic, p) for p in range(partitions)]
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            enable_auto_commit=False,
            fetch_max_wait_ms=200,
            max_partition_fetch_bytes=4_000_000,
        )
        self.records: list[Seen] = []
        self.errors = 0
        self.refetches = 0
        self.expected: dict[int, int] = {}  # partition -> the next offset to keep
        self.skipped_since: dict[tuple[int, int], float] = {}  # (partition, offset) -> first skipped

    async def start(self) -> TopicReader:
        await self.consumer.start()
        self.consumer.assign(self.tps)
        for tp in self.tps:
            self.consumer.seek(tp, 0)
        return self

    async def run(self, closing: asyncio.Event) -> None:
        while not closing.is_set():
            try:
                batch = await self.consumer.getmany(timeout_ms=200)
            except Exception:  # a frozen broker: keep reading once it is back
                self.errors += 1
                await asyncio.sleep(0.5)
                continue
            now = time.time()
            for tp, records in batch.items():
                self.keep(tp, records, now)

    def keep(self, tp: TopicPartition, records: Sequence[Any], now: float) -> None:
        """Keep `tp`'s records that follow the last kept one; at a jump past offsets never read, seek
        back and fetch them again, for `refetch_for` seconds (after that the offsets hold no record)."""
        expected = self.expected.get(tp.partition, 0)
        for r in records:
            if r.offset < expected:
                continue  # kept before: fetched again after a seek back
            if r.offset > expected:
                first = self.skipped_since.setdefault((tp.partition, expected), now)
                if now - first < self.refetch_for:
                    self.refetches += 1
                    self.consumer.seek(tp, expected)
                    break
            headers = tuple((k, bytes(v or b"")) for k, v in (r.headers or ()))
            self.records.append(Seen(r.partition, r.offset, r.key, r.value, headers, now, created_at(r)))
            expected = r.offset + 1
        self.expected[tp.partition] = expected

    def skipped(self) -> int:
        """How many offsets below the highest one read per partition no record was read at: on a topic
        that is not compacted, records this reader missed."""
        seen: dict[int, set[int]] = {}
        for r in self.records:
            seen.setdefault(r.partition, set()).add(r.offset)
        return sum(max(offsets) + 1 - len(offsets) for offsets in seen.values())

    async def behind(self, ends: Mapping[int, int]) -> int:
        """How many offsets below `ends` this reader has not read past, over all partitions."""
        positions = [await self.consumer.position(tp) for tp in self.tps]
        return sum(max(ends.get(tp.partition, 0) - at, 0) for tp, at in zip(self.tps, positions, strict=True))

    def highwater(self) -> dict[int, int]:
        """The latest fetch's high watermark per partition (those fetched so far)."""
        found = {tp.partition: self.consumer.highwater(tp) for tp in self.tps}
        return {p: hw for p, hw in found.items() if hw is not None}

    async def stop(self) -> None:
        await close_within(self.consumer.stop(), STOP_DEADLINE, f"stopping the reader of {self.topic}")


@dataclass(frozen=True)
class Poll:
    """The committed offsets of every followed group, read by one poll from `started` to `ended`."""

    started: float
    committed: dict[str, dict[int, int]]  # group -> partition -> next offset to read (nothing: 0)
    ended: float = 0.0


class CommitPoller:
    """Polls the groups' committed offsets with aiokafka's admin client, keeping the whole timeline: in
    the order given, each on `topic` or the one `on_topic` names for it."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        partitions: int,
        groups: Sequence[str],
        on_topic: Mapping[str, str] | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.tps = [TopicPartition(topic, p) for p in range(partitions)]
        self.topic_of = dict(on_topic or {})
        self.groups = tuple(groups)
        self.admin: AIOKafkaAdminClient | None = None
        self.coordinators: dict[str, int] = {}
        self.polls: list[Poll] = []
        self.starts: list[float] = []
        self.ends: list[float] = []  # when each poll ended, in order (polls run one after the other)
        self.failures = 0
        self.last_error = ""

    async def poll_once(self) -> Poll:
        if self.admin is None:
            admin = AIOKafkaAdminClient(
                bootstrap_servers=self.bootstrap, request_timeout_ms=int(REQUEST_TIMEOUT * 1000)
            )
            await within(admin.start(), REQUEST_TIMEOUT, "starting the commit poller")
            self.admin = admin
        started = time.time()
        committed: dict[str, dict[int, int]] = {}
        for group in self.groups:
            if group not in self.coordinators:
                self.coordinators[group] = await within(
                    self.admin.find_coordinator(group), REQUEST_TIMEOUT, f"finding {group}'s coordinator"
                )
            topic = self.topic_of.get(group)
            tps = self.tps if topic is None else [TopicPartition(topic, tp.partition) for tp in self.tps]
            answer = await within(
                self.admin.list_consumer_group_offsets(group, self.coordinators[group], partitions=tps),
                REQUEST_TIMEOUT,
                f"reading {group}'s committed offsets",
            )
            offsets = {tp.partition: max(meta.offset, 0) for tp, meta in answer.items()}
            committed[group] = {tp.partition: offsets.get(tp.partition, 0) for tp in tps}
        poll = Poll(started, committed, time.time())
        self.polls.append(poll)
        self.starts.append(started)
        self.ends.append(poll.ended)
        return poll

    async def reset(self) -> None:
        admin, self.admin = self.admin, None
        self.coordinators.clear()
        if admin is not None:
            await close_within(admin.close(), REQUEST_TIMEOUT, "closing the commit poller")

    async def run(self, closing: asyncio.Event) -> None:
        while not closing.is_set():
            try:
                await self.poll_once()
            except Exception as exc:  # a frozen broker times out: start over with a fresh client
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                await self.reset()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), POLL_EVERY)

    def latest(self) -> Poll | None:
        return self.polls[-1] if self.polls else None

    def first_after(self, when: float) -> Poll | None:
        """The first poll that started at or after `when`."""
        i = bisect.bisect_left(self.starts, when)
        return self.polls[i] if i < len(self.polls) else None

    def last_before(self, when: float) -> Poll | None:
        i = bisect.bisect_left(self.starts, when)
        return self.polls[i - 1] if i > 0 else None

    def last_ended_before(self, when: float) -> Poll | None:
        """The last poll that ended before `when`: it read no commit made after `when` (a poll held up by
        a frozen broker may read one made seconds after it started)."""
        i = bisect.bisect_left(self.ends, when)
        return self.polls[i - 1] if i > 0 else None

    def regressions(self) -> list[dict[str, Any]]:
        """Every time a group's committed offset was seen lower than in the poll before."""
        found = []
        for before, after in zip(self.polls, self.polls[1:], strict=False):
            for group, offsets in after.committed.items():
                for p, o in offsets.items():
                    if o < before.committed[group][p]:
                        found.append(
                            {"group": group, "partition": p, "from": before.committed[group][p], "to": o}
                        )
        return found

    async def stop(self) -> None:
        await self.reset()


class DerivedRecords:
    """What the stage's topic proves a group reading it applied, by brute force over every record read.

    At a poll that read the stage's committed offsets S on payments, then the group's G on the topic: a
    payment (p, o) below S(p) was derived before S was read (the stage commits after writing), so each
    record naming it was in the topic then, and it is applied when every such record lies below G on its
    partition. The group's position on p is min(S(p), the smallest payment offset on p named by a record
    at or past G): nothing of the gate's own mapping (`aml_app.kafka.derivation`) is used. Records
    written later name payments at or past S (a restarted stage writes again only what it had not
    committed), so reading the topic to its end, rather than to where it stood at the poll, changes nothing.
    """

    def __init__(self) -> None:
        self.reader: TopicReader | None = None
        self._built_from = -1
        #: per partition of the topic: its records' offsets, in order, and per payments partition the
        #: smallest payment offset named at or after each of them (the last entry: none).
        self._offsets: dict[int, list[int]] = {}
        self._suffix: dict[int, dict[int, list[int]]] = {}

    def _build(self) -> None:
        records = self.reader.records if self.reader is not None else []
        if len(records) == self._built_from:
            return
        self._built_from = len(records)
        named: dict[int, list[tuple[int, int, int]]] = {}
        for r in records:
            source = dict(r.headers).get(SOURCE_HEADER)
            partition, _, offset = (source or b"").decode(errors="replace").partition(":")
            if partition.isdigit() and offset.isdigit():
                named.setdefault(r.partition, []).append((r.offset, int(partition), int(offset)))
        self._offsets, self._suffix = {}, {}
        none = 2**62
        for d, rows in named.items():
            rows = sorted(set(rows))
            self._offsets[d] = [offset for offset, _, _ in rows]
            suffix: dict[int, list[int]] = {p: [none] * (len(rows) + 1) for p in range(PARTITIONS)}
            for i in range(len(rows) - 1, -1, -1):
                for after in suffix.values():
                    after[i] = after[i + 1]
                _, source_partition, source_offset = rows[i]
                if source_partition in suffix:
                    suffix[source_partition][i] = min(suffix[source_partition][i], source_offset)
            self._suffix[d] = suffix

    def position(self, stage: Mapping[int, int], group: Mapping[int, int]) -> dict[int, int]:
        self._build()
        found = {}
        for p in range(PARTITIONS):
            lowest = stage.get(p, 0)
            for d, offsets in self._offsets.items():
                i = bisect.bisect_left(offsets, group.get(d, 0))
                lowest = min(lowest, self._suffix[d][p][i])
            found[p] = lowest
        return found


async def log_ends(bootstrap: str, topic: str, partitions: int) -> tuple[dict[int, int], dict[int, int]]:
    """(each partition's end from a fetch's high watermark, the end ListOffsets reports).

    A consumer made now, after every producer stopped, reads from near each partition's end so that
    the fetch answers quickly; its high watermark is the true end on Tansu and on Apache Kafka alike.
    """
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=100)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        listed = await consumer.end_offsets(tps)
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, max(listed[tp] - 1, 0))
        deadline = time.monotonic() + 60
        while any(consumer.highwater(tp) is None for tp in tps):
            if time.monotonic() > deadline:
                raise SoakError(f"no fetch of {topic} answered within 60 s")
            await consumer.getmany(timeout_ms=200)
        fetched = {tp.partition: int(consumer.highwater(tp) or 0) for tp in tps}
        return fetched, {tp.partition: offset for tp, offset in listed.items()}
    finally:
        await close_within(consumer.stop(), STOP_DEADLINE, "stopping the log end reader")


async def read_again(bootstrap: str, topic: str, partitions: int) -> list[Seen]:
    """Every record of `topic`, read by a new reader from offset 0 to the ends a fetch reports: what the
    broker holds, to tell a record the soak's own reader missed from one the broker never kept."""
    ends, _ = await log_ends(bootstrap, topic, partitions)
    reader = await TopicReader(bootstrap, topic, partitions).start()
    try:
        deadline = time.monotonic() + 60
        for tp in reader.tps:
            while await reader.consumer.position(tp) < ends[tp.partition]:
                if time.monotonic() > deadline:
                    raise SoakError(f"reading {topic} again took longer than 60 s")
                batch = await reader.consumer.getmany(tp, timeout_ms=200)
                reader.keep(tp, batch.get(tp, []), time.time())
        return reader.records
    finally:
        await reader.stop()


def payment_bytes(payment_id: str, payer: str, payee: str, amount: str, ts: str) -> bytes:
    doc = {"payment_id": payment_id, "payer": payer, "payee": payee, "amount": amount, "currency": "EUR"}
    return json.dumps({**doc, "ts": ts}).encode()


def malformed_record(n: int) -> tuple[bytes, bytes]:
    """(key, value) of the n-th malformed record: four ways of breaking the contract, in turn."""
    payer = f"chaos-bad-{n}"
    value = payment_bytes(f"chaos-bad-{n}", payer, "acct-x", "10.00", utc_now())
    kind = n % 4
    if kind == 0:
        value = value[:-9]  # cut short: not JSON
    elif kind == 1:
        value = value.replace(b'"10.00"', b'"-10.00"')  # a negative amount
    elif kind == 2:
        doc = json.loads(value)
        del doc["payee"]
        value = json.dumps(doc).encode()
    else:
        value = b"\xff\xfe not a payment"  # not UTF-8
    return payer.encode(), value


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def is_malformed(record: Seen) -> bool:
    """A record every consumer must dead-letter: the malformed ones, and the payment stamped 2099."""
    return (record.key or b"").startswith((b"chaos-bad-", b"chaos-future-"))


def is_odd(payer: str) -> bool:
    """The payers of `odd-timestamps`, whose payments no window of the stores' check holds."""
    return payer.startswith(("chaos-future-", "chaos-past-"))


# ---- what was read, made sense of


@dataclass(frozen=True)
class Payment:
    payment_id: str
    payer: str
    amount: Decimal
    currency: str
    ts: str


@dataclass(frozen=True)
class Decision:
    partition: int
    offset: int
    payment_id: str
    worker: str
    decided_at: float
    arrived: float
    verdict: str = ""


@dataclass
class AlertSeen:
    """Who sent an alert record, when its producer created it and when it arrived here (wall clock).

    The record's own timestamp, not the alert's `decided_at`: the detector stamps `decided_at` before it
    checks that the partition is still its own, so a worker that decided after losing the partition can
    carry a `decided_at` from before its stop; only the producer's timestamp says the record was already
    in the producer then."""

    worker: str
    created: float | None
    arrived: float

    @classmethod
    def of(cls, record: Seen) -> AlertSeen:
        try:
            worker = str(json.loads(record.value or b"").get("worker", ""))
        except (ValueError, TypeError, AttributeError):
            worker = ""
        return cls(worker, record.created, record.arrived)


def sent_after_a_freeze(records: list[AlertSeen], freezes: list[tuple[str, float, float]]) -> int:
    """1 when one of a payment's alert records is a frozen worker's send, else 0, given (worker, stopped,
    continued) per freeze: its producer created the record before the worker was stopped, the record
    arrived only after the worker was continued, and another worker alerted on the payment too.

    Such a record was in the worker's producer when it froze, and the broker took it when the worker ran
    again, after its partition's next owner had read `alerts-sent` and may have alerted on the payment:
    a zombie's send, which only a broker that fences producers (Kafka transactions) can refuse. The soak
    reports these apart from the alerts sent twice that the workers could have seen. At most one record
    per payment is such a send, next to the next owner's: two alerts from the frozen worker, or two from
    the others, are sent twice all the same."""
    return int(
        any(
            frozen_send(r, (w, stopped, continued)) and any(other.worker not in ("", w) for other in records)
            for r in records
            for w, stopped, continued in freezes
        )
    )


def frozen_send(record: AlertSeen, freeze: tuple[str, float, float]) -> bool:
    """Whether the frozen worker's producer created `record` before the worker was stopped and the record
    arrived only after it was continued."""
    worker, stopped, continued = freeze
    return (
        record.created is not None
        and record.worker == worker
        and record.created <= stopped
        and record.arrived >= continued
    )


def only_frozen_sends(records: list[AlertSeen], freezes: list[tuple[str, float, float]]) -> bool:
    """Whether every alert record of a payment is a frozen worker's send (created before it was stopped,
    arriving after it was continued): the partition's next owner read `alerts-sent` without it and may
    have decided the payment clear."""
    return bool(records) and all(any(frozen_send(r, freeze) for freeze in freezes) for r in records)


def alerted_after_a_freeze(
    alerts: Mapping[str, int], records: Mapping[str, list[AlertSeen]], freezes: list[tuple[str, float, float]]
) -> dict[str, int]:
    """The payments alerted more than once (payment id -> alerts) only because of a frozen worker's send
    (`sent_after_a_freeze`): with it left out, one alert is left. Any other payment alerted more than once
    is alerted twice, a failure."""
    return {
        pid: n
        for pid, n in alerts.items()
        if n > 1 and n - sent_after_a_freeze(records.get(pid, []), freezes) <= 1
    }


@dataclass
class Findings:
    """What the readers saw, parsed as it arrives (`update` takes what is new)."""

    valid: dict[tuple[int, int], Payment] = field(default_factory=dict)
    malformed: set[tuple[int, int]] = field(default_factory=set)
    unreadable_payments: list[tuple[int, int]] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    decided: set[tuple[int, int]] = field(default_factory=set)
    unreadable_decisions: int = 0
    alerts: Counter[str] = field(default_factory=Counter)
    alert_records: dict[str, list[AlertSeen]] = field(default_factory=dict)  # payment id -> its records
    dead: dict[str, dict[tuple[int, int], str]] = field(default_factory=dict)  # source -> origin -> reason
    dead_arrived: dict[str, float] = field(default_factory=dict)  # source -> last arrival
    read: dict[str, int] = field(default_factory=dict)  # topic -> records parsed so far

    def take(self, name: str, records: list[Seen]) -> list[Seen]:
        start = self.read.get(name, 0)
        self.read[name] = len(records)
        return records[start:]

    def payments(self, records: list[Seen]) -> None:
        for r in self.take("payments", records):
            if is_malformed(r):
                self.malformed.add((r.partition, r.offset))
                continue
            try:
                doc = json.loads(r.value or b"")
                payment = Payment(
                    doc["payment_id"], doc["payer"], Decimal(doc["amount"]), doc["currency"], doc["ts"]
                )
            except (ValueError, KeyError, TypeError, InvalidOperation):
                self.unreadable_payments.append((r.partition, r.offset))
                continue
            self.valid[(r.partition, r.offset)] = payment

    def decisions_from(self, records: list[Seen]) -> None:
        for r in self.take("decisions", records):
            try:
                doc = json.loads(r.value or b"")
                when = datetime.fromisoformat(doc["decided_at"]).timestamp()
                d = Decision(
                    int(doc["partition"]),
                    int(doc["offset"]),
                    str(doc["payment_id"]),
                    str(doc.get("worker", "")),
                    when,
                    r.arrived,
                    str(doc.get("verdict", "")),
                )
            except (ValueError, KeyError, TypeError):
                self.unreadable_decisions += 1
                continue
            self.decisions.append(d)
            self.decided.add((d.partition, d.offset))

    def alerts_from(self, records: list[Seen]) -> None:
        for r in self.take("alerts", records):
            try:
                payment_id = str(json.loads(r.value or b"")["payment_id"])
            except (ValueError, KeyError, TypeError):
                payment_id = (r.key or b"").decode(errors="replace")
            self.alerts[payment_id] += 1
            self.alert_records.setdefault(payment_id, []).append(AlertSeen.of(r))

    def dead_letters(self, records: list[Seen], source_of: Callable[[str], str]) -> None:
        for r in self.take("dlq", records):
            headers = {k: v.decode(errors="replace") for k, v in r.headers}
            source = source_of(headers.get("dlq.worker", ""))
            try:
                origin = (int(headers["dlq.partition"]), int(headers["dlq.offset"]))
            except (KeyError, ValueError):
                origin = (-1, -1)
            self.dead.setdefault(source, {})[origin] = headers.get("dlq.reason", "?")
            self.dead_arrived[source] = max(self.dead_arrived.get(source, 0.0), r.arrived)


# ---- the run


class Soak:
    """One soak run: start, warm up, traffic with faults, catch-up, judge, clean up."""

    def __init__(self, options: Options, say: Callable[[str], None] | None = None) -> None:
        self.options = options
        self.began = time.monotonic()
        self._say = say
        self.folder = Path(tempfile.mkdtemp(prefix="aml-chaos-"))
        self.folder.chmod(0o755)  # a root run hands the PostgreSQL folder inside it to another user
        self.faults, self.skipped = plan(options)
        self.broker: EmbeddedBroker | None = None
        self.postgres: EmbeddedPostgres | None = None
        self.system: System | None = None
        self.simulator: AmlAppProcess | None = None
        self.producer: AIOKafkaProducer | None = None
        self.readers: dict[str, TopicReader] = {}
        self.poller: CommitPoller | None = None
        self.derived = DerivedRecords()
        #: Offsets of the derived topic its reader did not reach (`derived_read_whole`; None: not derived).
        self.derived_behind: int | None = None
        self.closing = asyncio.Event()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.findings = Findings()
        self.unexpected: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.frozen = False
        #: A worker stopped with SIGSTOP by `freeze-worker`, until it is continued (the cleanup continues it).
        self.frozen_worker: WorkerProcess | None = None
        #: The (partition, offset) of the payments `odd-timestamps` sent: "future" and "past".
        self.odd: dict[str, tuple[int, int]] = {}
        self.pipeline_starts = 0
        self.t0 = 0.0  # monotonic start of the traffic
        self.t0_wall = 0.0
        #: The simulator's first event time (`--start`), fixed by the warm-up, whose payments carry it: no
        #: simulated payment is older than the warm-up's, so none is past Service C's horizon behind it.
        self.first_event = ""
        self.next_progress = 0.0
        self.timings: dict[str, float] = {}
        self.ends: dict[int, int] = {}
        self.listed_ends: dict[int, int] = {}
        self.caught_up_at: float | None = None
        self.code = "the checkout as it is (--live-code)"
        self.pythonpath: str | None = None  # PYTHONPATH before the run, restored at the end

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.began:7.1f}s] {text}"
        if self._say is not None:
            self._say(line)
        else:
            print(line, flush=True)

    # -- names

    @property
    def settings(self) -> Settings:
        assert self.system is not None
        return self.system.settings

    @property
    def aml_group(self) -> str:
        return service_settings(self.settings, "aml").app_id

    @property
    def dependency_groups(self) -> tuple[str, ...]:
        return tuple(dep.group(self.settings) for dep in registry.SERVICES.values())

    @property
    def derived_group(self) -> str | None:
        """C's group when it reads the enrichment stage's topic (`--derived`)."""
        return self.settings.aggregates_group if self.options.derived else None

    @property
    def dead_letter_sources(self) -> tuple[str, ...]:
        """Who must dead-letter every malformed record: B, C (or the stage whose topic it reads) and AML."""
        return ("relations", "enrichment" if self.options.derived else "aggregates", "aml")

    def positions(self, poll: Poll) -> dict[str, dict[int, int]]:
        """Each dependency group's position on payments at `poll`: its committed offsets, or for a group
        reading the stage's topic, what the topic's records prove it applied (`DerivedRecords.position`)."""
        found = {g: poll.committed[g] for g in self.dependency_groups if g != self.derived_group}
        if self.derived_group is not None:
            stage = poll.committed[self.settings.kafka.enrichment_group]
            found[self.derived_group] = self.derived.position(stage, poll.committed[self.derived_group])
        return found

    def source_of(self, worker: str) -> str:
        """Who dead-lettered: B and C write their group's name, an AML worker its worker id, the stage
        "enrichment"."""
        if worker == DEAD_LETTER_WORKER:
            return "enrichment"
        for name, dep in registry.SERVICES.items():
            if worker in (dep.group(self.settings), name):
                return name
        assert self.system is not None
        if any(w.worker_id == worker for w in self.system.all_workers):
            return "aml"
        return f"other:{worker}"

    # -- the whole run

    async def run(self) -> dict[str, Any]:
        """The result document; `ok` says whether every promise held."""
        info = machine()
        error = ""
        try:
            started = time.monotonic()
            await self.start()
            self.timings["start_s"] = time.monotonic() - started
            started = time.monotonic()
            await self.warm_up()
            self.timings["warm_up_s"] = time.monotonic() - started
            started = time.monotonic()
            await self.traffic()
            self.timings["traffic_s"] = time.monotonic() - started
            started = time.monotonic()
            await self.catch_up()
            self.timings["catch_up_s"] = time.monotonic() - started
            aml = await self.aml_commit_check()
            stores = await self.check_stores()
            self.derived_behind = await self.derived_read_whole()
            doc = self.judge(aml, stores, await self.decided_on_a_fresh_read())
        except Exception as exc:  # SystemFailure, SoakError, a broker or server that did not start
            error = f"{type(exc).__name__}: {exc}"
            self.say(f"the soak could not run: {error}")
            traceback.print_exc()
            doc = {"ok": False, "failures": [f"the soak could not run: {error}"]}
        finally:
            await self.cleanup()
        self.timings["total_s"] = time.monotonic() - self.began
        machine_at_end(info)
        doc = {
            "benchmark": NAME,
            "machine": info,
            "params": {
                "seed": self.options.seed,
                "duration": self.options.duration,
                "rate": self.options.rate,
                "faults": list(self.options.faults),
                "gap": list(self.options.gap),
                "catch_up": self.options.catch_up,
                "commit_grace": self.options.commit_grace,
                "sample": self.options.sample,
                "partitions": PARTITIONS,
                "gate": self.options.gate,
                "live_code": self.options.live_code,
                "derived": self.options.derived,
            },
            "folder": str(self.folder),
            "code": self.code,
            "error": error,
            "timings": {k: round(v, 1) for k, v in self.timings.items()},
            **doc,
        }
        return doc

    async def start(self) -> None:
        """Broker and PostgreSQL of our own, the topics through the CLI, then the processes."""
        self.say(f"work folder {self.folder}")
        if not self.options.live_code:
            code, self.code = snapshot_code(self.folder)
            self.pythonpath = os.environ.get("PYTHONPATH", "")
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), self.pythonpath]))
            self.say(f"every process runs a copy of the code taken now ({self.code}): {code}")
        self.broker = EmbeddedBroker(free_port(), log_path=self.folder / "broker.log")
        await asyncio.to_thread(self.broker.start)
        self.postgres = EmbeddedPostgres(self.folder / "postgres", free_port())
        await asyncio.to_thread(self.postgres.start)
        settings = Settings(kafka=KafkaSettings(partitions=PARTITIONS), web=WebSettings(port=free_port()))
        for name in registry.NAMES:
            settings = settings.with_endpoint(name, port=free_port())
        if self.options.derived:
            settings = with_derived_aggregates(settings)
        layout = Layout(
            workers={"aml": 2},
            api_replicas=2,
            bootstrap=(self.broker.bootstrap,),
            store_url=self.postgres.url("aml"),
            gate=self.options.gate,
        )
        self.system = System(settings, self.folder / "system", layout, say=self.say)
        self.system.folder.mkdir(parents=True, exist_ok=True)
        await self.system.start_broker()
        kafka = replace(self.system.settings.kafka, bootstrap_servers=tuple(self.system.bootstrap))
        self.system.settings = replace(self.system.settings, kafka=kafka)
        await self.system.start_store()
        await self.create_topics()
        await self.start_clients()
        self.system.start_services()
        for _ in range(2):  # each on a free port of its own: consecutive ports may be taken meanwhile
            self.system.add_worker("aml")
        self.say(f"broker {self.broker.bootstrap}, PostgreSQL {self.postgres.url('aml')}")
        await self.system.wait_ready()

    async def create_topics(self) -> None:
        """`aml-app topics --create`, as a user provisions a cluster."""
        env = {**os.environ, **services_env(self.settings)}
        done = await asyncio.to_thread(
            subprocess.run,
            [aml_app_executable(), "topics", "--create"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        (self.folder / "topics.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise SoakError(f"aml-app topics --create failed: {(done.stderr or done.stdout).strip()[-500:]}")
        self.say(f"aml-app topics --create: {done.stdout.count('created')} topics created")

    async def start_clients(self) -> None:
        s = self.settings
        aml = service_settings(s, "aml")
        bootstrap = self.system.bootstrap[0] if self.system else ""
        topics = {
            "payments": s.kafka.payments_topic,
            "decisions": aml.kafka.decisions_topic,
            "alerts": aml.kafka.alerts_topic,
            "dlq": s.kafka.dlq_topic,
        }
        for name, topic in topics.items():
            self.readers[name] = await TopicReader(bootstrap, topic, PARTITIONS).start()
            self.tasks[f"{name} reader"] = asyncio.create_task(self.readers[name].run(self.closing))
        groups: tuple[str, ...] = (*self.dependency_groups, self.aml_group)
        on_topic: dict[str, str] = {}
        if self.derived_group is not None:
            # The stage's offsets are read before C's in each poll, as the proof needs (DerivedRecords).
            groups = (s.kafka.enrichment_group, *groups)
            on_topic[self.derived_group] = s.kafka.enriched_topic
            # One producer, the stage, writes the derived topic, in transactions: a marker at each commit.
            # Read again for seconds, each marker holds the reader back (a 60 s soak read a tenth of the
            # topic) and C's positions, read from what it saw, stand too high; Tansu's race needs two
            # producers.
            self.readers["derived"] = await TopicReader(
                bootstrap, s.kafka.enriched_topic, PARTITIONS, refetch_for=0.0
            ).start()
            self.tasks["derived reader"] = asyncio.create_task(self.readers["derived"].run(self.closing))
            self.derived.reader = self.readers["derived"]
        self.poller = CommitPoller(bootstrap, s.kafka.payments_topic, PARTITIONS, groups, on_topic)
        self.tasks["commit poller"] = asyncio.create_task(self.poller.run(self.closing))
        self.producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
        await self.producer.start()

    async def warm_up(self) -> None:
        """One payment per partition, until both dependencies committed past it (Spark's first batch)."""
        assert self.producer is not None and self.poller is not None
        placed: dict[int, int] = {}
        o = self.options
        first = default_start(payment_count(o.rate, o.duration), o.rate, DEFAULT_SPEEDUP, datetime.now(UTC))
        self.first_event = first.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        for p in range(PARTITIONS):
            payer = f"chaos-warm-{p}"
            value = payment_bytes(
                f"chaos-warm-{self.options.seed}-{p}", payer, "chaos-warm-sink", "1.00", self.first_event
            )
            meta = await (
                await self.producer.send(self.settings.kafka.payments_topic, value, payer.encode(), p)
            )
            placed[meta.partition] = meta.offset
        self.say(f"warm-up: waiting up to {WARM_UP_DEADLINE:.0f} s for the pipeline's first batch")

        def passed() -> bool:
            poll = self.poller.latest() if self.poller else None
            if poll is None:
                return False
            at = self.positions(poll)
            return all(at[g][p] > o for g in self.dependency_groups for p, o in placed.items())

        if not await self.wait_for(passed, WARM_UP_DEADLINE, "the dependencies to commit past the warm-up"):
            raise SoakError(f"the pipeline did not commit its first batch within {WARM_UP_DEADLINE:.0f} s")

    async def wait_for(self, condition: Callable[[], bool], deadline: float, what: str) -> bool:
        """Poll `condition` while watching the processes; False (said out loud) after `deadline` s."""
        until = time.monotonic() + deadline
        while not condition():
            if time.monotonic() > until:
                self.say(f"gave up waiting for {what} after {deadline:.0f} s")
                return False
            await self.tick()
            await asyncio.sleep(0.25)
        return True

    # -- traffic and faults

    async def traffic(self) -> None:
        o = self.options
        env = {**os.environ, **services_env(self.settings)}
        args = ["simulate", "--rate", f"{o.rate:g}", "--duration", f"{o.duration:g}", "--seed", str(o.seed)]
        args += ["--start", self.first_event]
        self.simulator = AmlAppProcess(
            [*args, "--prefix", f"chaos{o.seed}"], env, self.folder / "simulator.log"
        ).start()
        self.t0, self.t0_wall = time.monotonic(), time.time()
        self.next_progress = self.t0 + PROGRESS_EVERY
        self.say(f"aml-app {' '.join(args)}; {len(self.faults)} faults planned")
        for kind, why in NOT_INJECTED.items():
            self.say(f"  skipped: {kind} ({why})")
        for kind in self.skipped:
            self.say(
                f"  skipped: {kind} (does not fit in {o.duration:g} s at gaps of {o.gap[0]:g}-{o.gap[1]:g} s)"
            )
        stop_malformed = asyncio.Event()
        faults = asyncio.create_task(self.run_faults())
        malformed = asyncio.create_task(self.send_malformed(stop_malformed))
        deadline = self.t0 + o.duration + SIMULATOR_SLACK
        while self.simulator.alive():
            if time.monotonic() > deadline:
                self.notes.append(f"the simulator was still sending {SIMULATOR_SLACK:.0f} s after --duration")
                self.simulator.signal_group(signal.SIGTERM)
                await asyncio.to_thread(self.simulator.wait, 15)
                break
            if faults.done() and faults.exception() is not None:
                raise SoakError(f"the fault schedule failed: {faults.exception()!r}")
            await self.tick()
            await asyncio.sleep(0.5)
        stop_malformed.set()
        self.say(f"the simulator exited with code {self.simulator.returncode}")
        if self.simulator.returncode != 0:
            self.notes.append(f"the simulator exited with code {self.simulator.returncode}")
        try:
            await asyncio.wait_for(malformed, 60)
        except TimeoutError:
            self.notes.append("the malformed records' sender did not stop within 60 s")
        try:
            await asyncio.wait_for(asyncio.shield(faults), FAULTS_DEADLINE)
        except TimeoutError:
            faults.cancel()
            self.notes.append(f"the fault schedule was not done {FAULTS_DEADLINE:.0f} s after the traffic")

    async def send_malformed(self, stop: asyncio.Event) -> None:
        """One malformed record per MALFORMED_EVERY payments, paced against the traffic's start."""
        assert self.producer is not None
        interval = MALFORMED_EVERY / self.options.rate
        n = 0
        while not stop.is_set() and (n + 1) * interval < self.options.duration:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(self.t0 + (n + 1) * interval - time.monotonic(), 0))
            if stop.is_set():
                break
            key, value = malformed_record(n)
            n += 1
            try:
                await asyncio.wait_for(
                    await self.producer.send(self.settings.kafka.payments_topic, value, key), FAULTS_DEADLINE
                )
            except Exception as exc:  # counted from the topic anyway: a record that did not land is no case
                self.notes.append(f"malformed record {n - 1} not acknowledged: {exc!r}")

    async def run_faults(self) -> None:
        for fault in self.faults:
            await asyncio.sleep(max(self.t0 + fault.at - time.monotonic(), 0))
            fault.started = time.time()
            try:
                await self.inject(fault)
            except Exception as exc:  # reported: a fault that could not be injected fails the run
                fault.error = f"{type(exc).__name__}: {exc}"
            fault.ended = time.time()
            took = fault.ended - fault.started
            self.say(
                f"fault at +{fault.started - self.t0_wall:.1f}s: {fault.kind}: {fault.what}"
                + (f" FAILED: {fault.error}" if fault.error else "")
                + f" ({took:.1f} s)"
            )

    def live_workers(self) -> list[WorkerProcess]:
        assert self.system is not None
        return [w for w in self.system.all_workers if w.alive() and w.worker_id not in self.system.killed]

    async def inject(self, fault: Fault) -> None:
        system, broker, postgres = self.system, self.broker, self.postgres
        assert system is not None and broker is not None and postgres is not None
        if fault.kind == "kill-worker":
            victim = self.live_workers()[0]  # the oldest: every original worker gets its turn
            fault.target = victim.worker_id
            await asyncio.to_thread(system.kill_worker, victim)
            fault.what = f"kill -9 {victim.worker_id}; started {system.add_worker('aml').worker_id}"
        elif fault.kind == "kill-pipeline":
            assert system.pipeline is not None
            await asyncio.to_thread(system.pipeline.kill)
            self.restart_pipeline()
            fault.what = "kill -9 of the pipeline's process group; started it again"
        elif fault.kind == "kill-stage":
            assert system.stage is not None
            await asyncio.to_thread(system.stage.kill)
            system.restart_stage()
            fault.what = "kill -9 of the enrichment stage; started it again (same transactional id)"
        elif fault.kind == "kill-api":
            await asyncio.to_thread(system.apis[fault.target].kill)
            system.restart_api(fault.target)
            fault.what = f"kill -9 of the {fault.target} API; started it again"
        elif fault.kind == "postgres-stop":
            await asyncio.to_thread(postgres.stop, "immediate")
            await asyncio.sleep(fault.seconds)
            await asyncio.to_thread(postgres.start)
            fault.what = f"PostgreSQL stopped (immediate) for {fault.seconds:g} s, then started"
        elif fault.kind == "postgres-slow":
            tables = await asyncio.to_thread(self.hold_store_tables, fault.seconds)
            fault.what = (
                f"PostgreSQL slow: {', '.join(tables)} locked (ACCESS EXCLUSIVE) for {fault.seconds:g} s"
            )
        elif fault.kind in ("broker-freeze", "broker-freeze-long"):
            broker.pause()
            self.frozen = True
            try:
                await asyncio.sleep(fault.seconds)
            finally:
                broker.resume()
                self.frozen = False
            fault.what = f"broker SIGSTOP for {fault.seconds:g} s, then SIGCONT"
        elif fault.kind == "freeze-worker":
            await self.freeze_worker(fault)
        elif fault.kind == "odd-timestamps":
            await self.send_odd_timestamps(fault)
        elif fault.kind == "scale-up":
            before = len(self.live_workers())
            fault.target = system.add_worker("aml").worker_id
            fault.what = f"workers {before} -> {before + 1} (started {fault.target})"
        elif fault.kind == "scale-down":
            live = self.live_workers()
            victim = live[-1]
            fault.target = victim.worker_id
            system.killed.add(victim.worker_id)  # a stop on purpose, not a crash
            stopped = await asyncio.to_thread(victim.stop, 30)
            fault.what = f"workers {len(live)} -> {len(live) - 1} (SIGTERM {victim.worker_id}" + (
                ")" if stopped else ", killed after 30 s)"
            )
        else:
            raise ValueError(f"unknown fault {fault.kind!r}")

    def hold_store_tables(self, seconds: float) -> list[str]:
        """Lock every table of the dependencies' stores for `seconds` in one transaction: the pipeline's
        writes and the APIs' reads wait behind it (PostgreSQL slow, not down)."""
        import psycopg
        from psycopg import sql

        assert self.postgres is not None
        schemas = [dep.schema.name for dep in registry.SERVICES.values()]
        with psycopg.connect(self.postgres.url("aml"), connect_timeout=10) as conn:
            rows = conn.execute(
                "SELECT table_schema, table_name FROM information_schema.tables "
                "WHERE table_schema = ANY(%s) AND table_type = 'BASE TABLE' ORDER BY 1, 2",
                (schemas,),
            ).fetchall()
            names = [sql.Identifier(schema, table) for schema, table in rows]
            conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(sql.SQL(", ").join(names)))
            time.sleep(seconds)
            conn.rollback()
        return [f"{schema}.{table}" for schema, table in rows]

    async def freeze_worker(self, fault: Fault) -> None:
        """SIGSTOP the AML worker holding the most partitions (with what it has in flight), wait until the
        others own every partition, then SIGCONT it: a zombie that must not commit, alert or decide twice
        beyond what it had in flight."""
        live = self.live_workers()
        states = await asyncio.gather(*(w.state() for w in live))
        held = {w.worker_id: (s or {}).get("assigned", []) for w, s in zip(live, states, strict=True)}
        victim = max(live, key=lambda w: len(held[w.worker_id]))
        others = [w for w in live if w is not victim]
        fault.target = victim.worker_id
        in_flight = sum(1 for o in ((states[live.index(victim)] or {}).get("in_flight") or {}).values() if o)
        stopped_at = time.time()
        victim.signal_group(signal.SIGSTOP)
        self.frozen_worker = victim
        stopped = time.monotonic()
        moved = False
        try:
            while time.monotonic() - stopped < MOVE_DEADLINE:
                found = await asyncio.gather(*(w.state() for w in others))
                owned = {p for state in found if state for p in state.get("assigned", [])}
                if owned >= set(range(PARTITIONS)):
                    moved = True
                    break
                await asyncio.sleep(0.5)
        finally:
            victim.signal_group(signal.SIGCONT)
            fault.frozen = (stopped_at, time.time())
            self.frozen_worker = None
        took = time.monotonic() - stopped
        fault.seconds = round(took, 1)
        fault.what = (
            f"SIGSTOP {victim.worker_id} holding partitions {held[victim.worker_id]} "
            f"({in_flight} lanes busy); "
            + (f"they moved to the others after {took:.1f} s; SIGCONT" if moved else "SIGCONT")
        )
        if not moved:
            fault.error = f"its partitions had not moved to the other workers {MOVE_DEADLINE:g} s later"

    async def send_odd_timestamps(self, fault: Fault) -> None:
        """A payment stamped 2099 (past any allowed clock skew: every consumer dead-letters it) and one
        stamped 1971 (valid: decided, and older than every window of C)."""
        assert self.producer is not None
        for kind, ts in (("future", FUTURE_TS), ("past", PAST_TS)):
            payer = f"chaos-{kind}-{self.options.seed}"
            value = payment_bytes(payer, payer, "chaos-odd-sink", "12.00", ts)
            sent = await within(
                await self.producer.send(self.settings.kafka.payments_topic, value, payer.encode()),
                FAULTS_DEADLINE,
                f"sending the {kind} payment",
            )
            self.odd[kind] = (sent.partition, sent.offset)
        fault.what = (
            f"a payment stamped {FUTURE_TS} at {self.odd['future']} and one stamped {PAST_TS} at "
            f"{self.odd['past']} (partition, offset)"
        )

    def restart_pipeline(self) -> None:
        assert self.system is not None
        self.pipeline_starts += 1
        log_path = self.system.folder / f"pipeline.restart-{self.pipeline_starts}.log"
        self.system.pipeline = ServiceProcess("pipeline", ["pipeline"], self.settings, log_path).start()

    def reap(self) -> None:
        """A process that died on its own is reported (with the end of its log) and started again."""
        system = self.system
        if system is None:
            return
        for worker in list(system.all_workers):
            if worker.process is not None and not worker.alive() and worker.worker_id not in system.killed:
                self.record_exit(
                    f"worker {worker.worker_id}", worker.returncode, crash_lines(worker.log_text())
                )
                system.killed.add(worker.worker_id)
                system.add_worker("aml")
        pipeline = system.pipeline
        if pipeline is not None and not pipeline.alive() and not pipeline.stopped:
            self.record_exit("the pipeline", pipeline.returncode, crash_lines(pipeline.log_text()))
            pipeline.stopped = True
            self.restart_pipeline()
        stage = system.stage
        if stage is not None and not stage.alive() and not stage.stopped:
            self.record_exit("the enrichment stage", stage.returncode, crash_lines(stage.log_text()))
            stage.stopped = True
            system.restart_stage()
        for name, api in list(system.apis.items()):
            if not api.alive() and not api.stopped:
                self.record_exit(f"the {name} API", api.returncode, crash_lines(api.log_text()))
                api.stopped = True
                system.restart_api(name)

    def record_exit(self, who: str, code: int | None, tail: str) -> None:
        at = time.time() - self.t0_wall if self.t0_wall else None
        worker = who.removeprefix("worker ") if who.startswith("worker ") else None
        self.unexpected.append({"process": who, "worker": worker, "code": code, "at": at, "log_tail": tail})
        self.say(f"UNEXPECTED: {who} exited with code {code}; started it again. End of its log:\n{tail}")

    async def tick(self) -> None:
        """Reap, check our own clients, parse what arrived, and say how far things got now and then."""
        self.reap()
        for name, task in self.tasks.items():
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise SoakError(f"the {name} failed: {task.exception()!r}")
        self.update()
        if self.t0 and time.monotonic() >= self.next_progress:
            self.next_progress += PROGRESS_EVERY
            self.progress()

    def update(self) -> None:
        f = self.findings
        f.payments(self.readers["payments"].records)
        f.decisions_from(self.readers["decisions"].records)
        f.alerts_from(self.readers["alerts"].records)
        f.dead_letters(self.readers["dlq"].records, self.source_of)

    def progress(self) -> None:
        f, poll = self.findings, self.poller.latest() if self.poller else None
        ends = self.readers["payments"].highwater()
        lag = ""
        if poll is not None:
            at = {**poll.committed, **self.positions(poll)}
            lag = " ".join(
                f"{g} {sum(max(end - at[g].get(p, 0), 0) for p, end in ends.items())}"
                for g in at
                if g != self.settings.kafka.enrichment_group or self.derived_group is not None
            )
        dead = "/".join(str(len(f.dead.get(s, {}))) for s in self.dead_letter_sources)
        workers = ",".join(w.worker_id for w in self.live_workers())
        self.say(
            f"+{time.monotonic() - self.t0:.0f}s  payments {len(f.valid)} (+{len(f.malformed)} malformed)  "
            f"decided {len(f.decided & set(f.valid))}  dead-lettered r/a/aml {dead}  lag {lag}  "
            f"workers {workers}  polls {len(self.poller.polls) if self.poller else 0} "
            f"(failed {self.poller.failures if self.poller else 0})"
        )

    # -- catch-up and the checks

    def caught_up(self) -> bool:
        poll = self.poller.latest() if self.poller else None
        if poll is None or not self.ends:
            return False
        at = self.positions(poll)
        if any(at[g][p] < end for g in self.dependency_groups for p, end in self.ends.items()):
            return False
        f = self.findings
        if not set(f.valid) <= f.decided:
            return False
        return all(f.malformed <= set(f.dead.get(s, {})) for s in self.dead_letter_sources)

    async def catch_up(self) -> None:
        """Every producer stopped: the log ends are final; wait until everything was handled."""
        assert self.broker is not None
        self.ends, self.listed_ends = await log_ends(
            self.broker.bootstrap, self.settings.kafka.payments_topic, PARTITIONS
        )
        self.say(
            f"log ends (fetch high watermark) {self.ends}; ListOffsets says {self.listed_ends}; "
            f"waiting up to {self.options.catch_up:.0f} s for the catch-up"
        )
        if await self.wait_for(self.caught_up, self.options.catch_up, "the catch-up"):
            self.caught_up_at = time.time()
            self.say("caught up: dependencies at the log end, every payment decided and dead-lettered")
        self.progress()

    def reached(self, group: str) -> Poll | None:
        """The first poll that saw `group` at the log end on every partition."""
        assert self.poller is not None
        for poll in self.poller.polls:
            if all(poll.committed[group][p] >= end for p, end in self.ends.items()):
                return poll
        return None

    async def aml_commit_check(self) -> dict[str, Any]:
        """The AML group's committed offsets must reach the log end within a few commit intervals of its
        last decision (or dead letter); watched a while longer to say how far it got."""
        self.update()
        f, group = self.findings, self.aml_group
        last = max([d.arrived for d in f.decisions] + [f.dead_arrived.get("aml", 0.0)], default=time.time())
        grace = self.options.commit_grace
        await self.wait_for(
            lambda: self.reached(group) is not None, max(last + grace - time.time(), 1), group
        )
        poll = self.reached(group)
        within = poll is not None and poll.started - last <= grace
        if not within:
            await self.wait_for(lambda: self.reached(group) is not None, COMMIT_PATIENCE, f"{group}, longer")
        poll = self.reached(group)
        latest = self.poller.latest() if self.poller else None
        behind = (
            sum(max(end - latest.committed[group][p], 0) for p, end in self.ends.items()) if latest else None
        )
        return {
            "group": group,
            "last_activity_to_end_s": None if poll is None else round(poll.started - last, 2),
            "within_grace": within,
            "grace_s": grace,
            "behind_at_end_of_check": behind,
            "committed": latest.committed[group] if latest else None,
        }

    async def check_stores(self) -> dict[str, Any]:
        """For sampled payers, every API replica's count and sums against the payments read here."""
        assert self.system is not None
        totals: dict[str, tuple[int, dict[str, Decimal]]] = {}
        latest = datetime.fromtimestamp(0, UTC)
        for payment in self.findings.valid.values():
            if is_odd(payment.payer):
                continue  # stamped 1971: no window of C at the traffic's end holds it
            count, sums = totals.get(payment.payer, (0, {}))
            sums[payment.currency] = sums.get(payment.currency, Decimal(0)) + payment.amount
            totals[payment.payer] = (count + 1, sums)
            latest = max(latest, datetime.fromisoformat(payment.ts))
        at = latest.astimezone(UTC).isoformat().replace("+00:00", "Z")
        rng = random.Random(self.options.seed)
        payers = rng.sample(sorted(totals), min(self.options.sample, len(totals)))
        disagreements: list[dict[str, Any]] = []
        asked = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT)) as http:
            for name, api in sorted(self.system.apis.items()):
                for payer in payers:
                    asked += 1
                    expected = totals[payer]
                    got = await self.ask(http, api.url, api.kind, payer, at, api.headers)
                    if got != expected:
                        disagreements.append(
                            {"payer": payer, "replica": name, "expected": show(expected), "got": show(got)}
                        )
        return {
            "payers": len(payers),
            "replicas": sorted(self.system.apis),
            "asked": asked,
            "at": at,
            "disagreements": len(disagreements),
            "examples": disagreements[:10],
            "agree": not disagreements and asked > 0,
        }

    @staticmethod
    async def ask(
        http: aiohttp.ClientSession, url: str, kind: str, payer: str, at: str, headers: Mapping[str, str]
    ) -> tuple[int, dict[str, Decimal]] | str:
        """(count, sum per currency) of `payer`'s payments as one replica answers it, or what went wrong."""
        account = quote(payer, safe="")
        if kind == "relations":
            path, params = f"/relations/{account}", {"hops": "1", "parts": "out"}
        else:
            path, params = f"/aggregates/{account}", {"at": at}
        try:
            async with http.get(url + path, params=params, headers=headers) as response:
                if response.status != 200:
                    return f"HTTP {response.status}: {(await response.text())[:200]}"
                body = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        sums: dict[str, Decimal] = {}
        if kind == "relations":
            count = 0
            for edge in body.get("out", []):
                count += int(edge["count"])
                for currency, total in edge["totals"].items():
                    sums[currency] = sums.get(currency, Decimal(0)) + Decimal(total)
            return count, sums
        week = body["windows"]["7d"]
        return int(week["sent_count"]), {c: Decimal(t) for c, t in week["sent"].items()}

    # -- the verdict

    async def derived_read_whole(self) -> int | None:
        """Offsets of the derived topic its reader has not reached by its end (None without `--derived`):
        C's positions come from the records it read (`DerivedRecords`), and from fewer they stand too high,
        so a premature decision could pass."""
        reader = self.readers.get("derived")
        if reader is None or self.system is None:
            return None
        ends, _ = await log_ends(self.system.bootstrap[0], reader.topic, PARTITIONS)
        until = time.monotonic() + DERIVED_READ_DEADLINE
        while (behind := await reader.behind(ends)) and time.monotonic() < until:
            await self.tick()
            await asyncio.sleep(0.25)
        return behind

    async def decided_on_a_fresh_read(self) -> set[tuple[int, int]] | None:
        """The payments a new reader of the decisions topic finds decided, when the soak's reader left
        some undecided (None otherwise): a lost payment found here was missed by the reader, not lost."""
        self.update()
        f = self.findings
        if set(f.valid) <= f.decided:
            return None
        again = Findings()
        bootstrap = self.system.bootstrap[0] if self.system else ""
        again.decisions_from(await read_again(bootstrap, self.readers["decisions"].topic, PARTITIONS))
        return again.decided

    def judge(
        self, aml: dict[str, Any], stores: dict[str, Any], read_again: set[tuple[int, int]] | None = None
    ) -> dict[str, Any]:
        self.update()
        f = self.findings
        assert self.poller is not None
        premature = []
        unpolled = 0
        for d in f.decisions:
            poll = self.poller.first_after(d.arrived)
            if poll is None:
                unpolled += 1
                continue
            at = self.positions(poll)
            for group in self.dependency_groups:
                committed = at[group].get(d.partition, 0)
                if d.offset >= committed:
                    premature.append((d, group, committed, poll.started))
        premature_ids = {(d.partition, d.offset) for d, *_ in premature}
        lost = sorted(set(f.valid) - f.decided)
        freezes = [(x.target, *x.frozen) for x in self.faults if x.frozen is not None]
        after_freeze = alerted_after_a_freeze(f.alerts, f.alert_records, freezes)
        alerted_twice = {pid: n for pid, n in f.alerts.items() if n > 1 and pid not in after_freeze}
        # A payment handled again decides as its standing alert says: no "clear" beside an alert, but for
        # one only a frozen worker alerted on, after its partition moved (which the new owner cannot know).
        cleared_beside = sorted(
            {
                d.payment_id
                for d in f.decisions
                if d.verdict == "clear"
                and d.payment_id in f.alerts
                and not only_frozen_sends(f.alert_records.get(d.payment_id, []), freezes)
            }
        )
        dead = {s: len(f.malformed & set(f.dead.get(s, {}))) for s in self.dead_letter_sources}
        malformed_decided = f.malformed & f.decided
        valid_dead = {s: len(set(f.valid) & set(f.dead.get(s, {}))) for s in f.dead}
        latest = self.poller.latest()
        groups: dict[str, Any] = {}
        for group in self.dependency_groups:
            applied = self.positions(latest)[group] if latest else {}
            behind = sum(max(end - applied.get(p, 0), 0) for p, end in self.ends.items())
            groups[group] = {"committed": applied, "behind": behind, "at_end": behind == 0}
        groups[self.aml_group] = {**aml, "at_end": aml["within_grace"]}
        faults = [
            {
                "kind": x.kind,
                "planned_at_s": x.at,
                "started_at_s": None if x.started is None else round(x.started - self.t0_wall, 1),
                "took_s": None if x.started is None or x.ended is None else round(x.ended - x.started, 1),
                "target": x.target,
                "seconds": x.seconds,
                "what": x.what,
                "error": x.error,
            }
            for x in self.faults
        ]
        again = self.redecided()
        doc: dict[str, Any] = {
            "faults": faults,
            "skipped": [{"fault": k, "why": why} for k, why in NOT_INJECTED.items()]
            + [{"fault": k, "why": "did not fit in the run"} for k in self.skipped],
            "unexpected_exits": self.unexpected,
            "notes": self.notes,
            "produced": {
                "valid": len(f.valid),
                "malformed": len(f.malformed),
                "unreadable_unmarked": len(f.unreadable_payments),
                "log_ends_fetch": self.ends,
                "log_ends_list_offsets": self.listed_ends,
                "payment_ids_twice_on_the_topic": sum(
                    1 for n in Counter(p.payment_id for p in f.valid.values()).values() if n > 1
                ),
            },
            "decision_records": len(f.decisions),
            "unreadable_decisions": f.unreadable_decisions,
            "premature": {
                "decisions": len(premature_ids),
                "undated": unpolled,
                "examples": [
                    {
                        "partition": d.partition,
                        "offset": d.offset,
                        "payment_id": d.payment_id,
                        "worker": d.worker,
                        "group": group,
                        "committed_in_the_next_poll": committed,
                        "arrived": d.arrived,
                        "poll_started": started,
                    }
                    for d, group, committed, started in premature[:10]
                ],
            },
            "lost": {
                "payments": len(lost),
                # Decided all the same in what a new reader finds: the soak's reader missed them.
                "decided_on_a_fresh_read": None if read_again is None else len(set(lost) & read_again),
                "examples": [
                    {"partition": p, "offset": o, "payment_id": f.valid[(p, o)].payment_id}
                    for p, o in lost[:10]
                ],
            },
            "malformed": {
                "produced": len(f.malformed),
                "dead_lettered": dead,
                "decided": len(malformed_decided),
                "valid_payments_dead_lettered": valid_dead,
            },
            "alerts": {
                "payments": len(f.alerts),
                "records": sum(f.alerts.values()),
                "alerted_twice": len(alerted_twice),
                "examples": {pid: self.story(pid) for pid in list(alerted_twice)[:10]},
                "cleared_beside_an_alert": len(cleared_beside),
                "cleared_examples": {pid: self.story(pid) for pid in cleared_beside[:10]},
                # Sent again by a worker that froze with the alert in its producer (`sent_after_a_freeze`).
                "sent_again_after_a_freeze": len(after_freeze),
                "after_a_freeze": {pid: self.story(pid) for pid in list(after_freeze)[:10]},
            },
            "decided_twice": again,
            "aml_behind_dependencies": self.aml_lag(),
            "stores": stores,
            "groups": groups,
            "caught_up": self.caught_up_at is not None,
            "poller": {
                "polls": len(self.poller.polls),
                "failures": self.poller.failures,
                "last_error": self.poller.last_error,
                "regressions": self.poller.regressions()[:20],
            },
            "readers": {
                name: {
                    "records": len(r.records),
                    "errors": r.errors,
                    "refetches": r.refetches,
                    "skipped": r.skipped(),
                }
                for name, r in self.readers.items()
            },
        }
        failures = []
        if premature_ids:
            failures.append(f"{len(premature_ids)} premature decisions")
        if lost:
            found = None if read_again is None else len(set(lost) & read_again)
            missed = "" if found is None else f"; a new reader finds {found} decided"
            failures.append(f"{len(lost)} payments lost (never decided{missed})")
        if alerted_twice:
            failures.append(f"{len(alerted_twice)} payments alerted twice")
        if cleared_beside:
            failures.append(f"{len(cleared_beside)} payments decided clear beside their alert")
        if not stores["agree"]:
            failures.append(f"stores disagree with the payments ({stores['disagreements']} answers)")
        for group, state in groups.items():
            if not state["at_end"]:
                failures.append(f"group {group} not at the log end after the catch-up")
        missing = {s: len(f.malformed) - n for s, n in dead.items() if n < len(f.malformed)}
        if missing:
            failures.append(f"malformed records not dead-lettered: {missing}")
        if malformed_decided:
            failures.append(f"{len(malformed_decided)} malformed records decided")
        if again["beyond_in_flight"]:
            failures.append(
                f"{again['beyond_in_flight']} decisions made again beyond what was in flight at a rebalance"
            )
        regressions = self.poller.regressions()
        if regressions:
            failures.append(f"committed offsets seen going back {len(regressions)} times")
        odd = self.odd_verdicts()
        doc["odd_timestamps"] = odd
        failures += odd["failures"]
        doc["derived_reader_behind"] = self.derived_behind
        if self.derived_behind:
            failures.append(
                f"the derived topic's reader stands {self.derived_behind} offsets short of its end"
            )
        if self.unexpected:
            failures.append(f"{len(self.unexpected)} process(es) died on their own")
        errors = [x for x in self.faults if x.error]
        if errors:
            failures.append(f"{len(errors)} faults could not be injected")
        doc["failures"] = failures
        doc["ok"] = not failures
        return doc

    def story(self, payment_id: str) -> dict[str, Any]:
        """When a payment's alerts arrived and who decided it when (seconds after the traffic started)."""
        since = self.t0_wall
        return {
            "alerts_arrived_s": [
                round(r.arrived - since, 2) for r in self.findings.alert_records.get(payment_id, [])
            ],
            "alerts_sent_by": [r.worker for r in self.findings.alert_records.get(payment_id, [])],
            "decisions": [
                {
                    "worker": d.worker,
                    "decided_s": round(d.decided_at - since, 2),
                    "arrived_s": round(d.arrived - since, 2),
                }
                for d in self.findings.decisions
                if d.payment_id == payment_id
            ],
        }

    def odd_verdicts(self) -> dict[str, Any]:
        """What became of `odd-timestamps`' payments: the 2099 one dead-lettered by every consumer with a
        reason about the clock, decided by none; the 1971 one decided (and dead-lettered by none)."""
        f = self.findings
        found: dict[str, dict[str, Any]] = {}
        failures: list[str] = []
        for kind, origin in self.odd.items():
            dead = {source: reason for source, letters in f.dead.items() if (reason := letters.get(origin))}
            found[kind] = {"at": list(origin), "decided": origin in f.decided, "dead_lettered": dead}
        if "future" in found:
            future = found["future"]
            missing = [
                s for s in self.dead_letter_sources if "clock skew" not in future["dead_lettered"].get(s, "")
            ]
            if missing or future["decided"]:
                failures.append(
                    f"the payment stamped {FUTURE_TS}: not dead-lettered by {missing}, decided: "
                    f"{future['decided']}"
                )
        if "past" in found and (not found["past"]["decided"] or found["past"]["dead_lettered"]):
            failures.append(
                f"the payment stamped {PAST_TS}: decided {found['past']['decided']}, "
                f"dead-lettered by {sorted(found['past']['dead_lettered'])}"
            )
        return {**found, "failures": failures}

    def redecided(self) -> dict[str, Any]:
        """Decision records beyond a payment's first, set against what was in flight at the rebalances.

        A worker that dies, or loses partitions in a rebalance, leaves the payments it decided since its
        group's last commit to be decided again: those are in flight. So a payment may be decided again
        only if it was owed before the repeat: decided first, at or past the group's committed offset of
        its partition (in the last poll before that instant), when an AML fault stopped the worker that
        decided it, or when any AML worker began or ended a rebalance (its log's revoke and assignment
        lines, `revokes`; a fault's rebalance can come after the next fault, and a frozen worker's return
        or a joining one brings rebalances of its own). Any other repeat is a decision made again that was
        committed, or one made by a stopped worker after its partitions moved (a zombie). Per AML fault,
        for information: the repeats up to the next fault, what was owed at it, and the most first
        decisions in any `commit_grace` seconds from the fault on (`decided_in_grace`).
        """
        grace = self.options.commit_grace
        assert self.poller is not None
        first: dict[str, Decision] = {}
        again: list[Decision] = []
        for d in sorted(self.findings.decisions, key=lambda d: d.decided_at):
            if d.payment_id in first:
                again.append(d)
            else:
                first[d.payment_id] = d
        events: list[tuple[float, str, str | None]] = []  # when, what, the worker it stopped (None: all)
        for x in self.faults:
            if x.started is not None and x.kind == "kill-worker":
                events.append((x.started, f"{x.kind} {x.target}", x.target))
            elif x.started is not None and x.kind == "scale-down":
                events.append((x.started, f"{x.kind} {x.target}", None))
            elif x.started is not None and x.kind in ("scale-up", "broker-freeze", "broker-freeze-long"):
                events.append((x.started, x.kind, None))
            elif x.started is not None and x.kind == "freeze-worker":
                # Its partitions move while it stands still: the next owners decide again what it had not
                # committed, as after a kill; and it must decide nothing again once continued.
                events.append((x.started, f"{x.kind} {x.target}", x.target))
        for e in self.unexpected:
            if e.get("worker"):
                events.append((self.t0_wall + e["at"], f"unexpected exit of {e['worker']}", e["worker"]))
        events.sort()
        decisions = list(first.values())
        # (when, owed then): at every stop of a worker its own, at every revoke everybody's.
        owed_at = [
            (at, self.uncommitted([d for d in decisions if d.worker == worker], at))
            for at, _, worker in events
            if worker is not None
        ] + [(at, self.uncommitted(decisions, at)) for at in self.revokes()]
        owed_at.sort(key=lambda pair: pair[0])

        def owed(repeat: Decision) -> bool:
            return any(repeat.payment_id in ids for at, ids in owed_at if at <= repeat.decided_at)

        beyond = [d for d in again if not owed(d)]
        beyond_ids = {id(d) for d in beyond}
        rows: list[dict[str, Any]] = []
        for i, (at, what, worker) in enumerate(events):
            until = events[i + 1][0] if i + 1 < len(events) else float("inf")
            mine = [d for d in decisions if worker is None or d.worker == worker]
            repeated = [d for d in again if at <= d.decided_at < until]
            in_flight = set().union(*(ids for t, ids in owed_at if at <= t < until))
            rows.append(
                {
                    "fault": what,
                    "at_s": round(at - self.t0_wall, 1),
                    "decided_again": len(repeated),
                    "in_flight": len(in_flight),
                    "beyond": sum(1 for d in repeated if id(d) in beyond_ids),
                    "decided_in_grace": busiest(sorted(d.decided_at for d in mine), at, until, grace),
                    # Who decided first and when, for a few: which worker's decisions were owed again.
                    "first_decisions": Counter(first[d.payment_id].worker for d in repeated),
                    "examples": [self.story(d.payment_id) for d in repeated[:3]],
                }
            )
        before = sum(1 for d in beyond if not events or d.decided_at < events[0][0])
        return {
            "payment_ids": len({d.payment_id for d in again}),
            "extra_records": len(again),
            "before_any_fault": before,
            "rebalance_marks": len(owed_at) - sum(1 for _, _, w in events if w is not None),
            "per_fault": rows,
            "beyond_in_flight": len(beyond),
            "beyond_examples": [self.story(d.payment_id) for d in beyond[:5]],
        }

    def revokes(self) -> list[float]:
        """When each AML worker began and ended a rebalance (epoch seconds), from the logs of every worker
        the run started: Faust's "Revoking previously assigned partitions" and "Setting newly assigned
        partitions" lines, stamped in local time. Faust logs the revoke before it stops the lanes, which
        may decide a payment or two in between: the assignment that ends the rebalance covers those."""
        assert self.system is not None
        marks = ("Revoking previously assigned partitions", "Setting newly assigned partitions")
        instants = []
        for path in sorted(self.system.folder.glob("worker-*.log")):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("[") and any(mark in line for mark in marks):
                    stamp = line[1 : line.index("]")]
                    with contextlib.suppress(ValueError):
                        instants.append(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp())
        return sorted(instants)

    def uncommitted(self, decisions: list[Decision], when: float) -> set[str]:
        """The payments of `decisions` made by `when` at or past the group's committed offset of their
        partition in the last poll that ended before `when`: what a rebalance then would have them
        decided again."""
        assert self.poller is not None
        poll = self.poller.last_ended_before(when)
        committed = poll.committed[self.aml_group] if poll is not None else {}
        return {
            d.payment_id
            for d in decisions
            if d.decided_at <= when and d.offset >= committed.get(d.partition, 0)
        }

    def aml_lag(self) -> dict[str, Any]:
        """How far the AML group's committed offsets trailed its dependencies' during the run, with the
        worst moment and a sample every five seconds (seconds after the traffic started, records). For
        information: the trail is long while the service decides a backlog its dependencies just
        released, and one that keeps growing while they keep up means decisions its group does not
        commit."""
        assert self.poller is not None
        worst, when, series, next_sample = 0, None, [], 0.0
        for poll in self.poller.polls:
            at = self.positions(poll)
            lag = sum(
                max(min(at[g][p] for g in self.dependency_groups) - o, 0)
                for p, o in poll.committed[self.aml_group].items()
            )
            if lag > worst:
                worst, when = lag, poll.started
            if poll.started >= self.t0_wall and poll.started >= next_sample:
                series.append((round(poll.started - self.t0_wall, 1), lag))
                next_sample = poll.started + 5
        return {
            "max_records": worst,
            "at_s": None if when is None else round(when - self.t0_wall, 1),
            "every_5s": series,
        }

    # -- the end

    async def cleanup(self) -> None:
        """Stop everything we started, each step bounded, whatever happened."""
        if self.broker is not None and self.frozen:
            self.broker.resume()
        if self.frozen_worker is not None:
            self.frozen_worker.signal_group(signal.SIGCONT)
        if self.simulator is not None and self.simulator.alive():
            self.simulator.signal_group(signal.SIGTERM)
            if not await asyncio.to_thread(self.simulator.wait, 10):
                self.simulator.kill()
        self.closing.set()
        if self.tasks:
            await asyncio.wait(self.tasks.values(), timeout=STOP_DEADLINE)
        for task in self.tasks.values():
            task.cancel()
        for reader in self.readers.values():
            await reader.stop()
        if self.poller is not None:
            await self.poller.stop()
        if self.producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.producer.stop(), STOP_DEADLINE)
        if self.system is not None:
            await self.system.cleanup()
        if self.broker is not None:
            await asyncio.to_thread(self.broker.stop)
        if self.postgres is not None:
            await asyncio.to_thread(self.postgres.stop, "immediate")
            if not self.options.keep:
                shutil.rmtree(self.postgres.data, ignore_errors=True)
        if self.pythonpath is not None:
            if self.pythonpath:
                os.environ["PYTHONPATH"] = self.pythonpath
            else:
                os.environ.pop("PYTHONPATH", None)
        self.say(f"logs in {self.folder}")


def crash_lines(log: str, keep: int = 8) -> str:
    """The lines of a log that say why a process died: its last errors and exceptions, else its end."""
    lines = log.splitlines()
    marks = ("ERROR", "CRITICAL", "Error:", "Exception:", "Traceback")
    found = [line[:400] for line in lines if any(mark in line for mark in marks)]
    return "\n".join(found[-keep:] or lines[-keep:])


def busiest(times: Sequence[float], start: float, until: float, width: float) -> int:
    """The most of `times` (sorted) in any window (t - width, t] with start <= t < until."""
    ends = [start, *(t for t in times if start <= t < until)]
    return max(bisect.bisect_right(times, t) - bisect.bisect_right(times, t - width) for t in ends)


def show(value: tuple[int, dict[str, Decimal]] | str) -> Any:
    if isinstance(value, str):
        return value
    return {"count": value[0], "sums": {c: str(t) for c, t in sorted(value[1].items())}}


# ---- the report


def summary(doc: dict[str, Any]) -> str:
    """The human reading of a result document."""
    params = doc["params"]
    lines = [
        f"chaos soak, seed {params['seed']}: {params['duration']:g} s at {params['rate']:g} payments/s, "
        f"{params['partitions']} partitions, 2 AML workers, 2 replicas per API"
        + ("" if params["gate"] else ", GATE OFF (negative control)")
        + f" ({doc['folder']})",
        f"code: {doc.get('code')}; timings: {doc['timings']}",
    ]
    info = doc["machine"]
    if params.get("live_code") and info.get("code_at_start") != info.get("code_at_end"):
        lines.append(
            f"WARNING: the checkout changed during the run ({info.get('code_at_start')} -> "
            f"{info.get('code_at_end')}): processes started late ran other code"
        )
    if doc.get("error"):
        return "\n".join([*lines, f"FAILED TO RUN: {doc['error']}"])
    lines.append("faults:")
    for x in doc["faults"]:
        at = "not injected" if x["started_at_s"] is None else f"+{x['started_at_s']:.1f}s"
        lines.append(
            f"  {at:>8} {x['kind']:<14} {x['what']}" + (f"  FAILED: {x['error']}" if x["error"] else "")
        )
    for x in doc["skipped"]:
        lines.append(f"  skipped  {x['fault']}: {x['why']}")
    for e in doc["unexpected_exits"]:
        lines.append(f"  UNEXPECTED EXIT: {e['process']} code {e['code']} at +{(e['at'] or 0):.1f}s")
    for note in doc["notes"]:
        lines.append(f"  note: {note}")
    produced, malformed, again = doc["produced"], doc["malformed"], doc["decided_twice"]
    lines += [
        f"payments produced: {produced['valid']} valid, {produced['malformed']} malformed; log ends by fetch "
        f"{produced['log_ends_fetch']}, by ListOffsets {produced['log_ends_list_offsets']}",
        f"premature decisions: {doc['premature']['decisions']}"
        + (f" (undated: {doc['premature']['undated']})" if doc["premature"]["undated"] else ""),
        f"payments lost (valid, never decided): {doc['lost']['payments']}",
        f"malformed: {malformed['produced']} produced, dead-lettered by "
        f"{'/'.join(malformed['dead_lettered'])} "
        f"{'/'.join(str(n) for n in malformed['dead_lettered'].values())}, "
        f"decided {malformed['decided']}",
        f"alerted twice: {doc['alerts']['alerted_twice']} (of {doc['alerts']['payments']} payments alerted; "
        f"{doc['alerts']['sent_again_after_a_freeze']} sent again by a worker frozen with the alert in its "
        "producer); decided clear beside their alert: "
        f"{doc['alerts'].get('cleared_beside_an_alert', 0)}",
        *(
            f"payment stamped {FUTURE_TS if kind == 'future' else PAST_TS} at {odd['at']}: decided "
            f"{odd['decided']}, dead-lettered by {sorted(odd['dead_lettered']) or 'none'}"
            for kind, odd in doc.get("odd_timestamps", {}).items()
            if kind != "failures"
        ),
        f"decided twice: {again['payment_ids']} payment ids, {again['extra_records']} extra records; "
        f"beyond what was in flight at the faults and the {again['rebalance_marks']} rebalance marks: "
        f"{again['beyond_in_flight']}",
        *(
            f"  after {r['fault']} at +{r['at_s']:.1f}s: {r['decided_again']} decided again, "
            f"{r['in_flight']} in flight, {r['beyond']} beyond"
            for r in again["per_fault"]
        ),
        f"  before any fault: {again['before_any_fault']}",
        f"AML group's committed offsets behind its dependencies' during the run: at most "
        f"{doc['aml_behind_dependencies']['max_records']} records"
        + (
            f" (at +{doc['aml_behind_dependencies']['at_s']:.1f}s)"
            if doc["aml_behind_dependencies"]["at_s"] is not None
            else ""
        ),
        f"stores: {doc['stores']['payers']} payers x {len(doc['stores']['replicas'])} replicas: "
        + ("agree" if doc["stores"]["agree"] else f"{doc['stores']['disagreements']} answers DISAGREE"),
    ]
    for group, state in doc["groups"].items():
        if "behind" in state:
            where = "at the log end" if state["at_end"] else f"{state['behind']} records BEHIND"
        else:
            delay = state["last_activity_to_end_s"]
            where = (
                f"at the log end {delay:.1f} s after its last decision (grace {state['grace_s']:g} s)"
                if state["at_end"]
                else (
                    f"NOT at the log end within {state['grace_s']:g} s of its last decision"
                    + (f" (reached it after {delay:.1f} s)" if delay is not None else "")
                    + f"; {state['behind_at_end_of_check']} records behind at the end of the check "
                    + f"(committed {state['committed']})"
                )
            )
        lines.append(f"group {group}: {where}")
    poller = doc["poller"]
    lines.append(
        f"commit polls: {poller['polls']} ({poller['failures']} failed); "
        f"committed offsets seen going back: {len(poller['regressions'])}"
    )
    lines.append("verdict: " + ("PASS" if doc["ok"] else "FAIL: " + "; ".join(doc["failures"])))
    return "\n".join(lines)


def write(doc: dict[str, Any], path: Path | None) -> Path:
    params = doc["params"]
    path = path or RESULTS / f"{NAME}_seed{params['seed']}_{params['duration']:g}s.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of traffic")
    parser.add_argument("--rate", type=float, default=100.0, help="payments/s")
    parser.add_argument(
        "--faults",
        default=None,
        help=f"comma-separated, in any order (it is drawn from the seed): {', '.join(sorted(FAULT_KINDS))} "
        "(default: all of them; kill-stage only with --derived)",
    )
    parser.add_argument(
        "--derived",
        action="store_true",
        help="Service C reads payments.enriched, which the enrichment stage derives from payments",
    )
    parser.add_argument("--gap", default="15,20", help="seconds between two faults: LOW,HIGH")
    parser.add_argument("--catch-up", type=float, default=300.0, help="seconds to catch up after the traffic")
    parser.add_argument(
        "--commit-grace", type=float, default=10.0, help="seconds the AML group may take to reach the log end"
    )
    parser.add_argument("--sample", type=int, default=50, help="payers whose stores are checked")
    parser.add_argument("--results", type=Path, default=None, help="where to write the JSON result")
    parser.add_argument("--keep", action="store_true", help="keep PostgreSQL's data folder")
    parser.add_argument(
        "--no-gate", action="store_true", help="ungated workers: a negative control the verdict must fail"
    )
    parser.add_argument(
        "--live-code",
        action="store_true",
        help="run the checkout as it is (restarted processes then run whatever is on disk by then)",
    )
    args = parser.parse_args(argv)
    default = DERIVED_SCHEDULE if args.derived else FULL_SCHEDULE
    faults = tuple(k.strip() for k in (args.faults or ",".join(default)).split(",") if k.strip())
    unknown = [k for k in faults if k not in FAULT_KINDS and k not in NOT_INJECTED]
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(sorted(FAULT_KINDS))}")
    if "kill-stage" in faults and not args.derived:
        parser.error("kill-stage needs --derived (without it no stage runs)")
    low, _, high = args.gap.partition(",")
    return Options(
        seed=args.seed,
        duration=args.duration,
        rate=args.rate,
        faults=tuple(k for k in faults if k in FAULT_KINDS),
        gap=(float(low), float(high or low)),
        catch_up=args.catch_up,
        commit_grace=args.commit_grace,
        sample=args.sample,
        results=args.results,
        keep=args.keep,
        gate=not args.no_gate,
        live_code=args.live_code,
        derived=args.derived,
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    doc = asyncio.run(Soak(options).run())
    path = write(doc, options.results)
    print()
    print(summary(doc))
    print(f"\nresults: {path}")
    if doc.get("error"):
        return 2
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
