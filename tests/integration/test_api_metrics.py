"""`/metrics` of B's and C's APIs on PostgreSQL, read through the Prometheus client's own parser: requests
by route template and status, latency by route, "not yet" answers, the answer cache's hits and misses,
every series labelled with its service and no label taking what a client sent."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aml_app.dependencies.client import DependencyClient, Need, NotYet
from tests.integration.test_answer_cache import LOG, apis, ask, store  # noqa: F401  (the fixture)

pytestmark = pytest.mark.integration


async def scrape(url: str) -> list[Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: list[Any], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, [s for s in samples if s.name == name])
    return found[0]


async def test_each_api_counts_its_requests_answers_and_not_yet(store: str) -> None:  # noqa: F811
    async with apis(store) as (b, c, _caches):
        client = DependencyClient(b, c)
        try:
            await ask(client, Need({0: 6}, LOG))
            await ask(client, Need({0: 6}, LOG))
            with pytest.raises(NotYet):
                await ask(client, Need({0: 6}, "other:log", wait=0.1))
        finally:
            await client.close()
        async with aiohttp.ClientSession() as session:
            for path in ("/relations/someone", "/no/such/path%0A?x=1", "/relations/a?hops=9"):
                async with session.get(f"{b}{path}") as response:
                    await response.read()

        not_yet = 0.0
        for url, service, route in (
            (b, "relations", "POST /relations"),
            (c, "aggregates", "POST /aggregates"),
        ):
            samples = await scrape(url)
            mine = [s for s in samples if s.name.startswith("aml_api_")]
            assert mine and all(s.labels["service"] == service for s in mine)
            posts = [s for s in mine if s.name == "aml_api_requests_total" and s.labels["route"] == route]
            # Two answered; the "not yet" one a 200 that says so, or a 499 where the other service's "not
            # yet" came first and the client went away.
            assert {s.labels["status"] for s in posts} <= {"200", "499"}, posts
            answered = sum(s.value for s in posts)
            assert answered >= 3, posts
            assert value(samples, "aml_api_request_seconds_count", service=service, route=route) == answered
            not_yet += sum(s.value for s in mine if s.name == "aml_api_not_yet_total")
            assert value(samples, "aml_api_cache_lookups_total", service=service, result="hit") == 4
            assert value(samples, "aml_api_cache_lookups_total", service=service, result="miss") >= 8
            assert not [s for s in samples if s.name == "aml_api_store_behind"]  # no store check here
        assert not_yet >= 1

        samples = await scrape(b)
        get = "GET /relations/{account}"
        assert value(samples, "aml_api_requests_total", service="relations", route=get, status="200") == 1
        assert value(samples, "aml_api_requests_total", service="relations", route=get, status="400") == 1
        assert (
            value(samples, "aml_api_requests_total", service="relations", route="unmatched", status="404")
            == 1
        )
        routes = {s.labels.get("route") for s in samples if "route" in s.labels}
        assert routes <= {"POST /relations", get, "unmatched", "GET /metrics"}, routes


def test_a_store_behind_its_group_shows_as_one() -> None:
    from aml_app.dependencies.answer_cache import AnswerCache
    from aml_app.dependencies.api_metrics import ApiMetrics

    class Check:
        state = "behind"

    check = Check()
    metrics = ApiMetrics("relations", AnswerCache(0), check)
    samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples]
    assert value(samples, "aml_api_store_behind", service="relations") == 1
    check.state = "ok"
    samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples]
    assert value(samples, "aml_api_store_behind", service="relations") == 0
