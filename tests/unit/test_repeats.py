"""A derived topic's copies of payments: found exactly, whatever the order and the state before."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from aml_app.pipeline.repeats import find_repeats, parse_sources, seen_from_text, seen_to_text


def brute_force(records: list[tuple[int, int, str | None]], seen: dict) -> tuple[list[bool], dict]:
    """Record by record in the derived topic's order: a copy is a payment at or below the highest one
    applied from its payments partition into its derived partition."""
    state, repeated = dict(seen), [False] * len(records)
    for i in sorted(range(len(records)), key=lambda i: (records[i][0], records[i][1])):
        d, _offset, source = records[i]
        if source is None:
            continue
        p, o = (int(x) for x in source.split(":"))
        if o <= state.get((d, p), -1):
            repeated[i] = True
        else:
            state[(d, p)] = o
    moved = {pair: o for pair, o in state.items() if seen.get(pair) != o}
    return repeated, moved


def run(records: list[tuple[int, int, str | None]], seen: dict) -> tuple[list[bool], dict]:
    partitions = np.array([r[0] for r in records], np.int64)
    offsets = np.array([r[1] for r in records], np.int64)
    sources = pa.chunked_array([pa.array([r[2] for r in records], pa.string())])
    mask, moved = find_repeats(partitions, offsets, sources, seen)
    return [bool(x) for x in mask], moved


def test_a_stage_writing_a_batch_again_repeats_it_once() -> None:
    # Derived partition 0 gets payments 0:5, 0:6, 1:2 then the stage writes 0:5, 0:6 again (a restart).
    records = [(0, 10, "0:5"), (0, 11, "0:6"), (0, 12, "1:2"), (0, 13, "0:5"), (0, 14, "0:6"), (0, 15, "0:7")]
    mask, moved = run(records, {})
    assert mask == [False, False, False, True, True, False]
    assert moved == {(0, 0): 7, (0, 1): 2}


def test_what_the_store_applied_before_is_a_copy_too() -> None:
    mask, moved = run([(1, 3, "0:4"), (1, 4, "0:9")], {(1, 0): 4})
    assert mask == [True, False]
    assert moved == {(1, 0): 9}


def test_records_without_a_source_are_kept_and_change_nothing() -> None:
    mask, moved = run([(0, 1, None), (0, 2, "garbage"), (0, 3, "0:1")], {})
    assert mask == [False, False, False]
    assert moved == {(0, 0): 1}


@pytest.mark.parametrize("seed", range(40))
def test_agrees_with_record_by_record_in_any_row_order(seed: int) -> None:
    rng = random.Random(seed)
    records, next_offset = [], {0: 0, 1: 0, 2: 0}
    for _ in range(rng.randint(0, 60)):
        d = rng.randint(0, 2)
        source = None if rng.random() < 0.05 else f"{rng.randint(0, 3)}:{rng.randint(0, 30)}"
        records.append((d, next_offset[d], source))
        next_offset[d] += rng.randint(1, 2)  # holes: transaction markers
    seen = {(rng.randint(0, 2), rng.randint(0, 3)): rng.randint(-1, 20) for _ in range(rng.randint(0, 4))}
    rng.shuffle(records)  # Spark's collect promises no order
    assert run(records, seen) == brute_force(records, seen)


def test_sources_parse_only_in_their_one_form() -> None:
    partitions, offsets = parse_sources(pa.array(["3:17", "3:", ":4", "a:1", "1:2:3", None, "0:0"]))
    assert partitions.tolist() == [3, -1, -1, -1, -1, -1, 0]
    assert offsets.tolist() == [17, -1, -1, -1, -1, -1, 0]


def test_the_state_round_trips_through_its_text() -> None:
    seen = {(0, 1): 5, (2, 0): 0}
    assert seen_from_text(seen_to_text(seen)) == seen
    assert seen_from_text(None) == {}
