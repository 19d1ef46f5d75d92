"""Decisions that replay identically: the AML service decides payments while one partition of B and C is
held back and the others run ahead, then a second AML service decides the same payments again from the
earliest offset with B and C complete; every verdict and every rule that fired must be the same.

What makes them the same: the event-time gate admits a payment at time t only when B and C have applied
every partition's payments up to t, and B and C answer as of t (C's windows end at t; B counts only the
edges' payments made by t), so whatever else they have applied by then cannot reach the decision. The
per-partition gate, run the same way, decides a payment of the running partition without the held
partition's earlier payments: its replay differs, which shows the test can tell.

The scenario is a bipartite transfer across two partitions (payments are keyed by payer):

    t1  S1 -> D1  partition 1      t2  S2 -> D1  partition 0
    t3  S1 -> D2  partition 1      t4  S2 -> D2  partition 0  (D1 and D2 share both payers: an alert)

B and C apply partition 0 at once and partition 1 up to t1 only, so t2 is decided before t3 is in B
(had B answered from everything it holds, t2 would alert on the replay, where t3 and t4 are in B, and
not live); then they apply t3.

The real broker, B's and C's real APIs on PostgreSQL, real AML workers; the stores are fed by the test
(`tests.played_stores`), so that it can hold one partition back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from aml_app.harness.dependencies import ApiProcess
from aml_app.kafka.broker import EmbeddedBroker
from aml_app.kafka.identity import log_identity
from aml_app.kafka.tools import GroupCommitter, produce
from aml_app.settings import Settings
from tests.harness import DecisionLog, Names, wait_until
from tests.payments import PaymentRow
from tests.played_stores import Pipeline, api_settings, checked_ok, start_apis, stop_apis
from tests.stores import with_dependencies

pytestmark = pytest.mark.integration

T0 = datetime(2026, 3, 2, 9, tzinfo=UTC)
#: Heavy: above the graph's minimum average (1000 USD, 853.4 EUR).
AMOUNT = Decimal("5000.00")
DEADLINE = 60.0
RUNNING, HELD = 0, 1


def scenario(suffix: str) -> list[PaymentRow]:
    s1, s2, d1, d2 = (f"{name}-{suffix}" for name in ("S1", "S2", "D1", "D2"))
    legs = [(HELD, 0, s1, d1), (RUNNING, 0, s2, d1), (HELD, 1, s1, d2), (RUNNING, 1, s2, d2)]
    return [
        PaymentRow(p, o, f"bp-{suffix}-{n}", payer, payee, AMOUNT, "EUR", T0 + timedelta(hours=n))
        for n, (p, o, payer, payee) in enumerate(legs)
    ]


@pytest.fixture
async def apis(
    broker: EmbeddedBroker, names: Names, store_url: str, tmp_path: Path
) -> AsyncIterator[dict[str, ApiProcess]]:
    """B's and C's APIs on the test's store, checking it against the groups the gate trusts."""
    groups = dict(zip(("relations", "aggregates"), names.deps, strict=True))
    settings = api_settings(broker.bootstrap, names, store_url, groups)
    # No answer cache: it would hand the replay the live decisions' answers wherever their snapshot
    # meets the replay's need, identical by construction. The test compares what B and C answer from
    # their stores, which is what the event-time gate makes the same.
    started = start_apis(with_dependencies(settings, api_cache_answers=0), tmp_path)
    try:
        yield started
    finally:
        await stop_apis(started)


def verdicts(decisions: list[dict[str, Any]], worker: str) -> dict[tuple[int, int], tuple]:
    """(partition, offset) -> (verdict, rules) of one worker's decisions."""
    return {
        (d["partition"], d["offset"]): (d["verdict"], tuple(d["rules"]))
        for d in decisions
        if d["worker"] == worker
    }


async def decided_by(log: DecisionLog, worker: str, expected: set[tuple[int, int]]) -> dict:
    async def covered() -> dict | None:
        await log.poll(0.2)
        found = verdicts(log.decisions(), worker)
        return found if set(found) >= expected else None

    return await wait_until(covered, DEADLINE, f"{worker}'s decisions of {sorted(expected)}", interval=0)


@pytest.mark.parametrize(("mode", "replays"), [("event-time", True), ("partition", False)])
async def test_decisions_made_with_one_partition_held_back_replay_identically(
    broker: EmbeddedBroker,
    names: Names,
    producer: Any,
    deps: dict[str, GroupCommitter],
    store_url: str,
    apis: dict[str, ApiProcess],
    new_worker: Any,
    decision_log: DecisionLog,
    mode: str,
    replays: bool,
) -> None:
    paid = scenario(names.suffix)
    placed = await produce(producer, names.payments, [(p.partition, *p.record()) for p in paid])
    assert placed == [(p.partition, p.offset) for p in paid]
    t1, t2, t3, t4 = paid
    everything = {(p.partition, p.offset) for p in paid}

    log = await asyncio.to_thread(log_identity, {"bootstrap.servers": broker.bootstrap}, names.payments)
    committers = dict(zip(("relations", "aggregates"), ([c] for c in deps.values()), strict=True))
    pipeline = Pipeline(committers, with_dependencies(Settings(), store_url=store_url), log)
    for committer in deps.values():
        await committer.commit({2: 0, 3: 0})  # nothing there: quiet partitions
    # B and C: the running partition at once, the held one up to t1.
    await pipeline.apply_both([t2, t4])
    await pipeline.apply_both([t1])
    for api in apis.values():
        await wait_until(lambda a=api: checked_ok(a), DEADLINE, f"the {api.kind} API to find its store whole")

    env = {
        "AML_SERVICE": "aml",
        "AML_GATE_MODE": mode,
        "AML_RELATIONS_URL": apis["relations"].url,
        "AML_AGGREGATES_URL": apis["aggregates"].url,
    }
    live = new_worker(**env)
    await live.wait_ready(set(range(names.partitions)), timeout=DEADLINE)
    admitted = {(t1.partition, t1.offset), (t2.partition, t2.offset)}
    if mode == "partition":  # the running partition is wholly applied: t4 goes too
        admitted.add((t4.partition, t4.offset))
    await decided_by(decision_log, live.worker_id, admitted)
    # The held partition's t3 comes in; everything is decided.
    await pipeline.apply_both([t3])
    decided_live = await decided_by(decision_log, live.worker_id, everything)
    live.stop(grace=10)

    # The same payments decided again from the earliest offset, by a new AML service, B and C complete.
    again = new_worker(AML_APP_ID=f"{names.app_id}-replay", **env)
    await again.wait_ready(set(range(names.partitions)), timeout=DEADLINE)
    replayed = await decided_by(decision_log, again.worker_id, everything)

    # The replay's verdicts are those of the payments' own times: only t4 completes the bipartite block.
    assert replayed == {
        (t1.partition, t1.offset): ("clear", ()),
        (t2.partition, t2.offset): ("clear", ()),
        (t3.partition, t3.offset): ("clear", ()),
        (t4.partition, t4.offset): ("alert", ("aml.bipartite",)),
    }, replayed
    if replays:
        assert decided_live == replayed
    else:
        # Decided before the held partition's t3 was in B: no block yet.
        assert decided_live[(t4.partition, t4.offset)] == ("clear", ()), decided_live
