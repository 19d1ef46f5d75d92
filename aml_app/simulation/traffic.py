"""Simulated payment traffic with injected laundering typologies and their ground truth (pure, no I/O).

Why: detection can only be measured against known answers. `simulate` produces a deterministic stream
of payments (same seed, count, rate and start: byte-identical output) in which every laundering pattern
was put there on purpose and recorded, and in which the background is built so that it cannot look like
any of them under the default thresholds. Precision and recall then mean something (`score.py`).

Event time. Payments are sent at `rate` per second; payment n is sent n / rate seconds after the first.
Its `ts` is a simulated clock that starts at `start` and runs `speedup` times faster than sending
(default 60: a 60 s demo covers one simulated hour, so hourly and daily patterns show up in a demo).
ts(n) = start + n * speedup / rate seconds, so event time never decreases in send order, and therefore
never per payer either (the topic is keyed by payer: each payer's payments stay in order). A payment must
not be timestamped after it is sent (the contract dead-letters one whose `ts` is later than its Kafka
record's timestamp plus AML_MAX_CLOCK_SKEW), so a clock running ahead of sending has to start in the past:
`default_start` ends it at the send time of the last payment.

Background model (all accounts are named `<prefix>-p…`, `-m…`, `-s…` and never touch an instance):
- persons pay merchants small amounts (3 to 250, in the person's home currency; 85 % EUR, 10 % USD,
  5 % GBP) - about 70 % of the traffic;
- persons pay persons modest amounts (10 to 800), only from person i to a person among i+1..i+5: the
  person graph is a DAG and nobody has more than 5 distinct person payers;
- merchants settle with their own suppliers (merchant m with suppliers 3m, 3m+1, 3m+2 only), paying at
  most half of what they took in that currency in the last hour.
Persons never receive from merchants and suppliers never pay, so the whole background graph is a DAG
(no cycle ever). Invariants that keep it clear of every typology under the default thresholds:
no background amount is in the structuring band [threshold * (1 - band), threshold) (an amount that would
be is scaled below it); a person's average payment is at most 800 and a merchant has at most 3 payees
(no fan-out); merchants receive at most 250 a payment, persons from at most 5 persons and suppliers
from one merchant (no fan-in); an account that received 2000 or more in a currency in the last
hour never sends on more than half of it within that hour (no pass-through). The only edges whose average
payment can reach `graph_min_average` (1000) are merchant -> own supplier: heavy flows form stars of depth
one, so no heavy chain, two-step flow, shared payer or gather-scatter hub exists (no random, stack,
scatter-gather, bipartite, gather-scatter). The population grows with the hourly volume
(rate * 3600 / speedup), so per-account activity stays the same at any rate.

Injected typologies (each instance on fresh accounts `<prefix>-<typology>-<n>-…`, in EUR, sized from the
`AmlThresholds` given, spread evenly over the run, its payments in their natural order in event time):
- structuring: one payer sends min_count..min_count+2 payments in the band, 2 to 15 minutes apart, to 1
  or 2 beneficiaries; completes at the min_count-th payment.
- fan_in: min_counterparties..+4 fresh payers each pay one hub 1.5..3.5 times the fan-in minimum
  average, 10 s to 3 min apart; completes at the min_counterparties-th payer.
- fan_out: one hub pays min_counterparties..+4 fresh payees in the same way; completes likewise.
- cycle: A -> B (-> C) -> A, 2 or 3 hops (within the cycle thresholds), 1 to 10 minutes apart, each
  hop passing on 95-99 % of what it got; completes at the closing payment. Amounts stay under the
  pass-through minimum so that each instance shows one typology only.
- pass_through: a source pays a mule 2..6 times the pass-through minimum; within 1 to 10 minutes the mule
  sends min_ratio + 30..90 % of the rest on to 2 or 3 exits, minutes apart; completes at the first
  onward payment that brings the forwarded share to min_ratio.
- gather_scatter: G..G+2 payers (G = gather_scatter_min_counterparties) each pay a hub 1.5..3.5 times
  graph_min_average, 10 s to 3 min apart; 1 to 10 minutes later the hub sends 50-85 % of min_ratio of
  the gathered sum on to G..G+2 payees, 10 s to 3 min apart; completes at the hub's G-th payment.
- scatter_gather: a source pays M..M+2 intermediates (M = scatter_gather_min_intermediates) 1.2..2.5
  times graph_min_average each, 10 s to 3 min apart; 1 to 10 minutes later each intermediate passes on
  90-98 % of it to one sink, minutes apart; completes at the sink's M-th payment.
- random: a walk of H..H+2 heavy hops (H = random_min_hops) through fresh accounts that never comes back,
  1 to 10 minutes apart, each hop passing on 95-99 % (1.5..4 times graph_min_average at the start, below
  the pass-through minimum); completes at the H-th hop.
- bipartite: S..S+1 sources each pay every one of D..D+2 destinations (S, D = bipartite_min_sources,
  _destinations) 1.1..1.6 times graph_min_average, source after source, 30 s to 5 min apart; completes at
  source S's D-th payment.
- stack: two bipartite layers: K..K+1 sources (K = stack_min_sources) pay each of 2..3 intermediates
  1.1..1.6 times graph_min_average a payment, then the intermediates pay each of 2..3 destinations,
  destination after destination, each relaying 95-99 % of what its first source paid it; 30 s to 5 min
  apart; completes at the first payment of the second layer (a relay; the second payment into the first
  destination makes the two stacked layers). Its first layer is a bipartite block: the bipartite rule
  sees it first (rules.py).
Amounts of the layering patterns stay below the pass-through minimum per receiving account, and degrees
below the fan minimums, so that each instance shows its own typology (and a stack's first layer a
bipartite block).
A run too short for an instance's natural duration compresses that instance's gaps to fit.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_CEILING, ROUND_DOWN, Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

from aml_app.detection.rules import TYPOLOGIES
from aml_app.detection.thresholds import AmlThresholds
from aml_app.kafka.tools import PaymentRecord

T = TypeVar("T")
DEFAULT_SPEEDUP = 60.0
#: The most simulated seconds between two payments sent one after the other: a pass-through's onward
#: payments, each at least a slot after the last, must stay within the hour its rule looks at.
MAX_SLOT_SECONDS = 900
DEFAULT_THRESHOLD = Decimal("10000")
DEFAULT_BAND = Decimal("0.1")
HOUR = timedelta(hours=1)
CENT = Decimal("0.01")

# Background currencies and countries: (currency, weight, countries).
_HOME = (("EUR", 85, ("DE", "FR", "NL", "ES", "IT", "BE", "AT")), ("USD", 10, ("US",)), ("GBP", 5, ("GB",)))
_MERCHANT_COUNTRIES = ("DE", "FR", "NL", "ES", "IT", "IE", "LU")
_INSTANCE_COUNTRIES = ("DE", "FR", "NL", "ES", "IT", "CY", "MT", "LV")
_P2P_REACH = 5  # person i pays persons i+1..i+5 only
_SUPPLIERS_PER_MERCHANT = 3
# A background account that received this much in the last hour (one currency) sends on at most half.
_FORWARD_GUARD = Decimal("2000")
_KINDS = (("shop", 70), ("p2p", 22), ("settle", 8))


@dataclass(frozen=True)
class SimPayment(PaymentRecord):
    """One simulated payment, exactly as the contract puts it on the topic (amount and ts as text)."""

    payment_id: str
    payer: str
    payee: str
    amount: str
    currency: str
    ts: str
    channel: str
    country: str
    typology: str | None = None
    instance_id: str | None = None

    @property
    def when(self) -> datetime:
        return datetime.fromisoformat(self.ts)

    @property
    def decimal_amount(self) -> Decimal:
        return Decimal(self.amount)


@dataclass(frozen=True)
class Instance:
    """Ground truth for one injected pattern: its payments, its accounts, and the payment that completes
    it (the first at which the typology's rule can fire under the thresholds it was sized for)."""

    typology: str
    instance_id: str
    payment_ids: tuple[str, ...]
    accounts: tuple[str, ...]
    completes: str

    def as_json(self) -> dict[str, Any]:
        return {
            "typology": self.typology,
            "instance_id": self.instance_id,
            "payment_ids": list(self.payment_ids),
            "accounts": list(self.accounts),
            "completes": self.completes,
        }

    @classmethod
    def from_json(cls, doc: Any, where: str) -> Instance:
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        missing = [
            k for k in ("typology", "instance_id", "payment_ids", "accounts", "completes") if k not in doc
        ]
        if missing:
            raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
        for name in ("typology", "instance_id", "completes"):
            if not isinstance(doc[name], str) or not doc[name]:
                raise ValueError(f"{where}: {name} must be a non-empty string, got {doc[name]!r}")
        for name in ("payment_ids", "accounts"):
            items = doc[name]
            if not isinstance(items, list) or not items or not all(isinstance(i, str) and i for i in items):
                raise ValueError(f"{where}: {name} must be a non-empty list of strings")
        if doc["completes"] not in doc["payment_ids"]:
            raise ValueError(f"{where}: completes {doc['completes']!r} is not one of its payment_ids")
        return cls(
            typology=doc["typology"],
            instance_id=doc["instance_id"],
            payment_ids=tuple(doc["payment_ids"]),
            accounts=tuple(doc["accounts"]),
            completes=doc["completes"],
        )


@dataclass(frozen=True)
class Simulation:
    """The payments in send order and the ground truth of what was injected into them."""

    seed: int
    rate: float
    start: datetime
    speedup: float
    reporting_threshold: Decimal
    threshold_band: Decimal
    payments: tuple[SimPayment, ...]
    instances: tuple[Instance, ...]

    def records(self) -> list[tuple[bytes, bytes]]:
        """(key, value) for every payment, in send order."""
        return [(p.key, p.value()) for p in self.payments]

    def instances_of(self, typology: str) -> list[Instance]:
        return [i for i in self.instances if i.typology == typology]

    def payments_per_typology(self) -> dict[str, int]:
        """How many payments belong to each typology, and to the background (key "background")."""
        counts = {t: 0 for t in (*TYPOLOGIES, "background")}
        for p in self.payments:
            counts[p.typology or "background"] += 1
        return counts

    def write_ground_truth(self, path: str | Path) -> None:
        """One JSON object per instance per line (JSON Lines), in injection order."""
        with open(path, "w", encoding="utf-8") as out:
            for instance in self.instances:
                out.write(json.dumps(instance.as_json(), sort_keys=True) + "\n")


def read_ground_truth(path: str | Path) -> list[Instance]:
    """The instances written by `Simulation.write_ground_truth`; ValueError names a bad line."""
    instances = []
    with open(path, encoding="utf-8") as source:
        for number, line in enumerate(source, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            instances.append(Instance.from_json(doc, where))
    ids = [i.instance_id for i in instances]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: an instance_id appears twice")
    return instances


# --------------------------------------------------------------------------- helpers


def _cents(value: Decimal) -> Decimal:
    return value.quantize(CENT, rounding=ROUND_DOWN)


def _between(rng: random.Random, low: Decimal, high: Decimal) -> Decimal:
    """A whole-cent amount in [low, high], from integers only (the same on every platform)."""
    lo = int((low / CENT).to_integral_value(rounding=ROUND_CEILING))
    hi = int((high / CENT).to_integral_value(rounding=ROUND_DOWN))
    if lo > hi:
        raise ValueError(f"no whole-cent amount between {low} and {high}")
    return Decimal(rng.randint(lo, hi)) * CENT


def _scaled(rng: random.Random, base: Decimal, low: str, high: str) -> Decimal:
    return _between(rng, base * Decimal(low), base * Decimal(high))


def pick(rng: random.Random, weighted: Sequence[tuple[T, int]]) -> T:
    """One item of (item, integer weight) pairs, drawn by weight from integers only (the same on every
    platform)."""
    roll = rng.randrange(sum(w for _, w in weighted))
    for item, weight in weighted:
        if roll < weight:
            return item
        roll -= weight
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class _Band:
    """Service C's structuring band [threshold * (1 - band), threshold)."""

    threshold: Decimal
    band: Decimal

    @property
    def low(self) -> Decimal:
        return self.threshold * (1 - self.band)

    def contains(self, amount: Decimal) -> bool:
        return self.low <= amount < self.threshold

    def avoid(self, amount: Decimal) -> Decimal:
        """The amount, or, if it falls in the band, the amount scaled below the band."""
        if not self.contains(amount):
            return amount
        return max(_cents(amount * (1 - self.band)), CENT)


class _HourFlows:
    """Per account and currency: money received and sent in the last simulated hour (ts-hour, ts]."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str, str], deque[tuple[datetime, Decimal]]] = {}
        self._sums: dict[tuple[str, str, str], Decimal] = {}

    def total(self, account: str, direction: str, currency: str, now: datetime) -> Decimal:
        key = (account, direction, currency)
        events = self._events.get(key)
        if not events:
            return Decimal(0)
        while events and events[0][0] <= now - HOUR:
            self._sums[key] -= events.popleft()[1]
        return self._sums[key]

    def add(self, account: str, direction: str, currency: str, now: datetime, amount: Decimal) -> None:
        key = (account, direction, currency)
        self._events.setdefault(key, deque()).append((now, amount))
        self._sums[key] = self._sums.get(key, Decimal(0)) + amount


# --------------------------------------------------------------------------- injected typologies


@dataclass
class _Step:
    offset: float  # simulated seconds after the instance's first payment
    payer: str
    payee: str
    amount: Decimal
    channel: str


@dataclass
class _Shape:
    typology: str
    instance_id: str
    steps: list[_Step]
    accounts: list[str]
    completes: int  # index into steps


def _gaps(rng: random.Random, count: int, low: float, high: float) -> list[float]:
    """`count` offsets starting at 0, with gaps drawn in [low, high] seconds."""
    offsets = [0.0]
    for _ in range(count - 1):
        offsets.append(offsets[-1] + rng.uniform(low, high))
    return offsets


def _structuring(rng: random.Random, name: str, t: AmlThresholds, band: _Band) -> _Shape:
    payer = f"{name}-payer"
    beneficiaries = [f"{name}-beneficiary-{i}" for i in range(1, rng.randint(1, 2) + 1)]
    n = t.structuring_min_count + rng.randint(0, 2)
    steps = [
        _Step(
            at,
            payer,
            beneficiaries[i % len(beneficiaries)],
            _between(rng, band.low, band.threshold - CENT),
            "branch",
        )
        for i, at in enumerate(_gaps(rng, n, 120, 900))
    ]
    return _Shape("structuring", name, steps, [payer, *beneficiaries], t.structuring_min_count - 1)


def _fan(rng: random.Random, name: str, typology: str, t: AmlThresholds, band: _Band) -> _Shape:
    hub = f"{name}-hub"
    minimum = t.fan_in_min_counterparties if typology == "fan_in" else t.fan_out_min_counterparties
    average = t.fan_in_min_average if typology == "fan_in" else t.fan_out_min_average
    base = max(average, Decimal(100))
    n = minimum + rng.randint(0, 4)
    others = [f"{name}-{'payer' if typology == 'fan_in' else 'payee'}-{i:02d}" for i in range(1, n + 1)]
    steps = []
    for at, other in zip(_gaps(rng, n, 10, 180), others, strict=True):
        payer, payee = (other, hub) if typology == "fan_in" else (hub, other)
        steps.append(_Step(at, payer, payee, band.avoid(_scaled(rng, base, "1.5", "3.5")), "web"))
    return _Shape(typology, name, steps, [hub, *others], minimum - 1)


def _cycle(rng: random.Random, name: str, t: AmlThresholds, band: _Band) -> _Shape:
    allowed = [h for h in (2, 3) if t.cycle_min_hops <= h <= t.cycle_max_hops] or [t.cycle_max_hops]
    hops = rng.choice(allowed)
    ring = [f"{name}-{chr(ord('a') + i)}" for i in range(hops)]
    amount = band.avoid(_scaled(rng, t.pass_through_min_received, "0.4", "0.9"))
    steps = []
    for i, at in enumerate(_gaps(rng, hops, 60, 600)):
        steps.append(_Step(at, ring[i], ring[(i + 1) % hops], amount, "transfer"))
        amount = band.avoid(_cents(amount * Decimal(rng.randint(95, 99)) / 100))
    return _Shape("cycle", name, steps, ring, hops - 1)


def _pass_through(rng: random.Random, name: str, t: AmlThresholds, band: _Band) -> _Shape:
    source, mule = f"{name}-source", f"{name}-mule"
    exits = [f"{name}-exit-{i}" for i in range(1, rng.randint(2, 3) + 1)]
    deposit = band.avoid(_scaled(rng, t.pass_through_min_received, "2", "6"))
    ratio = t.pass_through_min_ratio
    share = ratio + (1 - ratio) * Decimal(rng.randint(30, 90)) / 100
    weights = [rng.randint(1, 10) for _ in exits]
    forwarded = _cents(deposit * share)
    amounts = [_cents(forwarded * w / sum(weights)) for w in weights]
    amounts[-1] = forwarded - sum(amounts[:-1])  # the parts add up to the forwarded total exactly
    amounts = [band.avoid(a) for a in amounts]
    steps = [_Step(0.0, source, mule, deposit, "transfer")]
    at = rng.uniform(60, 600)
    for exit_account, amount in zip(exits, amounts, strict=True):
        steps.append(_Step(at, mule, exit_account, amount, "transfer"))
        at += rng.uniform(30, 300)
    total, completes = Decimal(0), len(steps) - 1
    for i, step in enumerate(steps[1:], start=1):
        total += step.amount
        if total >= ratio * deposit:
            completes = i
            break
    return _Shape("pass_through", name, steps, [source, mule, *exits], completes)


def _heavy(rng: random.Random, t: AmlThresholds, low: str, high: str, cap: Decimal | None = None) -> Decimal:
    """A layering amount: `low`..`high` times graph_min_average (at least 100), at most `cap`."""
    base = max(t.graph_min_average, Decimal(100))
    top = base * Decimal(high) if cap is None else min(base * Decimal(high), cap)
    return _between(rng, base * Decimal(low), max(top, base * Decimal(low)))


def _gather_scatter(rng: random.Random, name: str, t: AmlThresholds, band: _Band) -> _Shape:
    hub = f"{name}-hub"
    minimum = t.gather_scatter_min_counterparties
    payers = [f"{name}-payer-{i:02d}" for i in range(1, minimum + rng.randint(0, 2) + 1)]
    payees = [f"{name}-payee-{i:02d}" for i in range(1, minimum + rng.randint(0, 2) + 1)]
    steps = [
        _Step(at, payer, hub, band.avoid(_heavy(rng, t, "1.5", "3.5")), "web")
        for at, payer in zip(_gaps(rng, len(payers), 10, 180), payers, strict=True)
    ]
    gathered = sum((step.amount for step in steps), Decimal(0))
    share = t.pass_through_min_ratio * Decimal(rng.randint(50, 85)) / 100
    each = max(_cents(gathered * share / len(payees)), CENT)
    later = steps[-1].offset + rng.uniform(60, 600)
    for at, payee in zip(_gaps(rng, len(payees), 10, 180), payees, strict=True):
        steps.append(_Step(later + at, hub, payee, band.avoid(each), "web"))
    return _Shape("gather_scatter", name, steps, [hub, *payers, *payees], len(payers) + minimum - 1)


def _scatter_gather(rng: random.Random, name: str, t: AmlThresholds, band: _Band) -> _Shape:
    source, sink = f"{name}-source", f"{name}-sink"
    minimum = t.scatter_gather_min_intermediates
    middle = [f"{name}-via-{i:02d}" for i in range(1, minimum + rng.randint(0, 2) + 1)]
    cap = t.pass_through_min_received * Decimal("0.9")
    steps = [
        _Step(at, source, via, band.avoid(_heavy(rng, t, "1.2", "2.5", cap)), "transfer")
        for at, via in zip(_gaps(rng, len(middle), 10, 180), middle, strict=True)
    ]
    later = steps[-1].offset + rng.uniform(60, 600)
    for at, first in zip(_gaps(rng, len(middle), 60, 600), list(steps), strict=True):
        onward = band.avoid(_cents(first.amount * Decimal(rng.randint(90, 98)) / 100))
        steps.append(_Step(later + at, first.payee, sink, onward, "transfer"))
    return _Shape("scatter_gather", name, steps, [source, *middle, sink], len(middle) + minimum - 1)


def _random_walk(rng: random.Random, name: str, t: AmlThresholds, band: _Band) -> _Shape:
    hops = t.random_min_hops + rng.randint(0, 2)
    walk = [f"{name}-{i}" for i in range(hops + 1)]
    amount = band.avoid(_heavy(rng, t, "1.5", "4", t.pass_through_min_received * Decimal("0.9")))
    steps = []
    for i, at in enumerate(_gaps(rng, hops, 60, 600)):
        steps.append(_Step(at, walk[i], walk[i + 1], amount, "transfer"))
        amount = band.avoid(_cents(amount * Decimal(rng.randint(95, 99)) / 100))
    return _Shape("random", name, steps, walk, t.random_min_hops - 1)


def _blocks(
    rng: random.Random, t: AmlThresholds, band: _Band, pairs: list[tuple[str, str]], start: float
) -> list[_Step]:
    """One heavy payment per (payer, payee) pair, in the order given, 30 s to 5 min apart."""
    return [
        _Step(start + at, payer, payee, band.avoid(_heavy(rng, t, "1.1", "1.6")), "transfer")
        for at, (payer, payee) in zip(_gaps(rng, len(pairs), 30, 300), pairs, strict=True)
    ]


def _bipartite(rng: random.Random, name: str, t: AmlThresholds, band: _Band) -> _Shape:
    sources = [f"{name}-source-{i}" for i in range(1, t.bipartite_min_sources + rng.randint(0, 1) + 1)]
    targets = [f"{name}-target-{i}" for i in range(1, t.bipartite_min_destinations + rng.randint(0, 2) + 1)]
    steps = _blocks(rng, t, band, [(s, d) for s in sources for d in targets], 0.0)
    completes = (t.bipartite_min_sources - 1) * len(targets) + t.bipartite_min_destinations - 1
    return _Shape("bipartite", name, steps, [*sources, *targets], completes)


def _stack(rng: random.Random, name: str, t: AmlThresholds, band: _Band) -> _Shape:
    sources = [f"{name}-source-{i}" for i in range(1, t.stack_min_sources + rng.randint(0, 1) + 1)]
    middle = [f"{name}-via-{i}" for i in range(1, 2 + rng.randint(0, 1) + 1)]
    targets = [f"{name}-target-{i}" for i in range(1, 2 + rng.randint(0, 1) + 1)]
    steps = _blocks(rng, t, band, [(s, m) for s in sources for m in middle], 0.0)
    later = steps[-1].offset + rng.uniform(60, 600)
    # Each intermediate relays 95-99 % of what its first source paid it, to every destination.
    first_in = {m: next(step.amount for step in steps if step.payee == m) for m in middle}
    pairs = [(m, d) for d in targets for m in middle]
    for at, (via, target) in zip(_gaps(rng, len(pairs), 30, 300), pairs, strict=True):
        relayed = band.avoid(_cents(first_in[via] * Decimal(rng.randint(95, 99)) / 100))
        steps.append(_Step(later + at, via, target, relayed, "transfer"))
    return _Shape("stack", name, steps, [*sources, *middle, *targets], len(sources) * len(middle))


def _shape(rng: random.Random, typology: str, name: str, t: AmlThresholds, band: _Band) -> _Shape:
    build = {
        "structuring": _structuring,
        "fan_in": lambda r, n, th, b: _fan(r, n, "fan_in", th, b),
        "fan_out": lambda r, n, th, b: _fan(r, n, "fan_out", th, b),
        "gather_scatter": _gather_scatter,
        "scatter_gather": _scatter_gather,
        "cycle": _cycle,
        "random": _random_walk,
        "bipartite": _bipartite,
        "stack": _stack,
        "pass_through": _pass_through,
    }
    return build[typology](rng, name, t, band)


# --------------------------------------------------------------------------- background


class _Background:
    """Generates background payments in send order; see the module docstring for the model."""

    def __init__(self, rng: random.Random, prefix: str, hourly_volume: float, band: _Band) -> None:
        self.rng = rng
        self.band = band
        self.persons = min(max(int(hourly_volume / 2), 200), 200_000)
        self.merchants = min(max(int(hourly_volume / 50), 10), 5_000)
        self.prefix = prefix
        homes = [(currency, weight) for currency, weight, _ in _HOME]
        self.home = [pick(rng, homes) for _ in range(self.persons)]
        countries = {h: c for h, _, c in _HOME}
        self.country = [rng.choice(countries[h]) for h in self.home]
        self.merchant_country = [rng.choice(_MERCHANT_COUNTRIES) for _ in range(self.merchants)]
        # A few busy merchants and a long tail: weight 1/(rank+1), cumulated for a bisect per draw.
        self.merchant_cumulative = list(
            itertools.accumulate(1_000_000 // (m + 1) for m in range(self.merchants))
        )
        self.flows = _HourFlows()

    def person(self, i: int) -> str:
        return f"{self.prefix}-p{i:06d}"

    def merchant(self, m: int) -> str:
        return f"{self.prefix}-m{m:04d}"

    def supplier(self, s: int) -> str:
        return f"{self.prefix}-s{s:05d}"

    def _may_send(self, account: str, currency: str, amount: Decimal, now: datetime) -> bool:
        """The pass-through guard: after receiving _FORWARD_GUARD or more in the last hour, at most half
        of it may leave again within that hour."""
        received = self.flows.total(account, "in", currency, now)
        if received < _FORWARD_GUARD:
            return True
        return self.flows.total(account, "out", currency, now) + amount <= received / 2

    def _record(self, payer: str, payee: str, currency: str, amount: Decimal, now: datetime) -> None:
        self.flows.add(payer, "out", currency, now, amount)
        self.flows.add(payee, "in", currency, now, amount)

    def next(self, now: datetime) -> tuple[str, str, Decimal, str, str, str]:
        """(payer, payee, amount, currency, channel, country) of the next background payment."""
        kind = pick(self.rng, _KINDS)
        if kind == "settle":
            found = self._settlement(now)
            if found is not None:
                return found
        if kind == "p2p":
            found = self._p2p(now)
            if found is not None:
                return found
        return self._shopping(now)

    def _shopping(self, now: datetime) -> tuple[str, str, Decimal, str, str, str]:
        while True:  # persons who received nothing lately always pass the guard, so this ends quickly
            i = self.rng.randrange(self.persons)
            m = self._merchant()
            amount = self._amount(((3, 20, 5), (20, 80, 3), (80, 250, 1)))
            payer, currency = self.person(i), self.home[i]
            if self._may_send(payer, currency, amount, now):
                self._record(payer, self.merchant(m), currency, amount, now)
                channel = self.rng.choice(("card", "card", "web", "mobile"))
                return payer, self.merchant(m), amount, currency, channel, self.country[i]

    def _p2p(self, now: datetime) -> tuple[str, str, Decimal, str, str, str] | None:
        i = self.rng.randrange(self.persons - 1)
        j = i + self.rng.randint(1, min(_P2P_REACH, self.persons - 1 - i))
        amount = self._amount(((10, 100, 4), (100, 800, 2)))
        payer, currency = self.person(i), self.home[i]
        if not self._may_send(payer, currency, amount, now):
            return None
        self._record(payer, self.person(j), currency, amount, now)
        return payer, self.person(j), amount, currency, self.rng.choice(("mobile", "web")), self.country[i]

    def _settlement(self, now: datetime) -> tuple[str, str, Decimal, str, str, str] | None:
        m = self._merchant()
        s = m * _SUPPLIERS_PER_MERCHANT + self.rng.randrange(_SUPPLIERS_PER_MERCHANT)
        payer = self.merchant(m)
        budgets = [
            (self.flows.total(payer, "in", c, now) / 2 - self.flows.total(payer, "out", c, now), c)
            for c, _, _ in _HOME
        ]
        budget, currency = max(budgets, key=lambda bc: (bc[0], bc[1]))
        if budget < 50:
            return None
        amount = self.band.avoid(min(_between(self.rng, Decimal(200), Decimal(3000)), _cents(budget)))
        self._record(payer, self.supplier(s), currency, amount, now)
        return payer, self.supplier(s), amount, currency, "transfer", self.merchant_country[m]

    def _merchant(self) -> int:
        roll = self.rng.randrange(self.merchant_cumulative[-1])
        return bisect.bisect_right(self.merchant_cumulative, roll)

    def _amount(self, buckets: Sequence[tuple[int, int, int]]) -> Decimal:
        """An amount from one of the (low, high, weight) buckets, kept out of the structuring band."""
        low, high = pick(self.rng, [((lo, hi), w) for lo, hi, w in buckets])
        return self.band.avoid(_between(self.rng, Decimal(low), Decimal(high)))


# --------------------------------------------------------------------------- the run


def _country_of(account: str) -> str:
    """A stable country per instance account (a checksum of its name: no random draw, no order effect)."""
    return _INSTANCE_COUNTRIES[sum(map(ord, account)) % len(_INSTANCE_COUNTRIES)]


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def default_start(count: int, rate: float, speedup: float, now: datetime) -> datetime:
    """The first event time of a run whose sending starts at `now` or later: the simulated clock ends at the
    send time of the last payment, so that no payment is timestamped after it is sent.

    ts(n) - sent(n) = start - now + n * (speedup - 1) / rate: for a speedup above 1 largest at the last
    payment, hence start = now - count / rate * (speedup - 1), to the second, rounded down; `now` (to the
    second) for a speedup of 1 or less, whose clock never gains on sending.
    """
    back = max(Fraction(count) / Fraction(rate) * (Fraction(speedup) - 1), Fraction(0))
    return (now.astimezone(UTC) - timedelta(microseconds=math.ceil(back * 1_000_000))).replace(microsecond=0)


def ahead_of_sending(start: datetime, count: int, rate: float, speedup: float, first_sent: datetime) -> float:
    """Seconds by which the latest-stamped payment of a run is timestamped after it is sent, when the
    first is sent at `first_sent` (negative: every payment is stamped before it is sent)."""
    gain = max((count - 1) * (speedup - 1) / rate, 0.0)
    return (start - first_sent).total_seconds() + gain


def default_instances(count: int) -> int:
    """Instances per typology when not given: one per 1000 payments, 1 to 20."""
    return min(max(count // 1000, 1), 20)


def simulate(
    seed: int,
    count: int,
    rate: float,
    start: datetime,
    *,
    speedup: float = DEFAULT_SPEEDUP,
    instances: int | None = None,
    reporting_threshold: Decimal = DEFAULT_THRESHOLD,
    threshold_band: Decimal = DEFAULT_BAND,
    thresholds: AmlThresholds | None = None,
    prefix: str | None = None,
) -> Simulation:
    """`count` payments in send order with `instances` instances of every typology injected.

    `reporting_threshold` and `threshold_band` must be Service C's (`Settings`); `thresholds` are the AML
    rule thresholds the injected patterns are sized to exceed (default `AmlThresholds()`). Account and
    payment ids start with `prefix` (default "sim<seed>"). Raises ValueError for impossible parameters.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a whole number >= 1, got {count!r}")
    if not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number of payments per second, got {rate!r}")
    if not (isinstance(speedup, int | float) and math.isfinite(speedup) and speedup > 0):
        raise ValueError(f"speedup must be a positive number, got {speedup!r}")
    if speedup / rate > MAX_SLOT_SECONDS:
        raise ValueError(
            f"speedup / rate is {speedup / rate:,.0f} simulated seconds per payment, more than "
            f"{MAX_SLOT_SECONDS}: an instance's payments, each a slot apart, would fall outside the rules' "
            "one-hour windows (lower the speedup or raise the rate)"
        )
    if start.tzinfo is None or start.utcoffset() is None:
        raise ValueError(f"start must be timezone-aware, got {start.isoformat()}")
    if not (reporting_threshold > 0 and 0 < threshold_band < 1):
        raise ValueError("reporting_threshold must be > 0 and threshold_band between 0 and 1")
    per_typology = default_instances(count) if instances is None else instances
    if isinstance(per_typology, bool) or not isinstance(per_typology, int) or per_typology < 0:
        raise ValueError(f"instances must be a whole number >= 0, got {instances!r}")
    thresholds = AmlThresholds() if thresholds is None else thresholds
    prefix = f"sim{seed}" if prefix is None else prefix
    start = start.astimezone(UTC)
    band = _Band(reporting_threshold, threshold_band)
    rng = random.Random(seed)

    shapes = [
        _shape(rng, typology, f"{prefix}-{typology.replace('_', '')}-{n}", thresholds, band)
        for typology in TYPOLOGIES
        for n in range(1, per_typology + 1)
    ]
    injected = sum(len(s.steps) for s in shapes)
    if injected > count // 3:
        raise ValueError(
            f"{per_typology} instance(s) of each typology need {injected} payments; "
            f"with {count} payments in all at most a third may be injected (send more, or fewer instances)"
        )
    slots = _place(rng, shapes, count, rate, speedup)

    seconds = Fraction(speedup) / Fraction(rate)
    background = _Background(rng, prefix, 3600 / float(seconds), band)
    payments: list[SimPayment] = []
    for n in range(count):
        now = start + timedelta(microseconds=int(n * seconds * 1_000_000))
        payment_id = f"{prefix}-{n:07d}"
        owner = slots.get(n)
        if owner is None:
            payer, payee, amount, currency, channel, country = background.next(now)
            payments.append(
                SimPayment(
                    payment_id, payer, payee, format(amount, "f"), currency, _iso(now), channel, country
                )
            )
            continue
        shape, step = owner
        payments.append(
            SimPayment(
                payment_id,
                step.payer,
                step.payee,
                format(step.amount, "f"),
                "EUR",
                _iso(now),
                step.channel,
                _country_of(step.payer),
                shape.typology,
                shape.instance_id,
            )
        )
    ids: dict[int, str] = {id(step): payments[n].payment_id for n, (_, step) in slots.items()}
    truth = tuple(
        Instance(
            typology=s.typology,
            instance_id=s.instance_id,
            payment_ids=tuple(ids[id(step)] for step in s.steps),
            accounts=tuple(s.accounts),
            completes=ids[id(s.steps[s.completes])],
        )
        for s in shapes
    )
    return Simulation(
        seed=seed,
        rate=float(rate),
        start=start,
        speedup=float(speedup),
        reporting_threshold=reporting_threshold,
        threshold_band=threshold_band,
        payments=tuple(payments),
        instances=truth,
    )


def _place(
    rng: random.Random, shapes: Iterable[_Shape], count: int, rate: float, speedup: float
) -> dict[int, tuple[_Shape, _Step]]:
    """Send slots for every instance payment: instances spread evenly over the run in a shuffled order,
    each payment at its offset (compressed if the instance is longer than half the run), in order."""
    order = list(shapes)
    rng.shuffle(order)
    seconds_per_slot = speedup / rate
    run = count * seconds_per_slot  # simulated seconds covered by the run
    # A collision moves a payment one slot later, past a slot another instance took: keep that many
    # slots free at the end (at most a third of the run, as simulate() checks).
    margin = sum(len(shape.steps) for shape in order) * seconds_per_slot
    taken: dict[int, tuple[_Shape, _Step]] = {}
    for j, shape in enumerate(order):
        span = shape.steps[-1].offset
        scale = min(1.0, run / 2 / span) if span > 0 else 1.0
        room = run - span * scale - margin
        begin = room * j / len(order) + rng.uniform(0, room / len(order))
        previous = -1
        for step in shape.steps:
            slot = max(int((begin + step.offset * scale) / seconds_per_slot), previous + 1)
            while slot in taken:
                slot += 1
            if slot >= count:
                raise ValueError(f"instance {shape.instance_id} does not fit in {count} payments")
            taken[slot] = (shape, step)
            previous = slot
    return taken
