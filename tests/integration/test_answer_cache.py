"""The answer cache of B's and C's APIs on the real embedded PostgreSQL, asked through the detectors' own
client: a second detector asking what the first asked is answered from the cache only where the
cached snapshot meets its need, and never so that its freshness check fails or a replica seems to go
back."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from aml_app.dependencies import aggregates, relations
from aml_app.dependencies.answer_cache import AnswerCache
from aml_app.dependencies.api import aggregates_app, relations_app
from aml_app.dependencies.client import DependencyClient, Need, NotYet, evidence_for, includes
from aml_app.dependencies.store import Reader
from aml_app.settings import Settings
from tests.payments import PaymentRow
from tests.played_stores import apply

LOG = "cluster:topic"
T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)
SETTINGS = Settings()
HEAVY = Decimal(0)


class Careless(AnswerCache):
    """The negative control: serves what it keeps whatever the need."""

    def get(self, key: Hashable, need: Need | None) -> str | None:
        return super().get(key, None if need is None else Need({}, need.log))


FIRST = [("a", "b"), ("b", "c"), ("c", "a"), ("a", "c"), ("c", "b"), ("b", "a")]
SECOND = [("a", "d"), ("d", "c"), ("b", "d")]


def rows(start: int, edges: list[tuple[str, str]], at: datetime) -> list[PaymentRow]:
    """One payment per edge of partition 0 from offset `start`, a minute apart from `at` on (a batch of
    the store's holds one payment per edge)."""
    return [
        PaymentRow(
            0, start + k, str(uuid.uuid4()), payer, payee, Decimal("5000"), "EUR", at + timedelta(minutes=k)
        )
        for k, (payer, payee) in enumerate(edges)
    ]


def fill(url: str, payments: list[PaymentRow]) -> None:
    for service in ("relations", "aggregates"):
        apply(url, service, payments, SETTINGS, LOG)


@asynccontextmanager
async def apis(url: str, cache: type[AnswerCache] = AnswerCache) -> AsyncIterator[tuple[str, str, Any]]:
    """B's and C's APIs on the store, each with a cache of `cache`'s kind; their URLs and their caches."""
    caches = (cache(100), cache(100))
    servers = [
        TestServer(relations_app(Reader(url, relations.SCHEMA), cache=caches[0]), host="127.0.0.1"),
        TestServer(
            aggregates_app(Reader(url, aggregates.SCHEMA), SETTINGS, cache=caches[1]), host="127.0.0.1"
        ),
    ]
    for server in servers:
        await server.start_server()
    try:
        yield str(servers[0].make_url("")), str(servers[1].make_url("")), caches
    finally:
        for server in servers:
            await server.close()


Q1 = [("a", "b", T0 + timedelta(minutes=3)), ("c", "a", T0 + timedelta(minutes=2))]
Q2 = [("b", "c", T0 + timedelta(minutes=4))]


async def ask(
    client: DependencyClient, need: Need, questions: list[tuple[str, str, datetime]] = Q1
) -> list[tuple[dict[str, Any], ...]]:
    return await evidence_for(client, questions, HEAVY, need=need, route=0)


@pytest.fixture
def store(postgres: Any) -> str:
    url = postgres.create_database(f"cache_{uuid.uuid4().hex[:12]}")
    fill(url, rows(0, FIRST, T0))
    return url


async def test_a_second_asker_gets_the_kept_answers_only_while_they_meet_its_need(store: str) -> None:
    async with apis(store) as (b, c, caches):
        first, second = DependencyClient(b, c), DependencyClient(b, c)
        try:
            asked = await ask(first, Need({0: 6}, LOG))
            await ask(first, Need({0: 6}, LOG), Q2)
            assert [cache.hits for cache in caches] == [0, 0]
            again = await ask(second, Need({0: 6}, LOG))
            assert again == asked, "the kept answers are the ones the first asker got"
            assert [cache.hits for cache in caches] == [4, 4], "every question of the second asker kept"

            fill(store, rows(6, SECOND, T0 - timedelta(hours=1)))  # earlier in time: changes the answers
            later = await ask(second, Need({0: 9}, LOG))
            assert [cache.hits for cache in caches] == [4, 4], "a need past the kept snapshot reads the store"
            for four in later:
                assert all(includes(answer, 0, 8, LOG) for answer in four)
            assert later != asked

            # Having seen the store at 9, the second asker gets Q2's answers kept at 6, which its need
            # allows: the replica must not seem to have gone back (their as_of is where the store was).
            await ask(second, Need({0: 6}, LOG), Q2)
            assert [cache.hits for cache in caches] == [6, 6]
            assert second.stats.went_back == 0
        finally:
            await first.close()
            await second.close()


async def test_without_the_need_check_a_kept_answer_fails_the_freshness_check(store: str) -> None:
    """The negative control of the test above: a cache serving its answers whatever the need hands the
    second asker answers that do not include the payments it needs."""
    async with apis(store, Careless) as (b, c, _):
        client = DependencyClient(b, c)
        try:
            await ask(client, Need({0: 6}, LOG))
            fill(store, rows(6, SECOND, T0 - timedelta(hours=1)))
            later = await ask(client, Need({0: 9}, LOG))
            assert not all(includes(answer, 0, 8, LOG) for four in later for answer in four)
        finally:
            await client.close()


async def test_answers_of_another_log_are_not_kept_for_this_one(store: str) -> None:
    async with apis(store) as (b, c, caches):
        client = DependencyClient(b, c)
        try:
            await ask(client, Need({0: 6}, LOG))
            with pytest.raises(NotYet):
                await ask(client, Need({0: 6}, "other:log", wait=0.1))
        finally:
            await client.close()
        assert [cache.hits for cache in caches] == [0, 0]


async def test_health_says_what_the_cache_served(store: str) -> None:
    async with apis(store) as (b, c, _):
        client = DependencyClient(b, c)
        try:
            await ask(client, Need({0: 6}, LOG))
            await ask(client, Need({0: 6}, LOG))
        finally:
            await client.close()
        async with aiohttp.ClientSession() as session, session.get(f"{b}/health") as response:
            health = await response.json()
        assert health["answer_cache"] == {
            "entries": 4,
            "capacity": 100,
            "hits": 4,
            "misses": 4,
            "joined": 0,
            "cleared": 0,
        }
