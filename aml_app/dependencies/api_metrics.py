"""Prometheus metrics of one replica of B's or C's API, for its `/metrics`: what the gate waits on, seen
from the service. Requests by route and status, their latency by route, the "not yet" answers (the store
had not applied what a question needed), what the answer cache served, and
whether the store is behind its consumer group. Every series has a `service` label; routes are the
application's route templates, so no label grows with what clients send.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aml_app.dependencies.answer_cache import AnswerCache


class Checked(Protocol):
    state: str


class _Served(Collector):
    """The answer cache's counts and the store check's state, read at each scrape."""

    def __init__(self, service: str, cache: AnswerCache, check: Checked | None) -> None:
        self.service, self.cache, self.check = service, cache, check

    def collect(self) -> Iterable[Metric]:
        lookups = CounterMetricFamily(
            "aml_api_cache_lookups",
            "Questions of batch requests looked up in the answer cache: `hit`, answered from an answer given "
            "before from a snapshot that meets the new need, `joined`, answered with the answer another "
            "request was computing, from such a snapshot, or `miss`, asked of the store.",
            labels=["service", "result"],
        )
        lookups.add_metric([self.service, "hit"], self.cache.hits)
        lookups.add_metric([self.service, "joined"], self.cache.joined)
        lookups.add_metric([self.service, "miss"], self.cache.misses)
        yield lookups
        if self.check is not None:
            behind = GaugeMetricFamily(
                "aml_api_store_behind",
                "1 while the store is behind its consumer group: the replica answers 503 (aml-app rebuild).",
                labels=["service"],
            )
            behind.add_metric([self.service], 1 if self.check.state == "behind" else 0)
            yield behind

    def describe(self) -> Iterable[Metric]:
        return []


class ApiMetrics:
    """One replica's registry (not the library's global one: tests run several apps in one process)."""

    def __init__(self, service: str, cache: AnswerCache, check: Checked | None) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.requests = Counter(
            "aml_api_requests",
            "Requests answered, by route (the route template) and HTTP status.",
            ["service", "route", "status"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "aml_api_request_seconds",
            "Time to answer a request, by route.",
            ["service", "route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.not_yet = Counter(
            "aml_api_not_yet",
            'Batch requests answered "not yet": the store had not applied what their need named in time.',
            ["service"],
            registry=self.registry,
        )
        self.registry.register(_Served(service, cache, check))

    def saw_not_yet(self) -> None:
        self.not_yet.labels(self.service).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Outermost: sees the status the error middleware made of an exception."""
        started = time.monotonic()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away first (nginx's name for it); its statement was cancelled
            raise
        finally:
            route = _route(request)
            self.requests.labels(self.service, route, str(status)).inc()
            self.seconds.labels(self.service, route).observe(time.monotonic() - started)


def _route(request: web.Request) -> str:
    """`METHOD /template` of the route that matched, `unmatched` for any other path."""
    info = request.match_info
    resource = info.route.resource if info is not None and info.route is not None else None
    if resource is None or getattr(info, "http_exception", None) is not None:
        return "unmatched"
    return f"{request.method} {resource.canonical}"
