"""The features binned with one sort each (`aml_app.training.binning`) are binned as scikit-learn bins them:
the same thresholds on every kind of feature the fits meet, the same trees, and scikit-learn's own binning
wherever its functions are not the ones the faster one was adapted from."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.ensemble._hist_gradient_boosting import binning

from aml_app.training.binning import faster_weighted_binning, one_sort


def columns(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Features of the kinds the replay gives: continuous, few values with ties, rounded amounts, a mass
    at a ceiling, missing values, and mostly zeros."""
    capped = np.minimum(rng.exponential(size=n), 1.0)
    missing = rng.normal(size=n)
    missing[rng.random(n) < 0.2] = np.nan
    zeros = rng.integers(0, 3000, n).astype(float)
    zeros[rng.random(n) < 0.5] = 0.0
    return [
        rng.normal(size=n),
        rng.integers(0, 400, n).astype(float),
        rng.integers(0, 40, n).astype(float),
        np.round(rng.lognormal(size=n), 2),
        capped,
        missing,
        zeros,
    ]


def weights(rng: np.random.Generator, n: int, with_zeros: bool, whole: bool = False) -> np.ndarray:
    """Benign rows light, a rare class's rows heavy (each class weighs alike), some of no weight; `whole`:
    in whole numbers, so that ranks fall exactly on a row and thresholds are averages of two."""
    w = rng.integers(1, 4, n).astype(float) if whole else rng.uniform(0.1, 1.0, n)
    heavy = rng.random(n) < 0.02
    w[heavy] *= rng.integers(50, 500, int(heavy.sum())) if whole else rng.uniform(50, 500, int(heavy.sum()))
    if with_zeros:
        w[rng.random(n) < 0.05] = 0.0
    return w


@pytest.mark.parametrize("seed", range(4))
def test_the_thresholds_are_scikit_learns(seed: int) -> None:
    rng = np.random.default_rng(seed)
    original = binning._find_binning_thresholds
    faster = one_sort(original)
    for n in (300, 5000):
        for col in columns(rng, n):
            zeros = seed % 2 == 0
            for sample_weight in (weights(rng, n, zeros), weights(rng, n, zeros, whole=True), None):
                for max_bins in (255, 63):
                    expected = original(
                        col.copy(), max_bins, None if sample_weight is None else sample_weight.copy()
                    )
                    got = faster(
                        col.copy(), max_bins, None if sample_weight is None else sample_weight.copy()
                    )
                    assert got.dtype == expected.dtype and np.array_equal(got, expected), (n, max_bins)


def test_trees_fitted_with_it_are_the_trees_fitted_without() -> None:
    rng = np.random.default_rng(7)
    n = 3000
    x = np.column_stack(columns(rng, n))
    y = np.where(rng.random(n) < 0.05, "fan_in", "benign")
    y[rng.random(n) < 0.03] = "cycle"
    sample_weight = weights(rng, n, with_zeros=False, whole=True)

    def fitted() -> HistGradientBoostingClassifier:
        return HistGradientBoostingClassifier(max_iter=15, random_state=0, early_stopping=False).fit(
            x, y, sample_weight=sample_weight
        )

    plain = fitted()
    with faster_weighted_binning() as used:
        assert used, "scikit-learn's functions are not the ones the faster binning was adapted from"
        faster = fitted()
    assert binning._find_binning_thresholds.__name__ == "_find_binning_thresholds", "put back after the fit"
    for a, b in zip(plain._bin_mapper.bin_thresholds_, faster._bin_mapper.bin_thresholds_, strict=True):
        assert np.array_equal(a, b)
    for one, other in zip(plain._predictors, faster._predictors, strict=True):
        for p, q in zip(one, other, strict=True):
            assert p.nodes.tobytes() == q.nodes.tobytes()
    assert np.array_equal(plain.predict_proba(x), faster.predict_proba(x))


def test_another_scikit_learn_bins_as_it_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `_find_binning_thresholds` of another source (another scikit-learn) is left in place."""
    original = binning._find_binning_thresholds

    def another(col_data: np.ndarray, max_bins: int, sample_weight: np.ndarray | None = None) -> np.ndarray:
        return original(col_data, max_bins, sample_weight)

    monkeypatch.setattr(binning, "_find_binning_thresholds", another)
    with faster_weighted_binning() as used:
        assert not used
        assert binning._find_binning_thresholds is another


def test_a_scikit_learn_without_its_sources_bins_as_it_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """An install without the .py files (`inspect.getsource` fails): scikit-learn's own binning, no error."""
    original = binning._find_binning_thresholds

    def unreadable(_: object) -> str:
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", unreadable)
    with faster_weighted_binning() as used:
        assert not used and binning._find_binning_thresholds is original


def test_nested_the_outer_one_puts_scikit_learns_back() -> None:
    original = binning._find_binning_thresholds
    with faster_weighted_binning() as outer:
        faster = binning._find_binning_thresholds
        assert outer and faster is not original
        with faster_weighted_binning() as inner:
            assert not inner and binning._find_binning_thresholds is faster
        assert binning._find_binning_thresholds is faster
    assert binning._find_binning_thresholds is original
