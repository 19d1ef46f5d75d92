"""The one module that touches Faust's and aiokafka's private names checks them at import."""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
import threading
import types
from typing import Any

import mode
import pytest
from faust.transport.consumer import Consumer as FaustConsumer
from faust.types import TP
from intervaltree import IntervalTree

from aml_app import faust_internals
from aml_app.faust_internals import (
    SENTINEL_WAIT,
    IncompatibleFaust,
    PromptStopWorker,
    check,
    dispatch_events,
    incompatibility,
    lean_drain_messages,
    missing_names,
    seek_in_consumer_thread,
    transport_with_fetch_wait,
)
from aml_app.gate.delivery import generation_starts


def test_every_private_name_is_there_in_the_pinned_versions() -> None:
    assert missing_names() == []
    assert faust_internals.BUILT_FOR == {
        "faust-streaming": "0.15.3",
        "aiokafka": "0.14.0",
        "mode-streaming": "0.7.1",
    }


def test_a_missing_name_is_one_sentence_naming_the_versions_it_was_built_for() -> None:
    module = types.ModuleType("faust.fake")

    class Consumer:
        _paused: set[int]

        def __init__(self) -> None:
            self._kept = 1

    required = [
        (module, "_current_event", "attr"),
        (Consumer, "_paused", "annotation"),
        (Consumer, "_active", "annotation"),
        (Consumer, "_kept", "source:__init__"),
        (Consumer, "_gone", "source:__init__"),
    ]
    assert missing_names(required) == [
        "faust.fake._current_event",
        f"{__name__}.test_a_missing_name_is_one_sentence_naming_the_versions_it_was_built_for."
        "<locals>.Consumer._active",
        f"{__name__}.test_a_missing_name_is_one_sentence_naming_the_versions_it_was_built_for."
        "<locals>.Consumer._gone",
    ]
    with pytest.raises(IncompatibleFaust) as raised:
        check(required)
    sentence = str(raised.value)
    assert "\n" not in sentence
    assert sentence.startswith(
        "aml-app was built for faust-streaming 0.15.3 and aiokafka 0.14.0 and mode-streaming 0.7.1, but "
    )
    assert "faust.fake._current_event" in sentence and "pyproject.toml" in sentence
    assert incompatibility(["x"]).count(".") >= 1


def test_the_worker_refuses_to_start_with_one_line_when_a_name_is_gone() -> None:
    """As after a Faust upgrade that renamed a private name: `aml-app worker` stops at once."""
    script = (
        "import sys, faust.streams\n"
        "del faust.streams._current_event\n"
        "sys.argv = ['aml-app', 'worker']\n"
        "from aml_app.cli import main\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("aml-app was built for faust-streaming 0.15.3")
    assert "faust.streams._current_event" in lines[0]


def test_a_changed_drain_loop_in_faust_is_reported() -> None:
    """`lean_drain_messages` adapts one version of Faust's loop; another version must not run silently."""
    assert faust_internals.transport_with_fetch_wait(100).Consumer._drain_messages is lean_drain_messages
    assert missing_names([], drain_digest="0" * 64) == [
        "the Consumer._drain_messages loop that lean_drain_messages adapts (it changed)"
    ]


def test_a_changed_stream_iteration_in_faust_is_reported() -> None:
    """`dispatch_events` stands in for one version of Faust's stream iteration; not for another."""
    assert missing_names([], iteration_digests=("0" * 64, "0" * 64)) == [
        "the Stream iteration that dispatch_events stands in for (it changed)"
    ]


class FakeFlag:
    def __init__(self, value: bool = False) -> None:
        self.value = value

    def is_set(self) -> bool:
        return self.value

    async def wait(self) -> None:
        await asyncio.Event().wait()


class FakeConsumer:
    """Just what the drain loop reads of Faust's consumer, fetching `batches` then stopping."""

    consumer_stopped_errors = ()

    def __init__(self, batches: list[list[tuple[str, int]]], suspended: bool) -> None:
        self.batches = batches
        self.handed: list[tuple[str, int]] = []
        self.waited_first = 0
        self._stopped = FakeFlag()
        self.suspend_flow = FakeFlag(suspended)
        self._read_offset: dict[str, int | None] = collections.defaultdict(lambda: None)
        self.diag = types.SimpleNamespace(set_flag=lambda flag: None, unset_flag=lambda flag: None)
        self._commit_every = None
        self.app = types.SimpleNamespace(topics=types.SimpleNamespace(acks_enabled_for=lambda topic: False))
        self.should_stop = False

    async def callback(self, message: types.SimpleNamespace) -> None:
        self.handed.append((message.topic, message.offset))

    async def getmany(self, timeout: float):  # type: ignore[no-untyped-def]
        batch = self.batches.pop(0)
        if not self.batches:
            self._stopped.value = True
        for topic, offset in batch:
            yield topic, types.SimpleNamespace(topic=topic, offset=offset)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_first(self, *coros: Any) -> None:
        self.waited_first += 1
        await coros[0]
        coros[1].close()


@pytest.mark.parametrize("suspended", [False, True])
async def test_the_lean_drain_loop_hands_over_every_new_record_once_in_order(suspended: bool) -> None:
    """Every fetched record at or past the last read offset of its partition is handed over, in order
    (an older one fetched again is dropped, as in Faust); `wait_first` only while the flow is suspended."""
    consumer = FakeConsumer([[("t", 0), ("t", 1)], [("t", 0), ("t", 2), ("u", 0)]], suspended)
    fetcher = types.SimpleNamespace(_stopped=FakeFlag())
    await asyncio.wait_for(lean_drain_messages(consumer, fetcher), 5)
    assert consumer.handed == [("t", 0), ("t", 1), ("t", 2), ("u", 0)]
    assert consumer._read_offset == {"t": 2, "u": 0}
    assert consumer.waited_first == (4 if suspended else 0)


class BookkeepingConsumer(FakeConsumer):
    """The drain loop's view of a consumer on an acked topic, with Faust's own commit bookkeeping
    (`_add_gap`, `_new_offset`) bound to it; `seek_before` maps a batch index to a seek done first."""

    def __init__(self, batches: list[list[tuple[str, int]]], seek_before: dict[int, int]) -> None:
        super().__init__(batches, suspended=False)
        self.app = types.SimpleNamespace(topics=types.SimpleNamespace(acks_enabled_for=lambda topic: True))
        self._gap: dict[str, IntervalTree] = collections.defaultdict(IntervalTree)
        self._acked: dict[str, list[int]] = collections.defaultdict(list)
        self._acked_index: dict[str, set[int]] = collections.defaultdict(set)
        self._committed_offset: dict[str, int | None] = collections.defaultdict(lambda: None)
        self.seek_before = seek_before
        self.fetched = 0

    _add_gap = FaustConsumer._add_gap
    _new_offset = FaustConsumer._new_offset

    async def getmany(self, timeout: float):  # type: ignore[no-untyped-def]
        if self.fetched in self.seek_before:
            self._read_offset["t"] = self.seek_before[self.fetched]  # what Faust's `seek` sets
        self.fetched += 1
        async for item in super().getmany(timeout):
            yield item

    def ack_in_order(self, tp: str) -> None:
        """What Faust's `ack` records for each handed-over offset (the lanes ack in offset order)."""
        for _, offset in self.handed:
            if offset not in self._acked_index[tp]:
                self._acked_index[tp].add(offset)
                self._acked[tp].append(offset)


async def test_a_jump_in_delivered_offsets_that_is_fetched_again_commits_in_one_step() -> None:
    """Offsets 10..19 are skipped (20 is delivered after 9), fetched again after a seek back to 10, and
    every offset up to 25 is acked in order: one commit reaches 26. Faust's own loop records 10..20 as a
    gap on the jump; with those offsets acked as well, each commit advanced one offset (11, 12, ...)."""
    batches = [[("t", o) for o in range(10)] + [("t", 20)], [("t", o) for o in range(10, 26)]]
    consumer = BookkeepingConsumer(batches, seek_before={1: 10})
    await asyncio.wait_for(lean_drain_messages(consumer, types.SimpleNamespace(_stopped=FakeFlag())), 5)
    assert [o for _, o in consumer.handed] == [*range(10), 20, *range(10, 26)]
    consumer.ack_in_order("t")
    assert consumer._new_offset("t") == 26
    assert not consumer._gap["t"], "no gap recorded: offsets 10..19 exist"


async def test_records_deleted_by_retention_past_our_commit_do_not_stop_our_commits() -> None:
    """Our group committed 5 on partition 0, and retention moved the log start to 12: the consumer starts
    at 12 and 5..11 are never acked. They are a gap of the generation, and the first commit after 12..15
    are acked reaches 16; without the gap Faust's bookkeeping never commits again (it waits for 5)."""
    tps = [TP("t", 0), TP("t", 1), TP("t", 2)]
    starts, deleted = generation_starts(
        tps, committed={0: 5, 1: None, 2: 20}, earliest={tps[0]: 12, tps[1]: 3, tps[2]: 10}
    )
    assert starts == {0: 12, 1: 3, 2: 20}
    assert deleted == [(tps[0], 5, 11)]

    consumer = BookkeepingConsumer([], seek_before={})
    consumer._committed_offset["t"] = 5
    for _, first, last in deleted:
        await consumer._add_gap("t", first, last)
    consumer.handed = [("t", o) for o in range(12, 16)]
    consumer.ack_in_order("t")
    assert consumer._new_offset("t") == 16


class FakeQueue(collections.deque):  # type: ignore[type-arg]
    def empty(self) -> bool:
        return not self

    def get_nowait(self) -> Any:
        return self.popleft()


class FakeStream:
    """Just what `dispatch_events` reads of a Faust stream over a topic's channel; `stop_flow_once` makes
    the flow look stopped for the next event only (a rebalance that began and ended)."""

    def __init__(self, events: list[Any], generation: int) -> None:
        self.should_stop = False
        self.events_total = 0
        self.stopped_iteration = False
        self.stop_flow_once = False
        self.unacked: list[Any] = []
        self.sensed: list[int] = []
        self.channel = types.SimpleNamespace(queue=FakeQueue(events), __anext__=self._past_the_end)
        self.app = types.SimpleNamespace(
            flow_control=types.SimpleNamespace(is_active=self._flow_active),
            topics=types.SimpleNamespace(acking_topics={"payments"}),
            consumer=types.SimpleNamespace(unacked=types.SimpleNamespace(add=self.unacked.append)),
            consumer_generation_id=generation,
        )
        self._on_message_in = lambda tp, offset, message: None
        self._on_stream_event_in = lambda tp, offset, stream, event: self.sensed.append(offset)

    def _flow_active(self) -> bool:
        stopped, self.stop_flow_once = self.stop_flow_once, False
        return not stopped

    async def _past_the_end(self) -> Any:
        raise AssertionError("read past the queued events")

    async def maybe_start(self) -> bool:
        return False

    def _channel_stop_iteration(self, channel: Any) -> None:
        self.stopped_iteration = True


def fake_event(offset: int, generation: int) -> Any:
    message = types.SimpleNamespace(
        topic="payments", tp=("payments", 0), offset=offset, generation_id=generation, tracked=False
    )
    return types.SimpleNamespace(message=message)


async def test_dispatch_events_hands_over_this_generations_events_in_order_and_tracks_them() -> None:
    """An event of an earlier generation, or one read while the flow is stopped, is dropped, untracked;
    every other is tracked as unacked (Faust commits no further than the acks), sensed and dispatched,
    in order; a long drain lets other tasks run."""
    events = [fake_event(0, 1)] + [fake_event(o, 2) for o in range(1, 301)]
    stream = FakeStream(events, generation=2)
    dispatched: list[int] = []
    turns = 0

    turns_while_draining = 0

    def dispatch(event: Any) -> None:
        nonlocal turns, turns_while_draining
        dispatched.append(event.message.offset)
        if event.message.offset == 1:
            turns = 0
        elif event.message.offset == 150:
            stream.stop_flow_once = True
        elif event.message.offset == 300:
            turns_while_draining = turns
            stream.should_stop = True

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.ensure_future(other_task())
    await asyncio.wait_for(dispatch_events(stream, dispatch, yield_every=100), 5)  # type: ignore[arg-type]
    other.cancel()
    kept = [o for o in range(1, 301) if o != 151]
    assert dispatched == kept
    assert stream.sensed == kept and stream.events_total == len(kept)
    assert sorted(m.offset for m in stream.unacked) == kept
    assert not events[0].message.tracked and not events[151].message.tracked
    assert turns_while_draining >= 2, "the drain did not let other tasks run"
    assert stream.stopped_iteration


class FakeConsumerThread:
    """Like Faust's consumer thread: an event loop in a thread of its own, where `call_thread` runs."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.seeks: list[tuple[str, int, int]] = []

    async def call_thread(self, method: Any, *args: Any) -> Any:
        async def call() -> Any:
            return method(*args)

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), self.loop))

    def seek(self, partition: str, offset: int) -> None:
        self.seeks.append((partition, offset, threading.get_ident()))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def test_the_worker_consumer_seeks_in_the_consumer_thread() -> None:
    """aiokafka's consumer is not thread-safe: a seek from the event loop's thread raced the consumer
    thread's iteration over fetched records and crashed a worker (KeyError in `fetched_records`)."""
    consumer_class = transport_with_fetch_wait(100).Consumer
    assert consumer_class._seek is seek_in_consumer_thread
    thread = FakeConsumerThread()
    try:
        await asyncio.wait_for(seek_in_consumer_thread(types.SimpleNamespace(_thread=thread), "tp", 7), 5)
    finally:
        thread.stop()
    assert thread.seeks == [("tp", 7, thread.thread.ident)]
    assert thread.thread.ident != threading.get_ident()


def stop_with_sentinel(sentinel: Any, task_body: Any) -> tuple[list[str], bool]:
    """The end of mode's `Worker._shutdown_loop` on a loop of its own: a task is running, the worker
    cancels it and runs `sentinel` to completion. Returns what the task did and whether a callback due
    half of mode's fixed second after the cancel had fired by the time the sentinel returned."""
    loop = asyncio.new_event_loop()
    steps: list[str] = []
    try:
        task = loop.create_task(task_body(steps))
        loop.run_until_complete(asyncio.sleep(0))  # the task is running
        task.cancel()
        fired: list[bool] = []
        loop.call_later(SENTINEL_WAIT / 2, fired.append, True)
        loop.run_until_complete(loop.create_task(sentinel()))
        return steps, bool(fired)
    finally:
        loop.close()


async def cleans_up_over_a_few_iterations(steps: list[str]) -> None:
    try:
        await asyncio.sleep(60)
    finally:
        for _ in range(3):
            await asyncio.sleep(0)
        steps.append("cleaned up")


def test_a_stopping_worker_waits_for_its_cancelled_tasks_and_not_a_fixed_second() -> None:
    """mode's sentinel sleeps 1 s at every stop; the worker's waits for the tasks it cancelled. Negative
    control: mode's own sentinel lets the half-second callback fire first."""
    worker = object.__new__(PromptStopWorker)
    ours = stop_with_sentinel(worker._sentinel_task, cleans_up_over_a_few_iterations)
    assert ours == (["cleaned up"], False)

    mode_worker = object.__new__(mode.Worker)
    modes = stop_with_sentinel(mode_worker._sentinel_task, cleans_up_over_a_few_iterations)
    assert modes == (["cleaned up"], True)


def test_a_task_that_ignores_its_cancel_holds_a_stop_for_at_most_mode_s_second() -> None:
    async def stubborn(steps: list[str]) -> None:
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                steps.append("ignored a cancel")

    worker = object.__new__(PromptStopWorker)
    assert stop_with_sentinel(worker._sentinel_task, stubborn) == (["ignored a cancel"], True)


def test_the_app_starts_its_workers_with_the_prompt_stop() -> None:
    from aml_app.app import app

    assert app.conf.Worker is PromptStopWorker


def test_the_overlap_warning_dropped_for_the_fast_timers_is_still_modes() -> None:
    import inspect

    import mode.timers

    assert faust_internals.TIMER_OVERLAPPING in inspect.getsource(mode.timers)


async def test_the_worker_consumer_reads_committed_payments_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Faust reads read_uncommitted outside its own transactions, the pipeline read_committed: a worker
    decided the payments of aborted transactions, which B and C never apply (the embedded broker hands
    them to read_committed readers too, so only the setting can be checked here)."""
    from aiokafka import AIOKafkaConsumer
    from faust.transport.drivers import aiokafka as faust_aiokafka

    made = AIOKafkaConsumer()
    monkeypatch.setattr(
        faust_aiokafka.AIOKafkaConsumerThread, "_create_worker_consumer", lambda self, transport: made
    )
    thread_class = transport_with_fetch_wait(100).Consumer.Thread
    consumer = thread_class._create_worker_consumer(object.__new__(thread_class), None)
    assert consumer is made and consumer._isolation_level == "read_committed"
    assert consumer._fetch_max_wait_ms == 100
    await consumer.stop()
