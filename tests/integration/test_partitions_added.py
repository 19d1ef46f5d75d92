"""Partitions added to `payments`: the alerts topic (the changelog of `alerts-sent`) must grow with it.

The embedded broker cannot add partitions to a topic (it does not implement CreatePartitions), so the
state after partitions were added to `payments` alone is set up directly: `payments` with 6 partitions,
its alerts topic with 4. The worker refuses it with one sentence before it processes anything, and
`aml-app topics --create --grow`, the documented way to grow them together, says in one sentence that this
broker refuses to.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from aml_app.harness.child_process import aml_app_executable
from aml_app.harness.workers import settings_env
from aml_app.kafka.broker import create_topics
from aml_app.kafka.tools import produce
from tests.harness import DecisionLog, Names, Worker, payments_for, wait_until

pytestmark = pytest.mark.integration


async def test_a_worker_refuses_payments_with_more_partitions_than_its_alerts_topic(
    broker, producer, tmp_path
):
    names = Names(partitions=6)
    await create_topics([broker.bootstrap], [names.payments, names.decisions, names.dlq], 6)
    await create_topics([broker.bootstrap], [names.alerts], 4)
    decisions = await DecisionLog(broker.bootstrap, names.decisions, names.partitions).start()
    placed = await produce(producer, names.payments, payments_for(names.partitions, 2, "n"))
    worker = Worker(broker.bootstrap, names, tmp_path, AML_GATE="off").start()
    try:
        await wait_until(lambda: not worker.alive(), 90, "the worker to refuse the topics")
        log = worker.log_tail(300)
        sentence = (
            f"{names.payments} has 6 partitions but {names.alerts} has 4: the alerts topic is the changelog "
            "of alerts-sent and needs as many, or an alert could be sent twice; grow the smaller with "
            "`AML_PARTITIONS=6 aml-app topics --create --grow` and start the workers again"
        )
        assert sentence in log, log
        await decisions.poll(0.5)
        assert not decisions.decided() & set(placed), "a payment was processed under that assignment"
    finally:
        worker.stop(grace=10)
        await decisions.stop()


async def test_topics_create_grows_nothing_the_broker_cannot_and_says_so(broker, names):
    """`AML_PARTITIONS=6 aml-app topics --create --grow` over topics of 4 partitions grows them, the payments
    topic last; the embedded broker refuses, and the command says so in one sentence (exit 1)."""
    env = {
        **os.environ,
        **settings_env(names.settings(broker.bootstrap)),
        "AML_SERVICE": "aml",
        "AML_APP_ID": names.app_id,
        "AML_PARTITIONS": "6",
    }
    process = await asyncio.create_subprocess_exec(
        aml_app_executable(),
        "topics",
        "--create",
        "--grow",
        "--timeout",
        "30",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 90)
    assert process.returncode == 1, (out, err)
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("Error: the cluster refused to add partitions to "), lines
    assert f"to {names.payments} " not in lines[0], "the payments topic is grown last"
    assert "(4 -> 6): IncompatibleBrokerVersion: CreatePartitionsRequest" in lines[0], lines
