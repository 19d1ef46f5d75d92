"""Reads, per partition, the first payment the dependencies have not applied: the event-time gate's input.

One group-less consumer fetches each asked partition from its watermark W(q) and keeps the first record
that is a payment under the contract (`aml_app.contract`, with the record's timestamp and the same bounds
as every consumer): a record that breaks it is dead-lettered and applied by no dependency, so it carries
no evidence, whatever `ts` it holds. A partition with nothing there is caught up, and the fetch's high
watermark is its log end (ListOffsets is not trusted for that: some brokers answer it with a record
batch's base offset + 1). The payment at an offset never changes within one log, so a partition whose
W(q) has not moved is not fetched again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from aml_app.contract import DEFAULT_MAX_CLOCK_SKEW, InvalidPayment, validate_payment
from aml_app.gate.event_time import Unapplied, micros
from aml_app.kafka.deadlines import close_within, start_within, within
from aml_app.kafka.offsets import OffsetReadError
from aml_app.kafka.security import KafkaSecurity, aiokafka_kwargs

#: How long the broker may hold a fetch of partitions that have nothing past W(q).
FETCH_MAX_WAIT_MS = 20


def event_time(record: ConsumerRecord[bytes, bytes], max_bytes: int, max_clock_skew: float) -> int | None:
    """The `ts` of a payment's record in microseconds; None for a record that breaks the contract
    (dead-lettered, and applied by no dependency: it carries no evidence)."""
    stamp = record.timestamp if record.timestamp is not None and record.timestamp >= 0 else None
    try:
        return micros(validate_payment(record.key, record.value, max_bytes, stamp, max_clock_skew)["ts"])
    except InvalidPayment:
        return None


class UnappliedReader:
    def __init__(
        self,
        bootstrap_servers: Sequence[str],
        topic: str,
        request_timeout: float = 5.0,
        *,
        security: KafkaSecurity,
        max_payment_bytes: int = 65536,
        max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW,
    ) -> None:
        """`max_payment_bytes` and `max_clock_skew`: the contract's bounds, as every consumer has them."""
        self.bootstrap_servers = list(bootstrap_servers)
        self.topic = topic
        self.max_payment_bytes = max_payment_bytes
        self.max_clock_skew = max_clock_skew
        self.request_timeout = request_timeout
        self._security = aiokafka_kwargs(security)
        self._consumer: AIOKafkaConsumer | None = None
        #: partition -> (W(q), what the last fetch there found), for one log.
        self._known: dict[int, tuple[int, Unapplied]] = {}
        self._log: str | None = None
        self.fetches = 0

    async def _reader(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap_servers,
                client_id="aml-gate-event-time",
                enable_auto_commit=False,
                # W(q) below q's log start (retention deleted records the group never committed past):
                # the first unapplied payment is the first one left, not the next one to arrive.
                auto_offset_reset="earliest",
                fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
                request_timeout_ms=int(self.request_timeout * 1000),
                **self._security,
            )
            await start_within(consumer.start, consumer.stop, self.request_timeout, "the event-time reader")
            self._consumer = consumer
        return self._consumer

    async def close(self) -> None:
        """Stop the reader within the request timeout (aiokafka's stop can wait forever on its fetcher:
        `aml_app.kafka.deadlines`); the next read starts a new one."""
        consumer, self._consumer = self._consumer, None
        self._known.clear()
        if consumer is not None:
            await close_within(consumer.stop(), self.request_timeout, "stopping the event-time reader")

    async def read(self, watermarks: Mapping[int, int], log: str | None = None) -> dict[int, Unapplied]:
        """Per partition, the log end and the event time of the first payment at or after W(q)."""
        if log != self._log:
            self._known.clear()
            self._log = log
        found: dict[int, Unapplied] = {}
        todo: dict[int, int] = {}
        for q, w in watermarks.items():
            known = self._known.get(q)
            if known is not None and known[0] == w:
                found[q] = known[1]  # the payment at W(q) is the same; its end is as that fetch saw it
            else:
                todo[q] = w
        if todo:
            try:
                found.update(await self._fetch(todo))
            except OffsetReadError:
                await self.close()
                raise
            except Exception as exc:
                await self.close()
                raise OffsetReadError(
                    f"reading the first unapplied payments failed: {exc!r}",
                    timed_out=isinstance(exc, TimeoutError),
                ) from exc
        self._known = {q: (watermarks[q], f) for q, f in found.items() if f.first_ts is not None}
        return found

    async def _fetch(self, todo: Mapping[int, int]) -> dict[int, Unapplied]:
        consumer = await self._reader()
        tps = {q: TopicPartition(self.topic, q) for q in todo}
        consumer.assign(list(tps.values()))
        for q, tp in tps.items():
            consumer.seek(tp, todo[q])
        self.fetches += 1
        found: dict[int, Unapplied] = {}
        deadline = time.monotonic() + self.request_timeout
        try:
            while len(found) < len(todo):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(todo) - set(found))
                    raise OffsetReadError(
                        f"no answer within {self.request_timeout:g} s fetching partitions {missing} of "
                        f"{self.topic!r} at the dependencies' watermarks",
                        timed_out=True,
                    )
                pending = [tps[q] for q in todo if q not in found]
                batch = await consumer.getmany(*pending, timeout_ms=int(min(left, 0.05) * 1000))
                for tp, records in batch.items():
                    first = next(
                        (
                            ts
                            for r in records
                            if r.offset >= todo[tp.partition]
                            and (ts := event_time(r, self.max_payment_bytes, self.max_clock_skew)) is not None
                        ),
                        None,
                    )
                    if first is not None:
                        end = consumer.highwater(tp)
                        found[tp.partition] = Unapplied(
                            end=max(end or 0, records[-1].offset + 1), first_ts=first
                        )
                for tp in pending:
                    if tp.partition in found:
                        continue
                    end = consumer.highwater(tp)
                    position = await within(consumer.position(tp), max(left, 0.001), f"the position of {tp}")
                    # Caught up: read to the end, or W(q) at or past it (a log cut back below what the
                    # dependencies committed: the reset to the log start must not read it all).
                    if end is not None and end <= max(position, todo[tp.partition]):
                        found[tp.partition] = Unapplied(end=end, first_ts=None)
        finally:
            consumer.assign([])
        return found
