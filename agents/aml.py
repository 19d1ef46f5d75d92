"""Service-A: anti-money-laundering detection, gated on its dependencies' committed offsets."""

from __future__ import annotations

from aml_app.tables.watermarks import WorkerGate

from aml_app.app import settings
from aml_app.detection.evidence import Evidence
from aml_app.detection.model import load
from aml_app.detection.rules import Hit, aml_rules, strengthened
from aml_app.worker.agent import Served
from aml_app.worker.detector import detecting_service


def service(worker_gate: WorkerGate) -> Served:
    """The AML agent: the rules, each hit scored by its rule's strength; with a model (`AML_MODEL`), the
    model and the rules it keeps alerting beside it, the model scoring a lane's batch at once."""
    thresholds = settings.detection.aml_thresholds
    model = load(settings.detection.aml_model, settings.detection.aml_alert_budget, settings.model_settings())

    def detect_many(evidences: list[Evidence]) -> list[list[Hit]]:
        if model is None:
            return [strengthened(aml_rules(evidence, thresholds)) for evidence in evidences]
        return model.detect_many(evidences, thresholds)

    def detect(evidence: Evidence) -> list[Hit]:
        return detect_many([evidence])[0]

    return Served(*detecting_service(worker_gate, "aml", detect, detect_many))
