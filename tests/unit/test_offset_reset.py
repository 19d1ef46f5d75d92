"""Readers that seek to an offset retention may have deleted read from the log start, not its end.

A dependency group that never committed on a partition, or whose offsets expired, has W(q) below q's log
start once retention deleted the records there. aiokafka's consumer answers a fetch at a deleted offset
by resetting its position as `auto_offset_reset` says, and its default is "latest": a reader left on the
default would find q at its end, with nothing unapplied, and the event-time gate would admit payments of
other partitions without q's earliest payments. The embedded broker cannot delete records, so these
tests put a consumer that resets as aiokafka does at each reader's seam.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

from aml_app.gate import delivery, unapplied
from aml_app.gate.unapplied import UnappliedReader
from aml_app.kafka.security import PLAINTEXT
from tests.payments import BASE, PaymentRow

#: The partition's log: offsets 0-4 deleted by retention, payments at 5-9.
LOG_START, LOG_END = 5, 10


def payment(offset: int) -> SimpleNamespace:
    row = PaymentRow(
        0, offset, f"p{offset}", "a", "b", Decimal("1.00"), "USD", BASE + timedelta(minutes=offset)
    )
    key, value = row.record()
    stamp = int((row.ts + timedelta(seconds=1)).timestamp() * 1000)
    return SimpleNamespace(offset=offset, key=key, value=value, timestamp=stamp)


class RetainedLog:
    """An `AIOKafkaConsumer` over one partition whose records below `LOG_START` are deleted: a fetch at
    a deleted offset moves the position to the log start ("earliest") or the log end ("latest", aiokafka's
    default), as aiokafka does on OffsetOutOfRange."""

    def __init__(self, *args: Any, auto_offset_reset: str = "latest", **kwargs: Any) -> None:
        self.reset = auto_offset_reset
        self.positions: dict[Any, int] = {}

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def assign(self, tps: list[Any]) -> None:
        self.positions = {tp: self.positions.get(tp, 0) for tp in tps}

    def seek(self, tp: Any, offset: int) -> None:
        self.positions[tp] = offset

    def _fetch(self, tp: Any) -> list[SimpleNamespace]:
        at = self.positions[tp]
        if at < LOG_START:
            at = LOG_START if self.reset == "earliest" else LOG_END
        records = [payment(o) for o in range(at, LOG_END)]
        self.positions[tp] = LOG_END
        return records

    async def getmany(self, *tps: Any, timeout_ms: int = 0, max_records: int | None = None) -> dict:
        out = {}
        for tp in tps or list(self.positions):
            records = self._fetch(tp)[:max_records]
            if records:
                self.positions[tp] = records[-1].offset + 1
                out[tp] = records
        return out

    def highwater(self, tp: Any) -> int:
        return LOG_END

    async def position(self, tp: Any) -> int:
        return self.positions[tp]


@contextmanager
def retained_log(module: Any) -> Iterator[None]:
    with mock.patch.object(module, "AIOKafkaConsumer", RetainedLog):
        yield


async def test_the_event_time_reader_finds_the_first_payment_at_the_log_start_below_a_deleted_watermark() -> (
    None
):
    reader = UnappliedReader(["127.0.0.1:9"], "payments", request_timeout=1.0, security=PLAINTEXT)
    with retained_log(unapplied):
        found = await reader.read({0: 2})
    assert found[0].first_ts is not None, "partition 0 was read as caught up: its payments 5-9 are unapplied"
    assert found[0].first_ts == unapplied.event_time(payment(LOG_START), 65536, 300.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("asked", [0, 3])
async def test_the_hole_reader_finds_the_log_start_below_deleted_offsets(asked: int) -> None:
    with retained_log(delivery):
        first = await delivery.first_offset_from(
            ["127.0.0.1:9"], "payments", 0, asked, 1.0, security=PLAINTEXT
        )
    assert first == LOG_START


async def test_reading_alerts_back_from_a_deleted_offset_returns_every_alert_left() -> None:
    from aml_app.tables import alerts

    with retained_log(alerts):
        found = await alerts.read_back(0, 2, 1.0)
    assert [key for key, _ in found] == [payment(o).key for o in range(LOG_START, LOG_END)]


class TruncatedLog(RetainedLog):
    """A long partition (records 0..LONG_END - 1) whose dependencies committed past its end (a log cut
    back by an unclean leader election, or an offset committed by hand): a fetch past the end resets to
    the log start, as aiokafka does with "earliest", and each fetch answers one page of records."""

    LONG_END, PAGE = 20_000, 100

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fetched = 0

    def highwater(self, tp: Any) -> int:
        return self.LONG_END

    async def getmany(self, *tps: Any, timeout_ms: int = 0, max_records: int | None = None) -> dict:
        out = {}
        for tp in tps:
            at = self.positions[tp]
            if at > self.LONG_END:
                at = 0 if self.reset == "earliest" else self.LONG_END
            records = [payment(o) for o in range(at, min(at + self.PAGE, self.LONG_END))]
            self.fetched += 1
            self.positions[tp] = at + len(records)
            if records:
                out[tp] = records
        return out


async def test_a_watermark_past_the_log_end_reads_as_caught_up_without_reading_the_partition() -> None:
    """Nothing at or after W(q) exists once the fetch's high watermark is at or below it: the reader
    must not read the whole partition from its start at every refresh (on a large one, longer than the
    refresh's deadline: no cut, and every partition waits)."""
    reader = UnappliedReader(["127.0.0.1:9"], "payments", request_timeout=5.0, security=PLAINTEXT)
    consumers: list[TruncatedLog] = []

    def made(*args: Any, **kwargs: Any) -> TruncatedLog:
        consumers.append(TruncatedLog(*args, **kwargs))
        return consumers[-1]

    with mock.patch.object(unapplied, "AIOKafkaConsumer", made):
        found = await reader.read({0: TruncatedLog.LONG_END + 500})
    assert found[0].first_ts is None and found[0].end == TruncatedLog.LONG_END
    assert consumers[0].fetched <= 2, f"{consumers[0].fetched} fetches: the partition was read from its start"
