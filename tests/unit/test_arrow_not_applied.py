"""`transforms.arrow_not_applied`: the driver-side twin of the Spark filter that skips what a store holds."""

from __future__ import annotations

import pyarrow as pa
import pytest

from aml_app.pipeline.transforms import arrow_not_applied

ROWS = pa.table(
    {
        "partition": pa.array([0, 0, 1, 1, 2, 3, 3], pa.int32()),
        "offset": pa.array([5, 6, 0, 9, 4, 7, 8], pa.int64()),
    }
)


def pairs(table: pa.Table) -> list[tuple[int, int]]:
    return list(zip(table["partition"].to_pylist(), table["offset"].to_pylist(), strict=True))


def test_nothing_applied_keeps_every_row() -> None:
    assert arrow_not_applied(ROWS, {}) is ROWS


@pytest.mark.parametrize(
    ("applied", "kept"),
    [
        ({0: 6}, [(0, 6), (1, 0), (1, 9), (2, 4), (3, 7), (3, 8)]),
        ({0: 7, 1: 9, 3: 8}, [(1, 9), (2, 4), (3, 8)]),
        ({2: 5, 9: 100}, [(0, 5), (0, 6), (1, 0), (1, 9), (3, 7), (3, 8)]),  # a partition the batch lacks
        ({0: 0, 1: 0, 2: 0, 3: 0}, [(0, 5), (0, 6), (1, 0), (1, 9), (2, 4), (3, 7), (3, 8)]),
        ({0: 100, 1: 100, 2: 100, 3: 100}, []),
    ],
)
def test_rows_before_the_store_offsets_are_dropped(
    applied: dict[int, int], kept: list[tuple[int, int]]
) -> None:
    assert pairs(arrow_not_applied(ROWS, applied)) == kept


def test_an_empty_batch_stays_empty() -> None:
    assert arrow_not_applied(ROWS.slice(0, 0), {0: 3}).num_rows == 0
