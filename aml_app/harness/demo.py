"""`aml-app demo`: the whole system end to end, on real processes, with simulated laundering.

The demo starts (or reuses) a broker, Services B and C as a user runs them (`aml-app pipeline`, the Spark
streaming queries of both, and `aml-app serve relations|aggregates`, their APIs), the gated workers of
Service-A (AML) and Service-A1 (fraud), then the payment simulator (`aml_app.simulation`: background
traffic with injected instances of ten laundering typologies, and its ground truth), plus a
few malformed records for the dead-letter topic. It prints progress every two seconds.

At the end it checks what the gate promises and what detection achieved:
- no decision before every dependency group committed past its payment (`aml_app.harness.verify`; the commit
  watch dates each commit conservatively, so a decision it calls premature is premature for certain);
- every valid payment decided by each service, no alert twice, no freshness violation (an answer of B or
  C that did not include the payment) while the gate is on;
- both services caught up with the log, every malformed record dead-lettered by every service, the APIs
  answer about a sample of payments;
- precision and recall per typology of the AML alerts against the ground truth.

`--no-gate` runs the workers ungated and `--trigger relations=10` makes a dependency lag: the comparison
of BENCHMARKS.md ("why the gate matters") is two such runs on the same seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from aml_app.dependencies.store import redacted
from aml_app.harness import undecided
from aml_app.harness.embedded_postgres import PostgresError
from aml_app.harness.report import fmt_ms, print_summary, say
from aml_app.harness.system import Interrupted, Layout, System, SystemFailure
from aml_app.harness.tails import partitions_of
from aml_app.harness.verdict import Ledger, Sent, Verdict, judge
from aml_app.harness.verify import percentile
from aml_app.kafka.broker import BrokerError
from aml_app.kafka.tools import payment_json
from aml_app.settings import Settings
from aml_app.simulation.producer import SimulatorReport, payment_count, run_simulator
from aml_app.simulation.traffic import DEFAULT_SPEEDUP, default_start

DEMO_DIR = Path("var/demo")
MALFORMED_EVERY = 100  # one malformed record per hundred payments, so the DLQ shows up
PROGRESS_EVERY = 2.0
FIRST_BATCH_DEADLINE = 180.0  # Spark compiles its first micro-batch in 10-30 s on two cores
DRAIN_DEADLINE = 120.0
CLIENT_STOP_DEADLINE = 10.0
SPOT_CHECKS = 5


def utc_now_z() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


async def sleep_unless(event: asyncio.Event, seconds: float) -> None:
    """Sleep, but wake at once when `event` is set (a stop request)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), max(seconds, 0))


@dataclass
class Options:
    duration: float = 60.0
    rate: float = 50.0
    aml_workers: int = 1
    fraud_workers: int = 1
    seed: int = 7
    instances: int | None = None  # per typology; default one per thousand payments
    gate: bool = True
    triggers: Mapping[str, float] = field(default_factory=dict)
    folder: Path = DEMO_DIR
    drain_deadline: float = DRAIN_DEADLINE
    #: Service C reads payments.enriched, which the enrichment stage derives (`aml-app enrich`).
    derived: bool = False

    def problems(self) -> list[str]:
        found = []
        if not self.duration > 0 or not self.rate > 0:
            found.append("--duration and --rate must be positive")
        if self.aml_workers < 1 or self.fraud_workers < 0:
            found.append("--workers must be at least 1 and --fraud-workers at least 0")
        if self.rate * self.duration < 1:
            found.append("--rate times --duration must give at least one payment")
        return found


@dataclass
class Controls:
    """First Ctrl-C/SIGTERM stops producing and drains; a second one skips the drain."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)

    def on_signal(self) -> None:
        if self.stop.is_set():
            if not self.hurry.is_set():
                say("second stop request: skipping the drain, cleaning up")
            self.hurry.set()
        else:
            say("stop requested: finishing up (press Ctrl-C again to skip the drain)")
            self.stop.set()


class Demo:
    """One run of the demo; `run` returns the verdict (None when interrupted before the system was up)."""

    def __init__(
        self,
        settings: Settings,
        options: Options,
        *,
        suffix: str = "",
        bootstrap: Sequence[str] = (),
        store_url: str = "",
        script: Callable[[Demo], Coroutine[Any, Any, None]] | None = None,
        worker_env: Mapping[str, str] | None = None,
    ) -> None:
        """`suffix`, `bootstrap` and `store_url` let tests share a broker and a database server; `script`
        runs alongside the traffic (a test kills a worker or stops an API from it, timed with `elapsed`);
        `worker_env` goes to every worker."""
        self.options = options
        self.controls = Controls()
        if options.derived:
            settings = with_derived_aggregates(settings)
        layout = Layout(
            workers={"aml": options.aml_workers, "fraud": options.fraud_workers},
            gate=options.gate,
            triggers=dict(options.triggers),
            suffix=suffix,
            bootstrap=tuple(bootstrap),
            store_url=store_url,
            worker_env=dict(worker_env or {}),
        )
        self.system = System(settings, options.folder, layout, say=say, stop=self.controls.stop)
        self.script = script
        self.ledger = Ledger()
        self.report: SimulatorReport | None = None
        self.producer: AIOKafkaProducer | None = None
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.started = 0.0
        self.spot_lines: list[str] = []
        self.spot_failures = 0
        self.ground_truth = self.system.folder / "ground-truth.jsonl"
        #: The simulator's first event time (`default_start`, fixed by the warm-up, whose payments carry it):
        #: no simulated payment is older than the warm-up's, so none is past Service C's horizon behind it.
        self.first_event: datetime | None = None

    @property
    def settings(self) -> Settings:
        return self.system.settings

    async def run(self) -> Verdict | None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.controls.on_signal)
        try:
            try:
                await self.start()
            except Interrupted:
                say("interrupted during start-up")
                return None
            await self.flow()
            await self.drain()
            await self.spot_check()
            assert self.system.watch is not None
            await self.system.watch.settle()  # a decision already read must not find its commit undated
            verdict = judge(
                self.system,
                self.ledger,
                self.settings,
                gated=self.options.gate,
                report=self.report,
                spot_failures=self.spot_failures,
            )
            print_summary(verdict, self.system, self.ledger, self.spot_lines, self.ground_truth)
            return verdict
        finally:
            await _stop_clients(self)
            await self.system.cleanup()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    # ---- start-up

    async def start(self) -> None:
        await self.system.start()
        self.print_where_to_look()
        await self.system.wait_ready()
        self.producer = AIOKafkaProducer(bootstrap_servers=self.system.bootstrap, linger_ms=5, acks="all")
        await self.producer.start()
        await self.warm_up()

    def print_where_to_look(self) -> None:
        s, o, system = self.settings, self.options, self.system
        kind = "embedded Tansu broker" if system.broker else "KAFKA_BOOTSTRAP_SERVERS"
        say()
        say(
            f"AML demo: {o.rate:g} payments/s for {o.duration:g} s, seed {o.seed}, "
            f"gate {'on' if o.gate else 'OFF'}"
        )
        say(f"  Kafka         {','.join(system.bootstrap)} ({kind}), topic {s.kafka.payments_topic}")
        say(f"                ({s.kafka.partitions} partitions), dead letters {s.kafka.dlq_topic}")
        triggers = ", ".join(f"{k} every {v:g} s" for k, v in o.triggers.items())
        say(
            f"  Services B, C `aml-app pipeline` (Spark {s.pipeline.spark_master}, "
            f"trigger {s.pipeline.trigger_interval:g} s"
            + (f"; {triggers}" if triggers else "")
            + f"), stores in {redacted(system.settings.dependencies.store_url)}"
        )
        for name, api in system.apis.items():
            say(f"                {name:<13}{api.url}/health")
        say(f"  gated on      {', '.join(s.depends_on)} (committed consumer-group offsets)")
        for service, workers in system.workers.items():
            for w in workers:
                say(f"  {service:<13} worker {w.worker_id}: web view {w.page_url}")
        say(f"  ground truth  {self.ground_truth}")
        say(f"  logs          {system.folder}/")
        say("  Ctrl-C stops producing early, drains and prints the summary")
        say()

    async def warm_up(self) -> None:
        """One payment per partition; wait until every group committed past them (Spark's first batch)."""
        system, s = self.system, self.settings
        assert self.producer is not None and system.watch is not None
        tail = next(iter(system.decisions.values()))
        partitions = await partitions_of(tail.consumer, s.kafka.payments_topic, s.kafka.partitions)
        o = self.options
        self.first_event = default_start(
            payment_count(o.rate, o.duration), o.rate, DEFAULT_SPEEDUP, datetime.now(UTC)
        )
        first = self.first_event.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        sent_at = time.time()
        for p in partitions:
            sent = Sent(f"warm-{uuid.uuid4().hex[:8]}-{p}", f"warm-up-{p}", "warm-up-sink", first)
            value = payment_json(sent.payment_id, sent.payer, sent.payee, "1.00", sent.ts)
            meta = await (
                await self.producer.send(
                    s.kafka.payments_topic, key=sent.payer.encode(), value=value, partition=p
                )
            )
            self.ledger.place(meta.partition, meta.offset, sent, sent_at)
            self.ledger.warm_up.add(sent.payment_id)
        say(
            f"warm-up: one payment per partition; waiting for the pipeline's first micro-batch "
            f"(up to {FIRST_BATCH_DEADLINE:.0f} s)"
        )
        started = time.monotonic()
        pending = list(system.groups)
        next_note = started + 10
        while pending:
            if self.controls.stop.is_set():
                raise Interrupted
            system.check_health()
            for group in [g for g in pending if not system.watch.behind(g, self.ledger.ends)]:
                say(f"  {group} committed past them after {time.monotonic() - started:.1f} s")
                pending.remove(group)
            if time.monotonic() - started > FIRST_BATCH_DEADLINE:
                assert system.pipeline is not None
                raise SystemFailure(
                    f"the pipeline did not commit for {', '.join(pending)} within "
                    f"{FIRST_BATCH_DEADLINE:.0f} s; see {system.pipeline.log_path}"
                )
            if pending and time.monotonic() >= next_note:
                say(f"  still waiting for {', '.join(pending)} ({time.monotonic() - started:.0f} s)")
                next_note += 10
            await asyncio.sleep(0.1)

    # ---- the flow of payments

    async def flow(self) -> None:
        """Run the simulator (and the malformed records) for `duration` seconds; report every 2 s."""
        o, s = self.options, self.settings
        assert self.producer is not None
        self.started = time.monotonic()
        self.tasks["payment simulator"] = asyncio.create_task(
            run_simulator(
                self.system.bootstrap,
                s.kafka.payments_topic,
                o.rate,
                o.duration,
                o.seed,
                str(self.ground_truth),
                start=self.first_event,
                reporting_threshold=s.dependencies.reporting_threshold,
                threshold_band=s.dependencies.threshold_band,
                thresholds=s.detection.aml_thresholds,
                instances=o.instances,
                prefix=f"sim{o.seed}-{uuid.uuid4().hex[:4]}",  # ids stay unique on a shared cluster
                producer=self.producer,
                stop=self.controls.stop,
                on_sent=self.ledger.on_sent,
            )
        )
        self.tasks["malformed records"] = asyncio.create_task(self.send_malformed())
        if self.script is not None:
            self.tasks["test script"] = asyncio.create_task(self.script(self))
        say(f"simulating {o.rate:g} payments/s (one malformed record per {MALFORMED_EVERY})")
        next_report = PROGRESS_EVERY
        simulator = self.tasks["payment simulator"]
        while not simulator.done() and not self.controls.stop.is_set():
            await sleep_unless(self.controls.stop, min(next_report - self.elapsed(), 0.5))
            self.system.check_health(self.tasks)
            if self.elapsed() >= next_report:
                await self.progress()
                next_report += PROGRESS_EVERY
        self.controls.stop.set()
        try:
            self.report = await asyncio.wait_for(simulator, CLIENT_STOP_DEADLINE)
            await asyncio.wait_for(self.tasks["malformed records"], CLIENT_STOP_DEADLINE)
            if self.script is not None:  # a script may go on after the traffic (it is awaited in drain)
                self.system.check_health(self.tasks)
        except TimeoutError:
            raise SystemFailure("the payment simulator did not stop within 10 s") from None
        except KafkaError as exc:
            raise SystemFailure(f"producing payments failed: {exc!r}") from exc

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    async def send_malformed(self) -> None:
        """One record in a hundred breaks the contract, cycling through three faults."""
        assert self.producer is not None
        interval = MALFORMED_EVERY / self.options.rate
        n = 0
        while not await self._stopped_within(interval):
            payer = f"acct-bad-{n % 7}"
            value = payment_json(f"bad-{uuid.uuid4().hex[:8]}", payer, "acct-x", "10.00", utc_now_z())
            if n % 3 == 0:
                value = value[:-9]  # truncated: not JSON
            else:
                doc = json.loads(value)
                if n % 3 == 1:
                    doc["amount"] = "-" + doc["amount"]
                else:
                    del doc["payee"]
                value = json.dumps(doc).encode()
            meta = await (
                await self.producer.send(self.settings.kafka.payments_topic, key=payer.encode(), value=value)
            )
            self.ledger.place(meta.partition, meta.offset, None, time.time())
            n += 1

    async def _stopped_within(self, seconds: float) -> bool:
        await sleep_unless(self.controls.stop, seconds)
        return self.controls.stop.is_set() or self.elapsed() >= self.options.duration

    # ---- progress

    def sources(self) -> tuple[str, ...]:
        """Who dead-letters: each gated service, then each dependency group (or the stage it reads)."""
        return (*self.system.services, *self.system.dead_letter_sources)

    async def progress(self, prefix: str = "") -> None:
        """One line: sent, decided and alerted per service, dependency lag, partitions held by the gate."""
        system = self.system
        assert system.watch is not None
        ids = self.ledger.ids()
        decided = " ".join(f"{svc} {len(t.distinct(ids))}" for svc, t in system.decisions.items())
        alerts = " ".join(f"{svc} {len(t.distinct(ids))}" for svc, t in system.alerts.items())
        lag = " ".join(f"{g} {system.watch.behind(g, self.ledger.ends)}" for g in system.groups)
        held, longest, answered = await system.waiting()
        holding = f"held {held}" + (f" (longest {longest:.1f}s)" if held and longest >= 1 else "")
        if not answered:
            holding += "+? (a worker did not answer)"
        waits = [float(d.get("waited_ms", 0)) for t in system.decisions.values() for d in t.of_run(ids)]
        say(
            f"{prefix}{self.elapsed():6.1f}s  sent {len(ids) - len(self.ledger.warm_up)}  decided {decided}  "
            f"alerts {alerts}  lag {lag}  {holding}  wait p50 {fmt_ms(percentile(waits, 50))}"
        )

    # ---- the end

    def caught_up(self) -> bool:
        """Dependencies at the log end; every payment decided and dead-lettered by every service."""
        system, ledger = self.system, self.ledger
        assert system.watch is not None and system.dead_letters is not None
        if any(system.watch.behind(g, ledger.ends) for g in system.groups):
            return False
        ids = ledger.ids()
        if any(len(t.distinct(ids)) != len(ids) for t in system.decisions.values()):
            return False
        return all(
            len(system.dead_letters.of_run(s, ledger.malformed)) == len(ledger.malformed)
            for s in self.sources()
        )

    async def drain(self) -> None:
        say(
            f"stopped producing after {self.elapsed():.1f} s ({self.ledger.produced} records); "
            f"letting the services and the workers catch up (up to {self.options.drain_deadline:.0f} s)"
        )
        deadline = time.monotonic() + self.options.drain_deadline
        next_report = time.monotonic() + PROGRESS_EVERY
        script = self.tasks.get("test script")
        while not (self.caught_up() and (script is None or script.done())):
            if self.controls.hurry.is_set():
                say("drain skipped")
                return
            if time.monotonic() > deadline:
                say(
                    "not everything was committed, decided and dead-lettered within "
                    f"{self.options.drain_deadline:.0f} s"
                )
                try:
                    await asyncio.wait_for(undecided.report(self), undecided.REPORT_DEADLINE_S)
                except Exception as exc:  # a report that fails must not hide the run's own verdict
                    say(f"could not say where the undecided payments are: {exc!r}")
                return
            self.system.check_health(self.tasks)
            if time.monotonic() >= next_report:
                await self.progress(prefix="drain ")
                next_report += PROGRESS_EVERY
            await sleep_unless(self.controls.hurry, 0.2)
        await self.progress(prefix="done  ")

    async def committed_on(self, topic: str, group: str) -> dict[int, int]:
        """`group`'s committed offsets on `topic` (nothing committed: 0)."""
        from aml_app.kafka.offsets import DependencyOffsets

        s = self.settings
        reader = DependencyOffsets(s.kafka.bootstrap_servers, topic, [group], security=s.kafka.security)
        try:
            _, committed = await reader.read()
        finally:
            await reader.close()
        return {d: o or 0 for d, o in committed[group].items()}

    async def spot_check(self) -> None:
        """Ask B and C about a few payments: their as_of covers it, B lists the payee, C counts it."""
        if self.controls.hurry.is_set() or not self.ledger.valid:
            return
        relations, aggregates = (self.system.live_api(kind) for kind in ("relations", "aggregates"))
        chosen = random.sample(sorted(self.ledger.valid.items()), min(SPOT_CHECKS, len(self.ledger.valid)))
        # C reading the stage's topic states its as_of there: it must reach C's group's committed offsets
        # on that topic, which (the verdict checks) place the group past every payment.
        group = self.settings.aggregates_group
        derived = self.settings.derived_dependencies.get(group)
        derived_ends = await self.committed_on(derived[0], group) if derived else None
        for (p, o), pay in sorted(chosen):
            rel, agg = await asyncio.gather(
                relations.get(f"/relations/{pay.payer}", {"hops": "1", "parts": "out"}),
                aggregates.get(f"/aggregates/{pay.payer}", {"at": pay.ts}),
            )
            problems = []
            if rel is None or agg is None:
                problems.append("an API did not answer")
                rel, agg = rel or {}, agg or {}
            rel_upto = int(rel.get("as_of", {}).get(str(p), 0))
            agg_upto = int(agg.get("as_of", {}).get(str(p), 0))
            agg_covers = agg_upto > o
            if derived_ends is not None:
                agg_as_of = {int(d): int(n) for d, n in agg.get("as_of", {}).items()}
                agg_covers = sum(derived_ends.values()) > 0 and all(
                    agg_as_of.get(d, 0) >= end for d, end in derived_ends.items()
                )
            out = {c["counterparty"] for c in rel.get("out", [])}
            sent = agg.get("windows", {}).get("1h", {}).get("sent_count", 0)
            checks = [
                (rel_upto > o, f"B's as_of p{p}={rel_upto} does not cover it"),
                (pay.payee in out, f"B does not list {pay.payee} among the payer's out counterparties"),
                (
                    agg_covers,
                    f"C's as_of p{p}={agg_upto} does not cover it"
                    if derived_ends is None
                    else f"C's as_of {agg.get('as_of')} does not reach its group's offsets {derived_ends}",
                ),
                (sent >= 1, "C counts no payment sent in the hour up to its ts"),
            ]
            problems += [text for good, text in checks if not good]
            self.spot_failures += bool(problems)
            c_as_of = f"C as_of p{p}={agg_upto}" if derived_ends is None else "C as_of at its group's offsets"
            self.spot_lines.append(
                f"  p{p}:{o} {pay.payer} -> {pay.payee} at {pay.ts}: B as_of p{p}={rel_upto}, "
                f"{c_as_of}, 1h sent_count {sent}  "
                + ("OK" if not problems else "PROBLEM: " + "; ".join(problems))
            )


async def _stop_clients(demo: Demo) -> None:
    """Producer tasks first (they use the producer), then the producer, each step bounded."""
    for task in demo.tasks.values():
        if not task.done():
            task.cancel()
    if demo.tasks:
        await asyncio.wait(demo.tasks.values(), timeout=CLIENT_STOP_DEADLINE)
    if demo.producer is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(demo.producer.stop(), CLIENT_STOP_DEADLINE)


def with_derived_aggregates(settings: Settings) -> Settings:
    """`settings` with Service C reading the topic the enrichment stage derives from payments (the demo's
    `--derived`; AML_DERIVED_DEPENDENCIES in a deployment)."""
    stage = (settings.kafka.enriched_topic, settings.kafka.enrichment_group)
    return replace(
        settings, derived_dependencies={**settings.derived_dependencies, settings.aggregates_group: stage}
    )


def run_demo(settings: Settings, options: Options) -> int:
    """Run the demo; 0 when every check passed."""
    problems = options.problems()
    if problems:
        say("demo: " + "; ".join(problems))
        return 2
    try:
        verdict = asyncio.run(_run(settings, options))
    except KeyboardInterrupt:  # a Ctrl-C before our handler was installed
        return 130
    if verdict is None:
        return 130
    return 0 if verdict.ok else 1


async def _run(settings: Settings, options: Options) -> Verdict | None:
    try:
        return await Demo(settings, options).run()
    except (SystemFailure, BrokerError, PostgresError, KafkaError, OSError) as exc:
        say(f"demo failed: {exc}")
        raise SystemExit(1) from None


def run_comparison(settings: Settings, options: Options, variants: Sequence[bool]) -> list[Verdict | None]:
    """Several demo runs on the same seed, e.g. gate on and gate off (for the benchmark)."""
    results = []
    for gate in variants:
        results.append(asyncio.run(Demo(settings, Options(**{**options.__dict__, "gate": gate})).run()))
    return results
