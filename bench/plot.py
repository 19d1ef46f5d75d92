"""Plots of the last benchmark results, for the issue: a picture shows the latency tail at a glance.

Reads bench/results/gate_overhead.json and bench/results/gate_latency.json (whichever exist) and
writes gate_overhead.png (decisions/s per run) and gate_latency.png (latency CDF per run).

    .venv/bin/python -m bench.plot
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

from bench.common import RESULTS


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def plot_overhead(doc: dict[str, Any]) -> Path:
    runs = doc["runs"]
    labels = [f"{r['variant']}\nrun {r['run']}" for r in runs]
    rates = [r["decisions_per_s"] for r in runs]
    colours = ["tab:blue" if r["variant"] == "gated" else "tab:grey" for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(len(runs)), rates, color=colours)
    ax.set_xticks(range(len(runs)), labels)
    ax.set_ylabel("decisions/s (first → last decision)")
    ratio = doc["summary"]["median_pair_ratio"]
    ax.set_title(f"Gate overhead: median gated/ungated = {ratio:.3f} (goal ≥ 0.9)")
    fig.tight_layout()
    path = RESULTS / "gate_overhead.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency(doc: dict[str, Any]) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in doc["runs"]:
        values = sorted(r["latencies_ms"])
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        label = f"dep delay {r['dep_delay_s']:g}s, {r['workers']} worker(s)"
        ax.step(values, ys, where="post", label=label)
    ax.axvline(doc["params"]["refresh_interval_s"] * 1000, color="red", ls="--", label="1 s goal")
    ax.axhline(0.99, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("last covering dependency commit → decided_at (ms)")
    ax.set_ylabel("fraction of payments")
    ax.set_title("Gate latency (CDF)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = RESULTS / "gate_latency.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    made = []
    if overhead := _load("gate_overhead"):
        made.append(plot_overhead(overhead))
    if latency := _load("gate_latency"):
        made.append(plot_latency(latency))
    print("\n".join(str(p) for p in made) or f"no results in {RESULTS}; run a benchmark first")


if __name__ == "__main__":
    main()
