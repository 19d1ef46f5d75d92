"""The command line: the embedded broker command and fail-fast configuration errors."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from aml_app.harness.child_process import aml_app_executable
from aml_app.kafka.broker import free_port
from tests.harness import wait_until

pytestmark = pytest.mark.integration

AML_APP = aml_app_executable()


async def test_broker_command_creates_the_topics_and_stops_on_ctrl_c(tmp_path):
    port = free_port()
    env = {**os.environ, "AML_PAYMENTS_TOPIC": "payments", "AML_PARTITIONS": "3"}
    broker = await asyncio.create_subprocess_exec(
        AML_APP,
        "broker",
        "--port",
        str(port),
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:

        async def topics() -> set[str] | None:
            admin = AIOKafkaAdminClient(bootstrap_servers=f"127.0.0.1:{port}", request_timeout_ms=2000)
            try:
                await admin.start()
                found = set(await admin.list_topics())
                return found if {"payments", "aml.decisions", "payments.dlq"} <= found else None
            except Exception:
                return None
            finally:
                await admin.close()

        # The topics can be listed before the command has heard they were created and said it is ready:
        # wait for its line first, else Ctrl-C can come before it.
        ready = await asyncio.wait_for(line_with(broker, "embedded broker ready"), 30)
        assert f"KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:{port}" in ready
        await wait_until(topics, 30, "the broker command to create the topics", interval=0.3)
        broker.send_signal(signal.SIGINT)
        out, _ = await asyncio.wait_for(broker.communicate(), 20)
    finally:
        if broker.returncode is None:
            broker.terminate()  # SIGTERM still stops the embedded broker cleanly; a kill would orphan it
            try:
                await asyncio.wait_for(broker.wait(), 20)
            except TimeoutError:
                broker.kill()
    assert broker.returncode == 0
    assert "embedded broker stopped" in out.decode()


async def line_with(process: asyncio.subprocess.Process, text: str) -> str:
    """The first line of the process's output that holds `text`."""
    assert process.stdout is not None
    while line := (await process.stdout.readline()).decode():
        if text in line:
            return line
    raise AssertionError(f"the output ended without a line holding {text!r}")


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("KAFKA_BOOTSTRAP_SERVERS", "not-a-server", "KAFKA_BOOTSTRAP_SERVERS"),
        ("AML_DEPENDS_ON", "aml", "AML_APP_ID"),
        ("AML_REFRESH_INTERVAL", "soon", "AML_REFRESH_INTERVAL"),
    ],
)
def test_a_bad_setting_stops_the_worker_at_once_with_a_sentence(tmp_path, variable, value, named):
    env = {**os.environ, variable: value}
    done = subprocess.run(
        [AML_APP, "worker"], env=env, cwd=tmp_path, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 2
    err = done.stderr.decode()
    assert err.startswith("aml-app: configuration error: ")
    assert named in err
    assert "Traceback" not in err


@pytest.mark.parametrize("servers", ["127.0.0.1:{port}", "no-such-host.invalid:9092"])
def test_a_worker_without_a_reachable_cluster_says_so_in_one_sentence(tmp_path, servers):
    """A refused port and a name that does not resolve: one line while it waits, one when it gives up
    (status 1), no traceback, no Faust start-up banner."""
    servers = servers.format(port=free_port())
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": servers,
        "AML_DATA_DIR": str(tmp_path),
        "AML_STARTUP_WAIT": "2",
    }
    done = subprocess.run(
        [AML_APP, "worker", "-l", "info"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr.decode()
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"aml-app: waiting up to 2 s for the Kafka cluster at {servers} (")
    assert lines[1].startswith(
        f"aml-app: cannot start the worker: the Kafka cluster at {servers} did not answer within 2 s: "
    )
    assert lines[1].endswith("; check KAFKA_BOOTSTRAP_SERVERS.")
    assert done.stdout == b""


def children_of(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_broker_command_on_a_port_in_use_says_so_in_one_sentence(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [AML_APP, "broker", "--port", str(port)]
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, timeout=60, check=False)
    err = done.stderr.decode()
    assert done.returncode == 1 and f"Error: port {port} on 127.0.0.1 is already in use" in err, err
    assert "Traceback" not in err


async def test_broker_command_exits_1_when_its_broker_dies(tmp_path):
    """Not "stopped" and exit 0, as after Ctrl-C."""
    port = free_port()
    broker = await asyncio.create_subprocess_exec(
        AML_APP, "broker", "--port", str(port), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        await asyncio.wait_for(line_with(broker, "embedded broker ready"), 30)
        [tansu] = children_of(broker.pid)
        os.kill(tansu, signal.SIGKILL)
        out, _ = await asyncio.wait_for(broker.communicate(), 20)
    finally:
        if broker.returncode is None:
            broker.terminate()
            await asyncio.wait_for(broker.wait(), 20)
    assert broker.returncode == 1
    assert "the embedded broker exited by itself with code -9" in out.decode()
