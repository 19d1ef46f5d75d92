"""`aml-app import-amlworld` as a user runs it, into a fresh payments topic on the session's broker: every
parsed payment arrives, keyed by payer, each payer's payments in event-time order, values byte for byte."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from aml_app.harness.child_process import aml_app_executable
from aml_app.kafka.broker import EmbeddedBroker, create_topics
from aml_app.kafka.tools import end_offsets
from aml_app.simulation.amlworld import read_amlworld
from tests.harness import TopicReader, wait_until
from tests.unit.test_amlworld import HEADER, ROWS

pytestmark = pytest.mark.integration
PARTITIONS = 3
REAL_DATA = Path(__file__).resolve().parents[1] / "data" / "amlworld"


def import_amlworld(broker: EmbeddedBroker, topic: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [aml_app_executable(), "import-amlworld", *args],
        env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap, "AML_PAYMENTS_TOPIC": topic},
        capture_output=True,
        text=True,
        timeout=60,
    )


async def fresh_topic(broker: EmbeddedBroker) -> str:
    topic = f"payments-{uuid.uuid4().hex[:8]}"
    await create_topics([broker.bootstrap], [topic], PARTITIONS)
    return topic


async def test_the_import_sends_every_payment_keyed_by_payer_in_event_time(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    source = tmp_path / "HI-Tiny_Trans.csv"
    source.write_text("\n".join([HEADER, *ROWS]) + "\n")
    expected = read_amlworld(source, prefix="it").payments
    topic = await fresh_topic(broker)
    truth = tmp_path / "truth.jsonl"

    result = import_amlworld(broker, topic, str(source), "--prefix", "it", "--truth", str(truth))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(f"9 row(s) read from {source}, 7 payment(s) sent to {topic}" in line for line in lines), (
        result.stdout
    )
    assert "  skipped: 2 row(s) paid in Bitcoin (no ISO 4217 code, our contract refuses it)" in lines
    assert "  skipped rows labelled laundering: 1 (not sent, not in the ground truth)" in lines
    assert "  laundering: 2 payment(s) sent with Is Laundering = 1" in lines
    assert "  event time 2022-08-31T23:59:00Z .. 2022-09-01T01:00:00Z" in lines
    assert truth.read_text().splitlines() == [
        '{"payment_id": "it-0000003", "is_laundering": true}',
        '{"payment_id": "it-0000007", "is_laundering": true}',
    ]

    reader = await TopicReader(broker.bootstrap, topic, PARTITIONS).start()
    try:

        async def all_read() -> bool:
            await reader.poll(0.2)
            return len(reader.records) >= len(expected)

        await wait_until(all_read, 15, f"{len(expected)} payments on {topic}", interval=0)
    finally:
        await reader.stop()
    assert len(reader.records) == len(expected)
    assert sorted((r.key, r.value) for r in reader.records) == sorted((p.key, p.value()) for p in expected)
    # Each payer's payments, read in offset order on its partition, are in the parser's (event-time) order.
    for payer in {p.payer for p in expected}:
        read = sorted((r.offset, r.value) for r in reader.records if r.key == payer.encode())
        assert [value for _, value in read] == [p.value() for p in expected if p.payer == payer]
        assert len({r.partition for r in reader.records if r.key == payer.encode()}) == 1
    # One payer whose rows are out of event-time order in the file (lines 3, 7, 10): sent 10, 3, 7.
    assert [p.payment_id for p in expected if p.payer == "0211:80A1B2C3D"] == [
        "it-0000010",
        "it-0000003",
        "it-0000007",
    ]


async def test_a_bad_row_sends_nothing(broker: EmbeddedBroker, tmp_path: Path) -> None:
    source = tmp_path / "broken.csv"
    source.write_text("\n".join([HEADER, *ROWS, ROWS[0].replace("Reinvestment,0", "Reinvestment,2")]) + "\n")
    topic = await fresh_topic(broker)

    result = import_amlworld(broker, topic, str(source))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: {source} line 11: Is Laundering must be 0 or 1, got '2'; nothing was sent."
    ]
    # Tansu's log end is the last batch's base offset + 1: above 0 as soon as anything was written.
    assert await end_offsets([broker.bootstrap], topic, range(PARTITIONS)) == dict.fromkeys(
        range(PARTITIONS), 0
    )


async def test_real_attempts_replay_into_real_background(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """LI-Medium's patterns file and HI-Small's first rows, in one command: every payment arrives once,
    and the ground truth gives each attempt's payments their typology."""
    data = REAL_DATA
    topic = await fresh_topic(broker)
    truth = tmp_path / "truth.jsonl"
    result = import_amlworld(
        broker,
        topic,
        str(data / "LI-Medium_Patterns.txt"),
        str(data / "HI-Small_Trans_rows1-7500.csv"),
        "--limit",
        "200",
        "--truth",
        str(truth),
    )
    assert result.returncode == 0, result.stderr
    assert "  attempts: 456 laundering attempt(s) of the patterns file" in result.stdout.splitlines()
    assert "amlworld: warning: 26 days of event time in 4108 payments, sent at once" in result.stdout
    sent = 200 + 3908
    assert f"{200 + 3909} row(s) read from" in result.stdout and f"{sent} payment(s) sent" in result.stdout
    lines = truth.read_text().splitlines()
    assert len(lines) == 3908 and all('"typology": ' in line for line in lines)
    reader = await TopicReader(broker.bootstrap, topic, PARTITIONS).start()
    try:

        async def all_read() -> bool:
            await reader.poll(0.2)
            return len(reader.records) >= sent

        await wait_until(all_read, 30, f"{sent} payments on {topic}", interval=0)
    finally:
        await reader.stop()
    assert len(reader.records) == sent
