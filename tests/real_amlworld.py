"""The real AMLworld files of `tests/data/amlworld`, read and replayed once per test session: several test
modules score detectors on the same evidence (the reference of B and C, gate on), which takes seconds
per replay of its 11,403 payments."""

from __future__ import annotations

import functools
from typing import Any

from aml_app.detection.evidence import Evidence
from aml_app.detection.thresholds import AmlThresholds
from aml_app.simulation.amlworld import read_amlworld, read_patterns
from aml_app.training.replay import Services, decided, timeline_of
from bench.amlworld_detection import BACKGROUND, PATTERNS


@functools.cache
def real_files() -> tuple[Any, Any, list[Any]]:
    """The patterns, the background and both as one timeline in event-time order."""
    patterns = read_patterns(PATTERNS)
    background = read_amlworld(BACKGROUND, prefix="amlworld-background")
    return patterns, background, timeline_of(patterns, background)


@functools.cache
def real_decided() -> tuple[tuple[Any, Evidence], ...]:
    """Every payment of the timeline with its evidence, gate on, with the default thresholds."""
    return tuple(decided(Services(AmlThresholds()), real_files()[2]))
