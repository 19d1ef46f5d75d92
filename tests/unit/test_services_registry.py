"""The registry of the dependency services: lookups by name, an unknown name refused, a third service.

Pure: no Kafka, Spark session or PostgreSQL (the pipeline's modules are imported, nothing runs).
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest

from aml_app import dependency_services as registry
from aml_app.dependencies import aggregates, relations
from aml_app.dependency_services import DependencyService, UnknownService, service
from aml_app.settings import Settings

KNOWN = "expected one of relations, aggregates"


def test_the_registry_holds_b_then_c_with_their_settings() -> None:
    settings = Settings()
    assert registry.NAMES == ("relations", "aggregates")
    b, c = service("relations"), service("aggregates")
    assert (b.schema, b.table, b.group(settings), b.port(settings)) == (
        relations.SCHEMA,
        "edges",
        "relations",
        8081,
    )
    assert (c.schema, c.table, c.group(settings), c.port(settings)) == (
        aggregates.SCHEMA,
        "flows",
        "aggregates",
        8082,
    )
    assert b.urls(settings) == ("http://127.0.0.1:8081",)
    assert c.with_port(settings, 9000).aggregates_port == 9000
    assert settings.depends_on == registry.NAMES


def test_c_alone_checks_its_thresholds_and_reports_late_payments_in_health() -> None:
    assert service("relations").health({"late_dropped": "3"}) == {"folded_before": None}
    folded = {"folded_before": "2026-03-01T12:00:00.000000Z"}
    assert service("relations").health(folded) == folded
    assert service("aggregates").health({"late_dropped": "3"}) == {"late_dropped": 3, "max_event_ts": None}


@pytest.mark.parametrize("name", ["ledger", "Aggregates", ""])
def test_an_unknown_name_is_refused_with_the_known_services(name: str) -> None:
    """Before the registry, `writer_for`, `aggregation`, the batch table and the API's port took any name
    but "relations" for aggregates; now every lookup refuses it."""
    with pytest.raises(UnknownService, match=f"unknown service {name!r}; {KNOWN}"):
        service(name)


def test_the_lookups_of_the_pipeline_and_the_api_refuse_an_unknown_name() -> None:
    from aml_app.dependencies.api import build_app
    from aml_app.harness.dependencies import ApiProcess
    from aml_app.pipeline.jobs import writer_for
    from aml_app.pipeline.runner import group_of, schema_of

    settings = Settings()
    for lookup in (
        lambda: writer_for("ledger"),
        lambda: group_of(settings, "ledger"),
        lambda: schema_of("ledger"),
        lambda: build_app("ledger", settings, check=False),
        lambda: ApiProcess("ledger", settings, log_path=None),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError, match=KNOWN):
            lookup()


def test_the_cli_refuses_an_unknown_service() -> None:
    from click.testing import CliRunner

    from aml_app.cli import parse_triggers, serve_command

    result = CliRunner().invoke(serve_command, ["ledger"])
    assert result.exit_code == 2 and "'relations', 'aggregates'" in result.output
    with pytest.raises(Exception, match="expected relations=SECONDS or aggregates=SECONDS"):
        parse_triggers(("ledger=5",))


# --- a test-only third service, whose own module is this one ------------------------------------------

#: The ledger's store schema (B's, for the test: it never opens a store) and what its writes received.
SCHEMA = relations.SCHEMA
WRITTEN: list[Any] = []


def write_table(conn: Any, table: Any, keep: timedelta) -> int:
    WRITTEN.append((conn, table, keep))
    return len(table)


def health(meta: dict[str, str]) -> dict[str, Any]:
    return {"entries": int(meta.get("entries", "0"))}


def ledger_transform(valid: Any, threshold: Decimal, band: Decimal) -> Any:
    return [row for row in valid if row > threshold]


def ledger_api(reader: Any, settings: Any, check: Any) -> Any:
    return ("the ledger's API", reader, service("ledger").urls(settings), check)


LEDGER = DependencyService(
    "ledger", __name__, "entries", f"{__name__}:ledger_transform", f"{__name__}:ledger_api", 8090
)


def test_a_third_service_is_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry and its own module (this one) are all the settings, the gate's dependencies, the
    pipeline's transform and writer, the API and the harness need: no other module changes."""
    from aml_app.harness.dependencies import services_env
    from aml_app.pipeline.jobs import writer_for
    from aml_app.pipeline.runner import group_of
    from aml_app.pipeline.transforms import BatchOutputs, aggregation
    from aml_app.settings import ConfigError, load_settings

    monkeypatch.setattr(registry, "SERVICES", {**registry.SERVICES, "ledger": LEDGER})
    WRITTEN.clear()
    env = {"AML_LEDGER_GROUP": "ledger-1", "AML_LEDGER_URL": "http://ledger-a:8090,http://ledger-b:8090"}
    settings = load_settings(env)

    assert settings.depends_on == ("relations", "aggregates", "ledger")
    assert group_of(settings, "ledger") == "ledger-1"
    assert service("ledger").port(settings) == 8090
    assert service("ledger").urls(settings) == ("http://ledger-a:8090", "http://ledger-b:8090")
    assert services_env(settings)["AML_LEDGER_GROUP"] == "ledger-1"
    assert aggregation("ledger", [1, 5, 9], Decimal(4), Decimal(0)) == [5, 9]
    outputs = BatchOutputs(spans=None, rejects=None, tables={"entries": [5, 9]})
    assert writer_for("ledger", timedelta(days=1))("conn", outputs) == 2
    assert WRITTEN == [("conn", [5, 9], timedelta(days=1))]
    assert service("ledger").app("reader", settings, None)[2] == (
        "http://ledger-a:8090",
        "http://ledger-b:8090",
    )
    assert service("ledger").health({"entries": "4"}) == {"entries": 4}
    with pytest.raises(ConfigError, match="AML_RELATIONS_PORT and AML_LEDGER_PORT must differ"):
        load_settings({"AML_LEDGER_PORT": "8081"})
    assert service("relations").table == "edges" and settings.relations_group == "relations"


def test_a_registry_can_be_passed_explicitly() -> None:
    mine = {"ledger": LEDGER}
    assert service("ledger", mine).table == "entries"
    with pytest.raises(UnknownService, match="'relations'; expected one of ledger"):
        service("relations", mine)


def test_the_registry_loads_neither_the_services_modules_nor_psycopg() -> None:
    """The CLI and the settings read the registry at import: it and the settings must stay light."""
    probe = (
        "import sys, aml_app.dependency_services\n"
        "alone = sorted(m for m in sys.modules if 'psycopg' in m or m.startswith('aml_app.'))\n"
        "import aml_app.settings\n"
        "after = sorted(m for m in sys.modules if 'psycopg' in m or m.startswith('aml_app.dependencies'))\n"
        "print(alone, after)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "['aml_app.dependency_services'] []"
