"""The reusable freshness gate: watermarks from committed offsets, per-partition waiting, lanes."""

from aml_app.gate.consumer import Admission, GatedConsumer
from aml_app.gate.gate import FreshnessGate
from aml_app.gate.retry import retry_forever

__all__ = [
    "Admission",
    "FreshnessGate",
    "GatedConsumer",
    "retry_forever",
]
