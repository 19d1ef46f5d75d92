"""A deployment's labelled history for training: AMLworld-layout files read into one timeline and its
attempts.

A transactions CSV (`*_Trans.csv`: every payment, `Is Laundering` 0 or 1) and, optionally, a patterns file
(`*_Patterns.txt`: laundering attempts by typology), as `aml-app import-amlworld` reads them
(`aml_app.simulation.amlworld`). A laundering row of the transactions that a pattern lists too (the same
payer, payee, amount, currency, minute and format) takes that attempt's typology, and the pattern's copy
is dropped: AMLworld's full sets list every laundering payment in both files. A pattern's payment that the
transactions lack is replayed into them, as `import-amlworld` does with a patterns file of another set.
A laundering row no pattern lists stays labelled by its row (`aml_app.training.fit.UNNAMED`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aml_app.simulation.amlworld import read_amlworld, read_patterns, transactions_and_patterns


@dataclass(frozen=True)
class Attempt:
    """One laundering attempt: its typology and its payments' ids in the timeline."""

    attempt_id: str
    typology: str
    payment_ids: tuple[str, ...]


@dataclass
class History:
    """Labelled payments in event-time order, and the attempts that name their typologies."""

    payments: list[Any]
    attempts: list[Attempt]
    files: list[str]
    skipped: int  # rows in currencies without an ISO 4217 code

    @property
    def laundering(self) -> int:
        listed = {pid for a in self.attempts for pid in a.payment_ids}
        return sum(1 for p in self.payments if p.is_laundering or p.payment_id in listed)


def _content(payment: Any) -> tuple[str, ...]:
    return (payment.payer, payment.payee, payment.amount, payment.currency, payment.ts, payment.channel)


def read_history(files: Sequence[str | Path], progress: Callable[[str], None] | None = None) -> History:
    """At most one transactions file and one patterns file, as one labelled timeline. Raises ValueError in
    one sentence naming the file (and line) of the first fault."""
    if not files:
        raise ValueError("no labelled file was given")
    transactions_file, patterns_file = transactions_and_patterns(files)
    payments: list[Any] = []
    skipped = 0
    if transactions_file is not None:
        read = read_amlworld(transactions_file, prefix="history", progress=progress)
        payments, skipped = read.payments, sum(read.skipped.values())
    attempts: list[Attempt] = []
    if patterns_file is not None:
        patterns = read_patterns(patterns_file, prefix="history-pattern")
        skipped += sum(patterns.skipped.values())
        rows: dict[tuple[str, ...], list[str]] = {}
        for payment in payments:
            if payment.is_laundering:
                rows.setdefault(_content(payment), []).append(payment.payment_id)
        own = {p.payment_id: p for p in patterns.payments}
        added = []
        for attempt in patterns.attempts:
            ids = []
            for pid in attempt.payment_ids:
                same = rows.get(_content(own[pid]))
                if same:
                    ids.append(same.pop(0))
                else:
                    ids.append(pid)
                    added.append(own[pid])
            attempts.append(Attempt(attempt.attempt_id, attempt.typology, tuple(ids)))
        payments = sorted([*payments, *added], key=lambda p: p.ts)
    if not payments:
        raise ValueError(f"{', '.join(map(str, files))} hold no payment")
    return History(payments, attempts, [str(f) for f in files], skipped)
