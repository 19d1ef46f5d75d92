"""The registry of the dependency services (B = relations, C = aggregates): what differs between them.

Every place that treats the services differently looks its service up here, so that an unknown name
fails loudly (`service`) instead of being taken for one of the others, and a new service is one entry
in `SERVICES` plus its own module. The settings read each service's group, port and API replicas from
`AML_<NAME>_GROUP`, `AML_<NAME>_PORT` and `AML_<NAME>_URL` (`Endpoint`).

An entry names its code, a module and "module:function" references, loaded when used: the registry
sits below the settings in the package's import order and imports nothing of the package, so the CLI and
the settings read it without loading a store, psycopg, Spark or aiohttp.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any, Protocol, Self, TypeVar

#: Queries one request to a dependency's API may hold (`aml_app.dependencies.api` refuses more).
MAX_QUERIES = 1000
#: Queries a detector asks each dependency about one payment (its payer and its payee), so a batch of
#: payments fits one request while it holds at most MAX_QUERIES // QUERIES_PER_PAYMENT of them.
QUERIES_PER_PAYMENT = 2


@dataclass(frozen=True)
class Endpoint:
    """Where one service is: its consumer group, its API's port, and its API's replicas (none: the port
    on `services_host`)."""

    group: str
    port: int
    api: tuple[str, ...] = ()


class _Dependencies(Protocol):
    """What the registry reads of the dependency settings (`aml_app.settings.DependencySettings`)."""

    @property
    def services_host(self) -> str: ...

    @property
    def endpoints(self) -> Mapping[str, Endpoint]: ...


class _Kafka(Protocol):
    @property
    def payments_topic(self) -> str: ...


class HasEndpoints(Protocol):
    """What the registry reads of the settings (`aml_app.settings.Settings`)."""

    @property
    def dependencies(self) -> _Dependencies: ...

    @property
    def kafka(self) -> _Kafka: ...

    @property
    def derived_dependencies(self) -> Mapping[str, tuple[str, str]]: ...

    def with_endpoint(self, name: str, **changes: Any) -> Self: ...


S = TypeVar("S", bound=HasEndpoints)


def load(reference: str) -> Callable[..., Any]:
    """The function a "module:function" reference names."""
    module, _, name = reference.partition(":")
    found: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return found


@dataclass(frozen=True)
class DependencyService:
    """One dependency service: its store, its batch table and Spark transform, its API and its defaults."""

    name: str
    #: The service's own module: its store `SCHEMA`, `write_table(conn, table, keep) -> rows applied`,
    #: and optionally `check_store(conn, schema, settings)` (run when the pipeline opens the store) and
    #: `health(meta) -> dict` (what /health adds from the store's meta).
    module: str
    #: The table the service's Spark job makes of a micro-batch (`BatchOutputs.tables`).
    table: str
    #: "module:function": (valid payments, near-threshold threshold, band) -> the table, as Arrow.
    transform: str
    #: "module:function": (reader, settings, store check) -> the aiohttp application with its routes.
    api: str
    #: The API's port when `AML_<NAME>_PORT` is not set.
    default_port: int

    @property
    def group_env(self) -> str:
        return f"AML_{self.name.upper()}_GROUP"

    @property
    def port_env(self) -> str:
        return f"AML_{self.name.upper()}_PORT"

    @property
    def urls_env(self) -> str:
        """The variable that lists the replicas of the service's API (comma-separated)."""
        return f"AML_{self.name.upper()}_URL"

    def default_endpoint(self) -> Endpoint:
        return Endpoint(self.name, self.default_port)

    def own(self) -> ModuleType:
        return importlib.import_module(self.module)

    @property
    def schema(self) -> Any:
        """The service's store schema (`aml_app.dependencies.store.Schema`), from its module."""
        return self.own().SCHEMA

    def write(self, conn: Any, table: Any, keep: timedelta) -> int:
        """Apply a batch's table to the store in `conn`'s transaction; the rows applied."""
        return int(self.own().write_table(conn, table, keep))

    def app(self, reader: Any, settings: Any, check: Any) -> Any:
        """The service's API (an aiohttp application) over `reader`."""
        return load(self.api)(reader, settings, check)

    def check_store(self, conn: Any, schema: Any, settings: Any) -> None:
        hook = getattr(self.own(), "check_store", None)
        if hook is not None:
            hook(conn, schema, settings)

    def health(self, meta: Mapping[str, str]) -> dict[str, Any]:
        hook = getattr(self.own(), "health", None)
        return {} if hook is None else dict(hook(meta))

    def group(self, settings: HasEndpoints) -> str:
        """The consumer group whose committed offsets say how far the service is."""
        return settings.dependencies.endpoints[self.name].group

    def topic(self, settings: HasEndpoints) -> str:
        """The topic the service reads: payments, or the topic derived from it that its group is declared
        to read (`AML_DERIVED_DEPENDENCIES`, the declaration the gate maps that group's offsets by)."""
        derived = settings.derived_dependencies.get(self.group(settings))
        return settings.kafka.payments_topic if derived is None else derived[0]

    def port(self, settings: HasEndpoints) -> int:
        return settings.dependencies.endpoints[self.name].port

    def with_port(self, settings: S, port: int) -> S:
        """`settings` with the service's API on `port` (a replica of its own)."""
        return settings.with_endpoint(self.name, port=port)

    def urls(self, settings: HasEndpoints) -> tuple[str, ...]:
        """The replicas of the service's API the workers ask."""
        endpoint = settings.dependencies.endpoints[self.name]
        return endpoint.api or (f"http://{settings.dependencies.services_host}:{endpoint.port}",)


SERVICES: Mapping[str, DependencyService] = {
    s.name: s
    for s in (
        DependencyService(
            "relations",
            "aml_app.dependencies.relations",
            "edges",
            "aml_app.pipeline.transforms:edges_table",
            "aml_app.dependencies.api:relations_app",
            8081,
        ),
        DependencyService(
            "aggregates",
            "aml_app.dependencies.aggregates",
            "flows",
            "aml_app.pipeline.transforms:flows_table",
            "aml_app.dependencies.api:aggregates_app",
            8082,
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
