"""The capacity benchmark reads each API replica's time answering batch requests from its /metrics text,
as prometheus_client writes it, and gives the mean per API kind over a step."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench.capacity import Sample, api_batch_ms, api_batch_sums


def metrics_text(observed: dict[str, list[float]]) -> str:
    """A replica's /metrics with the API's histogram: seconds observed per route."""
    registry = CollectorRegistry()
    seconds = Histogram("aml_api_request_seconds", "t", ["service", "route"], registry=registry)
    for route, values in observed.items():
        for value in values:
            seconds.labels("relations", route).observe(value)
    return generate_latest(registry).decode()


def test_only_the_batch_route_counts_not_single_questions_nor_buckets() -> None:
    text = metrics_text({"POST /relations": [0.05, 0.07], "GET /relations/{account}": [3.0]})
    found = api_batch_sums(text)
    assert found["count"] == 2
    assert abs(found["sum"] - 0.12) < 1e-9


def test_the_mean_is_over_every_replica_of_a_kind_between_two_samples() -> None:
    start = Sample(0.0, {}, {}, {}, 0, api_batches={"relations-api": {"sum": 1.0, "count": 10}})
    end = Sample(
        60.0,
        {},
        {},
        {},
        0,
        api_batches={
            "relations-api": {"sum": 2.0, "count": 20},
            "relations-2-api": {"sum": 0.5, "count": 10},
            "aggregates-api": {},
        },
    )
    assert api_batch_ms(start, end) == {"relations": 75.0, "aggregates": None}
