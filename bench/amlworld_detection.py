"""The AML rules on real AMLworld data: its laundering attempts replayed into its real background traffic.

    .venv/bin/python -m bench.amlworld_detection [--patterns FILE] [--background FILE] [--lag]
        [--no-simulated] [--seed 1] [--days 14] [--per-hour 100] [--attempts 40]

Every attempt of a patterns file (`LI-Medium_Patterns.txt`: 456 attempts of eight typologies, with every
payment) and every row of a transactions file (`HI-Small_Trans_rows1-7500.csv`: real background traffic)
go into one timeline, in event-time order; Services B and C are the naive reference
(`aml_app/training/replay.py`), so the evidence about each payment is what the stores would answer once they
have applied everything up to its time (the gate on). `--lag` gives each payment only the evidence before it
(a service reading behind its dependencies, the gate off).

Scored as the AMLworld papers report it, per attempt and over payments:
- an attempt is caught by its own typology when one of its payments got an alert of that typology, and
  by any alert when one of its payments got any alert;
- a typology's precision is the share of the payments its rule alerted that are laundering (of any
  attempt: real patterns overlap, a scatter-gather's sink is a fan-in too);
- the benign alert rate is the share of background payments labelled 0 that got any alert, with the
  rules that fired on them;
- over payments, minority-class precision, recall and F1 of "any alert" against "laundering" (an
  attempt's payment, or a background row labelled 1);
- the bound of what any rule over B and C can catch (`with evidence`): the share of attempts with a
  payment whose payer or payee made or got another payment between two parties in the 14 days up to
  it. A payment between accounts that have nothing else shows B and C only itself;
- the bound of what a detector that names typologies by shape can name (`named by shape`,
  `bench.attempt_shapes`): attempts with evidence, where the file gives attempts of one payment graph
  (one payment between two accounts, A -> B -> A) several typologies, count for the likeliest one
  only. Per typology, `shared shape` counts its attempts whose graph another typology's attempt has;
- how many attempts pay again between two accounts that an earlier attempt paid between, either way,
  in all and by the attempt's size (`bench.attempt_shapes.repeated_edges`), which the calibrated
  simulator reproduces (`REUSED_EDGE_SHARE`).

The same is then scored on a run of the simulator calibrated to these files
(`aml_app.simulation.calibrated`): 14 days of background at 100 payments an hour and 40 attempts of each
typology on its accounts, so rules also meet days of realistic background, which the real half hour
cannot show. Default inputs are the copies in `tests/data/amlworld/` (see its README for their source
and licence). Results: `bench/results/amlworld_detection.json`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from aml_app.dependencies.relations import LOOP_SPAN
from aml_app.detection.rules import TYPOLOGIES, aml_rules
from aml_app.detection.thresholds import AmlThresholds
from aml_app.simulation.amlworld import read_amlworld, read_patterns
from aml_app.simulation.calibrated import simulate_calibrated
from aml_app.training.replay import Services, decided, timeline_of
from bench.attempt_shapes import named_by_shape, repeated_edges
from bench.common import PROJECT, code_version, machine, markdown_table, write_results

DATA = PROJECT / "tests" / "data" / "amlworld"
PATTERNS = DATA / "LI-Medium_Patterns.txt"
BACKGROUND = DATA / "HI-Small_Trans_rows1-7500.csv"


def replay(payments: list[Any], lag: bool) -> dict[str, list[str]]:
    """payment id -> the rules that fired on it, in the timeline's order."""
    return fired_by_rules(decided(Services(AmlThresholds()), payments, lag))


def fired_by_rules(pairs: Iterable[tuple[Any, Any]]) -> dict[str, list[str]]:
    """payment id -> the rules that fired on it, from each payment's evidence (`decided`)."""
    thresholds = AmlThresholds()
    fired: dict[str, list[str]] = {}
    for payment, evidence in pairs:
        hits = aml_rules(evidence, thresholds)
        if hits:
            fired[payment.payment_id] = [f"{hit.typology}:{hit.rule}" for hit in hits]
    return fired


def with_evidence(timeline: list[Any]) -> set[str]:
    """The payments whose payer or payee made or got another payment between two parties in the
    LOOP_SPAN up to it (the timeline is in event-time order)."""
    last: dict[str, datetime] = {}
    found: set[str] = set()
    for payment in timeline:
        ts = datetime.fromisoformat(payment.ts)
        before = [last[a] for a in (payment.payer, payment.payee) if a in last]
        if any(ts - LOOP_SPAN <= when for when in before):
            found.add(payment.payment_id)
        if payment.payer != payment.payee:
            last[payment.payer] = last[payment.payee] = ts
    return found


def ratio(n: int, d: int) -> float | None:
    return round(n / d, 3) if d else None


def judge(patterns: Any, background: Any, fired: dict[str, list[str]], evidence: set[str]) -> dict[str, Any]:
    """The scores described in the module docstring; `evidence` the payments `with_evidence`."""
    typologies = {pid: {rule.split(":")[0] for rule in rules} for pid, rules in fired.items()}
    attempts = patterns.attempts
    laundering = {pid for a in attempts for pid in a.payment_ids} | {
        p.payment_id for p in background.payments if p.is_laundering
    }
    per_typology: dict[str, dict[str, Any]] = {}
    for typology in TYPOLOGIES:
        own_attempts = [a for a in attempts if a.typology == typology]
        own = sum(1 for a in own_attempts if any(typology in typologies.get(p, ()) for p in a.payment_ids))
        any_alert = sum(1 for a in own_attempts if any(p in fired for p in a.payment_ids))
        bound = sum(1 for a in own_attempts if any(p in evidence for p in a.payment_ids))
        alerted = [pid for pid, found in typologies.items() if typology in found]
        true_alerts = sum(1 for pid in alerted if pid in laundering)
        per_typology[typology] = {
            "attempts": len(own_attempts),
            "own_typology": own,
            "any_alert": any_alert,
            "evidenced": bound,
            "own_recall": ratio(own, len(own_attempts)),
            "any_recall": ratio(any_alert, len(own_attempts)),
            "with_evidence": ratio(bound, len(own_attempts)),
            "alerted_payments": len(alerted),
            "true_alerts": true_alerts,
            "precision": ratio(true_alerts, len(alerted)),
        }
    own_all = sum(v["own_typology"] for v in per_typology.values())  # typologies without attempts add 0
    any_all = sum(v["any_alert"] for v in per_typology.values())
    bound_all = sum(1 for a in attempts if any(p in evidence for p in a.payment_ids))
    shapes = named_by_shape(attempts, patterns.payments, evidence)
    reused = repeated_edges(attempts, patterns.payments)
    for typology, doc in per_typology.items():
        doc["shared_shape"] = shapes["shared_shape"].get(typology, 0)
    benign = [p for p in background.payments if not p.is_laundering]
    benign_alerted = [p for p in benign if p.payment_id in fired]
    benign_rules = Counter(rule for p in benign_alerted for rule in fired[p.payment_id])
    # What a detector has to alert to name an attempt without evidence: a payment between two accounts
    # with no other traffic, told from these only by its amount, currency, format and time.
    lone = Counter(
        getattr(p, "channel", None) or "unknown"
        for p in benign
        if p.payer != p.payee and p.payment_id not in evidence
    )
    flagged = set(fired)
    true_flags = len(flagged & laundering)
    return {
        "per_typology": per_typology,
        "all": {
            "attempts": len(attempts),
            "evidenced": bound_all,
            "own_recall": ratio(own_all, len(attempts)),
            "any_recall": ratio(any_all, len(attempts)),
            "with_evidence": ratio(bound_all, len(attempts)),
            "named_by_shape": shapes["named_by_shape"],
            "shared_shapes": shapes["shared_shapes"],
            "repeated_edges": reused,
        },
        "benign": {
            "payments": len(benign),
            "alerted": len(benign_alerted),
            "rate": ratio(len(benign_alerted), len(benign)),
            "by_rule": dict(benign_rules.most_common()),
            "lone": lone.total(),
            "lone_by_format": dict(lone.most_common()),
        },
        "payments": {
            "laundering": len(laundering),
            "flagged": len(flagged),
            "true_flags": true_flags,
            "precision": ratio(true_flags, len(flagged)),
            "recall": ratio(true_flags, len(laundering)),
            "f1": ratio(2 * true_flags, len(flagged) + len(laundering)),
        },
    }


def pooled(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`judge`'s scores of independent runs taken as one data set: counts summed, ratios of the sums.

    Why: one calibrated run holds 40 attempts of a typology, whose recall it measures to about 0.075
    (one standard error at 0.65); five runs pooled measure it to about 0.034. The shape bounds are per
    run (`named_by_shape`, one per run); shared shapes and repeated edges stay in each run's document."""
    per_typology: dict[str, dict[str, Any]] = {}
    for typology in TYPOLOGIES:
        own = [doc["per_typology"][typology] for doc in docs]
        total = {
            key: sum(v[key] for v in own)
            for key in (
                "attempts",
                "own_typology",
                "any_alert",
                "evidenced",
                "alerted_payments",
                "true_alerts",
            )
        }
        per_typology[typology] = {
            **total,
            "own_recall": ratio(total["own_typology"], total["attempts"]),
            "any_recall": ratio(total["any_alert"], total["attempts"]),
            "with_evidence": ratio(total["evidenced"], total["attempts"]),
            "precision": ratio(total["true_alerts"], total["alerted_payments"]),
            "shared_shape": sum(v["shared_shape"] for v in own),
        }
    attempts = sum(doc["all"]["attempts"] for doc in docs)
    evidenced = sum(doc["all"]["evidenced"] for doc in docs)
    benign = {key: sum(doc["benign"][key] for doc in docs) for key in ("payments", "alerted")}
    by_rule: Counter[str] = sum((Counter(doc["benign"]["by_rule"]) for doc in docs), Counter())
    lone: Counter[str] = sum((Counter(doc["benign"]["lone_by_format"]) for doc in docs), Counter())
    payments = {
        key: sum(doc["payments"][key] for doc in docs) for key in ("laundering", "flagged", "true_flags")
    }
    return {
        "runs": len(docs),
        "per_typology": per_typology,
        "all": {
            "attempts": attempts,
            "evidenced": evidenced,
            "own_recall": ratio(sum(v["own_typology"] for v in per_typology.values()), attempts),
            "any_recall": ratio(sum(v["any_alert"] for v in per_typology.values()), attempts),
            "with_evidence": ratio(evidenced, attempts),
            "named_by_shape": [doc["all"]["named_by_shape"] for doc in docs],
        },
        "benign": {
            **benign,
            "rate": ratio(benign["alerted"], benign["payments"]),
            "by_rule": dict(by_rule.most_common()),
            "lone": lone.total(),
            "lone_by_format": dict(lone.most_common()),
        },
        "payments": {
            **payments,
            "precision": ratio(payments["true_flags"], payments["flagged"]),
            "recall": ratio(payments["true_flags"], payments["laundering"]),
            "f1": ratio(2 * payments["true_flags"], payments["flagged"] + payments["laundering"]),
        },
    }


def score(patterns: Any, background: Any, lag: bool) -> dict[str, Any]:
    """Replay one data set's attempts in its background and judge the alerts."""
    timeline = timeline_of(patterns, background)
    started = time.perf_counter()
    fired = replay(timeline, lag=lag)
    elapsed = time.perf_counter() - started
    judged = judge(patterns, background, fired, with_evidence(timeline))
    return {"timeline": len(timeline), "seconds": round(elapsed, 1), **judged}


def report(title: str, doc: dict[str, Any], lag: bool) -> str:
    rows = [
        [
            t,
            v["attempts"],
            v["own_recall"],
            v["any_recall"],
            v["with_evidence"],
            v["shared_shape"],
            v["alerted_payments"],
            v["precision"],
        ]
        for t, v in doc["per_typology"].items()
    ]
    every = doc["all"]
    rows.append(
        [
            "all",
            every["attempts"],
            every["own_recall"],
            every["any_recall"],
            every["with_evidence"],
            "",
            "",
            "",
        ]
    )
    headers = [
        "typology",
        "attempts",
        "own-typology recall",
        "any-alert recall",
        "with evidence",
        "shared shape",
        "alerted",
        "precision",
    ]
    benign, payments = doc["benign"], doc["payments"]
    return "\n".join(
        [
            f"## {title}",
            "",
            markdown_table(headers, rows),
            "",
            f"named by shape, with evidence (the most a detector naming typologies by shape can reach): "
            f"{every['named_by_shape']}; shapes given several typologies: "
            + "; ".join(
                f"{s['payments']} payment{'s' * (s['payments'] != 1)} among {s['accounts']} accounts "
                f"{s['typologies']}"
                for s in every["shared_shapes"]
            ),
            f"attempts paying again between two accounts an earlier attempt paid between: "
            f"{every['repeated_edges']['repeated']} the same way, {every['repeated_edges']['reversed']} the "
            f"other way, of {every['repeated_edges']['attempts']}",
            f"benign payments alerted: {benign['alerted']} of {benign['payments']} ({benign['rate']}); "
            f"by rule: {benign['by_rule']}",
            f"benign payments between two parties without evidence (all a detector sees of an attempt "
            f"without evidence): {benign['lone']}, by format {benign['lone_by_format']}",
            f"payments: {payments['laundering']} laundering, {payments['flagged']} flagged, "
            f"precision {payments['precision']}, recall {payments['recall']}, F1 {payments['f1']}",
            f"replayed {doc['timeline']} payments in {doc['seconds']} s ({'lagging' if lag else 'gated'})",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", type=Path, default=PATTERNS)
    parser.add_argument("--background", type=Path, default=BACKGROUND)
    parser.add_argument("--lag", action="store_true", help="evidence before each payment only (gate off)")
    parser.add_argument("--no-simulated", action="store_true", help="real data only")
    parser.add_argument("--seed", type=int, default=1, help="of the calibrated simulator")
    parser.add_argument("--days", type=float, default=14.0, help="of the calibrated simulator's run")
    parser.add_argument(
        "--per-hour", type=float, default=100.0, help="calibrated background payments an hour"
    )
    parser.add_argument("--attempts", type=int, default=40, help="calibrated attempts of each typology")
    args = parser.parse_args()
    runs = {
        "real": score(
            read_patterns(args.patterns),
            read_amlworld(args.background, prefix="amlworld-background"),
            args.lag,
        )
    }
    print(report(f"real: {args.patterns.name} in {args.background.name}", runs["real"], args.lag))
    if not args.no_simulated:
        run = simulate_calibrated(args.seed, days=args.days, per_hour=args.per_hour, attempts=args.attempts)
        with tempfile.TemporaryDirectory() as folder:
            transactions, patterns = run.write(folder)
            runs["calibrated"] = score(
                read_patterns(patterns), read_amlworld(transactions, prefix="calibrated-background"), args.lag
            )
        title = (
            f"calibrated simulator: seed {args.seed}, {args.days:g} days, {args.per_hour:g} payments an hour"
        )
        print("\n" + report(title, runs["calibrated"], args.lag))
    write_results(
        "amlworld_detection" + ("_lag" if args.lag else ""),
        {
            "code": code_version(),
            "machine": machine(),
            "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            **runs,
            "at": time.time(),
        },
    )


if __name__ == "__main__":
    main()
