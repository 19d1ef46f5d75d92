"""The simulator's background against real AMLworld background, measure by measure
(`aml_app.simulation.calibration`).

    .venv/bin/python -m bench.calibration [--seed 11] [--count 7500]

Real: the benign rows of HI-Small's first 7,500 (`tests/data/amlworld/`). Simulated: `count` payments
of the simulator's background (no injected pattern). A calibrated simulator reproduces the real column;
this benchmark shows how far the current one is.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from aml_app.simulation.amlworld import read_amlworld
from aml_app.simulation.calibration import measure
from aml_app.simulation.traffic import simulate
from bench.amlworld_detection import BACKGROUND
from bench.common import finish, machine, markdown_table

NAME = "calibration"


def report(doc: dict[str, Any]) -> str:
    real, simulated = doc["real"], doc["simulated"]
    rows = [[name, json.dumps(real[name]), json.dumps(simulated[name])] for name in real]
    return markdown_table(["measure", "real (HI-Small)", "simulator"], rows)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--count", type=int, default=7500)
    args = parser.parse_args()
    real = read_amlworld(BACKGROUND)
    start = datetime(2026, 3, 2, 8, tzinfo=UTC)
    simulation = simulate(seed=args.seed, count=args.count, rate=50, start=start, instances=0)
    doc = {
        "benchmark": NAME,
        "machine": machine(),
        "params": vars(args),
        "real": measure(p for p in real.payments if not p.is_laundering).as_json(),
        "simulated": measure(p for p in simulation.payments if p.typology is None).as_json(),
    }
    finish(NAME, doc, report)


if __name__ == "__main__":
    cli()
