"""`aml-app topics --create` says so when topics get fewer copies than the cluster could give them."""

from __future__ import annotations

import pytest

from aml_app.topics_command import replication_note


@pytest.mark.parametrize(("replication", "brokers"), [(1, 1), (2, 2), (3, 3), (3, 5), (4, 5)])
def test_no_note_when_topics_have_all_the_copies_the_cluster_can_hold(replication: int, brokers: int) -> None:
    assert replication_note(replication, brokers) is None


def test_one_copy_on_three_brokers_is_named_with_what_to_set() -> None:
    note = replication_note(1, 3)
    assert note is not None
    assert note.startswith("AML_REPLICATION_FACTOR=1 on a cluster of 3 brokers")
    assert note.endswith("set it to 3 for production.")


def test_on_two_brokers_two_copies_are_what_to_set() -> None:
    note = replication_note(1, 2)
    assert note is not None and note.endswith("set it to 2 for production.")
