"""Every use of a Faust, mode or aiokafka private name, in one place, checked when this module is imported.

The gate leans on a few things Faust does not expose. Each is here, with the reason and the test that
found it; nothing else in the project touches a private name of these libraries, except
`aml_app.kafka.metadata` (a metadata request that creates no topic), kept apart so that readers of
offsets need not import Faust:

- `transport_with_fetch_wait`: Faust hard-codes its worker consumer's fetch wait (1.5 s), which a broker
  that holds fetches (Tansu) adds to every hop (`AML_FETCH_MAX_WAIT_MS`, BENCHMARKS.md), and reads
  `read_uncommitted` outside its own transactions, where the pipeline reads `read_committed`: the
  worker consumer reads `read_committed`, so no payment of an aborted transaction is decided.
- `lean_drain_messages`: Faust's consumer loop hands every record to the streams through
  `Service.wait_first`, four new tasks and an `asyncio.wait` per record, which is more than half of a
  bare Faust agent's CPU per event (BENCHMARKS.md). The same loop awaits the hand-over directly while the
  flow runs and keeps `wait_first` while it is suspended (a rebalance). It is checked against a digest of
  the Faust loop it was adapted from, so a Faust upgrade that changes that loop fails at start-up. It
  records no gaps in the commit bookkeeping: the lanes do, once the log confirms them (`record_gap`).
- `dispatch_events`: Faust's stream iteration awaits `sleep(0)` before every event and hands each one
  through two async generators; the gated agent only dispatches events to its lanes, so it takes them
  from the stream's channel itself, keeping what the iteration does for the commit and the sensors.
  Checked against digests of Faust's two iterators (`Stream._py_aiter`, `Stream._c_aiter`).
- `set_current_event`: a lane is a task of its own; a handler that writes a partitioned table needs
  Faust's "current event" there (`faust.streams._current_event`).
- `WatchedGlobalTable`: the global tables report changed keys (written here or applied from the
  changelog) so the gate's waiters wake at once; they use a single changelog partition and write it
  explicitly, so Faust never picks a partition from producer metadata it has not fetched
  (`Producer.key_partition` crashes a worker whose producer does not know the changelog topic).
- `highwaters_from_fetches`: Faust's table recovery reads each changelog up to the end ListOffsets
  reports, which some brokers (Tansu) put at the start of the last record batch + 1; the worker's
  consumer reads the end from a fetch's high watermark instead, so a recovered table lacks nothing.
- `record_gap`: the lanes tell Faust's commit bookkeeping about offsets the log confirms hold no record
  (Faust's own loop records every jump in delivered offsets as such a gap; see `lean_drain_messages`).
- `seek_in_consumer_thread`: Faust seeks aiokafka's consumer from the caller's thread while the consumer
  runs in a thread of its own; the gate's delivery repairs seek, and a seek that raced the consumer
  thread's iteration over fetched records crashed a worker.
- `seek_recovery_offsets`: Faust's table recovery seeks its changelog partitions in a task of its own
  after reading their offsets; a rebalance handled in between adds partitions with no offset yet, whose
  seek crashed the worker.
- `MEMORY_STORE`: Faust ignores a bare "memory://" store URL (an empty yarl URL is falsy).
- `partition_flags`: the delivery repairs' view of whether Faust pauses or fetches a partition.
- `subscribed_partitions`: Faust's `Consumer.topic_partitions` reads aiokafka's group coordinator's
  metadata snapshot (the partition counts the group rebalances on): the event-time gate distrusts a
  cut that covers fewer partitions than the worker's consumer sees.
- `keep_in_metadata`, `wait_for_topic`: keep the topics the worker writes in its producer's metadata
  (aiokafka drops a topic it does not track, and sends to it then hang), and wait for a topic's metadata.
- `BackToBackTimers`: mode's Timer warns each time a timer's run outlasts its interval (logger
  `mode.timers`); the gate's fast timers run back to back under load by design, so theirs are dropped.
- `PromptStopWorker`: mode's worker sleeps a fixed second (`Worker._sentinel_task`) before closing the
  event loop at every stop, for the tasks it has just cancelled; this one waits for those tasks, at
  most that second, so a SIGTERM'd worker exits as soon as they are done.

Importing this module checks that each name still exists and raises `IncompatibleFaust`, one sentence
naming the versions it was built for, so an upgrade fails at start-up instead of in the middle of the
night. `missing_names()` is what the check and its unit test use.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import weakref
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import Any

import aiokafka
import faust
import faust.streams
import mode
from aiokafka.consumer.group_coordinator import BaseCoordinator
from faust.tables.base import Collection
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP, AppT, EventT, StreamT, TransportT

from aml_app.kafka.log_ends import fetched_log_ends

BUILT_FOR = {"faust-streaming": "0.15.3", "aiokafka": "0.14.0", "mode-streaming": "0.7.1"}

#: (owner, name, how to look): "attr" = an attribute of the module or class; "annotation" = declared
#: on the class (an instance attribute); "source:<function>" = assigned or read in that function.
REQUIRED: list[tuple[Any, str, str]] = [
    (faust.streams, "_current_event", "attr"),
    (faust.App, "_new_transport", "attr"),
    (faust_aiokafka.AIOKafkaConsumerThread, "_create_worker_consumer", "attr"),
    (faust_aiokafka.Consumer, "_new_consumer_thread", "attr"),
    (faust_aiokafka.AIOKafkaConsumerThread, "_highwaters", "attr"),
    (faust_aiokafka.AIOKafkaConsumerThread, "_seek_wait", "attr"),
    (aiokafka.AIOKafkaConsumer, "_fetch_max_wait_ms", "source:__init__"),
    (aiokafka.AIOKafkaConsumer, "_fetch_max_wait_ms", "source:start"),
    (aiokafka.AIOKafkaConsumer, "_isolation_level", "source:start"),
    (Collection, "_to_key", "attr"),
    (faust_consumer.Consumer, "_paused_partitions", "annotation"),
    (faust_consumer.Consumer, "_active_partitions", "annotation"),
    (faust_aiokafka.Producer, "_ensure_producer", "attr"),
    (faust_consumer, "CONSUMER_FETCHING", "attr"),
    (faust_consumer.Consumer, "_drain_messages", "attr"),
    (faust_consumer.ThreadDelegateConsumer, "_seek", "attr"),
    (faust_consumer.ThreadDelegateConsumer, "_thread", "annotation"),
    (faust_consumer.Consumer, "_seek", "source:seek"),
    (faust_consumer.Consumer, "_read_offset", "annotation"),
    (faust_consumer.Consumer, "suspend_flow", "annotation"),
    (faust_consumer.Consumer, "_commit_every", "source:__init__"),
    (faust_consumer.Consumer, "_n_acked", "annotation"),
    (faust_consumer.Consumer, "_add_gap", "attr"),
    (faust.streams.Stream, "_on_message_in", "source:__init__"),
    (faust.streams.Stream, "_on_stream_event_in", "source:__init__"),
    (faust.streams.Stream, "_channel_stop_iteration", "attr"),
    (mode.Worker, "_sentinel_task", "source:_shutdown_loop"),
    (BaseCoordinator, "_metadata_snapshot", "source:__init__"),
    (faust_aiokafka.AIOKafkaConsumerThread, "topic_partitions", "attr"),
]

#: sha256 of the source of Faust's `Consumer._drain_messages` that `lean_drain_messages` adapts.
DRAIN_MESSAGES_DIGEST = "44a2500309e83c630493f6828af50166ec8d96a0b3e4fb2bab735f704ae93417"
#: sha256 of the sources of Faust's stream iterators (`Stream._py_aiter`, `Stream._c_aiter`, which drives
#: the Cython `StreamIterator`) that `dispatch_events` stands in for.
STREAM_ITERATION_DIGESTS = (
    "3a48ee257a65435b482d51edb74f2993a67867949b1ef89b49fea893769e0614",
    "fa44582a5882e9df5240199eabc475668bcd3c13b1816c45805dc746145b80bf",
)


class IncompatibleFaust(ImportError):
    """The installed Faust or aiokafka lacks a private name this project relies on."""

    #: The CLI prints this error as one line instead of a traceback.
    one_line = True


def _present(owner: Any, name: str, how: str) -> bool:
    if how == "attr":
        return hasattr(owner, name)
    if how == "annotation":
        return any(name in getattr(cls, "__annotations__", {}) for cls in inspect.getmro(owner))
    function = getattr(owner, how.removeprefix("source:"), None)
    try:
        return function is not None and f"self.{name}" in inspect.getsource(function)
    except (OSError, TypeError):
        return False


def _label(owner: Any, name: str) -> str:
    if inspect.ismodule(owner):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def source_digest(function: Any) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def missing_names(
    required: Iterable[tuple[Any, str, str]] = REQUIRED,
    drain_digest: str = DRAIN_MESSAGES_DIGEST,
    iteration_digests: tuple[str, str] = STREAM_ITERATION_DIGESTS,
) -> list[str]:
    """The private names that are not where this module expects them (or changed under us)."""
    missing = []
    drain = getattr(faust_consumer.Consumer, "_drain_messages", None)
    if drain is not None and source_digest(drain) != drain_digest:
        missing.append("the Consumer._drain_messages loop that lean_drain_messages adapts (it changed)")
    iterators = [getattr(faust.streams.Stream, name, None) for name in ("_py_aiter", "_c_aiter")]
    if None in iterators or tuple(source_digest(it) for it in iterators) != iteration_digests:
        missing.append("the Stream iteration that dispatch_events stands in for (it changed)")
    for owner, name, how in required:
        if not _present(owner, name, how):
            label = _label(owner, name)
            if label not in missing:
                missing.append(label)
    return missing


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def incompatibility(missing: list[str]) -> str:
    """The one sentence an operator sees."""
    built = " and ".join(f"{p} {v}" for p, v in BUILT_FOR.items())
    installed = " and ".join(f"{p} {_version(p)}" for p in BUILT_FOR)
    return (
        f"aml-app was built for {built}, but the installed {installed} lacks {', '.join(missing)}: "
        f"install the versions pinned in pyproject.toml, or port aml_app/faust_internals.py"
    )


def check(required: Iterable[tuple[Any, str, str]] = REQUIRED) -> None:
    missing = missing_names(required)
    if missing:
        raise IncompatibleFaust(incompatibility(missing))


check()


# --- the consumer's fetch wait -------------------------------------------------------------------


def transport_with_fetch_wait(fetch_max_wait_ms: int) -> type[faust_aiokafka.Transport]:
    """Faust's aiokafka transport whose worker consumer waits at most `fetch_max_wait_ms` per fetch."""

    class TunedConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
        def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
            consumer = super()._create_worker_consumer(transport)
            # aiokafka reads these when the consumer starts, which is after this call.
            consumer._fetch_max_wait_ms = fetch_max_wait_ms
            # Faust reads read_uncommitted outside its own transactions: a payment of an aborted
            # transaction, which the pipeline (librdkafka, read_committed) never applies, was decided.
            consumer._isolation_level = "read_committed"
            return consumer

        async def _highwaters(self, partitions: list[TP]) -> Mapping[TP, int]:
            return await highwaters_from_fetches(self, await super()._highwaters(partitions))

        _seek_wait = seek_recovery_offsets

    class TunedConsumer(faust_aiokafka.Consumer):
        Thread = TunedConsumerThread

        def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
            return self.Thread(self, loop=self.loop, beacon=self.beacon)

        _drain_messages = lean_drain_messages
        _seek = seek_in_consumer_thread

    class TunedTransport(faust_aiokafka.Transport):
        Consumer = TunedConsumer

    return TunedTransport


async def highwaters_from_fetches(thread: Any, reported: Mapping[TP, int]) -> Mapping[TP, int]:
    """The changelog ends Faust's table recovery reads up to, as fetches report them.

    Faust asks ListOffsets, which some brokers answer with the start of a partition's last record batch
    + 1 (Tansu: nine records, end 7): a recovered table then lacked its changelog's newest records, and
    `alerts-sent` so forgot alerts sent just before a rebalance, which the next owner sent again. Inside
    a transaction Faust reads last stable offsets, which are kept as they are."""
    if thread.consumer.in_transaction:
        return reported
    conf = thread.app.conf
    client = {
        "bootstrap_servers": faust_aiokafka.server_list(thread.transport.url, thread.transport.default_port),
        "request_timeout_ms": int(conf.broker_request_timeout * 1000),
        **faust_aiokafka.credentials_to_aiokafka_auth(conf.broker_credentials, conf.ssl_context),
    }
    return await fetched_log_ends(client, reported)


async def lean_drain_messages(self: Any, fetcher: Any) -> None:
    """Faust's `Consumer._drain_messages` (faust-streaming 0.15.3) with two changes.

    It hands each record over with a plain `await` while the flow runs instead of `wait_first` (four
    tasks and an `asyncio.wait` per record). While the flow is suspended (a rebalance) it waits as Faust
    does, so a hand-over that blocks then is abandoned as before. A hand-over blocks only on a full stream
    buffer or while Faust re-indexes its subscriptions; the gated agent empties its buffer without waiting
    (aml_app.gate.consumer), and a stopping fetcher cancels this loop either way.

    It records no gaps. Faust records every jump in delivered offsets as a gap it may commit over, the
    offset that jumped included, although the offsets in between may exist and come later (a seek back,
    a hole the lanes fetch again). Those offsets are then acked as well, and Faust's commit, which takes
    the first run of consecutive offsets of a sorted list that now holds them twice, advances about one
    offset per commit: a worker's committed offset fell thousands behind after a rebalance, and without
    the doubles it would commit over payments not yet processed. The lanes record a gap only when the
    log confirms that no record lies in it (`record_gap`)."""
    callback = self.callback
    getmany = self.getmany
    consumer_should_stop = self._stopped.is_set
    fetcher_should_stop = fetcher._stopped.is_set
    get_read_offset = self._read_offset.__getitem__
    set_read_offset = self._read_offset.__setitem__
    flag_consumer_fetching = faust_consumer.CONSUMER_FETCHING
    set_flag = self.diag.set_flag
    unset_flag = self.diag.unset_flag
    commit_every = self._commit_every
    flow_suspended = self.suspend_flow.is_set
    yield_every = 100
    num_since_yield = 0
    sleep = asyncio.sleep
    try:
        while not (consumer_should_stop() or fetcher_should_stop()):
            set_flag(flag_consumer_fetching)
            ait = getmany(timeout=1.0)
            await self.sleep(0)  # as Faust: getmany can return at once, in a loop
            if not self.should_stop:
                async for tp, message in ait:
                    num_since_yield += 1
                    if num_since_yield > yield_every:
                        await sleep(0)
                        num_since_yield = 0
                    offset = message.offset
                    r_offset = get_read_offset(tp)
                    if r_offset is None or offset >= r_offset:
                        if commit_every is not None and self._n_acked >= commit_every:
                            self._n_acked = 0
                            await self.commit()
                        if flow_suspended():
                            await self.wait_first(callback(message), self.suspend_flow.wait())
                        else:
                            await callback(message)
                        set_read_offset(tp, offset)
                unset_flag(flag_consumer_fetching)
    except self.consumer_stopped_errors:
        if self.transport.app.should_stop:
            return  # already stopping
        raise
    except asyncio.CancelledError:
        if self.transport.app.should_stop:
            return
        raise
    except Exception as exc:
        self.log.exception("Drain messages raised: %r", exc)
        raise
    finally:
        unset_flag(flag_consumer_fetching)


async def record_gap(app: AppT, tp: TP, first: int, last: int) -> None:
    """Tell Faust's commit bookkeeping that offsets `first`..`last` of `tp` hold no record (transaction
    markers, compaction, retention), so it may commit over them once the offset after them is acked.

    Only for offsets the log confirms are empty: Faust counts a gap's offsets as processed."""
    await app.consumer._add_gap(tp, first, last)  # type: ignore[attr-defined]


async def seek_in_consumer_thread(self: Any, partition: TP, offset: int) -> None:
    """Faust's `Consumer._seek`, run in the consumer's own thread like its other calls to aiokafka.

    Faust runs aiokafka's consumer in a thread of its own but seeks from the caller's: aiokafka's fetcher
    then drops a partition's fetched records while that thread iterates over them, and the worker dies
    of a KeyError in `Fetcher.fetched_records` (seen in the end-to-end benchmark, right after the gate
    fetched a hole again). Faust's `Consumer.seek` calls this, then moves its read offset as before."""
    await self._thread.call_thread(self._thread.seek, partition, offset)


async def seek_recovery_offsets(
    self: Any, consumer: aiokafka.AIOKafkaConsumer, partitions: Mapping[TP, int | None]
) -> None:
    """Faust's `AIOKafkaConsumerThread._seek_wait`, leaving out the partitions whose offset is None.

    Faust's table recovery reads its changelog partitions' offsets, then seeks them in a task it has just
    started, reading its offsets table again there. A rebalance handled on the event loop in between
    adds the partitions it assigns with no offset yet (None, for a store that has applied nothing) and
    starts the recovery again; Faust's seek of None raised ValueError, which crashed the worker (the chaos
    soak, as a frozen worker came back). Those partitions are seeked by the recovery the rebalance starts;
    a partition the rebalance took away stays as Faust handles it (aiokafka's IllegalStateError, which
    Faust's recovery takes for "rebalance again")."""
    known = {tp: offset for tp, offset in partitions.items() if offset is not None}
    await faust_aiokafka.AIOKafkaConsumerThread._seek_wait(self, consumer, known)


class FetchWaitApp(faust.App):
    """A Faust app whose transport is `transport_with_fetch_wait(fetch_max_wait_ms)`."""

    fetch_max_wait_ms = 1500

    def _new_transport(self) -> TransportT:
        transport = transport_with_fetch_wait(self.fetch_max_wait_ms)
        return transport(self.conf.broker_consumer, self)


# --- the agent's stream -------------------------------------------------------------------------


async def dispatch_events(
    stream: StreamT, dispatch: Callable[[EventT], None], yield_every: int = 100
) -> None:
    """Hand every event of a manual-ack `stream` to `dispatch`, as `async for event in stream.events()`
    would, without a turn of the event loop and two async generators per event.

    What Faust's iteration (faust-streaming 0.15.3, `Stream._c_aiter` and its Cython `StreamIterator`)
    does for the rest of the worker is kept: an event read in an earlier consumer generation, or while the
    flow is stopped (a rebalance), is dropped unacked as the Cython iterator drops it (whoever owns the
    partition reads it again from the committed offset); every other message is tracked as unacked, so
    Faust commits no further than the acks, and the sensors see it come in. Acks are the caller's
    (`Stream.ack`). The loop yields every `yield_every` events while a full buffer drains, so the lanes
    and the fetcher go on. Measured on a bare agent: 26 µs per event against 64 (BENCHMARKS.md).
    """
    started_by_us = await stream.maybe_start()
    app = stream.app
    channel = stream.channel
    queue = channel.queue  # type: ignore[attr-defined]  # an agent's stream reads a topic's channel
    empty, get_nowait, get = queue.empty, queue.get_nowait, channel.__anext__
    flow_active = app.flow_control.is_active
    acking_topics = app.topics.acking_topics
    track = app.consumer.unacked.add
    on_message_in = stream._on_message_in  # type: ignore[attr-defined]
    on_stream_event_in = stream._on_stream_event_in  # type: ignore[attr-defined]
    since_yield = 0
    try:
        while not stream.should_stop:
            if empty():
                since_yield = 0
                event = await get()
            else:
                event = get_nowait()
                since_yield += 1
                if since_yield >= yield_every:
                    since_yield = 0
                    await asyncio.sleep(0)
            message = event.message
            if not flow_active() or message.generation_id != app.consumer_generation_id:
                continue
            if message.topic in acking_topics and not message.tracked:
                message.tracked = True
                track(message)
                on_message_in(message.tp, message.offset, message)
            on_stream_event_in(message.tp, message.offset, stream, event)
            stream.events_total += 1  # type: ignore[attr-defined]  # a Stream's; StreamT does not declare it
            dispatch(event)
    except StopAsyncIteration:
        return  # as Faust: a stream over a finite iterable has ended
    finally:
        stream._channel_stop_iteration(channel)  # type: ignore[attr-defined]
        if started_by_us:
            await stream.stop()
            stream.service_reset()


# --- the current event of a lane -----------------------------------------------------------------


def set_current_event(event: EventT) -> None:
    """Make `event` Faust's current event in this task (each lane is a task with its own context)."""
    faust.streams._current_event.set(weakref.ref(event))


# --- global tables -------------------------------------------------------------------------------

#: An in-memory table store; Faust ignores a bare "memory://" (an empty yarl URL is falsy).
MEMORY_STORE = "memory://localhost/"


class WatchedGlobalTable(faust.GlobalTable):
    """A single-partition GlobalTable that reports changed keys, written here or applied from its
    changelog, and writes its changelog's one partition explicitly."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.partitions != 1:
            raise ValueError("a WatchedGlobalTable has exactly one changelog partition")
        self.watchers: list[Callable[[list[Any]], None]] = []

    def partition_for_key(self, key: Any) -> int | None:
        # With None, Faust asks the producer's metadata for the partition synchronously
        # (`Producer.key_partition`), which crashes while the producer does not know the topic yet.
        # Partition 0 goes through aiokafka's send, which awaits the topic's metadata.
        return 0

    def _changed(self, keys: Iterable[Any]) -> None:
        keys = list(keys)
        for watcher in self.watchers:
            watcher(keys)

    def on_key_set(self, key: Any, value: Any) -> None:
        super().on_key_set(key, value)
        self._changed([key])

    def apply_changelog_batch(self, batch: Iterable[EventT]) -> None:
        batch = list(batch)
        super().apply_changelog_batch(batch)
        self._changed(self._to_key(event.key) for event in batch)


# --- the worker's stop ---------------------------------------------------------------------------

#: The longest the last step of a worker's stop waits for its cancelled tasks (mode's fixed sleep).
SENTINEL_WAIT = 1.0


class PromptStopWorker(faust.Worker):
    """Faust's worker, ending its stop as soon as the tasks it cancelled are done.

    mode's `Worker._shutdown_loop` cancels every task left, then runs `_sentinel_task`, a fixed
    `sleep(1.0)` that gives them a moment before the loop closes: a second added to every stop (a
    rolling restart, a scale-down, a SIGTERM). Here the sentinel waits for exactly those tasks, up to
    the same second."""

    async def _sentinel_task(self) -> None:
        current = asyncio.current_task()
        others = [task for task in asyncio.all_tasks() if task is not current]
        if others:
            await asyncio.wait(others, timeout=SENTINEL_WAIT)


# --- producer metadata ---------------------------------------------------------------------------


def keep_in_metadata(app: AppT, topics: Iterable[str]) -> None:
    """Make the app's producer track `topics` in its metadata from now on (it refreshes in the background).

    aiokafka refreshes only the topics it tracks once it tracks any, and a send to a topic it knows from
    its first, full refresh does not track it: after the first send to a topic it did not know (a table's
    changelog), such a topic silently drops out of its metadata. Its partitions then have no leader, the
    sender waits for a metadata update that never brings them back, and every send to it hangs (without
    this, a probe worker stops after about 400 decisions of a backlog, every time).
    """
    client = app.producer._ensure_producer().client  # type: ignore[attr-defined]
    for topic in topics:
        client.add_topic(topic)


async def wait_for_topic(app: AppT, topic: str) -> None:
    """Return once the app's producer has `topic`'s metadata, and keep the topic in its metadata."""
    keep_in_metadata(app, [topic])
    await app.producer._ensure_producer().partitions_for(topic)  # type: ignore[attr-defined]


# --- the delivery repairs ------------------------------------------------------------------------


def partition_flags(app: AppT, tp: TP) -> tuple[bool, bool | None]:
    """(paused in Faust, fetched by Faust; None when unknown) for the delivery checks' view."""
    consumer = app.consumer
    paused = tp in getattr(consumer, "_paused_partitions", set())
    active = getattr(consumer, "_active_partitions", None)
    return paused, None if active is None else tp in active


def subscribed_partitions(app: AppT, topic: str) -> int:
    """How many partitions of `topic` the worker's consumer saw at its last metadata refresh (0: not
    started, or not subscribed to it)."""
    try:
        return app.consumer.topic_partitions(topic) or 0
    except AttributeError:  # a consumer thread or group coordinator not made yet
        return 0


# --- mode's warning for a timer that overlaps ---------------------------------------------------

#: What mode's Timer logs (logger `mode.timers`, WARNING) each time a run outlasts its interval
#: (`mode.timers.Timer`; tests/unit/test_faust_internals.py checks the text is still mode's).
TIMER_OVERLAPPING = "Timer %s is overlapping (interval=%r runtime=%r)"


class BackToBackTimers(logging.Filter):
    """Drops mode's overlap warning for the timers named (mode names a timer by its function's qualified
    name). The gate's refresh and demand run every `AML_FAST_REFRESH_INTERVAL` while a payment waits,
    an interval that is a floor, not a deadline: under load they run back to back, which the refresh's
    duration shows (`aml_admin_refresh_seconds`); a warning for each run was four lines in ten of a
    worker's log at 300 payments/s."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__()
        self.names = frozenset(names)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (
            record.msg == TIMER_OVERLAPPING
            and isinstance(args, tuple)
            and bool(args)
            and args[0] in self.names
        )


def quiet_back_to_back(*names: str) -> None:
    """Install `BackToBackTimers` for `names` on mode's timer logger (once per set of names)."""
    timers = logging.getLogger("mode.timers")
    if not any(isinstance(f, BackToBackTimers) and f.names == frozenset(names) for f in timers.filters):
        timers.addFilter(BackToBackTimers(names))
