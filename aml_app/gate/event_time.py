"""The event-time gate across partitions: pure arithmetic over one reading of every partition.

Most AML rules read the payee's side too, whose payments arrive on other partitions (payments are keyed by
payer). The per-partition gate proves B and C applied payment (p, o); it says nothing about the payments
of other partitions that happened before it. The event-time gate admits payment (p, o) with event time t
when, on every partition q, the dependencies have applied every payment timestamped up to the cut
`t - allowed lateness`: W(q) has passed q's first payment past the cut, or q's log end.

The leader reads, per partition, the first payment the dependencies have not applied (the one at W(q))
and publishes one **cut row**: every partition's W(q), and the *frontier*, the earliest event time among
those payments. Everything before the frontier is applied on every partition, so the test for a payment
is `cut - frontier < 0` plus the per-partition `o < W(p)` of the same reading.

Why the payment's own `ts`, not Kafka's record timestamp: the rules' windows are in payment time (C's
window at t is (t - w, t]), while a record's timestamp is a producer's or the broker's clock. Reading the
payment at W(q) also gives the true log end (a fetch's high watermark), which ListOffsets may not.

**Quiet partitions** never hold the gate: a partition whose dependencies have applied everything its log
held when the leader read it (W(q) = its end) has no frontier. That reading comes after the committed
offsets it is compared with, and `o < W(p)` of the same reading proves payment (p, o) was in the log
before it, so a payment of q appended after the reading came after (p, o): in event time too, unless it
is late.

**Late payments.** A payment of q timestamped at or before the cut but appended after a later-timestamped
payment of q, or after (p, o), may be missing from (p, o)'s evidence: the gate cannot know it exists.
Payments within the allowed lateness of t (timestamped in (t - lateness, t]) are not waited for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from aml_app.gate.watermark import Json

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)
#: The earliest instant a payment's `ts` may hold (the contract's year 0001), in microseconds since the epoch.
EARLIEST_US = (datetime.min.replace(tzinfo=UTC) - EPOCH) // MICROSECOND


def micros(ts: str) -> int:
    """Microseconds since the epoch of an ISO-8601 instant with a timezone (a payment's `ts`): exact,
    so two payments of the same instant compare equal."""
    when = datetime.fromisoformat(ts)
    if when.tzinfo is None:
        raise ValueError(f"{ts!r} has no timezone")
    return (when - EPOCH) // MICROSECOND


def instant(us: int) -> str:
    """The ISO-8601 UTC text of microseconds since the epoch (for rows, decisions and pages)."""
    return (EPOCH + us * MICROSECOND).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Unapplied:
    """What the leader read on one partition at W(q): the log end (a fetch's high watermark) and the
    event time of the first payment at or after W(q) (None: the dependencies have applied the whole log)."""

    end: int
    first_ts: int | None


@dataclass(frozen=True)
class Cut:
    """The event-time gate's one row: every partition's W(q) of one reading and that reading's frontier.

    The table holds its JSON (`as_json`); the gate and the views read this type (`from_json`)."""

    #: W(q) per partition (partitions as text, as in the JSON).
    watermarks: Mapping[str, int]
    #: The earliest event time (µs) not yet applied on some partition (None: none), and its partition.
    frontier: int | None
    held_by: int | None
    refreshed_at: float
    #: Per partition, the log end the leader read at W(q); per partition not caught up, its first
    #: unapplied event time; the partitions it could not read.
    ends: Mapping[str, int] = field(default_factory=dict)
    behind: Mapping[str, int] = field(default_factory=dict)
    unread: tuple[int, ...] = ()
    generation: int | None = None
    log: str | None = None
    #: A derived group's offsets on its topic, of the same reading (`watermark.derived_need`).
    derived: Mapping[str, Mapping[str, int]] | None = None
    #: The dependency groups every W(q) is the minimum over (the leader's AML_DEPENDS_ON).
    groups: tuple[str, ...] = ()

    @property
    def partitions(self) -> int:
        """How many partitions the cut speaks for: every one of the leader's reading."""
        return len(self.watermarks)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Cut:
        return cls(
            watermarks=dict(doc["watermarks"]),
            frontier=doc.get("frontier"),
            held_by=doc.get("held_by"),
            refreshed_at=float(doc.get("refreshed_at") or 0.0),
            ends=dict(doc.get("ends") or {}),
            behind=dict(doc.get("behind") or {}),
            unread=tuple(doc.get("unread") or ()),
            generation=doc.get("generation"),
            log=doc.get("log"),
            derived=doc.get("derived") or None,
            groups=tuple(doc.get("groups") or ()),
        )

    def as_json(self) -> Json:
        return {
            "watermarks": dict(self.watermarks),
            "ends": dict(self.ends),
            "behind": dict(self.behind),
            "unread": list(self.unread),
            "frontier": self.frontier,
            "held_by": self.held_by,
            "refreshed_at": self.refreshed_at,
            "generation": self.generation,
            "log": self.log,
            "groups": list(self.groups),
            **({"derived": {g: dict(o) for g, o in self.derived.items()}} if self.derived else {}),
        }


def cut_row(
    watermarks: Mapping[int, int],
    unapplied: Mapping[int, Unapplied],
    refreshed_at: float,
    *,
    generation: int | None = None,
    log: str | None = None,
    derived: Mapping[str, Any] | None = None,
    groups: Sequence[str] = (),
) -> Cut:
    """The one row the event-time gate reads: every partition's W(q) and the frontier of that reading.

    `frontier` is the earliest event time not yet applied on some partition (None: none), `held_by` the
    partition it is on; `behind` lists, per partition that is not caught up, its first unapplied event time
    (for the page). A partition missing from `unapplied` was not read: the row keeps the gate closed
    (`admits`; its frontier, shown on the page, is the epoch's start) rather than treat it as caught up.
    """
    behind: dict[str, int] = {}
    unread = sorted(set(watermarks) - set(unapplied))
    for q, found in unapplied.items():
        if found.first_ts is not None:
            behind[str(q)] = found.first_ts
    frontier: int | None
    held_by: int | None
    if unread:
        frontier, held_by = 0, unread[0]
    elif behind:
        held_by, frontier = min(
            ((int(q), ts) for q, ts in behind.items()), key=lambda item: (item[1], item[0])
        )
    else:
        frontier, held_by = None, None
    return Cut(
        watermarks={str(q): w for q, w in sorted(watermarks.items())},
        frontier=frontier,
        held_by=held_by,
        refreshed_at=refreshed_at,
        ends={str(q): found.end for q, found in sorted(unapplied.items())},
        behind=behind,
        unread=tuple(unread),
        generation=generation,
        log=log,
        derived=dict(derived) if derived else None,
        groups=tuple(groups),
    )


def admits(cut: Cut | None, partition: int, offset: int, event_us: int, lateness_us: int) -> bool:
    """Whether payment (partition, offset) at `event_us` may start under this cut row. None while a
    partition was not read: nothing is known of its payments, which may be older than any payment (the
    contract takes times from year 1, so no frontier instant alone would hold every one back)."""
    if cut is None or cut.unread:
        return False
    w = cut.watermarks.get(str(partition))
    if w is None or offset >= w:
        return False
    return cut.frontier is None or event_us - lateness_us < cut.frontier


def decided_at(cut: Cut, event_us: int, lateness_us: int) -> dict[str, Any]:
    """What a decision records of the cut it was decided at: the instant, the frontier and every W(q).
    The instant stops at the earliest one a payment may hold: a year-1 payment's cut is not in year 0."""
    frontier = cut.frontier
    return {
        "at": instant(max(event_us - lateness_us, EARLIEST_US)),
        "frontier": None if frontier is None else instant(frontier),
        "watermarks": dict(cut.watermarks),
        **({"derived": {g: dict(o) for g, o in cut.derived.items()}} if cut.derived else {}),
    }
