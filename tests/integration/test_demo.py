"""`aml-app demo` end to end: its own embedded broker, a real worker, simulated dependencies.

The demo checks the gate itself (no decision before every dependency committed past it); this test
runs it as a user would and reads the verdict from its summary.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from aml_app.broker import free_port
from tests.harness import AML_APP

pytestmark = pytest.mark.integration

TIMEOUT = 240


def run_demo(cwd: Path, *args: str) -> tuple[int, str]:
    """Run the demo; on a hang, SIGTERM it first so it stops the worker and broker it started."""
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env["AML_BROKER_PORT"] = str(free_port())
    env["AML_WEB_PORT"] = str(free_port())
    process = subprocess.Popen(
        [AML_APP, "demo", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            out, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
        pytest.fail(f"the demo did not finish within {TIMEOUT}s; output:\n{out}")
    return process.returncode, out


def test_demo_decides_every_valid_payment_and_none_prematurely(tmp_path: Path) -> None:
    code, out = run_demo(tmp_path, "--duration", "15", "--rate", "30")
    assert code == 0, out
    assert re.search(r"premature decisions\s+0\n", out), out
    produced = re.search(r"payments produced\s+(\d+) \(valid (\d+), malformed (\d+)\)", out)
    pattern = r"decisions\s+(\d+) distinct payment ids \((\d+) records, (\d+) missing\)"
    decided = re.search(pattern, out)
    assert produced and decided, out
    total, valid, malformed = map(int, produced.groups())
    assert valid > 0 and malformed > 0 and total == valid + malformed
    assert int(decided.group(1)) == valid, out
    assert int(decided.group(3)) == 0, out
    assert re.search(rf"dead-lettered\s+{malformed}\b", out), out
    assert (tmp_path / "var" / "demo" / "worker-0.log").exists()
