"""Faults of the leader's refresh as every worker's views and health check show them, and their end: the
event-time cut that cannot be read while the groups' offsets can (the gate admits nothing), and the
payments topic created again with fewer partitions. In a fresh interpreter each, as
`test_refresh_stamps.py` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.leader import LEADER

SCRIPT = (
    LEADER
    + """
said = []


class Said(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())


logging.getLogger("aml_app.tables.watermarks").addHandler(Said())
logging.getLogger("aml_app.tables.watermarks").setLevel(logging.INFO)


async def read_all(*args, **kwargs):
    return Reading([0, 1], {g: {0: 5, 1: 3} for g in groups}, log="cluster:topic")


failing = [False]


async def read(reached, log=None):
    if failing[0]:
        raise OffsetReadError("no answer within 5 s fetching partitions [1] of 'payments'", timed_out=True)
    return {q: Unapplied(end, None) for q, end in reached.items()}


gate.offsets.read_all = read_all
gate.unapplied.read = read


def seen():
    view = gate.operator_view(time.time())
    doc = {**view, "refresh": {"state": "ok"}}
    return {
        "admin_error": view["gate"]["admin_error"],
        "statuses": [d["status"] for d in view["dependencies"]],
        "health": health_code(doc),
        "cut_untrusted": gate.cut_view()["untrusted"],
    }


async def main():
    outcomes = []
    for failing[0] in (False, True, True, True, True, False):
        token = gate._attempt = object()
        outcomes.append((await gate.refresh_once(time.monotonic(), token)).value)
        clock[0] += 1.5
        if len(outcomes) == 5:
            during = seen()
    return {"outcomes": outcomes, "during": during, "after": seen(), "said": said}


print(json.dumps(asyncio.run(main())))
"""
)


def run() -> dict[str, Any]:
    env = {**os.environ, "AML_GATE_MODE": "event-time", "AML_WATERMARK_MAX_AGE": "5"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_cut_that_cannot_be_read_shows_on_every_workers_views_until_it_can() -> None:
    result = run()
    assert result["outcomes"] == ["succeeded", "overran", "overran", "overran", "overran", "succeeded"]
    during = result["during"]
    assert (
        during["admin_error"]
        == "the event-time cut: no answer within 5 s fetching partitions [1] of 'payments'"
    )
    assert set(during["statuses"]) == {"error"} and during["health"] == 2
    # The cut, 7.5 s old, names the read that keeps it old.
    assert during["cut_untrusted"] == (
        "the row is 7.5 s old (more than 5 s): the leader's read failed: the event-time cut: "
        "no answer within 5 s fetching partitions [1] of 'payments'"
    )
    assert result["after"] == {
        "admin_error": None,
        "statuses": ["ok", "ok"],
        "health": 0,
        "cut_untrusted": None,
    }
    # Logged once when it starts and once when it ends: the offsets' reads in between succeeded.
    failed = [line for line in result["said"] if line.startswith("watermark refresh failed")]
    recovered = [line for line in result["said"] if line.startswith("watermark refresh recovered")]
    assert len(failed) == 1 and len(recovered) == 1


SHRUNK = (
    LEADER
    + """
phase = ["old"]


async def read_all(*args, **kwargs):
    if phase[0] == "old":
        return Reading(list(range(6)), {g: {p: 10 for p in range(6)} for g in groups}, log="c:topic-v1")
    if phase[0] == "gone":
        raise OffsetReadError("topic 'payments' does not exist (yet)")
    return Reading([0, 1, 2], {g: {p: 4 for p in range(3)} for g in groups}, log="c:topic-v2")


gate.offsets.read_all = read_all


async def main():
    for phase[0] in ("old", "gone", "new"):
        token = gate._attempt = object()
        await gate.refresh_once(time.monotonic(), token)
        clock[0] += 1.5
    view = gate.operator_view(time.time())
    doc = {**view, "refresh": {}}
    return {
        "rows": {str(p): [r["log"], r.get("error")] for p, r in sorted(w.watermarks.items())},
        "admin_error": view["gate"]["admin_error"],
        "health": health_code(doc),
    }


print(json.dumps(asyncio.run(main())))
"""
)


def test_rows_of_partitions_the_topic_no_longer_has_are_dropped() -> None:
    """Deleted while its topic was away, created again with three partitions of six: rows 3-5 kept the
    error of the topic's absence and its old log, and every view showed the error for ever."""
    env = {**os.environ, "AML_GATE_MODE": "partition"}
    out = subprocess.run(
        [sys.executable, "-c", SHRUNK], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["rows"] == {str(p): ["c:topic-v2", None] for p in range(3)}
    assert result["admin_error"] is None and result["health"] == 0
