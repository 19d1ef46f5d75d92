"""What each topic keeps: every topic but the alerts is bounded in time, and what the workers read back
outlives what can be handled again."""

from __future__ import annotations

from aml_app.kafka.broker import TopicSpec
from aml_app.settings import load_settings
from aml_app.topics import DAY_MS, topic_specs


def specs() -> dict[str, TopicSpec]:
    return {spec.name: spec for spec in topic_specs(load_settings({}))}


def test_every_topic_but_the_alerts_is_bounded_in_time() -> None:
    """One decision per payment on a compacted topic alone grows with every payment for ever."""
    for name, spec in specs().items():
        if name.endswith(".alerts"):
            continue
        assert "delete" in spec.config.get("cleanup.policy", "delete").split(","), name
        assert int(spec.config["retention.ms"]) > 0, name


def test_decisions_keep_one_record_per_payment_for_longer_than_the_payments() -> None:
    topics = specs()
    payments = int(topics["payments"].config["retention.ms"])
    for service in ("aml", "fraud"):
        decisions = topics[f"{service}.decisions"].config
        assert decisions["cleanup.policy"] == "compact,delete"
        assert int(decisions["retention.ms"]) >= payments + DAY_MS


def test_the_alerts_topic_keeps_every_alert_the_workers_recover() -> None:
    """It is the changelog of `alerts-sent`: an alert deleted while its payment can still be handled again
    (a group moved back within the payments' retention) would be sent twice."""
    for service in ("aml", "fraud"):
        alerts = specs()[f"{service}.alerts"].config
        assert alerts["cleanup.policy"] == "compact"
        assert "retention.ms" not in alerts
