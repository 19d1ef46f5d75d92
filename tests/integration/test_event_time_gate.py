"""The event-time gate across partitions on the real broker: its reader, and a worker that holds a payment
until every partition's dependencies have applied what happened before it."""

from __future__ import annotations

import pytest

from aml_app.gate.event_time import micros
from aml_app.gate.unapplied import UnappliedReader
from aml_app.harness.verify import CommitTimeline
from aml_app.kafka.security import PLAINTEXT
from aml_app.kafka.tools import payment_json, produce
from tests.harness import ends_of, wait_until

pytestmark = pytest.mark.integration


def at(partition: int, n: int, ts: str, tag: str = "e") -> tuple[int, bytes, bytes]:
    payer = f"acct-{partition}"
    return partition, payer.encode(), payment_json(f"{tag}-{partition}-{n}", payer, f"acct-x{n}", "10.00", ts)


async def test_reader_finds_the_first_unapplied_payment_and_the_true_end(broker, names, producer):
    # Partition 0: four payments in one batch (send all, then wait), so a W in the middle of the batch
    # must skip the batch's first records; partition 1: two payments; partitions 2 and 3: nothing.
    records = [at(0, n, f"2026-11-20T10:0{n}:00Z") for n in range(4)]
    records.append((0, b"acct-0", b"not json"))
    records += [at(1, n, f"2026-11-20T11:0{n}:00Z") for n in range(2)]
    ends = ends_of(await produce(producer, names.payments, records))
    reader = UnappliedReader([broker.bootstrap], names.payments, security=PLAINTEXT)
    try:
        found = await reader.read({0: 2, 1: 2, 2: 0, 3: 0})
        assert found[0].first_ts == micros("2026-11-20T10:02:00Z")
        assert found[1].first_ts is None and found[1].end == ends[1]
        assert found[2].first_ts is None and found[2].end == 0
        # Only the malformed payment is left on partition 0: nothing there is evidence.
        found = await reader.read({0: 4, 1: 2, 2: 0, 3: 0})
        assert found[0].first_ts is None and found[0].end == ends[0] == 5
        assert reader.fetches == 2
        # A partition whose W has not moved since its payment was read is not fetched again.
        found = await reader.read({0: 3})
        assert found[0].first_ts == micros("2026-11-20T10:03:00Z")
        fetches = reader.fetches
        again = await reader.read({0: 3})
        assert again[0].first_ts == found[0].first_ts and reader.fetches == fetches
    finally:
        await reader.close()


async def partition_1_behind(names, producer, new_worker, deps, timeline: CommitTimeline, **env: str):
    """Partition 1 holds payments at 10:00-10:02, partition 0 at 10:05 and 10:06; a worker on the
    event-time gate starts, and the dependencies commit all of partition 0 but only 10:00 of partition 1.
    Returns (placed, ends, worker)."""
    records = [at(1, n, f"2026-11-20T10:0{n}:00Z") for n in range(3)]
    records += [at(0, n, f"2026-11-20T10:0{n + 5}:00Z") for n in range(2)]
    placed = await produce(producer, names.payments, records)
    ends = ends_of(placed)
    worker = new_worker(AML_GATE_MODE="event-time", **env)
    await worker.wait_ready(set(range(names.partitions)))
    await timeline.commit(deps, {0: ends[0], 1: 1, 2: 0, 3: 0})
    return placed, ends, worker


async def test_a_payment_waits_for_every_partitions_past_not_only_its_own(
    names, producer, new_worker, deps, decision_log
):
    # The dependencies finish partition 0 at once and partition 1 only later.
    timeline = CommitTimeline()
    placed, ends, worker = await partition_1_behind(names, producer, new_worker, deps, timeline)

    # Partition 1's first payment (10:00) is applied; its second (10:01) is not, and it came before
    # every payment of partition 0 (10:05 and later): nothing of partition 0 may be decided.
    await decision_log.wait_for({(1, 0)}, timeout=30)

    async def cut_seen() -> dict | None:
        state = await worker.state()
        cut = (state or {}).get("cut") or {}
        return state if cut.get("held_by") == 1 and (state or {}).get("waiting", {}).get("0") == 0 else None

    await wait_until(cut_seen, 30, "partition 0 waiting on partition 1's past")
    await decision_log.poll(0.5)
    assert not any(p == 0 for p, _ in decision_log.decided())

    await timeline.commit(deps, {1: ends[1]})
    await decision_log.wait_for(set(placed), timeout=30)
    cuts = {(d["partition"], d["offset"]): d["cut"] for d in decision_log.decisions()}
    assert cuts[(0, 0)]["at"] == "2026-11-20T10:05:00Z"
    assert cuts[(0, 0)]["watermarks"]["1"] == ends[1]


async def test_the_allowed_lateness_lets_a_payment_go_without_the_newest_evidence_of_others(
    names, producer, new_worker, deps, decision_log
):
    # Five minutes of lateness: 10:05 less 5 min is 10:00, before partition 1's first unapplied payment
    # (10:01); 10:06 less 5 min is not.
    _, _, worker = await partition_1_behind(
        names, producer, new_worker, deps, CommitTimeline(), AML_ALLOWED_LATENESS="300"
    )
    await decision_log.wait_for({(1, 0), (0, 0)}, timeout=30)

    async def held() -> dict | None:
        state = await worker.state()
        return state if (state or {}).get("waiting", {}).get("0") == 1 else None

    await wait_until(held, 30, "partition 0's second payment waiting")
    await decision_log.poll(0.5)
    assert (0, 1) not in decision_log.decided()
    cut = next(d["cut"] for d in decision_log.decisions() if (d["partition"], d["offset"]) == (0, 0))
    assert cut["at"] == "2026-11-20T10:00:00Z" and cut["frontier"] == "2026-11-20T10:01:00Z"
