"""What the opt-in AML model costs per payment: CPU of the rules alone, of the model one payment at a time,
and of the model scoring a lane's batch at once, on the real AMLworld payments.

    .venv/bin/python -m bench.model_cost

Why: a worker decides the payments of one partition in batches of up to `AML_MAX_BATCH`
(`aml_app/worker/detector.py`), and with `AML_MODEL` on, the model's walk of its trees and the
explanations of its alerts are most of the CPU a decision costs outside the wait for B and C. This bench
measures that CPU where it is spent, without Kafka or the services: the evidence of every payment of the
real files (`tests/data/amlworld`: LI-Medium's attempts in HI-Small's first 7,500 rows, 11,403 payments)
is replayed once through the reference of B and C (`aml_app/training/replay.py`, gate on), then each way of
deciding is timed over all of it:

- `rules`: `aml_rules` alone, per payment (what the worker runs without a model, and what every way
  below runs too);
- `before`: `Model.detect` per payment of the model code before batching (`--before`, a commit whose
  `aml_app/detection/model.py` is loaded from git): one feature row and one walk of the trees per payment,
  and for an alert an occlusion pass of 65 rows;
- `batch N`: `Model.detect_many` on the batches a lane would take: the payments keyed by payer over
  `AML_PARTITIONS` (4) partitions, each partition's payments in event-time order, N at a time (N = 1 is
  `Model.detect`, one payment at a time);
- `benign ...`: the rules and a lane's batches on the real benign background alone (HI-Small's rows): a
  third of the files' payments are laundering and the model explains each alert it makes, while a
  deployment's traffic is almost all benign.

- `stages`: where a lane's batch spends the model's CPU: the feature rows (`features`, in Python), the
  walk of the trees and the naming (`Model.probabilities`), and the rest of `Model.judge`, which is the
  explanation of each alert (occlusion read off the trees, and its text), also given per alert.

CPU is `time.process_time` (this process, every thread) over a whole pass, divided by the payments;
each way is run `--repeat` times and the median and the lowest are kept (the machine is shared: the lowest
is the least disturbed). The model's cost is a way's CPU less the rules'. Every way must give the same
hits (rule, typology, reason, figures) for every payment, or the bench fails. Results:
`bench/results/model_cost.json`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aml_app.detection.evidence import Evidence
from aml_app.detection.model import Model, load
from aml_app.detection.rules import Hit, aml_rules
from aml_app.detection.thresholds import AmlThresholds
from aml_app.settings import DetectionSettings, Settings
from aml_app.simulation.amlworld import read_amlworld, read_patterns
from aml_app.training.replay import Services, decided
from bench.amlworld_detection import BACKGROUND, PATTERNS, timeline_of
from bench.common import PROJECT, code_version, machine, markdown_table, write_results

#: A lane's batch under load is `AML_MAX_BATCH` (LANE_BATCH).
LANE_BATCH = DetectionSettings().max_batch
BATCHES = (1, 10, 50, LANE_BATCH, 200)
#: The last commit whose model walks one payment at a time (the per-payment path measured as `before`).
BEFORE = "7e8383d49fbe817329c4634caccbc8b9e70f27db"


def replayed() -> list[tuple[Any, Evidence]]:
    """Every payment of the real files with the evidence the worker decides it on (gate on)."""
    patterns = read_patterns(PATTERNS)
    background = read_amlworld(BACKGROUND, prefix="amlworld-background")
    return list(decided(Services(AmlThresholds()), timeline_of(patterns, background)))


def lanes(payments: Sequence[tuple[Any, Evidence]], partitions: int) -> list[list[Evidence]]:
    """The evidence of each partition's payments in order: payments are keyed by payer."""
    split: list[list[Evidence]] = [[] for _ in range(partitions)]
    for payment, evidence in payments:
        split[zlib.crc32(payment.payer.encode()) % partitions].append(evidence)
    return split


def batches(lanes_: list[list[Evidence]], size: int) -> list[list[Evidence]]:
    """Each lane's payments, `size` at a time."""
    return [lane[i : i + size] for lane in lanes_ for i in range(0, len(lane), size)]


def model_before(commit: str) -> Any:
    """`aml_app/detection/model.py` of `commit`, loaded as a module of its own."""
    text = subprocess.run(
        ["git", "show", f"{commit}:aml_app/detection/model.py"],
        cwd=PROJECT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    folder = Path(tempfile.mkdtemp(prefix="model-before-"))
    path = folder / "model_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("model_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["model_before"] = module
    spec.loader.exec_module(module)
    return module


def timed(decide: Callable[[], list[list[Hit]]], payments: int, repeat: int) -> tuple[dict[str, Any], Any]:
    """CPU µs per payment of `decide` (a whole pass), `repeat` times; and its hits."""
    spent, hits = [], None
    for _ in range(repeat):
        started = time.process_time()
        hits = decide()
        spent.append((time.process_time() - started) / payments * 1e6)
    return {"median_us": round(statistics.median(spent), 1), "lowest_us": round(min(spent), 1)}, hits


def by_payment(batched: list[list[Evidence]], hits: list[list[Hit]]) -> dict[str, list[Hit]]:
    """payment id -> its hits, from the hits of batches flattened in the same order."""
    order = [evidence.payment_id for batch in batched for evidence in batch]
    return dict(zip(order, hits, strict=True))


def stages(
    model: Model, batched: list[list[Evidence]], thresholds: AmlThresholds, payments: int, repeat: int
) -> dict[str, float]:
    """CPU µs per payment of each stage of `Model.judge` on `batched` (median of `repeat` passes): the
    feature rows, the walk and naming, and the rest (the alerts' explanations), which is also given per
    alert. The rules' hits are found before timing: the model reads them, the rules' cost is `rules`."""
    rule_hits = [[aml_rules(evidence, thresholds) for evidence in batch] for batch in batched]

    def rows() -> list[np.ndarray]:
        return [
            model.rows(batch, found, thresholds)[1] for batch, found in zip(batched, rule_hits, strict=True)
        ]

    built = rows()
    alerts = sum(name is not None for matrix in built if len(matrix) for name in model.verdicts(matrix))
    spent: dict[str, list[float]] = {"features": [], "walk and naming": [], "judge": []}
    for _ in range(repeat):
        started = time.process_time()
        rows()
        spent["features"].append(time.process_time() - started)
        started = time.process_time()
        for matrix in built:
            if len(matrix):
                model.verdicts(matrix)
        spent["walk and naming"].append(time.process_time() - started)
        started = time.process_time()
        for batch, found in zip(batched, rule_hits, strict=True):
            model.judge(batch, found, thresholds)
        spent["judge"].append(time.process_time() - started)
    median = {name: statistics.median(values) for name, values in spent.items()}
    explaining = max(median["judge"] - median["features"] - median["walk and naming"], 0.0)
    return {
        "features_us": round(median["features"] / payments * 1e6, 1),
        "walk_and_naming_us": round(median["walk and naming"] / payments * 1e6, 1),
        "explanations_us": round(explaining / payments * 1e6, 1),
        "alerts": alerts,
        "explanation_per_alert_us": round(explaining / max(alerts, 1) * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="passes per way of deciding (default 5)")
    parser.add_argument(
        "--before",
        default=BEFORE,
        help="the commit of the per-payment model to compare with ('none' to skip it; it takes minutes)",
    )
    parser.add_argument("--before-repeat", type=int, default=1, help="passes of the per-payment model")
    parser.add_argument("--partitions", type=int, default=Settings().kafka.partitions)
    args = parser.parse_args()
    doc: dict[str, Any] = {"machine": machine(), "code": code_version(), "args": vars(args)}
    started = time.perf_counter()
    payments = replayed()
    evidences = [evidence for _, evidence in payments]
    thresholds = AmlThresholds()
    model = load("amlworld")
    assert model is not None
    count = len(evidences)
    scored = sum(e.payer != e.payee for e in evidences)
    doc["data"] = {
        "payments": count,
        "self_payments": count - scored,
        "replayed_in_s": round(time.perf_counter() - started, 1),
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
    }
    print(f"{count} payments replayed ({count - scored} self-payments, which the model does not score)")

    figures: dict[str, Any] = {}
    figures["rules"], _ = timed(lambda: [aml_rules(e, thresholds) for e in evidences], count, args.repeat)
    print(f"rules: {figures['rules']}")
    lanes_ = lanes(payments, args.partitions)
    reference: dict[str, list[Hit]] | None = None
    for size in BATCHES:
        batched = batches(lanes_, size)

        def decide(batched: list[list[Evidence]] = batched) -> list[list[Hit]]:
            return [hits for batch in batched for hits in model.detect_many(batch, thresholds)]

        figures[f"batch {size}"], hits = timed(decide, count, args.repeat)
        got = by_payment(batched, hits)
        if reference is None:
            reference = got
            doc["data"]["model_alerts"] = sum(any(h.rule == "aml.model" for h in v) for v in got.values())
        elif got != reference:
            raise SystemExit(f"batches of {size} give other hits than one payment at a time")
        print(f"batch {size}: {figures[f'batch {size}']}")
    figures["stages"] = stages(model, batches(lanes_, LANE_BATCH), thresholds, count, args.repeat)
    print(f"stages, batches of {LANE_BATCH}: {figures['stages']}")
    # The same on the real benign background alone: a deployment's traffic is almost all benign, and the
    # model explains only what it alerts, so this is the cost per payment at the real base rate.
    benign = [(payment, evidence) for payment, evidence in payments if not payment.is_laundering]
    benign_evidence = [evidence for _, evidence in benign]
    figures["benign rules"], _ = timed(
        lambda: [aml_rules(e, thresholds) for e in benign_evidence], len(benign), args.repeat
    )
    benign_batched = batches(lanes(benign, args.partitions), LANE_BATCH)
    figures[f"benign batch {LANE_BATCH}"], hits = timed(
        lambda: [hits for batch in benign_batched for hits in model.detect_many(batch, thresholds)],
        len(benign),
        args.repeat,
    )
    assert reference is not None
    if any(reference[payment_id] != found for payment_id, found in by_payment(benign_batched, hits).items()):
        raise SystemExit("the benign rows alone give other hits than among every payment")
    doc["data"]["benign_payments"] = len(benign)
    doc["data"]["benign_two_party"] = sum(e.payer != e.payee for e in benign_evidence)
    doc["data"]["benign_model_alerts"] = sum(any(h.rule == "aml.model" for h in v) for v in hits)
    lane = figures[f"benign batch {LANE_BATCH}"]
    print(f"benign background: {figures['benign rules']}, batch {LANE_BATCH}: {lane}")
    if args.before != "none":
        before = model_before(args.before).load("amlworld")
        figures["before"], hits = timed(
            lambda: [before.detect(e, thresholds) for e in evidences], count, args.before_repeat
        )
        if by_payment([evidences], hits) != reference:
            raise SystemExit(f"the model of {args.before} gives other hits than the batch path")
        print(f"before ({args.before[:7]}): {figures['before']}")
    for name, entry in figures.items():
        if name not in ("rules", "benign rules", "stages"):
            rules = figures["benign rules" if name.startswith("benign") else "rules"]["median_us"]
            entry["model_us"] = round(entry["median_us"] - rules, 1)
    doc["figures"] = figures
    doc["seconds"] = round(time.perf_counter() - started, 1)
    path = write_results("model_cost", doc)
    print()
    print(report(doc))
    print(f"\nresults: {path}")


def report(doc: dict[str, Any]) -> str:
    figures = doc["figures"]
    rows = [["rules alone", figures["rules"]["median_us"], figures["rules"]["lowest_us"], ""]]
    ways = [("before", "model, per payment, before")] if "before" in figures else []
    ways += [(f"batch {size}", f"model, batches of {size}") for size in BATCHES]
    for name, label in ways:
        entry = figures[name]
        rows.append([label, entry["median_us"], entry["lowest_us"], entry["model_us"]])
    if "benign rules" in figures:
        data = doc["data"]
        rows.append(["benign background: rules alone", figures["benign rules"]["median_us"], "", ""])
        entry = figures[f"benign batch {LANE_BATCH}"]
        label = (
            f"benign background: model, batches of {LANE_BATCH} ({data['benign_payments']} payments, "
            f"{data['benign_two_party']} between two parties, {data['benign_model_alerts']} model alerts)"
        )
        rows.append([label, entry["median_us"], entry["lowest_us"], entry["model_us"]])
    table = markdown_table(["way", "CPU µs per payment (median)", "lowest", "of which the model"], rows)
    split = figures.get("stages")
    if split:
        table += (
            f"\nThe model at batches of {LANE_BATCH}, µs per payment: feature rows {split['features_us']}, "
            f"walk and naming {split['walk_and_naming_us']}, explanations {split['explanations_us']} "
            f"({split['explanation_per_alert_us']} per alert, {split['alerts']} alerts)."
        )
    return table + "\nEvery way gave the same hits for every payment."


if __name__ == "__main__":
    main()
