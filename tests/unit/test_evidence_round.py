"""One round of a batch's evidence: B's and C's requests go together, and end together."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from aml_app.dependencies.client import DependencyUnavailable, evidence_for


class OneDown:
    """C fails at once; B's request is still running (its follow-up pages, its next replica)."""

    def __init__(self) -> None:
        self.b_cancelled = False

    async def aggregates_many(self, *args: Any, **kwargs: Any) -> list[Any]:
        raise DependencyUnavailable("aggregates answered 503")

    async def relations_many(self, *args: Any, **kwargs: Any) -> list[Any]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.b_cancelled = True
            raise
        return []


async def test_a_failed_request_takes_the_other_one_of_its_round_with_it() -> None:
    """gather alone left B's request running beside the next round's (five rounds with C down: four
    of B's still running, five at once)."""
    client = OneDown()
    with pytest.raises(DependencyUnavailable):
        await evidence_for(client, [("a", "b", datetime(2026, 11, 20, tzinfo=UTC))])  # type: ignore[arg-type]
    await asyncio.sleep(0)  # the cancel reaches B's request
    assert client.b_cancelled
