"""How the detectors' client takes replicas' replies that are below what the service showed before: a
reply of answers one replica kept (two replicas over one store that only moves forward) did not go back,
though its `as_of`, the newest store that replica read, is below what the other showed since (taken for
one, it rested the replica and had the other compute again); replies that went back and say "not yet"
are a store behind the question, not an outage."""

from __future__ import annotations

import json
from typing import Any

import pytest

from aml_app.dependencies.answer_cache import AnswerCache
from aml_app.dependencies.api import _batch_response
from aml_app.dependencies.client import DependencyClient, Need, NotYet

STORE: dict[int, int] = {}
CACHES: dict[str, AnswerCache] = {}


async def serve(replica: str, keys: list[str], need: Need | None) -> dict[str, Any]:
    """What the replica's batch endpoint answers, its store read (`answer`) at the store's `as_of` now."""

    async def answer(todo: list[int]) -> dict[str, Any]:
        as_of = {str(p): o for p, o in STORE.items()}
        return {"answers": [{"account": keys[i], "as_of": as_of, "log": "L"} for i in todo]}

    response = await _batch_response(CACHES[replica], keys, need, answer)
    assert response.text is not None
    reply: dict[str, Any] = json.loads(response.text)
    return reply


class Replicas(DependencyClient):
    """The client over the replicas' endpoints at the narrowest seam: its HTTP send."""

    async def _send_to(self, dependency: str, url: Any, body: Any) -> dict[str, Any]:
        asked = body.get("need")
        need = Need({int(p): o for p, o in asked["as_of"].items()}, asked.get("log"), 0) if asked else None
        return await serve(url.host, [q["account"] for q in body["queries"]], need)


async def test_a_replica_answering_from_its_kept_answers_has_not_gone_back() -> None:
    STORE.clear()
    STORE.update({0: 100, 1: 100})
    CACHES.clear()
    CACHES.update({"r0": AnswerCache(100), "r1": AnswerCache(100)})
    aml = Replicas(["http://r0", "http://r1"], "http://c")
    fraud = Replicas(["http://r0", "http://r1"], "http://c")
    need = Need({0: 50}, "L", 0)
    try:
        await aml.relations_many(["k"], parts="out", need=need, route=0)  # r0 reads k at 100
        STORE.update({0: 120, 1: 130})
        await fraud.relations_many(["x"], parts="out", need=need, route=1)  # r1 reads x at 120, 130
        (k,) = await fraud.relations_many(["k"], parts="out", need=need, route=0)  # r0 has k kept
        assert k["as_of"] == {"0": 100, "1": 100}, "the kept answer, which meets the need"
        assert fraud.stats.went_back == 0
        assert CACHES["r0"].hits == 1 and CACHES["r1"].misses == 1, "nobody computed k again"
    finally:
        await aml.close()
        await fraud.close()


class Restored(DependencyClient):
    """Every replica over a store restored from a backup: below what it showed, and behind the need."""

    async def _send_to(self, dependency: str, url: Any, body: Any) -> dict[str, Any]:
        return {"not_yet": True, "as_of": {"0": 40}, "log": "L", "waited_ms": 2000}


async def test_replicas_behind_and_below_what_they_showed_are_not_yet_not_an_outage() -> None:
    """Said "every replica of relations failed: " with no reason, counted no "not yet", and kept the
    highest as_of shown, so every later answer below it went back again."""
    client = Restored(["http://r0", "http://r1"], "http://c")
    client.highest["relations"] = ("L", {0: 100})  # shown before the restore
    try:
        with pytest.raises(NotYet, match="relations has not applied what the question needs yet"):
            await client.relations_many(["a"], parts="out", need=Need({0: 60}, "L", 2))
        assert client.stats.not_yet == 2 and client.stats.went_back == 2
        assert "relations" not in client.highest
    finally:
        await client.close()
