"""Where a dependency that reads a topic derived from `payments` stands on `payments`: pure bookkeeping.

A derivation stage reads `payments` and writes a derived topic D (payments enriched, filtered, split,
merged, repartitioned by another key); a dependency group G reads D and commits its offsets on D. Those
offsets say nothing directly about `payments`. The gate needs, for every payments partition p, a position
W_G(p) such that every payment below it is applied by G, as it has for a group reading `payments`.

**The one cooperation asked of the stage.** Every derived record names the payments it comes from in its
headers (`aml-source: <partition>:<offset>`, once per payment, as Kafka Connect and Flink sinks carry their
source's position), and the stage commits its own group's offsets on `payments` only once the records
derived from the payments below them are written (acknowledged, or in the same transaction). A record
without such a header stops the mapping with one sentence (`DerivationError`): the gate never guesses.

**The mapping.** Let S(p) be the stage's committed offset on p, read before G's offsets on D and before
D's ends. Every payment below S(p) has all its derived records in D by then. A derived record is applied
by G when it lies below G's committed offset on its partition; the others are *pending*. So

    W_G(p) = min(S(p), the smallest source offset on p among the pending records)

is safe: a payment below it has been derived and none of its records is pending. It covers the cases a
stage makes:

- a payment the stage filtered out has no record and passes once S(p) passes it;
- a payment split into records on several partitions of D waits for the last of them;
- a record merged from several payments names them all, and holds each until it is applied;
- a partition of D fed by several payments partitions interleaves their offsets: each is tracked apart;
- a stage behind holds W at S(p); a stage that restarts and writes some records again (duplicates
  later in D, with smaller source offsets) holds W at the smallest one until G applies it;
- records of D that retention deleted before G read them cannot be placed, whether this bookkeeping
  read them or not (G would go on from the log start past payments it never applied): `DerivationError`
  says so; so does a compacted D (`aml_app.kafka.derived`).

**Cost.** The pending records are read once each, as they are appended (not the whole lag at every
refresh), and kept per (partition of D, payments partition) as a monotonic queue of the source offsets
that can still be the smallest pending one: O(1) per record, memory at most G's lag.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: The header a derived record names each payment it comes from in, as "<partition>:<offset>".
SOURCE_HEADER = "aml-source"
#: An `aml-source` value, exactly: the gate's reader and the pipeline's copy check (`aml_app.pipeline.
#: repeats`) read the same ones (int() alone took " 0:10" and "0:1_0", which the pipeline did not).
SOURCE_FORMAT = r"[0-9]{1,9}:[0-9]{1,18}"


class DerivationError(RuntimeError):
    """The derived topic cannot be mapped onto `payments`; the message says which record or partition."""


def source_positions(
    headers: Iterable[tuple[str, bytes | None]], topic: str, partition: int, offset: int
) -> list[tuple[int, int]]:
    """The (payments partition, offset) pairs a derived record (`topic`, `partition`, `offset`) names."""
    positions = []
    for key, value in headers:
        if key != SOURCE_HEADER:
            continue
        try:
            text = (value or b"").decode("ascii")
        except UnicodeDecodeError:
            text = ""
        if re.fullmatch(SOURCE_FORMAT, text) is None:
            raise DerivationError(
                f"the record at offset {offset} of {topic}[{partition}] has an {SOURCE_HEADER} header "
                f"{value!r}, not '<partition>:<offset>' of the payment it comes from"
            ) from None
        p, o = text.split(":")
        positions.append((int(p), int(o)))
    if not positions:
        raise DerivationError(
            f"the record at offset {offset} of {topic}[{partition}] has no {SOURCE_HEADER} header: the stage "
            "that writes it must name the payments it comes from, or the gate cannot tell which payments "
            "its readers have applied"
        )
    return positions


@dataclass
class _Partition:
    """The pending records of one partition of D, from `start` (complete from there) to `scanned`."""

    start: int
    scanned: int
    #: Per payments partition: (derived offset, source offset), source offsets rising front to back.
    lows: dict[int, deque[tuple[int, int]]] = field(default_factory=dict)

    def add(self, offset: int, source_partition: int, source_offset: int) -> None:
        queue = self.lows.setdefault(source_partition, deque())
        # An entry at or above this source offset, earlier in D, can never be the smallest pending one
        # again: this record stays pending at least as long.
        while queue and queue[-1][1] >= source_offset:
            queue.pop()
        queue.append((offset, source_offset))

    def applied_below(self, committed: int) -> None:
        self.start = max(self.start, committed)
        for source_partition, queue in list(self.lows.items()):
            while queue and queue[0][0] < committed:
                queue.popleft()
            if not queue:
                del self.lows[source_partition]


def check_retained(topic: str, group: str, partition: int, committed: int | None, log_start: int) -> int:
    """Where `group` stands on `partition` of D (its log start when it never committed), or the sentence
    that refuses: records the group never read are gone, so the payments in them cannot be placed."""
    if committed is None or committed < 0:
        if log_start > 0:
            raise DerivationError(
                f"{group!r} never committed on {topic}[{partition}], whose records below {log_start} are "
                "gone (retention): the payments in them cannot be placed; commit the group's offsets or "
                "recreate the topic"
            )
        return 0
    if committed < log_start:
        raise DerivationError(
            f"{group!r} committed {committed} on {topic}[{partition}], but the records from {committed} to "
            f"{log_start} are gone (retention) before the group read them: the payments in them cannot be "
            "placed"
        )
    return committed


class PendingSources:
    """The payments that one group reading D has not applied yet, kept up to date from the records of D
    read since the last refresh (`next_read`, `add`, `read_to`) and the group's committed offsets on D."""

    def __init__(self, topic: str, group: str) -> None:
        self.topic, self.group = topic, group
        self._partitions: dict[int, _Partition] = {}

    def next_read(self, partition: int, committed: int) -> int:
        """Where to read `partition` of D from next, given the group's committed offset on it (its log
        start when it never committed). A group moved back before what is kept is read again from there."""
        known = self._partitions.get(partition)
        if known is None or committed < known.start:
            self._partitions[partition] = known = _Partition(committed, committed)
        return max(known.scanned, committed)

    def add(self, partition: int, offset: int, positions: Sequence[tuple[int, int]]) -> None:
        """A record of D at `offset`, read in order after the previous one (`next_read`)."""
        known = self._partitions[partition]
        if offset < known.scanned:
            return  # read again after a retry: already counted
        for source_partition, source_offset in positions:
            known.add(offset, source_partition, source_offset)
        known.scanned = offset + 1

    def read_to(self, partition: int, end: int) -> None:
        """Every record of `partition` below `end` has been read (a fetch's high watermark; offsets in
        between that hold no record are transaction markers or aborted records)."""
        known = self._partitions[partition]
        known.scanned = max(known.scanned, end)

    def known(self) -> list[int]:
        """The partitions of D whose records are kept."""
        return list(self._partitions)

    def scanned(self, partition: int) -> int:
        return self._partitions[partition].scanned

    def positions(
        self,
        payments_partitions: Iterable[int],
        stage: Mapping[int, int | None],
        committed: Mapping[int, int],
        ends: Mapping[int, int],
    ) -> dict[int, int]:
        """W_G(p) for each payments partition: `stage` is S(p) (None: never committed), read first;
        `committed` the group's offset on each partition of D and `ends` each partition's end, read after
        it, every partition read up to its end."""
        lowest: dict[int, int] = {}
        for partition, offset in committed.items():
            known = self._partitions.get(partition)
            if known is None or known.scanned < ends[partition]:
                raise DerivationError(
                    f"{self.topic}[{partition}] has not been read to its end ({ends[partition]}); the "
                    f"positions of {self.group!r} on payments are not known yet"
                )
            known.applied_below(offset)
            for source_partition, queue in known.lows.items():
                low = queue[0][1]
                lowest[source_partition] = min(low, lowest.get(source_partition, low))
        return {
            p: min(max(stage.get(p) or 0, 0), lowest.get(p, max(stage.get(p) or 0, 0)))
            for p in payments_partitions
        }
