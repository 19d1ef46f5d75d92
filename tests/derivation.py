"""A simulated derivation stage and the brute-force truth of what a group reading its topic has applied,
shared by the unit test of the bookkeeping and the integration test on the real broker."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

PAYMENTS = (0, 1, 2)
DERIVED = (0, 1)


@dataclass
class Stage:
    """A derivation stage over three payments partitions writing two derived partitions."""

    rng: random.Random
    sizes: dict[int, int]
    derived: dict[int, list[list[tuple[int, int]]]] = field(default_factory=lambda: {d: [] for d in DERIVED})
    position: dict[int, int] = field(default_factory=lambda: dict.fromkeys(PAYMENTS, 0))  # next to process
    committed: dict[int, int] = field(default_factory=lambda: dict.fromkeys(PAYMENTS, 0))  # S(p)
    merging: list[tuple[int, int]] = field(default_factory=list)

    def step(self) -> None:
        """Process the next payment of a random partition, or commit, or restart from the commits."""
        roll = self.rng.random()
        if roll < 0.1:
            self.commit()
            return
        if roll < 0.13:  # a crash: what is being merged is lost, processing resumes from S(p)
            self.merging.clear()
            self.position = dict(self.committed)
            return
        open_partitions = [p for p in PAYMENTS if self.position[p] < self.sizes[p]]
        if not open_partitions:
            self.flush()
            return
        p = self.rng.choice(open_partitions)
        payment = (p, self.position[p])
        self.position[p] += 1
        kind = self.rng.choice(["one", "one", "one", "filter", "split", "merge"])
        if kind == "filter":
            return
        if kind == "merge":
            self.merging.append(payment)
            if len(self.merging) >= 3:
                self.flush()
            return
        self.merging.append(payment)
        targets = list(DERIVED) if kind == "split" else [self.rng.choice(DERIVED)]
        for d in targets:
            self.derived[d].append(list(self.merging))
        self.merging.clear()

    def flush(self) -> None:
        if self.merging:
            self.derived[self.rng.choice(DERIVED)].append(list(self.merging))
            self.merging.clear()

    def commit(self) -> None:
        """S(p): every payment below it is derived (none is still being merged)."""
        held = {p: min((o for q, o in self.merging if q == p), default=None) for p in PAYMENTS}
        self.committed = {p: self.position[p] if held[p] is None else held[p] for p in PAYMENTS}


def truth(stage: Stage, committed: dict[int, int], group_committed: dict[int, int]) -> dict[int, int]:
    """The first payment of each partition that the group has not applied, by brute force."""
    pending = {
        position
        for d, records in stage.derived.items()
        for offset, record in enumerate(records)
        if offset >= group_committed[d]
        for position in record
    }
    first = {}
    for p in PAYMENTS:
        o = 0
        while o < committed[p] and (p, o) not in pending:
            o += 1
        first[p] = o
    return first
