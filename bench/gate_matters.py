"""Why the gate matters: the same seeded traffic with a lagging dependency, gate on and gate off.

Two demo runs (`aml_app.harness.demo.Demo`: embedded broker, the Spark pipeline of B and C, their APIs,
the AML worker) on the same seed and rate, with Service B's query triggered only every `--lag` seconds, so
that B is behind most of the time. Gate on: the AML worker waits for both groups to commit past a payment.
Gate off (`--no-gate` in the demo): it decides at once on whatever B and C answer, as a plain consumer
would. Per run: freshness violations (answers of B or C that did not include the payment), decisions made
on such answers, decisions made before both groups committed past their payment, recall and precision per
typology against the simulator's ground truth, and the minority-class precision, recall and F1 over
payments.

    .venv/bin/python -m bench.gate_matters [--duration 40] [--rate 40] [--lag 5] [--seed 11]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from aml_app.harness.demo import Demo, Options
from aml_app.harness.verdict import Verdict
from aml_app.settings import load_settings
from aml_app.simulation.score import ratio_text
from bench.common import gate_on_and_off, markdown_table

NAME = "gate_matters"


def summary(verdict: Verdict) -> dict[str, Any]:
    aml = verdict.services["aml"]
    return {
        "gated": verdict.gated,
        "valid": verdict.valid,
        "decided": aml.decided,
        "missing": aml.missing,
        "freshness_violations": aml.freshness_violations,
        "decided_not_fresh": aml.decided_not_fresh,
        "premature": aml.premature_decisions,
        "alerts": aml.alerts,
        "wait_p50_ms": aml.wait_p50,
        "wait_p99_ms": aml.wait_p99,
        "latency_p50_ms": aml.latency_p50,
        "latency_p99_ms": aml.latency_p99,
        "scores": {
            t: {
                "instances": s.instances,
                "detected": s.detected,
                "recall": s.recall,
                "alerts": s.alerts,
                "precision": s.precision,
            }
            for t, s in verdict.scores.items()
        },
        "payments": {
            "laundering": verdict.payments.laundering,
            "flagged": verdict.payments.flagged,
            "true_flags": verdict.payments.true_flags,
            "precision": verdict.payments.precision,
            "recall": verdict.payments.recall,
            "f1": verdict.payments.f1,
        },
    }


async def run(args: argparse.Namespace, gate: bool) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"aml-bench-gate-{'on' if gate else 'off'}-"))
    options = Options(
        duration=args.duration,
        rate=args.rate,
        aml_workers=1,
        fraud_workers=0,
        seed=args.seed,
        instances=args.instances,
        gate=gate,
        triggers={"relations": args.lag},
        folder=folder,
    )
    verdict = await Demo(load_settings(), options).run()
    if verdict is None:
        raise RuntimeError("the run was interrupted")
    return summary(verdict) | {"folder": str(folder)}


def report(doc: dict[str, Any]) -> str:
    on, off = doc["runs"]["gate on"], doc["runs"]["gate off"]
    rows: list[tuple[Any, ...]] = [
        ("payments decided", on["decided"], off["decided"]),
        ("freshness violations (stale answers)", on["freshness_violations"], off["freshness_violations"]),
        ("decided on evidence lacking the payment", on["decided_not_fresh"], off["decided_not_fresh"]),
        ("decided before both groups committed it", on["premature"], off["premature"]),
        ("AML alerts", on["alerts"], off["alerts"]),
        (
            "end-to-end p50 / p99 (ms)",
            f"{on['latency_p50_ms']:.0f} / {on['latency_p99_ms']:.0f}",
            f"{off['latency_p50_ms']:.0f} / {off['latency_p99_ms']:.0f}",
        ),
    ]
    for typology, s_on in on["scores"].items():
        s_off = off["scores"][typology]
        rows.append(
            (
                f"{typology}: recall (detected / instances), precision",
                f"{ratio_text(s_on['recall'])} ({s_on['detected']}/{s_on['instances']}), "
                f"{ratio_text(s_on['precision'])}",
                f"{ratio_text(s_off['recall'])} ({s_off['detected']}/{s_off['instances']}), "
                f"{ratio_text(s_off['precision'])}",
            )
        )
    payments = [on["payments"], off["payments"]]
    rows.append(
        (
            "payments (minority class): precision, recall, F1",
            *(
                f"{ratio_text(x['precision'])}, {ratio_text(x['recall'])}, {ratio_text(x['f1'])}"
                for x in payments
            ),
        )
    )
    return markdown_table(["same seed, relations lagging", "gate on", "gate off"], rows)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=40)
    parser.add_argument("--rate", type=float, default=40)
    parser.add_argument("--lag", type=float, default=5, help="seconds between Service B's micro-batches")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--instances", type=int, default=3, help="instances of each typology")
    args = parser.parse_args()
    gate_on_and_off(NAME, args, run, report)


if __name__ == "__main__":
    cli()
