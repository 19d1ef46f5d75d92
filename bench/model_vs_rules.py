"""Rules, the learned model, or both: the AML detector chosen by measurement.

    .venv/bin/python -m bench.model_vs_rules [--model FILE] [--lag]

Scores three detectors on three data sets, side by side, with Services B and C as the naive reference
(gate on), as `bench.amlworld_detection` scores the rules:
- `rules`: every AML rule alerts (the default detector, `AML_MODEL` unset);
- `model`: the model (`--model`, default the shipped `aml_app/detection/amlworld_model.json`, trained
  by `aml-app train-model` on calibrated seeds 2 and 3) with the rules it keeps alerting beside it
  (`AML_MODEL=amlworld`);
- `both`: every rule and the model.

The data sets: the real AMLworld files (LI-Medium's attempts in HI-Small's first half hour); five other
runs of the calibrated simulator (`SCORED_SEEDS`, which no training sees), each judged alone and then
pooled (`bench.amlworld_detection.pooled`: 200 attempts of each typology); and our own simulator
(`aml_app.simulation.traffic`, seed 11), whose traffic is shaped otherwise: a deployment's traffic will
not be AMLworld's either, and this shows what a model does under such a shift. Also the model at each
of its alert budgets on the real files, the precision at the top of its queue there (alerts ranked by
their `score`), and its CPU time per payment. `--lag` gives each payment only
the evidence before it (the gate off). Results: `bench/results/model_vs_rules.json`
(`model_vs_rules_lag.json` with `--lag`).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from aml_app.detection.model import SHIPPED, Model, load
from aml_app.detection.rules import Hit
from aml_app.detection.thresholds import AmlThresholds
from aml_app.simulation.amlworld import read_amlworld, read_patterns
from aml_app.simulation.traffic import simulate
from aml_app.training.fit import SCORED_SEEDS, calibrated_run, replay
from aml_app.training.holdout import TOP_K, queue_of, rules_queue, within_budgets
from aml_app.training.replay import Services, decided
from bench.amlworld_detection import BACKGROUND, PATTERNS, judge, pooled, timeline_of, with_evidence
from bench.common import code_version, machine, markdown_table, write_results

OURS_START = datetime(2026, 3, 2, 8, tzinfo=UTC)
BUDGET_HEADERS = [
    "budget",
    "rules beside",
    "own-typology recall",
    "any alert",
    "benign alerted",
    "precision at HI's base rate",
    "at least",
]


def detectors(
    timeline: list[Any], model: Model, lag: bool = False, pairs: Iterable[tuple[Any, Any]] | None = None
) -> tuple[dict[str, dict[str, list[str]]], float]:
    """payment id -> hits ("typology:rule") per detector over one timeline (`timeline_of`); and the model's
    seconds.
    `lag`: each payment is decided on the evidence before it (the gate off); `pairs`: each payment with
    its evidence, replayed already (`decided`), instead of the timeline."""
    from aml_app.detection.rules import aml_rules

    thresholds = AmlThresholds()
    fired: dict[str, dict[str, list[str]]] = {"rules": {}, "model": {}, "both": {}}
    spent = 0.0
    for payment, evidence in decided(Services(thresholds), timeline, lag) if pairs is None else pairs:
        hits = aml_rules(evidence, thresholds)
        started = time.perf_counter()
        [model_hit], [benign] = model.judge([evidence], [hits], thresholds)
        spent += time.perf_counter() - started
        extra: list[Hit] = [model_hit] if model_hit is not None else []
        kept = model.beside(hits, benign)
        for name, chosen in (("rules", hits), ("model", kept + extra), ("both", hits + extra)):
            if chosen:
                fired[name][payment.payment_id] = [f"{hit.typology}:{hit.rule}" for hit in chosen]
    return fired, spent


def ours(seed: int, count: int) -> tuple[Any, Any]:
    """Our own simulator's run as (patterns, background) in the shape `judge` reads."""
    run = simulate(seed=seed, count=count, rate=50, start=OURS_START, instances=5)
    members = {pid for i in run.instances for pid in i.payment_ids}
    payments = [
        SimpleNamespace(
            payment_id=p.payment_id,
            payer=p.payer,
            payee=p.payee,
            amount=p.amount,
            currency=p.currency,
            ts=p.ts if isinstance(p.ts, str) else p.ts.isoformat(),
            is_laundering=False,
        )
        for p in run.payments
    ]
    attempts = [SimpleNamespace(typology=i.typology, payment_ids=i.payment_ids) for i in run.instances]
    return (
        SimpleNamespace(attempts=attempts, payments=[p for p in payments if p.payment_id in members]),
        SimpleNamespace(payments=[p for p in payments if p.payment_id not in members]),
    )


def summary(doc: dict[str, Any]) -> list[Any]:
    own = [v["own_recall"] for v in doc["per_typology"].values() if v["own_recall"] is not None]
    return [
        doc["all"]["own_recall"],
        doc["all"]["any_recall"],
        min(own),
        doc["benign"]["rate"],
        doc["payments"]["f1"],
    ]


def budgets(
    model: Model, patterns: Any, background: Any, pairs: Iterable[tuple[Any, Any]] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """What the model and the rules beside it alert at each of its alert budgets (`AML_ALERT_BUDGET`),
    each set on runs of the calibrated simulator, on one data set (`pairs`: its payments with their
    evidence, replayed already); and the analysts' queues of the model at its own cut and of the rules
    alone, ranked by the score each alert carries."""
    run = replay(patterns, background, pairs=pairs)
    return within_budgets(model, run), {"model": queue_of(model, run), "rules": rules_queue(run)}


def budget_rows(found: list[dict[str, Any]]) -> list[list[Any]]:
    hi = "HI (1 in 900)"
    return [
        [
            f"{100 * b['budget']:g} %",
            b["rules_beside"][0],  # one model
            b["own_typology"],
            b["any_alert"],
            f"{b['benign_alerted']} ({100 * b['benign_share']:.2f} %)",
            b["estimated_at_base_rate"][hi]["precision"],
            b["estimated_at_base_rate"][hi]["precision_at_least"],
        ]
        for b in found
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=SHIPPED, help="a model file, or 'amlworld' for the shipped one")
    parser.add_argument(
        "--calibrated-seeds", default=",".join(map(str, SCORED_SEEDS)), help="calibrated runs, pooled"
    )
    parser.add_argument("--ours-seed", type=int, default=11)
    parser.add_argument("--ours-count", type=int, default=6000)
    parser.add_argument("--lag", action="store_true", help="evidence before each payment only (gate off)")
    args = parser.parse_args()
    model = load(args.model)
    assert model is not None
    seeds = [int(s) for s in args.calibrated_seeds.split(",")]
    calibrated = "calibrated seeds " + ",".join(map(str, seeds))
    sets: dict[str, Callable[[], tuple[Any, Any]]] = {
        "real": lambda: (read_patterns(PATTERNS), read_amlworld(BACKGROUND, prefix="amlworld-background")),
        **{f"calibrated seed {s}": functools.partial(calibrated_run, s, 14.0, 100.0, 40) for s in seeds},
        f"our simulator seed {args.ours_seed}": lambda: ours(args.ours_seed, args.ours_count),
    }
    headers = ["detector", "own-typology recall", "any-alert recall", "lowest typology", "benign rate", "F1"]
    results: dict[str, Any] = {}
    payments, spent = 0, 0.0
    real_budgets: list[dict[str, Any]] = []
    real_queues: dict[str, dict[str, Any]] = {"model": {}, "rules": {}}
    for name, make in sets.items():
        patterns, background = make()
        timeline = timeline_of(patterns, background)
        # The real files are replayed once, for the detectors and for the model's budgets.
        with_budgets = name == "real" and not args.lag
        pairs = list(decided(Services(AmlThresholds()), timeline)) if with_budgets else None
        fired, seconds = detectors(timeline, model, args.lag, pairs)
        payments, spent = payments + len(timeline), spent + seconds
        evidence = with_evidence(timeline)
        results[name] = {d: judge(patterns, background, f, evidence) for d, f in fired.items()}
        print(f"## {name}\n")
        print(markdown_table(headers, [[d, *summary(doc)] for d, doc in results[name].items()]))
        print(f"\nnamed by shape, with evidence: {results[name]['rules']['all']['named_by_shape']}")
        if with_budgets:
            real_budgets, real_queues = budgets(model, patterns, background, pairs)
            print("\nthe model at each of its alert budgets (`AML_ALERT_BUDGET`):\n")
            print(markdown_table(BUDGET_HEADERS, budget_rows(real_budgets)))
            for who, queue in zip(("the model's", "the rules'"), real_queues.values(), strict=True):
                print(
                    f"\n{who} queue, alerts ranked by their `score` (ties: benign first): "
                    f"{queue['alerts']} alerts, the first benign one at place {queue['first_benign']}; "
                    "precision at its top:\n"
                )
                print(
                    markdown_table(
                        ["queue", *(f"top {k}" for k in TOP_K)],
                        [[name, *at.values()] for name, at in queue["precision_at_top"].items()],
                    )
                )
        print()
    runs = [results[f"calibrated seed {s}"] for s in seeds]
    results[calibrated] = {d: pooled([run[d] for run in runs]) for d in runs[0]}
    print(f"## {calibrated}, pooled\n")
    print(markdown_table(headers, [[d, *summary(doc)] for d, doc in results[calibrated].items()]))
    print()
    per_payment = 1e6 * spent / payments
    print(f"model: {per_payment:.0f} µs of CPU per payment, over {payments} payments ({args.model})")
    write_results(
        "model_vs_rules" + ("_lag" if args.lag else ""),
        {
            "code": code_version(),
            "machine": machine(),
            "params": vars(args),
            "model": {k: v for k, v in model.training.items()},
            "model_us_per_payment": round(per_payment, 1),
            "model_budgets_on_real": real_budgets,
            "model_queue_on_real": real_queues["model"],
            "rules_queue_on_real": real_queues["rules"],
            **results,
            "at": time.time(),
        },
    )


if __name__ == "__main__":
    main()
