"""Service-A: anti-money-laundering detection, gated on its dependencies' committed offsets."""

from __future__ import annotations

from aml_app.app import settings
from aml_app.detection.evidence import Evidence
from aml_app.detection.model import load
from aml_app.detection.rules import Hit, aml_rules
from aml_app.worker.detector import detecting_service

model = load(settings.detection.aml_model, settings.detection.aml_alert_budget)


def detect(evidence: Evidence) -> list[Hit]:
    """The rules; with a model (`AML_MODEL`), the model and the rules it keeps alerting beside it."""
    return detect_many([evidence])[0]


def detect_many(evidences: list[Evidence]) -> list[list[Hit]]:
    """`detect` of each payment of a batch; the model scores the batch at once."""
    if model is None:
        return [aml_rules(evidence, settings.detection.aml_thresholds) for evidence in evidences]
    return model.detect_many(evidences, settings.detection.aml_thresholds)


detector = detecting_service("aml", detect, detect_many)
