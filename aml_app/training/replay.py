"""Services B and C replayed with the naive reference (`aml_app/training/reference.py`): the evidence a
detector would see about each payment, without Kafka, Spark or PostgreSQL.

B answers the parts of each question that the detector asks for (`PAYER_PARTS` about the payer,
`PAYEE_PARTS` about the payee) and nothing else, as the real B does: a part it is not asked for is absent.

The reference loops over every payment it is given, which is quadratic over a whole run; so each question
gets only the payments that can change its answer: for aggregates, the payments touching the account that
C still holds; for the payer's `out`, its edges summed as payments are fed (`EdgeSummary`; as of an
earlier instant, the payments it sent); for the payee's `chain` (through the payer), the payments into
the payee and into the accounts up to 2 steps before it; for `sources` and `co_payees`, the payments into
the account and into its payers, and those its payers sent; for `loop`, the edges' first and last times,
kept up as payments are fed (`aml_app.training.reference.loop_on_edges`).

Every answer is as of the payment's time, as the real B and C give it to the detectors: only payments made
by then count, however many later ones were fed (`bench/partition_skew.py` feeds some partitions ahead);
C keeps what it holds only `AML_AGGREGATES_RETENTION` past its week before the newest payment fed, as its
store prunes.

Used by the detection tests on simulated traffic and by `bench/amlworld_detection.py` on real data.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from aml_app.dependencies.aggregates import HORIZON, floor_bucket
from aml_app.dependencies.client import PAYEE_PARTS, PAYER_PARTS
from aml_app.dependencies.relations import LOOP_MAX_PAYEES, LOOP_SPAN
from aml_app.detection.evidence import Evidence
from aml_app.detection.thresholds import AmlThresholds
from aml_app.settings import Settings
from aml_app.training.reference import (
    _total,
    instant_text,
    loop_on_edges,
    made_by,
    money_text,
    reference_aggregates,
    reference_layering,
    reference_relations,
)

THRESHOLD = Decimal("10000")
BAND = Decimal("0.1")
HOPS = 3


@dataclass(frozen=True)
class Row:
    """A payment-like object for the reference, parsed once (the reference accepts text, but re-parses)."""

    payer: str
    payee: str
    amount: Decimal
    currency: str
    ts: datetime


def row_of(payment: Any) -> Row:
    amount = payment.amount if isinstance(payment.amount, Decimal) else Decimal(str(payment.amount))
    ts = payment.ts if isinstance(payment.ts, datetime) else datetime.fromisoformat(payment.ts)
    return Row(payment.payer, payment.payee, amount, payment.currency, ts.astimezone(UTC))


@dataclass
class EdgeSummary:
    """One (payer, payee) edge of B's `out` part, summed as its payments are fed: what the reference's
    loop over every payment of the payer gives (`reference.reference_relations`), each currency's total
    added up in the same order at the same precision; its first and last payment are `Services.times`'.

    Why: a payer's `out` part lists every payee it ever paid; the reference loops over all the payer's
    payments once per payee, so a busy payer costs more with every payment, and a training replay of a
    bank's history grew quadratic with it."""

    count: int = 0
    totals: dict[str, Decimal] = field(default_factory=dict)
    shown: dict[str, Any] | None = None  # the summary as B answers it, until the next payment on the edge

    def add(self, payment: Row) -> None:
        self.count += 1
        self.totals[payment.currency] = _total(
            (self.totals.get(payment.currency, Decimal(0)), payment.amount)
        )
        self.shown = None

    def summary(self, counterparty: str, times: Mapping[str, list[datetime]]) -> dict[str, Any]:
        """The edge as B lists it; `times`: its payments' times per currency, sorted (`Services.times`)."""
        if self.shown is None:
            self.shown = {
                "counterparty": counterparty,
                "count": self.count,
                "totals": {c: money_text(self.totals[c]) for c in sorted(self.totals)},
                "first_seen": instant_text(min(each[0] for each in times.values())),
                "last_seen": instant_text(max(each[-1] for each in times.values())),
            }
        return self.shown


class EdgesAsOf(Mapping[tuple[str, str], list[tuple[datetime, datetime]]]):
    """B's edges for `loop` as of an instant: per (payer, payee), each currency's first and last payment
    time among those made by then (an edge first paid later is not there)."""

    def __init__(self, times: Mapping[tuple[str, str], Mapping[str, list[datetime]]], at: datetime) -> None:
        self.times, self.at = times, at

    def __getitem__(self, edge: tuple[str, str]) -> list[tuple[datetime, datetime]]:
        spans = []
        for paid in self.times.get(edge, {}).values():  # sorted
            made = bisect.bisect_right(paid, self.at)
            if made:
                spans.append((paid[0], paid[made - 1]))
        return spans

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.times)

    def __len__(self) -> int:
        return len(self.times)


class PayeesAsOf(Mapping[str, set[str]]):
    """Each payer's payees as of an instant."""

    def __init__(self, edges: EdgesAsOf, out: Mapping[str, set[str]]) -> None:
        self.edges, self.out = edges, out

    def __getitem__(self, payer: str) -> set[str]:
        return {payee for payee in self.out.get(payer, ()) if self.edges[(payer, payee)]}

    def __iter__(self) -> Iterator[str]:
        return iter(self.out)

    def __len__(self) -> int:
        return len(self.out)


def asked(answer: dict[str, Any], parts: str) -> dict[str, Any]:
    """B's answer as the detector gets it: the parts it asks for (`parts`) and nothing else. A part it
    does not ask for is absent from the real answer, so a rule or a model feature that read one here would
    see in the replay what it never sees in the worker."""
    wanted = {"account", "hops", "as_of", *parts.split(",")}
    return {key: value for key, value in answer.items() if key in wanted}


class Services:
    """What B and C would answer after the payments fed so far were applied."""

    def __init__(self, thresholds: AmlThresholds, keep: timedelta | None = None) -> None:
        """`keep`: C's retention past its week (default: AML_AGGREGATES_RETENTION's)."""
        self.keep = (
            keep if keep is not None else timedelta(seconds=Settings().dependencies.aggregates_retention)
        )
        self.newest: datetime | None = None
        self.min_average = thresholds.rates.in_each(thresholds.graph_min_average)  # as the detector asks
        self.loop_hops = thresholds.cycle_max_hops
        # (payer, payee) -> per currency its payment times, sorted; payer -> payees: B's edges for `loop`
        self.times: dict[tuple[str, str], dict[str, list[datetime]]] = defaultdict(dict)
        self.out: dict[str, set[str]] = defaultdict(set)
        self.edges: dict[tuple[str, str], EdgeSummary] = defaultdict(EdgeSummary)
        self.touching: dict[str, list[Row]] = defaultdict(list)
        self.sent_by: dict[str, list[Row]] = defaultdict(list)
        self.received_by: dict[str, list[Row]] = defaultdict(list)

    def feed(self, sent: Any) -> None:
        """Apply one payment-like object (`payer`, `payee`, `amount`, `currency`, `ts`)."""
        payment = row_of(sent)
        self.newest = payment.ts if self.newest is None else max(self.newest, payment.ts)
        self.touching[payment.payer].append(payment)
        if payment.payee != payment.payer:
            self.touching[payment.payee].append(payment)
        self.sent_by[payment.payer].append(payment)
        self.received_by[payment.payee].append(payment)
        bisect.insort(self.times[(payment.payer, payment.payee)].setdefault(payment.currency, []), payment.ts)
        self.out[payment.payer].add(payment.payee)
        self.edges[(payment.payer, payment.payee)].add(payment)

    def payers_of(self, accounts: set[str]) -> set[str]:
        return {p.payer for a in accounts for p in self.received_by.get(a, [])}

    def aggregates(self, account: str, at: datetime) -> dict[str, Any]:
        touching = self.touching.get(account, [])
        if self.newest is not None:
            # C holds the minutes from `kept` on. The bound only rises with the newest payment, so what
            # falls below it is never held again: dropped, an account's list spans C's retention, not
            # the whole history.
            kept = floor_bucket(self.newest - HORIZON - self.keep)
            touching = self.touching[account] = [p for p in touching if p.ts >= kept]
        held = [p for p in touching if p.ts <= at]
        return reference_aggregates([held], account, at, THRESHOLD, BAND)

    def relations(self, account: str, at: datetime) -> dict[str, Any]:
        """B's answer about a payer (`PAYER_PARTS`: its payees, an `EdgeSummary` each). As of an instant
        before a payment fed, from the reference's loop over the payer's payments made by then."""
        if self.newest is not None and at < self.newest:
            return asked(
                reference_relations(self.sent_by.get(account, []), account, HOPS, at=at), PAYER_PARTS
            )
        out = [
            self.edges[(account, payee)].summary(payee, self.times[(account, payee)])
            for payee in sorted(self.out.get(account, ()))
        ]
        return asked({"account": account, "hops": HOPS, "out": out}, PAYER_PARTS)

    def payee_relations(self, account: str, closing: str, at: datetime) -> dict[str, Any]:
        payers = sorted(self.payers_of({account}))
        subset = list(self.received_by.get(account, []))
        for payer in payers:
            subset += self.received_by.get(payer, []) + self.sent_by.get(payer, [])
        layering = reference_layering(made_by(subset, at), account, HOPS, self.min_average)
        back, frontier = {account}, {account}
        for _ in range(HOPS - 1):
            frontier = self.payers_of(frontier) - back
            back |= frontier
        into = [p for a in sorted(back) for p in self.received_by.get(a, [])]
        edges = EdgesAsOf(self.times, at)
        answer = {
            "account": account,
            "hops": HOPS,
            "chain": reference_layering(into, account, HOPS, self.min_average, closing, at)["chain"],
            "sources": layering["sources"],
            "co_payees": layering["co_payees"],
            "loop": loop_on_edges(
                edges,
                PayeesAsOf(edges, self.out),
                account,
                closing,
                at,
                self.loop_hops,
                LOOP_SPAN,
                LOOP_MAX_PAYEES,
            ),
        }
        return asked(answer, PAYEE_PARTS)

    def evidence(self, payment: Any) -> Evidence:
        """The evidence the detector would see about `payment` (it has a `payment_id` too)."""
        row = row_of(payment)
        at = row.ts
        return Evidence.parse(
            payment_id=payment.payment_id,
            payer=row.payer,
            payee=row.payee,
            amount=row.amount,
            currency=row.currency,
            ts=payment.ts if isinstance(payment.ts, str) else row.ts.isoformat(),
            payer_aggregates=self.aggregates(payment.payer, at),
            payee_aggregates=self.aggregates(payment.payee, at),
            payer_relations=self.relations(payment.payer, at),
            payee_relations=self.payee_relations(payment.payee, payment.payer, at),
            channel=getattr(payment, "channel", None),
        )


def timeline_of(patterns: Any, background: Any) -> list[Any]:
    """A data set's attempts and background as one timeline, in event-time order (a stable sort)."""
    return sorted([*background.payments, *patterns.payments], key=lambda p: p.ts)


def decided(services: Services, timeline: Iterable[Any], lag: bool = False) -> Iterator[tuple[Any, Evidence]]:
    """Each payment of `timeline` (in event-time order) with the evidence the detector decides it on,
    feeding `services` as it goes.

    Gate on, B and C have applied every payment timestamped up to the payment's time, those of the same
    instant included: the event-time gate admits a payment once no payment up to its time is left
    unapplied on any partition (docs/design.md), and B and C answer as of that time. AMLworld's times are
    whole minutes, so many payments share one. `lag` (the gate off): only the payments before it.
    """
    if lag:
        for payment in timeline:
            evidence = services.evidence(payment)
            services.feed(payment)
            yield payment, evidence
        return
    for _, instant in itertools.groupby(timeline, key=lambda payment: row_of(payment).ts):
        same = list(instant)
        for payment in same:
            services.feed(payment)
        for payment in same:
            yield payment, services.evidence(payment)
