"""Service-A: anti-money-laundering detection, gated on its dependencies' committed offsets."""

from __future__ import annotations

from aml_app.app import settings
from aml_app.detection.detector import detecting_service
from aml_app.detection.rules import aml_rules

detector = detecting_service("aml", lambda evidence: aml_rules(evidence, settings.aml_thresholds))
