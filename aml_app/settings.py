"""Typed configuration read from the environment, validated once at start-up.

Every setting has a sane default for the embedded demo; a bad value stops the process with a sentence
that names the variable, the value and what was expected, instead of a stack trace later.

`Settings` holds the worker's identity and one frozen group per thing configured (`KafkaSettings`,
`GateSettings`, `DependencySettings`, `PipelineSettings`, `DetectionSettings`, `WebSettings`); each group
is read by its own function, and `load_settings` composes them and checks what spans two of them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from aml_app import dependency_services as registry
from aml_app.contract import DEFAULT_MAX_CLOCK_SKEW, MAX_VALID_PAYMENT_BYTES
from aml_app.dependency_services import DependencyService, Endpoint
from aml_app.detection.model_settings import DEFAULT_BAND, DEFAULT_THRESHOLD, record
from aml_app.detection.thresholds import AmlThresholds, FraudThresholds
from aml_app.errors import ConfigError
from aml_app.failpoints import NAMES as FAILPOINTS
from aml_app.kafka.security import KafkaSecurity, load_security
from aml_app.numbers import DECIMAL_PLACES, WHOLE_TEXT, ascii_decimal, decimal_places

_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_GROUP = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


def available_services() -> list[str]:
    """The gated services a worker can run: one module each in the `agents` folder (`aml_app.agents`)."""
    spec = importlib.util.find_spec("aml_app.agents")
    if spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(next(iter(spec.submodule_search_locations)))
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


class GateMode(StrEnum):
    """AML_GATE_MODE: what a payment waits for at the gate."""

    #: Every partition's dependencies have applied what happened up to the payment
    #: (aml_app.gate.event_time): the AML service's default.
    EVENT_TIME = "event-time"
    #: B and C have applied the payment itself: enough for rules that read the payer's side only; the
    #: other services' default.
    PARTITION = "partition"


class WaitPolicy(StrEnum):
    """AML_WAIT_POLICY: what happens to a payment that waits past AML_MAX_WAIT."""

    #: It keeps waiting, with the service shown as breached.
    WAIT = "wait"
    #: It is decided on the evidence there is, the decision marked stale, and written to the review topic.
    DECIDE_STALE = "decide-stale"


class ProbeCostKind(StrEnum):
    """AML_PROBE_COST_KIND: what the probe's cost per payment is (agents/probe.py)."""

    #: A busy loop.
    CPU = "cpu"
    #: A blocking sleep that holds the event loop without using CPU, like a synchronous client call.
    BLOCK = "block"
    #: An asyncio sleep, like an awaited call.
    WAIT = "wait"


@dataclass(frozen=True)
class KafkaSettings:
    """The cluster, the topics, what a payment record on them may be, and the Kafka clients' pace."""

    bootstrap_servers: tuple[str, ...] = ("127.0.0.1:9092",)
    #: TLS and SASL for every Kafka client (aml_app.kafka.security): KAFKA_SECURITY_PROTOCOL, KAFKA_SASL_*,
    #: KAFKA_SSL_*. Its repr leaves the password out.
    security: KafkaSecurity = field(default_factory=KafkaSecurity)
    payments_topic: str = "payments"
    #: AML_ENRICHED_TOPIC / AML_ENRICHMENT_GROUP: the topic the enrichment stage (`aml-app enrich`)
    #: derives from payments, and the stage's consumer group on payments.
    enriched_topic: str = "payments.enriched"
    enrichment_group: str = "enrichment"
    decisions_topic: str = "aml.decisions"
    alerts_topic: str = "aml.alerts"
    dlq_topic: str = "payments.dlq"
    #: AML_REVIEW_TOPIC: payments decided stale or parked, with their original bytes and why.
    review_topic: str = "aml.review"
    partitions: int = 4
    replication_factor: int = 1
    #: AML_MAX_PAYMENT_BYTES: larger payment records go to the DLQ, from the workers and the pipeline. At
    #: most `MAX_VALID_PAYMENT_BYTES`, so that a valid payment fits in one record wherever it is copied (the
    #: derived topic, the review topic) at Kafka's 1 MB defaults.
    max_payment_bytes: int = 65536
    #: AML_MAX_CLOCK_SKEW, seconds: how far a payment's `ts` may be after its Kafka record's timestamp
    #: before every consumer (workers and pipeline) dead-letters it (aml_app.contract).
    max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW
    #: AML_PAYMENTS_TRANSACTIONAL: whether the producers of `payments` write it in transactions, whose
    #: markers take offsets: the pipeline then crosses a jump in offsets at once, else it reads it again
    #: (a jump in a topic without markers is records its client skipped).
    payments_transactional: bool = False
    session_timeout: float = 10.0
    rebalance_timeout: float = 10.0
    commit_interval: float = 1.0
    fetch_max_wait_ms: int = 100
    producer_linger_ms: int = 5
    #: AML_STARTUP_WAIT: seconds a starting worker waits for the Kafka cluster to answer before it stops
    #: with one sentence (a cluster that starts beside it takes a while).
    startup_wait: float = 15.0
    #: AML_BROKER_PORT: the port of the embedded broker (`aml-app broker`, the demo).
    broker_port: int = 9092

    @property
    def faust_brokers(self) -> list[str]:
        return [f"kafka://{server}" for server in self.bootstrap_servers]


@dataclass(frozen=True)
class GateSettings:
    """The freshness gate: what a payment waits for and how long, the watermark refresh's pace, the
    lanes' bounds, and when the operator views call a dependency stalled or lagging."""

    #: AML_GATE: off processes without waiting (for comparisons only).
    enabled: bool = True
    #: AML_GATE_MODE; its default depends on the service (`GateMode`).
    mode: GateMode = GateMode.EVENT_TIME
    #: AML_ALLOWED_LATENESS, seconds: how far behind the payment's event time the event-time gate lets
    #: the other partitions' applied evidence be (0: none, decisions replay identically).
    allowed_lateness: float = 0.0
    #: AML_MAX_WAIT, seconds: how long a payment may wait at the gate before the wait policy applies.
    max_wait: float = 300.0
    wait_policy: WaitPolicy = WaitPolicy.WAIT
    #: AML_MAX_ATTEMPTS: failed attempts after which a payment is parked on the review topic and its lane
    #: moves on; 0 (the default): never, the lane retries until it succeeds.
    max_attempts: int = 0
    refresh_interval: float = 1.0
    #: AML_FAST_REFRESH_INTERVAL: while a payment waits, a dependency's commit opens the gate within this
    #: interval plus one refresh; each refresh costs the leader about 1.7 ms of CPU, 3.6 with the
    #: event-time gate's reads (BENCHMARKS.md, "Capacity": 25 ms takes about 50 ms off the gate's share at
    #: 50/s for 4 % of a core per leader; `capacity_rate10_quiet.json`: the AML leader against a follower).
    fast_refresh_interval: float = 0.025
    #: How old a watermark row may be and still open the gate (AML_WATERMARK_MAX_AGE; by default five
    #: refresh intervals): a leader that stops refreshing closes the gate instead of leaving it open.
    watermark_max_age: float = 5.0
    #: AML_REFRESH_DEADLINE: how long one refresh of the watermark table may take before it is abandoned
    #: with its Kafka clients; 0: five refresh intervals, at least 10 s (`RefreshPolicy.refresh_deadline`).
    refresh_deadline: float = 0.0
    max_pending_per_partition: int = 1000
    #: Payments per partition whose decision is sent and not yet acknowledged by the broker (pipelined).
    max_in_flight: int = 1000
    #: The operator views (aml_app.gate.health): when a dependency counts as stalled or lagging.
    stall_after: float = 30.0
    lag_warn: int = 1000


@dataclass(frozen=True)
class DependencySettings:
    """Services B and C: where their APIs and their stores are, what their APIs may cost, and what the
    stores keep and count."""

    #: Each dependency service's group, API port and API replicas, by name (`AML_<NAME>_GROUP`,
    #: `AML_<NAME>_PORT`, `AML_<NAME>_URL`; `aml_app.dependency_services`).
    endpoints: Mapping[str, Endpoint] = field(
        default_factory=lambda: {name: s.default_endpoint() for name, s in registry.SERVICES.items()}
    )
    services_host: str = "127.0.0.1"
    #: Where Services B and C keep their state (PostgreSQL), as the pipeline's role, which owns the
    #: stores; `aml-app postgres` runs an embedded server here.
    store_url: str = "postgresql://aml_pipeline@127.0.0.1:5433/aml"
    #: AML_API_STORE_URL: the database as B's and C's APIs read it, as a role that may only read (the
    #: pipeline writes with AML_STORE_URL); empty: AML_STORE_URL. `aml-app postgres` provisions both.
    api_store_url: str = ""
    #: AML_API_TOKEN: when set, B's and C's APIs answer only requests that carry it as a bearer token
    #: (`Authorization: Bearer ...`; /health stays open for load balancers), and the workers send it.
    #: Kept out of every repr and log line.
    api_token: str = field(default="", repr=False)
    http_timeout: float = 5.0
    #: AML_FRESHNESS_WAIT: how long B and C may wait for their stores to cover a question's payments
    #: before answering "not yet" (less than the HTTP timeout).
    freshness_wait: float = 2.0
    #: AML_API_MAX_ROWS: the most entries one request to B lists in its `out` parts together (and in its
    #: `in` parts, and its `neighbourhood` parts), at least 200 (more than one counterparty's currencies);
    #: AML_API_TIMEOUT: the seconds B and C may spend computing one request's answers
    #: (aml_app.dependencies.api.Limits).
    api_max_rows: int = 50_000
    api_timeout: float = 10.0
    #: AML_API_CACHE_ANSWERS: how many batch answers each replica of B and C keeps for the next detector
    #: asking the same question (aml_app.dependencies.answer_cache; 0: none).
    api_cache_answers: int = 10_000
    api_access_log: bool = True
    #: AML_REPORTING_THRESHOLD / AML_THRESHOLD_BAND: what C's store counts as near the threshold; the
    #: store keeps the pair it was built with and refuses a pipeline with another.
    reporting_threshold: Decimal = DEFAULT_THRESHOLD
    threshold_band: Decimal = DEFAULT_BAND
    #: AML_AGGREGATES_RETENTION: seconds C keeps flows past its longest window (7 days) before its newest
    #: event time: how far behind its head C answers exactly (a lagging partition, a replay).
    aggregates_retention: float = 86400.0

    @property
    def reader_url(self) -> str:
        """The URL the APIs read the stores with: AML_API_STORE_URL, else AML_STORE_URL."""
        return self.api_store_url or self.store_url


@dataclass(frozen=True)
class PipelineSettings:
    """The Spark pipeline that fills B's and C's stores, and the enrichment stage beside it."""

    spark_master: str = "local[2]"
    trigger_interval: float = 0.5
    max_records_per_trigger: int = 100_000
    #: AML_PIPELINE_METRICS_PORT: the port of the pipeline's Prometheus `/metrics` on AML_SERVICES_HOST
    #: (aml_app.pipeline.metrics; 0: none).
    metrics_port: int = 8090
    #: AML_ENRICHMENT_METRICS_PORT: the port of the enrichment stage's `/metrics` and `/health` on
    #: AML_SERVICES_HOST (`aml-app enrich`; 0: none).
    enrichment_metrics_port: int = 8091
    #: AML_SPARK_CLASS_ARCHIVES: the folder of the Spark driver's class archives (`aml-app spark-archive`
    #: makes one; aml_app.pipeline.class_archive), relative to the working directory; None: none used.
    class_archives: Path | None = Path("var/jvm")
    #: AML_SPARK_UI: Spark's web UI for `aml-app pipeline` (port 4040).
    spark_ui: bool = False


@dataclass(frozen=True)
class DetectionSettings:
    """What the detectors decide with: the batch they decide together, the rules' thresholds, the
    learned model, and the probe service's knobs."""

    #: AML_MAX_BATCH: payments of one partition decided together (one request to B and one to C), at
    #: most 500: two queries each, and an API answers at most 1000 queries per request.
    max_batch: int = 100
    aml_thresholds: AmlThresholds = field(default_factory=AmlThresholds)
    fraud_thresholds: FraudThresholds = field(default_factory=FraudThresholds)
    #: AML_MODEL: the learned AML model beside the rules (aml_app.detection.model): '' (off), 'amlworld'
    #: (the one shipped with the package) or the path of a model file.
    aml_model: str = ""
    #: AML_ALERT_BUDGET: the share of benign payments the model and the rules beside it may alert (one of
    #: the model file's budgets, or the largest below); None: the file's own cut.
    aml_alert_budget: float | None = None
    #: Benchmarking knob of the probe service only (agents/probe.py): a cost per payment, in ms, and
    #: its kind.
    probe_cost_ms: float = 0.0
    probe_cost_kind: ProbeCostKind = ProbeCostKind.CPU
    #: Testing knob of the probe service only: payment id -> how many attempts at it fail (a handler
    #: that keeps failing, like a 4xx from B or C or a rule bug: shown as `retrying`).
    probe_fail: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class WebSettings:
    """A worker's web server: the operator page, /watermarks.json, /metrics and /health."""

    host: str = "127.0.0.1"
    port: int = 6066
    #: AML_WEB_TOKEN: when set, the web server answers only requests that carry it (`aml_app.tokens`;
    #: /health stays open for probes), and `aml-app status --worker` sends it. Kept out of every repr and
    #: log line.
    token: str = field(default="", repr=False)


@dataclass(frozen=True)
class Settings:
    """One process's settings: which service it is and what it waits for, then one group per thing
    configured."""

    #: Which gated service this worker runs: the module agents/<service>.py (aml, fraud, ...).
    service: str = "aml"
    app_id: str = "aml"
    #: The consumer groups the gate waits for: by default every dependency service's own group, in the
    #: registry's order (`aml_app.dependency_services`).
    depends_on: tuple[str, ...] = field(default_factory=lambda: tuple(registry.SERVICES))
    #: AML_DERIVED_DEPENDENCIES: the groups of `depends_on` that read a topic derived from payments, each
    #: with that topic and the derivation stage's group on payments (`aml_app.kafka.derivation`).
    derived_dependencies: dict[str, tuple[str, str]] = field(default_factory=dict)
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    data_dir: str = "var/aml"
    table_store: str = "rocksdb://"
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    gate: GateSettings = field(default_factory=GateSettings)
    dependencies: DependencySettings = field(default_factory=DependencySettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    detection: DetectionSettings = field(default_factory=DetectionSettings)
    web: WebSettings = field(default_factory=WebSettings)

    def model_settings(self) -> tuple[tuple[str, str], ...]:
        """The settings a learned model's features are computed with, as `aml-app train-model` records
        them (`aml_app.detection.model_settings`); hashable, for the cached `model.load`."""
        own = record(
            self.detection.aml_thresholds,
            self.dependencies.reporting_threshold,
            self.dependencies.threshold_band,
        )
        return tuple(sorted(own.items()))

    def with_endpoint(self, name: str, **changes: Any) -> Settings:
        """These settings with dependency service `name`'s group, port or API replicas changed."""
        deps = self.dependencies
        endpoint = dataclasses.replace(deps.endpoints[name], **changes)
        endpoints = {**deps.endpoints, name: endpoint}
        return dataclasses.replace(self, dependencies=dataclasses.replace(deps, endpoints=endpoints))

    # Services B and C by name, for the detectors' client and the tools that know them.
    @property
    def relations_group(self) -> str:
        return registry.SERVICES["relations"].group(self)

    @property
    def aggregates_group(self) -> str:
        return registry.SERVICES["aggregates"].group(self)

    @property
    def relations_port(self) -> int:
        return registry.SERVICES["relations"].port(self)

    @property
    def aggregates_port(self) -> int:
        return registry.SERVICES["aggregates"].port(self)

    @property
    def relations_urls(self) -> tuple[str, ...]:
        return registry.SERVICES["relations"].urls(self)

    @property
    def aggregates_urls(self) -> tuple[str, ...]:
        return registry.SERVICES["aggregates"].urls(self)

    @property
    def worker_data_dir(self) -> str:
        """RocksDB holds a lock per directory, so each worker on a host needs its own: one per web port."""
        return os.path.join(self.data_dir, f"{self.app_id}-{self.web.port}")

    @property
    def worker_data_dir_template(self) -> str:
        """`worker_data_dir` as a Faust path template (Faust formats `datadir` with `conf=` when read), so
        that `aml-app worker -p PORT`, which sets the port after these settings are read, moves it too."""
        folder = os.path.join(self.data_dir, self.app_id).replace("{", "{{").replace("}", "}}")
        return folder + "-{conf.web_port}"


def _refresh_deadline(env: Mapping[str, str], interval: float) -> float:
    """AML_REFRESH_DEADLINE: 0 (derived), or at least the refresh interval it bounds."""
    deadline = _float(env, "AML_REFRESH_DEADLINE", 0.0, 0.0, 3600)
    if 0 < deadline < interval:
        raise ConfigError(
            f"AML_REFRESH_DEADLINE={deadline:g} is shorter than AML_REFRESH_INTERVAL={interval:g}: a refresh "
            "would be abandoned before the next one is due; set it to at least the interval, or 0."
        )
    return deadline


def _token(env: Mapping[str, str], name: str) -> str:
    """A secret shared by processes: empty (none), or 16 to 512 printable ASCII characters without
    spaces. ASCII, because a WSGI server hands header values decoded as Latin-1 and aiohttp as UTF-8:
    a token with "ä" opened the workers and was refused by the pipeline's and the stage's /metrics."""
    value = env.get(name, "")
    if value and not (
        16 <= len(value) <= 512
        and value.isascii()
        and value.isprintable()
        and not any(c.isspace() for c in value)
    ):
        raise ConfigError(
            f"{name} must be 16 to 512 printable ASCII characters without spaces (its value is not shown)."
        )
    return value


def _text(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name)
    return default if value is None or value.strip() == "" else value.strip()


def _folder_or_none(env: Mapping[str, str], name: str, default: Path | None) -> Path | None:
    """A folder's path; set and empty: None (none used)."""
    value = env.get(name)
    if value is None:
        return default
    return Path(value.strip()) if value.strip() else None


def _int(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = _text(env, name, str(default))
    # Digits 0-9 only: Python's int() also takes "1_0" and other scripts' digits.
    if not WHOLE_TEXT.fullmatch(raw.strip()):
        raise ConfigError(f"{name}={raw!r} is not a whole number; expected {low}..{high}.")
    value = int(raw)
    if not low <= value <= high:
        raise ConfigError(f"{name}={value} is out of range; expected {low}..{high}.")
    return value


def _float(
    env: Mapping[str, str], name: str, default: float, low: float, high: float, unit: str = "seconds"
) -> float:
    raw = _text(env, name, str(default))
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of {unit}.") from None
    if not low <= value <= high:
        raise ConfigError(f"{name}={value} is out of range; expected {low}..{high} {unit}.")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _text(env, name, "on" if default else "off").lower()
    if raw in {"1", "true", "on", "yes"}:
        return True
    if raw in {"0", "false", "off", "no"}:
        return False
    raise ConfigError(f"{name}={raw!r} is not a switch; use on or off.")


def _decimal(env: Mapping[str, str], name: str, default: Decimal, low: Decimal, high: Decimal) -> Decimal:
    raw = _text(env, name, str(default))
    shown = f"{format(low, 'f')}..{format(high, 'f')}"
    value = ascii_decimal(raw)
    if value is None:
        raise ConfigError(f"{name}={raw!r} is not a decimal number; expected {shown}.")
    if not low <= value <= high:
        raise ConfigError(f"{name}={raw.strip()} is out of range; expected {shown}.")
    if decimal_places(value) > DECIMAL_PLACES:
        # The band's bounds (threshold x (1 - band)) are then exact at 8 places, as Spark compares them.
        raise ConfigError(f"{name}={raw.strip()} has more than {DECIMAL_PLACES} decimal places.")
    return value


def _servers(env: Mapping[str, str], name: str, default: str) -> tuple[str, ...]:
    raw = _text(env, name, default)
    servers = tuple(s.strip().removeprefix("kafka://") for s in raw.split(",") if s.strip())
    for server in servers:
        host, sep, port = server.rpartition(":")
        if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise ConfigError(
                f"{name}={raw!r}: {server!r} is not host:port; "
                "expected a comma-separated list such as broker1:9092,broker2:9092."
            )
    if not servers:
        raise ConfigError(f"{name} is empty; expected host:port[,host:port...].")
    return servers


def _name(env: Mapping[str, str], var: str, default: str, pattern: re.Pattern[str], what: str) -> str:
    value = _text(env, var, default)
    if not pattern.match(value) or value in {".", ".."}:
        raise ConfigError(
            f"{var}={value!r} is not a valid Kafka {what} name "
            "(letters, digits, '.', '_' and '-', at most 249)."
        )
    return value


def _urls(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """Comma-separated http(s) URLs: the replicas of one API."""
    urls = tuple(u.strip().rstrip("/") for u in _text(env, name, "").split(",") if u.strip())
    for url in urls:
        if not re.match(r"^https?://[^/\s]+", url):
            raise ConfigError(
                f"{name}: {url!r} is not an http(s) URL; expected one or more, comma-separated, such as "
                "http://relations-1:8081,http://relations-2:8081."
            )
    if len(set(urls)) != len(urls):
        raise ConfigError(f"{name} names a URL twice.")
    return urls


def _endpoint(env: Mapping[str, str], service: DependencyService) -> Endpoint:
    default = service.default_endpoint()
    return Endpoint(
        group=_name(env, service.group_env, default.group, _GROUP, "consumer group"),
        port=_int(env, service.port_env, default.port, 1, 65535),
        api=_urls(env, service.urls_env),
    )


def _store_url(env: Mapping[str, str], name: str, default: str) -> str:
    """A libpq connection URI (postgresql://user:password@host:port/database?sslmode=...)."""
    value = _text(env, name, default)
    if not re.match(r"^postgres(ql)?://", value):
        raise ConfigError(
            f"{name}={value[:60]!r} is not a PostgreSQL URL such as postgresql://user:password@host:5432/aml "
            "(TLS and other libpq settings go in its query string, e.g. ?sslmode=verify-full)."
        )
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(value)
    except Exception as exc:
        raise ConfigError(f"{name} is not a valid PostgreSQL URL: {str(exc).strip()}") from None
    for port in str(params.get("port") or "5432").split(","):
        if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
            raise ConfigError(f"{name} has the port {port!r}; a port is a whole number 1..65535.")
    return value


def _failures(env: Mapping[str, str], name: str) -> dict[str, int]:
    """`id1:3,id2:10` -> {"id1": 3, "id2": 10}."""
    out: dict[str, int] = {}
    for item in _text(env, name, "").split(","):
        if not item.strip():
            continue
        payment_id, _, count = item.strip().rpartition(":")
        if not payment_id or not count.isdigit() or not 1 <= int(count) <= 1_000_000:
            raise ConfigError(
                f"{name}={env.get(name)!r}: expected PAYMENT_ID:ATTEMPTS[,...] with 1..1000000 attempts."
            )
        out[payment_id] = int(count)
    return out


def _aml_model(env: Mapping[str, str]) -> str:
    """'' (off), 'amlworld' or the path of a file; the file's content is checked when the worker starts
    (`aml_app.detection.model.load`, from the command line)."""
    value = env.get("AML_MODEL", "").strip()
    if value.lower() in ("", "off"):
        return ""
    if value != "amlworld" and not Path(value).is_file():
        raise ConfigError(f"AML_MODEL={value!r} is neither 'amlworld', 'off' nor a model file.")
    return value


def _alert_budget(env: Mapping[str, str]) -> float | None:
    """None (the model file's own cut) or a share of benign payments in (0, 1), for a model only; the
    model file says whether it has such a budget (`aml_app.detection.model.load`)."""
    if not env.get("AML_ALERT_BUDGET", "").strip():
        return None
    value = _float(env, "AML_ALERT_BUDGET", 0.0, 1e-6, 0.5, unit="(a share of benign payments)")
    if not _aml_model(env):
        raise ConfigError("AML_ALERT_BUDGET sets the learned model's cut; set AML_MODEL too.")
    return value


def _derived_dependencies(
    env: Mapping[str, str], depends: tuple[str, ...], app_id: str, payments_topic: str
) -> dict[str, tuple[str, str]]:
    """AML_DERIVED_DEPENDENCIES: `group:topic:stage-group`, comma-separated."""
    raw = _text(env, "AML_DERIVED_DEPENDENCIES", "")
    derived: dict[str, tuple[str, str]] = {}
    for entry in (e.strip() for e in raw.split(",") if e.strip()):
        parts = entry.split(":")
        if len(parts) != 3 or not (
            _GROUP.match(parts[0]) and _TOPIC.match(parts[1]) and _GROUP.match(parts[2])
        ):
            raise ConfigError(
                f"AML_DERIVED_DEPENDENCIES: {entry!r} is not group:topic:stage-group (the dependency group, "
                "the topic derived from payments it reads, the consumer group of the stage that writes it)."
            )
        group, topic, stage = parts
        if group not in depends:
            raise ConfigError(
                f"AML_DERIVED_DEPENDENCIES names {group!r}, which AML_DEPENDS_ON does not list."
            )
        if group in derived:
            raise ConfigError(f"AML_DERIVED_DEPENDENCIES names {group!r} twice.")
        if topic == payments_topic:
            raise ConfigError(
                f"AML_DERIVED_DEPENDENCIES: {group!r} reads {topic!r}, the payments topic itself; leave it "
                "out (only groups reading a derived topic belong there)."
            )
        if stage == app_id or stage in depends:
            whose = "this service's own" if stage == app_id else "the dependency's own"
            if stage not in (app_id, group):
                whose = "another dependency's"
            raise ConfigError(
                f"AML_DERIVED_DEPENDENCIES: the stage group of {group!r} is {stage!r}, which is "
                f"{whose} group; name the group the derivation stage commits on payments."
            )
        derived[group] = (topic, stage)
    return derived


E = TypeVar("E", bound=StrEnum)


def _enum(env: Mapping[str, str], name: str, default: E) -> E:
    """One of the values of `default`'s enum, in any case."""
    kind = type(default)
    value = _text(env, name, default.value).lower()
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(m.value for m in kind)}.") from None


def _kafka(env: Mapping[str, str], app_id: str) -> KafkaSettings:
    """The cluster, the topics (this service's own named after `app_id` by default) and the clients."""
    d = KafkaSettings()
    session = _float(env, "AML_SESSION_TIMEOUT", d.session_timeout, 1, 300)
    kafka = KafkaSettings(
        bootstrap_servers=_servers(env, "KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
        security=load_security(env),
        payments_topic=_name(env, "AML_PAYMENTS_TOPIC", d.payments_topic, _TOPIC, "topic"),
        enriched_topic=_name(env, "AML_ENRICHED_TOPIC", d.enriched_topic, _TOPIC, "topic"),
        enrichment_group=_name(env, "AML_ENRICHMENT_GROUP", d.enrichment_group, _GROUP, "consumer group"),
        decisions_topic=_name(env, "AML_DECISIONS_TOPIC", f"{app_id}.decisions", _TOPIC, "topic"),
        alerts_topic=_name(env, "AML_ALERTS_TOPIC", f"{app_id}.alerts", _TOPIC, "topic"),
        dlq_topic=_name(env, "AML_DLQ_TOPIC", d.dlq_topic, _TOPIC, "topic"),
        review_topic=_name(env, "AML_REVIEW_TOPIC", f"{app_id}.review", _TOPIC, "topic"),
        partitions=_int(env, "AML_PARTITIONS", d.partitions, 1, 10000),
        replication_factor=_int(env, "AML_REPLICATION_FACTOR", d.replication_factor, 1, 10),
        max_payment_bytes=_int(
            env, "AML_MAX_PAYMENT_BYTES", d.max_payment_bytes, 256, MAX_VALID_PAYMENT_BYTES
        ),
        max_clock_skew=_float(env, "AML_MAX_CLOCK_SKEW", d.max_clock_skew, 0, 1e12),
        payments_transactional=_bool(env, "AML_PAYMENTS_TRANSACTIONAL", d.payments_transactional),
        session_timeout=session,
        rebalance_timeout=_float(env, "AML_REBALANCE_TIMEOUT", session, 1, 600),
        commit_interval=_float(env, "AML_COMMIT_INTERVAL", d.commit_interval, 0.1, 60),
        fetch_max_wait_ms=_int(env, "AML_FETCH_MAX_WAIT_MS", d.fetch_max_wait_ms, 1, 30000),
        producer_linger_ms=_int(env, "AML_PRODUCER_LINGER_MS", d.producer_linger_ms, 0, 1000),
        startup_wait=_float(env, "AML_STARTUP_WAIT", d.startup_wait, 0.1, 3600),
        broker_port=_int(env, "AML_BROKER_PORT", d.broker_port, 1, 65535),
    )
    topics = (
        kafka.payments_topic,
        kafka.decisions_topic,
        kafka.alerts_topic,
        kafka.dlq_topic,
        kafka.review_topic,
        kafka.enriched_topic,
    )
    if len(set(topics)) != len(topics):
        raise ConfigError(
            "AML_PAYMENTS_TOPIC, AML_DECISIONS_TOPIC, AML_ALERTS_TOPIC, AML_DLQ_TOPIC, AML_REVIEW_TOPIC and "
            "AML_ENRICHED_TOPIC must differ."
        )
    return kafka


def _gate(env: Mapping[str, str], service: str) -> GateSettings:
    """The gate; the AML service waits in event time by default, the others per partition."""
    d = GateSettings()
    fast = _float(env, "AML_FAST_REFRESH_INTERVAL", d.fast_refresh_interval, 0.01, 60)
    slow = _float(env, "AML_REFRESH_INTERVAL", d.refresh_interval, 0.05, 600)
    if fast > slow:
        raise ConfigError(
            f"AML_FAST_REFRESH_INTERVAL={fast} is longer than AML_REFRESH_INTERVAL={slow}; "
            "the on-demand refresh must be at least as frequent as the background one."
        )
    max_age = _float(env, "AML_WATERMARK_MAX_AGE", 5 * slow, 0.1, 86400)
    if max_age < 2 * slow:
        raise ConfigError(
            f"AML_WATERMARK_MAX_AGE={max_age} is less than twice AML_REFRESH_INTERVAL={slow}; "
            "rows would go stale between two refreshes and the gate would close for no reason."
        )
    mode = GateMode.EVENT_TIME if service == "aml" else GateMode.PARTITION
    return GateSettings(
        enabled=_bool(env, "AML_GATE", d.enabled),
        mode=_enum(env, "AML_GATE_MODE", mode),
        allowed_lateness=_float(env, "AML_ALLOWED_LATENESS", d.allowed_lateness, 0, 86400 * 30),
        max_wait=_float(env, "AML_MAX_WAIT", d.max_wait, 0.1, 86400 * 30),
        wait_policy=_enum(env, "AML_WAIT_POLICY", d.wait_policy),
        max_attempts=_int(env, "AML_MAX_ATTEMPTS", d.max_attempts, 0, 1_000_000),
        refresh_interval=slow,
        fast_refresh_interval=fast,
        watermark_max_age=max_age,
        refresh_deadline=_refresh_deadline(env, slow),
        max_pending_per_partition=_int(env, "AML_MAX_PENDING", d.max_pending_per_partition, 1, 1_000_000),
        max_in_flight=_int(env, "AML_MAX_IN_FLIGHT", d.max_in_flight, 1, 1_000_000),
        stall_after=_float(env, "AML_STALL_AFTER", d.stall_after, 0.1, 86400),
        lag_warn=_int(env, "AML_LAG_WARN", d.lag_warn, 0, 10**12),
    )


def _endpoints(env: Mapping[str, str]) -> dict[str, Endpoint]:
    """Every dependency service's group, port and replicas; no two services share a group or a port."""
    endpoints = {name: _endpoint(env, s) for name, s in registry.SERVICES.items()}
    for first, second in itertools.combinations(registry.SERVICES.values(), 2):
        if endpoints[first.name].group == endpoints[second.name].group:
            raise ConfigError(
                f"{first.group_env} and {second.group_env} must differ: each service has its own group."
            )
        if endpoints[first.name].port == endpoints[second.name].port:
            raise ConfigError(f"{first.port_env} and {second.port_env} must differ.")
    return endpoints


def _dependencies(env: Mapping[str, str]) -> DependencySettings:
    """B and C, their APIs and their stores."""
    d = DependencySettings()
    api_store_url = env.get("AML_API_STORE_URL", "").strip()
    deps = DependencySettings(
        endpoints=_endpoints(env),
        services_host=_text(env, "AML_SERVICES_HOST", d.services_host),
        store_url=_store_url(env, "AML_STORE_URL", d.store_url),
        api_store_url=_store_url(env, "AML_API_STORE_URL", "") if api_store_url else "",
        api_token=_token(env, "AML_API_TOKEN"),
        http_timeout=_float(env, "AML_HTTP_TIMEOUT", d.http_timeout, 0.1, 120),
        freshness_wait=_float(env, "AML_FRESHNESS_WAIT", d.freshness_wait, 0, 10),
        api_max_rows=_int(env, "AML_API_MAX_ROWS", d.api_max_rows, 200, 10_000_000),
        api_timeout=_float(env, "AML_API_TIMEOUT", d.api_timeout, 0.1, 3600),
        api_cache_answers=_int(env, "AML_API_CACHE_ANSWERS", d.api_cache_answers, 0, 10_000_000),
        api_access_log=_bool(env, "AML_API_ACCESS_LOG", d.api_access_log),
        reporting_threshold=_decimal(
            env, "AML_REPORTING_THRESHOLD", d.reporting_threshold, Decimal("0.01"), Decimal("1e12")
        ),
        threshold_band=_decimal(
            env, "AML_THRESHOLD_BAND", d.threshold_band, Decimal("0.001"), Decimal("0.9")
        ),
        aggregates_retention=_float(env, "AML_AGGREGATES_RETENTION", d.aggregates_retention, 0, 86400 * 3650),
    )
    if deps.freshness_wait >= deps.http_timeout:
        raise ConfigError(
            f"AML_FRESHNESS_WAIT={deps.freshness_wait:g} must be shorter than AML_HTTP_TIMEOUT="
            f"{deps.http_timeout:g}: a question that waits its whole bound must still be answered."
        )
    return deps


def _pipeline(env: Mapping[str, str]) -> PipelineSettings:
    d = PipelineSettings()
    return PipelineSettings(
        spark_master=_text(env, "AML_SPARK_MASTER", d.spark_master),
        trigger_interval=_float(env, "AML_TRIGGER_INTERVAL", d.trigger_interval, 0.05, 600),
        max_records_per_trigger=_int(
            env, "AML_MAX_RECORDS_PER_TRIGGER", d.max_records_per_trigger, 1, 100_000_000
        ),
        metrics_port=_int(env, "AML_PIPELINE_METRICS_PORT", d.metrics_port, 0, 65535),
        enrichment_metrics_port=_int(env, "AML_ENRICHMENT_METRICS_PORT", d.enrichment_metrics_port, 0, 65535),
        class_archives=_folder_or_none(env, "AML_SPARK_CLASS_ARCHIVES", d.class_archives),
        spark_ui=_bool(env, "AML_SPARK_UI", d.spark_ui),
    )


def _detection(env: Mapping[str, str]) -> DetectionSettings:
    d = DetectionSettings()
    return DetectionSettings(
        max_batch=_int(
            env, "AML_MAX_BATCH", d.max_batch, 1, registry.MAX_QUERIES // registry.QUERIES_PER_PAYMENT
        ),
        aml_thresholds=AmlThresholds.from_env(env),
        fraud_thresholds=FraudThresholds.from_env(env),
        aml_model=_aml_model(env),
        aml_alert_budget=_alert_budget(env),
        probe_cost_ms=_float(env, "AML_PROBE_COST_MS", d.probe_cost_ms, 0, 10_000, "milliseconds"),
        probe_cost_kind=_enum(env, "AML_PROBE_COST_KIND", d.probe_cost_kind),
        probe_fail=_failures(env, "AML_PROBE_FAIL"),
    )


def _web(env: Mapping[str, str]) -> WebSettings:
    d = WebSettings()
    return WebSettings(
        host=_text(env, "AML_WEB_HOST", d.host),
        port=_int(env, "AML_WEB_PORT", d.port, 1, 65535),
        token=_token(env, "AML_WEB_TOKEN"),
    )


def _depends_on(env: Mapping[str, str]) -> tuple[str, ...]:
    """AML_DEPENDS_ON: distinct consumer group names, at least one."""
    raw = _text(env, "AML_DEPENDS_ON", ",".join(Settings().depends_on))
    depends = tuple(g.strip() for g in raw.split(",") if g.strip())
    if not depends:
        raise ConfigError("AML_DEPENDS_ON is empty; name at least one consumer group to wait for.")
    for group in depends:
        if not _GROUP.match(group):
            raise ConfigError(f"AML_DEPENDS_ON: {group!r} is not a valid consumer group name.")
    if len(set(depends)) != len(depends):
        raise ConfigError(f"AML_DEPENDS_ON={raw!r} names a group twice.")
    return depends


def _service(env: Mapping[str, str]) -> str:
    """AML_SERVICE: a module of the agents package."""
    service = _text(env, "AML_SERVICE", Settings().service)
    services = available_services()
    if service not in services:
        raise ConfigError(
            f"AML_SERVICE={service!r} names no gated service; expected one of {', '.join(services)} "
            "(a module in the agents package)."
        )
    return service


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every setting; raise ConfigError with a readable sentence on the first fault."""
    env = os.environ if env is None else env
    failpoint = env.get("AML_FAILPOINT", "").strip()
    if failpoint and failpoint not in FAILPOINTS:
        raise ConfigError(
            f"AML_FAILPOINT={failpoint!r} names no failpoint; the test knob takes {', '.join(FAILPOINTS)}."
        )
    depends = _depends_on(env)
    service = _service(env)
    app_id = _name(env, "AML_APP_ID", service, _GROUP, "consumer group")
    if app_id in depends:
        raise ConfigError(
            f"AML_APP_ID={app_id!r} is also listed in AML_DEPENDS_ON; "
            "a service cannot wait for its own consumer group."
        )
    kafka = _kafka(env, app_id)
    if kafka.enrichment_group == app_id or kafka.enrichment_group in depends:
        # One group for two consumers of payments: each would commit the other's progress.
        raise ConfigError(
            f"AML_ENRICHMENT_GROUP={kafka.enrichment_group!r} is also "
            f"{'AML_APP_ID' if kafka.enrichment_group == app_id else 'in AML_DEPENDS_ON'}; "
            "the enrichment stage needs a consumer group of its own."
        )
    derived = _derived_dependencies(env, depends, app_id, kafka.payments_topic)
    for group, (topic, stage) in derived.items():
        # The gate maps the derived topic with the stage group's offsets on payments: another group's
        # (the stage's before a re-derivation under a new group) can be ahead of what was derived.
        if topic == kafka.enriched_topic and stage != kafka.enrichment_group:
            raise ConfigError(
                f"AML_DERIVED_DEPENDENCIES: {group!r} reads {topic!r}, which aml-app enrich writes under "
                f"AML_ENRICHMENT_GROUP={kafka.enrichment_group!r}, but names the stage group {stage!r}; "
                "name the group that writes it."
            )
    defaults = Settings()
    table_store = _text(env, "AML_TABLE_STORE", defaults.table_store)
    if not table_store.startswith(("rocksdb://", "memory://")):
        raise ConfigError(f"AML_TABLE_STORE={table_store!r} is not supported; use rocksdb:// or memory://.")
    return Settings(
        service=service,
        app_id=app_id,
        depends_on=depends,
        derived_dependencies=derived,
        worker_id=_text(env, "AML_WORKER_ID", defaults.worker_id),
        data_dir=_text(env, "AML_DATA_DIR", defaults.data_dir),
        table_store=table_store,
        kafka=kafka,
        gate=_gate(env, service),
        dependencies=_dependencies(env),
        pipeline=_pipeline(env),
        detection=_detection(env),
        web=_web(env),
    )
