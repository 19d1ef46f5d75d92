"""Answers of B and C kept for the next detector that asks the same question.

Two gated services (AML and fraud) ask every payment's questions of B and C: the same queries, each with
what it needs the store to have applied (`Need`). An API replica may answer from any snapshot that meets
the need, so an answer it gave before, from a snapshot that meets the new need too, is as good as a new
one: the freshness proof is the answer's own `as_of` and `log`, which the worker checks either way. The
cache keeps each answer's JSON text with them, least recently used first out.

Reads without a need (the ungated comparison mode) always read the store: they want what is there now.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aml_app.dependencies.client import Need

#: Answers longer than this are not kept: a busy account's lists would push out many small answers.
MAX_TEXT = 64 * 1024


@dataclass(frozen=True)
class Kept:
    text: str
    as_of: Mapping[int, int]
    log: str | None


class AnswerCache:
    """At most `entries` answers (0: none kept), by question."""

    def __init__(self, entries: int) -> None:
        if entries < 0:
            raise ValueError(f"entries must be at least 0, got {entries!r}")
        self.entries = entries
        self._kept: OrderedDict[Hashable, Kept] = OrderedDict()
        self.hits = 0
        self.misses = 0
        #: The newest `as_of` this replica's store showed in an answer it read, and its log: where the
        #: store is, as far as the replica knows, when it answers from what it kept.
        self.newest: tuple[str | None, dict[int, int]] | None = None

    def get(self, key: Hashable, need: Need | None) -> str | None:
        """The JSON text of the answer kept for `key` if its snapshot meets `need`, else None."""
        kept = self._kept.get(key)
        if need is None or kept is None or not need.met(kept.as_of, kept.log):
            self.misses += 1
            return None
        self._kept.move_to_end(key)
        self.hits += 1
        return kept.text

    def put(self, key: Hashable, text: str, answer: Mapping[str, Any], keep: bool = True) -> None:
        """Note where `answer`, read from the store now, shows the store; and unless not `keep`, keep it
        (as `text`) for `key`, with the `as_of` and `log` it states."""
        raw = answer.get("as_of")
        if not isinstance(raw, Mapping):
            return
        as_of, log = {int(p): int(o) for p, o in raw.items()}, answer.get("log")
        if self.newest is None or self.newest[0] != log:
            self.newest = (log, as_of)
        else:
            self.newest = (log, {p: max(o, self.newest[1].get(p, 0)) for p, o in as_of.items()})
        if not keep or self.entries == 0 or len(text) > MAX_TEXT:
            return
        self._kept[key] = Kept(text, as_of, log)
        self._kept.move_to_end(key)
        while len(self._kept) > self.entries:
            self._kept.popitem(last=False)

    def lookup(self, keys: Sequence[Hashable], need: Need | None) -> list[str | None]:
        return [self.get(key, need) for key in keys]

    def as_json(self) -> dict[str, int]:
        return {
            "entries": len(self._kept),
            "capacity": self.entries,
            "hits": self.hits,
            "misses": self.misses,
        }
