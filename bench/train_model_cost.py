"""What `aml-app train-model` costs on a long history: a simulated month of about a million payments.

A deployment trains on its own labelled history, and its time and memory grow with it (docs/detection.md,
"Training on a deployment's own history"). This writes one seeded run of the simulator calibrated to
AMLworld (`aml-app simulate-amlworld`), trains on it as a deployment would (`aml-app train-model`, the
history cut by attempt, the defaults otherwise) and records each command's wall time, CPU time and peak
memory (the kernel's accounting of the child process), when each phase of the training began (its
progress lines on stderr), and what the report scores on the part training never read.

    .venv/bin/python -m bench.train_model_cost [--days 28] [--per-hour 1500] [--attempts 150]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import PROJECT, finish, machine, markdown_table

NAME = "train_model_cost"
AML_APP = PROJECT / ".venv" / "bin" / "aml-app"
#: Progress lines within a phase (reading the files, replaying them), printed every few seconds: every
#: other line of stderr starts a phase.
WITHIN = re.compile(r"train-model: (amlworld: reading|replayed) ")


def run(command: list[str]) -> dict[str, Any]:
    """Run `command` to its end; its wall and CPU seconds, peak memory, and its stderr's phase lines,
    each with the second it came at (what it prints on stdout, the report, is read from `--report`)."""
    started = time.monotonic()
    child = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=PROJECT
    )
    assert child.stderr is not None
    phases = []
    for line in child.stderr:
        if not WITHIN.match(line):
            phases.append([round(time.monotonic() - started, 1), line.strip()])
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({child.returncode}): {phases[-3:]}")
    return {
        "wall_s": round(time.monotonic() - started, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "max_rss_mb": round(usage.ru_maxrss / 1024),  # KiB on Linux
        "phases": phases,
    }


def measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    history = folder / "history"
    simulate = run(
        [
            *(str(AML_APP), "simulate-amlworld", str(history), "--seed", str(args.seed)),
            *("--days", str(args.days), "--per-hour", str(args.per_hour), "--attempts", str(args.attempts)),
        ]
    )
    report_path = folder / "report.json"
    train = run(
        [
            *(str(AML_APP), "train-model", str(history / "Trans.csv"), str(history / "Patterns.txt")),
            *("--split", "attempt", "--seed", str(args.train_seed), "--out", str(folder / "model.json")),
            *("--report", str(report_path)),
        ]
    )
    report = json.loads(report_path.read_text())
    return {"simulate": simulate, "train": train, "report": report}


def render(doc: dict[str, Any]) -> str:
    result, info = doc["result"], doc["machine"]
    report = result["report"]
    probe = info["speed_probe_ms_at_start"].values()
    rows = [
        [step, r["wall_s"], r["cpu_s"], r["max_rss_mb"]]
        for step, r in (("simulate-amlworld", result["simulate"]), ("train-model", result["train"]))
    ]
    budgets = [
        [f"{b['budget']:.2%}", b["own_typology"], b["any_alert"], b["benign_alerted"]]
        for b in report["alert_budgets"]
    ] + [["the file's cut", report["own_typology"], report["any_alert"], report["benign"]["alerted"]]]
    return "\n".join(
        [
            f"{NAME}: {report['payments']:,} payments, {report['attempts']} attempts scored; code "
            f"{info['code_at_start']}, load {info['loadavg_at_start'][0]:.1f}, speed probe "
            f"{min(probe)}-{max(probe)} ms",
            markdown_table(["command", "wall s", "CPU s", "peak memory MB"], rows),
            "",
            "phases of train-model (s from its start):",
            *(f"  {at:>7.1f}  {line}" for at, line in result["train"]["phases"]),
            "",
            f"the scored part: {report['benign']['payments']:,} benign payments",
            markdown_table(["budget", "own-typology recall", "any alert", "benign alerted"], budgets),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=37, help="the simulator's seed")
    parser.add_argument("--days", type=float, default=28.0)
    parser.add_argument("--per-hour", type=float, default=1500.0, help="background payments per hour")
    parser.add_argument("--attempts", type=int, default=150, help="attempts of each typology")
    parser.add_argument("--train-seed", type=int, default=0, help="train-model's --seed (its split)")
    args = parser.parse_args()
    doc: dict[str, Any] = {"benchmark": NAME, "machine": machine(), "params": vars(args)}
    with tempfile.TemporaryDirectory(prefix="aml-bench-train-") as folder:
        doc["result"] = measure(args, Path(folder))
    finish(NAME, doc, render)


if __name__ == "__main__":
    main()
