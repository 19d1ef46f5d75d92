"""The replay of Services B and C (`aml_app/training/replay.py`) answers what the real services answer a
detector, so the rules and the model see in the benchmarks and in training what they see in the worker."""

from __future__ import annotations

from decimal import Decimal
from types import SimpleNamespace

from aml_app.detection.thresholds import AmlThresholds
from aml_app.training.reference import reference_relations
from aml_app.training.replay import HOPS, Services, decided


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
