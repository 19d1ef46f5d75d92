"""The demo's report on payments left undecided, on real processes: the session's broker, the Spark
pipeline, the APIs and the gated workers (`aml_app.harness.undecided`)."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from aml_app.harness.demo import Demo, Options
from aml_app.harness.undecided import payment_ids_in
from aml_app.kafka.broker import EmbeddedBroker
from tests.harness import Names, settings_for, wait_until

pytestmark = pytest.mark.integration


async def test_a_fresh_read_finds_the_decisions_that_are_in_the_topic(
    broker: EmbeddedBroker, names: Names, producer: AIOKafkaProducer
) -> None:
    for i in range(30):
        doc = json.dumps({"payment_id": f"pay-{i}", "decision": "clear"}).encode()
        await producer.send_and_wait(names.decisions, doc, partition=i % names.partitions)
    await producer.send_and_wait(names.decisions, b"not json", partition=0)
    found = await payment_ids_in([broker.bootstrap], names.decisions, {"pay-3", "pay-29", "pay-absent"})
    assert found == {"pay-3", "pay-29"}


@pytest.mark.timeout(600)
async def test_a_drain_that_runs_out_of_time_says_where_the_undecided_payments_are(
    broker: EmbeddedBroker, store_url: str, tmp_path: Path
) -> None:
    """C's API goes away for good while payments flow: the detectors cannot decide what comes after, the
    drain runs out of time, and the report finds those payments unacked by each service's group and
    absent from its decisions topic, with every worker's view."""

    async def take_c_away(demo: Demo) -> None:
        await wait_until(lambda: demo.elapsed() >= 4, 120, "payments flowing")
        system = demo.system
        replicas = [name for name, api in system.apis.items() if api.kind == "aggregates"]
        await asyncio.gather(*(asyncio.to_thread(system.apis[name].stop) for name in replicas))

    suffix = uuid.uuid4().hex[:8]
    demo = Demo(
        settings_for(broker, suffix),
        Options(folder=tmp_path / "system", duration=10, rate=30, instances=1, drain_deadline=10),
        suffix=f"-{suffix}",
        bootstrap=[broker.bootstrap],
        store_url=store_url,
        script=take_c_away,
    )
    await demo.run()
    report = json.loads((tmp_path / "system" / "undecided.json").read_text())
    assert set(report) == {"aml", "fraud"}
    for service, found in report.items():
        undecided = sum(part["count"] for part in found["undecided"].values())
        assert undecided > 0, service
        assert found["acked_by_group"] == 0, f"{service}'s group acked a payment it never decided"
        assert found["decided_in_topic_not_read"] == 0, service
        assert set(found["workers"]) == {f"{service}-0"}
        view = found["workers"][f"{service}-0"]
        assert view is not None and view["fetching"], f"{service}-0 did not answer: {view}"
