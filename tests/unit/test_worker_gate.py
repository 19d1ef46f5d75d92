"""The gate of a worker is one service of the Faust app, not state spread over a module."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import asyncio, json
from aml_app.tables import watermarks as w

closed = []


async def close(name):
    closed.append(name)


w.worker_gate.offsets.close = lambda: close("offsets")
w.worker_gate.unapplied.close = lambda: close("unapplied")


class Consumer:
    def stop(self):
        closed.append("lanes")


w.worker_gate.register(Consumer())


async def main():
    await w.worker_gate.start()
    running = sorted(t.fun.__name__ for t in w.worker_gate._get_tasks())
    await w.worker_gate.stop()
    return running


timers = asyncio.run(main())
left = [n for n in ("gate", "offsets", "unapplied", "status", "publisher", "refresh_errors") if hasattr(w, n)]
print(json.dumps([w.worker_gate in w.app._extra_services, timers, closed, left]))
"""


def test_the_worker_gate_is_a_service_the_app_starts_and_stopping_it_closes_its_clients() -> None:
    """Registered with the app (started after table recovery, stopped with it), it runs the refresh,
    demand and stall timers; when it stops, it stops the lanes and closes the leader's Kafka clients.
    The module holds the tables and the policy, and no gate, reader, status or publisher of its own.
    In a fresh interpreter: importing the tables builds the app."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    registered, timers, closed, left = json.loads(out.stdout.strip().splitlines()[-1])
    assert registered
    assert timers == ["publish_demand", "refresh_watermarks", "watch_stalls"]
    assert closed == ["lanes", "offsets", "unapplied"]
    assert left == []
