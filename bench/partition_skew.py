"""One partition of B and C held back: what each gate mode costs in recall and in latency.

    .venv/bin/python -m bench.partition_skew [--lag-hours 24] [--partitions 4] [--no-live]
        [--live-lag 2] [--live-seconds 20] [--rate 50]

**Recall** (replayed, real AMLworld data and the calibrated simulator). Payments go to partitions by
payer, as Kafka's default partitioner puts them (murmur2 of the key). Services B and C are the naive
reference (`aml_app/training/replay.py`), which answers as of the payment's time as the real ones do; they
apply every partition up to the wall-clock instant, except the held partition q, which they apply
`--lag-hours` behind. Each gate admits each payment at its own instant and the rules see what B and C
have applied by then:
- per-partition gate: a payment of another partition is admitted at its time t, with q's payments
  of (t - lag, t] missing; one of q at t + lag;
- event-time gate: every payment at t + lag (when q has applied t), with every payment up to t, and
  other partitions' payments of (t, t + lag] applied too;
- no skew: every payment with everything up to t (the reference for both);
- all ahead: no skew, but every partition applied up to t + lag when the payment is decided: a check
  that payments after t change no answer.
Each held partition in turn; own-typology recall per typology, the average over held partitions and
the worst one, and the share of alerted payments whose verdict differs from no skew.

**Latency** (live, the real gate: one worker of the probe service per mode on the embedded broker).
Payments are produced in real time (`ts` = now) at `--rate` a second for `--live-seconds`; the test plays
the dependency groups, committing every partition to its end every 100 ms except partition 0, which
they commit only up to its payments older than `--live-lag` seconds. Reported: decision latency
(decided_at - ts) of the held partition and of the others, per mode.

Results: `bench/results/partition_skew.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from aiokafka.partitioner import murmur2

from aml_app.detection.rules import TYPOLOGIES, aml_rules
from aml_app.detection.thresholds import AmlThresholds
from aml_app.kafka.tools import GroupCommitter, payment_json, produce
from aml_app.simulation.amlworld import read_amlworld, read_patterns
from aml_app.simulation.calibrated import simulate_calibrated
from aml_app.training.replay import Services
from bench.amlworld_detection import BACKGROUND, PATTERNS
from bench.common import bench_env, code_version, machine, markdown_table, write_results
from tests.harness import TopicReader


def partition_of(payer: str, partitions: int) -> int:
    """Kafka's default partitioner for a keyed record."""
    return (murmur2(payer.encode()) & 0x7FFFFFFF) % partitions


def replay(
    timeline: Sequence[Any],
    chosen: Callable[[int], bool],
    applied_until: Callable[[int, datetime], tuple[datetime, datetime]],
    held: set[int],
) -> dict[str, set[str]]:
    """payment id -> the typologies alerted, for the payments `chosen` (by index), in timeline order.

    `applied_until(i, t)` gives, for payment i at t, how far B and C have applied the other partitions
    and the held ones when the gate admits it; both must not decrease along the timeline.
    """
    thresholds = AmlThresholds()
    services = Services(thresholds)
    times = [datetime.fromisoformat(p.ts) for p in timeline]
    fed = [False] * len(timeline)
    pointers = {"free": 0, "held": 0}
    is_held = [p.partition in held for p in timeline]
    fired: dict[str, set[str]] = {}
    for i, payment in enumerate(timeline):
        if not chosen(i):
            continue
        free_until, held_until = applied_until(i, times[i])
        for kind, until in (("free", free_until), ("held", held_until)):
            j = pointers[kind]
            while j < len(timeline) and times[j] <= until:
                if is_held[j] == (kind == "held") and not fed[j]:
                    services.feed(timeline[j])
                    fed[j] = True
                j += 1
            pointers[kind] = j
        hits = aml_rules(services.evidence(payment), thresholds)
        if hits:
            fired[payment.payment_id] = {hit.typology for hit in hits}
    return fired


class Partitioned:
    """A payment with the partition its payer's key goes to."""

    def __init__(self, payment: Any, partition: int) -> None:
        self._payment = payment
        self.partition = partition

    def __getattr__(self, name: str) -> Any:
        return getattr(self._payment, name)


def recall(patterns: Any, fired: dict[str, set[str]]) -> dict[str, float | None]:
    found: dict[str, float | None] = {}
    for typology in TYPOLOGIES:
        attempts = [a for a in patterns.attempts if a.typology == typology]
        caught = sum(1 for a in attempts if any(typology in fired.get(p, ()) for p in a.payment_ids))
        found[typology] = round(caught / len(attempts), 3) if attempts else None
    caught_all = sum(
        1 for a in patterns.attempts if any(a.typology in fired.get(p, ()) for p in a.payment_ids)
    )
    found["all"] = round(caught_all / len(patterns.attempts), 3)
    return found


def changed(base: dict[str, set[str]], other: dict[str, set[str]]) -> float:
    """Share of the payments alerted in either run whose alerted typologies differ."""
    alerted = set(base) | set(other)
    return round(sum(1 for p in alerted if base.get(p) != other.get(p)) / max(len(alerted), 1), 4)


def skew(patterns: Any, background: Any, partitions: int, lag: timedelta) -> dict[str, Any]:
    timeline = sorted(
        (
            Partitioned(p, partition_of(p.payer, partitions))
            for p in [*background.payments, *patterns.payments]
        ),
        key=lambda p: p.ts,
    )
    started = time.perf_counter()
    base = replay(timeline, lambda i: True, lambda i, t: (t, t), set())
    runs: dict[str, Any] = {"no skew": {"recall": recall(patterns, base)}}
    # Every partition applied `lag` past each payment: answers as of t must not change.
    ahead = replay(timeline, lambda i: True, lambda i, t: (t + lag, t + lag), set())
    runs["all ahead"] = {"recall": recall(patterns, ahead), "changed": changed(base, ahead)}
    per_mode: dict[str, list[dict[str, Any]]] = {"per-partition gate": [], "event-time gate": []}
    for q in range(partitions):
        held = {q}
        on_held = [p.partition == q for p in timeline]
        off_held = [not on for on in on_held]
        others = replay(timeline, off_held.__getitem__, lambda i, t: (t, t - lag), held)
        own = replay(timeline, on_held.__getitem__, lambda i, t: (t + lag, t), held)
        per_partition = {**others, **own}
        event_time = replay(timeline, lambda i: True, lambda i, t: (t + lag, t), held)
        for mode, fired in (("per-partition gate", per_partition), ("event-time gate", event_time)):
            per_mode[mode].append(
                {"held": q, "recall": recall(patterns, fired), "changed": changed(base, fired)}
            )
    for mode, held_runs in per_mode.items():
        keys = list(held_runs[0]["recall"])
        mean = {
            k: None
            if held_runs[0]["recall"][k] is None
            else round(sum(r["recall"][k] for r in held_runs) / len(held_runs), 3)
            for k in keys
        }
        worst = min(held_runs, key=lambda r: r["recall"]["all"])
        runs[mode] = {"recall": mean, "worst": worst, "held": held_runs}
    runs["seconds"] = round(time.perf_counter() - started, 1)
    runs["timeline"] = len(timeline)
    return runs


def recall_table(doc: dict[str, Any]) -> str:
    base = doc["no skew"]["recall"]
    rows = []
    for typology in [*TYPOLOGIES, "all"]:
        if base[typology] is None:
            continue
        rows.append(
            [
                typology,
                base[typology],
                doc["per-partition gate"]["recall"][typology],
                doc["per-partition gate"]["worst"]["recall"][typology],
                doc["event-time gate"]["recall"][typology],
                doc["event-time gate"]["worst"]["recall"][typology],
            ]
        )
    headers = ["typology", "no skew", "per-partition (mean)", "(worst)", "event-time (mean)", "(worst)"]
    mean = {
        mode: sum(r["changed"] for r in doc[mode]["held"]) / len(doc[mode]["held"])
        for mode in ("per-partition gate", "event-time gate")
    }
    changes = (
        "alerted payments whose verdict differs from no skew, mean over held partitions: "
        f"per-partition {mean['per-partition gate']:.2%}, event-time {mean['event-time gate']:.2%}"
    )
    ahead = doc["all ahead"]
    changes += (
        "; with no skew but every partition applied the lag past each payment: "
        f"{ahead['changed']:.2%}, recall {ahead['recall']['all']}"
    )
    return markdown_table(headers, rows) + "\n\n" + changes


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


async def live(mode: str, lag: float, seconds: float, rate: float) -> dict[str, Any]:
    """Decision latency with partition 0's dependencies `lag` seconds behind, one probe worker."""
    async with bench_env() as env:
        names = await env.fresh_names(4)
        worker = env.start_worker(names, AML_GATE_MODE=mode)
        await worker.wait_ready(set(range(names.partitions)))
        reader = await TopicReader(env.bootstrap, names.decisions, names.partitions).start()
        sent: dict[int, list[tuple[int, float]]] = {p: [] for p in range(names.partitions)}
        committers = [
            await GroupCommitter([env.bootstrap], g, names.payments).start(range(names.partitions))
            for g in names.deps
        ]
        try:
            n = 0
            loop = asyncio.get_running_loop()
            start = loop.time()
            next_commit = start
            while loop.time() - start < seconds:
                now = time.time()
                batch = []
                for p in range(names.partitions):
                    ts = (
                        datetime.fromtimestamp(now, UTC)
                        .isoformat(timespec="microseconds")
                        .replace("+00:00", "Z")
                    )
                    value = payment_json(f"skew-{p}-{n}", f"acct-{p}", f"acct-y{n}", "10.00", ts)
                    batch.append((p, f"acct-{p}".encode(), value))
                for p, o in await produce(env.producer, names.payments, batch):
                    sent[p].append((o, now))
                n += 1
                if loop.time() >= next_commit:
                    offsets = {}
                    for p, placed in sent.items():
                        cutoff = time.time() - (lag if p == 0 else 0)
                        k = bisect.bisect_right([at for _, at in placed], cutoff)
                        offsets[p] = placed[k - 1][0] + 1 if k else 0
                    for c in committers:
                        await c.commit(offsets)
                    next_commit += 0.1
                await asyncio.sleep(max(0.0, start + n * len(sent) / rate - loop.time()))
            for c in committers:
                await c.commit({p: placed[-1][0] + 1 for p, placed in sent.items()})
            expected = sum(len(v) for v in sent.values())
            decisions: list[dict[str, Any]] = []
            deadline = loop.time() + 60 + lag
            while len(decisions) < expected and loop.time() < deadline:
                decisions += [json.loads(r.value) for r in await reader.poll(0.5)]
        finally:
            for c in committers:
                await c.stop()
            await reader.stop()
    produced_at = {(p, o): at for p, placed in sent.items() for o, at in placed}
    latency: dict[str, list[float]] = {"held partition": [], "other partitions": []}
    for d in decisions:
        decided = datetime.fromisoformat(d["decided_at"]).timestamp()
        key = "held partition" if d["partition"] == 0 else "other partitions"
        latency[key].append(1000 * (decided - produced_at[(d["partition"], d["offset"])]))
    return {
        "decided": len(decisions),
        "expected": expected,
        **{
            k: {"p50_ms": percentile(v, 0.5), "p99_ms": percentile(v, 0.99), "n": len(v)}
            for k, v in latency.items()
        },
    }


def replays(doc: dict[str, Any], args: argparse.Namespace, lag: timedelta) -> None:
    doc["real"] = skew(
        read_patterns(PATTERNS), read_amlworld(BACKGROUND, prefix="amlworld-background"), args.partitions, lag
    )
    print(
        f"## real AMLworld: {PATTERNS.name} in {BACKGROUND.name}, "
        f"one of {args.partitions} partitions {args.lag_hours:g} h behind\n"
    )
    print(recall_table(doc["real"]))
    run = simulate_calibrated(args.seed, days=14, per_hour=100, attempts=40)
    with tempfile.TemporaryDirectory() as folder:
        transactions, patterns = run.write(folder)
        doc["calibrated"] = skew(
            read_patterns(patterns),
            read_amlworld(transactions, prefix="calibrated-background"),
            args.partitions,
            lag,
        )
    print(f"\n## calibrated simulator, seed {args.seed}, 14 days\n")
    print(recall_table(doc["calibrated"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lag-hours", type=float, default=24.0, help="how far the held partition lags")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1, help="of the calibrated simulator")
    parser.add_argument("--no-live", action="store_true", help="skip the live latency runs")
    parser.add_argument("--no-replay", action="store_true", help="skip the recall replays")
    parser.add_argument("--live-lag", type=float, default=2.0, help="seconds partition 0 lags, live")
    parser.add_argument("--live-seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=50.0, help="payments a second, live")
    args = parser.parse_args()
    lag = timedelta(hours=args.lag_hours)
    doc: dict[str, Any] = {"code": code_version(), "machine": machine(), "params": vars(args)}
    if not args.no_replay:
        replays(doc, args, lag)
    if not args.no_live:
        doc["live"] = {
            mode: asyncio.run(live(mode, args.live_lag, args.live_seconds, args.rate))
            for mode in ("partition", "event-time")
        }
        rows = [
            [
                mode,
                part,
                r[part]["p50_ms"],
                r[part]["p99_ms"],
                r[part]["n"],
                f"{r['decided']}/{r['expected']}",
            ]
            for mode, r in doc["live"].items()
            for part in ("held partition", "other partitions")
        ]
        print(
            f"\n## live decision latency, partition 0 of 4 held {args.live_lag:g} s behind, {args.rate:g}/s\n"
        )
        print(markdown_table(["gate", "payments of", "p50 ms", "p99 ms", "n", "decided"], rows))
    doc["at"] = time.time()
    write_results("partition_skew", doc)


if __name__ == "__main__":
    main()
