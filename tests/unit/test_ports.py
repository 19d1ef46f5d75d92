"""Ports for the servers the harness starts, and what it says when one of them dies at start-up.

A worker whose web port is already some connection's local end fails to bind and exits at once; the
demo then has to say so, not show a page of shutdown lines.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from aml_app.harness.dependencies import ServiceProcess
from aml_app.harness.system import Layout, System, SystemFailure, failure
from aml_app.kafka.broker import free_port, outgoing_port_range, port_free, port_open
from aml_app.kafka.security import KafkaSecurity
from aml_app.settings import Settings


@pytest.fixture
def outgoing() -> Iterator[int]:
    """The local port of an open outgoing connection: nobody listens there, yet no server can bind it."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            accepted, _ = server.accept()
            with accepted:
                yield client.getsockname()[1]


def test_a_connections_local_port_is_not_free_though_nobody_listens_there(outgoing: int) -> None:
    assert not port_open("127.0.0.1", outgoing)
    assert not port_free("127.0.0.1", outgoing)


def test_a_port_a_server_listens_on_is_not_free_and_a_closed_one_is() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not port_free("127.0.0.1", port)
    assert port_free("127.0.0.1", port)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the range Linux gives outgoing ports")
def test_free_ports_lie_below_the_range_outgoing_connections_take_theirs_from() -> None:
    low, _ = outgoing_port_range()
    ports = [free_port() for _ in range(50)]
    assert all(port < low for port in ports), ports
    assert all(port_free("127.0.0.1", port) for port in ports)


def test_the_harness_gives_a_worker_another_port_when_its_own_is_a_connections_end(
    outgoing: int, tmp_path: Path
) -> None:
    said: list[str] = []
    system = System(Settings(), tmp_path, Layout(), say=said.append)
    chosen = system.free("AML_WEB_PORT", "worker aml-0", outgoing)
    assert chosen != outgoing
    assert said == [f"port {outgoing} is busy (AML_WEB_PORT): worker aml-0 uses {chosen}"]


async def test_two_systems_starting_side_by_side_never_get_the_same_free_port(tmp_path: Path) -> None:
    # Nothing listens on the port yet (its server starts seconds later): only the reservation keeps the
    # second system off it, until the first one's cleanup.
    port = free_port()
    first = System(Settings(), tmp_path / "first", Layout(), say=lambda _: None)
    said: list[str] = []
    second = System(Settings(), tmp_path / "second", Layout(), say=said.append)
    assert first.free("AML_WEB_PORT", "worker aml-0", port) == port
    other = second.free("AML_WEB_PORT", "worker aml-0", port)
    assert other != port and port_free("127.0.0.1", port)
    assert said == [f"port {port} is busy (AML_WEB_PORT): worker aml-0 uses {other}"]
    await first.cleanup()
    assert second.free("AML_BROKER_PORT", "the embedded broker", port) == port
    await second.cleanup()


async def test_a_second_system_in_the_same_folder_is_refused_until_the_first_ends(tmp_path: Path) -> None:
    """It emptied the first's logs and worker state and stopped the first's PostgreSQL server."""
    first = System(Settings(), tmp_path, Layout(), say=lambda _: None)
    second = System(Settings(), tmp_path, Layout(), say=lambda _: None)
    first.hold_folder()
    with pytest.raises(SystemFailure, match="is in use by another run"):
        second.hold_folder()
    await first.cleanup()
    second.hold_folder()
    await second.cleanup()


CRASH_LOG = """\
[2026-11-27 09:38:56,794] [30856] [INFO] [^---Server]: Starting...
[2026-11-27 09:38:56,794] [30856] [ERROR] [^Worker]: Error: OSError(98, "address already in use")
Traceback (most recent call last):
OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 38524): address already in use
""" + "".join(f"[2026-11-27 09:38:56,798] [30856] [INFO] [^--Part{i}]: Stopping...\n" for i in range(30))


def test_a_process_that_died_at_start_up_is_reported_with_its_first_error(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text(CRASH_LOG)
    process = ServiceProcess("worker", ["worker"], Settings(), log)
    message = failure("worker aml-0", process, "exited")
    assert message.startswith(
        "worker aml-0 exited; its first error:\n    [2026-11-27 09:38:56,794] [30856] [ERROR] [^Worker]: "
        'Error: OSError(98, "address already in use")\n  and the end of'
    )
    assert message.endswith("[^--Part29]: Stopping...")


def test_an_error_the_end_of_the_log_shows_is_not_repeated(tmp_path: Path) -> None:
    log = tmp_path / "api.log"
    log.write_text("starting\n2026-11-27 10:00:00 aml_app.api ERROR the store is unreachable\n")
    api = ServiceProcess("api", ["api"], Settings(), log)
    message = failure("the relations API", api, "exited with code 1")
    assert message.count("the store is unreachable") == 1
    assert message.startswith(f"the relations API exited with code 1; the end of {log}:")


async def test_a_secured_cluster_is_refused_in_one_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The systems' topic set-up and readers speak plaintext: it took 20 s to say "unreachable"."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    settings = Settings()
    secured = replace(settings, kafka=replace(settings.kafka, security=KafkaSecurity(protocol="SSL")))
    system = System(secured, tmp_path, Layout(), say=lambda _: None)
    with pytest.raises(SystemFailure, match="KAFKA_SECURITY_PROTOCOL=SSL: the demo and the test systems"):
        await system.start_broker()
