"""Typed evidence for the detection rules, parsed from the JSON answers of Services B and C.

Why a parsing layer: the rules should compare Decimals and datetimes, not poke at dicts of strings, and a
malformed or mismatched answer (wrong account, wrong instant, a missing field) must stop the decision with
a clear ValueError instead of silently reading as "nothing suspicious". Parsing checks the shape the
services document (docs/pipeline.md) and nothing more; an unknown account's answer (all
zeros, empty lists) is valid and parses to empty values. msgspec checks the shape (`from_json`); a
malformed answer is parsed again field by field (`checked`), whose error names the place of what is wrong.

No Faust here: Service-A and Service-A1 build `Evidence` from plain payment fields.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, TypeVar

import msgspec

WINDOW_NAMES = ("1h", "24h", "7d")
_COUNTS = ("sent_count", "received_count", "counterparties", "sent_counterparties", "received_counterparties")


# Every answer of a batch is parsed on the hot path, so a check builds its message only when it fails: a
# field's place in the answer goes in as `where` and `name`, which `_at` joins then.


def _at(where: str, name: str | None) -> str:
    return where if name is None else f"{where}.{name}"


def _is_object(doc: Any) -> bool:
    return type(doc) is dict or isinstance(doc, Mapping)


def _need(doc: Mapping[str, Any], key: str, where: str, name: str | None = None) -> Any:
    if type(doc) is dict and key in doc:
        return doc[key]
    if not _is_object(doc):
        raise ValueError(f"{_at(where, name)} must be a JSON object, got {type(doc).__name__}")
    if key not in doc:
        raise ValueError(f"{_at(where, name)} lacks the field {key!r}")
    return doc[key]


def _count(value: Any, where: str, name: str | None = None) -> int:
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{_at(where, name)} must be a whole number >= 0, got {value!r}")
    return value


def _text(value: Any, where: str, name: str | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{_at(where, name)} must be a non-empty string, got {value!r}")
    return value


def parse_money(value: Any, where: str, name: str | None = None) -> Decimal:
    """An exact amount from a decimal string ("12.50"); floats are refused because they are not exact."""
    if not isinstance(value, str):
        raise ValueError(f'{_at(where, name)} must be a decimal string such as "12.50", got {value!r}')
    try:
        amount = Decimal(value)
    except InvalidOperation:
        raise ValueError(f"{_at(where, name)} is not a decimal number: {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"{_at(where, name)} must be a finite amount >= 0, got {value!r}")
    return amount


def parse_instant(value: Any, where: str, name: str | None = None) -> datetime:
    """An aware UTC datetime from ISO-8601 text with a timezone ('Z' or an offset)."""
    if isinstance(value, datetime):
        when = value
    elif isinstance(value, str):
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"{_at(where, name)} is not an ISO-8601 instant: {value!r}") from None
    else:
        raise ValueError(f"{_at(where, name)} must be an ISO-8601 string, got {value!r}")
    if when.tzinfo is UTC:
        return when
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"{_at(where, name)} has no timezone: {value!r}")
    return when.astimezone(UTC)


def _sums(value: Any, where: str, name: str) -> dict[str, Decimal]:
    if not _is_object(value):
        raise ValueError(f"{where}.{name} must be an object of currency -> amount, got {value!r}")
    place = f"{where}.{name}"
    sums = {}
    for currency, text in value.items():
        if not isinstance(currency, str) or not currency:
            _text(currency, f"{place} currency")
        sums[currency] = parse_money(text, place, currency)
    return sums


def _accounts(values: list[Any], where: str, name: str) -> tuple[str, ...]:
    """A list of account names (non-empty strings) as a tuple."""
    for value in values:
        if not isinstance(value, str) or not value:
            _text(value, where, name)
    return tuple(values)


def _as_of(doc: Mapping[str, Any], where: str) -> dict[int, int]:
    raw = doc.get("as_of", {})
    if not _is_object(raw):
        raise ValueError(f"{where}.as_of must be an object of partition -> offset, got {raw!r}")
    try:
        return {
            int(p): o if type(o) is int and o >= 0 else _count(o, f"{where}.as_of[{p}]")
            for p, o in raw.items()
        }
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}.as_of is malformed: {exc}") from None


class Window(msgspec.Struct, frozen=True):
    """One window (at - w, at] of Service C: counts and per-currency sums, the payment itself included."""

    sent_count: int = 0
    sent: Mapping[str, Decimal] = msgspec.field(default_factory=dict)
    received_count: int = 0
    received: Mapping[str, Decimal] = msgspec.field(default_factory=dict)
    counterparties: int = 0
    sent_counterparties: int = 0
    received_counterparties: int = 0

    def sent_in(self, currency: str) -> Decimal:
        """Sent in `currency` only; other currencies are not converted (no FX)."""
        return self.sent.get(currency, Decimal(0))

    def received_in(self, currency: str) -> Decimal:
        """Received in `currency` only; other currencies are not converted (no FX)."""
        return self.received.get(currency, Decimal(0))

    @classmethod
    def from_json(cls, doc: Any, where: str) -> Window:
        counts = {name: _count(_need(doc, name, where), where, name) for name in _COUNTS}
        return cls(
            sent=_sums(_need(doc, "sent", where), where, "sent"),
            received=_sums(_need(doc, "received", where), where, "received"),
            **counts,
        )


@dataclass(frozen=True)
class Aggregates:
    """Service C's answer for one account at one instant (`GET /aggregates/{account}?at=`)."""

    account: str
    at: datetime
    windows: Mapping[str, Window]
    near_threshold_24h: int
    reporting_threshold: Decimal
    threshold_band: Decimal
    late_dropped: int = 0
    as_of: Mapping[int, int] = field(default_factory=dict)

    def window(self, name: str) -> Window:
        return self.windows[name]

    def is_near_threshold(self, amount: Decimal) -> bool:
        """Service C's own definition: threshold * (1 - band) <= amount < threshold."""
        low = self.reporting_threshold * (1 - self.threshold_band)
        return low <= amount < self.reporting_threshold

    @classmethod
    def from_json(cls, doc: Any) -> Aggregates:
        """C's answer, its shape checked by msgspec; where it is malformed, `checked` names the place."""
        return _fast(doc, _AggregatesDoc, _aggregates, cls.checked, "aggregates answer")

    @classmethod
    def checked(cls, doc: Any) -> Aggregates:
        """C's answer parsed field by field: what `from_json` runs to say what is wrong and where."""
        account = _text(_need(doc, "account", "aggregates answer"), "aggregates answer.account")
        where = f"aggregates answer for {account!r}"
        windows_doc = _need(doc, "windows", where)
        windows = {
            name: Window.from_json(_need(windows_doc, name, where, "windows"), f"{where}.windows.{name}")
            for name in WINDOW_NAMES
        }
        threshold = parse_money(_need(doc, "reporting_threshold", where), where, "reporting_threshold")
        band = parse_money(_need(doc, "threshold_band", where), where, "threshold_band")
        if threshold <= 0 or not 0 <= band < 1:
            raise ValueError(f"{where}: reporting_threshold must be > 0 and threshold_band in [0, 1)")
        return cls(
            account=account,
            at=parse_instant(_need(doc, "at", where), where, "at"),
            windows=windows,
            near_threshold_24h=_count(_need(doc, "near_threshold_24h", where), where, "near_threshold_24h"),
            reporting_threshold=threshold,
            threshold_band=band,
            late_dropped=_count(doc.get("late_dropped", 0), where, "late_dropped"),
            as_of=_as_of(doc, where),
        )


class Edge(msgspec.Struct, frozen=True):
    """A direct counterparty in Service B: payments on the edge, all currencies merged in `count`."""

    counterparty: str
    count: int
    totals: Mapping[str, Decimal]
    first_seen: datetime
    last_seen: datetime

    @classmethod
    def from_json(cls, doc: Any, where: str) -> Edge:
        counterparty = _text(_need(doc, "counterparty", where), where, "counterparty")
        where = f"{where}[{counterparty!r}]"
        return cls(
            counterparty=counterparty,
            count=_count(_need(doc, "count", where), where, "count"),
            totals=_sums(_need(doc, "totals", where), where, "totals"),
            first_seen=parse_instant(_need(doc, "first_seen", where), where, "first_seen"),
            last_seen=parse_instant(_need(doc, "last_seen", where), where, "last_seen"),
        )


class Cycle(msgspec.Struct, frozen=True):
    """The shortest directed cycle from the account back to itself (path starts and ends there); for a
    `loop`, `complete` is false when B stopped searching before it could say there is none."""

    found: bool = False
    path: tuple[str, ...] = ()
    complete: bool = True

    @property
    def hops(self) -> int:
        return max(len(self.path) - 1, 0)


@dataclass(frozen=True)
class Relations:
    """Service B's answer for one account (`GET /relations/{account}?hops=k`).

    The layering parts (chain, sources, co_payees) count heavy edges only, as the request's `min_average`
    defined them: `chain` is the longest heavy flow ending at the account (accounts in order, the account
    last; empty when none; asked about the payee, its last edge is the payer's), `sources` maps a source
    to the intermediates through which it reaches the account in two heavy steps, `co_payees` maps an
    account to the number of heavy payers it shares with this one. `loop` is the cycle that the payment
    being decided closes (asked about its payee, the cycle's start: path payee, ..., payer, payee), if
    money can have gone around it in time.
    """

    account: str
    hops: int
    out: Mapping[str, Edge]
    in_: Mapping[str, Edge]
    neighbourhood: Mapping[str, int]
    cycle: Cycle
    as_of: Mapping[int, int] = field(default_factory=dict)
    chain: tuple[str, ...] = ()
    sources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    co_payees: Mapping[str, int] = field(default_factory=dict)
    loop: Cycle = field(default_factory=Cycle)

    @classmethod
    def from_json(cls, doc: Any) -> Relations:
        """B's answer, its shape checked by msgspec; where it is malformed, `checked` names the place."""
        return _fast(doc, _RelationsDoc, _relations, cls.checked, "relations answer")

    @classmethod
    def checked(cls, doc: Any) -> Relations:
        """B's answer parsed field by field: what `from_json` runs to say what is wrong and where."""
        account = _text(_need(doc, "account", "relations answer"), "relations answer.account")
        where = f"relations answer for {account!r}"
        hops = _count(_need(doc, "hops", where), where, "hops")
        # A caller may ask B for some parts only (`parts=out,cycle`): a part not asked for is absent, and
        # reads as empty here; a part that is present must be well-formed.
        sides: dict[str, dict[str, Edge]] = {}
        for side in ("out", "in"):
            items = doc.get(side, []) if isinstance(doc, Mapping) else _need(doc, side, where)
            if not isinstance(items, list):
                raise ValueError(f"{where}.{side} must be a list, got {type(items).__name__}")
            sides[side] = {}
            for item in items:
                edge = Edge.from_json(item, f"{where}.{side}")
                sides[side][edge.counterparty] = edge
        neighbourhood: dict[str, int] = {}
        items = doc.get("neighbourhood", [])
        if not isinstance(items, list):
            raise ValueError(f"{where}.neighbourhood must be a list, got {type(items).__name__}")
        for item in items:
            name = _text(_need(item, "account", where, "neighbourhood"), where, "neighbourhood.account")
            hops_away = _need(item, "hops", where, "neighbourhood")
            neighbourhood[name] = _count(hops_away, where, f"neighbourhood[{name!r}].hops")
        return cls(
            account=account,
            hops=hops,
            out=sides["out"],
            in_=sides["in"],
            neighbourhood=neighbourhood,
            cycle=_cycle(doc.get("cycle", {"found": False, "path": []}), account, hops, where),
            as_of=_as_of(doc, where),
            chain=_chain(doc.get("chain", []), account, hops, where),
            sources=_listed(doc, "sources", "source", "via", where),
            co_payees=_listed(doc, "co_payees", "account", "shared", where),
            loop=_loop(doc.get("loop", {"found": False, "path": []}), account, where),
        )


def _chain(doc: Any, account: str, hops: int, where: str) -> tuple[str, ...]:
    if not isinstance(doc, list):
        raise ValueError(f"{where}.chain must be a list, got {type(doc).__name__}")
    path = _accounts(doc, where, "chain")
    if path and (len(path) < 2 or path[-1] != account or len(path) - 1 > hops or len(set(path)) < len(path)):
        raise ValueError(
            f"{where}.chain must end at {account!r} with 1..{hops} edges, no account twice, got {list(path)}"
        )
    return path


def _listed(answer: Mapping[str, Any], part: str, key: str, value: str, where: str) -> dict[str, Any]:
    """`sources` ({source, via: [accounts]}) or `co_payees` ({account, shared: n}) as a dict by key."""
    items = answer.get(part, [])
    where = f"{where}.{part}"
    if not isinstance(items, list):
        raise ValueError(f"{where} must be a list, got {type(items).__name__}")
    found: dict[str, Any] = {}
    for item in items:
        name = _text(_need(item, key, where), where, key)
        raw = _need(item, value, f"{where}[{name!r}]")
        if value == "via":
            if not isinstance(raw, list) or len(raw) < 2:
                raise ValueError(f"{where}[{name!r}].via must list at least 2 accounts, got {raw!r}")
            found[name] = _accounts(raw, f"{where}[{name!r}]", "via")
        else:
            found[name] = _count(raw, f"{where}[{name!r}]", value)
    return found


#: The longest loop Service B looks for (its `loop_hops` limit).
LOOP_MAX_HOPS = 16


def _loop(doc: Any, account: str, where: str) -> Cycle:
    complete = doc.get("complete", True) if isinstance(doc, Mapping) else True
    if not isinstance(complete, bool):
        raise ValueError(f"{where}.loop.complete must be true or false, got {complete!r}")
    found = _cycle(doc, account, LOOP_MAX_HOPS, where, "loop")
    return _distinct(Cycle(found.found, found.path, complete), where)


def _distinct(loop: Cycle, where: str) -> Cycle:
    if loop.found and len(set(loop.path[:-1])) < len(loop.path) - 1:
        raise ValueError(f"{where}.loop.path must pass through distinct accounts, got {list(loop.path)}")
    return loop


def _cycle(doc: Any, account: str, hops: int, where: str, part: str = "cycle") -> Cycle:
    found = _need(doc, "found", where, part)
    raw_path = _need(doc, "path", where, part)
    if not isinstance(found, bool):
        raise ValueError(f"{where}.{part}.found must be true or false, got {found!r}")
    if not isinstance(raw_path, list):
        raise ValueError(f"{where}.{part}.path must be a list, got {raw_path!r}")
    return _closed(Cycle(found, _accounts(raw_path, where, part + ".path")), account, hops, where, part)


def _closed(cycle: Cycle, account: str, hops: int, where: str, part: str) -> Cycle:
    """`cycle` if it is one from `account` back to it in 1..`hops` edges, or none with no path."""
    path = cycle.path
    if not cycle.found:
        if path:
            raise ValueError(f"{where}.{part} has a path but found is false")
        return cycle
    if len(path) < 2 or path[0] != account or path[-1] != account or len(path) - 1 > hops:
        raise ValueError(
            f"{where}.{part}.path must start and end at {account!r} with 1..{hops} edges, got {list(path)}"
        )
    return cycle


# --- the answers' shape, as msgspec checks it ------------------------------------------------------
# A worker parses four answers a payment: msgspec checks their shape in C, in about half the time a check
# field by field in Python takes (bench.evidence_parse), and `from_json` runs `checked` only to name what
# is wrong. What types cannot say (amounts are finite and >= 0, a chain ends at the account, a cycle
# returns to it) is checked below by the same functions as in `checked`, or as they check it. Amounts are
# strings here: a JSON number is refused, as `checked` refuses it. tests/unit/test_rules.py holds the two
# parses to the same answers and the same refusals.

_Shape = TypeVar("_Shape", bound=msgspec.Struct)
_Parsed = TypeVar("_Parsed")
_Count = Annotated[int, msgspec.Meta(ge=0)]
_Text = Annotated[str, msgspec.Meta(min_length=1)]
_Instant = Annotated[datetime, msgspec.Meta(tz=True)]


class _WindowDoc(msgspec.Struct):
    sent_count: _Count
    sent: dict[_Text, _Text]
    received_count: _Count
    received: dict[_Text, _Text]
    counterparties: _Count
    sent_counterparties: _Count
    received_counterparties: _Count


class _WindowsDoc(msgspec.Struct):
    h1: _WindowDoc = msgspec.field(name="1h")
    h24: _WindowDoc = msgspec.field(name="24h")
    d7: _WindowDoc = msgspec.field(name="7d")


class _AggregatesDoc(msgspec.Struct):
    account: _Text
    at: _Instant
    windows: _WindowsDoc
    near_threshold_24h: _Count
    reporting_threshold: _Text
    threshold_band: _Text
    late_dropped: _Count = 0
    as_of: dict[int, _Count] = msgspec.field(default_factory=dict)


class _EdgeDoc(msgspec.Struct):
    counterparty: _Text
    count: _Count
    totals: dict[_Text, _Text]
    first_seen: _Instant
    last_seen: _Instant


class _NeighbourDoc(msgspec.Struct):
    account: _Text
    hops: _Count


class _SourceDoc(msgspec.Struct):
    source: _Text
    via: Annotated[tuple[_Text, ...], msgspec.Meta(min_length=2)]


class _CoPayeeDoc(msgspec.Struct):
    account: _Text
    shared: _Count


class _CycleDoc(msgspec.Struct):
    found: bool
    path: tuple[_Text, ...]


class _LoopDoc(_CycleDoc):
    complete: bool = True


class _RelationsDoc(msgspec.Struct):
    account: _Text
    hops: _Count
    out: list[_EdgeDoc] = msgspec.field(default_factory=list)
    in_: list[_EdgeDoc] = msgspec.field(name="in", default_factory=list)
    neighbourhood: list[_NeighbourDoc] = msgspec.field(default_factory=list)
    cycle: _CycleDoc = msgspec.field(default_factory=lambda: _CycleDoc(False, ()))
    as_of: dict[int, _Count] = msgspec.field(default_factory=dict)
    chain: tuple[_Text, ...] = ()
    sources: list[_SourceDoc] = msgspec.field(default_factory=list)
    co_payees: list[_CoPayeeDoc] = msgspec.field(default_factory=list)
    loop: _LoopDoc = msgspec.field(default_factory=lambda: _LoopDoc(False, ()))


def _fast(
    doc: Any,
    shape: type[_Shape],
    build: Callable[[_Shape], _Parsed],
    checked: Callable[[Any], object],
    what: str,
) -> _Parsed:
    """`build` of `doc` converted to `shape`; a malformed `doc` is parsed by `checked`, which raises the
    error that names the place of what is wrong (msgspec's own message only if `checked` finds nothing)."""
    try:
        return build(msgspec.convert(doc, shape, str_keys=True))
    except (msgspec.ValidationError, ArithmeticError, ValueError) as exc:
        checked(doc)
        raise ValueError(f"{what}: {exc}") from None


#: `parse_money`, remembered: an answer repeats its sums (a window's total is often the next window's
#: too, and an account's stay put until it pays again) and every answer carries the same threshold and
#: band, so most amounts a worker reads it has read before, in the same currency.
_amount = functools.lru_cache(maxsize=16384)(parse_money)


def _amounts(texts: Mapping[str, str]) -> dict[str, Decimal]:
    return {currency: _amount(text, currency) for currency, text in texts.items()}


def _utc(when: datetime) -> datetime:
    return when if when.tzinfo is UTC else when.astimezone(UTC)


def _window(doc: _WindowDoc) -> Window:
    return Window(
        doc.sent_count,
        _amounts(doc.sent),
        doc.received_count,
        _amounts(doc.received),
        doc.counterparties,
        doc.sent_counterparties,
        doc.received_counterparties,
    )


def _aggregates(doc: _AggregatesDoc) -> Aggregates:
    threshold = _amount(doc.reporting_threshold, "reporting_threshold")
    band = _amount(doc.threshold_band, "threshold_band")
    if threshold <= 0 or not band < 1:
        raise ValueError("reporting_threshold must be > 0 and threshold_band in [0, 1)")
    windows = doc.windows
    return Aggregates(
        account=doc.account,
        at=_utc(doc.at),
        windows={"1h": _window(windows.h1), "24h": _window(windows.h24), "7d": _window(windows.d7)},
        near_threshold_24h=doc.near_threshold_24h,
        reporting_threshold=threshold,
        threshold_band=band,
        late_dropped=doc.late_dropped,
        as_of=doc.as_of,
    )


def _edges(docs: list[_EdgeDoc]) -> dict[str, Edge]:
    return {
        e.counterparty: Edge(
            e.counterparty, e.count, _amounts(e.totals), _utc(e.first_seen), _utc(e.last_seen)
        )
        for e in docs
    }


def _relations(doc: _RelationsDoc) -> Relations:
    account, hops, loop = doc.account, doc.hops, doc.loop
    where = f"relations answer for {account!r}"
    return Relations(
        account=account,
        hops=hops,
        out=_edges(doc.out),
        in_=_edges(doc.in_),
        neighbourhood={n.account: n.hops for n in doc.neighbourhood},
        cycle=_closed(Cycle(doc.cycle.found, doc.cycle.path), account, hops, where, "cycle"),
        as_of=doc.as_of,
        chain=_chain(list(doc.chain), account, hops, where) if doc.chain else (),
        sources={s.source: s.via for s in doc.sources},
        co_payees={c.account: c.shared for c in doc.co_payees},
        loop=_distinct(
            _closed(Cycle(loop.found, loop.path, loop.complete), account, LOOP_MAX_HOPS, where, "loop"), where
        ),
    )


@dataclass(frozen=True)
class Evidence:
    """One payment and what Services B and C answered about it, all including the payment itself."""

    payment_id: str
    payer: str
    payee: str
    amount: Decimal
    currency: str
    ts: datetime
    payer_aggregates: Aggregates
    payee_aggregates: Aggregates
    payer_relations: Relations
    payee_relations: Relations
    #: The payment's channel (AMLworld's payment format: `ach`, `wire`, ...), when the payment says.
    channel: str | None = None

    def __post_init__(self) -> None:
        for name in ("payment_id", "payer", "payee", "currency"):
            _text(getattr(self, name), f"payment {name}")
        if not isinstance(self.amount, Decimal) or not self.amount.is_finite() or self.amount <= 0:
            raise ValueError(f"payment amount must be a Decimal > 0, got {self.amount!r}")
        if self.ts.tzinfo is None:
            raise ValueError(f"payment ts must be timezone-aware, got {self.ts!r}")
        # Evidence about another account or another instant would be answered for the wrong question.
        for role, answer, account in (
            ("payer aggregates", self.payer_aggregates, self.payer),
            ("payee aggregates", self.payee_aggregates, self.payee),
            ("payer relations", self.payer_relations, self.payer),
            ("payee relations", self.payee_relations, self.payee),
        ):
            if answer.account != account:
                raise ValueError(f"{role} are for {answer.account!r}, not for {account!r}")
        for role, answer in (("payer", self.payer_aggregates), ("payee", self.payee_aggregates)):
            if answer.at != self.ts:
                raise ValueError(
                    f"{role} aggregates are at {answer.at.isoformat()}, not at the payment's ts "
                    f"{self.ts.isoformat()}"
                )

    @classmethod
    def parse(
        cls,
        *,
        payment_id: str,
        payer: str,
        payee: str,
        amount: Decimal,
        currency: str,
        ts: datetime | str,
        payer_aggregates: Any,
        payee_aggregates: Any,
        payer_relations: Any,
        payee_relations: Any,
        channel: str | None = None,
    ) -> Evidence:
        """Evidence from the payment's fields and the four parsed JSON answers; ValueError if malformed."""
        return cls(
            payment_id=payment_id,
            payer=payer,
            payee=payee,
            amount=amount,
            currency=currency,
            ts=parse_instant(ts, "payment ts"),
            payer_aggregates=Aggregates.from_json(payer_aggregates),
            payee_aggregates=Aggregates.from_json(payee_aggregates),
            payer_relations=Relations.from_json(payer_relations),
            payee_relations=Relations.from_json(payee_relations),
            channel=channel,
        )
