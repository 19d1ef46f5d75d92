"""Kafka TLS/SASL settings: validation, and the translations for aiokafka, librdkafka and Faust.

The embedded broker has neither TLS nor SASL, so these are pure units: what each client would be given.
"""

from __future__ import annotations

import logging
import shutil
import ssl
import subprocess

import pytest
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from aml_app.kafka.security import (
    PLAINTEXT,
    VARIABLES,
    KafkaSecurity,
    aiokafka_kwargs,
    faust_credentials,
    librdkafka_config,
    load_security,
)
from aml_app.settings import ConfigError, load_settings

PASSWORD = "pa55-w0rd-never-shown"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A self-signed certificate and its key (used as CA file, client certificate and key)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kafka-test"),
            *("-days", "2", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return {"cafile": str(cert), "certfile": str(cert), "keyfile": str(key)}


def sasl_env(protocol: str = "SASL_SSL", mechanism: str = "SCRAM-SHA-512") -> dict[str, str]:
    return {
        "KAFKA_SECURITY_PROTOCOL": protocol,
        "KAFKA_SASL_MECHANISM": mechanism,
        "KAFKA_SASL_USERNAME": "svc-aml",
        "KAFKA_SASL_PASSWORD": PASSWORD,
    }


def test_plaintext_by_default_adds_nothing_to_any_client() -> None:
    security = load_security({})
    assert security == KafkaSecurity()
    assert aiokafka_kwargs(security) == {}
    assert librdkafka_config(security) == {}
    assert faust_credentials(security) is None


def test_sasl_ssl_with_scram_for_every_client(tls_files: dict[str, str]) -> None:
    env = {**sasl_env(), "KAFKA_SSL_CAFILE": tls_files["cafile"]}
    security = load_security(env)

    kwargs = aiokafka_kwargs(security)
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (kwargs["sasl_plain_username"], kwargs["sasl_plain_password"]) == ("svc-aml", PASSWORD)
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
    assert kwargs["ssl_context"].check_hostname is True
    assert kwargs["ssl_context"].verify_mode == ssl.CERT_REQUIRED

    assert librdkafka_config(security) == {
        "security.protocol": "sasl_ssl",
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "svc-aml",
        "sasl.password": PASSWORD,
        "ssl.ca.location": tls_files["cafile"],
    }

    # Faust turns its credentials into aiokafka arguments itself: they must come out the same.
    faust_kwargs = credentials_to_aiokafka_auth(faust_credentials(security))
    for key in ("security_protocol", "sasl_mechanism", "sasl_plain_username", "sasl_plain_password"):
        assert faust_kwargs[key] == kwargs[key], key
    assert isinstance(faust_kwargs["ssl_context"], ssl.SSLContext)


def test_sasl_plaintext_defaults_to_plain_and_has_no_tls() -> None:
    env = sasl_env("sasl_plaintext", "")
    security = load_security(env)
    assert (security.protocol, security.sasl_mechanism) == ("SASL_PLAINTEXT", "PLAIN")
    kwargs = aiokafka_kwargs(security)
    assert kwargs["security_protocol"] == "SASL_PLAINTEXT"
    assert "ssl_context" not in kwargs
    config = librdkafka_config(security)
    assert config["security.protocol"] == "sasl_plaintext"
    assert config["sasl.mechanisms"] == "PLAIN"
    assert not any(key.startswith("ssl.") for key in config)
    assert credentials_to_aiokafka_auth(faust_credentials(security))["security_protocol"] == "SASL_PLAINTEXT"


def test_mutual_tls_passes_the_client_certificate(tls_files: dict[str, str]) -> None:
    env = {
        "KAFKA_SECURITY_PROTOCOL": "SSL",
        "KAFKA_SSL_CAFILE": tls_files["cafile"],
        "KAFKA_SSL_CERTFILE": tls_files["certfile"],
        "KAFKA_SSL_KEYFILE": tls_files["keyfile"],
    }
    security = load_security(env)
    assert librdkafka_config(security) == {
        "security.protocol": "ssl",
        "ssl.ca.location": tls_files["cafile"],
        "ssl.certificate.location": tls_files["certfile"],
        "ssl.key.location": tls_files["keyfile"],
    }
    kwargs = aiokafka_kwargs(security)
    assert kwargs["security_protocol"] == "SSL"
    assert "sasl_mechanism" not in kwargs
    auth = credentials_to_aiokafka_auth(faust_credentials(security))
    assert auth["security_protocol"] == "SSL"
    assert isinstance(auth["ssl_context"], ssl.SSLContext)


def test_ssl_without_a_ca_file_uses_the_system_cas() -> None:
    security = load_security({"KAFKA_SECURITY_PROTOCOL": "SSL"})
    context = aiokafka_kwargs(security)["ssl_context"]
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert librdkafka_config(security) == {"security.protocol": "ssl"}
    assert "system CAs" in security.describe()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"KAFKA_SECURITY_PROTOCOL": "TLS"}, ["KAFKA_SECURITY_PROTOCOL", "SASL_SSL"]),
        ({"KAFKA_SASL_MECHANISM": "PLAIN"}, ["KAFKA_SASL_MECHANISM", "PLAINTEXT", "SASL_"]),
        ({"KAFKA_SASL_USERNAME": "u"}, ["KAFKA_SASL_USERNAME", "does not authenticate"]),
        ({**sasl_env("SASL_SSL"), "KAFKA_SASL_USERNAME": ""}, ["KAFKA_SASL_USERNAME", "SASL_SSL"]),
        ({**sasl_env("SASL_PLAINTEXT"), "KAFKA_SASL_PASSWORD": " "}, ["KAFKA_SASL_PASSWORD"]),
        ({**sasl_env("SASL_SSL", "GSSAPI")}, ["KAFKA_SASL_MECHANISM", "GSSAPI", "SCRAM-SHA-256"]),
        ({"KAFKA_SSL_CAFILE": "ca.pem"}, ["KAFKA_SSL_CAFILE", "does not use TLS"]),
        ({"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CAFILE": "/no/such/ca.pem"}, ["KAFKA_SSL_CAFILE"]),
    ],
)
def test_a_bad_combination_is_one_sentence_naming_the_variable(env: dict[str, str], named: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_security(env)
    message = str(info.value)
    for name in named:
        assert name in message, f"{name!r} not in {message!r}"
    assert "\n" not in message and message.endswith(".")
    assert PASSWORD not in message


def test_a_key_without_a_certificate_is_refused(tls_files: dict[str, str]) -> None:
    env = {"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_KEYFILE": tls_files["keyfile"]}
    with pytest.raises(ConfigError, match=r"KAFKA_SSL_KEYFILE.*KAFKA_SSL_CERTFILE"):
        load_security(env)


def test_the_password_is_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    settings = load_settings(sasl_env("SASL_PLAINTEXT"))
    assert settings.kafka.security.password == PASSWORD
    shown = [repr(settings), str(settings), repr(settings.kafka.security), settings.kafka.security.describe()]
    assert all(PASSWORD not in text for text in shown)
    assert "svc-aml" in settings.kafka.security.describe()
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("test").info("settings: %s", settings)
    assert PASSWORD not in caplog.text
    assert PASSWORD not in repr(faust_credentials(settings.kafka.security))


def test_settings_fail_fast_on_a_bad_security_combination() -> None:
    with pytest.raises(ConfigError, match="KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD"):
        load_settings({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL"})


def test_clients_take_the_settings_given_and_never_the_environment_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aml_app.gate.unapplied import UnappliedReader
    from aml_app.kafka.offsets import DependencyOffsets

    settings = load_settings(sasl_env("SASL_PLAINTEXT", "SCRAM-SHA-256"))
    reader = DependencyOffsets(["kafka:9092"], "payments", ["relations"], security=settings.kafka.security)
    assert reader._security["sasl_plain_password"] == PASSWORD
    assert reader._librdkafka["sasl.password"] == PASSWORD
    # The environment says something else after start-up: no client reads it.
    for name, value in sasl_env("SASL_SSL", "PLAIN").items():
        monkeypatch.setenv(name, value)
    again = UnappliedReader(["kafka:9092"], "payments", security=settings.kafka.security)
    assert again._security["sasl_mechanism"] == "SCRAM-SHA-256"
    assert aiokafka_kwargs(PLAINTEXT) == {}


def test_the_pipeline_config_carries_the_security_settings(tls_files: dict[str, str]) -> None:
    from aml_app.pipeline.kafka_source import client_config
    from aml_app.pipeline.runner import kafka_config

    settings = load_settings(
        {**sasl_env(), "KAFKA_SSL_CAFILE": tls_files["cafile"], "KAFKA_BOOTSTRAP_SERVERS": "k:1"}
    )
    config = kafka_config(settings)
    assert config["bootstrap.servers"] == "k:1"
    assert config["sasl.mechanisms"] == "SCRAM-SHA-512"
    # The Spark source hands every `kafka.*` option to its consumers as it is.
    options = {f"kafka.{k}": v for k, v in config.items()}
    assert client_config(options) == config
    assert kafka_config(load_settings({})) == {"bootstrap.servers": "127.0.0.1:9092"}


class Recording(dict):
    """An environment that remembers which variables were asked for."""

    def __init__(self, *args: object, **kwargs: str) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        self.read.add(key)
        return super().get(key, default)


def test_the_listed_variables_are_exactly_the_ones_read(tls_files: dict[str, str]) -> None:
    env = Recording({**sasl_env(), "KAFKA_SSL_CAFILE": tls_files["cafile"]})
    load_security(env)
    assert env.read == set(VARIABLES)


def test_tls_files_that_do_not_load_are_one_sentence(
    tls_files: dict[str, str], tmp_path: pytest.TempPathFactory
) -> None:
    """Readable, but not a certificate, or a certificate without its key: every client would fail on
    them, the first with a traceback (the worker, `aml-app serve`, `aml-app status`)."""
    not_pem = tmp_path / "hostname"  # type: ignore[operator]
    not_pem.write_text("kafka-1\n")
    for env, named in (
        ({"KAFKA_SSL_CAFILE": str(not_pem)}, "KAFKA_SSL_CAFILE"),
        ({"KAFKA_SSL_CERTFILE": str(not_pem)}, "KAFKA_SSL_CERTFILE"),
        (
            {"KAFKA_SSL_CERTFILE": tls_files["certfile"], "KAFKA_SSL_KEYFILE": tls_files["certfile"]},
            "KEYFILE",
        ),
    ):
        with pytest.raises(ConfigError) as info:
            load_security({"KAFKA_SECURITY_PROTOCOL": "SSL", **env})
        message = str(info.value)
        assert message.startswith(named if named != "KEYFILE" else "KAFKA_SSL_CERTFILE"), message
        assert named in message and "\n" not in message and message.endswith(").")
    full = {"KAFKA_SSL_CAFILE": tls_files["cafile"], "KAFKA_SSL_CERTFILE": tls_files["certfile"]}
    assert load_security(
        {"KAFKA_SECURITY_PROTOCOL": "SSL", **full, "KAFKA_SSL_KEYFILE": tls_files["keyfile"]}
    )
