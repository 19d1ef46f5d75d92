"""The store-loss guard: a store must never be behind what its consumer group says it processed.

The group's committed offsets are what the freshness gate trusts: "committed past o on partition p"
means "payment (p, o) is in the store". The pipeline commits only after the store transaction that holds
the payments, so committed <= applied at every moment. A store found behind its group has lost history:
it is empty (a lost disk, a new database), restored from an old backup, or simply the wrong database.
Carrying on would make the group keep saying "processed" for payments the store no longer holds, so the
pipeline refuses to start and the API reports itself unhealthy, each with the same sentence.
"""

from __future__ import annotations

from collections.abc import Mapping


def behind(
    service: str, group: str, applied: Mapping[int, int], committed: Mapping[int, int | None]
) -> str | None:
    """The sentence saying how the store is behind its group, or None if it is not.

    `committed` must have been read BEFORE `applied`: the store only grows, so a store that kept up at
    the first reading still holds at least as much at the second, and a running pipeline is never
    mistaken for a lost store.
    """
    gaps = [
        (p, o, applied.get(p, 0))
        for p, o in sorted(committed.items())
        if o is not None and o > applied.get(p, 0)
    ]
    if not gaps:
        return None
    shown = "; ".join(
        f"partition {p}: group {group!r} has committed offset {o}, the store holds offsets below {have}"
        for p, o, have in gaps[:3]
    )
    more = f" (and {len(gaps) - 3} more partitions)" if len(gaps) > 3 else ""
    return (
        f"the {service} store is behind its consumer group ({shown}{more}): it is empty, restored from an "
        f"old backup, or the wrong database. Rebuild it with `aml-app rebuild {service}` (replays the topic "
        "from its earliest retained offset into a fresh store), or point AML_STORE_URL at the right database."
    )
