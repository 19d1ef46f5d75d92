"""The API replicas' answer cache and the routing that sends a partition's questions to one replica."""

from __future__ import annotations

import asyncio
import contextlib
import json
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from aml_app.dependencies import answer_cache
from aml_app.dependencies.answer_cache import MAX_TEXT, AnswerCache
from aml_app.dependencies.api import StoreCheck, _batch_response, aggregates_app
from aml_app.dependencies.client import Need, Replicas
from aml_app.dependencies.store import StoreVersionMismatch
from aml_app.settings import load_settings


def kept(as_of: dict[int, int], log: str = "L", **more: object) -> tuple[str, dict[str, object]]:
    answer = {"as_of": {str(p): o for p, o in as_of.items()}, "log": log, **more}
    return json.dumps(answer), answer


def test_an_answer_is_served_while_its_snapshot_meets_the_need() -> None:
    cache = AnswerCache(10)
    cache.put("q", *kept({0: 5, 1: 7}))
    assert cache.get("q", Need({0: 5, 1: 7}, "L")) is not None
    assert cache.get("q", Need({0: 3}, None)) is not None
    assert cache.get("q", Need({0: 6}, "L")) is None, "a need past the kept snapshot"
    assert cache.get("q", Need({2: 1}, "L")) is None, "a partition the snapshot had not applied"
    assert cache.get("q", Need({0: 1}, "M")) is None, "another log"
    assert cache.get("q", None) is None, "an ungated read wants the store as it is"
    assert (cache.hits, cache.misses) == (2, 4)


def test_the_least_recently_used_answer_goes_first_and_nothing_is_kept_at_zero() -> None:
    cache = AnswerCache(2)
    need = Need({0: 1}, "L")
    cache.put("a", *kept({0: 1}))
    cache.put("b", *kept({0: 1}))
    assert cache.get("a", need) is not None  # "b" is now the least recently used
    cache.put("c", *kept({0: 1}))
    assert [cache.get(k, need) is not None for k in "abc"] == [True, False, True]
    none = AnswerCache(0)
    none.put("a", *kept({0: 1}))
    assert none.get("a", need) is None
    with pytest.raises(ValueError):
        AnswerCache(-1)


def test_a_long_answer_is_not_kept() -> None:
    cache = AnswerCache(10)
    cache.put("long", *kept({0: 1}, out=["x" * MAX_TEXT]))
    assert cache.get("long", Need({0: 1}, "L")) is None


def test_a_route_starts_at_its_replica_and_moves_no_turn() -> None:
    replicas = Replicas(["http://r0", "http://r1"])
    assert [str(u) for u in replicas.order(3)] == ["http://r1", "http://r0"]
    assert [str(u) for u in replicas.order(2)] == ["http://r0", "http://r1"]
    assert [str(u) for u in replicas.order()] == ["http://r0", "http://r1"], "the turn did not move"
    replicas.failed(replicas.urls[1])
    assert [str(u) for u in replicas.order(1)] == ["http://r0", "http://r1"], "a resting replica last"


def test_the_newest_as_of_read_is_where_the_store_is_as_far_as_the_replica_knows() -> None:
    cache = AnswerCache(10)
    assert cache.newest is None
    cache.put("a", *kept({0: 5, 1: 2}))
    cache.put("b", *kept({0: 3, 1: 4}), keep=False)  # read now, not kept: still shows the store
    assert cache.newest == ("L", {0: 5, 1: 4})
    assert cache.get("b", Need({0: 1}, "L")) is None
    cache.put("c", *kept({0: 1}, log="M"))  # another log: its offsets start over
    assert cache.newest == ("M", {0: 1})


class Store:
    """The seam under `_batch_response`: answers each question as `q@<as_of of partition 0>`, from the
    snapshot `at`, and holds each computation until `go` is set (a slow question of B's)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.asked: list[list[str]] = []
        self.go = asyncio.Event()
        self.started = asyncio.Event()
        self.reply: dict[str, Any] | None = None  # instead of answers: a "not yet", say
        self.fail = False

    def answer(self, keys: list[str]) -> Any:
        async def compute(todo: list[int]) -> dict[str, Any]:
            self.asked.append([keys[i] for i in todo])
            self.started.set()
            async with asyncio.timeout(10):
                await self.go.wait()
            if self.fail:
                raise RuntimeError("the store went away")
            if self.reply is not None:
                return self.reply
            return {"answers": [{"q": keys[i], "as_of": {"0": self.at}, "log": "L"} for i in todo]}

        return compute


async def respond(cache: AnswerCache, store: Store, keys: list[str], need: Need | None) -> dict[str, Any]:
    response = await _batch_response(cache, keys, need, store.answer(keys), timeout=5)
    assert isinstance(response, web.Response) and response.text is not None
    return dict(json.loads(response.text))


async def two_askers(
    cache: AnswerCache, first: Store, second: Store, need: Need | None, keys: list[str]
) -> tuple[dict[str, Any] | BaseException, dict[str, Any] | BaseException]:
    """The first asker's questions are being computed when the second asks `keys`."""
    one = asyncio.ensure_future(respond(cache, first, ["a", "b"], Need({0: 1}, "L")))
    async with asyncio.timeout(10):
        await first.started.wait()
    two = asyncio.ensure_future(respond(cache, second, keys, need))
    for _ in range(5):
        await asyncio.sleep(0)
    first.go.set()
    second.go.set()
    done = await asyncio.gather(one, two, return_exceptions=True)
    return done[0], done[1]


async def test_a_question_being_computed_is_answered_once_for_both_askers() -> None:
    cache, first, second = AnswerCache(10), Store(5), Store(6)
    one, two = await two_askers(cache, first, second, Need({0: 4}, "L"), ["b", "c"])
    assert first.asked == [["a", "b"]] and second.asked == [["c"]], "b was computed twice"
    assert isinstance(one, dict) and isinstance(two, dict)
    assert two["answers"][0] == one["answers"][1] == {"q": "b", "as_of": {"0": 5}, "log": "L"}
    assert two["kept"] == [0] and two["as_of"] == {"0": 6}, "the shared answer is not listed as kept"
    assert "kept" not in one
    assert (cache.hits, cache.joined, cache.misses) == (0, 1, 3)


async def test_an_answer_being_computed_from_a_snapshot_short_of_the_need_is_not_shared() -> None:
    cache, first, second = AnswerCache(10), Store(5), Store(9)
    _one, two = await two_askers(cache, first, second, Need({0: 8}, "L"), ["b"])
    assert first.asked == [["a", "b"]] and second.asked == [["b"]], "b was not asked again"
    assert isinstance(two, dict) and two["answers"] == [{"q": "b", "as_of": {"0": 9}, "log": "L"}]
    assert "kept" not in two and cache.joined == 0


@pytest.mark.parametrize("outcome", ["not yet", "error", "truncated"])
async def test_a_computation_that_gives_nothing_to_share_leaves_the_waiter_to_ask_itself(
    outcome: str,
) -> None:
    cache, first, second = AnswerCache(10), Store(5), Store(6)
    if outcome == "not yet":
        first.reply = {"not_yet": True, "as_of": {"0": 0}, "log": "L", "waited_ms": 1}
    elif outcome == "error":
        first.fail = True
    else:
        first.reply = {"answers": [{"q": k, "as_of": {"0": 5}, "log": "L", "truncated": True} for k in "ab"]}
    _one, two = await two_askers(cache, first, second, Need({0: 4}, "L"), ["b"])
    assert second.asked == [["b"]], f"after a {outcome} the waiter did not ask the store itself"
    assert isinstance(two, dict) and two["answers"] == [{"q": "b", "as_of": {"0": 6}, "log": "L"}]
    assert cache.joined == 0 and not cache._flying, "a flight outlived its request"


@pytest.mark.parametrize("case", ["ungated read", "cache off"])
async def test_only_a_gated_read_with_the_cache_on_waits_for_another_askers_answer(case: str) -> None:
    cache = AnswerCache(0 if case == "cache off" else 10)
    first, second = Store(5), Store(6)
    _one, two = await two_askers(
        cache, first, second, None if case == "ungated read" else Need({0: 1}, "L"), ["b"]
    )
    assert second.asked == [["b"]]
    assert isinstance(two, dict) and two["answers"] == [{"q": "b", "as_of": {"0": 6}, "log": "L"}]


async def test_a_question_being_computed_for_a_higher_need_is_not_waited_for() -> None:
    """The two detectors ask the same question with different needs (their batches and cuts differ): one
    whose need the store already meets does not wait while the other's waits for the store (up to its
    whole wait, and the join's bound, 30 s here) but reads the store itself."""
    cache, first, second = AnswerCache(10), Store(5), Store(6)
    higher = asyncio.ensure_future(
        _batch_response(cache, ["a", "b"], Need({0: 9}, "L"), first.answer(["a", "b"]), timeout=30)
    )
    async with asyncio.timeout(10):
        await first.started.wait()
    second.go.set()
    async with asyncio.timeout(10):
        response = await _batch_response(cache, ["b"], Need({0: 4}, "L"), second.answer(["b"]), timeout=30)
    assert response.text is not None
    two = json.loads(response.text)
    assert second.asked == [["b"]] and two["answers"] == [{"q": "b", "as_of": {"0": 6}, "log": "L"}]
    assert not higher.done() and cache.joined == 0
    first.go.set()
    await higher


def test_what_was_kept_from_another_log_goes_even_for_a_need_without_one() -> None:
    """A detector on a derived topic states its need without a log: an answer kept from the topic's old
    log (higher offsets) met it after the topic was created again and the store rebuilt."""
    cache = AnswerCache(10)
    cache.put("a", *kept({0: 900}, log="D-old"))
    assert cache.get("a", Need({0: 41}, None)) is not None
    cache.put("b", *kept({0: 40}, log="D-new"), keep=False)  # a question reads the rebuilt store
    assert cache.get("a", Need({0: 41}, None)) is None
    assert cache.newest == ("D-new", {0: 40}) and cache.as_json()["cleared"] == 1


def test_answers_read_side_by_side_a_little_apart_keep_what_was_kept() -> None:
    cache = AnswerCache(10)
    cache.put("a", *kept({0: 600}))
    cache.put("b", *kept({0: 500}))  # a slower request's snapshot, taken before "a"'s
    assert cache.get("a", Need({0: 600}, "L")) is not None and cache.newest == ("L", {0: 600})


def test_a_slower_requests_older_snapshot_does_not_replace_a_newer_answer() -> None:
    cache = AnswerCache(10)
    cache.put("q", *kept({0: 200}))
    cache.put("q", *kept({0: 100}))
    assert cache.get("q", Need({0: 150}, "L")) is not None


def test_the_kept_answers_hold_at_most_max_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted by entries alone, 10,000 answers of a topic of 1,000 partitions held a gigabyte."""
    wide = {p: 1 for p in range(1000)}
    one = len(kept(wide)[0]) + 1000 * answer_cache.AS_OF_BYTES
    monkeypatch.setattr(answer_cache, "MAX_BYTES", 2 * one + one // 2)
    cache = AnswerCache(10_000)
    for key in "abcd":
        cache.put(key, *kept(wide))
    assert [k for k in "abcd" if cache.get(k, Need({0: 1}, "L")) is not None] == ["c", "d"]
    assert cache.as_json()["entries"] == 2


class Health:
    """The store as the check's snapshots read it, one reading after another."""

    def __init__(self, readings: list[tuple[str | None, dict[int, int]] | Exception]) -> None:
        self.readings = readings

    @contextlib.asynccontextmanager
    async def health_snapshot(self) -> Any:
        reading = self.readings.pop(0)
        if isinstance(reading, Exception):
            raise reading
        log, as_of = reading
        yield SimpleNamespace(as_of=as_of, meta={"log": log} if log else {})


class Committed:
    async def read(self) -> tuple[list[int], dict[str, dict[int, int]]]:
        return [0], {"aggregates": {0: 0}}


@pytest.mark.parametrize(
    ("second", "goes"),
    [
        (("L", {0: 900}), False),
        (("L", {0: 40}), True),  # rebuilt on the same log, not caught up yet
        (("L", {}), True),  # rebuilt, empty
        (("M", {0: 2000}), True),  # of another log
        (StoreVersionMismatch("the aggregates store has schema version 9"), True),
    ],
)
async def test_the_store_check_lets_the_cache_go_when_the_store_is_another(
    second: tuple[str, dict[int, int]] | Exception, goes: bool
) -> None:
    """A rebuild (a new threshold, a topic created again) replays from the earliest offset: the store
    check, reading the store every two seconds, finds it behind its last reading or of another log, and
    the answers kept from the old store go before a question is answered from them."""
    check = StoreCheck(Health([("L", {0: 800}), second]), "aggregates", load_settings({}))  # type: ignore[arg-type]
    check.offsets = Committed()  # type: ignore[assignment]
    cache = AnswerCache(10)
    aggregates_app(check.reader, load_settings({}), check, cache=cache)
    await check.check()
    cache.put("a", *kept({0: 800}))
    await check.check()
    assert (cache.get("a", Need({0: 1}, None)) is None) is goes
