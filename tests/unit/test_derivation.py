"""Mapping a group's offsets on a derived topic onto `payments` (`aml_app.kafka.derivation`).

A simulated stage filters, splits, merges, repartitions and, after a restart, writes records again; a
group reads the derived topic part way. The bookkeeping, fed the records as a leader reads them across
several refreshes, must give for every payments partition exactly the first payment the group has not
applied (the stage has not derived it, or one of its records is pending); a naive reading of the
group's offsets must not.
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aml_app.kafka.derivation import (
    SOURCE_HEADER,
    DerivationError,
    PendingSources,
    check_retained,
    source_positions,
)
from aml_app.pipeline.repeats import parse_sources
from tests.derivation import DERIVED, PAYMENTS, Stage, truth


def refresh(book: PendingSources, stage: Stage, group_committed: dict[int, int]) -> dict[int, int]:
    """One leader refresh: S(p) first, then the group's offsets, then each partition read to its end."""
    stage_committed = dict(stage.committed)
    ends = {d: len(records) for d, records in stage.derived.items()}
    for d in DERIVED:
        for offset in range(book.next_read(d, group_committed[d]), ends[d]):
            book.add(d, offset, stage.derived[d][offset])
        book.read_to(d, ends[d])
    return book.positions(PAYMENTS, stage_committed, group_committed, ends)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_positions_are_the_first_payment_the_group_has_not_applied(seed: int) -> None:
    rng = random.Random(seed)
    stage = Stage(rng, {p: rng.randint(0, 25) for p in PAYMENTS})
    book = PendingSources("payments.enriched", "aggregates")
    group_committed = dict.fromkeys(DERIVED, 0)
    for _ in range(rng.randint(1, 8)):  # refreshes
        for _ in range(rng.randint(0, 30)):
            stage.step()
        for d in DERIVED:
            end = len(stage.derived[d])
            if rng.random() < 0.1:  # the group is moved back (a replay of the group)
                group_committed[d] = rng.randint(0, group_committed[d])
            else:
                group_committed[d] = rng.randint(group_committed[d], max(group_committed[d], end))
        stage_committed = dict(stage.committed)
        assert refresh(book, stage, group_committed) == truth(stage, stage_committed, group_committed)


def test_a_naive_reading_of_the_groups_offsets_decides_before_the_group_applied() -> None:
    """Negative control: the group's offsets on D taken as offsets on payments (or the source position of
    the record it stopped at) say payments are applied that the group has not read."""
    stage = Stage(random.Random(0), dict.fromkeys(PAYMENTS, 0))
    # Partition 0 of D interleaves payments partitions 0 and 1; payment (0, 1) is filtered out.
    stage.derived[0] = [[(0, 0)], [(1, 0)], [(1, 1)], [(0, 2)], [(1, 2)], [(0, 3)]]
    stage.derived[1] = []
    stage.committed = {0: 4, 1: 3, 2: 0}
    group_committed = {0: 3, 1: 0}  # read (0,0), (1,0), (1,1); pending (0,2), (1,2), (0,3)
    expected = truth(stage, stage.committed, group_committed)
    assert expected == {0: 2, 1: 2, 2: 0}

    book = PendingSources("payments.enriched", "aggregates")
    assert refresh(book, stage, group_committed) == expected

    naive_as_offsets = {p: group_committed[0] for p in (0, 1)}
    assert naive_as_offsets[0] > expected[0]  # would decide payment (0, 2), not yet applied
    naive_record_at_commit = stage.derived[0][group_committed[0]][0]  # (0, 2): says nothing of partition 1
    assert naive_record_at_commit == (0, 2) and stage.committed[1] > expected[1]  # S(1) alone decides (1, 2)


def test_headers_name_the_payments_or_the_mapping_stops_with_one_sentence() -> None:
    assert source_positions(
        [(SOURCE_HEADER, b"3:17"), ("other", b"x"), (SOURCE_HEADER, b"0:5")], "d", 1, 9
    ) == [(3, 17), (0, 5)]
    with pytest.raises(DerivationError, match=r"offset 9 of d\[1\] has no aml-source header"):
        source_positions([("other", b"x")], "d", 1, 9)
    # Each form the pipeline's copy check does not read as a position (`repeats.parse_sources`): the
    # two read the same ones (int() took " 0:10", "+0:10", "0:1_0" and "0: 10").
    for bad in (b"3-17", b"x:1", None, b"\xff", b"-1:4", b" 0:10", b"0:10 ", b"+0:10", b"0:1_0", b"0: 10"):
        with pytest.raises(DerivationError, match="not '<partition>:<offset>'"):
            source_positions([(SOURCE_HEADER, bad)], "d", 1, 9)
        assert (
            parse_sources(pa.array([None if bad is None else bad.decode("latin-1")], pa.string()))[0][0] == -1
        )


def test_records_gone_before_the_group_read_them_cannot_be_placed() -> None:
    assert check_retained("d", "g", 0, None, 0) == 0
    assert check_retained("d", "g", 0, 12, 10) == 12
    with pytest.raises(DerivationError, match=r"never committed on d\[0\], whose records below 10 are gone"):
        check_retained("d", "g", 0, None, 10)
    with pytest.raises(DerivationError, match=r"records from 4 to 10 are gone"):
        check_retained("d", "g", 0, 4, 10)


def test_a_partition_not_read_to_its_end_gives_no_position() -> None:
    book = PendingSources("d", "g")
    book.add(0, book.next_read(0, 0), [(0, 0)])
    with pytest.raises(DerivationError, match=r"d\[0\] has not been read to its end \(2\)"):
        book.positions(PAYMENTS, {0: 5}, {0: 0}, {0: 2})
    book.add(0, 1, [(0, 1)])
    assert book.positions(PAYMENTS, {0: 5}, {0: 1}, {0: 2}) == {0: 1, 1: 0, 2: 0}
