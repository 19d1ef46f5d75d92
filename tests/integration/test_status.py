"""`aml-app status`: from the broker (no worker) and from a worker, as a table and as JSON, and its
one-line errors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
from typing import Any

import pytest

from aml_app.harness.child_process import aml_app_executable
from aml_app.harness.workers import settings_env
from aml_app.kafka.broker import free_port
from aml_app.kafka.tools import GroupCommitter, produce
from tests.harness import ends_of, payments_for, wait_until

pytestmark = pytest.mark.integration

AML_APP = aml_app_executable()


async def status(env: dict[str, str], *args: str, timeout: float = 60) -> tuple[int, str, str]:
    """Run `aml-app status ARGS` with `env` on top of ours; (exit code, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        AML_APP,
        "status",
        *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"aml-app status {' '.join(args)} did not end within {timeout}s") from None
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def table(text: str, first_header: str) -> list[dict[str, str]]:
    """The rows of the table whose header starts with `first_header`, cut at the header's columns."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_header))
    header = lines[start]
    spans = [(m.start(), m.group()) for m in re.finditer(r"\S+", header)]
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = {}
        for i, (begin, name) in enumerate(spans):
            end = spans[i + 1][0] if i + 1 < len(spans) else None
            cells[name] = line[begin:end].strip()
        rows.append(cells)
    return rows


async def test_status_from_the_broker_without_any_worker(broker, names, producer, deps):
    # Records sent together share record batches: Tansu's ListOffsets would answer short of the end.
    placed = await produce(producer, names.payments, payments_for(names.partitions, 6, "st"))
    ends = ends_of(placed)
    relations, aggregates = names.deps
    ghost = f"ghost-{names.suffix}"  # a dependency group that never committed anything
    # On partition 3 nobody committed up to the end: only a fetch tells the log end there.
    relations_at = {**ends, 3: 2}
    aggregates_at = {0: 1, 1: 6, 2: 6, 3: 2}
    await deps[relations].commit(relations_at)
    await deps[aggregates].commit(aggregates_at)
    service = await GroupCommitter([broker.bootstrap], names.app_id, names.payments).start(range(4))
    try:
        await service.commit({0: 1, 1: 4})
    finally:
        await service.stop()
    env = {
        **settings_env(names.settings(broker.bootstrap)),
        "AML_DEPENDS_ON": f"{relations},{aggregates},{ghost}",
        "AML_LAG_WARN": "4",
        "AML_MAX_WAIT": "60",
    }

    code, out, err = await status(env, "--json")
    assert code == 2, err  # critical: a dependency group is unknown
    doc = json.loads(out)
    assert doc["gate"]["max_wait_s"] == 60, "the broker's document said the default, 300"
    assert (doc["source"], doc["app_id"], doc["topic"]) == ("broker", names.app_id, names.payments)
    assert doc["depends_on"] == [relations, aggregates, ghost]
    parts = {p["partition"]: p for p in doc["partitions"]}
    assert sorted(parts) == [0, 1, 2, 3]
    for p, part in parts.items():
        assert part["log_end"] == ends[p], "the log end must be right even where ListOffsets is short"
        assert part["dependencies"] == {relations: relations_at[p], aggregates: aggregates_at[p], ghost: 0}
        assert part["watermark"] == 0  # the ghost group holds every partition at 0
        assert part["never_committed"] == [ghost]
        assert part["bottleneck"] == [ghost]
        assert part["waiting_offset"] is None and part["advanced_at"] == dict.fromkeys(doc["depends_on"])
    assert [parts[p]["service_committed"] for p in range(4)] == [1, 4, None, None]
    assert parts[0]["payments_waiting"] == ends[0] - 1 and parts[2]["payments_waiting"] == ends[2]
    statuses = {d["group"]: d for d in doc["dependencies"]}
    assert statuses[relations]["status"] == "ok" and statuses[relations]["lag"] == 4  # 4: not above 4
    assert statuses[aggregates]["status"] == "lagging"  # 5 behind on partition 0 > AML_LAG_WARN=4
    assert statuses[aggregates]["lagging_partitions"] == [0] and statuses[aggregates]["lag"] == 9
    assert statuses[ghost]["status"] == "unknown group"

    code, out, err = await status(env)
    assert code == 2, err
    assert out.splitlines()[0].startswith(f"topic {names.payments}, service group {names.app_id}: read from")
    rows = table(out, "PARTITION")
    assert [r["PARTITION"] for r in rows] == ["0", "1", "2", "3"]
    for row in rows:
        p = int(row["PARTITION"])
        assert row["LOG-END"] == str(ends[p])
        assert row[relations] == str(relations_at[p]) and row[ghost] == "0"
        assert row["WATERMARK"] == "0" and row["BOTTLENECK"] == ghost
        assert row["COMMITTED"] == {0: "1", 1: "4"}.get(p, "-")
        assert row["WAITING-AT"] == "-" and row["IN-FLIGHT"] == "-"
    dep_rows = {r["DEPENDENCY"]: r for r in table(out, "DEPENDENCY")}
    assert dep_rows[ghost]["STATUS"] == "unknown group"
    assert dep_rows[aggregates]["STATUS"] == "lagging" and dep_rows[aggregates]["LAG"] == "9"

    # The exit code a monitoring check reads: without the unknown group a lagging one warns (1), and
    # with only the group that is ok all is well (0).
    code, _out, err = await status({**env, "AML_DEPENDS_ON": f"{relations},{aggregates}"}, "--json")
    assert code == 1, err
    code, _out, err = await status({**env, "AML_DEPENDS_ON": relations}, "--json")
    assert code == 0, err


async def test_status_from_a_worker(names, producer, new_worker, deps):
    """Also: the worker wants a token (AML_WEB_TOKEN), which status sends from its own settings."""
    placed = await produce(producer, names.payments, payments_for(names.partitions, 4, "sw"))
    ends = ends_of(placed)
    token = {"AML_WEB_TOKEN": secrets.token_urlsafe(24)}
    worker = new_worker(**token)
    await worker.wait_ready(set(range(names.partitions)))
    relations, aggregates = names.deps
    await deps[relations].commit(ends)
    await deps[aggregates].commit({0: 1, 1: ends[1], 2: ends[2], 3: ends[3]})

    async def waiting_at_1() -> dict[str, Any] | None:
        state = await worker.state()
        if not state or not state["partitions"]:
            return None
        p0 = state["partitions"][0]
        return state if p0["waiting_offset"] == 1 and p0["dependencies"][aggregates] == 1 else None

    await wait_until(waiting_at_1, 30, "payment (0, 1) to wait on aggregates")

    code, out, err = await status({}, "--worker", f"127.0.0.1:{worker.port}", "--json")
    assert (code, out) == (3, ""), err  # unknown, as a monitoring check reads it
    assert err.count("\n") == 1 and "answered HTTP 401" in err and "AML_WEB_TOKEN" in err, err
    code, out, err = await status(token, "--worker", f"127.0.0.1:{worker.port}", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["source"] == "worker" and doc["worker"] == worker.worker_id
    p0 = doc["partitions"][0]
    assert (p0["waiting_offset"], p0["watermark"], p0["bottleneck"]) == (1, 1, [aggregates])
    assert [p["log_end"] for p in doc["partitions"]] == [ends[p] for p in range(4)]

    code, out, err = await status(token, "--worker", worker.url)
    assert code == 0, err
    assert f"as worker {worker.worker_id} sees it (the leader)" in out.splitlines()[0]
    rows = {r["PARTITION"]: r for r in table(out, "PARTITION")}
    assert rows["0"]["WAITING-AT"] == "1" and rows["0"]["IN-FLIGHT"] == "1"
    assert rows["0"]["BOTTLENECK"] == aggregates and rows["0"][aggregates] == "1"
    assert rows["0"]["BLOCKED-SINCE"].endswith("ago")
    assert rows["1"]["WAITING-AT"] == "-" and rows["1"]["WATERMARK"] == str(ends[1])


async def test_status_says_in_one_line_when_it_cannot_reach_its_source(names):
    nobody = free_port()
    code, out, err = await status(
        {"KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{nobody}"}, "--timeout", "2", timeout=60
    )
    assert code == 3 and out == ""  # unknown, as a monitoring check reads it
    assert err.count("\n") == 1, err
    assert err.startswith(
        f"aml-app status: cannot read offsets from the Kafka cluster at 127.0.0.1:{nobody}: "
    )

    code, out, err = await status({}, "--worker", f"127.0.0.1:{nobody}", "--timeout", "2")
    assert code == 3 and out == ""  # unknown, as a monitoring check reads it
    assert err.count("\n") == 1, err
    assert err.startswith(
        f"aml-app status: cannot reach the worker at http://127.0.0.1:{nobody}/watermarks.json: "
    )
