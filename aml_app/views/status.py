"""`aml-app status`: the watermark table in the terminal, like `kafka-consumer-groups --describe`.

Two sources. By default straight from the broker with the admin API (log ends, this service's group and
every dependency group's committed offsets per partition, lag, watermark): no worker needed, so it also
answers when every worker is down. Or `--worker URL`: a running worker's `/watermarks.json`, which adds
what only the workers know (who waits where and since when, in-flight offsets, stalls, payments that
keep failing and are retried). `--json` prints
the document instead of the table, for scripts.

The exit code is a monitoring check's (the Nagios plugin convention that Icinga and Sensu read; an exec
probe sees any non-zero code as failing): see `health_code`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import aiohttp
import click
from aiokafka import AIOKafkaConsumer, TopicPartition

from aml_app.click_types import TIMEOUT
from aml_app.gate.health import (
    ERROR,
    LAGGING,
    STALLED,
    UNKNOWN_GROUP,
    Limits,
    cut_closed,
    describe,
    plural_partitions,
)
from aml_app.gate.watermark import build_rows
from aml_app.kafka.deadlines import close_within, start_within
from aml_app.kafka.offsets import DependencyOffsets, OffsetReadError
from aml_app.kafka.security import KafkaSecurity, aiokafka_kwargs
from aml_app.settings import Settings
from aml_app.tokens import bearer

#: The exit codes of `aml-app status` (the Nagios plugin convention).
EXIT_OK, EXIT_WARNING, EXIT_CRITICAL, EXIT_UNKNOWN = 0, 1, 2, 3
#: Dependency statuses that hold payments back or leave their numbers unknown, and those that only warn.
CRITICAL_STATUSES = frozenset({STALLED, ERROR, UNKNOWN_GROUP})
WARNING_STATUSES = frozenset({LAGGING})


def health_code(doc: Mapping[str, Any]) -> int:
    """The exit code a status document calls for, so that scripts and probes need not parse it:

    - critical (2): a dependency is stalled, unknown or unread (the last refresh failed), a partition is
      breached (a payment waited past AML_MAX_WAIT), the worker's gate distrusts a row (closed there
      whatever the watermark), or the worker's refresh is stuck or failing;
    - warning (1): a dependency lags, or a payment keeps failing and is retried;
    - unknown (3): the worker is still recovering its tables, or has no watermark yet (no numbers);
      also what the command exits with when it cannot read its source at all or is misconfigured;
    - ok (0): otherwise.
    """
    if doc.get("recovering"):
        return EXIT_UNKNOWN
    statuses = {d["status"] for d in doc.get("dependencies", [])}
    gate = doc.get("gate") or {}
    refresh = doc.get("refresh") or {}
    if (
        statuses & CRITICAL_STATUSES
        or gate.get("breached_partitions")
        or gate.get("admin_error")
        or gate.get("untrusted_partitions")
        or cut_closed(doc.get("cut"))
        or refresh.get("state") == "stuck"
        or refresh.get("last_error")
    ):
        return EXIT_CRITICAL
    if not doc.get("partitions"):
        return EXIT_UNKNOWN
    if statuses & WARNING_STATUSES or doc.get("retrying"):
        return EXIT_WARNING
    return EXIT_OK


class StatusError(RuntimeError):
    """The source could not be read; the message is the one line the user sees."""


async def fetched_high_watermarks(
    bootstrap: Sequence[str],
    topic: str,
    starts: Mapping[int, int],
    timeout: float,
    security: KafkaSecurity,
) -> dict[int, int]:
    """The log ends as fetch responses report them (one small fetch per partition).

    ListOffsets is the log end on Apache Kafka, but Tansu answers it with the last record batch's base
    offset + 1; the high watermark of a fetch response is right on both. Partitions that do not answer
    within `timeout` are left out (the ListOffsets value stands).
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=list(bootstrap),
        enable_auto_commit=False,
        fetch_max_wait_ms=50,
        max_partition_fetch_bytes=1024,
        request_timeout_ms=int(timeout * 1000),
        **aiokafka_kwargs(security),
    )
    await start_within(consumer.start, consumer.stop, timeout, "the log-end reader")
    try:
        tps = {p: TopicPartition(topic, p) for p in starts}
        consumer.assign(list(tps.values()))
        for p, tp in tps.items():
            consumer.seek(tp, max(starts[p], 0))
        found: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while len(found) < len(tps) and time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=100)
            for p, tp in tps.items():
                high = consumer.highwater(tp)
                if high is not None:
                    found[p] = high
        return found
    finally:
        await close_within(consumer.stop(), timeout, "stopping the log-end reader")


async def from_broker(settings: Settings, timeout: float) -> dict[str, Any]:
    """The table from committed offsets and log ends alone (no waits, in-flight offsets or stalls)."""
    reader = DependencyOffsets(
        settings.kafka.bootstrap_servers,
        settings.kafka.payments_topic,
        settings.depends_on,
        request_timeout=timeout,
        security=settings.kafka.security,
        derived=settings.derived_dependencies,
    )
    servers = ",".join(settings.kafka.bootstrap_servers)
    try:
        reading = await reader.read_all(settings.app_id)
        assert reading.log_ends is not None
        highwaters = await fetched_high_watermarks(
            settings.kafka.bootstrap_servers,
            settings.kafka.payments_topic,
            reading.log_ends,
            timeout,
            security=settings.kafka.security,
        )
    except OffsetReadError as exc:
        raise StatusError(f"cannot read offsets from the Kafka cluster at {servers}: {exc}") from exc
    except Exception as exc:
        raise StatusError(
            f"cannot read offsets from the Kafka cluster at {servers}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        await reader.close()
    now = time.time()
    rows = build_rows(
        reading.partitions,
        reading.committed,
        refreshed_at=now,
        log_ends=reading.log_ends,
        service_committed=reading.service_committed,
        log=reading.log,
    )
    # One reading cannot tell when an offset last moved.
    rows = {p: replace(row, advanced_at=dict.fromkeys(row.advanced_at)) for p, row in rows.items()}
    limits = Limits.of(settings.gate)
    view = describe(rows, settings.depends_on, now, limits, highwaters=highwaters)
    return {
        "source": "broker",
        "bootstrap_servers": list(settings.kafka.bootstrap_servers),
        "app_id": settings.app_id,
        "topic": settings.kafka.payments_topic,
        "depends_on": list(settings.depends_on),
        "recovering": False,
        **view,
        "generated_at": now,
    }


def worker_json_url(url: str) -> str:
    """`127.0.0.1:6066`, `http://host:6066/` or the full `.../watermarks.json` all name the same view."""
    url = url.strip()
    if "://" not in url:
        url = f"http://{url}"
    return url if url.endswith("/watermarks.json") else url.rstrip("/") + "/watermarks.json"


async def from_worker(url: str, timeout: float, token: str = "") -> dict[str, Any]:
    """A running worker's `/watermarks.json`, as it is (asked with `token`, AML_WEB_TOKEN, if any)."""
    target = worker_json_url(url)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                target, headers=bearer(token), timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response,
        ):
            if response.status != 200:
                body = (await response.text())[:200]
                raise StatusError(f"the worker at {target} answered HTTP {response.status}: {body}")
            doc = await response.json()
    except StatusError:
        raise
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        reason = str(exc) or type(exc).__name__
        raise StatusError(f"cannot reach the worker at {target}: {reason}") from exc
    return {"source": "worker", **doc}


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _ago(then: float | None, now: float) -> str:
    if then is None:
        return "-"
    seconds = max(0.0, now - then)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns separated by two spaces, like Kafka's own tools."""
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows, strict=True)]
    return [
        "  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
        for line in (header, *rows)
    ]


def render(doc: Mapping[str, Any]) -> str:
    """The human table of a status document (from the broker or from a worker)."""
    now = doc["generated_at"]
    at = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if doc["source"] == "broker":
        origin = f"read from the Kafka cluster at {','.join(doc['bootstrap_servers'])}"
    else:
        origin = f"as worker {doc['worker']} sees it" + (" (the leader)" if doc.get("is_leader") else "")
    lines = [f"topic {doc['topic']}, service group {doc['app_id']}: {origin}, {at}"]
    if doc.get("recovering"):
        return "\n".join([*lines, "the worker is still recovering its tables: no numbers yet"])
    failing = (doc.get("refresh") or {}).get("last_error")
    if failing:
        lines.append(f"this worker's last offset refresh failed: {failing}")
    if not doc["partitions"]:
        return "\n".join([*lines, "no watermark yet: the leader has not written the table"])
    groups = list(doc["depends_on"])
    header = ["PARTITION", "LOG-END", "COMMITTED", "IN-FLIGHT", *groups]
    header += ["WATERMARK", "WAITING", "WAITING-AT", "BLOCKED-SINCE", "BOTTLENECK"]
    rows = [
        [
            _cell(p["partition"]),
            _cell(p["log_end"]),
            _cell(p["service_committed"]),
            _cell(p["in_flight"]),
            *(_cell(p["dependencies"].get(g)) for g in groups),
            _cell(p["watermark"]),
            _cell(p["payments_waiting"]),
            _cell(p["waiting_offset"]),
            _ago(p["blocked_since"], now),
            ",".join(p["bottleneck"]),
        ]
        for p in doc["partitions"]
    ]
    deps = [
        [d["group"], d["status"], _cell(d["lag"]), _ago(d["last_advance"], now), d["detail"]]
        for d in doc["dependencies"]
    ]
    gate = doc.get("gate") or {}
    lines += ["", *_table(header, rows), ""]
    lines += _table(["DEPENDENCY", "STATUS", "LAG", "LAST-ADVANCE", "DETAIL"], deps)
    if gate.get("admin_error"):
        lines += ["", f"last offset refresh failed: {gate['admin_error']}"]
    if gate.get("breached_partitions"):
        lines += [
            "",
            f"breached: payments have waited longer than AML_MAX_WAIT ({gate['max_wait_s']:g} s) on "
            f"{plural_partitions(gate['breached_partitions'])}, the longest {gate['longest_wait_s']:.0f} s",
        ]
    untrusted = [p for p in doc["partitions"] if p.get("untrusted")]
    if untrusted:
        lines += ["", "the gate distrusts these rows and stays closed there, whatever their watermark:"]
        lines += [f"  partition {p['partition']}: {p['untrusted']}" for p in untrusted]
    cut = doc.get("cut")
    if cut and cut.get("untrusted"):
        lines += ["", f"event-time cut distrusted, the gate admits nothing: {cut['untrusted']}"]
    if cut and cut.get("unread"):
        lines += [
            "",
            f"event-time cut: {plural_partitions(cut['unread'])} could not be read; the gate admits nothing",
        ]
    if cut and cut.get("held_by") is not None:
        lines += [
            "",
            f"event-time cut: payments before {cut['frontier_at']} pass (held by partition {cut['held_by']})",
        ]
    retrying = doc.get("retrying") or []
    if retrying:
        lines += [
            "",
            "retrying (a payment whose handler or decision keeps failing; nothing behind it is acked):",
        ]
        lines += _table(
            ["PARTITION", "OFFSET", "PAYMENTS", "ATTEMPTS", "SINCE", "WORKER", "ERROR"],
            [
                [
                    _cell(r["partition"]),
                    _cell(r["offset"]),
                    _cell(r["payments"]),
                    _cell(r["attempts"]),
                    _ago(r["since"], now),
                    r["worker"],
                    r["error"],
                ]
                for r in retrying
            ],
        )
    return "\n".join(lines)


@click.command("status")
@click.option(
    "--worker",
    "worker_url",
    metavar="URL",
    default=None,
    help="Ask a running worker (e.g. 127.0.0.1:6066) instead of the broker; adds waits and stalls.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON document instead of the table.")
@click.option(
    "--timeout",
    type=TIMEOUT,
    default=5.0,
    show_default=True,
    help="Seconds to wait for answers.",
)
def status_command(worker_url: str | None, as_json: bool, timeout: float) -> None:
    """Show the watermark table: log ends, committed offsets, watermarks, waits, dependency status.

    Exits 0 when all is well, 1 when a dependency lags or a payment is retried, 2 when a dependency is
    stalled, unknown or unread, a partition is breached, the gate distrusts a row or the refresh is stuck
    or failing, 3 when the source cannot be read, a setting is wrong, or there are no numbers yet."""
    from aml_app.settings import ConfigError, load_settings

    # The Kafka client logs every failed connection attempt; the one line below says it all.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        settings = load_settings()
    except ConfigError as exc:  # a check that cannot run says unknown, not critical
        click.echo(f"aml-app status: configuration error: {exc}", err=True)
        sys.exit(EXIT_UNKNOWN)
    try:
        if worker_url:
            doc = asyncio.run(from_worker(worker_url, timeout, settings.web.token))
        else:
            doc = asyncio.run(from_broker(settings, timeout))
    except StatusError as exc:
        click.echo(f"aml-app status: {exc}", err=True)
        sys.exit(EXIT_UNKNOWN)
    click.echo(json.dumps(doc, indent=2) if as_json else render(doc))
    sys.exit(health_code(doc))
