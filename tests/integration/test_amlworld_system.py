"""Real AMLworld payments through the whole system alert what the replay alerts.

The model is trained and scored on a replay of Services B and C (`aml_app/training/replay.py`). Here two days
of the real files (HI-Small's half hour of background, many payments to a minute, and LI-Medium's attempts of
those days) go through Kafka, Spark, PostgreSQL, the APIs and a gated worker running the shipped model;
its alerts must be the replay's, payment for payment, hit for hit, score for score, and each of the model's
says why.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from aml_app.detection.model import load
from aml_app.detection.thresholds import AmlThresholds
from aml_app.harness.demo import with_derived_aggregates
from aml_app.harness.system import Layout, System
from aml_app.kafka.broker import EmbeddedBroker
from aml_app.simulation.amlworld import read_amlworld, read_patterns
from aml_app.simulation.amlworld_command import send_payments
from aml_app.training.replay import Services, decided
from bench.amlworld_detection import BACKGROUND, PATTERNS, timeline_of
from tests.harness import settings_for, wait_until

pytestmark = pytest.mark.integration

# Spark starts in 25-60 s and compiles its first batch in 10-30 s on a busy 2-core machine.
TIMEOUT = 600
DAYS = 2


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("c_reads", ["payments", "derived"])
async def test_real_payments_alert_in_the_system_as_in_the_replay(
    broker: EmbeddedBroker, store_url: str, tmp_path: Path, c_reads: str
) -> None:
    """With C on payments, and with C on the topic the enrichment stage derives from them: the replay
    knows nothing of the stage, so the same alerts say the derivation changes no answer the worker
    decides on."""
    patterns = read_patterns(PATTERNS)
    background = read_amlworld(BACKGROUND, prefix="amlworld-background")
    timeline = timeline_of(patterns, background)
    until = datetime.fromisoformat(timeline[0].ts) + timedelta(days=DAYS)
    timeline = [p for p in timeline if datetime.fromisoformat(p.ts) < until]
    ids = {p.payment_id for p in timeline}

    suffix = uuid.uuid4().hex[:8]
    settings = settings_for(broker, suffix)
    if c_reads == "derived":
        settings = with_derived_aggregates(settings)
    layout = Layout(
        workers={"aml": 1},
        suffix=f"-{suffix}",
        bootstrap=(broker.bootstrap,),
        store_url=store_url,
        api_replicas=1,
        worker_env={"AML_MODEL": "amlworld"},
    )
    system = System(settings, tmp_path / "system", layout)
    try:
        await system.start()
        assert (system.stage is not None) == (c_reads == "derived")
        await system.wait_ready()
        sent = await send_payments(
            system.bootstrap, settings.kafka.payments_topic, timeline, days_per_second=1
        )
        assert sent == len(timeline)
        decisions = system.decisions["aml"]

        def all_decided() -> bool:
            system.check_health()
            return len(decisions.distinct(ids)) == len(ids)

        started = time.monotonic()
        await wait_until(all_decided, TIMEOUT - 120, f"the AML worker to decide {len(ids)} payments")
        flagged = {d["payment_id"] for d in decisions.of_run(ids) if d["verdict"] == "alert"}
        tail = system.alerts["aml"]
        await wait_until(
            lambda: {a["payment_id"] for a in tail.of_run(ids)} >= flagged, 60, "the flagged payments' alerts"
        )
        alerts = tail.of_run(ids)
        print(f"{len(ids)} payments decided in {time.monotonic() - started:.0f} s, {len(alerts)} alerted")
    finally:
        await system.cleanup()

    in_system = {
        alert["payment_id"]: sorted(f"{hit['typology']}:{hit['rule']}" for hit in alert["hits"])
        for alert in alerts
    }
    model, thresholds = load("amlworld"), AmlThresholds()
    assert model is not None
    replayed, replayed_benign, replayed_score = {}, {}, {}
    for payment, evidence in decided(Services(thresholds), timeline):
        hits = model.detect(evidence, thresholds)
        if hits:
            replayed[payment.payment_id] = sorted(f"{hit.typology}:{hit.rule}" for hit in hits)
            replayed_score[payment.payment_id] = hits[0].score
        for hit in hits:
            if hit.rule == "aml.model":
                replayed_benign[payment.payment_id] = float(hit.figures["benign_probability"])
    assert sum(hit.endswith(":aml.model") for hits in replayed.values() for hit in hits) >= 20
    assert in_system == replayed
    # The worker's model sees what the replay sees, to the probability: the features come from B's and
    # C's answers as of each payment, gated, exactly as the replay computes them.
    in_system_benign = {
        alert["payment_id"]: float(hit["figures"]["benign_probability"])
        for alert in alerts
        for hit in alert["hits"]
        if hit["rule"] == "aml.model"
    }
    assert in_system_benign == pytest.approx(replayed_benign, abs=2e-6)
    # Each alert carries the model's score of its payment, the rules' beside the model too: the analysts'
    # queue ranks the system's alerts as the replay ranks them.
    assert None not in replayed_score.values()
    in_system_score = {alert["payment_id"]: alert["score"] for alert in alerts}
    assert in_system_score == pytest.approx(replayed_score, abs=2e-6)
    # Each of the worker's model alerts says why: its probability of benign against the cut, and what moved
    # the verdict most.
    said = [hit for alert in alerts for hit in alert["hits"] if hit["rule"] == "aml.model"]
    assert said and all(
        "below its cut" in hit["reason"]
        and "most telling: " in hit["reason"]
        and "benign_probability" in hit["figures"]
        for hit in said
    )
