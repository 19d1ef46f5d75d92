"""The demo's report on payments left undecided: where they are and whether the service's group acked
them."""

from aml_app.harness.undecided import LISTED, acked_past, by_partition, worker_view


def test_places_are_grouped_per_partition_with_their_range() -> None:
    grouped = by_partition([(1, 40), (0, 7), (1, 38), (1, 39)])
    assert grouped == {
        "0": {"count": 1, "first": 7, "last": 7, "offsets": [7]},
        "1": {"count": 3, "first": 38, "last": 40, "offsets": [38, 39, 40]},
    }


def test_a_long_run_of_places_lists_its_first_offsets_only() -> None:
    grouped = by_partition((2, o) for o in range(100, 100 + 3 * LISTED))
    assert grouped["2"]["count"] == 3 * LISTED
    assert grouped["2"]["offsets"] == list(range(100, 100 + LISTED))
    assert grouped["2"]["last"] == 100 + 3 * LISTED - 1


def test_a_place_is_acked_when_the_group_committed_past_it() -> None:
    # Committed is the next offset to read: 10 covers offset 9, not 10.
    assert acked_past([(0, 9), (0, 10), (1, 3)], {0: 10}) == 1


def test_the_worker_view_keeps_where_payments_are_and_the_decision_count() -> None:
    state = {"processed": {"0": 12}, "fetching": {"0": {"hole": None}}, "detector": {"decisions": 12}, "x": 1}
    view = worker_view(state)
    assert view is not None
    assert view["processed"] == {"0": 12}
    assert view["fetching"] == {"0": {"hole": None}}
    assert view["decisions"] == 12
    assert "x" not in view
    assert worker_view(None) is None
