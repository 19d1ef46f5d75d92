"""The Faust application: one `app`, configured from the environment, discovering agents and tables."""

from __future__ import annotations

import socket
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from aiohttp.typedefs import Middleware
from faust.types import TopicT

from aml_app.collector import settle
from aml_app.faust_internals import FetchWaitApp, PromptStopWorker
from aml_app.gate.assignments import watch_assignments
from aml_app.kafka.security import faust_credentials
from aml_app.loopback import is_loopback, loopback_hosts_only
from aml_app.models import Alert, Decision
from aml_app.settings import Settings, load_settings
from aml_app.tokens import token_required

settings = load_settings()
#: The URL other workers know this one by; Faust also names group members by it, and
#: `aml_app.gate.assignments` counts members by it: with a wildcard bind (containers) use the host's name.
canonical_host = socket.gethostname() if settings.web.host in ("0.0.0.0", "::", "") else settings.web.host


def web_middlewares(settings: Settings) -> list[Middleware]:
    """Who may ask the worker's web server (the operator page, /watermarks.json, /metrics, Faust's routes).

    Bound to a loopback address, it answers only requests addressed to one: no web page whose name an
    attacker points at 127.0.0.1 reads it (aml_app.loopback). With AML_WEB_TOKEN, only requests with the
    token, or a browser that opened the page with it once (aml_app.tokens)."""
    middlewares: list[Middleware] = []
    if is_loopback(settings.web.host):
        middlewares.append(loopback_hosts_only)
    if settings.web.token:
        middlewares.append(token_required(settings.web.token, "AML_WEB_TOKEN", login=True))
    return middlewares


class AmlApp(FetchWaitApp):
    #: Faust hard-codes 1500 ms (aml_app.faust_internals); AML_FETCH_MAX_WAIT_MS.
    fetch_max_wait_ms = settings.kafka.fetch_max_wait_ms

    async def on_started(self) -> None:
        await super().on_started()
        settle()  # the worker's start-up heap, out of the cycle collector's scans (aml_app.collector)

    async def on_first_start(self) -> None:
        # Faust creates the worker's own directory but not its parents; only workers need it.
        Path(self.conf.datadir).parent.mkdir(parents=True, exist_ok=True)
        await super().on_first_start()


app = AmlApp(
    settings.app_id,
    broker=settings.kafka.faust_brokers,
    store=settings.table_store,
    datadir=settings.worker_data_dir_template,
    # The tables, as Faust declares them; the worker's gate, agent and views are built by
    # `aml_app.agents.compose` (called by `aml-app worker` before Faust's worker starts).
    autodiscover=["aml_app.tables"],
    # Faust scans its origin too: the module that defines the app, not the whole package.
    origin="aml_app.app",
    topic_partitions=settings.kafka.partitions,
    topic_replication_factor=settings.kafka.replication_factor,
    consumer_auto_offset_reset="earliest",
    broker_session_timeout=settings.kafka.session_timeout,
    broker_heartbeat_interval=max(settings.kafka.session_timeout / 5, 0.5),
    broker_rebalance_timeout=settings.kafka.rebalance_timeout,
    broker_commit_interval=settings.kafka.commit_interval,
    # Decisions batch for a few ms instead of one produce request each (BENCHMARKS.md).
    producer_linger=settings.kafka.producer_linger_ms / 1000,
    # A lane waiting on the gate holds unacked events; Faust must not wait for them on a rebalance.
    stream_wait_empty=False,
    # Faust reads a changelog's highwater, then the offset this worker has applied, and crashes if the
    # second is higher. The watermark table is written by the leader all the time, so during a
    # rebalance that race is routine, not a sign of lost data (seen in the 1 -> 3 -> 1 test).
    recovery_consistency_check=False,
    web_bind=settings.web.host,
    web_host=settings.web.host,
    web_port=settings.web.port,
    canonical_url=f"http://{canonical_host}:{settings.web.port}",
    web_application_options={"middlewares": web_middlewares(settings)},
    # TLS/SASL from KAFKA_SECURITY_PROTOCOL etc. (None: plaintext); Faust passes it to all its clients.
    broker_credentials=faust_credentials(settings.kafka.security),
    # Stops without mode's fixed second at the end (aml_app.faust_internals).
    Worker=PromptStopWorker,
)
#: Warns at each assignment that leaves this worker without a payments partition (aml_app.gate.assignments).
assignment_watch = watch_assignments(app, settings.kafka.payments_topic, settings.app_id, settings.worker_id)


def raw_topic(name: str) -> TopicT:
    """A topic of raw key and value bytes, partitioned like `payments` (payments, dead letters, review)."""
    return app.topic(
        name,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
        partitions=settings.kafka.partitions,
    )


payments_topic = raw_topic(settings.kafka.payments_topic)
decisions_topic = app.topic(
    settings.kafka.decisions_topic, key_type=str, value_type=Decision, partitions=settings.kafka.partitions
)


async def send_decision(payment_id: str, value: bytes) -> Awaitable[Any]:
    """Hand a decision's JSON (`models.decision_json`, the `Decision` record's bytes) straight to Faust's
    producer, without the model's and `Topic.send`'s per-message work (a quarter of the probe's time in
    a profile, BENCHMARKS.md); keyed by payment id. Returns the broker's acknowledgement to come."""
    return await app.producer.send(
        decisions_topic.get_topic_name(),
        payment_id.encode(),
        value,
        partition=None,
        timestamp=None,
        headers=None,
    )


#: Also the changelog of the `alerts-sent` table (tables/alerts.py): one record is both the alert and the
#: memory that it was sent. Compacted, keyed by payment id (raw UTF-8), partitioned like `payments`.
alerts_topic = app.topic(
    settings.kafka.alerts_topic,
    key_type=str,
    value_type=Alert,
    key_serializer="raw",
    value_serializer="json",
    partitions=settings.kafka.partitions,
    compacting=True,
    acks=False,  # as Faust's own changelog topics: the worker writes it, it never consumes it as a stream
)
dlq_topic = raw_topic(settings.kafka.dlq_topic)
#: Payments decided stale (AML_WAIT_POLICY=decide-stale) or parked (AML_MAX_ATTEMPTS, `aml-app park`):
#: original bytes as the value, why in headers, as on the dead-letter topic.
review_topic = raw_topic(settings.kafka.review_topic)
