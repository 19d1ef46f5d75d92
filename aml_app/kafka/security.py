"""Kafka security settings (TLS and SASL), read once and handed to every Kafka client in the same shape.

The system talks to Kafka through three client libraries: Faust (aiokafka underneath) for the workers,
aiokafka directly for the gate's admin reads, `aml-app status`, `aml-app topics` and the simulator, and
confluent-kafka (librdkafka) in the Spark pipeline. Each spells the same settings differently; the
translations live here, as pure functions, so a cluster that needs SASL_SSL is configured once
(`KAFKA_SECURITY_PROTOCOL`, `KAFKA_SASL_*`, `KAFKA_SSL_*`) and every client gets the same thing.

The password never appears in a repr, a log line or `describe()`.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from aml_app.errors import ConfigError

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
VARIABLES = (
    "KAFKA_SECURITY_PROTOCOL",
    "KAFKA_SASL_MECHANISM",
    "KAFKA_SASL_USERNAME",
    "KAFKA_SASL_PASSWORD",
    "KAFKA_SSL_CAFILE",
    "KAFKA_SSL_CERTFILE",
    "KAFKA_SSL_KEYFILE",
)


@dataclass(frozen=True)
class KafkaSecurity:
    """How to reach the cluster securely; the default is plaintext without authentication."""

    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None

    @property
    def uses_sasl(self) -> bool:
        return self.protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    @property
    def uses_ssl(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    def describe(self) -> str:
        """One line for logs and `aml-app topics`: everything but the password."""
        parts = [self.protocol]
        if self.uses_sasl:
            parts.append(f"{self.sasl_mechanism} as {self.username!r}")
        if self.uses_ssl:
            parts.append(f"CA {self.cafile}" if self.cafile else "system CAs")
            if self.certfile:
                parts.append(f"client certificate {self.certfile}")
        return ", ".join(parts)


#: Plaintext without authentication: the embedded broker of the demo, the tests and the benchmarks.
PLAINTEXT = KafkaSecurity()


def _value(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    return None if raw is None or raw.strip() == "" else raw.strip()


def load_security(env: Mapping[str, str] | None = None) -> KafkaSecurity:
    """Read and check the KAFKA_SECURITY_*, KAFKA_SASL_* and KAFKA_SSL_* variables.

    A combination that cannot work (SASL settings without a SASL protocol, a SASL protocol without
    credentials, TLS files without TLS, a file that does not exist or does not load) is a ConfigError
    with one sentence: a setting that would be silently ignored is a mistake the operator wants to hear
    about at start-up.
    """
    env = os.environ if env is None else env
    protocol = (_value(env, "KAFKA_SECURITY_PROTOCOL") or "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"KAFKA_SECURITY_PROTOCOL={protocol!r} is not supported; use one of {', '.join(PROTOCOLS)}."
        )
    mechanism = _value(env, "KAFKA_SASL_MECHANISM")
    username = _value(env, "KAFKA_SASL_USERNAME")
    # A password is taken as given (leading or trailing spaces may be part of it); blank means unset.
    raw_password = env.get("KAFKA_SASL_PASSWORD")
    password = raw_password if raw_password is not None and raw_password.strip() != "" else None
    files = {
        name: _value(env, name) for name in ("KAFKA_SSL_CAFILE", "KAFKA_SSL_CERTFILE", "KAFKA_SSL_KEYFILE")
    }
    security = KafkaSecurity(
        protocol=protocol,
        sasl_mechanism=mechanism.upper() if mechanism else None,
        username=username,
        password=password,
        cafile=files["KAFKA_SSL_CAFILE"],
        certfile=files["KAFKA_SSL_CERTFILE"],
        keyfile=files["KAFKA_SSL_KEYFILE"],
    )
    if security.uses_sasl:
        if security.sasl_mechanism is None:
            security = replace(security, sasl_mechanism="PLAIN")
        if security.sasl_mechanism not in MECHANISMS:
            raise ConfigError(
                f"KAFKA_SASL_MECHANISM={mechanism!r} is not supported; use one of {', '.join(MECHANISMS)}."
            )
        if username is None or password is None:
            missing = " and ".join(
                n
                for n, v in (("KAFKA_SASL_USERNAME", username), ("KAFKA_SASL_PASSWORD", password))
                if v is None
            )
            raise ConfigError(f"KAFKA_SECURITY_PROTOCOL={protocol} needs {missing} to authenticate.")
    else:
        given = [
            n
            for n, v in (
                ("KAFKA_SASL_MECHANISM", mechanism),
                ("KAFKA_SASL_USERNAME", username),
                ("KAFKA_SASL_PASSWORD", password),
            )
            if v is not None
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} set but KAFKA_SECURITY_PROTOCOL={protocol} does not authenticate; "
                "use SASL_PLAINTEXT or SASL_SSL."
            )
    if not security.uses_ssl:
        given = [n for n, v in files.items() if v is not None]
        if given:
            raise ConfigError(
                f"{', '.join(given)} set but KAFKA_SECURITY_PROTOCOL={protocol} does not use TLS; "
                "use SSL or SASL_SSL."
            )
    if security.keyfile and not security.certfile:
        raise ConfigError(
            "KAFKA_SSL_KEYFILE is set without KAFKA_SSL_CERTFILE; give the client certificate too."
        )
    for name, path in files.items():
        if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ConfigError(f"{name}={path!r} is not a readable file.")
    _load_tls_files(security)
    return security


def _load_tls_files(security: KafkaSecurity) -> None:
    """Load the TLS files once at start-up, as every client will: a file that is not a certificate (or
    its key) is a ConfigError here, not a traceback from the first client."""
    context = ssl.create_default_context()
    if security.cafile:
        try:
            context.load_verify_locations(cafile=security.cafile)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"KAFKA_SSL_CAFILE={security.cafile!r} holds no PEM certificate the client can load "
                f"({exc.strerror or exc})."
            ) from None
    if security.certfile:
        try:
            context.load_cert_chain(security.certfile, security.keyfile)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"KAFKA_SSL_CERTFILE={security.certfile!r} (with KAFKA_SSL_KEYFILE="
                f"{security.keyfile!r}) is not a PEM certificate and its private key the client can load "
                f"({exc.strerror or exc})."
            ) from None


def ssl_context(security: KafkaSecurity) -> ssl.SSLContext | None:
    """The TLS context aiokafka and Faust need (hostname checked; system CAs unless a CA file is given)."""
    if not security.uses_ssl:
        return None
    from aiokafka.helpers import create_ssl_context

    return create_ssl_context(cafile=security.cafile, certfile=security.certfile, keyfile=security.keyfile)


def aiokafka_kwargs(security: KafkaSecurity) -> dict[str, Any]:
    """Keyword arguments for any aiokafka client (producer, consumer, admin). Empty for plaintext, so
    plain clients stay as they were. Every client gets the settings loaded at start-up, passed down: none
    reads the environment again."""
    if security.protocol == "PLAINTEXT":
        return {}
    kwargs: dict[str, Any] = {"security_protocol": security.protocol}
    if security.uses_sasl:
        kwargs.update(
            sasl_mechanism=security.sasl_mechanism,
            sasl_plain_username=security.username,
            sasl_plain_password=security.password,
        )
    if security.uses_ssl:
        kwargs["ssl_context"] = ssl_context(security)
    return kwargs


def librdkafka_config(security: KafkaSecurity) -> dict[str, str]:
    """The same settings under librdkafka's names (confluent-kafka, the Spark source's `kafka.*` options).

    Empty for plaintext. On a Spark cluster the files must exist at the same path on every executor.
    """
    if security.protocol == "PLAINTEXT":
        return {}
    config = {"security.protocol": security.protocol.lower()}
    if security.uses_sasl:
        assert security.sasl_mechanism and security.username and security.password is not None
        config.update(
            {
                "sasl.mechanisms": security.sasl_mechanism,
                "sasl.username": security.username,
                "sasl.password": security.password,
            }
        )
    if security.uses_ssl:
        for key, path in (
            ("ssl.ca.location", security.cafile),
            ("ssl.certificate.location", security.certfile),
            ("ssl.key.location", security.keyfile),
        ):
            if path:
                config[key] = path
    return config


def faust_credentials(security: KafkaSecurity) -> Any:
    """Faust's `broker_credentials` (which it turns into the same aiokafka arguments); None for plaintext."""
    if security.protocol == "PLAINTEXT":
        return None
    import faust

    context = ssl_context(security)
    if not security.uses_sasl:
        return faust.SSLCredentials(context)
    return faust.SASLCredentials(
        username=security.username,
        password=security.password,
        ssl_context=context,
        mechanism=security.sasl_mechanism,
    )
