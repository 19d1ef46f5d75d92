"""The leader's refresh stamps what it writes with when its reads began, writes nothing once it no longer
leads in that generation, and its timers outlive a failed write of the table.

In a fresh interpreter each, as `test_worker_gate.py` does: importing the tables builds the app.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.leader import LEADER

STAMPS = (
    LEADER
    + """
scenario = os.environ["SCENARIO"]
logging.basicConfig(level=logging.INFO)  # stderr: what the refresh says


def meanwhile(read):
    # Each read takes 8 s (the refresh deadline is 10 s); the leader may be deposed or rebalance.
    clock[0] += 8.0
    if scenario == "deposed-during-" + read:
        w.app.is_leader = lambda: False
    if scenario == "rebalanced-during-" + read:
        w.app.consumer_generation_id += 1


async def read_all(*args, **kwargs):
    meanwhile("offsets")
    await asyncio.sleep(0.05)  # of it the log's identity 0.02 s, as DependencyOffsets counts it
    gate.offsets.identity_s += 0.02
    return Reading([0, 1], {g: {0: 5, 1: 3} for g in groups}, log="cluster:topic")


async def read(reached, log=None):
    meanwhile("cut")
    await asyncio.sleep(0.03)
    return {q: Unapplied(end, None) for q, end in reached.items()}


gate.offsets.read_all = read_all
gate.unapplied.read = read


async def main():
    before = time.time()
    token = gate._attempt = object()
    outcome = await asyncio.wait_for(gate.refresh_once(time.monotonic(), token), 10)
    cut = w.cuts.get(w.CUT)
    return {
        "before": before,
        "outcome": outcome.value,
        "rows": {str(p): [row["refreshed_at"], row["generation"]] for p, row in w.watermarks.items()},
        "cut": None if cut is None else [cut["refreshed_at"], cut["generation"]],
        "error": gate.status.last_error,
        "phases": gate.status.phase_s,
    }


print(json.dumps(asyncio.run(main())))
"""
)


def refresh(scenario: str, max_age: float = 30) -> dict[str, Any]:
    """One event-time refresh of the leader, in generation 3, whose reads each take 8 s."""
    env = {
        **os.environ,
        "AML_GATE_MODE": "event-time",
        "SCENARIO": scenario,
        "AML_WATERMARK_MAX_AGE": str(max_age),
    }
    out = subprocess.run(
        [sys.executable, "-c", STAMPS], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["log"] = out.stderr
    return result


def test_rows_and_the_cut_are_stamped_when_the_reads_they_rest_on_began() -> None:
    """A row's age limit bounds how old its reading is: a read of 8 s does not make it look 8 s newer,
    and the cut, which rests on the offsets read first, is no newer than they are."""
    result = refresh("slow")
    before = result["before"]
    assert result["outcome"] == "succeeded"
    assert result["rows"] == {"0": [before, 3], "1": [before, 3]}
    assert result["cut"] == [before, 3]


def test_each_read_of_a_refresh_is_timed_apart() -> None:
    """Where a slow refresh spends its time (the web view's `phase_s` and `/metrics`): the offsets'
    read less its log identity part, the identity, and the event-time cut."""
    phases = refresh("slow")["phases"]
    assert phases["log_identity"] == pytest.approx(0.02)
    assert 0.03 <= phases["offsets"] < 1.0
    assert 0.03 <= phases["event_time_cut"] < 1.0


def test_reads_that_outlive_the_max_age_are_a_failure_that_writes_nothing_of_them() -> None:
    """Reads that took AML_WATERMARK_MAX_AGE or longer found what every worker would distrust as soon as
    it is written: the refresh writes none of it and fails, saying why, so the views and the watchdog
    see a gate held closed instead of a refresh that succeeds."""
    offsets = refresh("slow", max_age=6)  # the offsets' read takes 8 s
    assert offsets["outcome"] == "failed"
    assert offsets["rows"] == {} and offsets["cut"] is None
    assert "the refresh's reads took 8.0 s, at least AML_WATERMARK_MAX_AGE=6 s" in offsets["error"]

    cut = refresh("slow", max_age=12)  # the offsets' read 8 s, the cut's 16 s after the reads began
    assert cut["outcome"] == "failed"
    assert cut["rows"] == {"0": [cut["before"], 3], "1": [cut["before"], 3]}
    assert cut["cut"] is None
    assert "the refresh's reads took 16.0 s, at least AML_WATERMARK_MAX_AGE=12 s" in cut["error"]


@pytest.mark.parametrize("change", ["deposed", "rebalanced"])
def test_a_leader_deposed_or_rebalanced_during_its_reads_writes_nothing_of_them(change: str) -> None:
    """What a leader read before it was deposed, or before its group rebalanced (a reset may have moved
    the committed offsets back), is not written stamped as the new generation's: not the rows when it
    happened during the offsets' read, not the cut when during the cut's."""
    reasons = {
        "deposed": "this worker stopped leading during its reads",
        "rebalanced": "the group rebalanced during its reads (generation 3, now 4)",
    }
    why = f"watermark refresh dropped: {reasons[change]}"
    offsets = refresh(f"{change}-during-offsets")
    assert offsets["outcome"] != "succeeded"
    assert offsets["rows"] == {} and offsets["cut"] is None
    assert why in offsets["log"], "the log says what was dropped and why"

    cut = refresh(f"{change}-during-cut")
    assert cut["outcome"] != "succeeded"
    assert cut["rows"] == {"0": [cut["before"], 3], "1": [cut["before"], 3]}
    assert cut["cut"] is None
    assert why in cut["log"]


GUARDED = """
import asyncio, json, os
from aml_app.gate.watchdog import Verdict
from aml_app.gate.watermark import WatermarkRow
from aml_app.tables import watermarks as w

w.app.is_leader = lambda: True
gate = w.gate_service()
gate.changelogs.known = True
groups = w.settings.depends_on


class FailingOnce(dict):
    # The watermark table, whose next write fails as one to a changelog the producer does not know.
    failures = 1

    def __setitem__(self, key, value):
        if self.failures:
            self.failures -= 1
            raise TypeError("'NoneType' object is not iterable")
        super().__setitem__(key, value)


row = WatermarkRow(partition=0, watermark=5, dependencies={g: 5 for g in groups}, refreshed_at=1.0)
w.watermarks = FailingOnce({0: row.as_json()})
w.rows_of = w.Typed(w.watermarks, WatermarkRow.from_json)
crashed = []
w.app.crash = lambda exc: crashed.append(str(exc)) or asyncio.sleep(0)
w.app.add_future = lambda coro: coro.close()


async def cancelled_under(*args, **kwargs):
    # A client closed under the read: the refresh is abandoned as overrun.
    pending = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, pending.cancel)
    return await pending


async def main():
    path = os.environ["PATH_TAKEN"]
    first = gate.offsets
    if path == "overrun":
        first.read_all = cancelled_under
        body = type(gate).refresh_watermarks.fun.__wrapped__
    else:
        gate.watchdog.check = lambda now: {"rebuild": Verdict.REBUILD, "leave": Verdict.LEAVE}[path]
        body = type(gate).watch_refresh.fun.__wrapped__
    timer = asyncio.ensure_future(body(gate))
    done, _ = await asyncio.wait({timer}, timeout=20)
    failure = None if not done or timer.cancelled() else timer.exception()
    return {
        "returned": bool(done) and not timer.cancelled() and failure is None,
        "failure": repr(failure),
        "counted": gate.refresh_errors.count,
        "last_outcome": gate.watchdog.last_outcome.value if gate.watchdog.last_outcome else None,
        "new_clients": gate.offsets is not first,
        "crashed": len(crashed),
    }


print(json.dumps(asyncio.run(main())))
"""


@pytest.mark.parametrize("path", ["overrun", "rebuild", "leave"])
def test_a_failed_table_write_never_ends_the_refresh_or_the_watchdog_timer(path: str) -> None:
    """Marking the rows with the error is a table write, and a timer that raises stops for good: on an
    abandoned refresh, and when the watchdog rebuilds the clients or makes the leader leave, a failed
    write is counted and the timer goes on with the rest of what it does."""
    env = {**os.environ, "AML_GATE_MODE": "partition", "PATH_TAKEN": path}
    out = subprocess.run(
        [sys.executable, "-c", GUARDED], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["returned"], f"the timer ended with {result['failure']}"
    assert result["counted"] == 1
    if path == "overrun":
        assert result["last_outcome"] == "overran"
    if path == "leave":
        assert result["crashed"] == 1
    else:
        assert result["new_clients"]
