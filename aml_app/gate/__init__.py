"""The reusable freshness gate: watermarks from committed offsets, per-partition waiting, lanes."""

from aml_app.gate.consumer import Admission, GatedConsumer, retry_forever
from aml_app.gate.gate import FreshnessGate
from aml_app.gate.offsets import DependencyOffsets, OffsetReadError

__all__ = [
    "Admission",
    "DependencyOffsets",
    "FreshnessGate",
    "GatedConsumer",
    "OffsetReadError",
    "retry_forever",
]
