"""Plots of the last benchmark results, for the issue: a picture shows the latency tail at a glance.

Reads the result files in bench/results (whichever exist) and writes gate_overhead.png (decisions/s
per run), gate_latency.png (latency CDF per run), scaling.png (decisions/s and admin requests/s against
the worker count), pipeline_throughput.png (records/s against a plain consumer), end_to_end.png (CPU
per payment per process), gate_matters.png (recall per typology, gate on and off), capacity.png
(produced → decided latency and the gate's own share against the payment rate) and edge_growth.png
(B's write and question about busy pairs, day by day, edges folded or not).

    .venv/bin/python -m bench.plot
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

from bench.common import RESULTS


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _save(fig: Any, name: str) -> Path:
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    return _save(fig, "gate_overhead")


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
    return _save(fig, "gate_latency")


def plot_scaling(doc: dict[str, Any]) -> Path:
    """Left: decisions/s per worker count and cost kind (each round a marker, the median a line), with
    linear scaling from the 1-worker median dotted. Right: admin requests/s, summed over workers."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = {"cpu": "tab:red", "block": "tab:blue", "wait": "tab:grey"}
    labels = {
        "cpu": "cpu: busy loop (bounded by the cores)",
        "block": "block: blocking sleep, no CPU",
        "wait": "wait: awaited sleep (lanes overlap it)",
    }
    summary = {kind: rows for kind, rows in doc["summary"].items() if kind != "stalled_runs"}
    for kind, per_count in summary.items():
        counts = sorted(int(n) for n in per_count)
        colour = colours.get(kind, "black")
        medians = []
        for n in counts:
            values = per_count[str(n)]["decisions_per_s"]
            left.scatter([n] * len(values), values, color=colour, s=14, alpha=0.6)
            medians.append(statistics.median(values))
        left.plot(counts, medians, color=colour, marker="o", label=labels.get(kind, kind))
        ratios = [per_count[str(n)]["median_ratio_to_1"] for n in counts]
        for n, m, r in zip(counts, medians, ratios, strict=True):
            left.annotate(f"x{r:.2f}", (n, m), textcoords="offset points", xytext=(6, -10), fontsize=8)
        if kind != "wait":  # linear scaling from one worker, for reference (the wait needs no more workers)
            left.plot(counts, [medians[0] * n for n in counts], color=colour, ls=":", lw=0.8)
        for phase, marker in (("held", "s"), ("processing", "o")):
            values = [statistics.median(per_count[str(n)][f"admin_requests_per_s_{phase}"]) for n in counts]
            right.plot(counts, values, color=colour, marker=marker, label=f"{kind}, {phase}")
    params = doc["params"]
    left.set_title(f"Decisions/s, {params['cost_ms']:g} ms per payment, {params['partitions']} partitions")
    left.set_xlabel("workers")
    left.set_ylabel("decisions/s (commit → last decision)")
    left.set_xticks(sorted({int(n) for rows in summary.values() for n in rows}))
    left.set_ylim(bottom=0)
    left.legend(fontsize=7, loc="upper left")
    right.set_title("Admin requests/s, all workers (leader only)")
    right.set_xlabel("workers")
    right.set_ylabel("requests/s")
    right.set_xticks(left.get_xticks())
    right.set_ylim(bottom=0)
    right.legend(fontsize=7)
    return _save(fig, "scaling")


def plot_pipeline(doc: dict[str, Any]) -> Path:
    """Records/s of each way of reading the same payments, on a log scale, with the ratio to raw."""
    summary = doc["summary"]
    readers = [
        ("raw consume", summary["raw_consume_per_s"]),
        ("the same,\nlibrdkafka's\ndefaults", summary.get("raw_consume_defaults_per_s")),
        ("read_range\n(Arrow)", summary["read_range_per_s"]),
    ]
    pipelines = [
        ("pipeline,\nsession up (c.)", summary["pipeline_warm_per_s"]),
        ("pipeline,\nsteady (c.)", summary["pipeline_steady_per_s"]),
        ("pipeline,\nwarm JVM (f.)", summary["pipeline_warm_jvm_per_s"]),
    ]
    readers = [(name, v) for name, v in readers if v is not None]  # results from before a'. was read
    bars = readers + pipelines
    raw = summary["raw_consume_per_s"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(
        range(len(bars)),
        [v for _, v in bars],
        color=["tab:grey"] * len(readers) + ["tab:blue"] * len(pipelines),
    )
    ax.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
    ax.set_yscale("log")
    ax.axhline(0.1 * raw, color="red", ls="--", lw=0.8, label="goal: 0.10 x raw")
    for i, (_, v) in enumerate(bars):
        ax.annotate(f"{v:,.0f}/s\n{v / raw:.3f}", (i, v), ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("records/s (log scale)")
    ax.set_title("Services B and C on Spark local[2] vs a plain consumer")
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, "pipeline_throughput")


def plot_end_to_end(doc: dict[str, Any]) -> Path:
    """CPU µs per payment of each process: where a gated payment's cost goes on a shared machine; and
    when AML falls behind its dependencies, while they run or after."""
    costs = sorted(doc["cpu_us_per_record"].items(), key=lambda kv: kv[1])
    series = doc.get("progress")
    fig, axes = plt.subplots(1, 2 if series else 1, figsize=(12 if series else 7, 3.8))
    ax = axes[0] if series else axes
    if series:
        when = axes[1]
        curves = (("sent", "sent"), ("covered", "both groups committed"), ("decided", "AML decided"))
        for key, label in curves:
            when.plot(series["seconds"], series[key], label=label)
        when.set_xlabel("seconds after the first send")
        when.set_ylabel("payments")
        when.legend(fontsize=8, loc="lower right")
        when.set_title("Progress")
    ax.barh(range(len(costs)), [v for _, v in costs], color="tab:blue")
    ax.set_yticks(range(len(costs)), [name for name, _ in costs], fontsize=7)
    ax.set_xlabel("CPU µs per payment")
    ratio = doc["ratio_aml_to_slowest_dependency"]
    ax.set_title(f"End to end on 2 cores:\nAML / slowest dependency = {ratio:.3f}")
    return _save(fig, "end_to_end")


def plot_gate_matters(doc: dict[str, Any]) -> Path:
    """Recall per typology, gate on and off, on the same seeded traffic with a lagging dependency."""
    runs = doc["runs"]
    typologies = list(runs["gate on"]["scores"])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.38
    for i, (name, colour) in enumerate((("gate on", "tab:blue"), ("gate off", "tab:red"))):
        run = runs[name]
        recalls = [run["scores"][t]["recall"] for t in typologies]
        label = f"{name}: {run['freshness_violations']} freshness violations"
        ax.bar(
            [x + (i - 0.5) * width for x in range(len(typologies))], recalls, width, color=colour, label=label
        )
    ax.set_xticks(range(len(typologies)), [t.replace("_", "\n") for t in typologies], fontsize=8)
    ax.set_ylabel("recall")
    ax.set_ylim(0, 1.35)
    ax.set_title("Why the gate matters: Service B lagging, same seed")
    ax.legend(fontsize=8)
    return _save(fig, "gate_matters")


def plot_capacity(doc: dict[str, Any]) -> Path:
    """p50 and p99 of produced → decided (AML, fraud) and of the gate's own share against the rate, both
    axes logarithmic; a rate not held is drawn hollow."""
    steps = doc["steps"]
    rates = [s["rate"] for s in steps]
    fig, ax = plt.subplots(figsize=(10, 4.6))
    series = [
        ("aml", "latency_ms", "AML produced → decided", "tab:blue", "-"),
        ("fraud", "latency_ms", "fraud produced → decided", "tab:orange", "-"),
        ("aml", "gate_share_ms", "AML gate's own share", "tab:blue", ":"),
        ("fraud", "gate_share_ms", "fraud gate's own share", "tab:orange", ":"),
    ]
    for service, key, label, colour, style in series:
        for q, marker in (("p99", "o"), ("p50", "s")):
            values = [s["services"][service][key][q] for s in steps]
            ax.plot(
                rates, values, color=colour, ls=style, lw=1.4 if q == "p99" else 0.9, label=f"{label}, {q}"
            )
            for rate, value, step in zip(rates, values, steps, strict=True):
                ax.plot(
                    [rate],
                    [value],
                    marker=marker,
                    color=colour,
                    ms=5,
                    mfc=colour if step["held"] else "white",
                )
    ax.axhline(2000, color="red", ls="--", lw=0.8, label="2 s (the capacity bound)")
    ax.axhline(150, color="grey", ls="--", lw=0.8, label="150 ms (the gate's goal)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.minorticks_off()
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.set_xlabel("payments/s sent (hollow markers: rate not held)")
    ax.set_ylabel("ms (log scale)")
    found = doc["goals"]["highest_rate_aml_p99_2s"]["rate"]
    held = f"{found:g}/s" if found else "none"
    ax.set_title(f"Capacity on 2 cores: the highest rate held with AML p99 ≤ 2 s: {held}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, "capacity")


def plot_edge_growth(doc: dict[str, Any]) -> Path:
    days = doc["days"]
    variants = [k for k, v in days[0].items() if isinstance(v, dict)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, colour in zip(variants, ["tab:blue", "tab:grey"], strict=False):
        x = [d["day"] for d in days]
        ax.plot(
            x,
            [d[variant]["question_ms"] for d in days],
            color=colour,
            marker="o",
            label=f"{variant}: question",
        )
        ax.plot(x, [d[variant]["write_ms"] for d in days], color=colour, ls="--", label=f"{variant}: write")
    ax.set_xlabel("day of event time")
    ax.set_ylabel("ms (a batch's write; a question about ten payees)")
    ax.set_title("B's store: pairs paying every minute")
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, "edge_growth")


def main() -> None:
    made = []
    if overhead := _load("gate_overhead"):
        made.append(plot_overhead(overhead))
    if latency := _load("gate_latency"):
        made.append(plot_latency(latency))
    if scaling := _load("scaling"):
        made.append(plot_scaling(scaling))
    if pipeline := _load("pipeline_throughput"):
        made.append(plot_pipeline(pipeline))
    if end_to_end := _load("end_to_end"):
        made.append(plot_end_to_end(end_to_end))
    if gate_matters := _load("gate_matters"):
        made.append(plot_gate_matters(gate_matters))
    if capacity := _load("capacity"):
        made.append(plot_capacity(capacity))
    if edge_growth := _load("edge_growth"):
        made.append(plot_edge_growth(edge_growth))
    print("\n".join(str(p) for p in made) or f"no results in {RESULTS}; run a benchmark first")


if __name__ == "__main__":
    main()
