"""How far the model's figures move with its training: the same trainer on other runs and settings.

    .venv/bin/python -m bench.model_spread

Why: the shipped model is one training (`aml-app train-model`: trees on calibrated seeds 2 and 3, the cut
on seeds 4 to 9), and `bench.model_vs_rules` scores that one. A figure that holds only for one choice of
runs is a figure of that choice. This bench trains the model with the same code under a few other
choices (other runs to learn from, more runs, the cut on one run, smaller trees, the payment's format
unread, no naming prior, each payment weighed alike rather than each attempt) and scores each, gate on,
on the real AMLworld files and on the calibrated runs that no training here sees (`SCORED_SEEDS`,
pooled as `bench.model_vs_rules` pools them).

Each data set is replayed through the reference of B and C once (`aml_app.training.fit.replay`); every model
is then scored on those features (`alerts`, which `tests/unit/test_model.py` holds equal to the detector
that `bench.model_vs_rules` replays). Results: `bench/results/model_spread.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aml_app.detection.model import BENIGN, FEATURES, PAYMENT_FORMATS, Model, load
from aml_app.simulation.amlworld import read_amlworld, read_patterns
from aml_app.training.fit import (
    PARAMS,
    RUNS,
    SCORED_SEEDS,
    SHIPPED_VETO,
    Replayed,
    calibrated_run,
    cut_on,
    predicted,
    replay,
    train,
)
from bench.amlworld_detection import BACKGROUND, PATTERNS, judge, pooled, timeline_of, with_evidence
from bench.common import code_version, machine, markdown_table, write_results

SMALLER = {**PARAMS, "max_leaf_nodes": 7, "min_samples_leaf": 200}
ALL_HELD_OUT = RUNS["held_out"]


@dataclass(frozen=True)
class Training:
    """Seeds to learn from, seeds to set the cut on, the trees' parameters, whether the trees may read
    the payment's format (unread: its features are 0 in training, so no tree splits on them), and whether
    the model names typologies with the naming prior found on the held-out runs or the likeliest, and
    whether each attempt weighs alike in training or each payment (`aml_app.training.fit.sample_weights`)."""

    seeds: list[int]
    held_out: list[int]
    params: dict[str, Any]
    reads_format: bool = True
    naming_prior: bool = True
    attempts_alike: bool = True


#: The first is the shipped model's training.
TRAININGS: dict[str, Training] = {
    "shipped: learn 2,3; cut 4-9": Training(RUNS["seeds"], ALL_HELD_OUT, PARAMS),
    "no naming prior": Training(RUNS["seeds"], ALL_HELD_OUT, PARAMS, naming_prior=False),
    "payments weighed alike": Training(RUNS["seeds"], ALL_HELD_OUT, PARAMS, attempts_alike=False),
    "learn 4,5; cut 2,3,6-9": Training([4, 5], [2, 3, 6, 7, 8, 9], PARAMS),
    "learn 6,7; cut 2-5,8,9": Training([6, 7], [2, 3, 4, 5, 8, 9], PARAMS),
    "format unread": Training(RUNS["seeds"], ALL_HELD_OUT, PARAMS, reads_format=False),
    "cut 4 alone": Training(RUNS["seeds"], [4], PARAMS),
    "learn 2,3,5,6; cut 4,7,8,9": Training([2, 3, 5, 6], [4, 7, 8, 9], PARAMS),
    "learn 2,3,5,6,7; cut 4,8,9": Training([2, 3, 5, 6, 7], [4, 8, 9], PARAMS),
    "smaller trees": Training(RUNS["seeds"], ALL_HELD_OUT, SMALLER),
    "smaller trees; learn 2,3,5,6,7; cut 4,8,9": Training([2, 3, 5, 6, 7], [4, 8, 9], SMALLER),
}
CALIBRATED = "calibrated seeds " + ",".join(map(str, SCORED_SEEDS))
#: Runs on each of which alone the shipped training's cut is set again, and its benign rate measured.
CUT_SEEDS = (4, 5, 6, 7, 8, 9)


def format_unread(run: Replayed) -> Replayed:
    """`run` with its payment-format features 0."""
    columns = [FEATURES.index(f"format_{name}") for name in PAYMENT_FORMATS]
    rows: list[Sequence[float]] = [
        [0.0 if i in columns else value for i, value in enumerate(row)] for row in run.rows
    ]
    return dataclasses.replace(run, rows=rows)


def alerts(model: Model, run: Replayed) -> dict[str, list[str]]:
    """payment id -> the alerts ("typology:rule") of the model's detector (`Model.detect`: the rules that
    alert beside the model, then the model's own) on a replayed run's features."""
    rows = np.array(run.rows, dtype=float)
    benign = model.probabilities(rows)[:, model.classes.index(BENIGN)].tolist()
    beside = [
        [
            (t, r)
            for r, t in zip(rules, typologies, strict=True)
            if (payment.payer == payment.payee or model.keeps_rules(p)) and r in model.alerting_rules
        ]
        for payment, rules, typologies, p in zip(run.payments, run.rules, run.typologies, benign, strict=True)
    ]
    verdicts = model.verdicts(rows, [frozenset(t for t, _ in kept) for kept in beside])
    fired: dict[str, list[str]] = {}
    for payment, kept, verdict in zip(run.payments, beside, verdicts, strict=True):
        chosen = [f"{t}:{r}" for t, r in kept]
        if verdict is not None and payment.payer != payment.payee:
            chosen.append(f"{verdict}:aml.model")
        if chosen:
            fired[payment.payment_id] = chosen
    return fired


def benign_rate(model: Model, run: Replayed) -> float:
    """The share of a calibrated run's benign payments that the model's detector alerts."""
    fired = alerts(model, run)
    benign = [p.payment_id for p, label in zip(run.payments, run.labels, strict=True) if label == BENIGN]
    return round(sum(pid in fired for pid in benign) / len(benign), 4)


def cuts(shipped: Model, fitted: Any, run: Callable[[int], Replayed]) -> dict[str, Any]:
    """The shipped training's trees (`fitted`) with the cut set on each of CUT_SEEDS alone, and the
    shipped model's benign rate on each: how much the one held-out run of the shipped cut decides."""
    index = list(fitted.classes_).index(BENIGN)
    return {
        str(seed): {
            "cut": round(
                cut_on(
                    predicted(fitted, [run(seed)]),
                    index,
                    [run(seed)],
                    set(shipped.alerting_rules),
                    veto=shipped.rule_veto,
                )[0],
                4,
            ),
            "shipped_benign_rate": benign_rate(shipped, run(seed)),
        }
        for seed in CUT_SEEDS
    }


def figures(doc: dict[str, Any]) -> dict[str, Any]:
    """What the table shows of one `judge` document."""
    own = {t: v["own_recall"] for t, v in doc["per_typology"].items() if v["own_recall"] is not None}
    lowest = min(own, key=lambda t: own[t])
    return {
        "own_recall": doc["all"]["own_recall"],
        "any_recall": doc["all"]["any_recall"],
        "lowest": f"{lowest} {own[lowest]}",
        "bipartite": own["bipartite"],
        "cycle": own["cycle"],
        "benign_rate": round(doc["benign"]["alerted"] / doc["benign"]["payments"], 4),
        "named_by_shape": doc["all"]["named_by_shape"],
        "per_typology": own,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    code, measured_on = code_version(), machine()  # what runs: the modules are imported by now
    started = time.perf_counter()
    runs: dict[int, Replayed] = {}

    def run(seed: int) -> Replayed:
        if seed not in runs:
            runs[seed] = replay(*calibrated_run(seed, RUNS["days"], RUNS["per_hour"], RUNS["attempts"]))
        return runs[seed]

    scored: dict[str, tuple[Any, Any]] = {
        "real": (read_patterns(PATTERNS), read_amlworld(BACKGROUND, prefix="amlworld-background")),
    }
    for seed in SCORED_SEEDS:
        scored[f"calibrated seed {seed}"] = calibrated_run(
            seed, RUNS["days"], RUNS["per_hour"], RUNS["attempts"]
        )
    replayed = {name: replay(*data) for name, data in scored.items()}
    evidence = {name: with_evidence(timeline_of(*data)) for name, data in scored.items()}
    shipped = load("amlworld")
    assert shipped is not None
    results: dict[str, Any] = {}
    rows = []
    for name, training in TRAININGS.items():
        seeds, held_out, params = training.seeds, training.held_out, training.params
        prepared = (lambda r: r) if training.reads_format else format_unread
        doc, fitted = train(
            [prepared(run(s)) for s in seeds],
            [prepared(run(s)) for s in held_out],
            params,
            attempts_alike=training.attempts_alike,
            veto=SHIPPED_VETO,  # the shipped training's recipe, varied one part at a time
        )
        if not training.naming_prior:
            doc["naming_prior"] = {}
        model = Model.from_json(doc)
        if name.startswith("shipped"):
            if model.cut != shipped.cut:
                raise SystemExit(f"the shipped training gave cut {model.cut}, the shipped file {shipped.cut}")
            shipped_fitted = fitted
        results[name] = {
            "seeds": seeds,
            "held_out": held_out,
            "params": params,
            "reads_format": training.reads_format,
            "attempts_alike": training.attempts_alike,
            "naming_prior": doc["naming_prior"],
            "cut": round(model.cut, 4),
            "alerting_rules": sorted(model.alerting_rules),
            "rule_precision": doc["training"]["rule_precision"],
        }
        judged = {
            data: judge(*scored[data], alerts(model, replayed[data]), evidence[data]) for data in scored
        }
        unseen = [judged[f"calibrated seed {seed}"] for seed in SCORED_SEEDS]
        results[name]["real"] = figures(judged["real"])
        results[name][CALIBRATED] = figures(pooled(unseen))
        results[name]["calibrated_per_run"] = {
            str(seed): {k: v for k, v in figures(doc).items() if k in ("own_recall", "lowest", "benign_rate")}
            for seed, doc in zip(SCORED_SEEDS, unseen, strict=True)
        }
        real, cal = results[name]["real"], results[name][CALIBRATED]
        own_per_run = [v["own_recall"] for v in results[name]["calibrated_per_run"].values()]
        rows.append(
            [
                name,
                real["own_recall"],
                real["any_recall"],
                real["lowest"],
                real["cycle"],
                real["benign_rate"],
                cal["own_recall"],
                f"{min(own_per_run):.3f}-{max(own_per_run):.3f}",
                cal["lowest"],
                cal["benign_rate"],
                ", ".join(r.removeprefix("aml.") for r in sorted(model.alerting_rules)),
            ]
        )
        print(f"{name}: done at {time.perf_counter() - started:.0f} s", flush=True)
    headers = [
        "training",
        "real own",
        "real any",
        "real lowest",
        "real cycle",
        "real benign",
        "calibrated own",
        "calibrated own, per run",
        "calibrated lowest",
        "calibrated benign",
        "rules alerting beside it",
    ]
    print(markdown_table(headers, rows))
    per_run = cuts(shipped, shipped_fitted, run)
    print(
        "the cut set on each run alone, and the shipped model's benign rate on it: "
        + "; ".join(
            f"seed {s}: {v['cut']:.4f}, {100 * v['shipped_benign_rate']:.2f} %" for s, v in per_run.items()
        )
    )
    bounds = {data: results[next(iter(results))][data]["named_by_shape"] for data in ("real", CALIBRATED)}
    print(
        f"named by shape, with evidence (the most a detector naming typologies by shape can reach): {bounds}"
    )
    write_results(
        "model_spread",
        {
            "code": code,
            "machine": measured_on,
            "calibrated_seeds": list(SCORED_SEEDS),
            "runs": {k: v for k, v in RUNS.items() if k in ("days", "per_hour", "attempts")},
            "trainings": results,
            "cut_per_run": per_run,
            "seconds": round(time.perf_counter() - started, 1),
            "at": time.time(),
        },
    )


if __name__ == "__main__":
    main()
