"""The leader's refresh against a read that never answers (`AML_FAILPOINT=refresh-hang`: it waits forever
and swallows its cancellation, as aiokafka's consumer did after a broker froze): the refresh is abandoned
at its deadline, the leader says it is stuck on its views and metrics, rebuilds its clients, then leaves
its group, and the other worker leads and decides every payment."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aml_app.harness.verify import CommitTimeline
from aml_app.kafka.tools import produce
from tests.harness import ends_of, payments_for, wait_until

pytestmark = pytest.mark.integration
DEADLINE = "3"
PACE = {"AML_REFRESH_INTERVAL": "0.3", "AML_REFRESH_DEADLINE": DEADLINE}


async def metric(worker, name: str) -> float | None:
    async with aiohttp.ClientSession() as session, session.get(f"{worker.url}/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


@pytest.mark.timeout(300)
async def test_a_leader_whose_refresh_hangs_says_so_then_leaves_so_another_leads(
    names, producer, new_worker, deps, decision_log
):
    # A refresh every 0.3 s bounded at 3 s: stuck after 6 s (`RefreshPolicy.stuck_after`), gone 9 s later.
    stuck = new_worker(AML_FAILPOINT="refresh-hang", **PACE)

    async def leading() -> dict | None:
        state = await stuck.state()
        return state if state and not state["recovering"] and state["is_leader"] else None

    await wait_until(leading, 60, "the worker with the hanging refresh to lead")
    placed = await produce(producer, names.payments, payments_for(names.partitions, 5, "h"))
    await CommitTimeline().commit(deps, ends_of(placed))
    healthy = new_worker(**PACE)

    async def says_stuck() -> dict | None:
        state = await stuck.state()
        refresh = state["refresh"] if state else None
        return refresh if refresh and refresh["state"] == "stuck" and state["is_leader"] else None

    refresh = await wait_until(says_stuck, 90, "the stuck leader to say so")
    assert refresh["overruns"] >= 1 and refresh["client_rebuilds"] == 1, refresh
    assert f"took longer than {DEADLINE} s and was abandoned" in refresh["last_error"], refresh
    assert await metric(stuck, "aml_refresh_stuck") == 1.0
    assert (await metric(stuck, "aml_admin_refresh_overruns_total") or 0) >= 1
    assert decision_log.decided() == set()  # nothing decided on watermarks nobody could read

    await wait_until(lambda: not stuck.alive(), 120, "the stuck leader to leave its group")
    assert "even with new Kafka clients" in stuck.log_text()
    assert "so that another worker leads" in stuck.log_text()
    await decision_log.wait_for(set(placed), timeout=90)
    made = decision_log.decisions()
    assert {d["worker"] for d in made} == {healthy.worker_id}
    assert len(made) == len(placed)
    state = await healthy.state()
    assert state is not None and state["is_leader"] and state["refresh"]["state"] == "ok"
