"""Where a lane sends the payments it does not decide: those that break the contract to the dead-letter
topic, those decided stale or parked to the review topic. Each record is the original key, bytes,
headers and timestamp, with why and where it was read in headers after the original ones (`dlq.*`,
`review.*`: docs/contract.md), as Kafka Connect writes a dead letter; a value too large for one record
goes in parts (`aml_app.contract.in_parts`); each send is retried until the broker has it, so nothing set
aside is lost."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

from faust.types import EventT, TopicT

from aml_app.backoff import OnFailure, awaited, retry_forever
from aml_app.contract import dead_letter_headers, in_parts, origin_headers
from aml_app.gate.stats import GateStats

log = logging.getLogger(__name__)


class ReviewKind(StrEnum):
    """Why a payment went to the review topic (its `review.kind` header)."""

    #: Admitted by the decide-stale policy after waiting `AML_MAX_WAIT` at the gate.
    STALE = "stale"
    #: Its handler failed `AML_MAX_ATTEMPTS` times, or an operator asked (`aml-app park`).
    PARKED = "parked"


class Sink:
    def __init__(self, dead_letters: TopicT, review: TopicT | None, worker_id: str, stats: GateStats) -> None:
        self.dead_letters = dead_letters
        self.review = review
        self.worker_id = worker_id
        self.stats = stats

    async def dead_letter(
        self,
        event: EventT[Any],
        reason: str,
        on_failure: OnFailure | None = None,
        attempts: int | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """The original bytes as the value, the reason and the origin in headers (Kafka Connect style).
        Retried until the broker has it, or (raising the last error) `attempts` failures or `stop()`."""
        message = event.message
        headers = dead_letter_headers(
            reason, message.topic, message.partition, message.offset, self.worker_id
        )
        await self._send(
            self.dead_letters,
            "the dead-letter topic",
            "dlq",
            event,
            headers,
            None,
            on_failure,
            attempts,
            stop,
        )
        self.stats.dead_lettered += 1
        log.info(
            "dead-lettered %s partition %d offset %d: %s",
            message.topic,
            message.partition,
            message.offset,
            reason,
        )

    async def to_review(
        self,
        event: EventT[Any],
        kind: ReviewKind,
        reason: str,
        attempts: int = 0,
        on_failure: OnFailure | None = None,
    ) -> None:
        """A payment decided stale or parked, in the payment's partition of the review topic; retried until
        the broker has it, each failure told to `on_failure`."""
        assert self.review is not None, "deciding stale or parking needs a review topic"
        message = event.message
        headers = origin_headers(
            "review",
            reason,
            message.topic,
            message.partition,
            message.offset,
            self.worker_id,
            kind=kind.value,
            attempts=attempts,
        )
        await self._send(
            self.review, "the review topic", "review", event, headers, message.partition, on_failure
        )
        if kind is ReviewKind.STALE:
            self.stats.decided_stale += 1
        else:
            self.stats.payments_parked += 1
        log.warning(
            "%s %s partition %d offset %d: %s",
            kind.value,
            message.topic,
            message.partition,
            message.offset,
            reason,
        )

    @staticmethod
    async def _send(
        topic: TopicT,
        where: str,
        prefix: str,
        event: EventT[Any],
        headers: list[tuple[str, bytes]],
        partition: int | None,
        on_failure: OnFailure | None,
        attempts: int | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        message = event.message

        # A dead letter goes where the topic's partitioner puts its key; a review copy stays in the
        # payment's partition.
        where_to: dict[str, Any] = {} if partition is None else {"partition": partition}

        parts = in_parts(message.value, [*original_headers(message.headers), *headers], prefix, message.key)
        timestamp = faust_timestamp(message.timestamp)
        for number, (key, value, part_headers) in enumerate(parts, 1):

            async def send(
                key: bytes | None = key,
                value: bytes | None = value,
                part_headers: list[tuple[str, bytes]] = part_headers,
            ) -> None:
                fut = await topic.send(
                    key=key, value=value, headers=part_headers, timestamp=timestamp, **where_to
                )
                # Shielded: a lane stopped meanwhile (a rebalance) stops waiting, and the producer's
                # future is left to the producer; cancelled, Faust's callback on it logs a traceback.
                what = f"the send of {message.partition}:{message.offset} to {where}"
                await awaited(asyncio.shield(fut), what)

            part = f" (part {number} of {len(parts)})" if len(parts) > 1 else ""
            await retry_forever(
                f"writing {message.partition}:{message.offset} to {where}{part}",
                send,
                on_failure=on_failure,
                attempts=attempts,
                stop=stop,
            )


def original_headers(headers: Any) -> list[tuple[str, bytes]]:
    """The record's own headers, in order (Faust gives a list of pairs, or a mapping for a record it made)."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers or ()
    return [(str(name), value) for name, value in pairs]


def faust_timestamp(seconds: float | None) -> float | None:
    """The record's timestamp as Faust's `send` takes it, so that it writes the original millisecond:
    Faust reads a timestamp as `ms / 1000` and sends `int(seconds * 1000)`, which can truncate to the
    millisecond before; half a millisecond more gives back the one it read. None: the record has none,
    and the producer stamps the copy."""
    if seconds is None or seconds < 0:
        return None
    return (round(seconds * 1000) + 0.5) / 1000
