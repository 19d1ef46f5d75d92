"""Horizontal scaling: the partitions of `payments` bound how many workers can do useful work.

Kafka gives each partition to one member of the group, so a worker beyond the partition count owns
nothing and waits as a hot spare. That is easy to miss when scaling by count (`honcho start -c aml=8`,
`deploy.replicas: 8`), so every worker looks at each assignment it receives and says so.

Faust sends every member the whole group's assignment (`app.assignor.external_topic_distribution`: each
member's URL -> its active partitions per topic), so a worker knows how many members the group has and
how many partitions the topic has without an extra request. Members are counted by URL, which is why
the app's canonical URL names the host when the web server binds a wildcard address (`aml_app.app`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupView:
    """One assignment as this worker sees it."""

    members: int
    #: Partitions of the topic that the group assigned (all of them: the assignor leaves none out).
    partitions: int
    #: This worker's partitions of the topic.
    mine: tuple[int, ...]


def group_view(
    distribution: Mapping[str, Mapping[str, Sequence[int]]], topic: str, mine: Iterable[int]
) -> GroupView:
    """The member count, the topic's partition count and this worker's share, from Faust's distribution."""
    everyone = {p for topics in distribution.values() for p in topics.get(topic, ())}
    own = tuple(sorted(set(mine)))
    return GroupView(members=len(distribution), partitions=len(everyone | set(own)), mine=own)


def idle_message(view: GroupView, topic: str, group: str, worker: str) -> tuple[int, str] | None:
    """What to log after an assignment: None while this worker owns a partition of `topic`.

    The warning is for a worker count above the partition count (a sizing mistake: these workers
    add no throughput). A worker can also come out empty-handed with enough partitions to go round,
    because Faust's assignor is sticky (each member may keep up to ceil(partitions / members)); that
    one is transient and only informational.
    """
    if view.mine:
        return None
    if view.members > view.partitions:
        return (
            logging.WARNING,
            f"topic {topic!r} has {view.partitions} partitions and group {group!r} has {view.members} "
            f"workers: this worker ({worker}) got no partition and will stay idle until another worker "
            "leaves; workers beyond the partition count add no throughput (add partitions to scale further)",
        )
    return (
        logging.INFO,
        f"this worker ({worker}) got no partition of {topic!r} in this assignment ({view.members} workers "
        f"for {view.partitions} partitions; Faust's sticky assignor lets a worker keep up to "
        f"{-(-view.partitions // max(view.members, 1))}); it takes some at a later rebalance",
    )


class AssignmentWatch:
    """Logs `idle_message` after each assignment, once per change of what it says."""

    def __init__(self, topic: str, group: str, worker: str) -> None:
        self.topic, self.group, self.worker = topic, group, worker
        self.view: GroupView | None = None
        self._said: str | None = None

    def on_assignment(
        self, distribution: Mapping[str, Mapping[str, Sequence[int]]], mine: Iterable[int]
    ) -> None:
        self.view = group_view(distribution, self.topic, mine)
        message = idle_message(self.view, self.topic, self.group, self.worker)
        if message is None:
            if self._said is not None:
                log.info(
                    "this worker (%s) now owns partitions %s of %r",
                    self.worker,
                    list(self.view.mine),
                    self.topic,
                )
            self._said = None
            return
        level, text = message
        if text != self._said:
            log.log(level, "%s", text)
        self._said = text


def watch_assignments(app: Any, topic: str, group: str, worker: str) -> AssignmentWatch:
    """Connect an AssignmentWatch to the app's assignments (a Faust signal; nothing runs until one)."""
    watch = AssignmentWatch(topic, group, worker)

    async def assigned(sender: Any, assigned: Any, **kwargs: Any) -> None:
        try:
            distribution = getattr(app.assignor, "external_topic_distribution", None)
            if not distribution:  # not a Faust assignment (nothing to count members by): say nothing
                return
            watch.on_assignment(distribution, (tp.partition for tp in assigned if tp.topic == topic))
        except Exception:  # a log line must never break Faust's handling of the assignment
            log.exception("could not check this worker's share of the assignment")

    app.on_partitions_assigned.connect(assigned)
    return watch
