"""The replay of Services B and C (`aml_app/training/replay.py`) answers what the real services answer a
detector, so the rules and the model see in the benchmarks and in training what they see in the worker."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest

from aml_app.dependencies.aggregates import HORIZON, floor_bucket
from aml_app.dependencies.client import PAYER_PARTS
from aml_app.dependencies.relations import LOOP_MAX_PAYEES, LOOP_SPAN
from aml_app.detection.exchange import ExchangeRates
from aml_app.detection.thresholds import AmlThresholds
from aml_app.training import replay as replay_module
from aml_app.training.reference import reference_aggregates, reference_loop, reference_relations
from aml_app.training.replay import (
    BAND,
    HOPS,
    THRESHOLD,
    Reporting,
    Services,
    asked,
    decided,
    row_of,
    windows_of,
)
from tests.real_amlworld import real_files


def _payment(
    pid: str, payer: str, payee: str, amount: str, minute: int, currency: str = "USD"
) -> SimpleNamespace:
    return SimpleNamespace(
        payment_id=pid,
        payer=payer,
        payee=payee,
        amount=Decimal(amount),
        currency=currency,
        ts=(datetime(2022, 9, 1, tzinfo=UTC) + timedelta(minutes=minute)).isoformat(),
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


def test_c_computes_an_accounts_windows_once_an_instant_and_again_after_a_payment_fed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three payments into x in one minute: all three are fed before any is asked about, so C's answer
    about x at that minute is computed once for the three; a payment fed after it is counted."""
    computed: list[str] = []

    def counted(held: list[Any], account: str, at: datetime, reporting: Reporting) -> dict[str, Any]:
        computed.append(account)
        return windows_of(held, account, at, reporting)

    monkeypatch.setattr(replay_module, "windows_of", counted)
    same = [_payment(f"p{n}", f"s{n}", "x", "100", 3) for n in range(3)]
    services = Services(AmlThresholds())
    asked_about = list(decided(services, same))
    assert computed.count("x") == 1 and len(asked_about) == 3
    at = row_of(same[0]).ts
    assert asked_about[0][1].payee_aggregates == asked_about[2][1].payee_aggregates
    services.feed(_payment("p3", "s3", "x", "100", 3))
    assert services.aggregates("x", at)["windows"]["1h"]["received_count"] == 4
    assert computed.count("x") == 2


def test_a_payees_layering_read_off_heavy_edges_is_the_references_loop() -> None:
    """B's `chain`, `sources` and `co_payees` about a payee, read off the heavy edges kept up as payments
    are fed, are the reference's loop over the payments into and out of the payee's payers: on the real
    files at every instant, gate on and off, and on a history built to hold each part, where an edge
    whose average falls below the minimum stops being heavy (fails while it still counts: y's payers
    would be three)."""
    timeline = real_files()[2]
    gated, lagging = Services(AmlThresholds()), Services(AmlThresholds())
    shown = 0
    for when, same in itertools.groupby(timeline, key=lambda p: row_of(p).ts):
        instant = list(same)
        for payment in instant:  # gate off: before the payment is fed
            assert lagging.layering(payment.payee, payment.payer, when) == lagging.layering_as_of(
                payment.payee, payment.payer, when
            )
            lagging.feed(payment)
            gated.feed(payment)
        for payment in instant:
            layering = gated.layering(payment.payee, payment.payer, when)
            assert layering == gated.layering_as_of(payment.payee, payment.payer, when)
            shown += any(layering.values())
    assert shown > 1000

    built = [
        _payment("1", "s", "u", "5000", 0),  # the chain s -> u -> c -> x
        _payment("2", "u", "c", "4800", 1),
        _payment("3", "c", "x", "4600", 2),
        _payment("4", "m1", "x", "2000", 3),  # x's heavy payers m1 and m2 ...
        _payment("5", "m2", "x", "2500", 4, "EUR"),
        _payment("6", "r", "m1", "3000", 5),  # ... both paid by r: a source
        _payment("7", "r", "m2", "3000", 6),
        _payment("8", "m1", "y", "1500", 7),  # ... both paying y: a co-payee
        _payment("9", "m2", "y", "1500", 8),
        _payment("10", "m3", "x", "2000", 9),  # heavy, then light: 2,010 over 3 payments
        _payment("11", "m3", "y", "1500", 10),
        _payment("12", "m3", "x", "5", 11),
        _payment("13", "m3", "x", "5", 12),
    ]
    services = Services(AmlThresholds())
    for payment in built:
        services.feed(payment)
    at = row_of(built[-1]).ts
    layering = services.layering("x", "c", at)
    assert layering == services.layering_as_of("x", "c", at)
    assert layering == {
        "chain": ["s", "u", "c", "x"],
        "sources": [{"source": "r", "via": ["m1", "m2"]}],
        "co_payees": [{"account": "y", "shared": 2}],
    }


def test_a_payees_loop_walked_over_edges_paid_within_its_span_is_the_references() -> None:
    """B's `loop` about a payee, walking only the edges paid within its span (`Services.live_out`), is
    the walk over every edge made by then and, at every 250th payment, the reference's over every payment
    fed: on the real files, gate on. On a history built for it, an edge first paid long ago but paid
    again within the span is walked (fails when an edge expires by its first payment: the longer loop
    through m), and an account that paid more than LOOP_MAX_PAYEES, most long ago, still ends the walk
    (fails when only its recent payees count: the loop through b)."""
    services, fed, found = Services(AmlThresholds()), [], 0
    for when, same in itertools.groupby(real_files()[2], key=lambda p: row_of(p).ts):
        instant = list(same)
        for payment in instant:
            services.feed(payment)
            fed.append(payment)
        for payment in instant:
            loop = services.loop(payment.payee, payment.payer, when)
            assert loop == services.loop_as_of(payment.payee, payment.payer, when)
            if len(fed) % 250 == 0:
                assert loop == reference_loop(
                    fed, payment.payee, payment.payer, when, services.loop_hops, LOOP_SPAN, LOOP_MAX_PAYEES
                )
            found += loop["found"]
    assert found > 200

    day, now = 1440, 30 * 1440
    built = [
        _payment("1", "x", "c", "900", now - 20 * day),  # too long ago for a loop closed now
        *(_payment(f"b{n}", "b", f"p{n}", "900", now - 20 * day) for n in range(LOOP_MAX_PAYEES + 1)),
        _payment("2", "x", "k", "900", now - 15 * day),  # first paid before the span, again within it
        _payment("3", "x", "m", "900", now - 3 * day),  # a longer loop: x -> m -> q -> c
        _payment("4", "x", "b", "900", now - 3 * day),  # b paid too many to be walked through
        _payment("7", "x", "k", "900", now - 3 * day),
        _payment("5", "b", "c", "900", now - 2 * day),
        _payment("6", "m", "q", "900", now - 2 * day),
        _payment("8", "q", "c", "900", now - day),
        _payment("9", "k", "c", "900", now - day // 2),
        _payment("10", "c", "x", "900", now),
    ]
    services = Services(AmlThresholds())
    for payment in built:
        services.feed(payment)
    at = row_of(built[-1]).ts
    assert services.live_out["b"] == {"c"} and "c" not in services.live_out["x"]
    loop = services.loop("x", "c", at)
    assert loop == services.loop_as_of("x", "c", at)
    assert loop == reference_loop(built, "x", "c", at, services.loop_hops, LOOP_SPAN, LOOP_MAX_PAYEES)
    assert loop == {"found": True, "path": ["x", "k", "c", "x"]}


def test_cs_windows_read_in_one_pass_are_the_references() -> None:
    """C's windows about an account, each payment of its week read once into every window it falls in,
    are the reference's filters over what C holds: on the real files (payer and payee of every payment, as
    of its instant and five hours before) and on an account with several currencies, one without a rate,
    a self-payment, payments near the reporting threshold and payments more than a week before the newest
    it holds."""
    services = Services(AmlThresholds())
    checked = 0
    for when, same in itertools.groupby(real_files()[2], key=lambda p: row_of(p).ts):
        instant = list(same)
        for payment in instant:
            services.feed(payment)
        for payment in instant:
            for account in (payment.payer, payment.payee):
                for at in (when, when - timedelta(hours=5)):
                    answer = services.aggregates(account, at)  # drops what C no longer holds, first
                    held = [p for p in services.touching[account] if p.ts <= at]
                    assert answer == reference_aggregates([held], account, at, THRESHOLD, BAND)
                    checked += 1
    assert checked > 40_000

    day = 24 * 60
    history = [
        _payment("1", "a", "b", "9500", 0),  # more than a week before the newest: dropped as too late
        _payment("2", "a", "b", "9500", 3 * day),
        _payment("3", "a", "c", "9999.99", 8 * day),  # near the threshold, in the last day
        _payment("4", "a", "a", "500", 8 * day + 10),  # a self-payment: neither sent nor received
        _payment("5", "d", "a", "120.5", 8 * day + 20, "EUR"),
        _payment("6", "e", "a", "7", 8 * day + 30, "XTS"),  # no rate
        _payment("7", "a", "b", "10000", 8 * day + 40),  # at the threshold: not near it
        _payment("8", "a", "b", "0.015", 8 * day + 50, "EUR"),
    ]
    services = Services(AmlThresholds())
    for payment in history:
        services.feed(payment)
    held = [row_of(p) for p in history]
    newest = held[-1].ts
    for at in (newest, newest - timedelta(minutes=25), newest - timedelta(days=2)):
        answer = services.aggregates("a", at)
        made = [p for p in services.touching["a"] if p.ts <= at]  # C's retention has dropped the first
        assert answer == reference_aggregates([made], "a", at, THRESHOLD, BAND)
    answer = windows_of(held, "a", newest)
    assert answer == reference_aggregates([held], "a", newest, THRESHOLD, BAND)
    assert (answer["late_dropped"], answer["near_threshold_24h"], answer["unconverted"]) == (1, 1, ["XTS"])
    assert answer["windows"]["24h"]["sent"] == {"EUR": "0.015", "USD": "19999.99"}


def test_c_answers_with_the_deployments_currency_threshold_and_band() -> None:
    """A training replay computes a deployment's features: C's totals in its reporting currency and its
    near-threshold count by its threshold and band, as the reference does with them."""
    rates = ExchangeRates.from_env({"AML_REPORTING_CURRENCY": "EUR"})
    reporting = Reporting(rates, Decimal("5000"), Decimal("0.2"))
    timeline = [_payment("p1", "a", "b", "4100", 0), _payment("p2", "a", "c", "3900", 1)]
    services = Services(AmlThresholds(rates=rates), reporting=reporting)
    for payment in timeline:
        services.feed(payment)
    at = row_of(timeline[1]).ts
    answer = services.aggregates("a", at)
    expected = reference_aggregates([timeline], "a", at, Decimal("5000"), Decimal("0.2"), rates)
    assert {k: v for k, v in answer.items() if k in expected} == expected
    assert answer["reporting_currency"] == "EUR" and answer["near_threshold_24h"] == 1
    assert answer["reporting_threshold"] == "5000" and answer["threshold_band"] == "0.2"
    in_dollars = Services(AmlThresholds())
    for payment in timeline:
        in_dollars.feed(payment)
    assert in_dollars.aggregates("a", at)["near_threshold_24h"] == 0
