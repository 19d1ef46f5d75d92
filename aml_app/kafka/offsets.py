"""Reads the dependency groups' committed offsets through the Kafka admin API.

Committed consumer-group offsets are the single source of truth of a dependency's progress; nothing is
asked of the dependencies beyond committing after their work is durable. Partitions are always passed
explicitly (it is what we need, and some brokers answer an open-ended OffsetFetch with nothing).

A dependency group that reads a topic derived from `payments` (`derived`) has its offsets on that topic
mapped onto `payments` (`aml_app.kafka.derived`): its entry in a reading is then that position, W(p),
every payment below which it has applied. The derivation stage's group is read first, as the mapping's
proof needs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from aml_app.kafka.deadlines import close_within, start_within, within
from aml_app.kafka.derivation import DerivationError
from aml_app.kafka.derived import DerivedTopic
from aml_app.kafka.identity import LogIdentities
from aml_app.kafka.metadata import describe_existing
from aml_app.kafka.security import KafkaSecurity, aiokafka_kwargs, librdkafka_config


class OffsetReadError(RuntimeError):
    """The admin API could not tell us the dependencies' progress; the caller keeps what it knew.

    `timed_out`: no answer came in time (a broker that hangs, not one that refuses): the refresh's
    watchdog counts such reads as overruns (`aml_app.gate.watchdog`)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class Reading:
    """One refresh's worth of offsets: what the gate needs and what an operator needs to see."""

    partitions: list[int]
    #: Each dependency group's committed offset per partition (None: nothing committed).
    committed: dict[str, dict[int, int | None]]
    #: This service's own group's committed offset per partition (None: nothing committed); None when
    #: this reading did not include it.
    service_committed: dict[int, int | None] | None = None
    #: ListOffsets(latest) per partition: the log end as the partition leader reports it; None when this
    #: reading did not include it.
    log_ends: dict[int, int] | None = None
    #: Which log the offsets are of (`aml_app.kafka.identity`), read after them in the same reading.
    log: str | None = None
    #: Each group reading a derived topic: its offsets on that topic that its `committed` position was
    #: mapped from (`DerivedTopic.committed`), for the freshness check of its answers.
    derived: dict[str, dict[int, int]] = field(default_factory=dict)


class DependencyOffsets:
    """One admin client (and, for log ends, one group-less consumer), reused across refreshes,
    counting the requests it makes.

    `security` is the cluster's TLS/SASL settings, as loaded at start-up (`Settings.kafka.security`);
    `derived` maps a group that reads a topic derived from `topic` to (that topic, the stage's group).
    """

    def __init__(
        self,
        bootstrap_servers: Sequence[str],
        topic: str,
        groups: Sequence[str],
        request_timeout: float = 5.0,
        *,
        security: KafkaSecurity,
        derived: Mapping[str, tuple[str, str]] | None = None,
    ) -> None:
        self.bootstrap_servers = list(bootstrap_servers)
        self._security = aiokafka_kwargs(security)
        self.topic = topic
        self.groups = list(groups)
        self.request_timeout = request_timeout
        self.requests = 0
        #: Seconds spent reading the log's identity so far (a part of each refresh the web view shows).
        self.identity_s = 0.0
        self._client: AIOKafkaAdminClient | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._coordinators: dict[str, int] = {}
        self._partitions: list[int] = []
        self._identities: LogIdentities | None = None
        #: The identity of the log the last reading was of (`read_all`).
        self._log_seen: str | None = None
        self._librdkafka = {
            "bootstrap.servers": ",".join(self.bootstrap_servers),
            **librdkafka_config(security),
        }
        self._carried = (0, 0)  # derived requests and records counted by the readers this one replaced
        client = {"bootstrap_servers": self.bootstrap_servers, **self._security}
        self._derived = {
            group: DerivedTopic(derived_topic, group, stage, client, request_timeout)
            for group, (derived_topic, stage) in (derived or {}).items()
        }

    async def _admin(self) -> AIOKafkaAdminClient:
        if self._client is None:
            client = AIOKafkaAdminClient(
                bootstrap_servers=self.bootstrap_servers,
                client_id="aml-gate",
                request_timeout_ms=int(self.request_timeout * 1000),
                **self._security,
            )
            await start_within(client.start, client.close, self.request_timeout, "the admin client")
            self._client = client
        return self._client

    async def _log_end_reader(self) -> AIOKafkaConsumer:
        """A consumer without a group: the public client API for ListOffsets (the admin client has none)."""
        if self._consumer is None:
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap_servers,
                client_id="aml-gate",
                enable_auto_commit=False,
                request_timeout_ms=int(self.request_timeout * 1000),
                **self._security,
            )
            await start_within(consumer.start, consumer.stop, self.request_timeout, "the log end reader")
            self._consumer = consumer
        return self._consumer

    async def close(self) -> None:
        """Close the clients, each within the request timeout (a client that does not close in time is
        left behind: `aml_app.kafka.deadlines`); the next read starts with new ones."""
        client, self._client = self._client, None
        consumer, self._consumer = self._consumer, None
        self._identities = None
        self._coordinators.clear()
        for derived in self._derived.values():
            await derived.close()
        if client is not None:
            await close_within(client.close(), self.request_timeout, "closing the admin client")
        if consumer is not None:
            await close_within(consumer.stop(), self.request_timeout, "stopping the log end reader")

    async def read(
        self, refresh_partitions: bool = False
    ) -> tuple[list[int], dict[str, dict[int, int | None]]]:
        """The topic's partitions and each group's committed offset on them (None: nothing committed).

        Partitions are re-read when asked, so partitions added to the topic are picked up.
        """
        reading = await self.read_all("", refresh_partitions, operator_fields=False)
        return reading.partitions, reading.committed

    async def read_all(
        self, service_group: str, refresh_partitions: bool = False, operator_fields: bool = True
    ) -> Reading:
        """`read` plus, when `operator_fields`, what the operator views need, in the same refresh: this
        service's own committed offsets (`service_group`'s) and the topic's log ends (two more requests).

        The log ends are read after the committed offsets, so on Apache Kafka no group is ever seen
        ahead of the log end. The log's identity is read after the offsets, and the reading counts only
        when the identity read before them (the last reading's) is the same: a topic deleted and created
        again between the offsets and the identity would put the old log's offsets under the new log's
        name. So the first reading, and the first after the log changed, is made twice.
        """
        try:
            for _ in range(2):
                reading = await self._read_once(service_group, refresh_partitions, operator_fields)
                settled, self._log_seen = reading.log == self._log_seen, reading.log
                if settled:
                    return reading
            raise OffsetReadError(f"{self.topic!r} became another log during the reading; reading it again")
        except OffsetReadError:
            raise
        except DerivationError as exc:  # a sentence about the derived topic: the clients are fine
            raise OffsetReadError(str(exc)) from exc
        except Exception as exc:
            raise await self._failed(exc) from exc

    async def _read_once(
        self, service_group: str, refresh_partitions: bool, operator_fields: bool
    ) -> Reading:
        admin = await self._admin()
        recheck = refresh_partitions or not self._partitions
        if recheck:
            self._partitions = await self._read_partitions(admin)
        partitions = self._partitions
        if not operator_fields:
            committed = await self._read_committed(admin, partitions, self.groups)
            return Reading(
                partitions, committed, log=await self._read_log(recheck), derived=self._on_derived()
            )
        groups = list(dict.fromkeys([*self.groups, service_group]))
        committed = await self._read_committed(admin, partitions, groups)
        own = committed[service_group] if service_group in self.groups else committed.pop(service_group)
        ends = await self._read_log_ends(partitions)
        return Reading(partitions, committed, own, ends, await self._read_log(recheck), self._on_derived())

    async def _failed(self, exc: Exception) -> OffsetReadError:
        """Forget the connections and coordinators, so the next refresh starts clean."""
        await self.close()
        name, text = type(exc).__name__, str(exc)
        message = text if text.startswith(name) else f"{name}: {text}".strip(": ")
        return OffsetReadError(message, timed_out=isinstance(exc, TimeoutError))

    async def _read_log_ends(self, partitions: Sequence[int]) -> dict[int, int]:
        consumer = await self._log_end_reader()
        self.requests += 1
        ends = await within(
            consumer.end_offsets([TopicPartition(self.topic, p) for p in partitions]),
            self.request_timeout,
            f"reading the log ends of {self.topic!r}",
        )
        return {tp.partition: offset for tp, offset in ends.items()}

    async def _read_log(self, cluster_too: bool) -> str:
        """The identity of the topic's log, read after the offsets: if the topic was deleted and created
        again before they were read, this sees the new log, so offsets of the new log never go out under
        the old one's name. The cluster's id is read again with the partitions. The derived topics' logs
        are described in the same request, and each reader checks its own (`DerivedTopic.check_log`)."""
        if self._identities is None:
            self._identities = LogIdentities(self._librdkafka, self.request_timeout)
        self.requests += 2 if cluster_too else 1
        readers = [reader for group, reader in self._derived.items() if group in self.groups]
        topics = list(dict.fromkeys([self.topic, *(reader.topic for reader in readers)]))
        # librdkafka's own timeouts bound the thread; this bounds the wait for it whatever it does.
        began = time.perf_counter()
        try:
            logs = await within(
                asyncio.to_thread(self._identities.read_all, topics, cluster_too),
                2 * self.request_timeout,
                f"reading which log {self.topic!r} is",
            )
        finally:
            self.identity_s += time.perf_counter() - began
        for reader in readers:
            reader.check_log(logs[reader.topic])
        return logs[self.topic]

    async def _read_partitions(self, admin: AIOKafkaAdminClient) -> list[int]:
        self.requests += 1
        topics = await within(
            describe_existing(admin, [self.topic]), self.request_timeout, f"describing {self.topic!r}"
        )
        found = [t for t in topics if t["topic"] == self.topic and not t["error_code"]]
        if not found or not found[0]["partitions"]:
            raise OffsetReadError(f"topic {self.topic!r} does not exist (yet)")
        return sorted(p["partition"] for p in found[0]["partitions"])

    @property
    def derived_requests(self) -> int:
        """Requests made to map the derived topics' offsets (counted apart from `requests`)."""
        return self._carried[0] + sum(derived.requests for derived in self._derived.values())

    @property
    def derived_records_read(self) -> int:
        """Records of the derived topics read so far (each once, unless a group is moved back)."""
        return self._carried[1] + sum(derived.records_read for derived in self._derived.values())

    def _on_derived(self) -> dict[str, dict[int, int]]:
        """Each derived group's offsets on its topic, as the reading just made mapped them."""
        return {
            group: dict(reader.committed) for group, reader in self._derived.items() if group in self.groups
        }

    def carry_over(self, before: DependencyOffsets) -> None:
        """Go on from the reader this one replaces: its counts, and what it has read of the derived
        topics (`DerivedTopic.take_over`)."""
        self.requests, self._log_seen = before.requests, before._log_seen
        self.identity_s = before.identity_s
        self._carried = (before.derived_requests, before.derived_records_read)
        for group, reader in self._derived.items():
            if group in before._derived:
                reader.take_over(before._derived[group])

    async def _coordinator(self, admin: AIOKafkaAdminClient, group: str) -> int:
        if group not in self._coordinators:
            self.requests += 1
            self._coordinators[group] = await within(
                admin.find_coordinator(group), self.request_timeout, f"finding {group!r}'s coordinator"
            )
        return self._coordinators[group]

    async def _read_committed(
        self, admin: AIOKafkaAdminClient, partitions: Sequence[int], groups: Sequence[str]
    ) -> dict[str, dict[int, int | None]]:
        """Each group's committed offsets on `partitions`; a group reading a derived topic, its position."""
        derived = [group for group in groups if group in self._derived]
        stages = list(dict.fromkeys(self._derived[group].stage_group for group in derived))
        # The stages' offsets first: a derived group's position is proved from them (kafka.derivation).
        stage_offsets = await self._read_plain(admin, partitions, stages)
        result = await self._read_plain(admin, partitions, [g for g in groups if g not in self._derived])
        for group in derived:
            reader = self._derived[group]
            on_topic = await reader.partitions(admin)
            reader.requests += 1  # a request made to map the derived topic
            raw = await self._fetch_committed(admin, group, reader.topic, on_topic)
            positions = await reader.positions(partitions, stage_offsets[reader.stage_group], raw)
            result[group] = {p: positions[p] for p in partitions}
        return {group: result[group] for group in groups}

    async def _read_plain(
        self, admin: AIOKafkaAdminClient, partitions: Sequence[int], groups: Sequence[str]
    ) -> dict[str, dict[int, int | None]]:
        """The groups' OffsetFetch requests side by side: a refresh waits for one round trip, not one per
        group (the leader's loop is busy under load, and each wait there is a turn behind the lanes)."""
        self.requests += len(groups)
        answers = await asyncio.gather(
            *(self._fetch_committed(admin, group, self.topic, partitions) for group in groups)
        )
        return dict(zip(groups, answers, strict=True))

    async def _fetch_committed(
        self, admin: AIOKafkaAdminClient, group: str, topic: str, partitions: Sequence[int]
    ) -> dict[int, int | None]:
        """`group`'s committed offsets on `partitions` of `topic` (None: nothing committed): one
        OffsetFetch, which the caller counts."""
        answer_from = await self._coordinator(admin, group)
        answer = await within(
            admin.list_consumer_group_offsets(
                group,
                group_coordinator_id=answer_from,
                partitions=[TopicPartition(topic, p) for p in partitions],
            ),
            self.request_timeout,
            f"reading {group!r}'s committed offsets on {topic!r}",
        )
        offsets = {
            tp.partition: (meta.offset if meta.offset >= 0 else None)
            for tp, meta in answer.items()
            if tp.topic == topic
        }
        missing = sorted(set(partitions) - set(offsets))
        if missing:
            # aiokafka returns an OffsetFetch answered with a top-level error (NOT_COORDINATOR,
            # COORDINATOR_LOAD_IN_PROGRESS: the coordinator moved or is loading) as an empty answer,
            # which would read as "nothing committed": every partition closed, or a group reading a
            # derived topic placed back at its start.
            del self._coordinators[group]
            raise OffsetReadError(
                f"group {group!r}'s coordinator (broker {answer_from}) answered without partitions "
                f"{_ranges(missing)} of {topic!r} (moved, or still loading); asking again"
            )
        return offsets


def _ranges(partitions: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5": short enough for a log line whatever the partition count."""
    spans: list[list[int]] = []
    for p in partitions:
        if spans and p == spans[-1][1] + 1:
            spans[-1][1] = p
        else:
            spans.append([p, p])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
