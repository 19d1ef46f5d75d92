"""The capacity benchmark dates the dependencies' commits from the pipeline's own log lines, and the
event-time gate's floor from them and the payments' times."""

from __future__ import annotations

import logging

import pytest

from aml_app.harness.verdict import Sent
from aml_app.harness.verify import CommitTimeline
from aml_app.pipeline.jobs import BATCH_LOG
from bench.capacity import batch_lines, event_time_covered, pipeline_commits

#: The pipeline's log format (`aml_app.pipeline.runner`).
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def line(at: float, service: str, batch: int, commit_s: float, committed: dict[int, int]) -> str:
    """One batch's line as the pipeline writes it, logged at wall-clock `at`."""
    record = logging.LogRecord(
        "aml_app.pipeline.jobs",
        logging.INFO,
        __file__,
        1,
        BATCH_LOG,
        (
            service,
            batch,
            27,
            1,
            0.3061,
            f"spark 0.291 dead_letters 0.000 store 0.013 commit {commit_s:.3f}",
            committed,
        ),
        None,
    )
    record.created, record.msecs = at, (at - int(at)) * 1000
    return logging.Formatter(FORMAT).format(record)


def test_a_batch_line_gives_its_phases_and_what_the_group_committed() -> None:
    [parsed] = batch_lines(line(1_800_000_000.5, "relations", 7, 0.004, {0: 12, 3: 40}))
    assert parsed["service"] == "relations"
    assert parsed["records"] == 27
    assert parsed["seconds"] == pytest.approx(0.306)
    assert parsed["phases"] == {"spark": 0.291, "dead_letters": 0.0, "store": 0.013, "commit": 0.004}
    assert parsed["committed"] == {0: 12, 3: 40}
    assert parsed["at"] == pytest.approx(1_800_000_000.5, abs=0.001)


def test_a_commit_is_dated_at_the_start_of_its_call_and_covers_what_it_committed() -> None:
    text = "\n".join(
        [
            line(100.200, "relations", 1, 0.010, {0: 5}),
            line(100.250, "aggregates", 1, 0.002, {0: 5}),
            "2026-11-30 07:00:00,000 py4j INFO unrelated",
            line(100.700, "relations", 2, 0.004, {0: 9}),
            line(100.900, "aggregates", 2, 0.001, {0: 9}),
        ]
    )
    groups = {"relations": "relations-group", "aggregates": "aggregates-group"}
    timeline = pipeline_commits(batch_lines(text), groups)
    # Offset 4 is covered once both groups committed 5: the later call started at 100.248.
    assert timeline.opened_at(groups.values(), 0, 4) == pytest.approx(100.248, abs=0.0011)
    assert timeline.opened_at(groups.values(), 0, 5) == pytest.approx(100.899, abs=0.0011)
    assert timeline.covered_at("relations-group", 0, 5) == pytest.approx(100.696, abs=0.0011)
    assert timeline.opened_at(groups.values(), 0, 9) is None  # nobody committed past it
    assert timeline.opened_at(groups.values(), 1, 0) is None  # a partition nobody committed


def test_the_event_time_floor_waits_for_every_partitions_payments_up_to_the_payments_time() -> None:
    at = "2026-11-30T10:00:{:02d}Z".format
    valid = {
        (0, 5): Sent("a", "x", "y", at(10)),
        (0, 6): Sent("b", "x", "y", at(20)),
        (1, 2): Sent("c", "x", "y", at(5)),
        (1, 3): Sent("d", "x", "y", at(10)),  # the same instant as (0, 5): waited for
        (1, 4): Sent("e", "x", "y", at(15)),
        (1, 7): Sent("f", "x", "y", at(8)),  # later in the log with an earlier time, sent in (0, 5)'s burst
        (1, 9): Sent("h", "x", "y", at(1)),  # sent after (0, 5) with an earlier time: late, not waited for
        (2, 0): Sent("g", "x", "y", at(30)),  # a partition with nothing up to (0, 5)'s time
    }
    sent_at = {"a": 50.0, "b": 51.0, "c": 49.0, "d": 50.0, "e": 50.0, "f": 50.0, "h": 60.0, "g": 52.0}
    timeline = CommitTimeline()
    for group in ("b", "c"):
        timeline.record(group, 0, 7, at=100.0)
        timeline.record(group, 1, 5, at=100.5)
        timeline.record(group, 2, 1, at=99.0)
    timeline.record("b", 1, 8, at=101.0)
    covered = event_time_covered(valid, sent_at, timeline, ["b", "c"])
    # Its own commit came at 100.0; (1, 7), sent with it and at or before its time, is not covered by
    # both groups yet.
    assert timeline.opened_at(["b", "c"], 0, 5) == 100.0
    assert covered(0, 5) is None
    timeline.record("c", 1, 8, at=101.2)
    assert covered(0, 5) == 101.2  # (1, 9), uncovered, came too late to count
    assert covered(1, 2) == 100.5  # nothing of partition 0 is as early, (1, 2) itself at 100.5
    assert covered(2, 0) == 101.2  # its own commit at 99.0, (1, 7) and (0, 6) before it
    assert covered(1, 9) is None  # itself not covered
