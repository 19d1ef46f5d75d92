"""Reaching a Kafka cluster at start-up: retried until a deadline, then one sentence saying which servers
did not answer and why. A fresh cluster (compose, Kubernetes) takes a while to answer metadata requests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence

from aiokafka.admin import AIOKafkaAdminClient

from aml_app.kafka.security import KafkaSecurity, aiokafka_kwargs


class Unreachable(RuntimeError):
    """The cluster did not answer in time; the message is one sentence."""


async def answering_admin(
    bootstrap: Sequence[str],
    security: KafkaSecurity,
    timeout: float,
    client_id: str,
    waiting: Callable[[str], None] | None = None,
    retry_every: float = 1.0,
) -> AIOKafkaAdminClient:
    """An admin client once the cluster answers a metadata request (an open port is not enough);
    Unreachable after `timeout` seconds of trying. `waiting(reason)` hears of the first failed attempt.

    The client library's own log lines of each failed attempt are kept back (a start-up against a cluster
    that is still starting would print one per second); the last of them is the reason given."""
    servers = ",".join(bootstrap)
    deadline = time.monotonic() + timeout
    reason = "no attempt"
    with _client_log() as said:
        while time.monotonic() < deadline:
            admin = AIOKafkaAdminClient(
                bootstrap_servers=list(bootstrap),
                client_id=client_id,
                request_timeout_ms=10_000,
                **aiokafka_kwargs(security),
            )
            try:
                await asyncio.wait_for(_described(admin), max(0.1, deadline - time.monotonic()))
                return admin
            except Exception as exc:
                first = reason == "no attempt"
                reason = said[-1] if said else _named(exc)
                if first and waiting is not None:
                    waiting(reason)
                with contextlib.suppress(Exception):
                    await admin.close()
                await asyncio.sleep(min(retry_every, max(0.0, deadline - time.monotonic())))
    raise Unreachable(f"the Kafka cluster at {servers} did not answer within {timeout:g} s: {reason}")


def _named(exc: BaseException) -> str:
    text = str(exc)
    return text if text.startswith(type(exc).__name__) else f"{type(exc).__name__}: {text}".rstrip(": ")


@contextlib.contextmanager
def _client_log() -> Iterator[list[str]]:
    """aiokafka's warnings and errors, kept in a list instead of printed."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logger = logging.getLogger("aiokafka")
    handler, propagate = Keep(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


async def _described(admin: AIOKafkaAdminClient) -> None:
    await admin.start()
    await admin.describe_cluster()


async def check_reachable(
    bootstrap: Sequence[str],
    security: KafkaSecurity,
    timeout: float,
    client_id: str,
    waiting: Callable[[str], None] | None = None,
    retry_every: float = 1.0,
) -> None:
    """Return once the cluster answers; Unreachable after `timeout` seconds."""
    admin = await answering_admin(bootstrap, security, timeout, client_id, waiting, retry_every)
    await admin.close()
