"""Scaling by count with the Procfile runner: `honcho start -c aml=N aml` for N = 1, 2, 3 while the
simulator sends payments and the dependencies commit behind it.

Only the `aml` process type of the project's Procfile is started, on the session's embedded broker, with
fresh topics and groups; it runs the probe service (the gate alone), the dependency groups are played
by the test. Each phase resumes from the previous phase's committed offsets under a group name of its
own (`hand_over`: a bug of the embedded broker, explained there). Checked: nothing decided early,
every payment decided, every partition owned by exactly one worker in each phase (from the workers'
/watermarks.json), each worker of a phase deciding payments, honcho stopping its workers cleanly (no
`aml-app worker` left behind), and the start-up warning when there are more workers than partitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka.broker import EmbeddedBroker, create_topics
from aml_app.kafka.tools import GroupCommitter
from aml_app.simulation.producer import run_simulator
from tests.harness import TEST_ENV, DecisionLog, Names, committed_offsets, wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROCFILE = ROOT / "Procfile"
BIN = Path(sys.executable).parent
STARTED = re.compile(r"(\S+) started \(pid=(\d+)\)")
#: How far the dependencies commit behind the producer: payments wait at the gate first.
DEPENDENCY_LAG = 0.5


def free_port_range(count: int) -> int:
    """A base port with `count` bindable ports from it (honcho numbers an instance base + i), below the
    kernel's ephemeral range, where outgoing connections (to the broker, say) cannot take one meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(20000, max(20001, low - count - 1))
        try:
            with contextlib.ExitStack() as stack:
                for i in range(count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
    raise AssertionError(f"no {count} consecutive free ports found")


def processes_with(variable: str, value: str) -> list[int]:
    """Our own processes whose environment has variable=value (how an orphan worker would be found)."""
    needle = f"{variable}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


class HonchoRun:
    """`honcho start -f Procfile -p BASE -c aml=N aml`, in a session of its own, output to a log file."""

    def __init__(self, workers: int, env: Mapping[str, str], workdir: Path, tag: str) -> None:
        self.workers = workers
        self.base = free_port_range(workers)
        self.env = dict(env)
        self.workdir = workdir
        self.log_path = workdir / f"honcho-{tag}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> HonchoRun:
        command = [str(BIN / "honcho"), "start", "-f", str(PROCFILE), "-p", str(self.base)]
        command += ["--no-colour", "-c", f"aml={self.workers}", "aml"]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                env=self.env,
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def children(self) -> dict[str, int]:
        """honcho's process name -> pid (= process group: honcho starts each in a session of its own)."""
        return {name: int(pid) for name, pid in STARTED.findall(self.log())}

    async def states(self) -> list[dict[str, Any] | None]:
        """Each worker's /watermarks.json (None while it does not answer); fails once honcho has ended."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"honcho exited with {self.process.returncode}:\n{self.log()[-4000:]}")
        async with aiohttp.ClientSession() as session:

            async def one(port: int) -> dict[str, Any] | None:
                try:
                    url = f"http://127.0.0.1:{port}/watermarks.json"
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                        return await response.json() if response.status == 200 else None
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    return None

            return list(await asyncio.gather(*(one(self.base + i) for i in range(self.workers))))

    async def stop(self, timeout: float = 30) -> None:
        """SIGTERM to honcho alone (it stops its children); then no child, and no process of ours, is left."""
        assert self.process is not None
        children = self.children()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.process.wait, timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # honcho's own group only: it was started by us
            raise AssertionError(f"honcho did not stop within {timeout}s:\n{self.log()[-3000:]}") from None
        for name, pid in children.items():
            with pytest.raises(ProcessLookupError):
                os.killpg(pid, 0)  # nothing is left in that process's group
            assert f"{name} stopped" in self.log(), f"{name} was not reported stopped"


class Traffic:
    """The simulator sends payments; the dependency groups commit DEPENDENCY_LAG seconds behind it."""

    def __init__(self, bootstrap: str, names: Names, committers: Mapping[str, GroupCommitter]) -> None:
        self.bootstrap, self.names, self.committers = bootstrap, names, committers
        self.placed: dict[str, tuple[int, int]] = {}  # payment id -> (partition, offset)
        self.sent_at: list[tuple[float, int, int]] = []  # (when, partition, offset + 1)
        self.timeline = CommitTimeline()
        self.stop = asyncio.Event()  # asks the simulator to stop after its current burst
        self.sent_all = asyncio.Event()  # the simulator has returned: every acknowledged payment is known

    def on_sent(self, payment: Any, partition: int, offset: int, sent_at: float) -> None:
        self.placed[payment.payment_id] = (partition, offset)
        self.sent_at.append((time.monotonic(), partition, offset + 1))

    async def follow(self) -> None:
        """Commit, every 0.25 s, the log ends as they were DEPENDENCY_LAG seconds ago; all at the end.

        The end is when the simulator has returned, not when it was asked to stop: the burst under way
        then is acknowledged after the request, and a final commit made before it would leave those
        payments uncommitted by the dependencies (so, rightly, never decided).
        """
        committed: dict[int, int] = {}
        while True:
            done = self.sent_all.is_set()
            cutoff = time.monotonic() - (0 if done else DEPENDENCY_LAG)
            ends: dict[int, int] = {}
            for when, p, end in self.sent_at:
                if when <= cutoff:
                    ends[p] = max(ends.get(p, 0), end)
            offsets = {p: o for p, o in ends.items() if o > committed.get(p, 0)}
            if offsets:
                await self.timeline.commit(self.committers, offsets)
                committed.update(offsets)
            if done:
                return
            await asyncio.sleep(0.25)

    async def run(self) -> None:
        follower = asyncio.create_task(self.follow())
        try:
            await run_simulator(
                [self.bootstrap],
                self.names.payments,
                rate=40,
                duration=600,
                seed=11,
                ground_truth_path=None,
                prefix=f"s{self.names.suffix}",
                stop=self.stop,
                on_sent=self.on_sent,
            )
        finally:
            self.stop.set()
            self.sent_all.set()
            await follower


async def hand_over(bootstrap: str, names: Names, old: str, new: str) -> dict[int, int]:
    """Give group `new` the committed offsets of group `old`: `new` resumes exactly where `old` stopped.

    Each phase runs under a group of its own because of a bug of the embedded broker (Tansu): when two
    members leave in one rebalance and the leader leaves second, the group keeps the departed leader
    for ever (`Forming::leave` in its group coordinator removes the member but not `state.leader`), so
    no later member is ever elected and nothing is assigned again (seen in about one run in three
    before this). Apache Kafka re-elects a leader. Committed offsets are the whole of a group's
    progress, so handing them over is what a restart of the same group would resume from.
    """
    committed = {
        p: o
        for p, o in (await committed_offsets(bootstrap, old, names.payments, names.partitions)).items()
        if o >= 0
    }
    if committed:
        committer = await GroupCommitter([bootstrap], new, names.payments).start(range(names.partitions))
        try:
            await committer.commit(committed)
        finally:
            await committer.stop()
    return committed


async def fresh_names(broker: EmbeddedBroker, partitions: int) -> Names:
    names = Names(partitions=partitions)
    await create_topics(
        [broker.bootstrap], [names.payments, names.decisions, names.alerts, names.dlq], partitions
    )
    return names


def honcho_env(broker: EmbeddedBroker, names: Names, workdir: Path) -> dict[str, str]:
    """What honcho passes on to the `aml` processes: the probe on this test's broker, topics and groups."""
    env = {k: v for k, v in os.environ.items() if k != "PORT"}
    return {
        **env,
        **TEST_ENV,
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        "AML_SERVICE": "probe",
        "AML_APP_ID": names.app_id,
        "AML_DEPENDS_ON": ",".join(names.deps),
        # The probe waits on this test's groups, both on payments (the Procfile's default puts C on the
        # enrichment stage's topic).
        "AML_DERIVED_DEPENDENCIES": "",
        "AML_PAYMENTS_TOPIC": names.payments,
        "AML_DECISIONS_TOPIC": names.decisions,
        "AML_ALERTS_TOPIC": names.alerts,
        "AML_DLQ_TOPIC": names.dlq,
        "AML_PARTITIONS": str(names.partitions),
        "AML_DATA_DIR": str(workdir / "data"),
    }


def disjoint_cover(states: list[dict[str, Any] | None], partitions: int) -> list[dict[str, Any]] | None:
    """The states, once every worker answers, has recovered, and they own every partition exactly once."""
    if any(s is None or s["recovering"] or not s["watermarks"] for s in states):
        return None
    owned = [p for s in states if s for p in s["assigned"]]
    return [s for s in states if s] if sorted(owned) == list(range(partitions)) else None


async def test_one_two_three_workers_started_from_the_procfile(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    names = await fresh_names(broker, partitions=6)
    committers = {
        g: await GroupCommitter([broker.bootstrap], g, names.payments).start(range(names.partitions))
        for g in names.deps
    }
    decision_log = await DecisionLog(broker.bootstrap, names.decisions, names.partitions).start()
    traffic = Traffic(broker.bootstrap, names, committers)
    flowing = asyncio.create_task(traffic.run())
    phases: dict[int, list[dict[str, Any]]] = {}
    handed_over: dict[int, dict[int, int]] = {}
    runs: list[HonchoRun] = []
    groups = {count: f"{names.app_id}-{count}" for count in (1, 2, 3)}
    try:
        for count in (1, 2, 3):
            if count > 1:
                handed_over[count] = await hand_over(
                    broker.bootstrap, names, groups[count - 1], groups[count]
                )
            env = {**honcho_env(broker, names, tmp_path), "AML_APP_ID": groups[count]}
            run = HonchoRun(count, env, tmp_path, f"aml{count}").start()
            runs.append(run)
            try:

                async def covered(run: HonchoRun = run) -> list[dict[str, Any]] | None:
                    return disjoint_cover(await run.states(), names.partitions)

                await wait_until(
                    covered, 90, f"{count} worker(s) to own the {names.partitions} partitions once"
                )

                async def all_working(run: HonchoRun = run) -> list[dict[str, Any]] | None:
                    states = disjoint_cover(await run.states(), names.partitions)
                    working = states and all(
                        s["assigned"] and sum(s["processed"].values()) > 0 for s in states
                    )
                    return states if working else None

                phases[count] = await wait_until(
                    all_working, 60, f"each of {count} worker(s) to decide payments"
                )
                if count == 3:
                    traffic.stop.set()
                    await asyncio.wait_for(flowing, 30)
                    expected = set(traffic.placed.values())
                    try:
                        await decision_log.wait_for(expected, timeout=90)
                    except AssertionError as exc:
                        states = await run.states()
                        keys = (
                            "worker",
                            "assigned",
                            "waiting",
                            "in_flight",
                            "processed",
                            "refetches",
                            "watermarks",
                        )
                        raise AssertionError(
                            f"{exc}; the workers: {[{k: s and s[k] for k in keys} for s in states]}"
                        ) from None
            finally:
                await run.stop()
    finally:
        traffic.stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(flowing, 30)
        await decision_log.stop()
        for committer in committers.values():
            await committer.stop()

    for group in groups.values():
        assert processes_with("AML_APP_ID", group) == [], "a worker outlived honcho"
    for count, states in phases.items():
        assert len(states) == count
        owned = [sorted(s["assigned"]) for s in states]
        assert sorted(p for ps in owned for p in ps) == list(range(names.partitions)), owned
        assert all(owned), f"{count} workers: a worker owned nothing: {owned}"
        assert sum(s["is_leader"] for s in states) == 1
    # Each phase went on from where the previous one had committed: its own work was in the offsets.
    assert all(sum(offsets.values()) > 0 for offsets in handed_over.values()), handed_over
    for run in runs:
        assert "got no partition" not in run.log()
    made = decision_log.decisions()
    assert len(traffic.placed) > 100
    assert premature(made, names.deps, traffic.timeline) == []
    assert {d["payment_id"] for d in made} == set(traffic.placed)
    assert {(d["partition"], d["offset"]) for d in made} == set(traffic.placed.values())
    deciders = {d["worker"] for d in made}
    for count, states in phases.items():
        assert {s["worker"] for s in states} <= deciders, (
            f"a worker of the {count}-worker phase decided nothing"
        )


async def test_a_worker_beyond_the_partition_count_warns_and_idles(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    names = await fresh_names(broker, partitions=2)
    run = HonchoRun(3, honcho_env(broker, names, tmp_path), tmp_path, "idle").start()
    try:

        async def settled() -> list[dict[str, Any]] | None:
            states = disjoint_cover(await run.states(), names.partitions)
            return states if states and len(states) == 3 else None

        states = await wait_until(settled, 90, "3 workers to share 2 partitions")
        idle = [s["worker"] for s in states if not s["assigned"]]
        assert len(idle) == 1
        warning = f"has 2 partitions and group '{names.app_id}' has 3 workers: this worker ({idle[0]})"
        await wait_until(lambda: warning in run.log(), 30, "the idle worker's warning")
    finally:
        await run.stop()
    lines = [line for line in run.log().splitlines() if "got no partition" in line and "WARNING" in line]
    assert len(lines) == 1, lines
    assert "will stay idle until another worker leaves" in lines[0]
    assert processes_with("AML_APP_ID", names.app_id) == []
