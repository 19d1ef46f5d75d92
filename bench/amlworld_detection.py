"""The AML rules on real AMLworld data: its laundering attempts replayed into its real background traffic.

    .venv/bin/python -m bench.amlworld_detection [--patterns FILE] [--background FILE] [--lag]

Every attempt of a patterns file (`LI-Medium_Patterns.txt`: 456 attempts of eight typologies, with every
payment) and every row of a transactions file (`HI-Small_Trans_rows1-7500.csv`: real background traffic)
go into one timeline, in event-time order; Services B and C are the naive reference
(`tests/replay.py`), so the evidence about each payment is what the stores would answer once they have
applied it and everything before it (the gate on). `--lag` gives each payment only the evidence before it
(a service reading behind its dependencies, the gate off).

Scored as the AMLworld papers report it, per attempt and over payments:
- an attempt is caught by its own typology when one of its payments got an alert of that typology, and
  by any alert when one of its payments got any alert;
- a typology's precision is the share of the payments its rule alerted that are laundering (of any
  attempt: real patterns overlap, a scatter-gather's sink is a fan-in too);
- the benign alert rate is the share of background payments labelled 0 that got any alert, with the
  rules that fired on them;
- over payments, minority-class precision, recall and F1 of "any alert" against "laundering" (an
  attempt's payment, or a background row labelled 1).

Default inputs are the copies in `tests/data/amlworld/` (see its README for their source and licence).
Results: `bench/results/amlworld_detection.json`.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aml_app.detection.rules import TYPOLOGIES, aml_rules
from aml_app.detection.thresholds import AmlThresholds
from aml_app.simulation.amlworld import read_amlworld, read_patterns
from bench.common import PROJECT, code_version, machine, markdown_table, write_results
from tests.replay import Services

DATA = PROJECT / "tests" / "data" / "amlworld"
PATTERNS = DATA / "LI-Medium_Patterns.txt"
BACKGROUND = DATA / "HI-Small_Trans_rows1-7500.csv"


def replay(payments: list[Any], lag: bool) -> dict[str, list[str]]:
    """payment id -> the rules that fired on it, in the timeline's order."""
    thresholds = AmlThresholds()
    services = Services(thresholds)
    fired: dict[str, list[str]] = {}
    for payment in payments:
        if not lag:
            services.feed(payment)
        hits = aml_rules(services.evidence(payment), thresholds)
        if hits:
            fired[payment.payment_id] = [f"{hit.typology}:{hit.rule}" for hit in hits]
        if lag:
            services.feed(payment)
    return fired


def ratio(n: int, d: int) -> float | None:
    return round(n / d, 3) if d else None


def judge(patterns: Any, background: Any, fired: dict[str, list[str]]) -> dict[str, Any]:
    """The scores described in the module docstring."""
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
        alerted = [pid for pid, found in typologies.items() if typology in found]
        per_typology[typology] = {
            "attempts": len(own_attempts),
            "own_typology": own,
            "any_alert": any_alert,
            "own_recall": ratio(own, len(own_attempts)),
            "any_recall": ratio(any_alert, len(own_attempts)),
            "alerted_payments": len(alerted),
            "precision": ratio(sum(1 for pid in alerted if pid in laundering), len(alerted)),
        }
    own_all = sum(v["own_typology"] for v in per_typology.values())  # typologies without attempts add 0
    any_all = sum(v["any_alert"] for v in per_typology.values())
    benign = [p for p in background.payments if not p.is_laundering]
    benign_alerted = [p for p in benign if p.payment_id in fired]
    benign_rules = Counter(rule for p in benign_alerted for rule in fired[p.payment_id])
    flagged = set(fired)
    true_flags = len(flagged & laundering)
    return {
        "per_typology": per_typology,
        "all": {
            "attempts": len(attempts),
            "own_recall": ratio(own_all, len(attempts)),
            "any_recall": ratio(any_all, len(attempts)),
        },
        "benign": {
            "payments": len(benign),
            "alerted": len(benign_alerted),
            "rate": ratio(len(benign_alerted), len(benign)),
            "by_rule": dict(benign_rules.most_common()),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", type=Path, default=PATTERNS)
    parser.add_argument("--background", type=Path, default=BACKGROUND)
    parser.add_argument("--lag", action="store_true", help="evidence before each payment only (gate off)")
    args = parser.parse_args()
    patterns = read_patterns(args.patterns)
    background = read_amlworld(args.background, prefix="amlworld-background")
    timeline = sorted([*background.payments, *patterns.payments], key=lambda p: p.ts)
    started = time.perf_counter()
    fired = replay(timeline, lag=args.lag)
    elapsed = time.perf_counter() - started
    doc = judge(patterns, background, fired)
    rows = [
        [t, v["attempts"], v["own_recall"], v["any_recall"], v["alerted_payments"], v["precision"]]
        for t, v in doc["per_typology"].items()
    ] + [["all", doc["all"]["attempts"], doc["all"]["own_recall"], doc["all"]["any_recall"], "", ""]]
    headers = ["typology", "attempts", "own-typology recall", "any-alert recall", "alerted", "precision"]
    print(markdown_table(headers, rows))
    benign, payments = doc["benign"], doc["payments"]
    print(
        f"\nbenign payments alerted: {benign['alerted']} of {benign['payments']} ({benign['rate']}); "
        f"by rule: {benign['by_rule']}"
    )
    print(
        f"payments: {payments['laundering']} laundering, {payments['flagged']} flagged, "
        f"precision {payments['precision']}, recall {payments['recall']}, F1 {payments['f1']}"
    )
    print(f"replayed {len(timeline)} payments in {elapsed:.1f} s ({'lagging' if args.lag else 'gated'})")
    write_results(
        "amlworld_detection" + ("_lag" if args.lag else ""),
        {
            "code": code_version(),
            "machine": machine(),
            "patterns": str(args.patterns),
            "background": str(args.background),
            "lag": args.lag,
            "timeline": len(timeline),
            "seconds": round(elapsed, 1),
            **doc,
            "at": time.time(),
        },
    )


if __name__ == "__main__":
    main()
