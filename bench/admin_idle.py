"""Admin load when nothing waits: the refresh is demand-driven, so it should fall to the slow interval.

Starts 1 and then 3 workers on an idle topic (dependencies far ahead, no payments arriving) and samples
the admin-request counters over a window, next to the same window with one payment blocked (demand).
The workers refresh on the default intervals (`Settings`), not the tests' shorter ones.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from aml_app.kafka.tools import produce
from aml_app.settings import Settings
from bench.common import (
    admin_requests,
    bench_env,
    code_version,
    machine,
    markdown_table,
    wait_owned,
    write_results,
)
from tests.harness import payments_for

#: The deployment's defaults, in place of the tests' (`tests.harness.TEST_ENV`).
INTERVALS = {
    "AML_REFRESH_INTERVAL": str(Settings().gate.refresh_interval),
    "AML_FAST_REFRESH_INTERVAL": str(Settings().gate.fast_refresh_interval),
}


async def sample(env, workers, window: float) -> float:
    """Admin requests per second, summed over the workers, over `window` seconds."""
    before = await admin_requests(workers)
    await asyncio.sleep(window)  # the measurement window itself
    after = await admin_requests(workers)
    return (after["admin_requests"] - before["admin_requests"]) / (after["at"] - before["at"])


async def one(env, count: int, window: float) -> dict[str, Any]:
    names = await env.fresh_names(4)
    workers = [env.start_worker(names, **INTERVALS) for _ in range(count)]
    await wait_owned(workers, 4)
    idle = await sample(env, workers, window)
    # One payment on partition 0 that no dependency has reached: the gate waits, demand appears.
    await produce(env.producer, names.payments, payments_for(4, 1, "idle")[:1])
    await asyncio.sleep(2)  # let the worker fetch it and publish its demand before sampling
    waiting = await sample(env, workers, window)
    await env.stop_workers(workers)
    return {"workers": count, "idle_req_s": round(idle, 2), "waiting_req_s": round(waiting, 2)}


async def main(window: float) -> None:
    async with bench_env() as env:
        rows = [await one(env, count, window) for count in (1, 3)]
    doc = {
        "code": code_version(),
        "machine": machine(),
        "window_s": window,
        "intervals": INTERVALS,
        "runs": rows,
        "at": time.time(),
    }
    write_results("admin_idle", doc)
    print(
        markdown_table(
            ["workers", "admin req/s, nothing waits", "admin req/s, one payment waiting"],
            [[r["workers"], r["idle_req_s"], r["waiting_req_s"]] for r in rows],
        )
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--window", type=float, default=15.0)
    asyncio.run(main(parser.parse_args().window))


if __name__ == "__main__":
    cli()
