"""load_settings: defaults, parsing, and one ConfigError per fault, each naming the variable."""

from __future__ import annotations

import os
import socket
from decimal import Decimal
from pathlib import Path

import pytest

from aml_app.contract import DEFAULT_MAX_CLOCK_SKEW
from aml_app.settings import ConfigError, GateMode, ProbeCostKind, Settings, WaitPolicy, load_settings


def test_defaults_from_an_empty_environment() -> None:
    s = load_settings({})
    assert s.kafka.bootstrap_servers == ("127.0.0.1:9092",)
    assert s.kafka.faust_brokers == ["kafka://127.0.0.1:9092"]
    assert s.app_id == "aml"
    assert s.depends_on == ("relations", "aggregates")
    assert (s.kafka.payments_topic, s.kafka.decisions_topic, s.kafka.dlq_topic) == (
        "payments",
        "aml.decisions",
        "payments.dlq",
    )
    assert s.kafka.partitions == 4
    assert s.kafka.replication_factor == 1
    assert s.gate.enabled is True
    assert s.gate.refresh_interval == 1.0
    assert s.gate.fast_refresh_interval == 0.025
    assert s.gate.max_pending_per_partition == 1000
    assert s.gate.max_in_flight == 1000
    assert s.kafka.max_payment_bytes == 65536
    assert s.kafka.session_timeout == 10.0
    assert s.kafka.rebalance_timeout == 10.0
    assert s.kafka.commit_interval == 1.0
    assert (s.web.host, s.web.port) == ("127.0.0.1", 6066)
    assert s.data_dir == "var/aml"
    assert s.table_store == "rocksdb://"
    assert s.kafka.broker_port == 9092
    assert s.worker_id == f"{socket.gethostname()}-{os.getpid()}"
    assert s.worker_data_dir == os.path.join("var/aml", "aml-6066")


def test_defaults_match_the_dataclass_defaults() -> None:
    """Each group's function reads its dataclass's defaults from an empty environment."""
    loaded, plain = load_settings({}), Settings()
    for group in ("kafka", "gate", "dependencies", "pipeline", "detection", "web"):
        assert getattr(loaded, group) == getattr(plain, group), group
    assert loaded == plain


def test_blank_values_fall_back_to_the_default() -> None:
    s = load_settings({"AML_APP_ID": "   ", "AML_PARTITIONS": "", "AML_DEPENDS_ON": ""})
    assert s.app_id == "aml"
    assert s.kafka.partitions == 4
    assert s.depends_on == ("relations", "aggregates")


def test_bootstrap_servers_are_split_stripped_and_unprefixed() -> None:
    s = load_settings({"KAFKA_BOOTSTRAP_SERVERS": "kafka://a:1, b:2"})
    assert s.kafka.bootstrap_servers == ("a:1", "b:2")
    assert s.kafka.faust_brokers == ["kafka://a:1", "kafka://b:2"]


def test_explicit_values_are_read_and_trimmed() -> None:
    s = load_settings(
        {
            "AML_APP_ID": " detector ",
            "AML_DEPENDS_ON": "g1, g2 ,g3",
            "AML_PARTITIONS": "12",
            "AML_GATE": "OFF",
            "AML_REFRESH_INTERVAL": "2.5",
            "AML_FAST_REFRESH_INTERVAL": "2.5",
            "AML_SESSION_TIMEOUT": "30",
            "AML_TABLE_STORE": "memory://",
            "AML_WEB_PORT": "7000",
            "AML_DATA_DIR": "/tmp/x",
            "AML_WORKER_ID": "w1",
        }
    )
    assert s.app_id == "detector"
    assert s.depends_on == ("g1", "g2", "g3")
    assert s.kafka.partitions == 12
    assert s.gate.enabled is False
    # fast == slow is allowed
    assert s.gate.refresh_interval == s.gate.fast_refresh_interval == 2.5
    # the rebalance timeout follows the session timeout unless set
    assert s.kafka.session_timeout == s.kafka.rebalance_timeout == 30.0
    assert s.table_store == "memory://"
    assert s.worker_id == "w1"
    assert s.worker_data_dir == os.path.join("/tmp/x", "detector-7000")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("on", True),
        ("1", True),
        ("true", True),
        ("YES", True),
        ("off", False),
        ("0", False),
        ("False", False),
        ("no", False),
    ],
)
def test_gate_switch_spellings(raw: str, expected: bool) -> None:
    assert load_settings({"AML_GATE": raw}).gate.enabled is expected


def _fails(env: dict[str, str], *names: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in {message!r}"
    return message


@pytest.mark.parametrize(
    "raw",
    ["broker", "a:b", "a:0", "a:65536", ":9092", "a:", "a:1,b", " , ", "kafka://"],
)
def test_bad_bootstrap_servers(raw: str) -> None:
    _fails({"KAFKA_BOOTSTRAP_SERVERS": raw}, "KAFKA_BOOTSTRAP_SERVERS")


@pytest.mark.parametrize("raw", [",", " , ,"])
def test_empty_depends_on(raw: str) -> None:
    message = _fails({"AML_DEPENDS_ON": raw}, "AML_DEPENDS_ON")
    assert "empty" in message


def test_duplicate_depends_on() -> None:
    message = _fails({"AML_DEPENDS_ON": "a, b, a"}, "AML_DEPENDS_ON")
    assert "twice" in message


def test_invalid_group_in_depends_on() -> None:
    _fails({"AML_DEPENDS_ON": "ok,not ok"}, "AML_DEPENDS_ON", "not ok")


def test_derived_dependencies_name_each_groups_topic_and_stage() -> None:
    assert load_settings({}).derived_dependencies == {}
    s = load_settings(
        {"AML_DERIVED_DEPENDENCIES": " aggregates:payments.enriched:enrichment ,relations:p.norm:norm-stage"}
    )
    assert s.derived_dependencies == {
        "aggregates": ("payments.enriched", "enrichment"),
        "relations": ("p.norm", "norm-stage"),
    }


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("aggregates:payments.enriched", "is not group:topic:stage-group"),
        ("aggregates:bad topic:enrichment", "is not group:topic:stage-group"),
        ("fraud:payments.enriched:enrichment", "'fraud', which AML_DEPENDS_ON does not list"),
        ("aggregates:a:s,aggregates:b:s", "names 'aggregates' twice"),
        ("aggregates:payments:enrichment", "the payments topic itself"),
        ("aggregates:payments.enriched:aml", "this service's own group"),
        ("aggregates:payments.enriched:aggregates", "the dependency's own group"),
        ("aggregates:payments.enriched:relations", "another dependency's group"),
    ],
)
def test_derived_dependencies_refused_in_one_sentence(raw: str, words: str) -> None:
    message = _fails({"AML_DERIVED_DEPENDENCIES": raw}, "AML_DERIVED_DEPENDENCIES", words)
    assert message.count(". ") == 0, message


def test_the_enriched_topics_stage_group_is_the_one_that_writes_it() -> None:
    """Re-derived under a new group, with the old one left in AML_DERIVED_DEPENDENCIES: the gate mapped
    the derived topic with the old group's offsets on payments, ahead of what the new stage derived."""
    renamed = {"AML_ENRICHMENT_GROUP": "enrichment-v2"}
    message = _fails(
        {**renamed, "AML_DERIVED_DEPENDENCIES": "aggregates:payments.enriched:enrichment"},
        "AML_DERIVED_DEPENDENCIES",
        "which aml-app enrich writes under AML_ENRICHMENT_GROUP='enrichment-v2', but names the stage group "
        "'enrichment'",
    )
    assert message.count(". ") == 0, message
    agreed = {**renamed, "AML_DERIVED_DEPENDENCIES": "aggregates:payments.enriched:enrichment-v2"}
    assert load_settings(agreed).derived_dependencies == {
        "aggregates": ("payments.enriched", "enrichment-v2")
    }
    other = {**renamed, "AML_DERIVED_DEPENDENCIES": "aggregates:p.norm:norm-stage"}  # another stage's topic
    assert load_settings(other).derived_dependencies == {"aggregates": ("p.norm", "norm-stage")}


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"AML_ENRICHMENT_GROUP": "aml"}, "is also AML_APP_ID"),
        ({"AML_ENRICHMENT_GROUP": "relations"}, "is also in AML_DEPENDS_ON"),
        ({"AML_ENRICHMENT_GROUP": "b", "AML_DEPENDS_ON": "a,b"}, "is also in AML_DEPENDS_ON"),
    ],
)
def test_enrichment_group_is_its_own(env: dict[str, str], words: str) -> None:
    _fails(env, "AML_ENRICHMENT_GROUP", words)


def test_decimal_settings_have_at_most_four_places() -> None:
    """C counts a payment near the threshold with Spark at 8 places (the bounds rounded there) and again
    exactly where a window splits a minute: a threshold of 10000.000000004 counted 9000.0000 in one and
    not the other. Four places each keep threshold x (1 - band) exact at 8."""
    _fails({"AML_REPORTING_THRESHOLD": "10000.000000004"}, "AML_REPORTING_THRESHOLD", "more than 4 decimal")
    _fails({"AML_THRESHOLD_BAND": "0.12345"}, "AML_THRESHOLD_BAND", "more than 4 decimal")
    # 24 places, which normalize() rounds away at Decimal's 28 digits: counted exactly, not rounded.
    _fails(
        {"AML_REPORTING_THRESHOLD": "10000.000000000000000000000001"},
        "AML_REPORTING_THRESHOLD",
        "more than 4",
    )
    _fails({"AML_REPORTING_THRESHOLD": "1_0000"}, "AML_REPORTING_THRESHOLD", "is not a decimal number")
    s = load_settings({"AML_REPORTING_THRESHOLD": "9999.9999", "AML_THRESHOLD_BAND": "0.0500"})
    assert s.dependencies.reporting_threshold == Decimal("9999.9999")
    assert load_settings({"AML_REPORTING_THRESHOLD": "1E+4"}).dependencies.reporting_threshold == 10000


def test_app_id_listed_in_depends_on() -> None:
    _fails({"AML_APP_ID": "aml", "AML_DEPENDS_ON": "relations,aml"}, "AML_APP_ID", "AML_DEPENDS_ON")
    # also with the default dependency list
    _fails({"AML_APP_ID": "relations"}, "AML_APP_ID", "AML_DEPENDS_ON")


@pytest.mark.parametrize(
    "name",
    [
        "AML_PARTITIONS",
        "AML_REPLICATION_FACTOR",
        "AML_MAX_PENDING",
        "AML_MAX_IN_FLIGHT",
        "AML_MAX_PAYMENT_BYTES",
        "AML_WEB_PORT",
        "AML_BROKER_PORT",
        "AML_REFRESH_INTERVAL",
        "AML_FAST_REFRESH_INTERVAL",
        "AML_SESSION_TIMEOUT",
        "AML_REBALANCE_TIMEOUT",
        "AML_COMMIT_INTERVAL",
    ],
)
def test_non_numeric(name: str) -> None:
    _fails({name: "soon"}, name, "soon")


@pytest.mark.parametrize("name", ["AML_PARTITIONS", "AML_WEB_PORT", "AML_MAX_PAYMENT_BYTES"])
def test_whole_numbers_reject_fractions(name: str) -> None:
    _fails({name: "1.5"}, name)


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("AML_PARTITIONS", "0"),
        ("AML_PARTITIONS", "10001"),
        ("AML_REPLICATION_FACTOR", "11"),
        ("AML_MAX_PENDING", "0"),
        ("AML_MAX_PAYMENT_BYTES", "255"),
        ("AML_MAX_PAYMENT_BYTES", "523777"),
        ("AML_WEB_PORT", "0"),
        ("AML_WEB_PORT", "65536"),
        ("AML_BROKER_PORT", "-1"),
        ("AML_REFRESH_INTERVAL", "0.04"),
        ("AML_REFRESH_INTERVAL", "601"),
        ("AML_REFRESH_INTERVAL", "nan"),
        ("AML_REFRESH_INTERVAL", "inf"),
        ("AML_FAST_REFRESH_INTERVAL", "0.001"),
        ("AML_SESSION_TIMEOUT", "0.5"),
        ("AML_SESSION_TIMEOUT", "301"),
        ("AML_REBALANCE_TIMEOUT", "601"),
        ("AML_COMMIT_INTERVAL", "0.05"),
        ("AML_COMMIT_INTERVAL", "61"),
        ("AML_MAX_BATCH", "0"),
        ("AML_MAX_BATCH", "501"),
    ],
)
def test_out_of_range(name: str, raw: str) -> None:
    message = _fails({name: raw}, name)
    assert "out of range" in message


@pytest.mark.parametrize(("name", "raw"), [("AML_PARTITIONS", "1"), ("AML_PARTITIONS", "10000")])
def test_range_bounds_are_inclusive(name: str, raw: str) -> None:
    assert load_settings({name: raw}).kafka.partitions == int(raw)


def test_fast_refresh_longer_than_slow() -> None:
    _fails(
        {"AML_FAST_REFRESH_INTERVAL": "2", "AML_REFRESH_INTERVAL": "1"},
        "AML_FAST_REFRESH_INTERVAL",
        "AML_REFRESH_INTERVAL",
    )
    # the default fast interval (0.025) against a slow one set below it
    _fails({"AML_FAST_REFRESH_INTERVAL": "0.1", "AML_REFRESH_INTERVAL": "0.05"}, "AML_FAST_REFRESH_INTERVAL")


@pytest.mark.parametrize("raw", ["maybe", "2", "enabled"])
def test_bad_gate_switch(raw: str) -> None:
    _fails({"AML_GATE": raw}, "AML_GATE")


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("AML_PAYMENTS_TOPIC", "pay ments"),
        ("AML_DECISIONS_TOPIC", "aml/decisions"),
        ("AML_DLQ_TOPIC", "x" * 250),
        ("AML_DLQ_TOPIC", "dlq!"),
        ("AML_APP_ID", "bad id"),
    ],
)
def test_bad_names(name: str, raw: str) -> None:
    _fails({name: raw}, name)


def test_longest_topic_name_is_accepted() -> None:
    assert load_settings({"AML_DLQ_TOPIC": "x" * 249}).kafka.dlq_topic == "x" * 249


@pytest.mark.parametrize(
    "env",
    [
        {"AML_DLQ_TOPIC": "payments"},
        {"AML_DECISIONS_TOPIC": "payments.dlq"},
        {"AML_PAYMENTS_TOPIC": "t", "AML_DECISIONS_TOPIC": "t", "AML_DLQ_TOPIC": "t"},
    ],
)
def test_equal_topic_names(env: dict[str, str]) -> None:
    _fails(env, "AML_PAYMENTS_TOPIC", "AML_DECISIONS_TOPIC", "AML_DLQ_TOPIC")


@pytest.mark.parametrize("raw", ["redis://", "rocksdb", "aerospike://x"])
def test_unsupported_table_store(raw: str) -> None:
    _fails({"AML_TABLE_STORE": raw}, "AML_TABLE_STORE", raw)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_operator_view_limits() -> None:
    s = load_settings({})
    assert (s.gate.stall_after, s.gate.lag_warn) == (30.0, 1000)
    s = load_settings({"AML_STALL_AFTER": "2.5", "AML_LAG_WARN": "0"})
    assert (s.gate.stall_after, s.gate.lag_warn) == (2.5, 0)


@pytest.mark.parametrize(
    ("name", "raw", "says"),
    [
        ("AML_STALL_AFTER", "soon", "soon"),
        ("AML_STALL_AFTER", "0.05", "out of range"),
        ("AML_STALL_AFTER", "86401", "out of range"),
        ("AML_LAG_WARN", "many", "many"),
        ("AML_LAG_WARN", "-1", "out of range"),
        ("AML_LAG_WARN", "1.5", "whole number"),
        ("AML_REFRESH_DEADLINE", "-1", "out of range"),
        ("AML_REFRESH_DEADLINE", "0.5", "shorter than AML_REFRESH_INTERVAL=1"),
    ],
)
def test_bad_operator_view_limits(name: str, raw: str, says: str) -> None:
    assert says in _fails({name: raw}, name)


def test_the_refresh_deadline_is_derived_unless_set() -> None:
    assert load_settings({}).gate.refresh_deadline == 0.0
    assert load_settings({"AML_REFRESH_DEADLINE": "3"}).gate.refresh_deadline == 3.0
    s = load_settings({"AML_REFRESH_INTERVAL": "0.3", "AML_REFRESH_DEADLINE": "0.3"})
    assert (s.gate.refresh_interval, s.gate.refresh_deadline) == (0.3, 0.3)


def test_kafka_security_defaults_to_plaintext_and_is_read_at_start_up() -> None:
    assert load_settings({}).kafka.security.protocol == "PLAINTEXT"
    s = load_settings(
        {
            "KAFKA_SECURITY_PROTOCOL": "sasl_plaintext",
            "KAFKA_SASL_MECHANISM": "scram-sha-256",
            "KAFKA_SASL_USERNAME": "svc",
            "KAFKA_SASL_PASSWORD": "pw",
        }
    )
    assert (s.kafka.security.protocol, s.kafka.security.sasl_mechanism) == ("SASL_PLAINTEXT", "SCRAM-SHA-256")
    assert (s.kafka.security.username, s.kafka.security.password) == ("svc", "pw")


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"KAFKA_SECURITY_PROTOCOL": "ssl-please"}, "KAFKA_SECURITY_PROTOCOL"),
        ({"KAFKA_SASL_MECHANISM": "PLAIN"}, "KAFKA_SASL_MECHANISM"),
        ({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_PASSWORD": "pw"}, "KAFKA_SASL_USERNAME"),
        ({"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CAFILE": "/nonexistent/ca.pem"}, "KAFKA_SSL_CAFILE"),
    ],
)
def test_bad_kafka_security(env: dict[str, str], name: str) -> None:
    _fails(env, name)


def test_the_gate_mode_and_the_wait_policy_are_read_into_their_enums() -> None:
    """The AML service waits in event time by default, the others per partition; a value names itself."""
    assert load_settings({}).gate.mode is GateMode.EVENT_TIME
    assert load_settings({"AML_SERVICE": "fraud"}).gate.mode is GateMode.PARTITION
    assert load_settings({"AML_GATE_MODE": "Partition"}).gate.mode is GateMode.PARTITION
    assert (
        load_settings({"AML_SERVICE": "probe", "AML_GATE_MODE": "event-time"}).gate.mode
        is GateMode.EVENT_TIME
    )
    assert load_settings({}).gate.wait_policy is WaitPolicy.WAIT
    assert load_settings({"AML_WAIT_POLICY": "decide-stale"}).gate.wait_policy is WaitPolicy.DECIDE_STALE
    assert GateMode.EVENT_TIME.value == "event-time" and WaitPolicy.DECIDE_STALE.value == "decide-stale"
    message = _fails({"AML_GATE_MODE": "offset"}, "AML_GATE_MODE")
    assert message == "AML_GATE_MODE='offset' is not one of event-time, partition."
    message = _fails({"AML_WAIT_POLICY": "give-up"}, "AML_WAIT_POLICY")
    assert message == "AML_WAIT_POLICY='give-up' is not one of wait, decide-stale."


def test_probe_cost_is_off_by_default_and_read_when_set() -> None:
    s = load_settings({})
    assert (s.detection.probe_cost_ms, s.detection.probe_cost_kind) == (0.0, ProbeCostKind.CPU)
    s = load_settings({"AML_PROBE_COST_MS": "2.5", "AML_PROBE_COST_KIND": "Block"})
    assert (s.detection.probe_cost_ms, s.detection.probe_cost_kind) == (2.5, ProbeCostKind.BLOCK)


@pytest.mark.parametrize(
    ("name", "raw", "says"),
    [
        ("AML_PROBE_COST_MS", "slow", "milliseconds"),
        ("AML_PROBE_COST_MS", "-1", "out of range"),
        ("AML_PROBE_COST_MS", "10001", "out of range"),
        ("AML_PROBE_COST_MS", "nan", "out of range"),
        ("AML_PROBE_COST_KIND", "gpu", "cpu, block, wait"),
    ],
)
def test_bad_probe_cost(name: str, raw: str, says: str) -> None:
    assert says in _fails({name: raw}, name)


def test_probe_failures_are_off_by_default_and_read_when_set() -> None:
    assert load_settings({}).detection.probe_fail == {}
    assert load_settings({"AML_PROBE_FAIL": "p-0-1:3, a:b:7"}).detection.probe_fail == {"p-0-1": 3, "a:b": 7}
    for raw in ("p-0-1", "p-0-1:x", ":3", "p:0"):
        assert "PAYMENT_ID:ATTEMPTS" in _fails({"AML_PROBE_FAIL": raw}, "AML_PROBE_FAIL")


def test_the_freshness_wait_is_shorter_than_the_http_timeout() -> None:
    """A question that waits its whole bound at B or C must still be answered within the request."""
    assert (
        load_settings({"AML_FRESHNESS_WAIT": "1.5", "AML_HTTP_TIMEOUT": "2"}).dependencies.freshness_wait
        == 1.5
    )
    with pytest.raises(ConfigError, match=r"^AML_FRESHNESS_WAIT=3 must be shorter than AML_HTTP_TIMEOUT=3"):
        load_settings({"AML_FRESHNESS_WAIT": "3", "AML_HTTP_TIMEOUT": "3"})


def test_the_clock_skew_bound_defaults_to_the_contracts_and_is_read_when_set() -> None:
    assert load_settings({}).kafka.max_clock_skew == DEFAULT_MAX_CLOCK_SKEW == 5.0
    assert load_settings({"AML_MAX_CLOCK_SKEW": "0.25"}).kafka.max_clock_skew == 0.25
    assert load_settings({"AML_MAX_CLOCK_SKEW": "0"}).kafka.max_clock_skew == 0
    assert load_settings({"AML_MAX_CLOCK_SKEW": "1e12"}).kafka.max_clock_skew == 1e12  # the bound off
    for raw in ("-1", "1.1e12", "nan", "inf"):
        assert "out of range" in _fails({"AML_MAX_CLOCK_SKEW": raw}, "AML_MAX_CLOCK_SKEW")
    assert "seconds" in _fails({"AML_MAX_CLOCK_SKEW": "5s"}, "AML_MAX_CLOCK_SKEW")


def test_the_api_bounds_default_and_are_read_when_set() -> None:
    defaults = load_settings({}).dependencies
    assert (defaults.api_max_rows, defaults.api_timeout) == (50_000, 10.0)
    settings = load_settings({"AML_API_MAX_ROWS": "200", "AML_API_TIMEOUT": "0.5"})
    assert (settings.dependencies.api_max_rows, settings.dependencies.api_timeout) == (200, 0.5)
    # Fewer rows than a counterparty's currencies would leave a list that no page can move on.
    assert "out of range" in _fails({"AML_API_MAX_ROWS": "199"}, "AML_API_MAX_ROWS")
    assert "out of range" in _fails({"AML_API_TIMEOUT": "0"}, "AML_API_TIMEOUT")
    assert "seconds" in _fails({"AML_API_TIMEOUT": "10s"}, "AML_API_TIMEOUT")


def test_the_worker_data_folder_template_keeps_braces_in_the_folder_name() -> None:
    from types import SimpleNamespace

    s = load_settings({"AML_DATA_DIR": "/tmp/a{b}", "AML_APP_ID": "x"})
    assert s.worker_data_dir_template.format(conf=SimpleNamespace(web_port=7001)) == "/tmp/a{b}/x-7001"


@pytest.mark.parametrize(
    ("variable", "group", "field"),
    [("AML_API_TOKEN", "dependencies", "api_token"), ("AML_WEB_TOKEN", "web", "token")],
)
def test_tokens_are_checked_kept_out_of_reprs_and_handed_to_started_processes(
    variable: str, group: str, field: str
) -> None:
    from aml_app.harness.workers import settings_env

    token = "a-shared-secret-of-" + "y" * 20
    settings = load_settings({variable: token})
    assert getattr(getattr(settings, group), field) == token and token not in repr(settings)
    assert settings_env(settings)[variable] == token
    unset = load_settings({})
    assert getattr(getattr(unset, group), field) == "" and settings_env(unset)[variable] == ""
    # ASCII: a WSGI server hands headers decoded as Latin-1, aiohttp as UTF-8, and "ä" matched one only.
    for bad in (
        "short",
        "has a space in it, sixteen+",
        "x" * 513,
        "a-tab\there-and-more-chars",
        "pässwörd-" * 3,
    ):
        with pytest.raises(
            ConfigError, match=rf"^{variable} must be 16 to 512 printable ASCII characters"
        ) as caught:
            load_settings({variable: bad})
        assert bad not in str(caught.value)


def test_the_spark_class_archives_folder_is_var_jvm_unless_set_and_none_when_set_empty() -> None:
    assert load_settings({}).pipeline.class_archives == Path("var/jvm")
    assert load_settings({"AML_SPARK_CLASS_ARCHIVES": " /opt/jvm "}).pipeline.class_archives == Path(
        "/opt/jvm"
    )
    assert load_settings({"AML_SPARK_CLASS_ARCHIVES": ""}).pipeline.class_archives is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"AML_PARTITIONS": "\uff11\uff12"}, "AML_PARTITIONS='\uff11\uff12' is not a whole number"),
        ({"AML_PARTITIONS": "1_0"}, "AML_PARTITIONS='1_0' is not a whole number"),
        ({"AML_STORE_URL": "postgresql://x@127.0.0.1:notaport/aml"}, "AML_STORE_URL has the port 'notaport'"),
        ({"AML_STORE_URL": "postgresql://x@h1:5432,h2:70000/aml"}, "AML_STORE_URL has the port '70000'"),
        ({"AML_ENRICHED_TOPIC": "payments"}, "AML_ENRICHED_TOPIC must differ"),
    ],
)
def test_values_accepted_before_and_wrong_are_one_sentence(env: dict[str, str], message: str) -> None:
    """Digits of other scripts and `1_0` (Python's int() takes both), a store URL whose port is no number
    (the API retried its connection for ever), the enrichment stage writing into its own input."""
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_store_url_of_several_hosts_and_the_default_port_is_accepted() -> None:
    assert load_settings({"AML_STORE_URL": "postgresql://x@h1:5432,h2:5433/aml"}).dependencies.store_url
    assert load_settings({"AML_STORE_URL": "postgresql://x@h1/aml"}).dependencies.store_url


def test_the_spark_ui_is_a_switch_read_with_the_other_settings() -> None:
    """It was handed to Spark as written: a typo reached the JVM instead of stopping the start."""
    assert load_settings({}).pipeline.spark_ui is False
    assert load_settings({"AML_SPARK_UI": "true"}).pipeline.spark_ui is True
    with pytest.raises(ConfigError, match=r"AML_SPARK_UI=.ture. is not a switch; use on or off\."):
        load_settings({"AML_SPARK_UI": "ture"})


def test_a_failpoint_that_names_nothing_is_refused() -> None:
    """A misspelt test knob did nothing where a test meant a crash."""
    _fails({"AML_FAILPOINT": "after-store-writes"}, "AML_FAILPOINT", "names no failpoint")
    assert load_settings({"AML_FAILPOINT": "refresh-hang"}) is not None
