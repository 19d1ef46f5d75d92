"""Naive pure-Python answers of services B (relations) and C (aggregates), to check the stores against.

Written differently from the stores on purpose: no SQL, no indexes, no incremental state; every part of
every answer loops over all payments again. Used by the store tests and by the Spark integration tests.

Payments are "payment-like": any objects with `payer`, `payee`, `amount` (Decimal or decimal string),
`currency` and `ts` (aware datetime or ISO-8601 string) attributes, e.g. `aml_app.models.Payment` or
`aml_app.dependencies.aggregates.PaymentRow`. Only valid payments belong in the lists.

Conventions shared with the stores (aml_app/dependencies/store.py):
- money as text: no exponent, at least two decimal places, more only when needed ("12.50", "0.0001");
- instants as text: UTC, six fractional digits, 'Z' ("2026-01-02T03:04:05.000000Z").

Too-late rule (as in aml_app/dependencies/aggregates.py): `reference_aggregates` takes the payments as the
list of batches in apply order. For each batch, max_ts becomes the largest ts over all earlier batches
AND this batch; then each payment of the batch whose minute starts before max_ts - 7 days (ts < the
start of that minute, minutes counted from the epoch) is dropped and counted in `late_dropped`. The
store prunes old rows, so its answers equal these only for instants `at >= exact_from(batches)`
(= max ts - 1 hour).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal, localcontext
from typing import Any

from aml_app.dependencies.relations import FLOW_RATIO, LOOP_SPAN
from aml_app.detection.exchange import ExchangeRates

HORIZON = timedelta(days=7)
LISTED = 10  # sources and co_payees: the strongest ten (aml_app/dependencies/relations.py)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
WINDOWS = (("1h", timedelta(hours=1)), ("24h", timedelta(hours=24)), ("7d", timedelta(days=7)))


def amount_of(payment: Any) -> Decimal:
    return payment.amount if isinstance(payment.amount, Decimal) else Decimal(str(payment.amount))


def ts_of(payment: Any) -> datetime:
    ts = payment.ts if isinstance(payment.ts, datetime) else datetime.fromisoformat(payment.ts)
    return ts.astimezone(UTC)


def money_text(value: Decimal) -> str:
    whole, _, fraction = format(value, "f").partition(".")
    fraction = fraction.rstrip("0")
    while len(fraction) < 2:
        fraction += "0"
    return f"{whole}.{fraction}"


def instant_text(when: datetime) -> str:
    return when.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _total(amounts: Iterable[Decimal]) -> Decimal:
    with localcontext() as ctx:
        ctx.prec = 80
        result = Decimal(0)
        for amount in amounts:
            result += amount
        return result


# --- service B -----------------------------------------------------------------------------------


def _summary(payments: list[Any], account: str, counterparty: str, outgoing: bool) -> dict[str, Any]:
    def on_edge(p: Any) -> bool:
        return (p.payer, p.payee) == ((account, counterparty) if outgoing else (counterparty, account))

    currencies = sorted({p.currency for p in payments if on_edge(p)})
    return {
        "counterparty": counterparty,
        "count": sum(1 for p in payments if on_edge(p)),
        "totals": {
            c: money_text(_total(amount_of(p) for p in payments if on_edge(p) and p.currency == c))
            for c in currencies
        },
        "first_seen": instant_text(min(ts_of(p) for p in payments if on_edge(p))),
        "last_seen": instant_text(max(ts_of(p) for p in payments if on_edge(p))),
    }


def _walks(payments: list[Any], start: str, length: int) -> list[list[str]]:
    """Every directed walk of exactly `length` edges from `start` (an edge: at least one payment)."""
    walks = [[start]]
    for _ in range(length):
        walks = [[*w, payee] for w in walks for payee in {p.payee for p in payments if p.payer == w[-1]}]
    return walks


@dataclass(frozen=True)
class _EdgeRow:
    """One heavy (payer, payee, currency) row of B's edges; its average in units is total / payments /
    unit."""

    payer: str
    payee: str
    payments: int
    total: Decimal
    unit: Decimal
    first: datetime
    last: datetime

    def flows_into(self, after: _EdgeRow) -> bool:
        """Money paid on this row can have gone on along `after` (compared by multiplication, as B does)."""
        low, high = FLOW_RATIO
        with localcontext() as ctx:
            ctx.prec = 80
            on = after.total * self.payments * self.unit
            back = self.total * after.payments * after.unit
            return self.first <= after.last and low * back <= on <= high * back


def _heavy_rows(payments: list[Any], min_average: Decimal | Mapping[str, Decimal]) -> list[_EdgeRow]:
    """The heavy (payer, payee, currency) rows: those whose payments average >= min_average (one for
    every currency, or its currency's; a currency without one is never heavy), each with its unit (its
    currency's minimum, or 1 when one minimum holds for every currency), as B's `chain` compares them."""
    rows: dict[tuple[str, str, str], list[Any]] = {}
    for p in payments:
        rows.setdefault((p.payer, p.payee, p.currency), []).append(p)
    found = []
    for (u, v, currency), group in rows.items():
        least = min_average.get(currency) if isinstance(min_average, Mapping) else min_average
        total = _total(amount_of(p) for p in group)
        if least is None or total < least * len(group):
            continue
        unit = least if isinstance(min_average, Mapping) else Decimal(1)
        times = [ts_of(p) for p in group]
        found.append(_EdgeRow(u, v, len(group), total, unit, min(times), max(times)))
    return found


def _chain(
    rows: list[_EdgeRow], account: str, hops: int, closing: str | None, at: datetime | None
) -> list[str]:
    """The longest flow of heavy rows ending at `account` (at most `hops` edges, through distinct
    accounts, each row's first payment no later than the next row's last and its average FLOW_RATIO times
    the one before), ending with closing -> account when `closing` is given, of rows paid within
    LOOP_SPAN before `at` and not first after it when `at` is given; the smallest of those."""
    if at is not None:
        rows = [r for r in rows if r.first <= at and r.last >= at - LOOP_SPAN]
    paths: list[tuple[list[str], _EdgeRow | None]] = [([account], None)]
    best: list[str] = []
    for level in range(hops):
        paths = [
            ([row.payer, *path], row)
            for path, after in paths
            for row in rows
            if row.payee == path[0]
            and row.payer not in path
            and (level > 0 or closing is None or row.payer == closing)
            and (after is None or row.flows_into(after))
        ]
        if not paths:
            break
        best = min(path for path, _ in paths)
    return best


def _sources(heavy: set[tuple[str, str]], account: str) -> list[dict[str, Any]]:
    via: dict[str, set[str]] = {}
    for m, v in heavy:
        if v != account or m == account:
            continue
        for s, m2 in heavy:
            if m2 == m and s not in (account, m):
                via.setdefault(s, set()).add(m)
    found = [{"source": s, "via": sorted(ms)} for s, ms in via.items() if len(ms) >= 2]
    return sorted(found, key=lambda f: (-len(f["via"]), f["source"]))[:LISTED]


def _co_payees(heavy: set[tuple[str, str]], account: str) -> list[dict[str, Any]]:
    payers = {u for u, v in heavy if v == account}
    shared: dict[str, int] = {}
    for other in {v for u, v in heavy if v != account}:
        count = len(payers & {u for u, v in heavy if v == other})
        if count >= 2:
            shared[other] = count
    found: list[dict[str, Any]] = [{"account": a, "shared": n} for a, n in shared.items()]
    return sorted(found, key=lambda f: (-f["shared"], f["account"]))[:LISTED]


def reference_layering(
    payments: Iterable[Any],
    account: str,
    hops: int,
    min_average: Decimal | Mapping[str, Decimal] = Decimal(0),
    closing: str | None = None,
    at: datetime | None = None,
) -> dict[str, Any]:
    """Service B's layering parts (chain, sources, co_payees) for `account`; `closing` and `at` as B's
    query (`at`: as of then, from the payments made by then)."""
    rows = _heavy_rows(made_by(payments, at), min_average)
    heavy = {(r.payer, r.payee) for r in rows}
    return {
        "chain": _chain(rows, account, hops, closing, at),
        "sources": _sources(heavy, account),
        "co_payees": _co_payees(heavy, account),
    }


def made_by(payments: Iterable[Any], at: datetime | None) -> list[Any]:
    """The payments made at or before `at` (every one when `at` is None): what B answers from at `at`."""
    return list(payments) if at is None else [p for p in payments if ts_of(p) <= at]


def reference_relations(
    payments: Iterable[Any],
    account: str,
    hops: int,
    min_average: Decimal | Mapping[str, Decimal] = Decimal(0),
    at: datetime | None = None,
) -> dict[str, Any]:
    """Service B's answer for `account`, every part, without `as_of`; `at`: as of then."""
    payments = made_by(payments, at)
    payees = sorted({p.payee for p in payments if p.payer == account})
    payers = sorted({p.payer for p in payments if p.payee == account})

    distance = {account: 0}
    for step in range(1, hops + 1):
        for p in payments:
            for here, there in ((p.payer, p.payee), (p.payee, p.payer)):
                if distance.get(here) == step - 1 and there not in distance:
                    distance[there] = step
    neighbourhood = sorted(
        ({"account": a, "hops": d} for a, d in distance.items() if a != account),
        key=lambda n: (n["hops"], n["account"]),
    )

    cycle: dict[str, Any] = {"found": False, "path": []}
    for length in range(2, hops + 1):
        # Simple cycles: the accounts in between are distinct and none is the account itself, so a
        # self-payment (money that stays with its owner) makes no cycle and is part of none.
        closed = [
            w
            for w in _walks(payments, account, length)
            if w[-1] == account and len(set(w[1:-1])) == length - 1 and account not in w[1:-1]
        ]
        if closed:
            cycle = {"found": True, "path": min(closed)}
            break

    return {
        "account": account,
        "hops": hops,
        "out": [_summary(payments, account, c, outgoing=True) for c in payees],
        "in": [_summary(payments, account, c, outgoing=False) for c in payers],
        "neighbourhood": neighbourhood,
        "cycle": cycle,
        **reference_layering(payments, account, hops, min_average, None, at),
    }


def _edge_times(payments: list[Any]) -> dict[tuple[str, str], list[tuple[datetime, datetime]]]:
    """(payer, payee) -> (first, last) payment time of each of its currencies: what B's edges keep
    (self-payments included; no loop takes them)."""
    spans: dict[tuple[str, str, str], tuple[datetime, datetime]] = {}
    for p in payments:
        key, ts = (p.payer, p.payee, p.currency), ts_of(p)
        first, last = spans.get(key, (ts, ts))
        spans[key] = (min(first, ts), max(last, ts))
    edges: dict[tuple[str, str], list[tuple[datetime, datetime]]] = {}
    for (payer, payee, _currency), span in spans.items():
        edges.setdefault((payer, payee), []).append(span)
    return edges


def _step(spans: Sequence[tuple[datetime, datetime]], reached: datetime, at: datetime) -> datetime | None:
    """The earliest time money that reached an edge's payer at `reached` can take the edge (one of its
    currencies' first payment, not before `reached`, its last payment not before it either, its first at
    or before `at`), or None."""
    times = [max(reached, first) for first, last in spans if last >= reached and first <= at]
    return min(times) if times else None


def reference_loop(
    payments: Iterable[Any],
    account: str,
    closing: str,
    at: datetime,
    loop_hops: int,
    span: timedelta,
    max_payees: int,
) -> dict[str, Any]:
    """Service B's `loop` about `account` closed by a payment from `closing` at `at`, as {"found", "path"}
    with one of the shortest paths (B may return another; `is_loop` checks any): every simple path
    account -> ... -> closing of at most loop_hops - 1 edges, tried one by one, each edge taken at the
    earliest time it allows (`_step`), starting at `at` - span, and never going on from an account in
    between that paid more than `max_payees` distinct accounts."""
    edges = _edge_times(made_by(payments, at))
    out: dict[str, set[str]] = {}
    for payer, payee in edges:
        out.setdefault(payer, set()).add(payee)
    return loop_on_edges(edges, out, account, closing, at, loop_hops, span, max_payees)


def loop_on_edges(
    edges: Mapping[tuple[str, str], list[tuple[datetime, datetime]]],
    out: Mapping[str, set[str]],
    account: str,
    closing: str,
    at: datetime,
    loop_hops: int,
    span: timedelta,
    max_payees: int,
    tried: Mapping[str, set[str]] | None = None,
) -> dict[str, Any]:
    """`reference_loop` over edges kept as `_edge_times` makes them and each payer's payees (for callers
    that keep both up to date). `tried`: the payees the walk tries from each account, `out` by default;
    a caller that knows which edges no walk as of `at` can take (last paid before `at` - `span`) may
    leave them out, while `out` still counts every payee for `max_payees`."""
    best: tuple[str, ...] | None = None
    steps = out if tried is None else tried

    def walk(here: str, reached: datetime, seen: tuple[str, ...]) -> None:
        nonlocal best
        depth = len(seen) - 1
        if best is not None and depth + 1 >= len(best) - 1:
            return
        for there in sorted(steps.get(here, ())):
            when = _step(edges.get((here, there), []), reached, at)
            if when is None or there in (account, here) or there in seen:
                continue
            if there == closing:
                best = (*seen, there)
                return
            paid = out.get(there, set())
            if depth + 2 < loop_hops and len(paid) - (there in paid) <= max_payees:
                walk(there, when, (*seen, there))

    walk(account, at - span, (account,))
    return {"found": True, "path": [*best, account]} if best is not None else {"found": False, "path": []}


def is_loop(payments: Iterable[Any], path: Sequence[str], at: datetime, span: timedelta) -> bool:
    """Whether `path` (account, ..., closing, account) is a loop as B defines it: distinct accounts, and
    money can have gone along its edges in time order before `at`."""
    edges = _edge_times([p for p in payments if p.payer != p.payee])
    if len(path) < 3 or path[0] != path[-1] or len(set(path[:-1])) != len(path) - 1:
        return False
    reached = at - span
    for here, there in itertools.pairwise(path[:-1]):
        when = _step(edges.get((here, there), []), reached, at)
        if when is None:
            return False
        reached = when
    return True


# --- service C -----------------------------------------------------------------------------------


def accepted(batches: Sequence[Sequence[Any]]) -> tuple[list[Any], int]:
    """(payments kept, number dropped as too late), applying the too-late rule batch by batch."""
    kept: list[Any] = []
    dropped = 0
    high: datetime | None = None
    for batch in batches:
        for p in batch:
            if high is None or ts_of(p) > high:
                high = ts_of(p)
        cutoff = None if high is None else high - HORIZON
        minute_start = None if cutoff is None else cutoff - (cutoff - EPOCH) % timedelta(minutes=1)
        for p in batch:
            if minute_start is not None and ts_of(p) < minute_start:
                dropped += 1
            else:
                kept.append(p)
    return kept, dropped


def exact_from(batches: Sequence[Sequence[Any]]) -> datetime | None:
    """The earliest instant from which the store's aggregates must equal the reference (max ts - 1h)."""
    stamps = [ts_of(p) for batch in batches for p in batch]
    return max(stamps) - timedelta(hours=1) if stamps else None


def in_reporting(payments: Sequence[Any], rates: ExchangeRates) -> str:
    """The payments' amounts converted one currency at a time into the reporting currency, to the cent;
    amounts in currencies without a rate count nothing."""
    return totals_in_reporting(
        {
            c: _total(amount_of(p) for p in payments if p.currency == c)
            for c in {p.currency for p in payments}
        },
        rates,
    )


def totals_in_reporting(totals: Mapping[str, Decimal], rates: ExchangeRates) -> str:
    """Per-currency totals converted one currency at a time into the reporting currency, to the cent,
    at 80 digits as the reference's sums (`ExchangeRates.total` works at 28); currencies without a rate
    count nothing."""
    with localcontext() as ctx:
        ctx.prec = 80
        exact = sum((t / rates.per_unit[c] for c, t in totals.items() if c in rates.per_unit), Decimal(0))
    return money_text(exact.quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN))


def reference_aggregates(
    batches: Sequence[Sequence[Any]],
    account: str,
    at: datetime,
    threshold: Decimal,
    band: Decimal,
    rates: ExchangeRates | None = None,
) -> dict[str, Any]:
    """Service C's answer for `account` at instant `at`, without `as_of`; `rates` default to AMLworld's."""
    rates = rates or ExchangeRates()
    kept, dropped = accepted(batches)
    at = at.astimezone(UTC)
    windows: dict[str, Any] = {}
    near = 0
    unconverted: set[str] = set()
    for name, length in WINDOWS:
        # A self-payment moves no money between parties: it is neither sent nor received.
        sent = [p for p in kept if p.payer == account != p.payee and at - length < ts_of(p) <= at]
        received = [p for p in kept if p.payee == account != p.payer and at - length < ts_of(p) <= at]
        unconverted |= {p.currency for p in sent + received} - set(rates.per_unit)
        windows[name] = {
            "sent_count": len(sent),
            "sent": {
                c: money_text(_total(amount_of(p) for p in sent if p.currency == c))
                for c in sorted({p.currency for p in sent})
            },
            "sent_total": in_reporting(sent, rates),
            "received_count": len(received),
            "received": {
                c: money_text(_total(amount_of(p) for p in received if p.currency == c))
                for c in sorted({p.currency for p in received})
            },
            "received_total": in_reporting(received, rates),
            "counterparties": len({p.payee for p in sent} | {p.payer for p in received}),
            "sent_counterparties": len({p.payee for p in sent}),
            "received_counterparties": len({p.payer for p in received}),
        }
        if name == "24h":
            with localcontext() as ctx:
                ctx.prec = 80
                low = threshold * (1 - band)
            near = sum(1 for p in sent if low <= amount_of(p) < threshold)
    return {
        "account": account,
        "at": instant_text(at),
        "windows": windows,
        "near_threshold_24h": near,
        "reporting_threshold": format(threshold, "f"),
        "threshold_band": format(band, "f"),
        "late_dropped": dropped,
        "exact": True,  # compared only where the store answers exactly (`exact_from`)
        "reporting_currency": rates.reporting,
        "unconverted": sorted(unconverted),
    }
