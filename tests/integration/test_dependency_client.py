"""The detectors' client for Services B and C, against the real APIs (on PostgreSQL) over real HTTP on
loopback, with replicas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from decimal import Decimal
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from aml_app.dependencies.client import (
    LOOP_HOPS,
    PAYEE_PARTS,
    PAYER_PARTS,
    DependencyClient,
    DependencyRequestError,
    DependencyUnavailable,
    evidence_for,
    includes,
)
from aml_app.kafka.broker import free_port
from tests.integration.test_services_api import T0, aggregates_api, relations_api, stores

__all__ = ["stores"]  # a fixture


async def gather_answers(client: DependencyClient, payer: str, payee: str, at: datetime) -> tuple:
    """The four single GETs a payment's evidence is made of."""
    return tuple(
        await asyncio.gather(
            client.aggregates(payer, at),
            client.aggregates(payee, at),
            client.relations(payer, parts=PAYER_PARTS, at=at),
            client.relations(payee, parts=PAYEE_PARTS, loop=(payer, at, LOOP_HOPS), at=at),
        )
    )


@asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@asynccontextmanager
async def services(url: str) -> AsyncIterator[DependencyClient]:
    async with served(relations_api(url)) as r_url, served(aggregates_api(url)) as a_url:
        client = DependencyClient(r_url, a_url, timeout=5)
        try:
            yield client
        finally:
            await client.close()


async def test_answers_for_a_payment_with_one_pooled_session(stores: str) -> None:
    async with services(stores) as client:
        payer_agg, payee_agg, payer_rel, payee_rel = await gather_answers(client, "A", "a/b ü", T0)
        assert payer_agg["account"] == "A" and payer_agg["at"] == "2026-03-01T12:00:00.000000Z"
        assert payer_agg["windows"]["1h"]["sent_count"] == 2
        # An account id with '/' and non-ASCII characters is one path segment.
        assert payee_agg["account"] == "a/b ü" and payee_agg["windows"]["1h"]["received_count"] == 1
        # Only the parts the detectors use (hops 3): no neighbourhood.
        assert set(payer_rel) == {"account", "hops", "as_of", "log", "out"}
        assert set(payee_rel) == {"account", "hops", "as_of", "log", "chain", "sources", "co_payees", "loop"}
        assert payee_rel["chain"] == ["A", "a/b ü"], "the payment's own edge; C -> A paid 10,000 times less"
        assert payer_rel["hops"] == 3 and [e["counterparty"] for e in payer_rel["out"]] == ["B", "a/b ü"]
        # A B C A is no loop: C paid A two days before A paid B.
        _, _, _, loop = await gather_answers(client, "C", "A", T0)
        assert loop["loop"] == {"found": False, "path": [], "complete": True}
        session = client._client()
        for _ in range(5):
            await gather_answers(client, "A", "B", T0)
        assert client._client() is session, "a new session (and connections) per request"
        assert client.stats.requests == 28 and client.stats.failures == 0


async def test_a_batch_of_payments_takes_two_requests_and_matches_the_single_answers(stores: str) -> None:
    async with services(stores) as client:
        payments = [("A", "a/b ü", T0), ("B", "C", T0), ("A", "B", T0)]
        batch = await evidence_for(client, payments)
        assert client.stats.requests == 2, "one POST to B and one to C, whatever the batch size"
        singles = [await gather_answers(client, payer, payee, at) for payer, payee, at in payments]
        assert batch == singles
        assert await evidence_for(client, []) == []
        # min_average reaches B: no edge averages a billion, so no heavy chain comes into "a/b ü".
        assert batch[0][3]["chain"] != []
        assert (await evidence_for(client, payments, Decimal("1000000000")))[0][3]["chain"] == []
        # One minimum per currency: the stored edges are in EUR; a currency not named is never heavy.
        assert (await evidence_for(client, payments, {"EUR": Decimal(0), "USD": Decimal(5)}))[0][3][
            "chain"
        ] != []
        assert (await evidence_for(client, payments, {"USD": Decimal(0)}))[0][3]["chain"] == []


async def test_as_of_proves_inclusion_of_a_payment(stores: str) -> None:
    async with services(stores) as client:
        answer = await client.aggregates("A", T0)
        assert answer["as_of"] == {"0": 2, "1": 2}
        assert includes(answer, 0, 1) and not includes(answer, 0, 2)
        assert not includes(answer, 3, 0), "a partition the store has not seen includes nothing"


async def test_a_dependency_that_is_down_is_unavailable_not_an_answer() -> None:
    down = f"http://127.0.0.1:{free_port()}"
    client = DependencyClient(down, down, timeout=2)
    try:
        with pytest.raises(DependencyUnavailable, match="unavailable"):
            await client.relations("A")
        assert client.stats.failures == 1 and client.stats.last_error
    finally:
        await client.close()


async def test_a_5xx_is_unavailable_and_a_4xx_is_our_bug(stores: str) -> None:
    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"error": "The store could not be read right now."}, status=503)

    app = web.Application()
    app.router.add_get("/aggregates/{account}", broken)
    async with served(app) as url, served(relations_api(stores)) as working:
        client = DependencyClient(working, url, timeout=2)
        try:
            with pytest.raises(DependencyUnavailable, match="503"):
                await client.aggregates("A", T0)
            with pytest.raises(DependencyRequestError, match="400"):
                await client.relations("A", hops=4)
        finally:
            await client.close()


async def test_a_4xx_with_a_body_that_is_not_json_is_refused_not_an_outage() -> None:
    """A proxy's HTML 401 or 404 was decoded before its status was read: taken for an outage, retried
    and the replica rested, where a refusal is a request this client gets wrong."""

    async def html(request: web.Request) -> web.Response:
        return web.Response(text="<html><body>401 Authorization Required</body></html>", status=401)

    app = web.Application()
    app.router.add_get("/aggregates/{account}", html)
    async with served(app) as url:
        client = DependencyClient(url, url, timeout=2)
        try:
            with pytest.raises(DependencyRequestError, match="401 <html><body>401 Authorization Required"):
                await client.aggregates("A", T0)
        finally:
            await client.close()


def counted(app: web.Application) -> Any:
    """Counts the requests `app` answers; returns the counter."""
    answered = [0]

    async def count(request: web.Request, response: web.StreamResponse) -> None:
        answered[0] += 1

    app.on_response_prepare.append(count)
    return lambda: answered[0]


async def test_requests_take_turns_over_the_replicas_and_survive_one_going_down(stores: str) -> None:
    """Two replicas of each API on one store: both serve; with one gone, every request is still answered
    (the next replica at once), and the gone one is left out for a while instead of costing each request."""
    apps = [relations_api(stores), relations_api(stores), aggregates_api(stores), aggregates_api(stores)]
    served_by = [counted(app) for app in apps]
    async with served(apps[0]) as r1, served(apps[1]) as r2, served(apps[2]) as a1, served(apps[3]) as a2:
        client = DependencyClient([r1, r2], [a1, a2], timeout=2)
        try:
            for _ in range(4):
                answers = await evidence_for(client, [("A", "B", T0)])
                assert answers[0][2]["out"] and answers[0][3]["loop"]["complete"] is True
            assert client.stats.requests == 8 and client.stats.failures == 0
        finally:
            await client.close()
    assert [count() for count in served_by] == [2, 2, 2, 2], "every replica took its turn"
    gone = f"http://127.0.0.1:{free_port()}"
    async with served(relations_api(stores)) as alive, served(aggregates_api(stores)) as a_alive:
        client = DependencyClient([gone, alive], [a_alive], timeout=2)
        try:
            for _ in range(6):
                answer = await client.relations("A")
                assert answer["as_of"] == {"0": 2, "1": 2}
            assert client.stats.failures == 1, "the replica that is down was tried once, then rested"
            assert client.stats.requests == 7
        finally:
            await client.close()
        everyone_gone = DependencyClient([gone, f"http://127.0.0.1:{free_port()}"], [a_alive], timeout=2)
        try:
            with pytest.raises(DependencyUnavailable, match="every replica of relations failed"):
                await everyone_gone.relations("A")
        finally:
            await everyone_gone.close()


def edge(counterparty: str) -> dict[str, Any]:
    return {
        "counterparty": counterparty,
        "count": 1,
        "totals": {"EUR": "5000.00"},
        "first_seen": "2026-03-01T00:00:00.000000Z",
        "last_seen": "2026-03-01T00:00:00.000000Z",
    }


@pytest.mark.parametrize(
    ("page_as_of", "page_log", "merged_as_of", "merged_log"),
    [({"0": 8, "1": 12}, "L", {"0": 8, "1": 9}, "L"), ({"0": 10, "1": 9}, "M", {"0": 10, "1": 9}, None)],
    ids=["a page from an older snapshot", "a page of another log"],
)
async def test_a_list_made_whole_from_two_snapshots_claims_only_what_both_hold(
    page_as_of: dict[str, int], page_log: str, merged_as_of: dict[str, int], merged_log: str | None
) -> None:
    """An `out` list that B cut short goes on in a later request, which may be served from another
    snapshot (another replica, a store restored). The whole list is as of the older of the two on each
    partition, and of no log when their logs differ: an answer that kept the first one's `as_of` claimed
    payments its second page may lack, and the detector would take it as proof."""
    pages = [
        {"account": "A", "as_of": {"0": 10, "1": 9}, "log": "L", "out": [edge("B")], "truncated": {"out": 1}},
        {"account": "A", "as_of": page_as_of, "log": page_log, "out": [edge("C")], "exact": False},
    ]

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"answers": [pages.pop(0)]})

    paged = web.Application()
    paged.router.add_post("/relations", answer)
    async with served(paged) as b:
        client = DependencyClient([b], [b], timeout=2)
        try:
            [whole] = await client.relations_many(["A"], parts="out", route=0)
        finally:
            await client.close()
    assert [e["counterparty"] for e in whole["out"]] == ["B", "C"] and not pages
    assert whole["as_of"] == merged_as_of and whole["log"] == merged_log
    assert whole["exact"] is False, "the second page was read after B folded payments"


@pytest.mark.parametrize(
    "single, batch",
    [
        ({"account": "A", "as_of": {"0": None}}, {"answers": [{"account": "A", "as_of": {"0": "two"}}]}),
        ({"account": "A", "as_of": {"zero": 2}}, {"answers": []}),
    ],
    ids=["as_of not a number", "partition not a number, batch short"],
)
async def test_a_replica_that_answers_malformed_json_is_passed_over_for_the_next(
    stores: str, single: dict, batch: dict
) -> None:
    """A replica's answer that cannot be read (an `as_of` that is not offsets, a batch without an answer
    per question) is that replica's failure: the next one is asked, as for a replica that is down."""

    async def answer_single(request: web.Request) -> web.Response:
        return web.json_response(single)

    async def answer_batch(request: web.Request) -> web.Response:
        return web.json_response(batch)

    broken = web.Application()
    broken.router.add_get("/relations/{account}", answer_single)
    broken.router.add_post("/relations", answer_batch)
    async with (
        served(broken) as bad,
        served(relations_api(stores)) as good,
        served(aggregates_api(stores)) as a,
    ):
        for ask in (lambda c: c.relations("A"), lambda c: c.relations_many(["A"], route=0)):
            client = DependencyClient([bad, good], [a], timeout=2)  # the broken replica first
            try:
                answer = await ask(client)
                answer = answer[0] if isinstance(answer, list) else answer
                assert answer["as_of"] == {"0": 2, "1": 2} and answer["out"]
                assert client.stats.failures == 1 and "relations" in client.stats.last_error
            finally:
                await client.close()
