"""Both simulators against real AMLworld data, measure by measure (`aml_app.simulation.calibration`).

    .venv/bin/python -m bench.calibration [--seed 11]

Background: the benign rows of HI-Small's first 7,500 (`tests/data/amlworld/`) against half an hour of
each simulator's background (ours, `traffic.py`: 7,500 payments with no injected pattern; the calibrated
one, `calibrated.py`: 15,000 payments an hour among 500,000 accounts). Attempts: LI-Medium's patterns
file against 200 calibrated attempts of each typology. Each simulator's measures out of the bounds of
`calibration.BACKGROUND_BOUNDS` and `PATTERN_BOUNDS` are listed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aml_app.simulation.amlworld import read_amlworld, read_patterns
from aml_app.simulation.calibrated import simulate_calibrated
from aml_app.simulation.calibration import (
    background_gaps,
    measure,
    measure_patterns,
    pattern_gaps,
)
from aml_app.simulation.traffic import simulate
from bench.amlworld_detection import BACKGROUND, PATTERNS
from bench.common import code_version, finish, machine, markdown_table

NAME = "calibration"


def report(doc: dict[str, Any]) -> str:
    real, ours, calibrated = (doc["background"][k] for k in ("real", "ours", "calibrated"))
    rows = [
        [name, json.dumps(real[name]), json.dumps(ours[name]), json.dumps(calibrated[name])] for name in real
    ]
    lines = [
        markdown_table(["measure", "real (HI-Small)", "our simulator", "calibrated simulator"], rows),
        "",
    ]
    patterns = doc["patterns"]
    names = [n for n in next(iter(patterns["real"].values())) if n != "attempts"]
    rows = [
        [typology, name, json.dumps(patterns["real"][typology][name]), json.dumps(measures[name])]
        for typology, measures in patterns["calibrated"].items()
        for name in names
    ]
    lines += [markdown_table(["typology", "measure", "real (LI-Medium)", "calibrated simulator"], rows), ""]
    for who, gaps in doc["gaps"].items():
        lines.append(f"out of bounds, {who}: {len(gaps)}" + "".join(f"\n- {gap}" for gap in gaps))
    return "\n".join(lines)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    real = measure(p for p in read_amlworld(BACKGROUND).payments if not p.is_laundering)
    ours_run = simulate(
        seed=args.seed, count=7500, rate=50, start=datetime(2026, 3, 2, 8, tzinfo=UTC), instances=0
    )
    ours = measure(ours_run.payments)
    background_run = simulate_calibrated(
        args.seed, days=0.5 / 24, per_hour=15_000, attempts=0, accounts=500_000
    )
    attempts_run = simulate_calibrated(args.seed, days=14, per_hour=1, attempts=200)
    real_patterns = read_patterns(PATTERNS)
    with tempfile.TemporaryDirectory() as folder:
        transactions, _ = background_run.write(Path(folder) / "background")
        calibrated = measure(read_amlworld(transactions).payments)
        _, patterns_file = attempts_run.write(Path(folder) / "attempts")
        simulated_patterns = read_patterns(patterns_file)
    real_shapes = measure_patterns(real_patterns.attempts, real_patterns.payments)
    shapes = measure_patterns(simulated_patterns.attempts, simulated_patterns.payments)
    doc = {
        "benchmark": NAME,
        "machine": machine(),
        "code": code_version(),
        "params": vars(args),
        "background": {"real": real.as_json(), "ours": ours.as_json(), "calibrated": calibrated.as_json()},
        "patterns": {
            "real": {t: m.as_json() for t, m in real_shapes.items()},
            "calibrated": {t: m.as_json() for t, m in shapes.items()},
        },
        "gaps": {
            "our simulator, background": background_gaps(real, ours),
            "calibrated simulator, background": background_gaps(real, calibrated),
            "calibrated simulator, attempts": pattern_gaps(real_shapes, shapes),
        },
    }
    finish(NAME, doc, report)


if __name__ == "__main__":
    cli()
