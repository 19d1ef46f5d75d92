"""The watermark table, the demand table, and the leader's refresh timer.

`watermarks` (partition -> row) is a GlobalTable: every worker holds every partition's watermark, so a
partition that moves to another worker is gated there at once. Only the leader talks to the admin API
(one set of calls per refresh, whatever the worker count) and writes the rows; the changelog carries
them to the other workers, whose table hook wakes the gate's waiters.

`demand` (worker id -> partitions it is waiting on) makes the refresh demand-driven: the leader polls
the admin API on the fast interval only while somebody waits on a partition that is still closed.

With the event-time gate (`AML_GATE_MODE=event-time`, aml_app.gate.event_time), the leader also reads the
first payment the dependencies have not applied on every partition, in the same refresh, and writes one
cut row to `gate-cut`: every worker admits a payment when the cut covers its event time.

For the operators, the rows also carry the log end, this service's own committed offset (both read on
the slow interval only) and when each dependency's offset last moved; every worker derives the
dependency statuses from the two tables (`operator_view`), and the leader logs stalls (`watch_stalls`).

The tables are defined at import, as Faust requires; everything else of the gate on this worker (the
`FreshnessGate`, the Kafka readers, the timers, the publisher) is one mode service, `WorkerGate`, built
when the worker is composed (`gate_service`), that the app starts after table recovery and stops with
itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar, cast

import faust
from faust.tables.manager import TableManager
from mode import Service
from mode.utils.objects import qualname

from aml_app.app import app, settings
from aml_app.faust_internals import (
    MEMORY_STORE,
    WatchedGlobalTable,
    quiet_back_to_back,
    subscribed_partitions,
    wait_for_topic,
)
from aml_app.gate import FreshnessGate, GatedConsumer
from aml_app.gate.event_time import Cut, cut_row, instant
from aml_app.gate.health import Limits, StallWatch, describe
from aml_app.gate.options import ParkRequest
from aml_app.gate.unapplied import UnappliedReader
from aml_app.gate.watchdog import Outcome, RefreshWatchdog, Verdict
from aml_app.gate.watermark import (
    REFRESH_PHASES,
    Demand,
    Json,
    RefreshPolicy,
    Stamped,
    WatermarkRow,
    build_rows,
    distrust,
    live_blocked_since,
    live_demand,
    refresh_due,
    row_changed,
)
from aml_app.kafka.deadlines import CancelledWithin, DeadlineExceeded, within
from aml_app.kafka.offsets import DependencyOffsets, OffsetReadError
from aml_app.kafka.quiet import quiet_hand_assignments
from aml_app.settings import GateMode

log = logging.getLogger(__name__)

T = TypeVar("T")


def _global_table(name: str, key_type: type, help: str) -> WatchedGlobalTable:
    table = WatchedGlobalTable(
        app,
        name=name,
        default=None,
        beacon=app.tables.beacon,
        partitions=1,
        schema=faust.Schema(key_type=key_type, key_serializer="json", value_serializer="json"),
        # Apply every changelog record as it arrives: a waiting payment should see it at once.
        standby_buffer_size=1,
        recovery_buffer_size=1,
        is_global=True,
        # Written from timers, not from a stream; also makes every worker read every partition.
        use_partitioner=True,
        # Derived state, recomputed by the next refresh: kept in memory, rebuilt from the changelog.
        # (Faust's RocksDB store also refuses writes made outside an event, as these are.)
        store=MEMORY_STORE,
        help=help,
    )
    return cast(WatchedGlobalTable, app.tables.add(table))


watermarks = _global_table("watermarks", int, "Per payments partition: W(p) and the offsets behind it.")
demand = _global_table("gate-demand", str, "Per worker: the partitions it waits on, and since when.")
#: The event-time gate's one row (key CUT), written by the leader with the watermarks.
cuts = _global_table("gate-cut", str, "The event-time gate's cut: every W(q) and the earliest unapplied ts.")
CUT = "cut"


#: Payments an operator asked to park (`aml-app park P:O`): "P:O" -> who, when and why. Written by the
#: command straight to the table's changelog; a lane parks such a payment when it fails on it.
class Typed(Generic[T]):
    """A table's values as their type, each value parsed once: again only when the table holds another
    (a write, or the changelog applying one), so the gate's lookups on the hot path cost a dict read."""

    def __init__(self, table: WatchedGlobalTable, parse: Callable[[Json], T]) -> None:
        self.table, self.parse = table, parse
        self._parsed: dict[Any, tuple[Json, T]] = {}

    def values(self) -> list[T]:
        return [value for _, value in self.items()]

    def items(self) -> list[tuple[Any, T]]:
        return [(key, value) for key in list(self.table.keys()) if (value := self.get(key)) is not None]

    def get(self, key: Any) -> T | None:
        raw = self.table.get(key)
        if raw is None:
            return None
        seen = self._parsed.get(key)
        if seen is not None and seen[0] is raw:
            return seen[1]
        value = self.parse(raw)
        self._parsed[key] = (raw, value)
        return value


#: The rows, the cut and the demand entries as the gate and the views read them.
rows_of = Typed(watermarks, WatermarkRow.from_json)
cut_of = Typed(cuts, Cut.from_json)
demand_of = Typed(demand, Demand.from_json)
park_requests = _global_table(
    "gate-park", str, "Payments an operator asked to park: 'P:O' -> who, when, why."
)
park_of = Typed(park_requests, ParkRequest.from_json)
EVENT_TIME = settings.gate.mode is GateMode.EVENT_TIME
#: Every pace of the refresh, the gate and the delivery check, derived in one place.
refresh = RefreshPolicy(
    settings.gate.refresh_interval,
    settings.gate.fast_refresh_interval,
    settings.gate.stall_after,
    settings.gate.refresh_deadline,
)
#: `AML_FAILPOINT=refresh-hang`, for the tests only: the leader's reads of the dependencies' offsets
#: never answer and swallow their cancellation, as aiokafka's consumer did after a broker froze.
REFRESH_HANGS = os.environ.get("AML_FAILPOINT") == "refresh-hang"
limits = Limits.of(settings.gate)


async def never_answering() -> None:
    """A read that never answers and swallows every cancel (`AML_FAILPOINT=refresh-hang`)."""
    while True:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()


class RefreshStuck(RuntimeError):
    """The leader's refresh is stuck even with new Kafka clients: the worker leaves its group."""


def recovering() -> bool:
    """Whether this worker's tables are still recovering from their changelogs."""
    # `recovery` is TableManager's; Faust types app.tables as TableManagerT, which lacks it.
    return bool(app.in_recovery) or not cast(TableManager, app.tables).recovery.completed.is_set()


class RefreshStatus:
    """The leader's view of its own refreshes, for logs, the web view and the benchmarks."""

    def __init__(self) -> None:
        self.last_refresh: float | None = None
        self.last_attempt: float | None = None
        self.last_error: str | None = None
        self.refreshes = 0
        self.errors = 0
        self.partition_check_at = 0.0
        #: How many partitions of the payments topic the last reading had.
        self.partitions = 0
        #: The operator fields (log ends, our own commits) are read on the slow interval only, so the
        #: fast refresh that unblocks payments costs what it did before they existed.
        self.operator_read_at = float("-inf")
        self.log_ends: dict[int, int] = {}
        self.service_committed: dict[int, int | None] = {}
        #: Told each refresh's duration in seconds, the event-time cut's read included and failed or
        #: abandoned refreshes too (the web view's metrics).
        self.duration_observers: list[Callable[[float], None]] = []
        #: Seconds the refreshes so far spent in each of their reads, failed ones included: where a slow
        #: refresh spends its time (the web view and `/metrics`).
        self.phase_s: dict[str, float] = dict.fromkeys(REFRESH_PHASES, 0.0)

    def failed(self, message: str, holding: str) -> None:
        """Count a failed read; log it once per distinct error, saying what is held meanwhile."""
        self.errors += 1
        if message != self.last_error:
            log.warning("watermark refresh failed, holding %s: %s", holding, message)
        self.last_error = message


def topic_partitions() -> int:
    """How many partitions of the payments topic this worker's consumer saw at its last metadata
    refresh (0: none yet). The group rebalances on a change, so the worker learns of added partitions
    as fast as the consumer group does; a cut covering fewer is from before they were added."""
    return subscribed_partitions(app, settings.kafka.payments_topic)


@dataclass(frozen=True)
class Stamp:
    """When a refresh's reads began and in which consumer generation: what its rows are stamped with."""

    at: float
    generation: int

    def current(self) -> bool:
        """Whether this worker still leads in the generation the reads began in: a deposed leader, or
        one whose group rebalanced meanwhile, writes nothing stamped as the new generation's. When
        not, the log says what the refresh dropped and why."""
        if not app.is_leader():
            log.info("watermark refresh dropped: this worker stopped leading during its reads")
            return False
        if app.consumer_generation_id != self.generation:
            log.info(
                "watermark refresh dropped: the group rebalanced during its reads (generation %s, now %s)",
                self.generation,
                app.consumer_generation_id,
            )
            return False
        return True

    def outlived(self, max_age: float) -> str | None:
        """Why what the reads found is not written: they took `max_age` or longer, so every worker would
        distrust it as written (`distrust`), and a refresh that wrote it would pass for a success."""
        took = time.time() - self.at
        if took < max_age:
            return None
        return (
            f"the refresh's reads took {took:.1f} s, at least AML_WATERMARK_MAX_AGE={max_age:g} s: what "
            "they found would be distrusted as written, so the gate stays closed; the broker answers "
            "slowly (raise AML_WATERMARK_MAX_AGE if it always takes this long)"
        )


def _worth_writing(old: Stamped | None, row: Stamped, changed: bool) -> bool:
    """Write a row when it changed, or when it is getting old, so readers can trust its age."""
    return changed or old is None or row.refreshed_at - old.refreshed_at >= refresh.row_rewrite


class ChangelogsKnown:
    """No table write before the producer knows the changelog topic (a send to a topic it does not know
    crashes the worker in Faust's key_partition): waited for once."""

    def __init__(self) -> None:
        self.known = False

    async def wait(self) -> None:
        if not self.known:
            for table in (watermarks, demand, cuts):
                await wait_for_topic(app, table.changelog_topic.get_topic_name())
            self.known = True


class WriteErrors:
    """A timer's failed table writes: counted, logged once per distinct error, retried next tick."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self.last: str | None = None

    def failed(self, exc: BaseException) -> None:
        self.count += 1
        message = f"{type(exc).__name__}: {exc}"
        if message != self.last:
            log.warning("%s failed, retrying on the next tick: %s", self.what, message, exc_info=exc)
        self.last = message

    def succeeded(self) -> None:
        if self.last is not None:
            log.info("%s works again after: %s", self.what, self.last)
        self.last = None


class DemandPublisher:
    """Publishes this worker's waiting partitions (and its lanes that retry a failing payment) when
    they change, and re-asserts them while there are any."""

    def __init__(self, gate: FreshnessGate) -> None:
        self.gate = gate
        #: What it last published: the waiting offsets and the failing lanes, by partition.
        self.published: tuple[dict[int, int], dict[int, Any]] | None = None
        self.published_at = 0.0
        self.writes = 0
        self.errors = WriteErrors("publishing this worker's gate demand")
        #: Called at each tick for the lanes that keep failing: partition (str) -> what they retry.
        self.retrying: Callable[[], dict[str, Any]] = dict

    def tick(self, now: float) -> None:
        gate = self.gate
        current = (dict(gate.waiting), {int(p): doc for p, doc in self.retrying().items()})
        busy = bool(current[0] or current[1])
        stale = busy and now - self.published_at >= refresh.demand_republish
        if current != self.published or stale:
            entry = Demand(at=now, waiting=current[0], since=gate.blocked_since, retrying=current[1])
            demand[settings.worker_id] = entry.as_json()
            self.published, self.published_at = current, now
            self.writes += 1

    def stats(self) -> dict[str, Any]:
        return {"writes": self.writes, "errors": self.errors.count, "last_error": self.errors.last}


class WorkerGate(Service):
    """This worker's gate, supervised by the Faust app: started after table recovery (`app.service`)
    and stopped with the app, which stops its timers and closes its Kafka clients.

    It holds the `FreshnessGate` the lanes wait on, the leader's readers of the dependencies' offsets
    and of the first unapplied payments, the refresh status, the demand publisher and the stall watch,
    and the timers that drive them; and this worker's gated consumer once its agent registers it, whose
    lanes it stops when it stops (an unexpected end of a lane stops the worker: `GatedConsumer`).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: Waiters re-check on a timer too, in case the table hooks below stop firing (and rows age).
        self.gate = FreshnessGate(
            lookup=rows_of.get,
            recheck_every=refresh.gate_recheck,
            distrust=self.distrusted,
            cut=(lambda: cut_of.get(CUT)) if EVENT_TIME else None,
            lateness_us=round(settings.gate.allowed_lateness * 1_000_000),
        )
        gate = self.gate
        watermarks.watchers.append(lambda keys: gate.notify(int(k) for k in keys))
        cuts.watchers.append(lambda keys: gate.notify_all())
        self.offsets, self.unapplied = self._new_readers()
        self.status = RefreshStatus()
        self.watchdog = RefreshWatchdog(refresh.refresh_deadline, refresh.stuck_after, refresh.leave_after)
        #: The refresh attempt running now, whose readings may be written; an abandoned one may not.
        self._attempt: object | None = None
        self._leaving = False
        self.publisher = DemandPublisher(gate)
        self.stall_watch = StallWatch()
        self.refresh_errors = WriteErrors("writing the watermark table")
        self.changelogs = ChangelogsKnown()
        #: This worker's gated consumer (`aml_app.worker.agent.gated_agent` registers it, once).
        self.consumer: GatedConsumer | None = None
        # Under load the fast timers run back to back: their durations are a metric, not a warning each.
        quiet_back_to_back(*(qualname(timer.fun) for timer in (self.refresh_watermarks, self.publish_demand)))
        # The readers assign partitions by hand for each read: no INFO line (a five-line table) each time.
        quiet_hand_assignments()

    @staticmethod
    def _new_readers() -> tuple[DependencyOffsets, UnappliedReader]:
        """The leader's Kafka clients: the admin reads of the offsets, the event-time fetches."""
        servers, topic, security = (
            settings.kafka.bootstrap_servers,
            settings.kafka.payments_topic,
            settings.kafka.security,
        )
        return (
            DependencyOffsets(
                servers,
                topic,
                settings.depends_on,
                security=security,
                derived=settings.derived_dependencies,
            ),
            UnappliedReader(
                servers,
                topic,
                security=security,
                max_payment_bytes=settings.kafka.max_payment_bytes,
                max_clock_skew=settings.kafka.max_clock_skew,
            ),
        )

    def _rebuild_readers(self) -> None:
        """Give up the leader's Kafka clients for new ones, closing the old ones in the background (each
        close has a deadline, `aml_app.kafka.deadlines`): nothing a stuck client does can hold the next
        refresh, and the refresh running now may no longer write what it reads."""
        self._attempt = None
        old = (self.offsets, self.unapplied)
        self.offsets, self.unapplied = self._new_readers()
        self.offsets.carry_over(old[0])
        for reader in old:
            self.add_future(reader.close())

    def register(self, consumer: GatedConsumer) -> None:
        if self.consumer is not None:
            raise RuntimeError("a worker runs one gated service; gated_agent was called twice")
        self.consumer = consumer

    async def on_stop(self) -> None:
        if self.consumer is not None:
            self.consumer.stop()
        await self.offsets.close()
        await self.unapplied.close()

    def distrusted(self, row: Stamped) -> str | None:
        """Why this worker may not admit payments on `row` now (`aml_app.gate.watermark.distrust`)."""
        generation = app.consumer_generation_id
        return distrust(
            row,
            time.time(),
            settings.gate.watermark_max_age,
            generation,
            self.gate.log,
            groups=settings.depends_on,
            partitions=topic_partitions() if row.partitions is not None else 0,
            failure=lambda: self._read_failure(row),
        )

    def _read_failure(self, row: Stamped) -> str | None:
        """The leader's last failed read that keeps `row` old: its own error, or for the cut any row's
        (a cut is written only after the offsets it rests on were read)."""
        if isinstance(row, WatermarkRow):
            return row.error
        return next((r.error for r in rows_of.values() if r is not None and r.error), None)

    # --- the leader's refresh -----------------------------------------------------------------------

    @Service.timer(refresh.fast)
    async def refresh_watermarks(self) -> None:
        """Leader only: read the dependencies' committed offsets when due and publish W(p) for every p."""
        if not app.is_leader():
            return
        status = self.status
        now = time.monotonic()
        waiting = live_demand(demand_of.values(), time.time(), max_age=refresh.demand_max_age)
        last = status.last_refresh if status.last_error is None else status.last_attempt
        rows = {p: row for p in waiting if (row := rows_of.get(p)) is not None}
        generation = app.consumer_generation_id
        if refresh_due(
            now,
            last,
            waiting,
            rows,
            refresh.interval,
            refresh.fast,
            generation=generation,
            every_wait=EVENT_TIME,
        ):
            attempt = self._attempt = object()
            deadline = refresh.refresh_deadline
            started = time.perf_counter()
            try:
                outcome = await within(self.refresh_once(now, attempt), deadline, "the watermark refresh")
            except (DeadlineExceeded, CancelledWithin) as exc:
                # A call that never returns (a client waiting on a broker that froze mid-request), or one
                # that a client cancelled under it: abandoned; the next refresh starts with new clients.
                outcome = Outcome.OVERRAN
                message = f"{exc} and was abandoned; retrying with new Kafka clients"
                self.status.failed(message, "the last known watermarks")
                self._mark_error_guarded(message)
                self._rebuild_readers()
            except Exception as exc:  # a timer that raises stops the worker: never for a table write
                outcome = Outcome.FAILED
                self.refresh_errors.failed(exc)
            else:
                self.refresh_errors.succeeded()
            finally:
                if self._attempt is attempt:
                    self._attempt = None
                for observe in self.status.duration_observers:
                    observe(time.perf_counter() - started)
            self.watchdog.ended(time.monotonic(), outcome)

    async def refresh_once(self, now: float, attempt: object) -> Outcome:
        """One refresh: read, then write the rows (and the cut) unless `attempt` was abandoned meanwhile
        (`_attempt` is no longer it); how it ended, for the watchdog."""
        await self.changelogs.wait()
        status = self.status
        status.last_attempt = now
        # Partitions added to the topic: read them now if this worker's consumer sees more than the
        # last reading had, else every partition_recheck.
        recheck = (
            now - status.partition_check_at >= refresh.partition_recheck
            or topic_partitions() > status.partitions
        )
        operator_fields = now - status.operator_read_at >= refresh.operator_read
        # Stamped before the reads: a row's age bounds how old its reading is, however long the read took.
        stamp = Stamp(time.time(), app.consumer_generation_id)
        offsets, began = self.offsets, time.perf_counter()
        identity_before = offsets.identity_s
        try:
            if REFRESH_HANGS:
                await never_answering()
            reading = await offsets.read_all(
                settings.app_id, refresh_partitions=recheck, operator_fields=operator_fields
            )
        except OffsetReadError as exc:
            if attempt is self._attempt:
                status.failed(str(exc), "the last known watermarks")
                self._mark_error(str(exc))
            return Outcome.OVERRAN if exc.timed_out else Outcome.FAILED
        finally:
            identity = offsets.identity_s - identity_before
            status.phase_s["log_identity"] += identity
            status.phase_s["offsets"] += time.perf_counter() - began - identity
        if attempt is not self._attempt:
            return Outcome.OVERRAN
        if not stamp.current():
            return Outcome.FAILED
        if (slow := stamp.outlived(settings.gate.watermark_max_age)) is not None:
            status.failed(slow, "the last known watermarks")
            self._mark_error(slow)
            return Outcome.FAILED
        if recheck:
            status.partition_check_at = now
        status.partitions = len(reading.partitions)
        status.last_refresh = now
        status.refreshes += 1
        if reading.log_ends is not None and reading.service_committed is not None:
            status.log_ends, status.service_committed = reading.log_ends, reading.service_committed
            status.operator_read_at = now
        rows = build_rows(
            reading.partitions,
            reading.committed,
            refreshed_at=stamp.at,
            log_ends=status.log_ends,
            service_committed=status.service_committed,
            previous={p: rows_of.get(p) for p in reading.partitions},
            generation=stamp.generation,
            log=reading.log,
            derived=reading.derived,
        )
        self._write_rows(rows)
        self._drop_rows_beyond(set(reading.partitions))
        if EVENT_TIME:
            outcome = await self._write_cut(rows, reading.log, attempt, stamp)
            if outcome is not Outcome.SUCCEEDED:
                return outcome
        if status.last_error:
            log.info("watermark refresh recovered after: %s", status.last_error)
        status.last_error = None
        return Outcome.SUCCEEDED

    @staticmethod
    def _write_rows(rows: dict[int, WatermarkRow]) -> None:
        for p, row in rows.items():
            old = rows_of.get(p)
            if _worth_writing(old, row, row_changed(old, row)):
                watermarks[p] = row.as_json()

    @staticmethod
    def _drop_rows_beyond(partitions: set[int]) -> None:
        """Drop the rows of partitions the topic no longer has (deleted and created again with fewer):
        kept, their last error and their old log would speak for the topic on every view for ever."""
        for p in [p for p in list(watermarks.keys()) if p not in partitions]:
            del watermarks[p]

    @staticmethod
    def _mark_error(message: str) -> None:
        """Keep every watermark as it was; record the error on the rows so every worker can see it."""
        for p in list(watermarks.keys()):
            row = rows_of.get(p)
            if row is not None and row.error != message:
                watermarks[p] = row.failed(message, time.time()).as_json()

    def _mark_error_guarded(self, message: str) -> None:
        """`_mark_error` where a failure would leave a timer (which then stops for good): counted, retried
        on the next tick."""
        try:
            self._mark_error(message)
        except Exception as exc:
            self.refresh_errors.failed(exc)

    def _cut_failed(self, message: str) -> None:
        """The cut's read failed: its old row ages out and the gate closes. The rows, just written fresh,
        carry the error, so that every worker's views and health check see it, not the leader's alone."""
        self.status.failed(message, "the last event-time cut")
        self._mark_error(f"the event-time cut: {message}")

    async def _write_cut(
        self, rows: dict[int, WatermarkRow], log_id: str | None, attempt: object, stamp: Stamp
    ) -> Outcome:
        """Read every partition's first unapplied payment after the committed offsets and write the cut
        row, stamped as the `rows` it rests on; on a failed read the old row stays and ages out
        (`distrust`), so the gate closes, never opens."""
        reached = {p: row.watermark for p, row in rows.items()}
        began = time.perf_counter()
        try:
            found = await self.unapplied.read(reached, log_id)
        except OffsetReadError as exc:
            if attempt is self._attempt:
                self._cut_failed(str(exc))
            return Outcome.OVERRAN if exc.timed_out else Outcome.FAILED
        finally:
            self.status.phase_s["event_time_cut"] += time.perf_counter() - began
        if attempt is not self._attempt:
            return Outcome.OVERRAN
        if not stamp.current():
            return Outcome.FAILED
        if (slow := stamp.outlived(settings.gate.watermark_max_age)) is not None:
            self._cut_failed(slow)
            return Outcome.FAILED
        derived = next((row.derived for row in rows.values() if row.derived), None)
        row = cut_row(
            reached,
            found,
            stamp.at,
            generation=stamp.generation,
            log=log_id,
            derived=derived,
            groups=settings.depends_on,
        )
        old = cut_of.get(CUT)
        changed = old is None or replace(old, refreshed_at=row.refreshed_at) != row
        if _worth_writing(old, row, changed):
            cuts[CUT] = row.as_json()
        return Outcome.SUCCEEDED

    # --- every worker: its demand, the statuses ----------------------------------------------------

    @Service.timer(refresh.fast)
    async def publish_demand(self) -> None:
        """Never lets a failure out: a timer that raises stops the worker."""
        try:
            await within(self.changelogs.wait(), refresh.refresh_deadline, "learning the changelog topics")
            self.publisher.tick(time.time())
        except Exception as exc:
            self.publisher.errors.failed(exc)
        else:
            self.publisher.errors.succeeded()

    @Service.timer(refresh.interval)
    async def watch_refresh(self) -> None:
        """Leader only: the watchdog of the refresh (`aml_app.gate.watchdog`). Never awaits anything that
        can hang: the clients it gives up are closed in the background."""
        now = time.monotonic()
        if not app.is_leader():
            self.watchdog.disarm()
            return
        self.watchdog.arm(now)
        verdict = self.watchdog.check(now)
        if verdict is Verdict.REBUILD:
            message = (
                f"the leader ({settings.worker_id}) has completed no watermark refresh for "
                f"{self.watchdog.quiet_for(now):.0f} s (last error: {self.status.last_error}); it rebuilds "
                "its Kafka clients"
            )
            log.error("%s", message)
            self._mark_error_guarded(message)
            self._rebuild_readers()
        elif verdict is Verdict.LEAVE and not self._leaving:
            self._leaving = True
            sentence = (
                f"the leader ({settings.worker_id}) has completed no watermark refresh for "
                f"{self.watchdog.quiet_for(now):.0f} s, even with new Kafka clients (last error: "
                f"{self.status.last_error}): this worker stops and leaves its group so that another "
                "worker leads; its supervisor starts it again"
            )
            log.error("%s", sentence)
            self._mark_error_guarded(sentence)
            app.add_future(app.crash(RefreshStuck(sentence)))

    @Service.timer(refresh.stall_check)
    async def watch_stalls(self) -> None:
        """Every worker computes the statuses (its page and metrics show them); the leader logs a stall
        once when it starts and once when it clears."""
        if recovering():
            return
        lines = self.stall_watch.update(self.operator_view(time.time())["dependencies"])
        if app.is_leader():
            for level, message in lines:
                log.log(level, message)

    # --- what the operators see --------------------------------------------------------------------

    def cut_view(self) -> dict[str, Any] | None:
        """The cut row as the page shows it: the frontier as an instant too (None: per-partition gate)."""
        row = cut_of.get(CUT) if EVENT_TIME else None
        if row is None:
            return None
        frontier = row.frontier
        return {
            **row.as_json(),
            "frontier_at": None if frontier is None else instant(frontier),
            "lateness_s": settings.gate.allowed_lateness,
            "untrusted": self.distrusted(row),
        }

    def waiting_everywhere(self, now: float) -> tuple[dict[int, int], dict[int, float]]:
        """Who waits where, over every worker: the lowest waiting offset and since when, per partition.

        This worker's own gate is merged in, so its page is right before its demand entry comes back
        through the changelog.
        """
        entries = demand_of.values()
        waiting = live_demand(entries, now, max_age=refresh.demand_max_age)
        since = live_blocked_since(entries, now, max_age=refresh.demand_max_age)
        for p, offset in self.gate.waiting.items():
            waiting[p] = min(waiting.get(p, offset), offset)
        for p, started in self.gate.blocked_since.items():
            since[p] = min(since.get(p, started), started)
        return waiting, since

    def retrying_everywhere(self, now: float) -> list[dict[str, Any]]:
        """The lanes that keep failing on a payment, on every worker (from the demand table), with this
        worker's own merged in at once; one entry per partition, with the worker that retries it."""
        found: dict[int, dict[str, Any]] = {}
        for worker, entry in demand_of.items():
            if now - entry.at > refresh.demand_max_age:
                continue
            for p, doc in entry.retrying.items():
                found[p] = {**doc, "worker": worker}
        mine = {int(p): doc for p, doc in self.publisher.retrying().items()}
        for q, doc in mine.items():
            found[q] = {**doc, "worker": settings.worker_id}
        for q in [q for q, doc in found.items() if doc["worker"] == settings.worker_id]:
            if q not in mine:
                del found[q]  # our demand entry is older than our lane's success
        return [{**found[p], "retrying_for_s": round(now - found[p]["since"], 3)} for p in sorted(found)]

    def operator_view(
        self,
        now: float,
        *,
        in_flight: dict[int, int | None] | None = None,
        local: Iterable[int] = (),
        highwaters: dict[int, int | None] | None = None,
    ) -> dict[str, Any]:
        """The table as an operator sees it (partitions, dependencies, gate): see aml_app.gate.health."""
        waiting, since = self.waiting_everywhere(now)
        rows = {p: row for p in list(watermarks.keys()) if (row := rows_of.get(p)) is not None}
        return describe(
            rows,
            settings.depends_on,
            now,
            limits,
            waiting=waiting,
            blocked_since=since,
            in_flight=in_flight,
            local=set(local),
            highwaters=highwaters,
            untrusted={p: self.distrusted(row) for p, row in rows.items()},
        )


def gate_service() -> WorkerGate:
    """This worker's gate, as a service of the app: started after table recovery, stopped with the app.
    Built once, by whoever composes the worker (`aml_app.agents.compose`)."""
    worker_gate = WorkerGate()
    app.service(worker_gate)  # type: ignore[arg-type]  # Faust types it for a class; it starts an instance
    return worker_gate
