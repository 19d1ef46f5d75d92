"""Answers of B and C kept for the next detector that asks the same question.

Two gated services (AML and fraud) ask every payment's questions of B and C: the same queries, each with
what it needs the store to have applied (`Need`). An API replica may answer from any snapshot that meets
the need, so an answer it gave before, from a snapshot that meets the new need too, is as good as a new
one: the freshness proof is the answer's own `as_of` and `log`, which the worker checks either way. The
cache keeps each answer's JSON text with them, least recently used first out.

The second detector often asks while the first one's answer is still being computed (B's deeper
questions take hundreds of milliseconds): a question already being computed on this replica is not
computed again; the second asker waits for that answer (`Flight`) and takes it when its snapshot meets
its own need too, else asks the store itself.

Reads without a need (the ungated comparison mode) always read the store: they want what is there now.

What is kept is of the store the replica read. A store rebuilt (`aml-app rebuild`, after a new threshold
or a topic created again) starts over from the topic's earliest offset: the replica's store check, every
two seconds, then finds it behind its last reading or of another log (`rebuilt`), as does a question
that reads another log (`saw`), and every kept answer goes. They also go when the store is found at
another schema version, and they hold at most MAX_BYTES in all.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from aml_app.dependencies.client import Need

#: Answers longer than this are not kept: a busy account's lists would push out many small answers.
MAX_TEXT = 64 * 1024
#: The most the kept answers may hold in all, counted as their text and their `as_of` (AS_OF_BYTES a
#: partition, parsed): at the default 10,000 answers of a topic of 1,000 partitions, their `as_of` alone
#: took a gigabyte.
MAX_BYTES = 64 * 1024 * 1024
AS_OF_BYTES = 100


@dataclass(frozen=True)
class Kept:
    text: str
    as_of: Mapping[int, int]
    log: str | None

    @property
    def size(self) -> int:
        return len(self.text) + AS_OF_BYTES * len(self.as_of)

    def covers(self, other: Kept) -> bool:
        """Whether this answer's snapshot is of the same log and at least as far on every partition."""
        return self.log == other.log and all(self.as_of.get(p, 0) >= o for p, o in other.as_of.items())


class Flight:
    """The answers one request is computing, for the requests that ask the same questions meanwhile."""

    def __init__(self, futures: dict[Hashable, asyncio.Future[Kept | None]]) -> None:
        self.futures = futures

    def landed(self, key: Hashable, kept: Kept | None) -> None:
        """`key`'s answer (None: none to share, such as a list cut short)."""
        future = self.futures.get(key)
        if future is not None and not future.done():
            future.set_result(kept)


class AnswerCache:
    """At most `entries` answers (0: none kept, none shared), by question."""

    def __init__(self, entries: int) -> None:
        if entries < 0:
            raise ValueError(f"entries must be at least 0, got {entries!r}")
        self.entries = entries
        self._kept: OrderedDict[Hashable, Kept] = OrderedDict()
        self._bytes = 0  # the kept answers' `Kept.size`, summed
        self.hits = 0
        self.misses = 0
        #: Questions answered with the answer another request was computing.
        self.joined = 0
        #: Key -> the answer a request is computing, and the need it computes it for (None: none).
        self._flying: dict[Hashable, tuple[asyncio.Future[Kept | None], Need | None]] = {}
        #: The newest `as_of` this replica's store showed in an answer it read, and its log: where the
        #: store is, as far as the replica knows, when it answers from what it kept.
        self.newest: tuple[str | None, dict[int, int]] | None = None
        #: Times every kept answer went, the store being another than the one they were read from.
        self.cleared = 0

    def saw(self, log: str | None, as_of: Mapping[int, int]) -> None:
        """Note where a read now shows the store. Answers read side by side show it a little apart, so
        only another log says that it is another store: then what was kept from the old one goes."""
        if self.newest is not None and self.newest[0] == log:
            newest = self.newest[1]
            self.newest = (log, {**newest, **{p: max(o, newest.get(p, 0)) for p, o in as_of.items()}})
        else:
            self.rebuilt(log, as_of)

    def rebuilt(self, log: str | None, as_of: Mapping[int, int]) -> None:
        """The store is another than the one the kept answers were read from (the store check found it
        behind its own last reading: `StoreCheck`): every kept answer goes, and the store's position
        starts over from this reading."""
        self.clear()
        self.newest = (log, dict(as_of))

    def clear(self) -> None:
        """Let every kept answer go (answers being computed still reach their waiters, who check them)."""
        if self._kept:
            self.cleared += 1
        self._kept.clear()
        self._bytes = 0

    def get(self, key: Hashable, need: Need | None) -> str | None:
        """The JSON text of the answer kept for `key` if its snapshot meets `need`, else None."""
        kept = self._kept.get(key)
        if need is None or kept is None or not need.met(kept.as_of, kept.log):
            self.misses += 1
            return None
        self._kept.move_to_end(key)
        self.hits += 1
        return kept.text

    def in_flight(self, key: Hashable, need: Need | None) -> asyncio.Future[Kept | None] | None:
        """The answer to `key` another request is computing now, for a gated read (`need`) to wait for;
        None where that request needs more than `need`: it may wait for the store to get there first,
        while the store may already answer this one."""
        if need is None or (flying := self._flying.get(key)) is None:
            return None
        future, computing_for = flying
        if future.done() or (computing_for is not None and not computing_for.met(need.as_of, need.log)):
            return None
        return future

    @contextmanager
    def flight(self, keys: Sequence[Hashable], need: Need | None = None) -> Iterator[Flight]:
        """Say that this request computes `keys` (for `need`) until the block ends; whoever waits on one
        of them then gets its answer, or None if the block ended without one (an error, a "not yet", a
        cancel)."""
        if self.entries == 0:
            yield Flight({})
            return
        loop = asyncio.get_running_loop()
        futures: dict[Hashable, asyncio.Future[Kept | None]] = {}
        for key in keys:
            if key not in self._flying:
                futures[key] = loop.create_future()
                self._flying[key] = futures[key], need
        try:
            yield Flight(futures)
        finally:
            for key, future in futures.items():
                if not future.done():
                    future.set_result(None)
                if self._flying.get(key, (None, None))[0] is future:
                    del self._flying[key]

    def shared(self, kept: Kept | None, need: Need) -> str | None:
        """The text of an answer another request computed, if its snapshot meets `need`."""
        if kept is None or not need.met(kept.as_of, kept.log):
            return None
        self.joined += 1
        self.misses -= 1  # counted as a miss when it was looked up
        return kept.text

    def put(self, key: Hashable, text: str, answer: Mapping[str, Any], keep: bool = True) -> Kept | None:
        """Note where `answer`, read from the store now, shows the store; and unless not `keep`, keep it
        (as `text`) for `key`, with the `as_of` and `log` it states. The answer as kept, to share with
        requests waiting on it (None: not to be shared)."""
        raw = answer.get("as_of")
        if not isinstance(raw, Mapping):
            return None
        as_of, log = {int(p): int(o) for p, o in raw.items()}, answer.get("log")
        self.saw(log, as_of)
        if not keep or self.entries == 0:
            return None
        kept = Kept(text, as_of, log)
        before = self._kept.get(key)
        if len(text) <= MAX_TEXT and not (before is not None and before.covers(kept) and before != kept):
            # (a slower request's older snapshot does not replace a newer answer to the same question)
            if before is not None:
                self._bytes -= before.size
            self._kept[key] = kept
            self._bytes += kept.size
            self._kept.move_to_end(key)
            while len(self._kept) > self.entries or self._bytes > MAX_BYTES:
                _, gone = self._kept.popitem(last=False)
                self._bytes -= gone.size
        return kept

    def lookup(self, keys: Sequence[Hashable], need: Need | None) -> list[str | None]:
        return [self.get(key, need) for key in keys]

    def as_json(self) -> dict[str, int]:
        return {
            "entries": len(self._kept),
            "capacity": self.entries,
            "hits": self.hits,
            "misses": self.misses,
            "joined": self.joined,
            "cleared": self.cleared,
        }
