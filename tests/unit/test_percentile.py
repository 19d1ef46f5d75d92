"""The harness's and the benchmarks' percentile (`aml_app.harness.verify.percentile`): linear between
ranks, and infinite, not NaN, where it reaches a payment never decided (`inf` in a capacity step's
latencies: `inf - inf` and `inf * 0` gave NaN, which the step's JSON recorded as its p99)."""

from __future__ import annotations

import math

from aml_app.harness.verify import percentile

INF = float("inf")


def test_linear_between_ranks() -> None:
    assert percentile([1, 2, 3], 50) == 2.0 and percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10.0 and math.isnan(percentile([], 50))


def test_a_never_decided_payment_makes_the_percentiles_it_reaches_infinite() -> None:
    assert percentile([0.5] * 98 + [INF] * 2, 99) == INF  # both neighbours infinite: was NaN
    assert percentile([0.5] * 99 + [INF], 99) == INF
    assert percentile([0.5] * 99 + [INF], 98) == 0.5
    assert percentile([1.0, INF], 0) == 1.0  # on the finite rank exactly: was NaN (inf * 0)
