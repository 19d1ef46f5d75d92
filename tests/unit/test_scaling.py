"""The scaling warning: a worker without a payments partition says why, from Faust's group assignment."""

from __future__ import annotations

import logging

import pytest

from aml_app.gate.assignments import AssignmentWatch, group_view, idle_message

TOPIC = "payments"


def distribution(*shares: list[int], other: str = "aml-watermarks-changelog") -> dict:
    """Faust's external_topic_distribution: member URL -> {topic: partitions} (other topics too)."""
    return {f"http://host-{i}:6066": {TOPIC: share, other: [0]} for i, share in enumerate(shares)}


def test_members_and_partitions_come_from_the_whole_group() -> None:
    view = group_view(distribution([0, 1], [2], [3], []), TOPIC, [])
    assert (view.members, view.partitions, view.mine) == (4, 4, ())
    # A member whose entry lacks the topic altogether counts as a member all the same.
    view = group_view({"http://a:1": {TOPIC: [0, 1]}, "http://b:1": {}}, TOPIC, [0, 1])
    assert (view.members, view.partitions, view.mine) == (2, 2, (0, 1))


def test_no_message_while_the_worker_owns_a_partition() -> None:
    view = group_view(distribution([0], [1], [2]), TOPIC, [1])
    assert idle_message(view, TOPIC, "aml", "w1") is None


def test_more_workers_than_partitions_is_a_warning_naming_the_partition_count() -> None:
    view = group_view(distribution([0], [1], []), TOPIC, [])
    level, text = idle_message(view, TOPIC, "aml", "w3")  # type: ignore[misc]
    assert level == logging.WARNING
    assert "has 2 partitions" in text and "has 3 workers" in text
    assert "w3" in text and "idle until another worker leaves" in text


def test_an_empty_share_with_enough_partitions_is_only_information() -> None:
    # Faust's sticky assignor: 4 partitions, 3 members, two keep 2 each.
    view = group_view(distribution([0, 1], [2, 3], []), TOPIC, [])
    level, text = idle_message(view, TOPIC, "aml", "w3")  # type: ignore[misc]
    assert level == logging.INFO
    assert "3 workers for 4 partitions" in text and "up to 2" in text


def test_the_watch_logs_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    watch = AssignmentWatch(TOPIC, "aml", "w3")
    with caplog.at_level(logging.INFO, logger="aml_app.gate.assignments"):
        watch.on_assignment(distribution([0], [1], []), [])
        watch.on_assignment(distribution([0], [1], []), [])  # same again: said already
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        watch.on_assignment(distribution([0], [1]), [1])  # another worker left: this one works
        assert caplog.records[-1].levelno == logging.INFO
        assert "now owns partitions [1]" in caplog.records[-1].getMessage()
        watch.on_assignment(distribution([0], [1], [], []), [])  # idle again: said again
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO, logging.WARNING]
    assert "has 4 workers" in caplog.records[-1].getMessage()
    assert watch.view is not None and watch.view.members == 4
