"""What an operator sets for a gated consumer's lanes, grouped by what it bounds or decides."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aml_app.contract import DEFAULT_MAX_CLOCK_SKEW


@dataclass(frozen=True)
class ParkRequest:
    """An operator's request to park a payment (`aml-app park`): who, why and when. The park table
    holds its JSON, which the command writes."""

    by: str = "aml-app park"
    reason: str = ""
    at: float | None = None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ParkRequest:
        return cls(by=str(doc.get("by") or cls.by), reason=str(doc.get("reason") or ""), at=doc.get("at"))

    def as_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "by": self.by, "at": self.at}


#: Whether an operator asked to park the payment at (partition, offset), and who and why.
ParkRequested = Callable[[int, int], ParkRequest | None]


@dataclass(frozen=True)
class LaneLimits:
    """How much a lane takes and holds at once."""

    #: Payments of one partition handed to a batch handler at once (1 with a per-payment handler).
    max_batch: int = 1
    #: Events a lane buffers (queued, and held past a hole) before its partition is paused.
    max_pending: int = 1000
    #: Payments handled and waiting for what their handler left to complete, per partition.
    max_in_flight: int = 1000
    #: The contract's bounds on a payment: its size, and how far its `ts` may be past its record's time.
    max_payment_bytes: int = 65536
    max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError("max_batch must be at least 1, and 1 with a per-payment handler")
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")


@dataclass(frozen=True)
class LanePolicy:
    """What a lane does with a payment the gate or its handler holds: by default it waits and retries
    as long as it takes; the others need the review topic, where such a payment goes."""

    #: Off: payments pass without waiting for their dependencies (to measure what the gate prevents).
    gate_enabled: bool = True
    #: Seconds a payment may wait at the gate before it is admitted stale (the decide-stale policy).
    stale_after: float | None = None
    #: Failed attempts after which a payment is parked (0: never).
    max_attempts: int = 0
    #: Whether an operator asked to park a payment (`aml-app park`): it is parked at its next failure.
    park_requested: ParkRequested | None = None

    @property
    def sets_aside(self) -> bool:
        """Whether some payments may go to the review topic."""
        return self.stale_after is not None or bool(self.max_attempts) or self.park_requested is not None


DEFAULT_LIMITS = LaneLimits()
#: Wait at the gate and retry a failing handler as long as it takes.
DEFAULT_POLICY = LanePolicy()
