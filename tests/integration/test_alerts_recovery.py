"""`alerts-sent`, the memory that keeps an alert from being sent twice, recovered from its changelog (the
alerts topic) on the real broker: to the end a fetch reports, and refused when the store is ahead."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from confluent_kafka import Producer

from aml_app.harness.workers import WorkerProcess
from aml_app.kafka.broker import free_port
from aml_app.kafka.tools import end_offsets
from aml_app.models import Alert
from tests.harness import TEST_ENV, wait_until

pytestmark = pytest.mark.integration


def alert(payment_id: str, partition: int, offset: int) -> Alert:
    """An alert as the detector sends it (the record is also `alerts-sent`'s entry for the payment)."""
    return Alert(
        payment_id=payment_id,
        partition=partition,
        offset=offset,
        service="aml",
        payer="acct-1",
        payee="acct-2",
        amount="9500.00",
        currency="USD",
        ts="2026-11-20T10:15:00+00:00",
        typologies=["structuring"],
        hits=[],
        decided_at="2026-11-20T10:15:01+00:00",
        worker="w0",
    )


def alert_records(bootstrap: str, topic: str, partition: int, ids: list[str]) -> None:
    """Alert records as the detector writes them (payment id -> JSON), all in one record batch."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 200, "batch.num.messages": 1000})
    failures: list[str] = []
    for n, payment_id in enumerate(ids):
        producer.produce(
            topic,
            key=payment_id.encode(),
            value=alert(payment_id, partition, n).dumps(),
            partition=partition,
            on_delivery=lambda err, msg: failures.append(str(err)) if err else None,
        )
    assert producer.flush(30) == 0 and failures == []


def start_worker(broker, names, tmp_path: Path, port: int) -> WorkerProcess:
    """A probe worker on a given port: the port names its data directory, so a restart on the same port
    reopens the same `alerts-sent` store."""
    return WorkerProcess(
        names.settings(broker.bootstrap),
        port=port,
        worker_id=f"w{port}",
        data_dir=tmp_path / "data",
        log_path=tmp_path / f"worker-{port}-{free_port()}.log",
        cwd=tmp_path,
        **TEST_ENV,
    ).start()


async def recovered(worker: WorkerProcess, partition: int) -> dict | None:
    state = await worker.state()
    if not state or state["recovering"]:
        return None
    return state["alerts_sent"].get(str(partition))


async def test_recovery_reads_the_alerts_topic_to_the_end_a_fetch_reports(broker, names, workers, tmp_path):
    """Nine alerts in one record batch: the embedded broker's ListOffsets puts the partition's end at the
    batch's start + 1, so a recovery that trusts it remembers one alert of nine, and the next owner of a
    payment alerted on just before a rebalance alerts on it again."""
    ids = [f"alerted-{i}" for i in range(9)]
    await asyncio.to_thread(alert_records, broker.bootstrap, names.alerts, 0, ids)
    reported = (await end_offsets([broker.bootstrap], names.alerts, [0]))[0]
    print(f"ListOffsets reports {reported} for 9 records")  # Tansu: 1
    worker = start_worker(broker, names, tmp_path, free_port())
    workers.append(worker)

    store = await wait_until(lambda: recovered(worker, 0), 90, "the worker to recover alerts-sent")
    assert store == {"applied_to": 9, "log_end": 9}


async def test_a_store_ahead_of_its_alerts_topic_stops_the_worker_with_one_sentence(
    broker, names, workers, tmp_path
):
    """The alerts topic deleted and created again under a worker's data directory: its store holds alerts
    the new topic does not, and would hide them. Faust's own check is off for the whole app (the watermark
    table trips it routinely), so the worker keeps it for this table."""
    await asyncio.to_thread(alert_records, broker.bootstrap, names.alerts, 0, ["a", "b", "c"])
    port = free_port()
    first = start_worker(broker, names, tmp_path, port)
    workers.append(first)

    async def three() -> bool:
        store = await recovered(first, 0)
        return bool(store) and store["applied_to"] == 3

    await wait_until(three, 90, "the first worker to recover three alerts")
    assert first.stop(grace=30), "the first worker stopped in time"

    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([names.alerts])
        await wait_until(
            lambda: _gone(admin, names.alerts), 30, "the alerts topic to be deleted", interval=0.2
        )
        await admin.create_topics([NewTopic(names.alerts, names.partitions, 1)])
    finally:
        await admin.close()

    second = start_worker(broker, names, tmp_path, port)
    workers.append(second)
    await wait_until(lambda: not second.alive(), 90, "the worker to refuse its store")
    log = second.log_tail(200)
    assert "alerts-sent store of" in log and "has applied offset 2, but that partition ends at 0" in log, log


async def _gone(admin: AIOKafkaAdminClient, topic: str) -> bool:
    return topic not in await admin.list_topics()


async def test_alerts_written_while_a_worker_recovers_do_not_look_like_a_store_ahead(
    broker, names, producer, workers, tmp_path
):
    """The previous owner of a partition can still be writing alerts while its next owner recovers: the
    store then applies records past the end recovery read when it began. That is no store ahead of its
    topic, and the worker goes on (the end it checks against is read after recovery)."""
    stop = asyncio.Event()

    async def previous_owner() -> int:
        n = 0
        while not stop.is_set():
            value = alert(f"late-{n}", 0, n).dumps()
            await producer.send_and_wait(names.alerts, value, key=f"late-{n}".encode(), partition=0)
            n += 1
        return n

    writing = asyncio.create_task(previous_owner())
    try:
        worker = start_worker(broker, names, tmp_path, free_port())
        workers.append(worker)
        store = await wait_until(lambda: recovered(worker, 0), 90, "the worker to recover alerts-sent")
    finally:
        stop.set()
        written = await writing
    assert worker.alive(), worker.log_tail(50)
    assert store["applied_to"] and written >= store["applied_to"]
