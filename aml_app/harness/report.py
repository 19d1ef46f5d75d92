"""What the demo prints: progress lines and the final summary."""

from __future__ import annotations

import math
from pathlib import Path

from aml_app.harness.dependencies import COMMIT_POLL_EVERY
from aml_app.harness.system import System
from aml_app.harness.verdict import Ledger, Verdict
from aml_app.simulation.score import format_payment_score, format_scores


def say(line: str = "") -> None:
    print(line, flush=True)


def fmt_ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.0f} ms"


def print_summary(
    v: Verdict, system: System, ledger: Ledger, spot_lines: list[str], ground_truth: Path
) -> None:
    """The summary at the end of a run: every check, then the detection scores."""
    assert system.watch is not None
    end = sum(ledger.ends.values())
    rows = [("payments produced", f"{v.valid + v.malformed} (valid {v.valid}, malformed {v.malformed})")]
    for s in v.services.values():
        rows += [
            (
                f"{s.service} decisions",
                f"{s.decided} payments ({s.records} records, {s.missing} missing)",
            ),
            (f"{s.service} alerts", f"{s.alerts} payments ({s.duplicate_alerts} alerted twice)"),
            (f"{s.service} premature", f"{s.premature_decisions} decisions before their dependencies"),
            (
                f"{s.service} freshness",
                f"{s.freshness_violations} violations, {s.decided_not_fresh} decided not fresh",
            ),
            (
                f"{s.service} gate wait",
                f"p50 {fmt_ms(s.wait_p50)}, p99 {fmt_ms(s.wait_p99)} (after warm-up)",
            ),
            (f"{s.service} end-to-end", f"p50 {fmt_ms(s.latency_p50)}, p99 {fmt_ms(s.latency_p99)}"),
            (
                f"{s.service} after commits",
                f"p50 {fmt_ms(s.after_commits_p50)}, p99 {fmt_ms(s.after_commits_p99)} (its own share)",
            ),
        ]
    rows.append(
        (
            "dependencies",
            f"committed p50 {fmt_ms(v.committed_p50)}, p99 {fmt_ms(v.committed_p99)} after produced",
        )
    )
    reasons = ", ".join(f"{reason} {n}" for reason, n in v.reasons.most_common())
    by = ", ".join(f"{s.dead_lettered} by {s.service}" for s in v.services.values())
    by += "".join(f", {n} by {g}" for g, n in v.dead_lettered.items())
    rows.append(("dead-lettered", by + (f" ({reasons})" if reasons else "")))
    for group, behind in v.behind.items():
        done = sum(system.watch.committed(group).values())
        state = "reached the log end" if not behind else f"{behind} records short of the log end"
        rows.append((f"{group}", f"committed {done} of {end} offsets: {state}"))
    polls = f"{system.watch.polls} polls every {COMMIT_POLL_EVERY * 1000:.0f} ms"
    rows.append(("commit watch", f"{polls}, {system.watch.advances} advances seen"))
    checked = len(spot_lines)
    rows.append(("API spot check", f"{checked - v.spot_failures} of {checked} payments OK"))
    rows += [(f"web view {w.worker_id}", w.page_url) for w in system.all_workers]
    metrics = [
        (
            "pipeline",
            f"http://{system.settings.dependencies.services_host}:{system.settings.pipeline.metrics_port}",
        )
    ]
    if system.stage is not None:
        host, port = (
            system.settings.dependencies.services_host,
            system.settings.pipeline.enrichment_metrics_port,
        )
        metrics.append(("enrichment", f"http://{host}:{port}"))
    metrics += [(f"{name} API", api.url) for name, api in system.apis.items()]
    rows += [(f"metrics {name}", f"{url}/metrics") for name, url in metrics if not url.endswith(":0")]
    rows.append(("result", "OK" if v.ok else "PROBLEM"))
    if spot_lines:
        say()
        say("spot check: B GET /relations/{payer}?hops=1&parts=out, C GET /aggregates/{payer}?at={ts}")
        for line in spot_lines:
            say(line)
    say()
    say("summary")
    say("-" * 78)
    width = max(22, *(len(name) + 2 for name, _ in rows))
    for name, value in rows:
        say(f"  {name:<{width}}{value}")
    say("-" * 78)
    for s in v.services.values():
        for p, o, group, covered, decided in s.premature[:5]:
            when = "never" if covered is None else f"{covered - decided:+.3f} s after the decision"
            say(f"  {s.service} premature: {p}:{o} decided before {group} committed past it ({when})")
    say()
    say(f"AML detection against the ground truth ({ground_truth.name}):")
    say(format_scores(v.scores))
    say(format_payment_score(v.payments))
