"""Seeded test payments for the pipeline tests: few accounts (edges repeat, cycles form), several currencies,
event times spread over days and arriving out of order, late ones inside the 7-day horizon, and malformed
records (one kind a payment stamped in 2099). Returns what was produced so tests can build the reference
answers."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from aiokafka import AIOKafkaProducer

from aml_app.kafka.tools import produce

BASE = datetime(2026, 3, 1, tzinfo=UTC)
#: A payment stamped far ahead of the moment it is sent (its record's timestamp): every consumer refuses it.
FUTURE = json.dumps(
    {
        "payment_id": "future",
        "payer": "acct-0",
        "payee": "acct-1",
        "amount": "1.00",
        "currency": "EUR",
        "ts": "2099-01-01T00:00:00Z",
    }
).encode()
#: A payee with a NUL, which PostgreSQL's text cannot store: refused by the contract, never written.
NUL_PAYEE = json.dumps(
    {
        "payment_id": "nul",
        "payer": "acct-0",
        "payee": "acct-\x00",
        "amount": "1.00",
        "currency": "EUR",
        "ts": "2024-05-01T12:00:00Z",
    }
).encode()
MALFORMED = (b"not json", b"[]", b'{"payment_id": "x"}', b"\xff\xfe", b"", FUTURE, NUL_PAYEE)


@dataclass(frozen=True)
class PaymentRow:
    """One valid payment as the tests know it, at Kafka record (partition, offset)."""

    partition: int
    offset: int
    payment_id: str
    payer: str
    payee: str
    amount: Decimal
    currency: str
    ts: datetime

    def record(self) -> tuple[bytes, bytes]:
        """(key, value) as a producer sends it: the payer's id and the JSON document."""
        doc = {
            "payment_id": self.payment_id,
            "payer": self.payer,
            "payee": self.payee,
            "amount": str(self.amount),
            "currency": self.currency,
            "ts": self.ts.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        }
        return self.payer.encode(), json.dumps(doc).encode()


@dataclass
class Produced:
    valid: list[PaymentRow]
    malformed: list[tuple[int, int, bytes]]  # partition, offset, value

    @property
    def accounts(self) -> list[str]:
        return sorted({p.payer for p in self.valid} | {p.payee for p in self.valid})


def payment_doc(rng: random.Random, n: int, prefix: str, accounts: int, spread: timedelta) -> dict[str, str]:
    payer, payee = rng.sample(range(accounts), 2) if rng.random() > 0.02 else (0, 0)
    amount = (
        Decimal(rng.choice(["9500", "9999.99", "10000", "120.5", "0.0001", "42"]))
        + Decimal(rng.randrange(0, 10_000)) / 100
    )
    when = BASE + timedelta(seconds=rng.randrange(int(spread.total_seconds())))
    return {
        "payment_id": f"{prefix}-{n}",
        "payer": f"acct-{payer}",
        "payee": f"acct-{payee}",
        "amount": str(amount),
        "currency": rng.choice(["EUR", "EUR", "USD", "GBP"]),
        "ts": when.isoformat().replace("+00:00", "Z"),
    }


async def produce_payments(
    producer: AIOKafkaProducer,
    topic: str,
    count: int,
    seed: int,
    accounts: int = 12,
    spread: timedelta = timedelta(days=6),
    malformed_every: int = 50,
) -> Produced:
    """Send `count` records (every `malformed_every`-th one malformed), keyed by payer."""
    rng = random.Random(seed)
    records: list[tuple[int | None, bytes | None, bytes | None]] = []
    docs: list[dict[str, str] | None] = []
    for n in range(count):
        if malformed_every and n % malformed_every == malformed_every - 1:
            records.append((None, b"acct-0", MALFORMED[n % len(MALFORMED)]))
            docs.append(None)
            continue
        doc = payment_doc(rng, n, f"s{seed}", accounts, spread)
        records.append((None, doc["payer"].encode(), json.dumps(doc).encode()))
        docs.append(doc)
    placed = await produce(producer, topic, records)
    produced = Produced([], [])
    for (partition, offset), doc, (_p, _k, value) in zip(placed, docs, records, strict=True):
        if doc is None:
            assert value is not None
            produced.malformed.append((partition, offset, value))
            continue
        produced.valid.append(
            PaymentRow(
                partition=partition,
                offset=offset,
                payment_id=doc["payment_id"],
                payer=doc["payer"],
                payee=doc["payee"],
                amount=Decimal(doc["amount"]),
                currency=doc["currency"],
                ts=datetime.fromisoformat(doc["ts"]),
            )
        )
    return produced
