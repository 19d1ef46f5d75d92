"""B's loop search keeps a label only where it beats every earlier label of its account in time
(`aml_app.dependencies.relations.LoopSearch`): an earlier arrival forward, a later departure backward."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from aml_app.dependencies.relations import LoopSearch, Query

AT = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def t(minutes: int) -> datetime:
    return AT - timedelta(minutes=60 - minutes)


def search() -> LoopSearch:
    # The payment Z -> P being decided: forward from its payee P, backward from its payer Z.
    return LoopSearch(Query("P", 3, ("loop",), Decimal(0), "Z", AT, 12))


def test_forward_keeps_an_earlier_arrival_found_later_and_drops_a_later_one() -> None:
    loop = search()
    loop.advance("forward", [("P", "A", t(1)), ("P", "X", t(10))])
    loop.advance("forward", [("A", "X", t(2)), ("A", "Y", t(5))])
    assert loop.labels["forward"]["X"][-1] == (2, t(2), ("P", "A", "X"))
    assert loop.frontiers["forward"] == ["X", "Y"]
    loop.advance("forward", [("X", "Y", t(7)), ("X", "W", t(8))])  # Y was reached at t(5) already
    assert [label[0] for label in loop.labels["forward"]["Y"]] == [2]
    assert loop.frontiers["forward"] == ["W"]


def test_backward_keeps_a_later_departure_found_later_and_drops_an_earlier_one() -> None:
    loop = search()
    loop.advance("backward", [("Z", "B", t(50)), ("Z", "X", t(20))])
    loop.advance("backward", [("B", "X", t(40)), ("B", "C", t(30))])
    assert loop.labels["backward"]["X"][-1] == (2, t(40), ("Z", "B", "X"))
    loop.advance("backward", [("X", "C", t(25)), ("X", "D", t(35))])  # C may leave at t(30) already
    assert [label[0] for label in loop.labels["backward"]["C"]] == [2]
    assert loop.frontiers["backward"] == ["D"]


def test_a_loop_is_found_where_the_better_labels_meet() -> None:
    loop = search()
    loop.advance("forward", [("P", "A", t(1)), ("P", "X", t(10))])
    loop.advance("backward", [("Z", "X", t(5))])  # X must be left by t(5): the direct arrival is too late
    assert loop.found is None
    loop.advance("forward", [("A", "X", t(2))])
    assert loop.found == ("P", "A", "X", "Z")
    assert loop.answer() == {"found": True, "path": ["P", "A", "X", "Z", "P"], "complete": True}
