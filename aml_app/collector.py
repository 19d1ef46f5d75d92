"""Python's cycle collector in the long-running processes (workers, the APIs): what a process builds to
start is kept out of its scans.

A worker or an API replica holds a large, permanent heap once started (modules, Faust's services and
tables, the clients, the model), and allocates many short-lived objects per payment (answers, evidence,
decisions). Left as it is, the collector runs a young collection every 700 allocations and, as survivors
pile up, a full one that scans the whole permanent heap again: a fifth of a worker's CPU at 500
payments/s (BENCHMARKS.md, "Capacity"). `settle` moves what exists at start-up to the permanent
generation, which no collection scans, and collects the young generation every `YOUNG` allocations.
Objects are still freed when their last reference goes; only cycles built before `settle` are never
collected, and a started process builds none that it drops.
"""

from __future__ import annotations

import gc

#: Allocations between two collections of the young generation (Python's default: 700).
YOUNG = 10_000


def settle() -> None:
    """Call once, when the process has started: collect what start-up left, then freeze the rest."""
    gc.collect()
    gc.set_threshold(YOUNG, *gc.get_threshold()[1:])
    gc.freeze()
