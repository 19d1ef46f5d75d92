"""Bounded waits and parked payments on the real broker: a wait past AML_MAX_WAIT is shown as breached
(the default policy keeps waiting) or decided stale and sent for review (`decide-stale`); a payment that
keeps failing is parked on the review topic after AML_MAX_ATTEMPTS, and its lane moves on."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client.parser import text_string_to_metric_families

from aml_app.harness.child_process import aml_app_executable
from aml_app.harness.verify import CommitTimeline
from aml_app.harness.workers import settings_env
from aml_app.kafka.tools import produce
from tests.harness import TopicReader, ends_of, payments_for, wait_until
from tests.integration.test_status import status

pytestmark = pytest.mark.integration


async def metric(worker, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{worker.url}/metrics") as response:
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families[name.removesuffix("_total")].samples[0].value


async def reviewed(bootstrap: str, names, count: int) -> list:
    reader = await TopicReader(bootstrap, names.review, names.partitions).start()
    try:

        async def enough() -> list | None:
            await reader.poll(0.2)
            return reader.records if len(reader.records) >= count else None

        return await wait_until(enough, 30, f"{count} records on the review topic")
    finally:
        await reader.stop()


async def test_a_wait_past_the_bound_is_shown_as_breached_and_keeps_waiting(
    names, producer, new_worker, deps, decision_log
):
    placed = await produce(producer, names.payments, payments_for(names.partitions, 2, "b"))
    ends = ends_of(placed)
    worker = new_worker(AML_MAX_WAIT="1")
    await worker.wait_ready(set(range(names.partitions)))
    await CommitTimeline().commit(deps, {p: ends[p] for p in range(1, names.partitions)})

    async def breached() -> dict | None:
        state = await worker.state()
        return state if state and (state.get("gate") or {}).get("breached_partitions") == [0] else None

    state = await wait_until(breached, 30, "partition 0 breached")
    assert state["gate"]["longest_wait_s"] >= 1 and state["gate"]["max_wait_s"] == 1
    assert await metric(worker, "aml_wait_breached_partitions") == 1
    code, out, err = await status({}, "--worker", worker.url)
    assert code == 2, err  # a breached partition: critical for a monitoring check
    assert "breached: payments have waited longer than AML_MAX_WAIT (1 s) on partition 0" in out
    # The default policy decides nothing stale: partition 0 still waits.
    assert not any(p == 0 for p, _ in decision_log.decided()) and state["decided_stale"] == 0


async def test_decide_stale_decides_after_the_bound_and_sends_the_payment_for_review(
    broker, names, producer, new_worker, deps, decision_log
):
    placed = await produce(producer, names.payments, payments_for(names.partitions, 2, "s"))
    ends = ends_of(placed)
    worker = new_worker(AML_MAX_WAIT="1", AML_WAIT_POLICY="decide-stale")
    await worker.wait_ready(set(range(names.partitions)))
    await CommitTimeline().commit(deps, {p: ends[p] for p in range(1, names.partitions)})

    await decision_log.wait_for(set(placed), timeout=30)
    stale = {(d["partition"], d["offset"]): d for d in decision_log.decisions() if d["stale"]}
    assert set(stale) == {(0, 0), (0, 1)}
    assert all("decided stale after" in d["note"] for d in stale.values())
    records = await reviewed(broker.bootstrap, names, 2)
    assert sorted(int(dict(r.headers)["review.offset"]) for r in records) == [0, 1]
    assert {dict(r.headers)["review.kind"] for r in records} == {b"stale"}
    assert all(r.partition == 0 for r in records)
    assert await metric(worker, "aml_decided_stale_total") == 2


async def test_a_payment_at_the_retry_ceiling_is_parked_and_the_partition_flows_on(
    broker, names, producer, new_worker, deps, decision_log
):
    placed = await produce(producer, names.payments, payments_for(names.partitions, 3, "p"))
    await CommitTimeline().commit(deps, ends_of(placed))
    worker = new_worker(AML_PROBE_FAIL="p-0-1:1000", AML_MAX_ATTEMPTS="2")
    await decision_log.wait_for({po for po in placed if po != (0, 1)}, timeout=60)
    assert (0, 1) not in decision_log.decided()
    [record] = await reviewed(broker.bootstrap, names, 1)
    headers = dict(record.headers)
    assert headers["review.kind"] == b"parked" and headers["review.attempts"] == b"2"
    assert headers["review.offset"] == b"1" and b"ProbeFailure" in headers["review.reason"]
    assert json.loads(record.value)["payment_id"] == "p-0-1"
    state = await worker.state()
    assert state["parked"] == 1 and state["retrying"] == []
    assert await metric(worker, "aml_parked_total") == 1


async def aml_app(env: dict[str, str], *args: str, timeout: float = 60) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        aml_app_executable(),
        *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_aml_app_park_parks_a_failing_payment_by_hand(
    broker, names, producer, new_worker, deps, decision_log
):
    placed = await produce(producer, names.payments, payments_for(names.partitions, 3, "h"))
    await CommitTimeline().commit(deps, ends_of(placed))
    # No retry ceiling: without the request the payment would be retried for ever.
    worker = new_worker(AML_PROBE_FAIL="h-0-1:1000000")

    async def retrying() -> dict | None:
        state = await worker.state()
        return state if state and state["retrying"] and state["retrying"][0]["attempts"] >= 2 else None

    await wait_until(retrying, 60, "the payment retrying")
    env = {**settings_env(names.settings(broker.bootstrap)), "AML_SERVICE": "probe"}
    code, out, err = await aml_app(env, "park", "0:1", "--reason", "bad beneficiary data")
    assert code == 0, err
    assert "park payment 0:1" in out
    await decision_log.wait_for({po for po in placed if po != (0, 1)}, timeout=60)
    [record] = await reviewed(broker.bootstrap, names, 1)
    headers = dict(record.headers)
    assert headers["review.kind"] == b"parked" and headers["review.offset"] == b"1"
    assert (
        b"parked by hand" in headers["review.reason"] and b"bad beneficiary data" in headers["review.reason"]
    )
    assert (0, 1) not in decision_log.decided()
    code, _, err = await aml_app(env, "park", "zero")
    assert code == 2 and "'zero' is not PARTITION:OFFSET" in err
    # A service no worker ran (a wrong AML_APP_ID): refused, and its changelog topic not created (the
    # producer's metadata request created it, and the command said it had asked the workers).
    wrong = {**env, "AML_APP_ID": f"{names.suffix}-nobody"}
    code, _, err = await aml_app(wrong, "park", "0:1")
    assert code == 1 and f"topic {names.suffix}-nobody-gate-park-changelog does not exist" in err
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        assert f"{names.suffix}-nobody-gate-park-changelog" not in await admin.list_topics()
    finally:
        await admin.close()
