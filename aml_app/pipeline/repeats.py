"""Which records of a derived topic repeat a payment the service has applied already.

A service reading a topic derived from payments (`aml_app.kafka.derivation`) may get a payment twice:
a stage that restarts writes again what it wrote after its last commit, and on a broker that hands
aborted transactions' records to read_committed readers (the embedded one does) the first copies come
too. Each record names its payment in the `aml-source` header ("partition:offset"), and a stage writes
the records of each payments partition to each derived partition in the payments' order (every
read-process-write loop does: it reads a partition in order and appends in order). So within one
derived partition, a record whose source offset is at or below the highest one already applied from
the same payments partition is a copy: the service skips it. The state is one number per (derived
partition, payments partition), kept in the service's store with the batch it covers.

A record without the header (or with one that does not parse) is applied as it is: the gate refuses to
map such a topic with a sentence of its own (`aml_app.kafka.derivation.source_positions`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aml_app.kafka.derivation import SOURCE_FORMAT

#: (derived partition, payments partition) -> the highest payments offset applied from it.
Seen = dict[tuple[int, int], int]


def parse_sources(sources: Any) -> tuple[Any, Any]:
    """The payments partition and offset of each record (Arrow string column "p:o"), as two int64
    numpy arrays, -1 where a record names none (or names it in another form)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(sources)
    partitions, offsets = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
    if n == 0:
        return partitions, offsets
    well_formed = pc.fill_null(pc.match_substring_regex(sources, f"^{SOURCE_FORMAT}$"), False)
    rows = np.flatnonzero(well_formed.to_numpy(zero_copy_only=False))
    if len(rows):
        parts = pc.split_pattern(pc.take(sources, pa.array(rows)), ":")
        partitions[rows] = pc.cast(pc.list_element(parts, 0), pa.int64()).to_numpy()
        offsets[rows] = pc.cast(pc.list_element(parts, 1), pa.int64()).to_numpy()
    return partitions, offsets


def find_repeats(
    partitions: Any, offsets: Any, sources: Any, seen: Mapping[tuple[int, int], int]
) -> tuple[Any, Seen]:
    """Which of a batch's records repeat a payment (a numpy bool mask, in the rows' order) and the
    highest source offset per (derived partition, payments partition) once the batch is applied (only
    the pairs the batch moved). `partitions` and `offsets` are the records' derived partitions and
    offsets, `sources` their `source` column, `seen` the state before the batch."""
    import numpy as np

    derived = np.asarray(partitions, np.int64)
    at = np.asarray(offsets, np.int64)
    source_partitions, source_offsets = parse_sources(sources)
    repeated = np.zeros(len(at), bool)
    moved: Seen = {}
    named = np.flatnonzero(source_partitions >= 0)
    if len(named) == 0:
        return repeated, moved
    # In the derived topic's order within each (derived partition, payments partition).
    order = named[np.lexsort((at[named], source_partitions[named], derived[named]))]
    keys = np.stack([derived[order], source_partitions[order]], axis=1)
    starts = np.flatnonzero(np.any(np.diff(keys, axis=0) != 0, axis=1)) + 1
    for group in np.split(order, starts):
        pair = (int(derived[group[0]]), int(source_partitions[group[0]]))
        values = source_offsets[group]
        before = seen.get(pair, -1)
        highest = np.maximum.accumulate(np.concatenate(([before], values)))
        repeated[group] = values <= highest[:-1]
        if highest[-1] > before:
            moved[pair] = int(highest[-1])
    return repeated, moved


def seen_to_text(seen: Mapping[tuple[int, int], int]) -> str:
    """The state as the store keeps it (a JSON object "d:p" -> offset)."""
    return json.dumps({f"{d}:{p}": o for (d, p), o in sorted(seen.items())}, separators=(",", ":"))


def seen_from_text(text: str | None) -> Seen:
    """`seen_to_text`'s inverse; nothing recorded yet is an empty state."""
    if not text:
        return {}
    seen: Seen = {}
    for pair, offset in json.loads(text).items():
        d, p = pair.split(":")
        seen[(int(d), int(p))] = int(offset)
    return seen
