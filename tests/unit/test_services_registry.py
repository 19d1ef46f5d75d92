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

from aml_app.dependencies import aggregates, relations
from aml_app.dependencies import services as registry
from aml_app.dependencies.services import DependencyService, UnknownService, service
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
    assert service("relations").health({"late_dropped": "3"}) == {}
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


def ledger_transform(valid: Any, threshold: Decimal, band: Decimal) -> Any:
    """The test-only service's transform, named by its registry entry."""
    return [row for row in valid if row > threshold]


def ledger_service(written: list[Any]) -> DependencyService:
    """A test-only third service: its batch table, write, group, port and URLs, nothing else."""

    def write(conn: Any, table: Any, keep: timedelta) -> int:
        written.append((conn, table, keep))
        return len(table)

    return DependencyService(
        "ledger",
        "aml_app.dependencies.relations",
        "entries",
        f"{__name__}:ledger_transform",
        write,
        lambda reader, settings, check: None,  # type: ignore[arg-type, return-value]
        "app_id",
        "web_port",
        "relations_urls",
        "AML_LEDGER_URL",
    )


def test_a_third_service_is_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding the entry is all the pipeline's writer, its transform, the batch table and the settings'
    lookups need: no other module changes."""
    from aml_app.pipeline.jobs import writer_for
    from aml_app.pipeline.runner import group_of
    from aml_app.pipeline.transforms import BatchOutputs, aggregation

    written: list[Any] = []
    monkeypatch.setattr(registry, "SERVICES", {**registry.SERVICES, "ledger": ledger_service(written)})
    settings = Settings()

    assert aggregation("ledger", [1, 5, 9], Decimal(4), Decimal(0)) == [5, 9]
    outputs = BatchOutputs(spans=None, rejects=None, tables={"entries": [5, 9]})
    assert writer_for("ledger", timedelta(days=1))("conn", outputs) == 2
    assert written == [("conn", [5, 9], timedelta(days=1))]
    assert group_of(settings, "ledger") == settings.app_id
    assert service("ledger").port(settings) == settings.web_port
    assert service("relations").table == "edges"  # the others are unchanged


def test_a_registry_can_be_passed_explicitly() -> None:
    mine = {"ledger": ledger_service([])}
    assert service("ledger", mine).table == "entries"
    with pytest.raises(UnknownService, match="'relations'; expected one of ledger"):
        service("relations", mine)


def test_the_registry_loads_neither_the_services_modules_nor_psycopg() -> None:
    """The CLI and the settings read the names at import: the registry must stay light."""
    probe = (
        "import sys, aml_app.dependencies.services\n"
        "print(sorted(m for m in sys.modules if 'psycopg' in m or m.startswith('aml_app.dependencies.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "['aml_app.dependencies.services']"
