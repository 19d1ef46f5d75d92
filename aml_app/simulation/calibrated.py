"""A simulator calibrated to AMLworld: real-shaped background and laundering attempts in AMLworld's layouts.

Why: our own simulator (`traffic.py`) shapes its patterns to fit our rules, so its figures say nothing
about real data. This one draws every parameter from the real files in `tests/data/amlworld/` and writes
what AMLworld publishes: a transactions CSV of background (labelled 0) and a patterns file of laundering
attempts (labelled 1). Whatever reads AMLworld (`aml-app import-amlworld`, `bench.amlworld_detection`)
reads it unchanged. The measures it is held to, and their bounds, are in `tests/unit/test_calibration.py`.

Background, from HI-Small's first 7,500 rows:
- 72.5 % of payments are an account paying itself (`Reinvestment`);
- the rest are bursts: a payer makes 1-7 payments in a row (61 % make one), almost always to one payee,
  each in a format drawn by the real shares (credit card, cheque, ACH, cash, wire);
- a few payment processors make 6.9 % of the payments between two parties, each from a pool of 80
  payees (the real rows' busiest account paid 65 payees 144 times in half an hour);
- amounts are drawn from the real rows' quantiles per format (log-linear between them), so their heavy
  tails (cheques of hundreds of millions) are there;
- every account holds US dollars, as 99.97 % of the real rows do.
Accounts are numbered, and their banks drawn by a heavy-tailed law; a run has `accounts` of them
(default: about ten payments per account, as AMLworld's HI-Small has 5.08 million payments for 515,000
accounts).

Laundering attempts, from LI-Medium's patterns file (456 attempts), on background accounts:
- sizes: each typology's smallest attempt (one payment of a fan, one hop, one bipartite edge, a stack of
  two payments) about as often as in the file, otherwise spread up to the file's largest (`SIZES`);
- time: fans, cycles and random walks within 6 days, bipartite edges within 3; scatter-gather's second
  layer 2-4 days after the first; gather-scatter's fan-out in the 6 days after its fan-in's last
  payment; a stack's second hop up to 90 hours after its first. A run shorter than an attempt
  compresses that attempt to fit;
- shape: bipartite attempts are disjoint edges and stacks disjoint two-hop chains or two-payment
  cycles, as in the file (no account has two payers or two payees there); money goes back where it
  came from as often as there: a scatter-gather through one account is A -> M -> A, and some
  gather-scatters pay back their fan-in's payers (BACK_TO_SENDERS);
- money: amounts from the file's quantiles in US dollars; a hop passes on 93-107 % of what it got
  (scatter-gather 80-120 %); an attempt is in one currency about as often as its typology's are in the
  file (every fan-in, two in five gather-scatters, ...), otherwise each payment's currency is drawn from
  the file's mix; amounts are converted at AMLworld's rates; every payment is ACH, as in the file;
- accounts: some attempts pay between two accounts an earlier attempt paid between, either way round,
  as AMLworld's laundering accounts launder together again: most attempts of one or two payments, few
  larger ones (REUSED_EDGE_SHARE); a small attempt reuses a small one's edge, a large one a large one's.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

from aml_app.detection.exchange import ExchangeRates
from aml_app.simulation.amlworld import BEGIN, CURRENCIES, END, HEADER
from aml_app.simulation.traffic import pick

START = datetime(2022, 9, 1, tzinfo=UTC)
PAYMENTS_PER_ACCOUNT = 10  # HI-Small: 5.08 M payments, 515 k accounts
SELF_SHARE = 0.725
PROCESSOR_SHARE = 0.069
PROCESSOR_PAYEES = 80
# Burst sizes of a payer's payments between two parties (half an hour of HI-Small: 677 payers paid once,
# 187 twice, 129 three times, ...).
BURSTS = ((1, 615), (2, 170), (3, 117), (4, 67), (5, 17), (6, 5), (7, 9))
NEW_PAYEE = 0.1  # a burst's next payment goes to another payee
FORMATS = (("Credit Card", 358), ("Cheque", 344), ("ACH", 141), ("Cash", 106), ("Wire", 48))
SELF_FORMATS = (("Reinvestment", 997), ("Cheque", 1), ("Cash", 1), ("ACH", 1))
PROCESSOR_FORMATS = (("Cheque", 62), ("Credit Card", 44), ("Cash", 38))  # the busiest real account's
# Quantiles (0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 100 %) of the real amounts in US dollars, to 3 digits:
# the rows between two parties per format, self-payments (Reinvestment), the patterns file (laundering).
QUANTILES = (0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 100)
AMOUNTS = {
    "Reinvestment": (0.19, 3.5, 5.78, 8.49, 17.3, 1940, 33100, 371000, 1070000, 7910000, 61300000),
    "Credit Card": (0.26, 1.15, 6.26, 9.43, 34.7, 212, 6780, 17100, 22300, 27600, 29900),
    "Cheque": (0.01, 0.01, 0.03, 261, 2240, 15700, 140000, 2210000, 15500000, 151000000, 830000000),
    "ACH": (0.01, 0.02, 38.4, 144, 1170, 6360, 65800, 2500000, 16000000, 215000000, 568000000),
    "Cash": (0.01, 17.2, 90, 176, 2340, 18700, 130000, 1370000, 6400000, 50200000, 223000000),
    "Wire": (8.04, 10.4, 35, 101, 730, 4640, 17300, 110000, 975000, 14900000, 17200000),
    "laundering": (16.4, 168, 816, 1810, 5230, 10300, 15200, 18500, 19800, 42400000, 7030000000),
}
# Currencies of the patterns file's payments (ISO codes, per mille).
PATTERN_CURRENCIES = (
    ("USD", 399), ("EUR", 313), ("CNY", 59), ("JPY", 52), ("RUB", 50), ("INR", 43), ("CAD", 29), ("GBP", 28),
    ("AUD", 15), ("ILS", 10),
)  # fmt: skip
# The chance that an attempt is paid in one currency, chosen so that the share of one-currency attempts
# (a small attempt's few currencies can coincide) comes out as the file's.
SINGLE_CURRENCY = {
    "FAN-IN": 1.0,
    "FAN-OUT": 0.2,
    "GATHER-SCATTER": 0.4,
    "SCATTER-GATHER": 0.3,
    "CYCLE": 0.25,
    "RANDOM": 0.05,
    "BIPARTITE": 0.1,
    "STACK": 0.35,
}
HOUR = 3600.0
RATES = ExchangeRates()  # AMLworld's own fixed rates
NAMES = {iso: name for name, iso in CURRENCIES.items()}
TYPOLOGIES = (
    "FAN-IN",
    "FAN-OUT",
    "GATHER-SCATTER",
    "SCATTER-GATHER",
    "CYCLE",
    "RANDOM",
    "BIPARTITE",
    "STACK",
)


@dataclass(frozen=True)
class Row:
    """One payment in AMLworld's layout; `at` is seconds after the run's start."""

    at: float
    payer: int
    payee: int
    amount: Decimal
    currency: str  # ISO code
    payment_format: str


@dataclass(frozen=True)
class Attempt:
    """One laundering attempt: its patterns-file typology, the file's description, its payments."""

    typology: str
    detail: str
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class CalibratedRun:
    """Background and attempts of one run; `write` puts them in AMLworld's two file layouts."""

    seed: int
    start: datetime
    background: tuple[Row, ...]
    attempts: tuple[Attempt, ...]

    def write(self, directory: str | Path) -> tuple[Path, Path]:
        """`Trans.csv` (the background, AMLworld's header, labelled 0) and `Patterns.txt` (the attempts,
        CRLF lines as AMLworld writes them), in `directory`; returns their paths."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        transactions, patterns = folder / "Trans.csv", folder / "Patterns.txt"
        with open(transactions, "w", encoding="utf-8", newline="") as out:
            writer = csv.writer(out, lineterminator="\n")
            writer.writerow(HEADER)
            writer.writerows(self._fields(row, "0") for row in self.background)
        with open(patterns, "w", encoding="utf-8", newline="") as out:
            for attempt in self.attempts:
                title = f"{attempt.typology}:  {attempt.detail}" if attempt.detail else attempt.typology
                out.write(f"{BEGIN}{title}\r\n")
                for row in attempt.rows:
                    out.write(",".join(self._fields(row, "1")) + "\r\n")
                out.write(f"{END}\r\n\r\n")
        return transactions, patterns

    def _fields(self, row: Row, label: str) -> list[str]:
        when = (self.start + timedelta(seconds=row.at)).strftime("%Y/%m/%d %H:%M")
        amount, currency = format(row.amount, "f"), NAMES[row.currency]
        payer, payee = account(row.payer), account(row.payee)
        return [when, *payer, *payee, amount, currency, amount, currency, row.payment_format, label]


def account(number: int) -> tuple[str, str]:
    """(bank, account) of account `number`: banks heavy-tailed over 400, accounts in AMLworld's hex style."""
    bank = int(400 ** random.Random(number).random()) - 1
    return f"{bank:03d}", f"8{number:07X}0"


def processors(accounts: int) -> int:
    """How many of the first accounts are payment processors: one per million accounts, at least one."""
    return max(1, accounts // 1_000_000)


class _Draw:
    """The seeded generator shared by the background and the attempts, and its amounts."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def usd(self, kind: str) -> float:
        """An amount in US dollars from the real quantiles of `kind`, log-linear between them."""
        knots = AMOUNTS[kind]
        u = self.rng.uniform(0, 100)
        i = max(0, bisect.bisect_right(QUANTILES, u) - 1)
        if i >= len(QUANTILES) - 1:
            return knots[-1]
        low, high = math.log(knots[i]), math.log(knots[i + 1])
        share = (u - QUANTILES[i]) / (QUANTILES[i + 1] - QUANTILES[i])
        return math.exp(low + (high - low) * share)


def _money(usd: float, currency: str) -> Decimal:
    """`usd` dollars in `currency` at AMLworld's rates, to the cent (at least one cent)."""
    value = Decimal(repr(usd)) * RATES.per_unit[currency]
    return max(value.quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN), Decimal("0.01"))


# --------------------------------------------------------------------------- background


def _event_shares() -> tuple[float, float]:
    """(self, processor): the chances that an event of the background is a self-payment or a processor's
    payment, such that SELF_SHARE and PROCESSOR_SHARE hold for payments (a burst is several payments)."""
    burst = sum(size * weight for size, weight in BURSTS) / sum(weight for _, weight in BURSTS)
    processor = PROCESSOR_SHARE * burst / (1 - PROCESSOR_SHARE + PROCESSOR_SHARE * burst)
    between = processor + (1 - processor) * burst  # payments per event between two parties
    return SELF_SHARE * between / (1 - SELF_SHARE + SELF_SHARE * between), processor


def _background(draw: _Draw, count: int, per_hour: float, accounts: int) -> list[Row]:
    rng = draw.rng
    first = processors(accounts)  # accounts 0..first-1 are payment processors
    pools = [[rng.randrange(first, accounts) for _ in range(PROCESSOR_PAYEES)] for _ in range(first)]
    self_event, processor_event = _event_shares()
    rows: list[Row] = []
    step = HOUR / per_hour
    while len(rows) < count:
        roll = rng.random()
        if roll < self_event:
            payer = rng.randrange(first, accounts)
            kind = pick(rng, SELF_FORMATS)
            amount = _money(draw.usd("Reinvestment"), "USD")
            rows.append(Row(len(rows) * step, payer, payer, amount, "USD", kind))
        elif roll < self_event + (1 - self_event) * processor_event:
            processor = rng.randrange(first)
            kind = pick(rng, PROCESSOR_FORMATS)
            amount = _money(draw.usd(kind), "USD")
            rows.append(Row(len(rows) * step, processor, rng.choice(pools[processor]), amount, "USD", kind))
        else:
            payer = rng.randrange(first, accounts)
            payee = _other(rng, payer, first, accounts)
            for n in range(pick(rng, BURSTS)):
                if n and rng.random() < NEW_PAYEE:
                    payee = _other(rng, payer, first, accounts)
                kind = pick(rng, FORMATS)
                amount = _money(draw.usd(kind), "USD")
                rows.append(Row(len(rows) * step, payer, payee, amount, "USD", kind))
    return rows[:count]


def _other(rng: random.Random, payer: int, low: int, high: int) -> int:
    while True:
        payee = rng.randrange(low, high)
        if payee != payer:
            return payee


# --------------------------------------------------------------------------- laundering attempts

# Per typology: (smallest size, its share of attempts, largest size, skew). The size counts fan payments,
# hops, edges, intermediates, chains; the shares are the patterns file's; a size above the smallest is
# smallest + 1 + (largest - smallest) * u ** skew, u uniform (skew 1.5: small attempts more often).
SIZES = {
    "FAN-IN": (1, 0.21, 16, 1.0),
    "FAN-OUT": (1, 0.17, 16, 1.0),
    "GATHER-SCATTER": (1, 0.19, 15, 1.5),  # the fan-in's degree; the fan-out's follows the same law
    "SCATTER-GATHER": (1, 0.16, 16, 1.5),
    "CYCLE": (2, 0.24, 13, 1.0),
    "RANDOM": (1, 0.18, 12, 1.0),
    "BIPARTITE": (1, 0.26, 15, 1.0),
    "STACK": (1, 0.42, 15, 1.5),  # one chain, or (STACK_LOOP_SHARE of the time) a two-payment cycle
}
FAN_DAYS = 6.0
#: Money back where it came from. A gather-scatter's fan-out pays back the accounts its fan-in came from
# BACK_TO_SENDERS of the time (18 of the file's 43 pay an account that paid them), and a scatter-gather
# through one account is A -> M -> A (10 of 10). STACK_LOOP_SHARE of the smallest stacks are two-payment
# cycles (20 of the file's 67 stacks are, 28 are of one chain or cycle).
BACK_TO_SENDERS = 0.45
STACK_LOOP_SHARE = 0.7
BIPARTITE_DAYS = 3.0
STACK_GAP_HOURS = 90.0
#: The share of attempts of one payment, of two, and of more that pay between two accounts an earlier
# attempt of the same kind (small: one or two payments; large) paid between, either way round. In
# LI-Medium, 69 of 456 attempts pay again along an earlier attempt's edge and 72 against one
# (`bench.attempt_shapes.repeated_edges`), and they are small ones: 30 of the 51 lone payments and 33 of
# the 77 two-payment attempts pay between two accounts an earlier attempt paid between, mostly a small
# one (pairs of accounts that launder together again and again), against 20 of the 328 larger ones. A
# later attempt then often closes a loop the cycle rule sees, whatever its typology.
REUSED_EDGE_SHARE = (0.6, 0.4, 0.05)


class _Attempts:
    """Draws attempts on background accounts; times are hours after the attempt's start."""

    def __init__(self, draw: _Draw, accounts: int) -> None:
        self.draw, self.rng = draw, draw.rng
        self.first = processors(accounts)
        self.accounts = accounts
        # (payer, payee) of the attempts drawn so far: of the small ones (True), of the large ones (False)
        self.edges: dict[bool, list[tuple[int, int]]] = {True: [], False: []}

    def size(self, typology: str) -> int:
        low, share, high, skew = SIZES[typology]
        if self.rng.random() < share:
            return low
        return min(high, low + 1 + int((high - low) * self.rng.random() ** skew))

    def members(self, n: int) -> list[int]:
        chosen: dict[int, None] = {}
        while len(chosen) < n:
            chosen.setdefault(self.rng.randrange(self.first, self.accounts))
        return list(chosen)

    def currencies(self, single: bool) -> Callable[[], str]:
        """A function giving each payment's currency: one for the whole attempt, or drawn per payment."""
        one = pick(self.rng, PATTERN_CURRENCIES)
        return lambda: one if single else pick(self.rng, PATTERN_CURRENCIES)

    def within(self, n: int, days: float, after: float = 0.0) -> list[float]:
        """`n` hours from `after` on: the first at `after`, the last 70-100 % of `days` later, the others
        uniform between (the file's attempts of two payments or more nearly fill their window)."""
        if n == 1:
            return [after + self.rng.uniform(0, days * 24)]
        end = days * 24 * self.rng.uniform(0.7, 1.0)
        inner = sorted(self.rng.uniform(0, end) for _ in range(n - 2))
        return [after, *(after + hour for hour in inner), after + end]

    def build(self, typology: str) -> tuple[str, list[tuple[float, int, int, float, str]]]:
        """(detail, [(hour, payer, payee, usd, currency)])."""
        rng, size = self.rng, self.size(typology)
        currency = self.currencies(rng.random() < SINGLE_CURRENCY[typology])
        usd = lambda: self.draw.usd("laundering")  # noqa: E731
        out: list[tuple[float, int, int, float, str]] = []
        if typology in ("FAN-IN", "FAN-OUT"):
            hub, *others = self.members(size + 1)
            for hour, other in zip(self.within(size, FAN_DAYS), others, strict=True):
                payer, payee = (other, hub) if typology == "FAN-IN" else (hub, other)
                out.append((hour, payer, payee, usd(), currency()))
            return f"Max {size}-degree {typology.title()}", out
        if typology == "GATHER-SCATTER":
            scatter = self.size(typology)
            hub, *others = self.members(size + scatter + 1)
            payers, payees = others[:size], others[size:]
            if rng.random() < BACK_TO_SENDERS:  # the fan-out pays the fan-in's payers first
                payees = (payers + payees)[:scatter]
            gathered = self.within(size, FAN_DAYS)
            for hour, payer in zip(gathered, payers, strict=True):
                out.append((hour, payer, hub, usd(), currency()))
            for hour, payee in zip(self.within(scatter, FAN_DAYS, gathered[-1]), payees, strict=True):
                out.append((hour, hub, payee, usd(), currency()))
            return f"Max {size}-degree Fan-In", out
        if typology == "SCATTER-GATHER":
            source, sink, *middle = self.members(size + 2)
            if size == 1:  # through one account, the money comes back to its source
                sink = source
            for hour, via in zip(self.within(size, 2.0), middle, strict=True):
                sent = usd()
                out.append((hour, source, via, sent, currency()))
                out.append((hour + rng.uniform(48, 96), via, sink, sent * rng.uniform(0.8, 1.2), currency()))
            return "", out
        if typology in ("CYCLE", "RANDOM"):
            walk = self.members(size + (0 if typology == "CYCLE" else 1))
            hops = list(zip(walk, walk[1:] + walk[:1], strict=True))[:size]
            sent = usd()
            for hour, (payer, payee) in zip(self.within(size, FAN_DAYS), hops, strict=True):
                out.append((hour, payer, payee, sent, currency()))
                sent *= rng.uniform(0.93, 1.07)
            return f"Max {size} hops", out
        if typology == "BIPARTITE":
            people = self.members(2 * size)
            for hour, payer, payee in zip(
                self.within(size, BIPARTITE_DAYS), people[::2], people[1::2], strict=True
            ):
                out.append((hour, payer, payee, usd(), currency()))
            return "", out
        if size == 1 and rng.random() < STACK_LOOP_SHARE:  # STACK: a two-payment cycle
            a, b = self.members(2)
            hour, sent = rng.uniform(0, 72), usd()
            out.append((hour, a, b, sent, currency()))
            out.append(
                (hour + rng.uniform(0, STACK_GAP_HOURS), b, a, sent * rng.uniform(0.93, 1.07), currency())
            )
            return "", out
        people = self.members(3 * size)
        for n in range(size):
            a, b, c = people[3 * n : 3 * n + 3]
            hour, sent = rng.uniform(0, 72), usd()
            out.append((hour, a, b, sent, currency()))
            out.append(
                (hour + rng.uniform(0, STACK_GAP_HOURS), b, c, sent * rng.uniform(0.93, 1.07), currency())
            )
        return "", out

    def reuse(
        self, steps: list[tuple[float, int, int, float, str]]
    ) -> list[tuple[float, int, int, float, str]]:
        """`steps` with, REUSED_EDGE_SHARE of the time for their size, the two accounts of one payment
        renamed to those of a payment of an attempt of their kind drawn before, either way round (unless
        that would merge two of its accounts); then remembers the attempt's edges."""
        edges = [(payer, payee) for _, payer, payee, _, _ in steps]
        small = len(steps) <= 2
        pool = self.edges[small]
        if pool and self.rng.random() < REUSED_EDGE_SHARE[min(len(steps), 3) - 1]:
            old = self.rng.choice(pool)
            new = old if self.rng.random() < 0.5 else old[::-1]
            mine = self.rng.choice(edges)
            others = {account for edge in edges for account in edge} - set(mine)
            if not others.intersection(new):
                rename = dict(zip(mine, new, strict=True))
                steps = [(h, rename.get(p, p), rename.get(q, q), usd, c) for h, p, q, usd, c in steps]
        pool += [(payer, payee) for _, payer, payee, _, _ in steps]
        return steps


def simulate_calibrated(
    seed: int,
    *,
    days: float = 14.0,
    per_hour: float = 400.0,
    attempts: int = 40,
    accounts: int | None = None,
    start: datetime = START,
) -> CalibratedRun:
    """`days` of background at `per_hour` payments an hour, with `attempts` attempts of each of the eight
    typologies started at random over the run (an attempt longer than the run is compressed to fit).
    Raises ValueError for impossible parameters."""
    if not (math.isfinite(days) and days > 0 and math.isfinite(per_hour) and per_hour > 0):
        raise ValueError(f"days and per_hour must be positive numbers, got {days!r} and {per_hour!r}")
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 0:
        raise ValueError(f"attempts must be a whole number >= 0, got {attempts!r}")
    count = max(1, round(days * 24 * per_hour))
    population = accounts if accounts is not None else max(1000, count // PAYMENTS_PER_ACCOUNT)
    if population < 100:
        raise ValueError(f"accounts must be at least 100, got {population}")
    draw = _Draw(seed)
    background = _background(draw, count, per_hour, population)
    builder = _Attempts(draw, population)
    run = days * 24
    made = []
    order = [typology for typology, _ in itertools.product(TYPOLOGIES, range(attempts))]
    draw.rng.shuffle(order)  # an attempt may reuse the edges of any typology's attempts drawn before it
    for typology in order:
        detail, built = builder.build(typology)
        steps = builder.reuse(built)
        longest = max(hour for hour, *_ in steps)
        scale = min(1.0, run / longest) if longest > 0 else 1.0
        span = longest * scale
        begin = builder.rng.uniform(0, run - span)
        rows = tuple(  # min: a compressed attempt's rounding must not end it past the run
            Row(min(run, begin + hour * scale) * HOUR, payer, payee, _money(usd, currency), currency, "ACH")
            for hour, payer, payee, usd, currency in sorted(steps)
        )
        made.append(Attempt(typology, detail, rows))
    draw.rng.shuffle(made)
    return CalibratedRun(seed, start.astimezone(UTC), tuple(background), tuple(made))
