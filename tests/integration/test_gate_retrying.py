"""A payment whose handler keeps failing is retried, never skipped, and visible while it fails: in
`/watermarks.json`, `/metrics` and `aml-app status`. The probe's `AML_PROBE_FAIL` makes the
first attempts at one payment fail, as a 4xx from a dependency or a bug in a rule would."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka.tools import produce
from tests.harness import committed_offsets, ends_of, payments_for, wait_until
from tests.integration.test_status import status, table

pytestmark = pytest.mark.integration

FAILING = "r-0-1"  # payments_for(..., "r"): partition 0, offset 1
ATTEMPTS = 10  # about 13 s of jittered backoff at least: time to look at every view


async def test_a_failing_payment_is_retried_in_place_and_shown_as_retrying(
    broker, names, producer, new_worker, deps, decision_log
):
    placed = await produce(producer, names.payments, payments_for(names.partitions, 4, "r"))
    timeline = CommitTimeline()
    await timeline.commit(deps, ends_of(placed))
    worker = new_worker(AML_PROBE_FAIL=f"{FAILING}:{ATTEMPTS}")

    async def shown() -> dict | None:
        state = await worker.state()
        if not state or not state["retrying"] or state["retrying"][0]["attempts"] < 2:
            return None
        return state

    state = await wait_until(shown, 60, "the failing payment to show as retrying")
    [entry] = state["retrying"]
    assert (entry["partition"], entry["offset"], entry["payments"]) == (0, 1, 1)
    assert entry["worker"] == worker.worker_id
    assert entry["error"].startswith("ProbeFailure: AML_PROBE_FAIL: attempt")
    assert entry["since"] <= state["generated_at"] and entry["retrying_for_s"] >= 0
    assert state["handler_failures"] >= 2

    async with aiohttp.ClientSession() as session, session.get(f"{worker.url}/metrics") as response:
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [attempts] = families["aml_payment_retrying_attempts"].samples
    [offset] = families["aml_payment_retrying_offset"].samples
    assert attempts.labels == offset.labels == {"service": "probe", "partition": "0"}
    assert attempts.value >= 2 and offset.value == 1

    code, out, err = await status({}, "--worker", worker.url)
    assert code == 1, err  # a payment retried: a monitoring check's warning
    [row] = table(out, "PARTITION  OFFSET")
    assert (row["PARTITION"], row["OFFSET"], row["WORKER"]) == ("0", "1", worker.worker_id)
    assert row["ERROR"].startswith("ProbeFailure")

    # Meanwhile nothing behind it on partition 0 is decided or committed; the other partitions flow.
    await decision_log.wait_for({(p, o) for p, o in placed if p != 0 or o < 1}, timeout=30)
    assert not any(p == 0 and o >= 1 for p, o in decision_log.decided())
    committed = await committed_offsets(broker.bootstrap, names.app_id, names.payments, names.partitions)
    assert committed[0] <= 1, committed

    await decision_log.wait_for(set(placed), timeout=90)
    made = decision_log.decisions()
    assert premature(made, names.deps, timeline) == []
    assert len(made) == len({d["payment_id"] for d in made}) == len(placed)

    async def cleared() -> bool:
        state = await worker.state()
        return bool(state) and state["retrying"] == []

    await wait_until(cleared, 30, "retrying to clear once the payment went through")
    final = await worker.state()
    assert final["handler_failures"] == ATTEMPTS
