"""Service-A: anti-money-laundering detection, gated on its dependencies' committed offsets."""

from __future__ import annotations

from aml_app.app import settings
from aml_app.detection.evidence import Evidence
from aml_app.detection.model import load
from aml_app.detection.rules import Hit, aml_rules
from aml_app.worker.detector import detecting_service

model = load(settings.aml_model)


def detect(evidence: Evidence) -> list[Hit]:
    """The rules; with a model (`AML_MODEL`), the model and the rules it keeps alerting beside it."""
    if model is None:
        return aml_rules(evidence, settings.aml_thresholds)
    return model.detect(evidence, settings.aml_thresholds)


detector = detecting_service("aml", detect)
