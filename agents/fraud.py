"""Service-A1: fraud detection. Same gate, same dependencies, its own consumer group and rules.

A module like this one, named in the registry (`aml_app.agents.SERVICES`), is all it takes to add a
gated service: `AML_SERVICE=fraud aml-app worker` runs it, with consumer group `fraud` and topics
`fraud.decisions` and `fraud.alerts` unless configured otherwise.
"""

from __future__ import annotations

from aml_app.tables.watermarks import WorkerGate

from aml_app.app import settings
from aml_app.detection.fraud_rules import fraud_rules
from aml_app.worker.agent import Served
from aml_app.worker.detector import detecting_service


def service(worker_gate: WorkerGate) -> Served:
    thresholds = settings.detection.fraud_thresholds
    return Served(
        *detecting_service(worker_gate, "fraud", lambda evidence: fraud_rules(evidence, thresholds))
    )
