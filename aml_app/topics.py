"""Every topic of the system and its configuration, in one place.

Used by `aml-app broker` (the embedded development broker), the demo, and as the reference for a real
cluster (`aml-app topics` prints it). Keyed outputs (decisions and alerts, keyed by payment id) are
compacted, so re-processing after a crash leaves one record per payment once the log is compacted.
Every topic but the alerts keeps a time-based retention: one decision per payment would otherwise grow
the decisions topic with every payment for ever. The alerts topic is compacted only: it is the changelog
of `alerts-sent`, the record of what was alerted on, and a worker that recovers it must find every alert
a payment still in the payments topic could be handled again for.
"""

from __future__ import annotations

from aml_app.kafka.broker import TopicSpec
from aml_app.settings import Settings, available_services

DAY_MS = 24 * 3600 * 1000
PAYMENTS_RETENTION_DAYS = 7
DECISIONS_RETENTION_DAYS = 30
#: Services that publish decisions and alerts (the probe writes only to topics a test names).
DETECTING = ("aml", "fraud")


def service_topics(service: str, suffix: str = "") -> tuple[str, str]:
    """Default (decisions, alerts) topics of a service; `suffix` keeps test runs on one broker apart."""
    return f"{service}.decisions{suffix}", f"{service}.alerts{suffix}"


def review_topic(service: str, suffix: str = "") -> str:
    """Default review topic of a service: payments decided stale or parked, for a person to look at."""
    return f"{service}.review{suffix}"


def topic_specs(settings: Settings, suffix: str = "") -> list[TopicSpec]:
    """The payments topic, its dead-letter topic, and every detecting service's decisions, alerts, review."""
    n, rf = settings.kafka.partitions, settings.kafka.replication_factor
    keyed = {"cleanup.policy": "compact", "min.insync.replicas": str(min(2, rf))}
    # A payment's decision outlives the payment (7 days) by long enough for a downstream store to copy it.
    decided = keyed | {
        "cleanup.policy": "compact,delete",
        "retention.ms": str(DECISIONS_RETENTION_DAYS * DAY_MS),
    }
    specs = [
        TopicSpec(
            settings.kafka.payments_topic,
            n,
            rf,
            {"retention.ms": str(PAYMENTS_RETENTION_DAYS * DAY_MS), "min.insync.replicas": str(min(2, rf))},
            "payments, key = payer",
        ),
        TopicSpec(
            settings.kafka.dlq_topic,
            n,
            rf,
            {"retention.ms": str(30 * DAY_MS)},
            "dead letters: bytes + reason",
        ),
        TopicSpec(
            settings.kafka.enriched_topic,
            n,
            rf,
            {"retention.ms": str(PAYMENTS_RETENTION_DAYS * DAY_MS), "min.insync.replicas": str(min(2, rf))},
            "payments with their amount in the reporting currency (aml-app enrich), by payee",
        ),
    ]
    for service in [s for s in DETECTING if s in available_services()]:
        # This worker's own service may have its topics renamed; the others keep their default names.
        mine = service == settings.service
        decisions, alerts = (
            (settings.kafka.decisions_topic, settings.kafka.alerts_topic)
            if mine
            else service_topics(service, suffix)
        )
        review = settings.kafka.review_topic if mine else review_topic(service, suffix)
        specs.append(
            TopicSpec(decisions, n, rf, decided, f"{service}: one decision per payment, key = payment id")
        )
        specs.append(
            TopicSpec(alerts, n, rf, keyed, f"{service}: flagged payments with evidence, key = payment id")
        )
        specs.append(
            TopicSpec(
                review,
                n,
                rf,
                {"retention.ms": str(30 * DAY_MS)},
                f"{service}: payments decided stale or parked: bytes + why",
            )
        )
    return specs
