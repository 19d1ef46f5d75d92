"""Pure offset planning for the Kafka streaming source: no Spark, no Kafka, unit-tested.

Spark keeps offsets as JSON, so an offset here is `{"<partition>": next offset}` with string keys; Kafka's
convention holds throughout: an end offset is exclusive, a start offset is the next record to read.
"""

from __future__ import annotations

from collections.abc import Mapping

SparkOffset = dict[str, int]


def to_spark(offsets: Mapping[int, int]) -> SparkOffset:
    return {str(p): int(o) for p, o in sorted(offsets.items())}


def from_spark(offset: Mapping[str, int]) -> dict[int, int]:
    return {int(p): int(o) for p, o in offset.items()}


def starting_offsets(
    partitions: Mapping[int, tuple[int, int]], committed: Mapping[int, int | None]
) -> dict[int, int]:
    """Where a new query starts: the group's committed offset, else the log start.

    `partitions` maps each partition to its (low, high) watermarks. A committed offset outside the log
    (records deleted by retention, or a topic recreated) is clamped into it, as Kafka's
    auto.offset.reset=earliest would do.
    """
    start = {}
    for p, (low, high) in partitions.items():
        committed_offset = committed.get(p)
        start[p] = low if committed_offset is None else min(max(committed_offset, low), high)
    return start


def plan_end(start: Mapping[int, int], latest: Mapping[int, int], max_records: int | None) -> dict[int, int]:
    """End offsets of the next micro-batch: everything up to `latest`, or at most `max_records` records.

    Partitions that appeared since `start` was planned start at their log start, which the caller folds
    into `start`. Under a limit, the budget is shared fairly (water-filling): every partition with a
    backlog gets an equal share, and what a small backlog leaves unused goes to the others, so no
    partition starves.
    """
    end = {p: max(start.get(p, 0), latest.get(p, 0)) for p in sorted(set(start) | set(latest))}
    if max_records is None:
        return end
    backlog = {p: end[p] - start.get(p, 0) for p in end if end[p] > start.get(p, 0)}
    if sum(backlog.values()) <= max_records:
        return end
    budget = max_records
    grant = dict.fromkeys(backlog, 0)
    hungry = sorted(backlog, key=lambda p: (backlog[p], p))
    while budget > 0 and hungry:
        share = max(1, budget // len(hungry))
        for p in list(hungry):
            take = min(share, backlog[p] - grant[p], budget)
            grant[p] += take
            budget -= take
            if grant[p] == backlog[p]:
                hungry.remove(p)
            if budget == 0:
                break
    return {p: start.get(p, 0) + grant.get(p, 0) if p in backlog else end[p] for p in end}


def planned_ranges(start: Mapping[int, int], end: Mapping[int, int]) -> list[tuple[int, int, int]]:
    """(partition, start, end) for every partition with records to read in the batch."""
    return [(p, start.get(p, 0), end[p]) for p in sorted(end) if end[p] > start.get(p, 0)]


Range = tuple[int, int, int]  # (partition, start, end)


def task_count(ranges: list[Range], max_tasks: int | None, min_records_per_task: int | None = None) -> int:
    """How many tasks read a batch: one per range, at most `max_tasks`, and no more than one per
    `min_records_per_task` records (but at least one)."""
    count = len(ranges) if max_tasks is None else min(max_tasks, len(ranges))
    if min_records_per_task is not None and ranges:
        records = sum(end - start for _p, start, end in ranges)
        count = min(count, max(1, -(-records // min_records_per_task)))
    return count


def pack_ranges(
    ranges: list[Range], max_tasks: int | None, min_records_per_task: int | None = None
) -> list[tuple[Range, ...]]:
    """Group a batch's ranges into at most `max_tasks` Spark tasks of about equal record counts, and a
    small batch into fewer (`task_count`).

    One task per Kafka partition (Spark's own connector does that) runs in waves when partitions outnumber
    cores, and a small micro-batch then pays the per-task cost (a Python worker round trip, a client) once
    per wave. Packing into as many tasks as there are cores makes every batch one wave. A batch of a few
    thousand records is read and checked faster by one task than its per-task cost (measured: 1,300-record
    micro-batches took 311 ms in one task, 362 ms in two). Greedy longest-first onto the least-loaded
    task: the largest task holds at most the ideal share plus one range. Each task's ranges are in
    partition order; tasks are ordered by their first partition.
    """
    if max_tasks is not None and max_tasks < 1:
        raise ValueError(f"max_tasks must be at least 1, got {max_tasks}")
    if min_records_per_task is not None and min_records_per_task < 1:
        raise ValueError(f"min_records_per_task must be at least 1, got {min_records_per_task}")
    count = task_count(ranges, max_tasks, min_records_per_task)
    if count >= len(ranges):
        return [(r,) for r in ranges]
    tasks: list[list[Range]] = [[] for _ in range(count)]
    loads = [0] * count
    for r in sorted(ranges, key=lambda r: (-(r[2] - r[1]), r[0])):
        i = min(range(count), key=lambda t: (loads[t], t))
        tasks[i].append(r)
        loads[i] += r[2] - r[1]
    packed = [tuple(sorted(task)) for task in tasks if task]
    return sorted(packed, key=lambda task: task[0][0])
