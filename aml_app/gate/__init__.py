"""The reusable freshness gate: watermarks from committed offsets, per-partition waiting, lanes."""

from aml_app.gate.consumer import GatedConsumer
from aml_app.gate.gate import Admission, FreshnessGate

__all__ = [
    "Admission",
    "FreshnessGate",
    "GatedConsumer",
]
