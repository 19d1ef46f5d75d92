"""Services B and C replayed with the naive reference (`aml_app/training/reference.py`): the evidence a
detector would see about each payment, without Kafka, Spark or PostgreSQL.

B answers the parts of each question that the detector asks for (`PAYER_PARTS` about the payer,
`PAYEE_PARTS` about the payee) and nothing else, as the real B does: a part it is not asked for is absent.

The reference loops over every payment it is given, which is quadratic over a whole run; so the replay
keeps what each question reads as payments are fed, and is held equal to the reference by
`tests/unit/test_replay.py`: C's windows read, in one pass, the account's payments that C still holds, in
time order (`windows_of`); the payer's `out` sums its edges (`EdgeSummary`); the payee's `chain`,
`sources` and `co_payees` are read off B's heavy edges (`Services.layering`); `loop` reads the edges'
first and last times (`aml_app.training.reference.loop_on_edges`), trying only the edges paid within its
span (`Services.live_out`). As of an instant before a payment fed, B's parts are the reference's over the
payments that can change them.

Every answer is as of the payment's time, as the real B and C give it to the detectors: only payments made
by then count, however many later ones were fed (`bench/partition_skew.py` feeds some partitions ahead);
C keeps what it holds only `AML_AGGREGATES_RETENTION` past its week before the newest payment fed, as its
store prunes.

Used by the detection tests on simulated traffic and by `bench/amlworld_detection.py` on real data.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal, localcontext
from typing import Any

from aml_app.dependencies.aggregates import HORIZON, floor_bucket
from aml_app.dependencies.client import PAYEE_PARTS, PAYER_PARTS
from aml_app.dependencies.relations import LOOP_MAX_PAYEES, LOOP_SPAN
from aml_app.detection.evidence import Evidence
from aml_app.detection.exchange import ExchangeRates
from aml_app.detection.model_settings import DEFAULT_BAND, DEFAULT_THRESHOLD
from aml_app.detection.thresholds import AmlThresholds
from aml_app.settings import Settings
from aml_app.training.reference import (
    LISTED,
    WINDOWS,
    _chain,
    _EdgeRow,
    _total,
    instant_text,
    loop_on_edges,
    made_by,
    money_text,
    reference_layering,
    reference_relations,
    totals_in_reporting,
)

THRESHOLD, BAND = DEFAULT_THRESHOLD, DEFAULT_BAND
HOPS = 3


@dataclass(frozen=True)
class Reporting:
    """What C's answers depend on besides the payments: the rates it totals in (`AML_REPORTING_CURRENCY`,
    `AML_EXCHANGE_RATES`) and the threshold and band it counts near-threshold payments by
    (`AML_REPORTING_THRESHOLD`, `AML_THRESHOLD_BAND`). The defaults are the reference's."""

    rates: ExchangeRates = field(default_factory=ExchangeRates)
    threshold: Decimal = THRESHOLD
    band: Decimal = BAND

    @functools.cached_property
    def near(self) -> Decimal:
        with localcontext() as ctx:
            ctx.prec = 80
            return self.threshold * (1 - self.band)

    @functools.cached_property
    def answered(self) -> dict[str, str]:
        return {"reporting_threshold": format(self.threshold, "f"), "threshold_band": format(self.band, "f")}


DEFAULT_REPORTING = Reporting()


@dataclass(frozen=True, slots=True)
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


@dataclass(slots=True)
class EdgeSummary:
    """One (payer, payee) edge of B's `out` part, summed as its payments are fed: what the reference's
    loop over every payment of the payer gives (`reference.reference_relations`), each currency's total
    added up in the same order at the same precision; its first and last payment are `Services.times`'.

    Why: a payer's `out` part lists every payee it ever paid; the reference loops over all the payer's
    payments once per payee, so a busy payer costs more with every payment, and a training replay of a
    bank's history grew quadratic with it."""

    count: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    totals: dict[str, Decimal] = field(default_factory=dict)
    shown: dict[str, Any] | None = None  # the summary as B answers it, until the next payment on the edge

    def add(self, payment: Row) -> None:
        self.count += 1
        self.counts[payment.currency] = self.counts.get(payment.currency, 0) + 1
        self.totals[payment.currency] = _total(
            (self.totals.get(payment.currency, Decimal(0)), payment.amount)
        )
        self.shown = None

    def heavy(self, least: Mapping[str, Decimal]) -> list[str]:
        """The currencies in which the edge's payments average at least `least`'s (B's heavy rows); a
        currency without a minimum is never heavy."""
        return [c for c, total in self.totals.items() if c in least and total >= least[c] * self.counts[c]]

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


def _ts(payment: Row) -> datetime:
    return payment.ts


def windows_of(
    held: list[Row], account: str, at: datetime, reporting: Reporting = DEFAULT_REPORTING
) -> dict[str, Any]:
    """`reference_aggregates([held], account, at, reporting.threshold, reporting.band, reporting.rates)`,
    `held` in time order: each payment of the week read once, into every window it falls in (the same sums
    at the same precision).

    Why: the reference filters every payment C holds once per window and figure; a replay asks about
    two accounts per payment, and a training replay of a long history spent most of its time there."""
    # The too-late rule with one batch: the payments before the minute a week before the newest
    dropped = bisect.bisect_left(held, floor_bucket(held[-1].ts - HORIZON), key=_ts) if held else 0
    # per window and way: the payments' count, counterparties and amounts per currency
    ways: dict[str, dict[str, tuple[list[int], set[str], dict[str, list[Decimal]]]]] = {
        name: {"sent": ([0], set(), {}), "received": ([0], set(), {})} for name, _ in WINDOWS
    }
    after = [(at - length, ways[name]) for name, length in WINDOWS]
    week = at - max(length for _, length in WINDOWS)
    for p in held[bisect.bisect_right(held, week, lo=dropped, key=_ts) :]:
        if p.payer == p.payee:  # moves no money between parties: neither sent nor received
            continue
        way, other = ("sent", p.payee) if p.payer == account else ("received", p.payer)
        for edge, window in after:
            if p.ts > edge:
                count, parties, amounts = window[way]
                count[0] += 1
                parties.add(other)
                amounts.setdefault(p.currency, []).append(p.amount)
    windows: dict[str, Any] = {}
    unconverted: set[str] = set()
    rates, near, threshold = reporting.rates, reporting.near, reporting.threshold
    for name, window in ways.items():
        shown: dict[str, Any] = {}
        for way in ("sent", "received"):
            count, _, amounts = window[way]
            shown[f"{way}_count"] = count[0]
            if not amounts:
                shown[way], shown[f"{way}_total"] = {}, "0.00"
                continue
            totals = {c: _total(amounts[c]) for c in sorted(amounts)}
            unconverted |= totals.keys() - rates.per_unit.keys()
            shown[way] = {c: money_text(t) for c, t in totals.items()}
            shown[f"{way}_total"] = totals_in_reporting(totals, rates)
        sent, received = window["sent"][1], window["received"][1]
        shown["counterparties"] = len(sent | received)
        shown["sent_counterparties"] = len(sent)
        shown["received_counterparties"] = len(received)
        windows[name] = shown
    return {
        "account": account,
        "at": instant_text(at),
        "windows": windows,
        "near_threshold_24h": sum(
            1
            for amounts in ways["24h"]["sent"][2].values()
            for amount in amounts
            if near <= amount < threshold
        ),
        **reporting.answered,
        "late_dropped": dropped,
        "exact": True,
        "reporting_currency": rates.reporting,
        "unconverted": sorted(unconverted),
    }


def asked(answer: dict[str, Any], parts: str) -> dict[str, Any]:
    """B's answer as the detector gets it: the parts it asks for (`parts`) and nothing else. A part it
    does not ask for is absent from the real answer, so a rule or a model feature that read one here would
    see in the replay what it never sees in the worker."""
    wanted = {"account", "hops", "as_of", *parts.split(",")}
    return {key: value for key, value in answer.items() if key in wanted}


class Services:
    """What B and C would answer after the payments fed so far were applied."""

    def __init__(
        self, thresholds: AmlThresholds, keep: timedelta | None = None, reporting: Reporting | None = None
    ) -> None:
        """`keep`: C's retention past its week (default: AML_AGGREGATES_RETENTION's); `reporting`: C's
        (default: the thresholds' rates, the default threshold and band)."""
        self.reporting = reporting if reporting is not None else Reporting(thresholds.rates)
        self.keep = (
            keep if keep is not None else timedelta(seconds=Settings().dependencies.aggregates_retention)
        )
        self.newest: datetime | None = None
        self.min_average = thresholds.rates.in_each(thresholds.graph_min_average)  # as the detector asks
        self.loop_hops = thresholds.cycle_max_hops
        # (payer, payee) -> per currency its payment times, sorted; payer -> payees: B's edges for `loop`
        self.times: dict[tuple[str, str], dict[str, list[datetime]]] = defaultdict(dict)
        self.out: dict[str, set[str]] = defaultdict(set)
        # payer -> the payees of its edges last paid within LOOP_SPAN of the newest payment, and a heap of
        # (a payment's time, payer, payee) saying when to look at an edge again (`_expire`)
        self.live_out: dict[str, set[str]] = defaultdict(set)
        self.paid_at: list[tuple[datetime, str, str]] = []
        self.edges: dict[tuple[str, str], EdgeSummary] = defaultdict(EdgeSummary)
        # B's heavy edges (`EdgeSummary.heavy`): payee -> its heavy payers, payer -> its heavy payees
        self.heavy_in: dict[str, set[str]] = defaultdict(set)
        self.heavy_out: dict[str, set[str]] = defaultdict(set)
        self.touching: dict[str, list[Row]] = defaultdict(list)
        self.sent_by: dict[str, list[Row]] = defaultdict(list)
        self.received_by: dict[str, list[Row]] = defaultdict(list)
        # C's answers given since the last payment fed, by (account, at): the payments of one instant are
        # all fed before any is asked about, and a busy account is asked about several times at it
        self.answered: dict[tuple[str, datetime], dict[str, Any]] = {}

    def feed(self, sent: Any) -> None:
        """Apply one payment-like object (`payer`, `payee`, `amount`, `currency`, `ts`)."""
        payment = row_of(sent)
        self.answered.clear()
        self.newest = payment.ts if self.newest is None else max(self.newest, payment.ts)
        bisect.insort(self.touching[payment.payer], payment, key=_ts)
        if payment.payee != payment.payer:
            bisect.insort(self.touching[payment.payee], payment, key=_ts)
        self.sent_by[payment.payer].append(payment)
        self.received_by[payment.payee].append(payment)
        bisect.insort(self.times[(payment.payer, payment.payee)].setdefault(payment.currency, []), payment.ts)
        self.out[payment.payer].add(payment.payee)
        self.live_out[payment.payer].add(payment.payee)
        heapq.heappush(self.paid_at, (payment.ts, payment.payer, payment.payee))
        self._expire()
        edge = self.edges[(payment.payer, payment.payee)]
        edge.add(payment)
        if edge.heavy(self.min_average):
            self.heavy_in[payment.payee].add(payment.payer)
            self.heavy_out[payment.payer].add(payment.payee)
        else:  # a payment can bring an edge's average below the minimum
            self.heavy_in[payment.payee].discard(payment.payer)
            self.heavy_out[payment.payer].discard(payment.payee)

    def _expire(self) -> None:
        """Drop from `live_out` the edges last paid before the newest payment's time less LOOP_SPAN.

        Why: a loop as of an instant starts LOOP_SPAN before it and takes an edge only if paid since
        (`reference._step`), and the replay asks as of the newest payment or later; a walk that tries
        every payee an account ever paid grows with the history."""
        assert self.newest is not None
        horizon = self.newest - LOOP_SPAN
        while self.paid_at and self.paid_at[0][0] < horizon:
            _, payer, payee = heapq.heappop(self.paid_at)
            if max(paid[-1] for paid in self.times[(payer, payee)].values()) < horizon:
                self.live_out[payer].discard(payee)

    def payers_of(self, accounts: set[str]) -> set[str]:
        return {p.payer for a in accounts for p in self.received_by.get(a, [])}

    def aggregates(self, account: str, at: datetime) -> dict[str, Any]:
        """C's answer about `account` as of `at`: the reference's (`reference_aggregates`, over the
        payments C holds made by then), computed from the account's payments in time order
        (`windows_of`), once for each account and instant between two payments fed."""
        if (answer := self.answered.get((account, at))) is not None:
            return answer
        touching = self.touching.get(account, [])
        if self.newest is not None and touching:
            # C holds the minutes from `kept` on. The bound only rises with the newest payment, so what
            # falls below it is never held again: dropped, an account's list spans C's retention, not
            # the whole history.
            kept = floor_bucket(self.newest - HORIZON - self.keep)
            if touching[0].ts < kept:
                del touching[: bisect.bisect_left(touching, kept, key=_ts)]
        answer = self.answered[(account, at)] = windows_of(
            touching[: bisect.bisect_right(touching, at, key=_ts)], account, at, self.reporting
        )
        return answer

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
        """B's answer about a payee (`PAYEE_PARTS`). The layering parts come from the heavy edges kept up
        as payments are fed (`layering`); as of an instant before a payment fed, from the reference's
        loop over the payments into and out of the account's payers made by then (`layering_as_of`);
        `loop` tries the edges paid within its span (`loop`), or as of such an instant every edge made by
        then (`loop_as_of`)."""
        if self.newest is not None and at < self.newest:
            layering, loop = self.layering_as_of(account, closing, at), self.loop_as_of(account, closing, at)
        else:
            layering, loop = self.layering(account, closing, at), self.loop(account, closing, at)
        return asked({"account": account, "hops": HOPS, **layering, "loop": loop}, PAYEE_PARTS)

    def loop(self, account: str, closing: str, at: datetime) -> dict[str, Any]:
        """B's `loop` about `account` closed by a payment from `closing` at `at` (no earlier than the
        newest payment fed), trying only the edges `live_out` holds: one last paid before `at` less
        LOOP_SPAN no walk can take."""
        return self._walk(account, closing, at, self.out, self.live_out)

    def loop_as_of(self, account: str, closing: str, at: datetime) -> dict[str, Any]:
        """B's `loop` as of any instant: over every edge paid by then, each currency's first and last
        payment made by then."""
        return self._walk(account, closing, at, PayeesAsOf(EdgesAsOf(self.times, at), self.out), None)

    def _walk(
        self,
        account: str,
        closing: str,
        at: datetime,
        out: Mapping[str, set[str]],
        tried: Mapping[str, set[str]] | None,
    ) -> dict[str, Any]:
        return loop_on_edges(
            EdgesAsOf(self.times, at),
            out,
            account,
            closing,
            at,
            self.loop_hops,
            LOOP_SPAN,
            LOOP_MAX_PAYEES,
            tried=tried,
        )

    def layering(self, account: str, closing: str, at: datetime) -> dict[str, Any]:
        """B's `chain`, `sources` and `co_payees` about `account` from every payment fed (`at` no earlier
        than the newest), read off the heavy edges: what the reference computes from the payments into
        the account, into its payers and out of them (`layering_as_of`).

        Why: the reference loops over every payment of every payer of the account, so a busy payee
        costs more with every payment, and a training replay of a long history grew with it."""
        heavy_in, heavy_out = self.heavy_in, self.heavy_out
        payers = heavy_in.get(account, set())
        via: dict[str, set[str]] = defaultdict(set)
        shared: Counter[str] = Counter()
        for m in payers:
            if m != account:
                for s in heavy_in.get(m, ()):
                    if s not in (account, m):
                        via[s].add(m)
            shared.update(v for v in heavy_out.get(m, ()) if v != account)
        sources = sorted((-len(ms), s, sorted(ms)) for s, ms in via.items() if len(ms) >= 2)
        co_payees = sorted((-n, a) for a, n in shared.items() if n >= 2)
        # The chain ends closing -> account, so it only takes edges into `closing` and into its payers.
        rows = self.heavy_rows(closing, account)
        if rows:
            for payer in heavy_in.get(closing, ()):
                rows += self.heavy_rows(payer, closing)
                for source in heavy_in.get(payer, ()):
                    rows += self.heavy_rows(source, payer)
        return {
            "chain": _chain(rows, account, HOPS, closing, at),
            "sources": [{"source": s, "via": ms} for _, s, ms in sources[:LISTED]],
            "co_payees": [{"account": a, "shared": -n} for n, a in co_payees[:LISTED]],
        }

    def heavy_rows(self, payer: str, payee: str) -> list[_EdgeRow]:
        """The edge's heavy rows, one per currency, as the reference's `_heavy_rows` makes them."""
        edge = self.edges.get((payer, payee))
        if edge is None:
            return []
        times = self.times[(payer, payee)]
        return [
            _EdgeRow(
                payer, payee, edge.counts[c], edge.totals[c], self.min_average[c], times[c][0], times[c][-1]
            )
            for c in edge.heavy(self.min_average)
        ]

    def layering_as_of(self, account: str, closing: str, at: datetime) -> dict[str, Any]:
        """The layering parts as of `at`, from the reference's loop over the payments that can change
        them, made by then."""
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
        return {
            "chain": reference_layering(into, account, HOPS, self.min_average, closing, at)["chain"],
            "sources": layering["sources"],
            "co_payees": layering["co_payees"],
        }

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
    for payment in fed(services, timeline):
        yield payment, services.evidence(payment)


def fed(services: Services, timeline: Iterable[Any]) -> Iterator[Any]:
    """Each payment of `timeline` (in event-time order) once `services` were fed every payment up to its
    time, those of the same instant included (gate on: `decided`, which asks them about each)."""
    for _, instant in itertools.groupby(timeline, key=lambda payment: row_of(payment).ts):
        same = list(instant)
        for payment in same:
            services.feed(payment)
        yield from same
