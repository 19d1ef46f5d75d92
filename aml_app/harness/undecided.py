"""What the demo knows about payments a service never decided, written when its drain runs out of time.

A payment left undecided is either stuck in a worker (its lane holds it, or the worker never fetched it)
or decided and never read back by the demo's reader of the decisions topic. Which one is told apart by
the service's committed offsets (a worker acks a payment only once its decision is sent), a second, fresh
read of the decisions topic, and each worker's own view (`/watermarks.json`: what every lane processed,
holds in flight and fetches). The demo writes it all to `undecided.json` in its folder and prints a line
per service.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from aml_app.harness.report import say
from aml_app.harness.system import service_settings
from aml_app.harness.tails import RecordTail

if TYPE_CHECKING:
    from aml_app.harness.demo import Demo

#: The worker state fields that say where a partition's payments are.
WORKER_FIELDS = (
    "assigned",
    "processed",
    "in_flight",
    "waiting",
    "blocked_since",
    "fetching",
    "retrying",
    "handler_failures",
    "refetches",
    "holes_refetched",
    "gaps_accepted",
    "parked",
    "payments_handled",
)
#: Offsets listed per partition at most (the count says how many there are).
LISTED = 20
#: Seconds without a new record after which the second read of the decisions topic ends.
QUIET_S = 2.0
#: The longest the second read takes in all.
READ_DEADLINE_S = 30.0
#: The longest the whole report takes.
REPORT_DEADLINE_S = 120.0


def by_partition(places: Iterable[tuple[int, int]]) -> dict[str, dict[str, Any]]:
    """Undecided (partition, offset) places per partition: how many, the first and last offset, and the
    first `LISTED` offsets."""
    offsets: dict[int, list[int]] = {}
    for p, o in places:
        offsets.setdefault(p, []).append(o)
    return {
        str(p): {"count": len(os), "first": min(os), "last": max(os), "offsets": sorted(os)[:LISTED]}
        for p, os in sorted(offsets.items())
    }


def acked_past(places: Iterable[tuple[int, int]], committed: Mapping[int, int]) -> int:
    """How many of the places the service's group has committed past (its worker acked them)."""
    return sum(1 for p, o in places if committed.get(p, 0) > o)


async def payment_ids_in(bootstrap: Sequence[str], topic: str, wanted: set[str]) -> set[str]:
    """Which of `wanted` a fresh read of `topic` from its start finds as `payment_id`s: the read ends
    after `QUIET_S` seconds without a new record, or after `READ_DEADLINE_S`."""
    tail = RecordTail(bootstrap, topic)
    await asyncio.wait_for(tail.start(expected_partitions=1), READ_DEADLINE_S)
    reading = asyncio.create_task(tail.run())
    try:
        deadline = time.monotonic() + READ_DEADLINE_S
        seen, quiet_since = 0, time.monotonic()
        while time.monotonic() - quiet_since < QUIET_S and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            if len(tail.records) > seen:
                seen, quiet_since = len(tail.records), time.monotonic()
    finally:
        tail.halt()
        await asyncio.wait_for(reading, READ_DEADLINE_S)
        await asyncio.wait_for(tail.stop(), READ_DEADLINE_S)
    return tail.distinct(wanted)


def worker_view(state: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The fields of a worker's `/watermarks.json` that say where its partitions' payments are."""
    if state is None:
        return None
    detector = state.get("detector") or {}
    return {
        **{k: state.get(k) for k in WORKER_FIELDS},
        "decisions": detector.get("decisions"),
        "refresh": state.get("refresh"),
    }


async def report(demo: Demo) -> dict[str, Any]:
    """Per service with undecided payments: where they are, how many its group acked, how many a fresh
    read of its decisions topic finds, and its workers' views; written to `undecided.json` in the folder
    of the demo whose drain ran out of time."""
    system, ledger = demo.system, demo.ledger
    ids = ledger.ids()
    found: dict[str, Any] = {}
    for service, tail in system.decisions.items():
        seen = tail.distinct(ids)
        places = [(p, o) for (p, o), sent in ledger.valid.items() if sent.payment_id not in seen]
        if not places:
            continue
        wanted = {ledger.valid[place].payment_id for place in places}
        group = service_settings(demo.settings, service, system.layout.suffix).app_id
        committed = await demo.committed_on(demo.settings.kafka.payments_topic, group)
        in_topic = await payment_ids_in(system.bootstrap, tail.topic, wanted)
        workers = {w.worker_id: worker_view(await w.state()) for w in system.workers.get(service, [])}
        found[service] = {
            "undecided": by_partition(places),
            "acked_by_group": acked_past(places, committed),
            "committed": {str(p): o for p, o in sorted(committed.items())},
            "log_ends": {str(p): o for p, o in sorted(ledger.ends.items())},
            "decided_in_topic_not_read": len(in_topic),
            "workers": workers,
        }
        parts = found[service]["undecided"].items()
        where = ", ".join(f"p{p}: {v['count']} from {v['first']}" for p, v in parts)
        say(
            f"{service}: {len(places)} undecided ({where}); {found[service]['acked_by_group']} acked by its "
            f"group, {len(in_topic)} decided in the topic and not read"
        )
    path = system.folder / "undecided.json"
    path.write_text(json.dumps(found, indent=1, default=str))
    say(f"where the undecided payments are: {path}")
    return found
