"""Reads the dependency groups' committed offsets through the Kafka admin API.

Committed consumer-group offsets are the single source of truth of a dependency's progress; nothing is
asked of the dependencies beyond committing after their work is durable. Partitions are always passed
explicitly (it is what we need, and some brokers answer an open-ended OffsetFetch with nothing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

log = logging.getLogger(__name__)


class OffsetReadError(RuntimeError):
    """The admin API could not tell us the dependencies' progress; the caller keeps what it knew."""


class DependencyOffsets:
    """One admin client, reused across refreshes, counting the requests it makes."""

    def __init__(
        self,
        bootstrap_servers: Sequence[str],
        topic: str,
        groups: Sequence[str],
        request_timeout: float = 5.0,
    ) -> None:
        self.bootstrap_servers = list(bootstrap_servers)
        self.topic = topic
        self.groups = list(groups)
        self.request_timeout = request_timeout
        self.requests = 0
        self._client: AIOKafkaAdminClient | None = None
        self._coordinators: dict[str, int] = {}
        self._partitions: list[int] = []

    async def _admin(self) -> AIOKafkaAdminClient:
        if self._client is None:
            client = AIOKafkaAdminClient(
                bootstrap_servers=self.bootstrap_servers,
                client_id="aml-gate",
                request_timeout_ms=int(self.request_timeout * 1000),
            )
            await asyncio.wait_for(client.start(), self.request_timeout)
            self._client = client
        return self._client

    async def close(self) -> None:
        client, self._client = self._client, None
        self._coordinators.clear()
        if client is not None:
            await client.close()

    async def read(
        self, refresh_partitions: bool = False
    ) -> tuple[list[int], dict[str, dict[int, int | None]]]:
        """The topic's partitions and each group's committed offset on them (None: nothing committed).

        Partitions are re-read when asked, so partitions added to the topic are picked up.
        """
        try:
            admin = await self._admin()
            if refresh_partitions or not self._partitions:
                self._partitions = await self._read_partitions(admin)
            return self._partitions, await self._read_committed(admin, self._partitions)
        except OffsetReadError:
            raise
        except Exception as exc:
            # Forget the connection and coordinators: the next refresh starts clean.
            await self._reset()
            raise OffsetReadError(f"{type(exc).__name__}: {exc}".strip(": ")) from exc

    async def _read_partitions(self, admin: AIOKafkaAdminClient) -> list[int]:
        self.requests += 1
        topics = await asyncio.wait_for(admin.describe_topics([self.topic]), self.request_timeout)
        found = [t for t in topics if t["topic"] == self.topic and not t["error_code"]]
        if not found or not found[0]["partitions"]:
            raise OffsetReadError(f"topic {self.topic!r} does not exist (yet)")
        return sorted(p["partition"] for p in found[0]["partitions"])

    async def _read_committed(
        self, admin: AIOKafkaAdminClient, partitions: Sequence[int]
    ) -> dict[str, dict[int, int | None]]:
        tps = [TopicPartition(self.topic, p) for p in partitions]
        result: dict[str, dict[int, int | None]] = {}
        for group in self.groups:
            if group not in self._coordinators:
                self.requests += 1
                self._coordinators[group] = await asyncio.wait_for(
                    admin.find_coordinator(group), self.request_timeout
                )
            self.requests += 1
            answer = await asyncio.wait_for(
                admin.list_consumer_group_offsets(
                    group, group_coordinator_id=self._coordinators[group], partitions=tps
                ),
                self.request_timeout,
            )
            result[group] = {
                tp.partition: (meta.offset if meta.offset >= 0 else None)
                for tp, meta in answer.items()
                if tp.topic == self.topic
            }
        return result

    async def _reset(self) -> None:
        try:
            await self.close()
        except Exception:  # closing a broken client must not hide the original error
            log.debug("closing the admin client failed", exc_info=True)
