"""The simulator (pure): deterministic, every payment on contract, a background that is a DAG and stays out
of the structuring band, every typology injected as asked with a consistent ground truth that survives a
file; and the scoring on hand-made inputs. No Kafka."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner

from aml_app.contract import validate_payment
from aml_app.detection.rules import TYPOLOGIES
from aml_app.detection.thresholds import AmlThresholds
from aml_app.simulation.command import _summary, simulate_command
from aml_app.simulation.producer import (
    BURST_SECONDS,
    MIN_BURST,
    SimulatorReport,
    payment_count,
    run_simulator,
)
from aml_app.simulation.score import format_payment_score, format_scores, payment_score, score
from aml_app.simulation.traffic import (
    Instance,
    SimPayment,
    Simulation,
    ahead_of_sending,
    default_start,
    read_ground_truth,
    simulate,
)

START = datetime(2026, 3, 1, 9, tzinfo=UTC)
THRESHOLD = Decimal("10000")
BAND = Decimal("0.1")
AML = AmlThresholds()


@pytest.fixture(scope="module")
def run() -> Simulation:
    return simulate(seed=7, count=4000, rate=50, start=START, instances=2)


def background(simulation: Simulation) -> list[SimPayment]:
    return [p for p in simulation.payments if p.typology is None]


def find_cycle(edges: set[tuple[str, str]]) -> list[str] | None:
    """A directed cycle among `edges`, or None (iterative depth-first search with three colours)."""
    successors: dict[str, list[str]] = defaultdict(list)
    for payer, payee in sorted(edges):
        successors[payer].append(payee)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(successors):
        if state.get(root):
            continue
        path, stack = [root], [iter(successors[root])]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(successors.get(nxt, [])))
    return None


# --------------------------------------------------------------------------- determinism and the contract


def test_same_seed_same_payments_and_ground_truth(run: Simulation, tmp_path: Path) -> None:
    again = simulate(seed=7, count=4000, rate=50, start=START, instances=2)
    assert again.payments == run.payments
    assert again.records() == run.records()
    assert again.instances == run.instances
    run.write_ground_truth(tmp_path / "a.jsonl")
    again.write_ground_truth(tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_a_different_seed_gives_different_payments(run: Simulation) -> None:
    other = simulate(seed=8, count=4000, rate=50, start=START, instances=2)
    assert [(p.payer, p.payee, p.amount) for p in other.payments] != [
        (p.payer, p.payee, p.amount) for p in run.payments
    ]
    assert [i.payment_ids for i in other.instances] != [i.payment_ids for i in run.instances]


def test_every_payment_is_on_contract_and_keyed_by_its_payer(run: Simulation) -> None:
    for payment, (key, value) in zip(run.payments, run.records(), strict=True):
        fields = validate_payment(key, value, 65536)
        assert key == payment.payer.encode()
        assert fields == {
            "payment_id": payment.payment_id,
            "payer": payment.payer,
            "payee": payment.payee,
            "amount": payment.amount,
            "currency": payment.currency,
            "ts": payment.ts,
            "channel": payment.channel,
            "country": payment.country,
        }
        assert Decimal(payment.amount).as_tuple().exponent == -2
        assert payment.ts.endswith("Z")
    assert len({p.payment_id for p in run.payments}) == len(run.payments)


def test_event_time_follows_the_send_clock_and_never_goes_back_per_payer(run: Simulation) -> None:
    # 50 payments/s, 60 simulated seconds per real second: 1.2 s of event time per payment.
    assert run.payments[0].when == START
    assert run.payments[-1].when == START + timedelta(seconds=1.2 * 3999)
    last: dict[str, datetime] = {}
    for payment in run.payments:
        assert payment.when >= last.get(payment.payer, payment.when)
        last[payment.payer] = payment.when
    slower = simulate(seed=7, count=10, rate=5, start=START, instances=0, speedup=1)
    assert [p.when - START for p in slower.payments] == [timedelta(seconds=0.2 * n) for n in range(10)]


@pytest.mark.parametrize(
    ("count", "rate", "speedup"), [(3000, 50, 60), (4000, 50, 60), (7, 3, 60), (10, 5, 1), (10, 5, 0.5)]
)
def test_the_default_start_ends_the_simulated_clock_at_the_last_send(
    count: int, rate: float, speedup: float
) -> None:
    """No payment is timestamped after it is sent, even when sending starts the moment the start is
    chosen; with a clock that gains on sending, the last payment is stamped within a second of its send."""
    now = datetime(2026, 11, 28, 21, 45, 11, 987654, tzinfo=UTC)
    start = default_start(count, rate, speedup, now)
    assert start.microsecond == 0 and start <= now
    simulation = simulate(seed=3, count=count, rate=rate, start=start, instances=0, speedup=speedup)
    ahead = [p.when - (now + timedelta(seconds=n / rate)) for n, p in enumerate(simulation.payments)]
    assert max(ahead) <= timedelta(0)
    assert ahead_of_sending(start, count, rate, speedup, now) == pytest.approx(max(ahead).total_seconds())
    if speedup > 1:
        assert ahead[-1] > -timedelta(seconds=1 + (speedup - 1) / rate)
    else:
        assert start == now.replace(microsecond=0)
    # 50/s for 60 s at 60 times: the simulated hour ends at the last send, 59 minutes back from now.
    assert default_start(3000, 50, 60, now) == datetime(2026, 11, 28, 20, 46, 11, tzinfo=UTC)


def test_start_in_another_timezone_is_written_in_utc() -> None:
    shifted = simulate(
        seed=1,
        count=10,
        rate=5,
        start=datetime(2026, 3, 1, 10, tzinfo=timezone(timedelta(hours=1))),
        instances=0,
    )
    assert shifted.payments[0].ts == "2026-03-01T09:00:00.000Z"


# --------------------------------------------------------------------------- the background


def test_background_graph_has_no_directed_cycle(run: Simulation) -> None:
    edges = {(p.payer, p.payee) for p in background(run)}
    assert len(edges) > 1000
    assert find_cycle(edges) is None
    # The check itself finds a cycle when there is one: the injected cycles.
    injected = {(p.payer, p.payee) for p in run.payments if p.typology == "cycle"}
    assert find_cycle(edges | injected) is not None


def test_a_longer_faster_background_is_still_a_dag() -> None:
    busy = simulate(seed=3, count=20000, rate=400, start=START, instances=1)
    assert find_cycle({(p.payer, p.payee) for p in background(busy)}) is None


@pytest.mark.parametrize(("threshold", "band"), [(THRESHOLD, BAND), (Decimal("500"), Decimal("0.2"))])
def test_background_amounts_never_fall_in_the_structuring_band(threshold: Decimal, band: Decimal) -> None:
    simulation = simulate(
        seed=5,
        count=4000,
        rate=50,
        start=START,
        instances=1,
        reporting_threshold=threshold,
        threshold_band=band,
    )
    low = threshold * (1 - band)
    amounts = [p.decimal_amount for p in background(simulation)]
    assert not [a for a in amounts if low <= a < threshold]
    if threshold == Decimal("500"):
        assert max(amounts) > threshold  # the band is inside the background's range: it was avoided
    structuring = [p.decimal_amount for p in simulation.payments if p.typology == "structuring"]
    assert structuring and all(low <= a < threshold for a in structuring)


def test_background_is_mostly_eur_with_some_usd_and_gbp(run: Simulation) -> None:
    currencies = [p.currency for p in background(run)]
    share = {c: currencies.count(c) / len(currencies) for c in set(currencies)}
    assert set(share) == {"EUR", "USD", "GBP"}
    assert share["EUR"] > 0.7
    assert share["USD"] > 0.03 and share["GBP"] > 0.01


def test_background_keeps_its_own_accounts(run: Simulation) -> None:
    injected = {a for i in run.instances for a in i.accounts}
    touched = {a for p in background(run) for a in (p.payer, p.payee)}
    assert not injected & touched


# --------------------------------------------------------------------------- the injected instances


def test_every_typology_is_injected_as_many_times_as_asked(run: Simulation) -> None:
    for typology in TYPOLOGIES:
        assert len(run.instances_of(typology)) == 2
    per_typology = run.payments_per_typology()
    assert sum(per_typology.values()) == 4000
    for typology in TYPOLOGIES:
        assert per_typology[typology] == sum(len(i.payment_ids) for i in run.instances_of(typology))
    none = simulate(seed=7, count=500, rate=50, start=START, instances=0)
    assert none.instances == () and all(p.typology is None for p in none.payments)


def test_ground_truth_matches_the_payments(run: Simulation) -> None:
    by_id = {p.payment_id: p for p in run.payments}
    order = {p.payment_id: n for n, p in enumerate(run.payments)}
    all_accounts: list[str] = []
    for instance in run.instances:
        payments = [by_id[pid] for pid in instance.payment_ids]
        assert {(p.typology, p.instance_id) for p in payments} == {(instance.typology, instance.instance_id)}
        assert [order[pid] for pid in instance.payment_ids] == sorted(
            order[pid] for pid in instance.payment_ids
        )
        assert {a for p in payments for a in (p.payer, p.payee)} == set(instance.accounts)
        assert instance.completes in instance.payment_ids
        all_accounts += instance.accounts
    assert len(all_accounts) == len(set(all_accounts))  # every instance on its own accounts
    labelled = {p.payment_id for p in run.payments if p.typology}
    assert labelled == {pid for i in run.instances for pid in i.payment_ids}


def test_instance_shapes(run: Simulation) -> None:
    by_id = {p.payment_id: p for p in run.payments}
    low = THRESHOLD * (1 - BAND)
    for instance in run.instances:
        payments = [by_id[pid] for pid in instance.payment_ids]
        done = instance.payment_ids.index(instance.completes)
        span = payments[-1].when - payments[0].when
        if instance.typology == "structuring":
            assert len({p.payer for p in payments}) == 1
            assert all(low <= p.decimal_amount < THRESHOLD for p in payments)
            assert done == AML.structuring_min_count - 1 and span < timedelta(hours=24)
        elif instance.typology in ("fan_in", "fan_out"):
            hub_side, other_side = ("payee", "payer") if instance.typology == "fan_in" else ("payer", "payee")
            assert len({getattr(p, hub_side) for p in payments}) == 1
            minimum = getattr(AML, f"{instance.typology}_min_counterparties")
            assert len({getattr(p, other_side) for p in payments}) == len(payments) >= minimum
            assert done == minimum - 1 and all(p.decimal_amount >= 1500 for p in payments)
        elif instance.typology == "cycle":
            assert len(payments) in (2, 3) and done == len(payments) - 1
            assert [p.payee for p in payments[:-1]] == [p.payer for p in payments[1:]]
            assert payments[-1].payee == payments[0].payer
            assert all(p.decimal_amount < AML.pass_through_min_received for p in payments)
        elif instance.typology == "pass_through":
            deposit, onward = payments[0], payments[1:]
            assert {p.payer for p in onward} == {deposit.payee} and span < timedelta(hours=1)
            forwarded = sum(p.decimal_amount for p in onward[:done])
            assert forwarded >= AML.pass_through_min_ratio * deposit.decimal_amount
            assert (
                forwarded - onward[done - 1].decimal_amount
                < AML.pass_through_min_ratio * deposit.decimal_amount
            )
            assert deposit.decimal_amount >= AML.pass_through_min_received
        else:
            assert_layering_shape(instance.typology, payments, done)


def assert_layering_shape(typology: str, payments: list[SimPayment], done: int) -> None:
    """The AMLworld layering patterns: their structure, heavy amounts, and the payment that completes them."""
    heavy = [p for p in payments if p.decimal_amount >= AML.graph_min_average]
    received: dict[str, Decimal] = defaultdict(Decimal)
    for p in payments:
        received[p.payee] += p.decimal_amount
    if typology == "gather_scatter":
        hub = payments[done].payer
        gather = [p for p in payments if p.payee == hub]
        scatter = [p for p in payments if p.payer == hub]
        assert len(gather) + len(scatter) == len(payments)
        minimum = AML.gather_scatter_min_counterparties
        assert minimum <= len({p.payer for p in gather}) <= minimum + 2
        assert minimum <= len({p.payee for p in scatter}) <= minimum + 2
        assert payments[: len(gather)] == gather and done == len(gather) + minimum - 1
        assert all(p.decimal_amount >= 1500 for p in gather)
        assert sum(p.decimal_amount for p in scatter) < AML.pass_through_min_ratio * received[hub]
        return
    assert heavy == payments  # every layering payment is heavy
    if typology == "scatter_gather":
        k = len(payments) // 2
        source, sink = payments[0].payer, payments[-1].payee
        assert {p.payer for p in payments[:k]} == {source} and {p.payee for p in payments[k:]} == {sink}
        assert [p.payee for p in payments[:k]] == [p.payer for p in payments[k:]] and 3 <= k <= 5
        assert done == k + 2
    elif typology == "random":
        assert [p.payee for p in payments[:-1]] == [p.payer for p in payments[1:]]
        walk = [payments[0].payer, *(p.payee for p in payments)]
        assert len(set(walk)) == len(walk) and 3 <= len(payments) <= 5 and done == 2
    elif typology == "bipartite":
        sources, targets = {p.payer for p in payments}, {p.payee for p in payments}
        assert {(p.payer, p.payee) for p in payments} == {(s, d) for s in sources for d in targets}
        assert len(payments) == len(sources) * len(targets) and not sources & targets
        assert done == len(targets) + 1
    else:
        assert typology == "stack"
        middle = {p.payee for p in payments} & {p.payer for p in payments}
        sources = {p.payer for p in payments} - middle
        targets = {p.payee for p in payments} - middle
        assert 2 <= len(middle) <= 3 and 2 <= len(sources) <= 3 and 2 <= len(targets) <= 3
        assert {(p.payer, p.payee) for p in payments} == {(s, m) for s in sources for m in middle} | {
            (m, d) for m in middle for d in targets
        }
        assert done == len(sources) * len(middle)
    # No receiving account reaches the pass-through minimum, so that rule stays out of these patterns.
    assert max(received.values()) < AML.pass_through_min_received or typology == "scatter_gather"


def test_heavy_background_flows_are_stars_of_depth_one(run: Simulation) -> None:
    """Only edges whose average payment reaches graph_min_average count for the layering rules: in the
    background they must form no chain, no shared payee, no two-step flow. Every edge averaging more than
    the largest person-to-person payment (800, below any default-like threshold) is a settlement, and the
    settlements (whatever their amounts) are stars: each supplier paid by one merchant, and never paying."""
    assert Decimal(800) < AML.graph_min_average
    totals: dict[tuple[str, str, str], list[Decimal]] = defaultdict(list)
    for p in background(run):
        totals[(p.payer, p.payee, p.currency)].append(p.decimal_amount)
    settlements = {(u, v) for u, v, _ in totals if "-s" in v}
    assert len(settlements) > 10 and all("-m" in u for u, _ in settlements)
    heavy = {(u, v) for (u, v, _), a in totals.items() if sum(a) > 800 * len(a)}
    assert heavy <= settlements
    suppliers = [v for _, v in settlements]
    assert len(suppliers) == len(set(suppliers))  # one payer each: no block, no gathering
    assert not set(suppliers) & {u for u, _, _ in totals}  # suppliers never pay: no chain


def test_instances_are_spread_over_the_run(run: Simulation) -> None:
    order = {p.payment_id: n for n, p in enumerate(run.payments)}
    starts = sorted(order[i.payment_ids[0]] for i in run.instances)
    assert starts[0] < 4000 * 0.25 and starts[-1] > 4000 * 0.5


def test_instances_follow_configured_thresholds() -> None:
    strict = AmlThresholds(structuring_min_count=5, fan_in_min_counterparties=12, cycle_min_hops=3)
    simulation = simulate(seed=2, count=4000, rate=50, start=START, instances=2, thresholds=strict)
    for instance in simulation.instances_of("structuring"):
        assert len(instance.payment_ids) >= 5 and instance.payment_ids.index(instance.completes) == 4
    for instance in simulation.instances_of("fan_in"):
        assert len(instance.payment_ids) >= 12
    for instance in simulation.instances_of("cycle"):
        assert len(instance.payment_ids) == 3


# --------------------------------------------------------------------------- the ground truth file


def test_ground_truth_round_trips_through_the_file(run: Simulation, tmp_path: Path) -> None:
    path = tmp_path / "truth.jsonl"
    run.write_ground_truth(path)
    lines = path.read_text().splitlines()
    assert len(lines) == len(run.instances)
    assert json.loads(lines[0])["typology"] in TYPOLOGIES
    assert read_ground_truth(path) == list(run.instances)


def _line(**fields: object) -> str:
    doc = {
        "typology": "cycle",
        "instance_id": "c1",
        "payment_ids": ["a"],
        "accounts": ["x"],
        "completes": "a",
    }
    return json.dumps({**doc, **fields})


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1]", "expected a JSON object"),
        ('{"typology": "cycle"}', "missing field"),
        (_line(payment_ids=["a"], completes="b"), "not one of its payment_ids"),
        (_line(payment_ids=[], completes="a"), "payment_ids must be a non-empty list"),
        (_line(accounts=["x", 3]), "accounts must be a non-empty list"),
        (_line(typology=""), "typology must be a non-empty string"),
    ],
)
def test_a_bad_ground_truth_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "truth.jsonl"
    good = Instance("fan_in", "f1", ("p1",), ("a", "b"), "p1")
    path.write_text(json.dumps(good.as_json()) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"truth.jsonl:2: .*{message}"):
        read_ground_truth(path)


# --------------------------------------------------------------------------- bad parameters


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 0}, "count must be"),
        ({"rate": 0}, "rate must be"),
        ({"rate": float("inf")}, "rate must be"),
        ({"start": datetime(2026, 3, 1)}, "timezone-aware"),
        ({"count": 300, "instances": 5}, "at most a third may be injected"),
        ({"instances": -1}, "instances must be"),
        ({"speedup": 0}, "speedup must be"),
        ({"rate": 1, "speedup": 1200}, "1,200 simulated seconds per payment, more than 900"),
    ],
)
def test_impossible_parameters_are_refused(kwargs: dict, message: str) -> None:
    arguments = {"seed": 1, "count": 1000, "rate": 50.0, "start": START, **kwargs}
    with pytest.raises(ValueError, match=message):
        simulate(**arguments)


def test_payment_count() -> None:
    assert payment_count(50, 60) == 3000
    assert payment_count(0.5, 3) == 1
    # As written, not as the binary product (28.999999999999996) truncates.
    assert payment_count(0.29, 100) == 29 and payment_count(0.57, 100) == 57
    for rate, duration in ((0, 60), (50, 0), (0.1, 1), (50, float("inf")), (float("nan"), 60)):
        with pytest.raises(ValueError):
            payment_count(rate, duration)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "0"], "--rate"),
        (["--duration", "-5"], "--duration"),
        (["--start", "yesterday"], "not an ISO-8601 instant"),
        (["--start", "2026-03-01T09:00:00"], "has no timezone"),
        (["--rate", "1", "--duration", "0.5"], "sends no payment"),
        (["--duration", "inf"], "'inf' is not a finite number"),
        (["--speedup", "nan"], "'nan' is not a finite number"),
        (["--start", "0001-01-01T00:30:00+01:00"], "before year 1 or after 9999"),
        (["--start", "9999-12-31T23:30:00-01:00"], "before year 1 or after 9999"),
    ],
)
def test_the_command_refuses_bad_options_before_connecting(args: list[str], message: str) -> None:
    result = CliRunner().invoke(simulate_command, args, env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert result.exit_code == 2
    assert message in result.output


def test_the_command_refuses_a_start_that_would_timestamp_payments_after_they_are_sent() -> None:
    """A --start that puts payments more than AML_MAX_CLOCK_SKEW after their send time is one sentence,
    not a run whose payments every consumer dead-letters; the simulator's own skew bound is the one."""
    args = ["--rate", "50", "--duration", "60", "--start", "2099-01-01T00:00:00Z"]
    env = {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    result = CliRunner().invoke(simulate_command, args, env=env)
    assert result.exit_code == 2
    assert "would timestamp payments up to" in result.output and "AML_MAX_CLOCK_SKEW (5 s)" in result.output
    assert "every consumer would dead-letter them" in result.output
    # Now, at 60 times for 60 s, would run an hour ahead of sending; a start 59 minutes back would not.
    now = datetime.now(UTC).replace(microsecond=0)
    result = CliRunner().invoke(simulate_command, [*args[:4], "--start", now.isoformat()], env=env)
    assert result.exit_code == 2 and "start at or before" in result.output


def test_a_ground_truth_that_cannot_be_written_is_named_as_such(tmp_path: Path) -> None:
    """Not as a failure to reach Kafka: nothing was sent, and the file is what went wrong."""
    path = tmp_path / "missing" / "truth.jsonl"
    args = ["--rate", "50", "--duration", "10", "--ground-truth", str(path)]
    result = CliRunner().invoke(simulate_command, args, env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert result.exit_code == 1
    assert f"could not write the ground truth to {path}: No such file or directory" in result.output
    assert "Kafka" not in result.output


def test_the_command_reports_a_bad_threshold_variable() -> None:
    result = CliRunner().invoke(simulate_command, [], env={"AML_RULE_FAN_IN_MIN_AVERAGE": "lots"})
    assert result.exit_code == 1
    assert "AML_RULE_FAN_IN_MIN_AVERAGE='lots'" in result.output


# --------------------------------------------------------------------------- scoring

TRUTH = [
    Instance("cycle", "c1", ("p1", "p2", "p3"), ("a", "b", "c"), "p3"),
    Instance("cycle", "c2", ("p4", "p5"), ("d", "e"), "p5"),
    Instance("fan_in", "f1", ("p6", "p7"), ("f", "g", "h"), "p7"),
]


def test_score_perfect() -> None:
    scores = score([("p3", "cycle"), ("p5", "cycle"), ("p7", "fan_in"), ("p6", "fan_in")], TRUTH)
    assert (scores["cycle"].recall, scores["cycle"].precision) == (1.0, 1.0)
    assert (scores["fan_in"].recall, scores["fan_in"].precision) == (1.0, 1.0)
    assert (scores["fan_in"].detected, scores["fan_in"].alerts, scores["fan_in"].true_alerts) == (1, 2, 2)


def test_score_missed_instance_and_false_positive() -> None:
    alerts = [("p3", "cycle"), ("bg-1", "cycle"), ("p7", "fan_in")]
    scores = score(alerts, TRUTH)
    assert scores["cycle"].recall == 0.5  # c2 missed
    assert scores["cycle"].precision == 0.5  # bg-1 is background
    assert (scores["fan_in"].recall, scores["fan_in"].precision) == (1.0, 1.0)


def test_score_an_alert_of_the_wrong_typology_neither_detects_nor_counts_as_true() -> None:
    scores = score([("p4", "fan_in"), ("p3", "cycle")], TRUTH)
    assert scores["cycle"].recall == 0.5  # p4 belongs to c2, but the alert says fan_in
    assert scores["fan_in"].precision == 0.0 and scores["fan_in"].recall == 0.0


def test_score_counts_duplicate_alerts_once() -> None:
    scores = score([("bg-1", "cycle")] * 3 + [("p1", "cycle")] * 3, TRUTH)
    assert (scores["cycle"].alerts, scores["cycle"].true_alerts, scores["cycle"].precision) == (2, 1, 0.5)


def test_score_zero_denominators_are_none_and_shown_as_n_a() -> None:
    scores = score([("bg-1", "structuring")], TRUTH)
    assert scores["structuring"].recall is None  # no instances
    assert scores["structuring"].precision == 0.0
    assert scores["pass_through"].recall is None and scores["pass_through"].precision is None
    assert scores["cycle"].precision is None and scores["cycle"].recall == 0.0  # no alerts
    assert list(scores)[: len(TYPOLOGIES)] == list(TYPOLOGIES)
    table = format_scores(scores).splitlines()
    assert table[0].split() == ["typology", "instances", "detected", "recall", "alerts", "precision"]
    assert table[1 + TYPOLOGIES.index("pass_through")].split() == [
        "pass_through",
        "0",
        "0",
        "n/a",
        "0",
        "n/a",
    ]


def test_score_keeps_typologies_it_does_not_know() -> None:
    scores = score([("x", "velocity_spike")], [])
    assert scores["velocity_spike"].alerts == 1 and scores["velocity_spike"].precision == 0.0


def test_payment_score_is_minority_class_f1_over_payments() -> None:
    # TRUTH labels p1..p7 laundering; bg-1 is background. Flag p3 twice (two typologies), p4, and bg-1.
    alerts = [("p3", "cycle"), ("p3", "random"), ("p4", "fan_in"), ("bg-1", "cycle")]
    result = payment_score(alerts, TRUTH)
    assert (result.flagged, result.laundering, result.true_flags) == (3, 7, 2)
    assert result.precision == pytest.approx(2 / 3) and result.recall == pytest.approx(2 / 7)
    assert result.f1 == pytest.approx(2 * (2 / 3) * (2 / 7) / (2 / 3 + 2 / 7))
    assert "F1 0.400" in format_payment_score(result)
    quiet = payment_score([], TRUTH)
    assert (quiet.precision, quiet.recall, quiet.f1) == (None, 0.0, 0.0)
    assert payment_score([], []).f1 is None


# --------------------------------------------------------------------------- pacing


class _Sent:
    def __init__(self, offset: int) -> None:
        self.partition, self.offset = 0, offset


class _SlowProducer:
    """Acknowledges at once, but each send costs `cost` seconds of the event loop: slower than the rate."""

    def __init__(self, cost: float) -> None:
        self.cost, self.sent = cost, 0

    async def send(
        self, topic: str, key: bytes | None = None, value: bytes | None = None
    ) -> asyncio.Future[_Sent]:
        began = time.perf_counter()
        while time.perf_counter() - began < self.cost:
            pass
        future: asyncio.Future[_Sent] = asyncio.get_running_loop().create_future()
        future.set_result(_Sent(self.sent))
        self.sent += 1
        return future


async def test_a_producer_slower_than_the_rate_sends_in_bounded_bursts() -> None:
    """Each burst holds at most a tenth of a second of the rate (at least MIN_BURST payments), so a stop
    or a progress line waits for one bounded burst, not for the whole backlog (bursts grew without bound:
    [1, 526, 2166, ...] at 50,000/s)."""
    bursts: dict[float, int] = defaultdict(int)

    def on_sent(payment: SimPayment, partition: int, offset: int, sent_at: float) -> None:
        bursts[sent_at] += 1

    rate = 4000.0  # 400 a burst at most; the producer manages about 2,000/s
    report = await run_simulator(
        [], "payments", rate, 1.0, 3, None, producer=_SlowProducer(0.0005), on_sent=on_sent, start=START
    )
    assert report.sent == 4000 and sum(bursts.values()) == 4000
    assert max(bursts.values()) <= max(MIN_BURST, int(rate * BURST_SECONDS))
    assert len(bursts) >= 10


def test_the_summary_says_when_the_rate_was_not_reached(capsys: pytest.CaptureFixture[str]) -> None:
    simulation = simulate(seed=1, count=200, rate=100, start=START, instances=0)
    report = SimulatorReport("payments", 200, simulation, None, sent=200, elapsed=4.0)
    report.payments_per_typology = {t: 0 for t in (*TYPOLOGIES, "background")}
    _summary(report, 100)
    assert "sent at 50/s, below the 100/s asked" in capsys.readouterr().out
    report.elapsed = 2.0
    _summary(report, 100)
    assert "below" not in capsys.readouterr().out


def test_the_summary_of_a_stopped_run_names_the_instances_not_fully_sent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    simulation = simulate(seed=1, count=3000, rate=100, start=START, instances=2)
    sent = simulation.payments[:1500]
    report = SimulatorReport("payments", 3000, simulation, "truth.jsonl", sent=1500, elapsed=15.0)
    report.payments_per_typology = {t: 0 for t in (*TYPOLOGIES, "background")}
    report.placements = {p.payment_id: (0, n) for n, p in enumerate(sent)}
    report.stopped_early = True
    ids = {p.payment_id for p in sent}
    unsent = sum(not set(i.payment_ids) <= ids for i in simulation.instances)
    assert 0 < unsent < len(simulation.instances)
    _summary(report, 100)
    assert f"it lists {unsent} instance(s) not fully sent" in capsys.readouterr().out
