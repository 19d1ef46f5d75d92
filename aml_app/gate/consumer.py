"""Gated consumption for any Faust agent: ordered per partition, never blocking other partitions.

Faust delivers every partition of an agent through one stream; waiting inside that loop would stall
all partitions behind the slowest one. So the agent only dispatches each event to a *lane*, one asyncio
task per partition that processes its payments in offset order:

    parse -> (invalid: dead-letter) -> wait for the gate -> handler -> ack

The stream runs with manual acks and each lane acks strictly in offset order, after the handler has
finished. Faust commits the longest contiguous run of acked offsets, so the committed offset never
passes a payment that is waiting or in flight (the over-commit of Faust issue #606 needs an ack ahead
of an unacked head, which in-order acks never produce). A handler exception is retried with backoff and
the lane stays on that payment: nothing is skipped (Faust would ack a crashed event, issue #315). On a
rebalance every lane is cancelled; its unacked payments are re-read by the next owner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from faust.types import AppT, EventT, StreamT, TopicT

from aml_app.gate.gate import FreshnessGate
from aml_app.models import InvalidPayment, Payment, parse_payment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admission:
    """What the gate saw when it let a payment through; recorded in the decision."""

    partition: int
    offset: int
    watermark: int
    dependencies: dict[str, int]
    waited_ms: float
    gated: bool


Handler = Callable[[Payment, Admission], Awaitable[None]]


async def retry_forever(
    what: str,
    action: Callable[[], Awaitable[Any]],
    first_delay: float = 0.1,
    max_delay: float = 5.0,
) -> Any:
    """Run `action` until it succeeds, backing off exponentially; log each failure."""
    delay = first_delay
    attempt = 1
    while True:
        try:
            return await action()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s failed (attempt %d, retrying in %.1fs): %r", what, attempt, delay, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)
            attempt += 1


@dataclass
class Lane:
    partition: int
    queue: asyncio.Queue[EventT] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    paused: bool = False
    in_flight: int | None = None
    done: int = 0


class GatedConsumer:
    """Bridges one Faust agent stream to per-partition lanes guarded by a FreshnessGate."""

    def __init__(
        self,
        app: AppT,
        gate: FreshnessGate,
        handler: Handler,
        dead_letters: TopicT,
        *,
        gate_enabled: bool = True,
        max_pending: int = 1000,
        max_payment_bytes: int = 65536,
        worker_id: str = "",
    ) -> None:
        self.app = app
        self.gate = gate
        self.handler = handler
        self.dead_letters = dead_letters
        self.gate_enabled = gate_enabled
        self.max_pending = max_pending
        self.max_payment_bytes = max_payment_bytes
        self.worker_id = worker_id
        self.lanes: dict[int, Lane] = {}
        self.dead_lettered = 0
        self.rebalances = 0

    async def consume(self, stream: StreamT) -> None:
        """The agent body: dispatch, never wait."""
        manual = stream.noack()
        async for event in manual.events():
            self._dispatch(manual, event)

    def _dispatch(self, stream: StreamT, event: EventT) -> None:
        tp = event.message.tp
        lane = self.lanes.get(tp.partition)
        if lane is None:
            lane = self.lanes[tp.partition] = Lane(tp.partition)
            lane.task = asyncio.ensure_future(self._run_lane(stream, lane))
        lane.queue.put_nowait(event)
        if not lane.paused and lane.queue.qsize() >= self.max_pending:
            # Back-pressure for this partition only: stop fetching it until the lane catches up.
            self.app.consumer.pause_partitions([tp])
            lane.paused = True

    def on_rebalance(self) -> None:
        """Cancel every lane: unacked payments stay uncommitted and are re-read by their next owner."""
        self.rebalances += 1
        lanes, self.lanes = self.lanes, {}
        for lane in lanes.values():
            if lane.task is not None:
                lane.task.cancel()

    async def _run_lane(self, stream: StreamT, lane: Lane) -> None:
        while True:
            event = await lane.queue.get()
            if lane.paused and lane.queue.qsize() <= self.max_pending // 2:
                self.app.consumer.resume_partitions([event.message.tp])
                lane.paused = False
            lane.in_flight = event.message.offset
            await self._process(event)
            await stream.ack(event)
            lane.in_flight = None
            lane.done += 1

    async def _process(self, event: EventT) -> None:
        message = event.message
        p, offset = message.tp.partition, message.offset
        try:
            payment = parse_payment(message.key, message.value, self.max_payment_bytes)
        except InvalidPayment as exc:
            reason = str(exc)
            await retry_forever(f"dead-lettering {p}:{offset}", lambda: self._dead_letter(event, reason))
            return
        started = time.monotonic()
        if self.gate_enabled:
            row = await self.gate.wait_open(p, offset)
        else:
            row = self.gate.row(p) or {"watermark": -1, "dependencies": {}}
        admission = Admission(
            partition=p,
            offset=offset,
            watermark=row["watermark"],
            dependencies=dict(row["dependencies"]),
            waited_ms=round((time.monotonic() - started) * 1000, 3),
            gated=self.gate_enabled,
        )
        await retry_forever(
            f"processing payment {payment.payment_id} at {p}:{offset}",
            lambda: self.handler(payment, admission),
        )

    async def _dead_letter(self, event: EventT, reason: str) -> None:
        """Original bytes as the value, the reason and the origin in headers (Kafka Connect style)."""
        message = event.message
        headers = [
            ("dlq.reason", reason.encode()),
            ("dlq.topic", message.topic.encode()),
            ("dlq.partition", str(message.partition).encode()),
            ("dlq.offset", str(message.offset).encode()),
            ("dlq.worker", self.worker_id.encode()),
        ]
        fut = await self.dead_letters.send(key=message.key, value=message.value, headers=headers)
        await fut
        self.dead_lettered += 1
        log.info("dead-lettered %s:%d: %s", message.topic, message.offset, reason)
