"""Where a Python process's CPU goes: py-spy's samples of the system's own processes, by function.

The capacity benchmark measures each process's CPU per payment; this says which functions inside the
workers, the API replicas and the pipeline's driver spend it, so the next cut is chosen from a
measurement. py-spy samples each process from outside (no code in the process, no restart) at `RATE`
samples a second for the step's measured part, only the thread that holds the GIL (`--gil`): a thread
blocked on a socket, PostgreSQL or the JVM, or runnable but not running on a busy machine, is not
counted, so the shares are of the Python code the process ran (C that releases the GIL, like Arrow's
readers, is not in them). Samples whose innermost frame is a wait (`IDLE`) are counted apart. A
function's share times its process's CPU per payment (from the same step) estimates what it costs a
payment: within the sampling error (about 1 / sqrt of its samples), and taking the C that runs without
the GIL to be spread like the rest.
"""

from __future__ import annotations

import asyncio
import collections
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from aml_app.harness.child_process import installed_executable

#: Samples a second per process: enough for shares of a few percent over a minute.
RATE = 50
#: Frames a thread waits in: a sample whose innermost frame is one of these is idle, not CPU.
IDLE = (
    "select (selectors.py",
    "_worker (concurrent/futures/thread.py",
    "wait (threading.py",
    "get (queue.py",
    "_wait_for_tstate_lock (threading.py",
)
#: Files of the frames under every sample (the event loop, the command line, a thread's start): their
#: inclusive share is the process's, so they are left out of the inclusive figures.
PLUMBING = (
    "(asyncio/base_events.py",
    "(asyncio/events.py",
    "(asyncio/runners.py",
    "(threading.py",
    "(click/",
    "(faust/cli/",
    "(mode/worker.py",
    "(aml_app/cli.py",
    "(aml-app",
    "(runpy.py",
    "App.main (faust/app/base.py",
    "run_app (aiohttp/web.py",
    "serve (aml_app/dependencies/api.py",
)
#: Functions and files kept per process, by inclusive share.
SHOWN = 60


def available() -> str | None:
    """The py-spy executable, or None (it is a development dependency: `pip install py-spy`)."""
    return installed_executable("py-spy")


async def record(pids: Mapping[str, int], seconds: float, rate: int = RATE) -> dict[str, dict[str, Any]]:
    """Sample every process of `pids` (name -> pid) at once for `seconds`; per process its `summary`, or
    {"error": why} for one py-spy could not sample (it needs ptrace rights over the process)."""
    exe = available()
    if exe is None:
        raise RuntimeError("py-spy is not installed: pip install py-spy (aml-app's dev extra has it)")
    with tempfile.TemporaryDirectory(prefix="py-spy-") as tmp:
        runs = {}
        for name, pid in pids.items():
            out = Path(tmp) / f"{pid}.txt"
            duration = str(max(1, round(seconds)))
            proc = await asyncio.create_subprocess_exec(
                exe, "record", "--pid", str(pid), "--rate", str(rate), "--duration", duration,
                "--gil", "--format", "raw", "--output", str(out),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            runs[name] = (proc, out)
        found: dict[str, dict[str, Any]] = {}
        for name, (proc, out) in runs.items():
            try:
                _, err = await asyncio.wait_for(proc.communicate(), seconds + 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                found[name] = {"error": f"py-spy did not finish within {seconds + 30:g} s"}
                continue
            if proc.returncode != 0 or not out.exists():
                why = err.decode(errors="replace").strip()[-300:]
                found[name] = {"error": why or f"py-spy exited with {proc.returncode}"}
                continue
            found[name] = summary(out.read_text().splitlines())
    return found


def _function(frame: str) -> str:
    """A frame as py-spy writes it, `name (file:line)`, without its line: one entry per function."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def summary(lines: Iterable[str]) -> dict[str, Any]:
    """py-spy's raw output (one `frame;frame;... count` line per distinct stack) summed per function:
    `busy` (samples that ran code) and `idle`, and per function its share of the busy samples,
    inclusive (it or what it called was running; `PLUMBING` left out) and self (it was running), and per
    source file the share of samples with one of its functions on the stack (`files`)."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    busy = idle = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        if any(marker in frames[-1] for marker in IDLE):
            idle += n
            continue
        busy += n
        own[_function(frames[-1])] += n
        functions = {f for f in map(_function, frames) if not any(m in f for m in PLUMBING)}
        for function in functions:
            inclusive[function] += n
        for file in {f.rpartition(" (")[2].rstrip(")") for f in functions if " (" in f}:
            files[file] += n
    share = (lambda n: round(n / busy, 4)) if busy else (lambda n: 0.0)
    return {
        "busy": busy,
        "idle": idle,
        "inclusive": {f: share(n) for f, n in inclusive.most_common(SHOWN)},
        "self": {f: share(n) for f, n in own.most_common(SHOWN)},
        "files": {f: share(n) for f, n in files.most_common(SHOWN)},
    }


def per_payment(
    profile: Mapping[str, Any], us_per_payment: float | None, shares: str = "inclusive"
) -> dict[str, float]:
    """A process's functions (`shares`: "inclusive", "self" or "files") in µs of CPU a payment: their
    shares of its `us_per_payment`."""
    if us_per_payment is None or shares not in profile:
        return {}
    return {f: round(s * us_per_payment, 1) for f, s in profile[shares].items()}
