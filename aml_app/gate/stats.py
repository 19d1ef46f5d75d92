"""The gated consumer's counters, shared by its steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GateStats:
    """The gated consumer's counters, for the web view and the metrics."""

    rebalances: int = 0
    dead_lettered: int = 0
    handler_failures: int = 0
    #: Payments admitted stale (waited past the decide-stale wait) and parked on the review topic.
    decided_stale: int = 0
    payments_parked: int = 0
    #: Partitions fetched again: records fetched and never delivered; holes whose records exist.
    refetches: int = 0
    holes_refetched: int = 0
    #: Holes the log showed to be gaps in its offsets, gone past.
    gaps_accepted: int = 0
