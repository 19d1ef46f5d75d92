"""The replay of Services B and C (`aml_app/training/replay.py`) answers what the real services answer a
detector, so the rules and the model see in the benchmarks and in training what they see in the worker."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace

from aml_app.dependencies.aggregates import HORIZON, floor_bucket
from aml_app.dependencies.client import PAYER_PARTS
from aml_app.detection.thresholds import AmlThresholds
from aml_app.training.reference import reference_aggregates, reference_relations
from aml_app.training.replay import BAND, HOPS, THRESHOLD, Services, asked, decided, row_of
from tests.real_amlworld import real_files


def _payment(pid: str, payer: str, payee: str, amount: str, minute: int) -> SimpleNamespace:
    return SimpleNamespace(
        payment_id=pid,
        payer=payer,
        payee=payee,
        amount=Decimal(amount),
        currency="USD",
        ts=f"2022-09-01T00:{minute:02d}:00+00:00",
    )


def test_b_answers_only_the_parts_the_detector_asks_for() -> None:
    """B leaves out a part it is not asked for (`PAYER_PARTS`, `PAYEE_PARTS`): the replay must too, or a
    model learns from a part that is always empty in the worker."""
    timeline = [_payment("p1", "a", "b", "5000", 0), _payment("p2", "b", "a", "4900", 5)]
    services = Services(AmlThresholds())
    for payment in timeline:
        services.feed(payment)
    evidence = services.evidence(timeline[1])  # b pays a back
    sent = [*services.sent_by["a"], *services.sent_by["b"]]
    whole = reference_relations(sent, "b", HOPS, at=services.newest)
    assert whole["cycle"]["found"] and whole["in"], "asked for every part, B names the cycle and b's payer"
    payer, payee = evidence.payer_relations, evidence.payee_relations
    assert set(payer.out) == {"a"}
    assert not payer.in_ and not payer.cycle.found and not payer.neighbourhood
    assert not payee.out and not payee.in_ and not payee.cycle.found and not payee.neighbourhood
    assert payee.loop.found and payee.loop.path == ("a", "b", "a")


def test_gate_on_the_evidence_holds_every_payment_of_the_same_instant() -> None:
    """The event-time gate admits a payment at t once B and C have applied every payment up to t, and both
    answer as of t: two payments into one account in the same minute (AMLworld's times are whole minutes)
    both see both. Gate off, each sees only what came before it."""
    timeline = [
        _payment("p1", "a", "x", "5000", 3),
        _payment("p2", "b", "x", "5000", 3),
        _payment("p3", "c", "x", "5000", 4),
    ]
    gated = {p.payment_id: e for p, e in decided(Services(AmlThresholds()), timeline)}
    received = {pid: e.payee_aggregates.window("1h").received_count for pid, e in gated.items()}
    assert received == {"p1": 2, "p2": 2, "p3": 3}
    lagging = {p.payment_id: e for p, e in decided(Services(AmlThresholds()), timeline, lag=True)}
    received = {pid: e.payee_aggregates.window("1h").received_count for pid, e in lagging.items()}
    assert received == {"p1": 0, "p2": 1, "p3": 2}


def test_a_payers_edges_summed_as_payments_come_are_the_references_loop_over_them() -> None:
    """B's `out` part about a payer, kept as each edge's running summary (counts, totals per currency in
    feed order, first and last payment), is the reference's loop over every payment of the payer: on the
    real files (several currencies, self-payments, a payer of over a hundred payments), asked as the replay
    asks, gate on and off. As of an instant before some payment fed, an edge first paid after it is not
    there (fails answering from the running summaries alone)."""

    def naive(services: Services, account: str, at: datetime) -> dict[str, object]:
        return asked(
            reference_relations(services.sent_by.get(account, []), account, HOPS, at=at), PAYER_PARTS
        )

    timeline = real_files()[2]
    gated, lagging = Services(AmlThresholds()), Services(AmlThresholds())
    checked = 0
    for n, (when, same) in enumerate(itertools.groupby(timeline, key=lambda p: row_of(p).ts)):
        instant = list(same)
        for payment in instant:
            if n % 5 == 0:  # gate off: before the payment is fed
                assert lagging.relations(payment.payer, when) == naive(lagging, payment.payer, when)
            lagging.feed(payment)
            gated.feed(payment)
        if n % 5 == 0:
            for payment in instant:
                assert gated.relations(payment.payer, when) == naive(gated, payment.payer, when)
                checked += 1
    assert checked > 1000
    busiest = max(gated.sent_by, key=lambda account: len(gated.sent_by[account]))
    assert len(gated.sent_by[busiest]) > 100 and len(gated.relations(busiest, when)["out"]) > 20
    early = [_payment("p1", "a", "b", "5000", 0), _payment("p2", "a", "c", "70.5", 5)]
    services = Services(AmlThresholds())
    for payment in early:
        services.feed(payment)
    between = row_of(_payment("at", "a", "b", "1", 2)).ts
    assert [edge["counterparty"] for edge in services.relations("a", between)["out"]] == ["b"]
    assert services.relations("a", between) == naive(services, "a", between)


def test_c_answers_from_what_it_holds_however_long_the_history() -> None:
    """C's windows about an account paid every six hours for three weeks, its retention a day past its
    week: the replay, which drops what C no longer holds, answers as the reference over the payments C
    holds, at the newest instant and three days before it, whose week reaches back past what C holds; and
    its list of the account's payments spans C's retention, not the history."""
    start = datetime(2022, 9, 1, tzinfo=UTC)
    history = [
        SimpleNamespace(
            payment_id=f"p{n}",
            payer=f"s{n % 5}",
            payee="x",
            amount=Decimal("100.25"),
            currency="USD",
            ts=(start + timedelta(hours=6 * n)).isoformat(),
        )
        for n in range(84)
    ]
    keep = timedelta(days=1)
    services = Services(AmlThresholds(), keep=keep)
    for payment in history:
        services.feed(payment)
    newest = row_of(history[-1]).ts
    kept = floor_bucket(newest - HORIZON - keep)
    for at in (newest, newest - timedelta(days=3)):
        held = [row_of(p) for p in history if kept <= row_of(p).ts <= at]
        assert services.aggregates("x", at) == reference_aggregates([held], "x", at, THRESHOLD, BAND)
    assert len(services.touching["x"]) == sum(1 for p in history if row_of(p).ts >= kept) < len(history)
