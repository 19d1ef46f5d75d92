"""The long-running processes keep their start-up heap out of the cycle collector's scans
(`aml_app.collector`). Each check runs in a process of its own: freezing changes the whole process."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_settle_freezes_the_heap_and_still_collects_later_cycles() -> None:
    out = run(
        """
        import gc
        from aml_app.collector import YOUNG, settle
        assert gc.get_freeze_count() == 0
        settle()
        assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
        assert gc.get_threshold()[0] == YOUNG
        class Node: pass
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle built after start-up, then dropped
        del a, b
        print(gc.collect())
        """
    )
    assert int(out) >= 2


def test_a_worker_settles_once_started() -> None:
    out = run(
        """
        import asyncio, gc
        from aml_app.faust_internals import FetchWaitApp
        async def started(self): pass
        FetchWaitApp.on_started = started  # Faust's own start-up is not what this checks
        from aml_app.app import app
        before = gc.get_freeze_count()
        asyncio.run(app.on_started())
        print(before, gc.get_freeze_count())
        """
    )
    before, after = map(int, out.split())
    assert before == 0 and after > 1000


def test_an_api_replica_settles_after_its_store_pools_open() -> None:
    out = run(
        """
        import asyncio, gc
        from aiohttp import web
        from aml_app.dependencies import api
        from aml_app.settings import load_settings
        served = []
        web.run_app = lambda app, **_: served.append(app)
        api.serve("aggregates", load_settings({}))
        (app,) = served
        startup = list(app.on_startup)
        assert startup[-1] is api._settled, startup  # after the cleanup context that opens the pools
        asyncio.run(api._settled(app))
        print(gc.get_freeze_count())
        """
    )
    assert int(out.splitlines()[-1]) > 1000
