"""The lane's own rules for what arrives: re-deliveries, holes, what is held past one, and the gap."""

from __future__ import annotations

from typing import Any

from aml_app.gate.lane import Arrival, HandledBatch, Lane
from tests.unit.test_lanes import event


def offsets(events: list[Any]) -> list[int]:
    return [e.message.offset for e in events]


def test_a_lane_queues_in_order_and_drops_what_it_had_before() -> None:
    lane = Lane(0)
    assert lane.receive(event(0, 5), 5, checks_holes=True) is Arrival.QUEUED
    assert lane.receive(event(0, 6), 5, checks_holes=True) is Arrival.QUEUED
    assert lane.receive(event(0, 5), 5, checks_holes=True) is Arrival.REDELIVERED
    assert lane.receive(event(0, 4), 5, checks_holes=True) is Arrival.REDELIVERED  # below the start
    assert offsets(list(lane.queue)) == [5, 6] and lane.next_offset == 7


def test_a_jump_opens_a_hole_that_holds_what_comes_after_until_the_missing_record_fills_it() -> None:
    lane = Lane(0)
    lane.receive(event(0, 0), 0, checks_holes=True)
    assert lane.receive(event(0, 3), 0, checks_holes=True) is Arrival.HOLE
    assert lane.receive(event(0, 4), 0, checks_holes=True) is Arrival.HELD
    assert lane.receive(event(0, 4), 0, checks_holes=True) is Arrival.HELD  # a duplicate is not held twice
    assert lane.hole == (1, 3) and offsets(lane.held) == [3, 4] and lane.buffered == 3
    assert lane.receive(event(0, 1), 0, checks_holes=True) is Arrival.QUEUED  # it came after all
    assert lane.hole is None and lane.held == [] and offsets(list(lane.queue)) == [0, 1]


def test_a_hole_that_is_a_gap_in_the_log_gives_back_its_held_events_to_receive_again() -> None:
    lane = Lane(0)
    lane.receive(event(0, 0), 0, checks_holes=True)
    lane.receive(event(0, 3), 0, checks_holes=True)
    lane.receive(event(0, 4), 0, checks_holes=True)
    held = lane.cross_gap()
    assert lane.hole is None and lane.next_offset == 3
    assert [lane.receive(e, 0, checks_holes=True) for e in held] == [Arrival.QUEUED, Arrival.QUEUED]
    assert offsets(list(lane.queue)) == [0, 3, 4]


def test_without_hole_checks_a_jump_is_queued() -> None:
    """A lane not attached to a log (no way to tell a hole from a gap) goes on, as a plain consumer."""
    lane = Lane(0)
    lane.receive(event(0, 0), 0, checks_holes=False)
    assert lane.receive(event(0, 9), 0, checks_holes=False) is Arrival.QUEUED and lane.next_offset == 10


def test_the_acks_go_from_the_front_and_make_room() -> None:
    lane = Lane(0)
    for o in range(3):
        lane.receive(event(0, o), 0, checks_holes=True)
    first, _ = lane.take()
    assert lane.in_flight == 0 and offsets(lane.unacked()) == [0, 1, 2]
    lane.add_handled(HandledBatch(lane.hand_over(), [], _ready(), []))
    assert lane.handled_payments == 1 and lane.resume_offset() == 0
    lane.acked_front()
    lane.settled(1)
    assert lane.handled_payments == 0 and lane.done == 1 and lane.room.is_set()
    assert lane.resume_offset() == 1 and first.message.offset == 0


def _ready() -> Any:
    """Pending work that is already done (the lane never awaits it here)."""
    return object()
