"""What B's answer cache keeps an answer under: one key per question, and the per-currency minimum parsed
once per text; which sides of a loop search a round expands."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from aml_app.dependencies import relations
from aml_app.dependencies.api import BadRequest, parse_min_average
from aml_app.dependencies.relations import Query

AT = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
BASE = Query("A", 3, ("out", "chain", "loop"), {"USD": Decimal(1000), "EUR": Decimal(900)}, "B", AT, 12, None)


def test_the_same_question_has_the_same_key_however_its_minimums_are_ordered() -> None:
    again = BASE._replace(
        parts=["out", "chain", "loop"], min_average={"EUR": Decimal(900), "USD": Decimal(1000)}
    )
    assert again.key() == BASE.key()
    assert hash(again.key()) == hash(BASE.key())


def test_a_parsed_minimum_keys_its_question_as_the_same_minimums_given_as_a_dict() -> None:
    for text in ("USD:1000,EUR:900", "EUR:900.0,USD:1000"):
        parsed = BASE._replace(min_average=parse_min_average(text))
        assert parsed.key() == BASE.key() and hash(parsed.key()) == hash(BASE.key())
    assert BASE._replace(min_average=parse_min_average("USD:1000,EUR:901")).key() != BASE.key()


@pytest.mark.parametrize(
    "change",
    [
        {"account": "A2"},
        {"hops": 2},
        {"parts": ("out", "chain")},
        {"min_average": {"USD": Decimal(1000), "EUR": Decimal(901)}},
        {"min_average": Decimal(1000)},
        {"closing": "C"},
        {"at": AT.replace(microsecond=1)},
        {"loop_hops": 11},
        {"after": "Z"},
    ],
    ids=lambda change: next(iter(change)),
)
def test_a_question_that_differs_in_any_field_has_another_key(change: dict[str, Any]) -> None:
    assert BASE._replace(**change).key() != BASE.key()


def test_a_per_currency_minimum_is_parsed_once_and_shared_read_only() -> None:
    first = parse_min_average("USD:1000,EUR:853.4")
    assert first == {"USD": Decimal(1000), "EUR": Decimal("853.4")}
    assert parse_min_average("USD:1000,EUR:853.4") is first
    with pytest.raises(TypeError):
        first["USD"] = Decimal(0)  # type: ignore[index]
    for _ in range(2):  # a refusal is not kept: the second asker hears it too
        with pytest.raises(BadRequest, match="not an ISO 4217 currency code"):
            parse_min_average("USD:1,XYZ:2")


def test_a_loop_search_goes_forward_first_then_both_sides_while_they_are_small() -> None:
    """Each round of B's loop searches is a round trip to PostgreSQL. The first goes forward alone (the
    closing payer may be a merchant that hundreds pay); then a search whose frontiers are both small
    takes a step on each side in the same round, one whose frontier has grown takes the smaller."""
    at = datetime(2026, 3, 1, 12, tzinfo=UTC)
    small = relations.LOOP_BOTH_SIDES
    search = relations.LoopSearch(Query("A", 1, ["loop"], Decimal(0), "Z", at))
    assert search.sides() == ["forward"]
    search.advance("forward", [("A", "B", at)])
    assert search.sides() == ["forward", "backward"]
    search.advance("backward", [("Z", f"M{i:02}", at) for i in range(small)])
    assert search.sides() == ["forward", "backward"]
    search.advance("backward", [(f"M{i % small:02}", f"N{i:02}", at) for i in range(small + 1)])
    assert search.sides() == ["forward"]
    search.advance("forward", [("B", f"C{i:02}", at) for i in range(small + 2)])
    assert search.sides() == ["backward"]


def test_a_loop_search_is_done_once_either_side_reaches_nothing_new() -> None:
    """A side whose frontier is empty has labelled every account it reaches in time, the closing payer
    or the payee among them: whatever the other side would still find, the search has found already."""
    at = datetime(2026, 3, 1, 12, tzinfo=UTC)
    early = at - timedelta(hours=2)
    dead_end = relations.LoopSearch(Query("A", 1, ["loop"], Decimal(0), "Z", at))
    dead_end.advance("forward", [("A", "B", early)])
    dead_end.advance("backward", [("Z", f"M{i:02}", at) for i in range(40)])
    assert not dead_end.done
    dead_end.advance("forward", [])  # B paid no one in time
    assert dead_end.done and dead_end.answer() == {"found": False, "path": [], "complete": True}
    # Forward reaches the closing payer and nothing else: the loop is found where the sides first meet.
    closing = relations.LoopSearch(Query("A", 1, ["loop"], Decimal(0), "Z", at))
    closing.advance("forward", [("A", "B", early)])
    closing.advance("backward", [("Z", f"M{i:02}", at) for i in range(40)])
    closing.advance("forward", [("B", "Z", early)])
    assert closing.done
    assert closing.answer() == {"found": True, "path": ["A", "B", "Z", "A"], "complete": True}
    # The backward side runs dry first.
    source = relations.LoopSearch(Query("A", 1, ["loop"], Decimal(0), "Z", at))
    source.advance("forward", [("A", f"B{i:02}", early) for i in range(40)])
    source.advance("backward", [])
    assert source.done and source.answer()["complete"] is True
