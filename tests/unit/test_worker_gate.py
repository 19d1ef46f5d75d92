"""The gate of a worker is one service of the Faust app, not state spread over a module."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import asyncio, json
from aml_app.tables import watermarks as w

worker_gate = w.gate_service()
closed = []


async def close(name):
    closed.append(name)


worker_gate.offsets.close = lambda: close("offsets")
worker_gate.unapplied.close = lambda: close("unapplied")


class Consumer:
    def stop(self):
        closed.append("lanes")


worker_gate.register(Consumer())


async def main():
    await worker_gate.start()
    running = sorted(t.fun.__name__ for t in worker_gate._get_tasks())
    await worker_gate.stop()
    return running


timers = asyncio.run(main())
left = [
    n for n in ("worker_gate", "gate", "offsets", "unapplied", "status", "publisher", "refresh_errors")
    if hasattr(w, n)
]
print(json.dumps([worker_gate in w.app._extra_services, timers, closed, left]))
"""


def test_the_worker_gate_is_a_service_the_app_starts_and_stopping_it_closes_its_clients() -> None:
    """Registered with the app (started after table recovery, stopped with it), it runs the refresh,
    demand and stall timers; when it stops, it stops the lanes and closes the leader's Kafka clients.
    The module holds the tables and the policy, and no gate, reader, status or publisher of its own:
    importing it builds none (`gate_service` does). In a fresh interpreter: importing the tables builds
    the app."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    registered, timers, closed, left = json.loads(out.stdout.strip().splitlines()[-1])
    assert registered
    assert timers == ["publish_demand", "refresh_watermarks", "watch_refresh", "watch_stalls"]
    assert closed == ["lanes", "offsets", "unapplied"]
    assert left == []


HANG = """
import asyncio, contextlib, json, os, time
from aml_app.gate.watermark import RefreshPolicy
from aml_app.kafka.offsets import Reading
from aml_app.tables import watermarks as w


class Short(RefreshPolicy):
    @property
    def refresh_deadline(self):
        return 0.3


w.refresh = Short(1.0, 0.1, 30)
gate = w.gate_service()
gate.changelogs.known = True
w.app.is_leader = lambda: True
written = []
gate._write_rows = lambda rows: written.append(sorted(rows))
release = asyncio.Event()
groups = w.settings.depends_on


async def hang(*args, **kwargs):
    # An admin read that never answers and swallows its cancellation, as aiokafka's fetcher can.
    while not release.is_set():
        with contextlib.suppress(asyncio.CancelledError):
            await release.wait()
    return Reading([0], {g: {0: 5} for g in groups}, log="cluster:topic")


async def cancelled_under(*args, **kwargs):
    # A client closed under the read: a future the read awaits is cancelled by code it does not own,
    # as aiokafka's are when a broker froze mid-request.
    pending = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, pending.cancel)
    return await pending


async def answer(*args, **kwargs):
    return Reading([0], {g: {0: 7} for g in groups}, log="cluster:topic")


async def main():
    refresh = type(gate).refresh_watermarks.fun.__wrapped__
    first = gate.offsets
    first.read_all = {"hang": hang, "cancelled": cancelled_under}[os.environ["READ"]]
    timer = asyncio.ensure_future(refresh(gate))
    done, _ = await asyncio.wait({timer}, timeout=20)
    result = {
        "returned": bool(done) and not timer.cancelled() and timer.exception() is None,
        "overruns": gate.watchdog.overruns,
        "last_outcome": gate.watchdog.last_outcome.value if gate.watchdog.last_outcome else None,
        "error": gate.status.last_error,
        "new_clients": gate.offsets is not first,
    }
    release.set()  # the abandoned read answers at last: its reading must not be written
    for _ in range(50):
        await asyncio.sleep(0.01)
    result["written_by_the_abandoned_read"] = list(written)
    gate.offsets.read_all = answer
    token = gate._attempt = object()
    result["next_outcome"] = (await gate.refresh_once(time.monotonic(), token)).value
    result["written"] = list(written)
    return result


print(json.dumps(asyncio.run(main())))
"""


@pytest.mark.parametrize(
    ("read", "sentence"),
    [
        ("hang", "took longer than 0.3 s and was abandoned"),
        ("cancelled", "the watermark refresh was cancelled by the code it called and was abandoned"),
    ],
)
def test_a_refresh_whose_admin_call_hangs_or_is_cancelled_under_it_is_abandoned(
    read: str, sentence: str
) -> None:
    """An admin read that never returns and swallows its cancellation (aiokafka's fetcher did; the
    leader's refresh then never ran again), or one that a client cancels under it (aiokafka's futures
    after a broker froze mid-request; as a `CancelledError` it would end the refresh timer for good, and
    the watchdog would stop the worker): the refresh timer returns, counts an overrun with its
    sentence, and starts over with new Kafka clients; nothing of the abandoned read is written; the next
    refresh, with clients that answer, writes."""
    env = {**os.environ, "AML_GATE_MODE": "partition", "READ": read}
    out = subprocess.run(
        [sys.executable, "-c", HANG], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["returned"], "the refresh timer hung on the admin call, or ended with its error"
    assert result["overruns"] == 1 and result["last_outcome"] == "overran"
    assert sentence in result["error"]
    assert result["new_clients"]
    assert result["written_by_the_abandoned_read"] == []
    assert result["next_outcome"] == "succeeded" and result["written"] == [[0]]


OVERLAPS = """
import json, logging
from mode.utils.objects import qualname
from aml_app.faust_internals import TIMER_OVERLAPPING
from aml_app.tables import watermarks as w

worker_gate = w.gate_service()
seen = []
handler = logging.Handler()
handler.emit = lambda record: seen.append(record.args[0])
timers = logging.getLogger("mode.timers")
timers.addHandler(handler)
timers.setLevel(logging.WARNING)
for task in worker_gate._get_tasks():  # each of the gate's timers overlaps once, as mode says it
    timers.warning(TIMER_OVERLAPPING, qualname(task.fun), 0.025, 0.04)
print(json.dumps(sorted(name.rsplit(".", 1)[-1] for name in seen)))
"""


def test_only_the_fast_timers_overlapping_is_not_a_warning() -> None:
    """Under load the refresh and the demand (every 25 ms while a payment waits) run back to back, which
    their durations show: mode's warning for each run is dropped. The watchdog's and the stall watch's
    overlaps still warn."""
    out = subprocess.run(
        [sys.executable, "-c", OVERLAPS], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["watch_refresh", "watch_stalls"]


GROUPS = """
import json, time
from aml_app.gate.watermark import build_rows
from aml_app.tables import watermarks as w

gate = w.gate_service()
now, generation = time.time(), w.app.consumer_generation_id
old = build_rows([0], {"relations": {0: 9}, "aggregates": {0: 9}}, now, generation=generation)[0]
new = build_rows([0], {g: {0: 9} for g in w.settings.depends_on}, now, generation=generation)[0]
print(json.dumps([list(w.settings.depends_on), gate.distrusted(old), gate.distrusted(new)]))
"""


def test_a_worker_distrusts_rows_that_do_not_count_a_group_it_depends_on() -> None:
    """A worker restarted with a group added to AML_DEPENDS_ON keeps its gate closed on the rows a
    leader on the old setting writes, and opens it on rows that count every group it depends on."""
    env = {**os.environ, "AML_DEPENDS_ON": "relations,aggregates,risk"}
    out = subprocess.run(
        [sys.executable, "-c", GROUPS], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    groups, old, new = json.loads(out.stdout.strip().splitlines()[-1])
    assert groups == ["relations", "aggregates", "risk"]
    assert old is not None and "does not count group risk" in old
    assert new is None


GROWN = """
import json, time
from aml_app.gate.event_time import Unapplied, cut_row
from aml_app.tables import watermarks as w

gate = w.gate_service()
now, generation = time.time(), w.app.consumer_generation_id
groups = tuple(w.settings.depends_on)
cut = cut_row({0: 8, 1: 8}, {0: Unapplied(8, None), 1: Unapplied(8, None)}, now, generation=generation,
              groups=groups)
seen = []
for count in (None, 2, 3):
    w.app.consumer.topic_partitions = lambda topic, count=count: count
    seen.append(gate.distrusted(cut))
print(json.dumps(seen))
"""


def test_a_worker_distrusts_a_cut_that_misses_partitions_its_consumer_sees() -> None:
    """The topic grew: the worker's consumer sees 3 partitions of `payments`, the leader's cut covers the
    2 it read before; the worker admits nothing on that cut until one covers all 3."""
    env = {**os.environ, "AML_GATE_MODE": "event-time"}
    out = subprocess.run(
        [sys.executable, "-c", GROWN], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    unknown, same, grown = json.loads(out.stdout.strip().splitlines()[-1])
    assert unknown is None and same is None
    assert grown is not None and "the payments topic has 3" in grown
