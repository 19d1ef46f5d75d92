"""The AML service on real AMLworld data through the whole system: Kafka, Spark, PostgreSQL, the APIs and a
gated worker, gate on and gate off.

    .venv/bin/python -m bench.amlworld_system [--days-per-second 0.25] [--deadline 600] [--model amlworld]
        [--retention 2592000]

The same data as `bench/amlworld_detection.py` (LI-Medium's 456 attempts in the first 7,500 rows of
HI-Small), sent in event-time order as `aml-app import-amlworld` sends them, paced: `--days-per-second`
days of event time per second of wall time. Pacing matters: Service C drops a payment more than 7 days
older than the newest one it has seen (its windows' horizon), so 27 days of sparse attempts sent at once
would land in one micro-batch and lose their first 20 days; at half a day a second, 15 payments of a run
still reached C more than a week older than the newest it had applied (14 s of wall time) and were not
stored, so the default is a quarter. Compressed so, time also makes a gated
worker's lag look long: 16 s behind B and C in wall time is 8 days behind in event time, past what C keeps
by default (`AML_AGGREGATES_RETENTION`, a day past its week), and the worker then decides on pruned
windows where in real time it would be seconds behind. `--retention` (default 30 days, the files' span)
sets what C keeps; the results count the decisions made on pruned windows, and the payments C found too
late to store (more than a week older than the newest it had applied). Each run starts its own system
(`aml_app.harness.system`), waits until the AML worker has decided every payment, reads its alerts topic
and scores them as the replay benchmark does (`judge`). Gate on, the figures should equal the replay's
with the reference B and C; gate off, the worker decides on what B and C hold when it asks. `--model`
runs the worker with `AML_MODEL` set (results `amlworld_system_model.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from aml_app.harness.system import Layout, System
from aml_app.settings import load_settings
from aml_app.simulation.amlworld import read_amlworld, read_patterns
from aml_app.simulation.amlworld_command import send_payments
from bench.amlworld_detection import BACKGROUND, PATTERNS, judge, timeline_of, with_evidence
from bench.common import gate_on_and_off, markdown_table

NAME = "amlworld_system"


async def run(args: argparse.Namespace, gate: bool) -> dict[str, Any]:
    patterns = read_patterns(PATTERNS)
    background = read_amlworld(BACKGROUND, prefix="amlworld-background")
    timeline = timeline_of(patterns, background)
    folder = Path(tempfile.mkdtemp(prefix=f"aml-bench-amlworld-{'on' if gate else 'off'}-"))
    env = {"AML_MODEL": args.model} if args.model else {}
    layout = Layout(workers={"aml": 1}, gate=gate, api_replicas=1, worker_env=env)
    system = System(load_settings(), folder, layout)
    try:
        await system.start()
        await system.wait_ready()
        started = time.monotonic()
        sent = await send_payments(
            system.bootstrap,
            system.settings.kafka.payments_topic,
            timeline,
            security=system.settings.kafka.security,
            days_per_second=args.days_per_second,
        )
        ids = {p.payment_id for p in timeline}
        decisions = system.decisions["aml"]
        while len(decisions.distinct(ids)) < len(ids):
            if time.monotonic() - started > args.deadline:
                done = len(decisions.distinct(ids))
                raise RuntimeError(f"{done} of {len(ids)} payments decided within {args.deadline:.0f} s")
            system.check_health()
            await asyncio.sleep(0.5)
        seconds = time.monotonic() - started
        alerts = system.alerts["aml"].of_run(ids)
        # C keeps a day past its week before its newest event time: a worker lagging further behind B and
        # C than that decides on pruned windows, and its verdicts are not the replay's.
        pruned = {d["payment_id"] for d in decisions.of_run(ids) if "pruned" in d.get("note", "")}
        # And a payment a week older than the newest C has applied is too late for C: not stored.
        last = timeline[-1]
        answer = await system.live_api("aggregates").get(f"/aggregates/{last.payer}", {"at": last.ts})
        late = answer["late_dropped"] if isinstance(answer, dict) else None
    finally:
        await system.cleanup()
    fired: dict[str, list[str]] = {}
    for alert in alerts:
        fired.setdefault(alert["payment_id"], []).extend(
            f"{hit['typology']}:{hit['rule']}" for hit in alert.get("hits", [])
        )
    return {
        "gate": gate,
        "sent": sent,
        "seconds": round(seconds, 1),
        "decided_on_pruned_windows": len(pruned),
        "too_late_for_c": late,
        "folder": str(folder),
    } | judge(patterns, background, fired, with_evidence(timeline))


def report(doc: dict[str, Any]) -> str:
    on, off = doc["runs"]["gate on"], doc["runs"]["gate off"]
    rows = [
        [t, v["attempts"], v["own_recall"], off["per_typology"][t]["own_recall"]]
        for t, v in on["per_typology"].items()
        if v["attempts"]
    ]
    rows.append(["all", on["all"]["attempts"], on["all"]["own_recall"], off["all"]["own_recall"]])
    rows.append(["benign alerted", on["benign"]["payments"], on["benign"]["rate"], off["benign"]["rate"]])
    rows.append(["payment F1", on["payments"]["laundering"], on["payments"]["f1"], off["payments"]["f1"]])
    rows.append(["payments too late for C", on["sent"], on["too_late_for_c"], off["too_late_for_c"]])
    rows.append(
        [
            "decided on pruned windows",
            on["sent"],
            on["decided_on_pruned_windows"],
            off["decided_on_pruned_windows"],
        ]
    )
    return markdown_table(["typology", "attempts", "own-typology recall, gate on", "gate off"], rows)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days-per-second", type=float, default=0.25, help="event time sent per second")
    parser.add_argument("--deadline", type=float, default=600, help="seconds to decide every payment")
    parser.add_argument("--model", default="", help="AML_MODEL for the worker (default: the rules)")
    parser.add_argument(
        "--retention", type=float, default=30 * 86400, help="AML_AGGREGATES_RETENTION of C, in seconds"
    )
    args = parser.parse_args()
    os.environ["AML_AGGREGATES_RETENTION"] = f"{args.retention:g}"  # the pipeline inherits it
    gate_on_and_off(NAME + ("_model" if args.model else ""), args, run, report)


if __name__ == "__main__":
    cli()
