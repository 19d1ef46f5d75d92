"""IBM AMLworld's published transactions (Altman et al. 2023) as payments of our contract, plus their labels.

Pure parsing, no Kafka: `read_amlworld(path)` reads a whole `*_Trans.csv` (or its first `limit` rows)
before anything can be sent, so a file with one bad row sends nothing. Every fault is a `ValueError` of one
sentence naming the file and the line. What it maps and why: docs/amlworld.md.

The header repeats the column name "Account" (sender, then receiver), so columns are read by position.
"""

from __future__ import annotations

import csv
import functools
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import BinaryIO

from aml_app.contract import InvalidPayment, validate_payment
from aml_app.kafka.tools import PaymentRecord

HEADER = (
    "Timestamp",
    "From Bank",
    "Account",
    "To Bank",
    "Account",
    "Amount Received",
    "Receiving Currency",
    "Amount Paid",
    "Payment Currency",
    "Payment Format",
    "Is Laundering",
)
TIMESTAMP, FROM_BANK, FROM_ACCOUNT, TO_BANK, TO_ACCOUNT = 0, 1, 2, 3, 4
AMOUNT_PAID, PAYMENT_CURRENCY, PAYMENT_FORMAT, IS_LAUNDERING = 7, 8, 9, 10

#: AMLworld's currency names -> ISO 4217 codes.
CURRENCIES = {
    "US Dollar": "USD",
    "Euro": "EUR",
    "Yuan": "CNY",
    "Yen": "JPY",
    "UK Pound": "GBP",
    "Rupee": "INR",
    "Ruble": "RUB",
    "Canadian Dollar": "CAD",
    "Australian Dollar": "AUD",
    "Swiss Franc": "CHF",
    "Mexican Peso": "MXN",
    "Brazil Real": "BRL",
    "Saudi Riyal": "SAR",
    "Shekel": "ILS",
}
#: Currency names with no ISO 4217 code, which our contract refuses: such rows are skipped and counted.
UNMAPPABLE = frozenset({"Bitcoin"})
DEFAULT_PREFIX = "amlworld"
# The contract's own rules would refuse these too; checked here first so the message can say which column.
_AMOUNT = re.compile(r"[0-9]+(\.[0-9]+)?")
_TIMESTAMP = re.compile(r"[0-9]{4}/[0-9]{2}/[0-9]{2} [0-9]{2}:[0-9]{2}")
# Far above any real payment, so the value always fits the contract's smallest allowed record size.
_MAX_VALUE_BYTES = 65536


@dataclass(frozen=True, slots=True)
class AmlworldPayment(PaymentRecord):
    """One row as a payment of our contract (slots: a real file has five million of them in memory)."""

    payment_id: str
    payer: str
    payee: str
    amount: str
    currency: str
    ts: str
    channel: str
    is_laundering: bool


@dataclass
class AmlworldImport:
    """A parsed file: its payments in event-time order, what was skipped, and the ground truth."""

    path: str
    rows_read: int
    payments: list[AmlworldPayment]
    skipped: Counter[str] = field(default_factory=Counter)  # currency name -> rows skipped
    skipped_laundering: int = 0  # laundering rows among the skipped ones (not in `laundering`)
    attempts: list[PatternAttempt] = field(default_factory=list)  # from a patterns file
    skipped_attempts: int = 0  # a patterns file's attempts every row of which was skipped

    @property
    def laundering(self) -> frozenset[str]:
        """Payment ids labelled Is Laundering = 1 (AMLworld labels payments, not pattern instances)."""
        return frozenset(p.payment_id for p in self.payments if p.is_laundering)

    def write_ground_truth(self, path: str | Path) -> None:
        """JSON Lines, one `{"payment_id": ..., "is_laundering": true}` per laundering payment, in event time,
        with `"typology"` and `"attempt"` for a payment of a patterns file's attempt; a payment not listed
        was labelled 0."""
        attempt_of = {pid: a for a in self.attempts for pid in a.payment_ids}
        with open(path, "w", encoding="utf-8") as out:
            for payment in self.payments:
                if payment.is_laundering:
                    line: dict[str, object] = {"payment_id": payment.payment_id, "is_laundering": True}
                    attempt = attempt_of.get(payment.payment_id)
                    if attempt is not None:
                        line.update(typology=attempt.typology, attempt=attempt.attempt_id)
                    out.write(json.dumps(line) + "\n")

    def merged(self, other: AmlworldImport) -> AmlworldImport:
        """This import and `other` as one, in event-time order (a stable sort: each file keeps its order
        within a minute), e.g. a patterns file's attempts replayed into a transactions file's background."""
        return AmlworldImport(
            f"{self.path} + {other.path}",
            self.rows_read + other.rows_read,
            sorted([*self.payments, *other.payments], key=lambda p: p.ts),
            self.skipped + other.skipped,
            self.skipped_laundering + other.skipped_laundering,
            [*self.attempts, *other.attempts],
            self.skipped_attempts + other.skipped_attempts,
        )


def read_amlworld(
    path: str | Path,
    *,
    limit: int | None = None,
    prefix: str = DEFAULT_PREFIX,
    progress: Callable[[str], None] | None = None,
    progress_interval: float = 5.0,
) -> AmlworldImport:
    """Parse the file (its first `limit` data rows if given) into payments sorted by event time.

    Each payment's id is `<prefix>-<line>`, the row's line in the file (the header is line 1), seven digits
    or more. The sort is stable, so payments of the same minute keep the file's order; our services expect
    each payer's payments in event-time order. Raises ValueError naming the file and line of the first fault.
    A real file takes minutes: `progress` hears every `progress_interval` seconds how far the read is, at
    what rate, and about how long it has left.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be 0 or more, got {limit}")
    name = str(path)
    payments: list[AmlworldPayment] = []
    skipped: Counter[str] = Counter()
    skipped_laundering = 0
    rows = 0
    # Interned: a real file repeats a few hundred thousand accounts and minutes over millions of rows.
    accounts: dict[str, str] = {}
    times: dict[str, str] = {}
    line = 0
    size = os.path.getsize(path) if progress is not None else 0
    started = time.monotonic()
    next_progress = started + progress_interval
    try:
        with open(path, "rb") as raw:
            reader = csv.reader(_decoded(raw, name), strict=True)
            header = next(reader, None)
            line = reader.line_num
            if header is None:
                raise ValueError(f"{name} is empty; expected the AMLworld header {','.join(HEADER)}.")
            if tuple(header) != HEADER:
                raise ValueError(
                    f"{name} line {line}: the header is {','.join(header)[:200]!r}, "
                    f"expected {','.join(HEADER)}."
                )
            while limit is None or rows < limit:  # not one row more is read than asked for
                if (row := next(reader, None)) is None:
                    break
                line = reader.line_num
                rows += 1
                payment = _payment(row, name, line, prefix, accounts, times)
                if payment is None:
                    skipped[row[PAYMENT_CURRENCY]] += 1
                    skipped_laundering += row[IS_LAUNDERING] == "1"
                else:
                    payments.append(payment)
                if progress is not None and rows % 10_000 == 0 and time.monotonic() >= next_progress:
                    next_progress = time.monotonic() + progress_interval
                    progress(_read_so_far(name, rows, raw.tell(), size, time.monotonic() - started))
    except csv.Error as exc:
        raise ValueError(f"{name} line {line + 1}: not readable as CSV ({exc}).") from None
    payments.sort(key=lambda p: p.ts)
    return AmlworldImport(name, rows, payments, skipped, skipped_laundering)


def _decoded(raw: BinaryIO, name: str) -> Iterator[str]:
    """The file's lines as text, each decoded alone, so that a byte that is not UTF-8 is named at its own
    line (a text wrapper decodes ahead in chunks and fails lines before it); the first drops a BOM."""
    for number, data in enumerate(raw, start=1):
        try:
            yield data.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name} line {number}: not UTF-8 text ({exc.reason}).") from None


def _read_so_far(name: str, rows: int, position: int, size: int, elapsed: float) -> str:
    """One progress line of a read: rows, share of the file, rate and the time left at that rate."""
    share = min(position / size, 1.0) if size else 1.0
    left = elapsed * (1 - share) / share if share > 0 else float("nan")
    return (
        f"amlworld: reading {name}: {rows:,} rows, {share:.0%} of {size / 1e6:,.0f} MB, "
        f"{rows / elapsed:,.0f} rows/s, about {left:,.0f} s left"
    )


def _payment(
    row: list[str],
    name: str,
    line: int,
    prefix: str,
    accounts: dict[str, str],
    times: dict[str, str],
) -> AmlworldPayment | None:
    """The row's payment, or None for a row paid in a currency without an ISO 4217 code. Such a row is
    checked like any other (a broken file is broken whatever its currency)."""
    where = f"{name} line {line}"
    if len(row) != len(HEADER):
        raise ValueError(f"{where}: {len(row)} column(s), expected {len(HEADER)}.")
    for index in (FROM_BANK, FROM_ACCOUNT, TO_BANK, TO_ACCOUNT, PAYMENT_FORMAT):
        if not row[index].strip():
            raise ValueError(f"{where}: {HEADER[index]} (column {index + 1}) is empty.")
    ts = _timestamp(row[TIMESTAMP], where, times)
    amount = row[AMOUNT_PAID]
    if not _AMOUNT.fullmatch(amount) or Decimal(amount) <= 0:
        raise ValueError(f"{where}: Amount Paid must be a decimal number above 0, got {amount[:40]!r}.")
    laundering = row[IS_LAUNDERING]
    if laundering not in ("0", "1"):
        raise ValueError(f"{where}: Is Laundering must be 0 or 1, got {laundering[:40]!r}.")
    currency = CURRENCIES.get(row[PAYMENT_CURRENCY])
    if currency is None:
        if row[PAYMENT_CURRENCY] in UNMAPPABLE:
            return None
        raise ValueError(f"{where}: unknown Payment Currency {row[PAYMENT_CURRENCY][:40]!r}.")
    payer = f"{row[FROM_BANK]}:{row[FROM_ACCOUNT]}"
    payee = f"{row[TO_BANK]}:{row[TO_ACCOUNT]}"
    payment = AmlworldPayment(
        payment_id=f"{prefix}-{line:07d}",
        payer=accounts.setdefault(payer, payer),
        payee=accounts.setdefault(payee, payee),
        amount=amount,
        currency=currency,
        ts=ts,
        channel=_channel(row[PAYMENT_FORMAT]),
        is_laundering=laundering == "1",
    )
    try:  # the contract's remaining rules: at most 4 decimals, below 1e15, lengths of ids
        validate_payment(payment.key, payment.value(), _MAX_VALUE_BYTES)
    except InvalidPayment as exc:
        raise ValueError(f"{where}: the payment would break our contract: {exc}.") from None
    return payment


#: A patterns file's typology names -> ours (aml_app.detection.rules.TYPOLOGIES).
PATTERN_TYPOLOGIES = {
    "FAN-IN": "fan_in",
    "FAN-OUT": "fan_out",
    "CYCLE": "cycle",
    "GATHER-SCATTER": "gather_scatter",
    "SCATTER-GATHER": "scatter_gather",
    "RANDOM": "random",
    "BIPARTITE": "bipartite",
    "STACK": "stack",
}
BEGIN, END = "BEGIN LAUNDERING ATTEMPT - ", "END LAUNDERING ATTEMPT"


@dataclass(frozen=True)
class PatternAttempt:
    """One laundering attempt of a patterns file: its typology (ours), the file's own description (`Max
    16-degree Fan-Out`), and its payments' ids in the file's order."""

    attempt_id: str
    typology: str
    detail: str
    payment_ids: tuple[str, ...]
    accounts: tuple[str, ...]


@dataclass
class AmlworldPatterns:
    """A parsed patterns file: every attempt, and all their payments in event-time order."""

    path: str
    attempts: list[PatternAttempt]
    payments: list[AmlworldPayment]
    skipped: Counter[str] = field(default_factory=Counter)  # currency name -> rows skipped
    skipped_attempts: int = 0  # attempts every row of which was skipped (not in `attempts`)


def read_patterns(path: str | Path, *, prefix: str = "amlworld-pattern") -> AmlworldPatterns:
    """Parse an AMLworld patterns file (`*_Patterns.txt`): laundering attempts between `BEGIN LAUNDERING
    ATTEMPT - <TYPOLOGY>[: <detail>]` and `END LAUNDERING ATTEMPT` lines, each payment a row of the
    transactions layout (no header). Payment ids are `<prefix>-<line>`; every row must be labelled 1.
    Raises ValueError naming the file and line of the first fault, as `read_amlworld` does."""
    name = str(path)
    attempts: list[PatternAttempt] = []
    payments: list[AmlworldPayment] = []
    skipped: Counter[str] = Counter()
    accounts: dict[str, str] = {}
    times: dict[str, str] = {}
    current: tuple[str, str, list[str], dict[str, None]] | None = None  # typology, detail, ids, accounts
    rows_in_attempt = 0  # its rows, skipped ones too
    skipped_attempts = 0
    line = 0
    try:
        with open(path, "rb") as source:
            for line, raw in enumerate(_decoded(source, name), start=1):
                text = raw.rstrip("\r\n")
                if not text.strip():
                    continue
                if text.startswith(BEGIN):
                    if current is not None:
                        raise ValueError(
                            f"{name} line {line}: a new attempt begins before the last one ended."
                        )
                    kind, _, detail = text[len(BEGIN) :].partition(":")
                    typology = PATTERN_TYPOLOGIES.get(kind.strip())
                    if typology is None:
                        raise ValueError(
                            f"{name} line {line}: unknown laundering typology {kind.strip()[:40]!r}."
                        )
                    current, rows_in_attempt = (typology, detail.strip(), [], {}), 0
                    continue
                if text.startswith(END):
                    if current is None or not rows_in_attempt:
                        raise ValueError(f"{name} line {line}: an attempt ends that has no payment.")
                    typology, detail, ids, members = current
                    current = None
                    if not ids:  # every payment skipped (e.g. all in Bitcoin): nothing of it is sent
                        skipped_attempts += 1
                        continue
                    attempts.append(
                        PatternAttempt(
                            f"{prefix}-attempt-{len(attempts) + 1}",
                            typology,
                            detail,
                            tuple(ids),
                            tuple(members),
                        )
                    )
                    continue
                if current is None:
                    raise ValueError(f"{name} line {line}: a payment outside any laundering attempt.")
                row = next(csv.reader([text], strict=True))
                payment = _payment(row, name, line, prefix, accounts, times)
                if row[IS_LAUNDERING] != "1":
                    raise ValueError(f"{name} line {line}: a payment of an attempt is labelled 0, not 1.")
                rows_in_attempt += 1
                if payment is None:
                    skipped[row[PAYMENT_CURRENCY]] += 1
                    continue
                current[2].append(payment.payment_id)
                current[3].update(dict.fromkeys((payment.payer, payment.payee)))
                payments.append(payment)
    except csv.Error as exc:
        raise ValueError(f"{name} line {line}: not readable as CSV ({exc}).") from None
    if current is not None:
        raise ValueError(f"{name} ends inside a laundering attempt.")
    payments.sort(key=lambda p: p.ts)
    return AmlworldPatterns(name, attempts, payments, skipped, skipped_attempts)


def is_patterns_file(path: str | Path) -> bool:
    """Whether the file is in the patterns layout (its first non-blank line begins an attempt) rather
    than the transactions one (a header)."""
    with open(path, encoding="utf-8-sig", errors="replace") as source:
        for raw in source:
            if raw.strip():
                return raw.startswith(BEGIN)
    return False


def transactions_and_patterns(files: Sequence[str | Path]) -> tuple[str | Path | None, str | Path | None]:
    """The transactions file and the patterns file among `files` (each None if absent), told apart by
    their first line; ValueError in one sentence when more than one of either is given."""
    patterns = [f for f in files if is_patterns_file(f)]
    transactions = [f for f in files if f not in patterns]
    if len(patterns) > 1 or len(transactions) > 1:
        raise ValueError(
            f"{len(transactions)} transactions and {len(patterns)} patterns files were given; "
            "give at most one of each"
        )
    return (transactions[0] if transactions else None), (patterns[0] if patterns else None)


def read_patterns_import(path: str | Path, *, prefix: str = "amlworld-pattern") -> AmlworldImport:
    """A patterns file (`read_patterns`) as an import: its payments, all labelled 1, and its attempts."""
    patterns = read_patterns(path, prefix=prefix)
    skipped = sum(patterns.skipped.values())
    rows = len(patterns.payments) + skipped
    return AmlworldImport(
        patterns.path,
        rows,
        patterns.payments,
        patterns.skipped,
        skipped,
        patterns.attempts,
        patterns.skipped_attempts,
    )


@functools.cache
def _channel(payment_format: str) -> str:
    """`Credit Card` -> `credit_card` (cached: one string per format, not per row)."""
    return payment_format.strip().lower().replace(" ", "_")


def _timestamp(raw: str, where: str, times: dict[str, str]) -> str:
    """`2022/09/01 00:20` -> `2022-09-01T00:20:00Z`; AMLworld declares no timezone, we read it as UTC."""
    known = times.get(raw)
    if known is not None:
        return known
    try:
        if not _TIMESTAMP.fullmatch(raw):
            raise ValueError
        when = datetime.strptime(raw, "%Y/%m/%d %H:%M")
    except ValueError:
        raise ValueError(f"{where}: Timestamp must be YYYY/MM/DD HH:MM, got {raw[:40]!r}.") from None
    times[raw] = when.strftime("%Y-%m-%dT%H:%M:00Z")
    return times[raw]
