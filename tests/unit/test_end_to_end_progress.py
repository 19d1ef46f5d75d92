"""The end-to-end benchmark's progress series: counts by each tick, so its curves show where AML falls
behind its dependencies."""

from bench.end_to_end import progress


def test_each_curve_counts_what_happened_by_its_tick() -> None:
    series = progress(sent=[0.0, 0.1, 0.3], covered=[0.5, 0.6, 0.7], decided=[0.8, 1.0, 1.2], step=0.25)
    assert series["seconds"] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    assert series["sent"] == [1, 2, 3, 3, 3, 3]
    assert series["covered"] == [0, 0, 1, 3, 3, 3]
    assert series["decided"] == [0, 0, 0, 0, 2, 3]


def test_the_last_tick_is_past_the_last_event() -> None:
    series = progress(sent=[0.0], covered=[0.1], decided=[2.01], step=0.5)
    assert series["seconds"][-1] >= 2.01
    assert series["decided"][-1] == 1
