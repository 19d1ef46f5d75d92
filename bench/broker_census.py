"""A census of the broker's requests: which process asks what of it, how often, and how long it answers.

The broker's CPU is the largest single cost of the whole system at 150-500 payments/s on this machine
(`bench.capacity`), and its process says nothing about who makes it work. `Census` is a Kafka proxy in
front of the broker: the broker advertises the proxy's port, so every client's connection goes through
it; each request's header (API key, version, correlation id, client id) is read as it passes, and each
answer is matched to its request by the correlation id. Per process (the owner of the connection's
client socket, found through /proc), client id and API it counts requests, the bytes each way and the
wall time the broker took to answer (from the request's last byte forwarded to the answer's first byte
read: for a fetch this includes the time the broker held it waiting for records). For Fetch and
ListOffsets it also counts the topics and partitions asked, since the embedded broker's cost of both
grows with the record batches a partition holds (`bench.broker_growth`).

The proxy runs in the benchmark's process, so it adds its own CPU and a little latency to every
request: a census run's latencies are not the capacity's figures, only its counts are.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import proc_table

API_NAMES = {
    0: "Produce",
    1: "Fetch",
    2: "ListOffsets",
    3: "Metadata",
    8: "OffsetCommit",
    9: "OffsetFetch",
    10: "FindCoordinator",
    11: "JoinGroup",
    12: "Heartbeat",
    13: "LeaveGroup",
    14: "SyncGroup",
    15: "DescribeGroups",
    16: "ListGroups",
    18: "ApiVersions",
    19: "CreateTopics",
    20: "DeleteTopics",
    22: "InitProducerId",
    32: "DescribeConfigs",
    37: "CreatePartitions",
    60: "DescribeCluster",
    75: "DescribeTopicPartitions",
}

#: Request header versions: flexible (tagged fields after the client id) from these API versions on.
FLEXIBLE_FROM = {0: 9, 1: 12, 2: 6, 3: 9, 8: 8, 9: 6, 10: 3, 11: 6, 12: 4, 13: 4, 14: 4, 18: 3, 19: 5}


@dataclass
class Tally:
    """What one process's client asked of one API: requests, those answered, the bytes each way and the
    wall time the broker took to answer them."""

    requests: int = 0
    answered: int = 0
    wall_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    #: Fetch and ListOffsets: (topic, partition) asked, summed over the requests.
    partitions: Counter[str] = field(default_factory=Counter)

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "answered": self.answered,
            "wall_s": round(self.wall_s, 4),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "partitions": dict(self.partitions),
        }


class _Reader:
    """Reads the fields of a request body in Kafka's encodings."""

    def __init__(self, data: bytes, at: int = 0) -> None:
        self.data = data
        self.at = at

    def int8(self) -> int:
        self.at += 1
        return self.data[self.at - 1]

    def int16(self) -> int:
        (value,) = struct.unpack_from(">h", self.data, self.at)
        self.at += 2
        return int(value)

    def int32(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.at)
        self.at += 4
        return int(value)

    def skip(self, n: int) -> None:
        self.at += n

    def uvarint(self) -> int:
        shift = value = 0
        while True:
            byte = self.data[self.at]
            self.at += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def string(self) -> str | None:
        n = self.int16()
        if n < 0:
            return None
        self.at += n
        return self.data[self.at - n : self.at].decode("utf-8", "replace")

    def compact_string(self) -> str | None:
        n = self.uvarint() - 1
        if n < 0:
            return None
        self.at += n
        return self.data[self.at - n : self.at].decode("utf-8", "replace")

    def tagged_fields(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.skip(self.uvarint())

    def array_length(self, flexible: bool) -> int:
        return self.uvarint() - 1 if flexible else self.int32()


def _topics(body: _Reader, flexible: bool, partition_bytes: int, by_id: bool = False) -> Counter[str]:
    """A request's array of topics, each with its partitions' count (a topic by the first bytes of its
    id when `by_id`); each partition's fields are `partition_bytes` long, its tagged fields aside."""
    found: Counter[str] = Counter()
    for _ in range(body.array_length(flexible)):
        if by_id:
            topic = "id:" + body.data[body.at : body.at + 16].hex()[:8]
            body.skip(16)
        else:
            topic = (body.compact_string() if flexible else body.string()) or "?"
        count = body.array_length(flexible)
        for _ in range(count):
            body.skip(partition_bytes)
            if flexible:
                body.tagged_fields()
        if flexible:
            body.tagged_fields()
        found[topic] += count
    return found


def _fetch_topics(body: _Reader, version: int, flexible: bool) -> Counter[str]:
    """The topics a Fetch asks for (by topic id from v13 on)."""
    if version < 15:
        body.skip(4)  # replica id
    body.skip(12)  # max wait, min bytes, max bytes
    body.skip(1)  # isolation level
    if version >= 7:
        body.skip(8)  # session id and epoch
    # partition, current leader epoch, fetch offset, last fetched epoch, log start offset, max bytes
    partition = (
        4 + (4 if version >= 9 else 0) + 8 + (4 if version >= 12 else 0) + (8 if version >= 5 else 0) + 4
    )
    return _topics(body, flexible, partition, by_id=version >= 13)


def _list_offsets_topics(body: _Reader, version: int, flexible: bool) -> Counter[str]:
    body.skip(4)  # replica id
    if version >= 2:
        body.skip(1)  # isolation level
    # partition, current leader epoch, timestamp, max offsets (v0)
    partition = 4 + (4 if version >= 4 else 0) + 8 + (4 if version == 0 else 0)
    return _topics(body, flexible, partition)


def parse_request(frame: bytes) -> tuple[int, int, int, str, Counter[str]]:
    """(API key, version, correlation id, client id, topic partitions asked) of one request frame."""
    body = _Reader(frame)
    key, version, correlation = body.int16(), body.int16(), body.int32()
    client = body.string() or ""
    topics: Counter[str] = Counter()
    flexible = version >= FLEXIBLE_FROM.get(key, 1 << 15)
    with contextlib.suppress(Exception):  # a census never breaks the traffic it counts
        if flexible:
            body.tagged_fields()
        if key == 1:
            topics = _fetch_topics(body, version, flexible)
        elif key == 2:
            topics = _list_offsets_topics(body, version, flexible)
    return key, version, correlation, client, topics


def socket_owner(local_port: int, remote_port: int) -> int | None:
    """The pid holding the TCP socket 127.0.0.1:local_port -> :remote_port, from /proc (None: not found)."""
    wanted = f":{local_port:04X} "
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if (parts[1] + " ").endswith(wanted) and parts[2].endswith(f":{remote_port:04X}"):
                    inode = parts[9]
                    break
        if inode:
            break
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path) == target:
                        return int(entry.name)
    return None


class Census:
    """A counting proxy on `port` in front of the broker at `target` (host, port)."""

    def __init__(self, port: int, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port
        self.target = target
        self.tallies: dict[tuple[int | None, str, str], Tally] = {}
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def snapshot(self) -> dict[tuple[int | None, str, str], dict[str, Any]]:
        return {key: tally.as_json() for key, tally in self.tallies.items()}

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        peer_port = client_w.get_extra_info("peername")[1]
        pid = await asyncio.to_thread(socket_owner, peer_port, self.port)
        pending: dict[int, tuple[Tally, float]] = {}
        try:
            broker_r, broker_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            self._tasks.discard(task)
            return
        answers = asyncio.create_task(self._answers(broker_r, client_w, pending))
        try:
            while True:
                head = await client_r.readexactly(4)
                (size,) = struct.unpack(">i", head)
                frame = await client_r.readexactly(size)
                key, _version, correlation, client, topics = parse_request(frame)
                counted = (pid, client, API_NAMES.get(key, str(key)))
                tally = self.tallies.get(counted) or self.tallies.setdefault(counted, Tally())
                tally.requests += 1
                tally.bytes_in += size + 4
                tally.partitions.update(topics)
                # Noted before it goes: the answer can be read while the request is still being drained.
                pending[correlation] = (tally, time.perf_counter())
                broker_w.write(head + frame)
                await broker_w.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            answers.cancel()
            await asyncio.gather(answers, return_exceptions=True)
            for writer in (broker_w, client_w):
                writer.close()
            self._tasks.discard(task)

    @staticmethod
    async def _answers(
        broker_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        pending: dict[int, tuple[Tally, float]],
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await broker_r.readexactly(8)
                at = time.perf_counter()
                size, correlation = struct.unpack(">ii", head)
                rest = await broker_r.readexactly(size - 4)
                found = pending.pop(correlation, None)
                if found is not None:
                    tally, sent = found
                    tally.answered += 1
                    tally.wall_s += at - sent
                    tally.bytes_out += size + 4
                client_w.write(head + rest)
                await client_w.drain()
        client_w.close()


def difference(
    before: Mapping[tuple[int | None, str, str], Mapping[str, Any]],
    after: Mapping[tuple[int | None, str, str], Mapping[str, Any]],
) -> dict[tuple[int | None, str, str], dict[str, Any]]:
    """What was asked between two snapshots."""
    out = {}
    for key, now in after.items():
        then = before.get(key, {})
        diff: dict[str, Any] = {
            f: now[f] - then.get(f, 0) for f in ("requests", "answered", "wall_s", "bytes_in", "bytes_out")
        }
        parts = Counter(now["partitions"])
        parts.subtract(then.get("partitions", {}))
        diff["partitions"] = {t: n for t, n in parts.items() if n}
        if diff["requests"]:
            out[key] = diff
    return out


def owners(pids: Iterable[int | None], named: Mapping[str, int]) -> dict[int, str]:
    """Each pid's name: the nearest of `named`'s processes (`bench.common.processes`) it descends from."""
    parents, _ = proc_table()
    out: dict[int, str] = {}
    by_pid = {pid: name for name, pid in named.items()}
    for pid in pids:
        at: int | None = pid
        while at is not None and at not in by_pid and at > 1:
            at = parents.get(at)
        if pid is not None:
            out[pid] = by_pid.get(at, f"pid {pid}") if at is not None else f"pid {pid}"
    return out


def rows(
    diff: Mapping[tuple[int | None, str, str], Mapping[str, Any]],
    names: Mapping[int, str],
    seconds: float,
    payments: int,
) -> list[dict[str, Any]]:
    """Per process, client id and API between two snapshots: requests a second and a payment, the
    broker's answering time a second, and the partitions asked a second by topic; busiest first."""
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for (pid, client, api), d in diff.items():
        key = (names.get(pid, f"pid {pid}") if pid is not None else "unknown", client, api)
        m = merged.setdefault(
            key, {"requests": 0, "answered": 0, "wall_s": 0.0, "bytes_out": 0, "partitions": Counter()}
        )
        m["requests"] += d["requests"]
        m["answered"] += d["answered"]
        m["wall_s"] += d["wall_s"]
        m["bytes_out"] += d["bytes_out"]
        m["partitions"].update(d["partitions"])
    out = [
        {
            "process": process,
            "client_id": client,
            "api": api,
            "requests_per_s": round(m["requests"] / seconds, 1),
            "requests_per_payment": round(m["requests"] / payments, 3) if payments else None,
            "answer_ms_per_s": round(1000 * m["wall_s"] / seconds, 1),
            # Over the answered requests: the wall time is summed as answers come.
            "answer_ms_mean": round(1000 * m["wall_s"] / m["answered"], 2) if m["answered"] else None,
            "kb_out_per_s": round(m["bytes_out"] / seconds / 1000, 1),
            "partitions_per_s": {t: round(n / seconds, 1) for t, n in m["partitions"].most_common()},
        }
        for (process, client, api), m in merged.items()
    ]
    return sorted(out, key=lambda r: -r["requests_per_s"])


def table(found: Sequence[Mapping[str, Any]], top: int = 25) -> str:
    lines = [
        "| process | client id | API | requests /s | a payment | broker answer ms /s, mean | kB out /s | "
        "partitions asked /s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in found[:top]:
        parts = ", ".join(f"{t} {n:g}" for t, n in list(r["partitions_per_s"].items())[:4])
        lines.append(
            f"| {r['process']} | {r['client_id']} | {r['api']} | {r['requests_per_s']:g} | "
            f"{r['requests_per_payment']} | {r['answer_ms_per_s']:g}, {r['answer_ms_mean']} | "
            f"{r['kb_out_per_s']:g} | {parts} |"
        )
    return "\n".join(lines)
