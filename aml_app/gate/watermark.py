"""Pure watermark arithmetic: no I/O, so every rule here is unit-tested in isolation.

Kafka's committed offset is the *next* offset a group will read, so a group whose committed offset on
partition p is c has finished every offset < c. The watermark W(p) is the minimum of that over all
dependency groups, and payment (p, o) is fresh exactly when o < W(p). A group with no committed offset
has finished nothing: its contribution is 0.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

#: A table value as JSON (what the changelog carries).
Json = dict[str, Any]


@dataclass(frozen=True)
class WatermarkRow:
    """One partition's row of the watermark table: W(p) and the reading it was computed from.

    The table holds its JSON (`as_json`, the changelog's format and `/watermarks.json`'s `watermarks`);
    the gate, the leader and the views read this type (`from_json`), never the JSON's keys."""

    partition: int
    watermark: int
    #: Each dependency group's committed offset on the partition (0 where it has none).
    dependencies: Mapping[str, int]
    #: When the leader read the offsets (its clock).
    refreshed_at: float
    #: The log end (ListOffsets latest, never below a committed offset) and this service's own commit.
    log_end: int | None = None
    service_committed: int | None = None
    #: The groups that never committed on the partition.
    never_committed: tuple[str, ...] = ()
    #: Per group, when its committed offset last moved.
    advanced_at: Mapping[str, float | None] = field(default_factory=dict)
    #: The consumer generation the leader wrote it in, and the log its offsets are of (see `distrust`).
    generation: int | None = None
    log: str | None = None
    #: Per group reading a topic derived from payments, its offsets there (partitions as text).
    derived: Mapping[str, Mapping[str, int]] | None = None
    #: The last refresh's failure on this partition, and when (the offsets are the last good reading).
    error: str | None = None
    error_at: float | None = None

    @property
    def groups(self) -> tuple[str, ...]:
        """The dependency groups W(p) is the minimum over (the leader's AML_DEPENDS_ON)."""
        return tuple(self.dependencies)

    @property
    def partitions(self) -> int | None:
        """A partition's row speaks for its partition only (the cut's counts the partitions it covers)."""
        return None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> WatermarkRow:
        return cls(
            partition=int(doc.get("partition", -1)),
            watermark=int(doc["watermark"]),
            dependencies=dict(doc.get("dependencies") or {}),
            refreshed_at=float(doc.get("refreshed_at") or 0.0),
            log_end=doc.get("log_end"),
            service_committed=doc.get("service_committed"),
            never_committed=tuple(doc.get("never_committed") or ()),
            advanced_at=dict(doc.get("advanced_at") or {}),
            generation=doc.get("generation"),
            log=doc.get("log"),
            derived=doc.get("derived"),
            error=doc.get("error"),
            error_at=doc.get("error_at"),
        )

    def as_json(self) -> Json:
        doc: Json = {
            "partition": self.partition,
            "watermark": self.watermark,
            "dependencies": dict(self.dependencies),
            "refreshed_at": self.refreshed_at,
            "log_end": self.log_end,
            "service_committed": self.service_committed,
            "never_committed": list(self.never_committed),
            "advanced_at": dict(self.advanced_at),
            "generation": self.generation,
            "log": self.log,
        }
        if self.derived is not None:
            doc["derived"] = {group: dict(offsets) for group, offsets in self.derived.items()}
        if self.error is not None:
            doc["error"], doc["error_at"] = self.error, self.error_at
        return doc

    def failed(self, message: str, at: float) -> WatermarkRow:
        """This row with the refresh's failure recorded (its offsets stay the last good reading)."""
        return replace(self, error=message, error_at=at)


class Stamped(Protocol):
    """What `distrust` reads of a row of either table (a partition's row, the event-time cut)."""

    @property
    def refreshed_at(self) -> float: ...

    @property
    def generation(self) -> int | None: ...

    @property
    def log(self) -> str | None: ...

    @property
    def groups(self) -> tuple[str, ...]: ...

    @property
    def partitions(self) -> int | None: ...


class CutLike(Protocol):
    """What `derived_need` reads of the event-time cut (`aml_app.gate.event_time.Cut`)."""

    @property
    def derived(self) -> Mapping[str, Mapping[str, int]] | None: ...


@dataclass(frozen=True)
class RefreshPolicy:
    """Every pace of the gate, derived here from what an operator sets: the background refresh
    interval (`AML_REFRESH_INTERVAL`), the on-demand one (`AML_FAST_REFRESH_INTERVAL`), how long a
    dependency may stand still before it counts as stalled (`AML_STALL_AFTER`) and, if set, how long one
    refresh may take (`AML_REFRESH_DEADLINE`)."""

    #: The leader reads the dependencies' offsets this often when nobody waits.
    interval: float
    #: ... and this often while a payment waits on a closed partition.
    fast: float
    stall_after: float
    #: One refresh's deadline as set; 0: derived from the interval (`refresh_deadline`).
    deadline: float = 0.0

    @property
    def gate_recheck(self) -> float:
        """Waiters look at their row again this often, in case the table hook stops firing."""
        return self.interval

    @property
    def row_rewrite(self) -> float:
        """An unchanged row is written again this often, so that its age says the leader is alive."""
        return self.interval

    @property
    def operator_read(self) -> float:
        """The log ends and this service's own commits, for the operators: read this often."""
        return self.interval

    @property
    def partition_recheck(self) -> float:
        """The payments topic's partition count is read again this often (it rarely changes)."""
        return 10 * self.interval

    @property
    def demand_republish(self) -> float:
        """A worker with waiting payments writes its demand again this often, even unchanged."""
        return self.interval / 2

    @property
    def demand_max_age(self) -> float:
        """A worker's demand entry older than this no longer counts (six republish intervals)."""
        return 3 * self.interval

    @property
    def delivery_check(self) -> float:
        """The lanes' delivery is checked this often (`GatedConsumer.check_delivery`)..."""
        return self.interval

    @property
    def delivery_quiet(self) -> float:
        """... for a partition whose lane has had nothing new for this long."""
        return 2 * self.interval

    @property
    def refresh_deadline(self) -> float:
        """One refresh may take this long; then it is abandoned with its Kafka clients and the next
        starts with new ones. Unless set, five intervals and at least 10 s, twice an admin request's own
        5 s timeout, so that one slow answer does not cost the clients."""
        return self.deadline or max(10.0, 5 * self.interval)

    @property
    def stuck_after(self) -> float:
        """The leader with no successful refresh for this long is stuck (`aml_app.gate.watchdog`)."""
        return max(20 * self.interval, 2 * self.refresh_deadline)

    @property
    def leave_after(self) -> float:
        """A leader stuck this much longer on refreshes that overrun leaves its group."""
        return 3 * self.refresh_deadline

    @property
    def stall_check(self) -> float:
        """The dependency statuses are computed this often: four times per stall, within the intervals."""
        return max(self.fast, min(self.interval, self.stall_after / 4))


def watermark(committed: Mapping[str, int | None]) -> int:
    """Min of the dependency groups' committed offsets on one partition (None or negative => 0)."""
    if not committed:
        raise ValueError("a watermark needs at least one dependency group")
    return min(max(offset or 0, 0) for offset in committed.values())


def is_open(offset: int, row: WatermarkRow | None) -> bool:
    """Whether payment at `offset` may start: strictly below the watermark."""
    return row is not None and offset < row.watermark


def distrust(
    row: Stamped,
    now: float,
    max_age: float,
    generation: int | None,
    log: str | None = None,
    *,
    groups: Collection[str] = (),
    partitions: int = 0,
    failure: Callable[[], str | None] | None = None,
) -> str | None:
    """Why a worker may not admit payments on `row` (None: it may).

    A row is a reading of the dependencies' committed offsets, and committed offsets can move back (a
    group reset or deleted). So a row counts only while it is recent (`refreshed_at`, the leader's
    clock, at most `max_age` seconds ago by this worker's: clocks kept in step, as NTP does) and written
    in this worker's consumer generation or later: a restarted worker, or one after a rebalance, waits
    for the current leader's first refresh instead of trusting rows its changelog replayed. And its
    offsets must be of the `log` this worker reads (`aml_app.kafka.identity`): after the topic is
    deleted and created again, or the cluster changes, offsets of two logs are never compared. And its
    watermark must count every group of `groups`, those this worker depends on: while AML_DEPENDS_ON
    changes in a rolling restart, a leader still on the old setting publishes a W(p) that says nothing
    of a group added to it. And a row that speaks for every partition (the event-time cut) must cover
    the `partitions` this worker's consumer sees the topic has (0: not known yet): one read before
    partitions were added says nothing of the payments there. An old row names the leader's last failed
    read when `failure` (asked only then) gives one.
    """
    if log is not None and row.log != log:
        return (
            f"the row's offsets are of log {row.log}, but this worker reads log {log} (the payments "
            "topic was deleted and created again, or the cluster changed): offsets of two logs are not "
            "compared; the workers read the current log at their next assignment (restart them)"
        )
    uncounted = [g for g in groups if g not in row.groups]
    if uncounted:
        return (
            f"the row's watermark does not count group{'s' if len(uncounted) > 1 else ''} "
            f"{', '.join(uncounted)}, which this worker depends on (it counts "
            f"{', '.join(row.groups) or 'none'}: the leader runs with another AML_DEPENDS_ON); waiting "
            "for a leader that depends on the same groups"
        )
    covered = row.partitions
    if covered is not None and covered < partitions:
        return (
            f"the cut covers {covered} partitions, but the payments topic has {partitions} as this "
            "worker's consumer sees it (partitions were added): waiting for the leader to read them"
        )
    age = now - row.refreshed_at
    if age > max_age:
        error = None if failure is None else failure()
        why = "the leader has not refreshed it" if error is None else f"the leader's read failed: {error}"
        return f"the row is {age:.1f} s old (more than {max_age:g} s): {why}"
    written = row.generation
    if generation is not None and (written is None or written < generation):
        return (
            f"the row was written in consumer generation {written}, before this worker's "
            f"{generation}: waiting for the leader's first refresh"
        )
    return None


def build_rows(
    partitions: Iterable[int],
    committed_by_group: Mapping[str, Mapping[int, int | None]],
    refreshed_at: float,
    *,
    log_ends: Mapping[int, int] | None = None,
    service_committed: Mapping[int, int | None] | None = None,
    previous: Mapping[int, WatermarkRow | None] | None = None,
    generation: int | None = None,
    log: str | None = None,
    derived: Mapping[str, Mapping[int, int]] | None = None,
) -> dict[int, WatermarkRow]:
    """One table row per partition: the watermark and the offsets it was computed from.

    Besides W(p) and the dependencies' offsets, a row carries what an operator needs to see why a
    partition waits: the log end (`log_ends`, ListOffsets latest), this service's own committed offset
    (`service_committed`), the groups that never committed on it, and per group when its committed offset
    last moved (`advanced_at`), carried over from the `previous` row while the offset stays put, and the
    consumer `generation` the leader wrote it in and the `log` the offsets are of (see `distrust`). A
    group reading a topic derived from payments has its offsets on that topic in `derived` (those its
    position was mapped from: what its answers must include, `derived_need`).

    The log end is never below an offset some group committed: a committed offset is proof that the log
    reaches that far, and some brokers (Tansu) answer ListOffsets with a record batch's base offset + 1.
    """
    rows: dict[int, WatermarkRow] = {}
    on_derived = derived_json(derived) if derived else None  # the same reading's, for every row
    for p in partitions:
        raw = {g: offsets.get(p) for g, offsets in committed_by_group.items()}
        deps = {g: max(offset or 0, 0) for g, offset in raw.items()}
        own = (service_committed or {}).get(p)
        own = None if own is None or own < 0 else own
        listed = None if log_ends is None else log_ends.get(p)
        log_end = None if listed is None else max(listed, own or 0, *deps.values())
        old = (previous or {}).get(p)
        old_deps = old.dependencies if old is not None else {}
        old_advanced = old.advanced_at if old is not None else {}
        advanced_at = {
            g: old_advanced[g] if old_deps.get(g) == c and old_advanced.get(g) is not None else refreshed_at
            for g, c in deps.items()
        }
        rows[p] = WatermarkRow(
            partition=p,
            watermark=watermark(deps),
            dependencies=deps,
            refreshed_at=refreshed_at,
            log_end=log_end,
            service_committed=own,
            never_committed=tuple(sorted(g for g, offset in raw.items() if offset is None or offset < 0)),
            advanced_at=advanced_at,
            generation=generation,
            log=log,
            derived=on_derived,
        )
    return rows


def derived_json(derived: Mapping[str, Mapping[int, int]]) -> dict[str, dict[str, int]]:
    """Derived groups' offsets as a row keeps them (JSON: partitions as text)."""
    return {
        group: {str(d): o for d, o in sorted(offsets.items())} for group, offsets in sorted(derived.items())
    }


def derived_need(*rows: WatermarkRow | CutLike | None) -> dict[str, dict[int, int]]:
    """What each derived group's answers must include for a payment the rows let through: per group, the
    highest offset on its topic over the rows (a partition's row and the event-time gate's cut)."""
    need: dict[str, dict[int, int]] = {}
    for row in rows:
        for group, offsets in ((row.derived if row is not None else None) or {}).items():
            mine = need.setdefault(group, {})
            for d, o in offsets.items():
                mine[int(d)] = max(mine.get(int(d), 0), int(o))
    return need


def row_changed(old: WatermarkRow | None, new: WatermarkRow) -> bool:
    """Whether `new` says something `old` did not (an error row always counts as changed)."""
    if old is None or old.error:
        return True
    return any(
        getattr(old, k) != getattr(new, k)
        for k in (
            "watermark",
            "dependencies",
            "log_end",
            "service_committed",
            "never_committed",
            "generation",
            "log",
            "derived",
        )
    )


@dataclass(frozen=True)
class Demand:
    """One worker's entry of the demand table: the lowest offset it waits on per partition and since
    when, its lanes that keep failing (as `aml_app.gate.handling.Retrying` shows them), and when it
    wrote the entry. The table holds its JSON (partitions as text)."""

    at: float
    waiting: Mapping[int, int] = field(default_factory=dict)
    since: Mapping[int, float] = field(default_factory=dict)
    retrying: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Demand:
        return cls(
            at=float(doc.get("at", 0)),
            waiting={int(p): int(o) for p, o in (doc.get("waiting") or {}).items()},
            since={int(p): float(t) for p, t in (doc.get("since") or {}).items()},
            retrying={int(p): dict(d) for p, d in (doc.get("retrying") or {}).items()},
        )

    def as_json(self) -> Json:
        return {
            "waiting": {str(p): o for p, o in self.waiting.items()},
            "retrying": {str(p): dict(d) for p, d in self.retrying.items()},
            "since": {str(p): t for p, t in self.since.items()},
            "at": self.at,
        }


def live_demand(entries: Iterable[Demand], now: float, max_age: float) -> dict[int, int]:
    """Lowest waiting offset per partition over every worker whose demand entry is recent."""
    waiting: dict[int, int] = {}
    for entry in entries:
        if now - entry.at > max_age:
            continue
        for p, offset in entry.waiting.items():
            waiting[p] = min(waiting.get(p, offset), offset)
    return waiting


def live_blocked_since(entries: Iterable[Demand], now: float, max_age: float) -> dict[int, float]:
    """Earliest time some worker started waiting, per partition, over the recent demand entries."""
    since: dict[int, float] = {}
    for entry in entries:
        if now - entry.at > max_age:
            continue
        for p, started in entry.since.items():
            since[p] = min(since.get(p, started), started)
    return since


#: The reads of a refresh, in order: the groups' committed offsets (with the operator fields and, now and
#: then, the partitions), the log's identity, and the event-time cut's first unapplied payments.
REFRESH_PHASES = ("offsets", "log_identity", "event_time_cut")


def refresh_due(
    now: float,
    last_refresh: float | None,
    waiting: Mapping[int, int],
    rows: Mapping[int, WatermarkRow],
    slow_interval: float,
    fast_interval: float,
    generation: int | None = None,
    every_wait: bool = False,
) -> bool:
    """The leader refreshes on the slow interval, or on the fast one while some payment is blocked: by
    the watermark, or by a row written before the current consumer `generation` (see `distrust`). With
    `every_wait` (the event-time gate, which may hold a payment whose own row is open) any waiting
    payment counts as blocked.

    This keeps admin load at one set of calls per slow interval when nothing waits, and unblocks a
    waiting partition within about one fast interval of its dependencies committing.
    """
    if last_refresh is None:
        return True
    age = now - last_refresh
    if age >= slow_interval:
        return True

    def blocked(p: int, offset: int) -> bool:
        if every_wait:
            return True
        row = rows.get(p)
        if row is None or not is_open(offset, row):
            return True
        written = row.generation
        return generation is not None and (written is None or written < generation)

    return any(blocked(p, offset) for p, offset in waiting.items()) and age >= fast_interval
