"""The API replicas' answer cache and the routing that sends a partition's questions to one replica."""

from __future__ import annotations

import json

import pytest

from aml_app.dependencies.answer_cache import MAX_TEXT, AnswerCache
from aml_app.dependencies.client import Need, Replicas


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
