"""The registry of the dependency services (B = relations, C = aggregates): what differs between them.

Every place that treats the services differently looks its service up here, so that an unknown name
fails loudly (`service`) instead of being taken for one of the others, and a new service is one entry
in `SERVICES` plus its own module (store schema, writes, queries). Everything heavy (the service's
module, psycopg, pyspark, aiohttp) is imported when used, so the CLI and the settings can read the
names without loading them.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg
    from aiohttp import web

    from aml_app.dependencies.api import StoreCheck
    from aml_app.dependencies.store import Reader, Schema
    from aml_app.settings import Settings


@dataclass(frozen=True)
class DependencyService:
    """One dependency service: its store, its consumer group and port, its batch table and its API.

    `group`, `port` and `urls` name the `Settings` fields (or properties) that hold them, so the
    settings keep their names and environment variables.
    """

    name: str
    #: The service's own module: its store `SCHEMA`, writes and queries.
    module: str
    #: The table the service's Spark job makes of a micro-batch (`BatchOutputs.tables`).
    table: str
    #: The Spark transform that makes the table, as "module:function": (valid payments, near-threshold
    #: threshold, band) -> the table, as Arrow. A name, not the function: the pipeline imports the
    #: registry and loads the transform it names, so this package never imports Spark's side.
    transform: str
    #: (connection, the batch's table, how long flows are kept) -> the rows applied.
    write: Callable[[psycopg.Connection, Any, timedelta], int]
    #: (reader, settings, store check) -> the aiohttp application with the service's routes.
    app: Callable[[Reader, Any, StoreCheck | None], web.Application]
    group_setting: str
    port_setting: str
    urls_setting: str
    #: The environment variable that sets `urls` (comma-separated), as `load_settings` reads it.
    urls_env: str
    #: Checks the store makes against the settings when the pipeline opens it (connection, schema, settings).
    check_store: Callable[[psycopg.Connection, Schema, Any], None] = lambda conn, schema, settings: None
    #: What /health adds from the store's meta.
    health: Callable[[Mapping[str, str]], dict[str, Any]] = lambda meta: {}

    @property
    def schema(self) -> Schema:
        """The service's store schema, from its module."""
        schema: Schema = importlib.import_module(self.module).SCHEMA
        return schema

    def group(self, settings: Settings) -> str:
        """The consumer group whose committed offsets say how far the service is."""
        return str(getattr(settings, self.group_setting))

    def port(self, settings: Settings) -> int:
        return int(getattr(settings, self.port_setting))

    def with_port(self, settings: Settings, port: int) -> Settings:
        """`settings` with the service's API on `port` (a replica of its own)."""
        changes: dict[str, Any] = {self.port_setting: port}
        return dataclasses.replace(settings, **changes)

    def urls(self, settings: Settings) -> tuple[str, ...]:
        """The replicas of the service's API the workers ask."""
        return tuple(getattr(settings, self.urls_setting))


def _write_edges(conn: psycopg.Connection, table: Any, keep: timedelta) -> int:
    from aml_app.dependencies import relations

    relations.write_edges(conn, relations.SCHEMA, table)
    return int(table.num_rows)


def _write_flows(conn: psycopg.Connection, table: Any, keep: timedelta) -> int:
    from aml_app.dependencies import aggregates

    return aggregates.write_batch(conn, aggregates.SCHEMA, table, keep)


def _relations_app(reader: Reader, settings: Any, check: StoreCheck | None) -> web.Application:
    from aml_app.dependencies.api import relations_app

    return relations_app(reader, check)


def _aggregates_app(reader: Reader, settings: Any, check: StoreCheck | None) -> web.Application:
    from aml_app.dependencies.api import aggregates_app

    return aggregates_app(reader, settings, check)


def _check_thresholds(conn: psycopg.Connection, schema: Schema, settings: Any) -> None:
    from aml_app.dependencies import aggregates

    aggregates.check_thresholds(conn, schema, settings.reporting_threshold, settings.threshold_band)


def _aggregates_health(meta: Mapping[str, str]) -> dict[str, Any]:
    return {"late_dropped": int(meta.get("late_dropped", "0")), "max_event_ts": meta.get("max_event_ts")}


SERVICES: Mapping[str, DependencyService] = {
    s.name: s
    for s in (
        DependencyService(
            "relations",
            "aml_app.dependencies.relations",
            "edges",
            "aml_app.pipeline.transforms:edges_table",
            _write_edges,
            _relations_app,
            "relations_group",
            "relations_port",
            "relations_urls",
            "AML_RELATIONS_URL",
        ),
        DependencyService(
            "aggregates",
            "aml_app.dependencies.aggregates",
            "flows",
            "aml_app.pipeline.transforms:flows_table",
            _write_flows,
            _aggregates_app,
            "aggregates_group",
            "aggregates_port",
            "aggregates_urls",
            "AML_AGGREGATES_URL",
            check_store=_check_thresholds,
            health=_aggregates_health,
        ),
    )
}
NAMES: tuple[str, ...] = tuple(SERVICES)


class UnknownService(ValueError):
    """A name that is not one of the registered dependency services."""


def service(name: str, services: Mapping[str, DependencyService] | None = None) -> DependencyService:
    """The registered service `name` (in `services`, by default `SERVICES`); any other name is an error
    naming the known ones, never taken for one of them."""
    known = SERVICES if services is None else services
    try:
        return known[name]
    except KeyError:
        raise UnknownService(f"unknown service {name!r}; expected one of {', '.join(known)}") from None
