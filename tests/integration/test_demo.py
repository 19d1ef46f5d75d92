"""`aml-app demo` as a user runs it: its own embedded broker, the Spark pipeline (Services B and C) and their
APIs as subprocesses, the AML and fraud workers gated on the pipeline's consumer groups, the simulator.

The demo checks the gate itself (no decision before both services' groups committed past it, dated from
the broker; no freshness violation), that both services caught up with the log, that every service
dead-lettered every malformed record, that the APIs answer for a few payments, and scores the AML alerts
against the simulator's ground truth; this test reads the verdict from its summary. The scripted crash and
outage runs are in test_end_to_end.py. Spark takes ~25 s to start and ~10 s more for its first batch, so
the traffic is kept short.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from aml_app.kafka.broker import free_port
from tests.harness import AML_APP

pytestmark = pytest.mark.integration

TIMEOUT = 420


def run_demo(cwd: Path, *args: str) -> tuple[int, str]:
    """Run the demo; on a hang, SIGTERM it first so it stops the processes and the broker it started."""
    env = {k: v for k, v in os.environ.items() if k not in {"KAFKA_BOOTSTRAP_SERVERS", "AML_DEPENDS_ON"}}
    for variable in ("AML_BROKER_PORT", "AML_WEB_PORT", "AML_RELATIONS_PORT", "AML_AGGREGATES_PORT"):
        env[variable] = str(free_port())
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
            out, _ = process.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
        pytest.fail(f"the demo did not finish within {TIMEOUT}s; output:\n{out}")
    return process.returncode, out


@pytest.mark.timeout(TIMEOUT + 120)  # above the suite's 300 s: Spark alone may take minutes on a busy CI box
def test_demo_on_the_real_services_decides_every_payment_and_none_prematurely(tmp_path: Path) -> None:
    code, out = run_demo(tmp_path, "--duration", "25", "--rate", "40")
    folder = tmp_path / "var" / "demo"
    pipeline_log = (folder / "pipeline.log").read_text(errors="replace") if folder.exists() else ""
    context = f"{out}\n--- pipeline.log (end) ---\n{pipeline_log[-4000:]}"
    assert code == 0, context
    produced = re.search(r"payments produced\s+(\d+) \(valid (\d+), malformed (\d+)\)", out)
    assert produced, context
    total, valid, malformed = map(int, produced.groups())
    assert valid > 0 and malformed > 0 and total == valid + malformed
    m = malformed
    for service in ("aml", "fraud"):
        decided = re.search(rf"{service} decisions\s+(\d+) payments \((\d+) records, (\d+) missing\)", out)
        assert decided and decided.groups() == (str(valid), str(valid), "0"), context
        assert re.search(rf"{service} alerts\s+\d+ payments \(0 alerted twice\)", out), context
        assert re.search(rf"{service} premature\s+0 decisions before their dependencies", out), context
        assert re.search(rf"{service} freshness\s+0 violations, 0 decided not fresh", out), context
    # Each service dead-letters every malformed record itself: four copies, one per service.
    assert re.search(rf"dead-lettered\s+{m} by aml, {m} by fraud, {m} by relations, {m} by aggregates", out)
    # Both Spark queries committed their groups to the end of everything produced.
    for group in ("relations", "aggregates"):
        assert re.search(rf"{group}\s+committed {total} of {total} offsets: reached the log end", out), (
            context
        )
    # The wait is split where the dependencies' commits cover a payment: their part, then each service's.
    committed = re.search(r"dependencies\s+committed p50 (\d+) ms, p99 (\d+) ms after produced", out)
    assert committed, context
    for service in ("aml", "fraud"):
        share = re.search(rf"{service} after commits\s+p50 (-?\d+) ms, p99 (-?\d+) ms", out)
        whole = re.search(rf"{service} end-to-end\s+p50 (\d+) ms, p99 (\d+) ms", out)
        assert share and whole, context
        assert 0 <= int(share.group(1)) < int(whole.group(1)), context
        assert int(committed.group(1)) < int(whole.group(1)), context
    assert re.search(r"API spot check\s+5 of 5 payments OK", out), context
    assert re.search(r"result\s+OK", out), context
    # Every injected typology was caught, and every alert is on a laundering payment (patterns overlap, so
    # an alert may name another of them: a bipartite block's payee is a fan-in too).
    for typology in ("structuring", "fan_in", "fan_out", "cycle", "pass_through"):
        row = re.search(rf"{typology}\s+(\d+)\s+(\d+)\s+1\.000\s+(\d+)\s+", out)
        assert row and int(row.group(1)) >= 1, f"{typology}:\n{context}"
    assert re.search(
        r"payments: \d+ laundering, (\d+) flagged, \1 of them laundering; precision 1\.000", out
    ), context
    ground_truth = folder / "ground-truth.jsonl"
    assert ground_truth.exists() and len(ground_truth.read_text().splitlines()) >= 5
    # The pipeline really ran its batches, and was stopped (not killed) at the end.
    assert re.search(r"relations batch \d+: \d+ records", pipeline_log), pipeline_log[-4000:]
    assert re.search(r"aggregates batch \d+: \d+ records", pipeline_log), pipeline_log[-4000:]
    assert "pipeline stopped" in pipeline_log, pipeline_log[-4000:]
    assert (folder / "worker-aml-0.log").exists() and (folder / "worker-fraud-0.log").exists()
    assert (folder / "relations-api.log").exists() and (folder / "aggregates-api.log").exists()
