"""Scikit-learn's weighted binning of the features, with one sort of each feature instead of one per
threshold.

Why: HistGradientBoostingClassifier (scikit-learn 1.9) bins each feature of a fit with sample weights by
calling `_weighted_percentile` once for each of its 254 thresholds, and each call sorts the feature again.
Every fit here has weights (each class weighs alike), and below 200,000 rows (above, scikit-learn bins a
weighted sample without weights) that binning is most of a fit on a small history and about 1.2 s a
feature of 100,000 rows. `_weighted_percentile` takes every threshold's rank in one call and computes each
exactly as the call for that rank alone does: one sort, the same thresholds, the same trees.

`faster_weighted_binning` puts that into scikit-learn's binning while trees are fitted, and only where
the two functions it relies on are the ones it was adapted from (scikit-learn 1.9.1, BSD-3-Clause): their
sources' digest is checked, and any other version bins as scikit-learn does. `tests/unit/test_binning.py`
holds the thresholds and the fitted trees equal to scikit-learn's own.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

#: sha256 of the sources of scikit-learn 1.9.1's `_find_binning_thresholds` and `_weighted_percentile`.
ADAPTED_FROM = "68517bde21c457038f7e82c479c0f0f7bf5a2708e3c691fa4b32274dc8b70f2d"


def digest(*functions: Callable[..., Any]) -> str | None:
    """The sha256 of the functions' sources, in order; None where a source cannot be read (an install
    without its .py files), which then bins as scikit-learn does."""
    try:
        sources = "".join(inspect.getsource(f) for f in functions)
    except (OSError, TypeError):
        return None
    return hashlib.sha256(sources.encode()).hexdigest()


def one_sort(original: Callable[..., Any]) -> Callable[..., Any]:
    """scikit-learn 1.9.1's `_find_binning_thresholds`, asking `_weighted_percentile` for every
    threshold's rank in one call; without weights, `original` itself."""
    from numpy.lib.stride_tricks import sliding_window_view
    from sklearn.ensemble._hist_gradient_boosting.common import ALMOST_INF, X_DTYPE
    from sklearn.utils.stats import _weighted_percentile

    def thresholds(col_data: np.ndarray, max_bins: int, sample_weight: np.ndarray | None = None) -> Any:
        if sample_weight is None:
            return original(col_data, max_bins, sample_weight)
        missing_mask = np.isnan(col_data)
        if missing_mask.any():
            col_data = col_data[~missing_mask]
            sample_weight = sample_weight[~missing_mask]
        nonzero = sample_weight != 0
        col_data = col_data[nonzero]
        sample_weight = sample_weight[nonzero]
        sort_idx = np.argsort(col_data)
        col_data = col_data[sort_idx]
        sample_weight = sample_weight[sort_idx]
        distinct_values = np.unique(col_data).astype(X_DTYPE)
        if len(distinct_values) == 1:
            return np.asarray([])
        if len(distinct_values) <= max_bins:
            bin_thresholds = sliding_window_view(distinct_values, 2).mean(axis=1)
        else:
            percentiles = np.linspace(0, 100, num=max_bins + 1)[1:-1]
            bin_thresholds = np.asarray(
                _weighted_percentile(col_data, sample_weight, percentiles, average=True)
            )
        unique_bin_values = np.unique(bin_thresholds)
        if unique_bin_values.shape[0] != bin_thresholds.shape[0]:
            bin_thresholds = unique_bin_values
        np.clip(bin_thresholds, a_min=None, a_max=ALMOST_INF, out=bin_thresholds)
        return bin_thresholds

    return thresholds


@contextmanager
def faster_weighted_binning() -> Iterator[bool]:
    """While it lasts, scikit-learn's binning takes `one_sort` where its functions are the ones it was
    adapted from; yields whether it does (nested, the outer one already did)."""
    from sklearn.ensemble._hist_gradient_boosting import binning

    original = binning._find_binning_thresholds
    if digest(original, binning._weighted_percentile) != ADAPTED_FROM:
        yield False
        return
    binning._find_binning_thresholds = one_sort(original)
    try:
        yield True
    finally:
        binning._find_binning_thresholds = original
