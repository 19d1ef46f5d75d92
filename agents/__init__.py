"""The gated services a worker can run, and the one place a worker is composed.

`SERVICES` names each service (`AML_SERVICE`) and the function that registers its agent; importing it
registers nothing. `compose` builds what a worker runs: the gate service, the service's gated agent
and the web views, given what they show. `aml-app worker` calls it before Faust's worker starts.
"""

from __future__ import annotations

from collections.abc import Callable

from aml_app.agents import aml, fraud, probe
from aml_app.tables.watermarks import WorkerGate, gate_service

from aml_app.errors import ConfigError
from aml_app.views.web import Shown, add_views
from aml_app.worker.agent import Served

#: Each gated service by name: what registers its agent on a worker's gate.
SERVICES: dict[str, Callable[[WorkerGate], Served]] = {
    "aml": aml.service,
    "fraud": fraud.service,
    "probe": probe.service,
}


def unregistered(service: str) -> str | None:
    """Why `service` cannot run, in one sentence (None: it can): a module of agents/ not in `SERVICES`."""
    if service in SERVICES:
        return None
    return (
        f"AML_SERVICE={service!r} is not in the registry of gated services (SERVICES in "
        f"aml_app/agents/__init__.py: {', '.join(SERVICES)}); a new service's module is named there."
    )


def compose(service: str) -> Shown:
    """Build this worker: its gate service, `service`'s gated agent on it, and the web views."""
    if (problem := unregistered(service)) is not None:
        raise ConfigError(problem)
    worker_gate = gate_service()
    served = SERVICES[service](worker_gate)
    # Every worker's page shows the lanes that keep failing, through the demand table.
    worker_gate.publisher.retrying = served.gated.retrying_json
    shown = Shown(worker_gate, served.gated, served.detector)
    add_views(shown)
    return shown
