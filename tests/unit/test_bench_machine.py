"""What every benchmark's results record of the machine: the speed probe and the CPU time stolen."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import bench.common as common

STAT = "cpu  10 2 30 400 5 0 6 7 0 0\ncpu0 5 1 15 200 2 0 3 4 0 0\nintr 1 2 3\n"


def test_cpu_ticks_are_the_first_eight_counters_and_the_stolen_one(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert common.cpu_ticks(stat) == (10 + 2 + 30 + 400 + 5 + 0 + 6 + 7, 7)


@pytest.mark.parametrize("text", ["", "intr 1 2 3\n", "cpu  10 2 30\n"])
def test_cpu_ticks_that_cannot_be_read_are_none(tmp_path: Path, text: str) -> None:
    stat = tmp_path / "stat"
    stat.write_text(text)
    assert common.cpu_ticks(stat) is None
    assert common.cpu_ticks(tmp_path / "absent") is None


def test_the_stolen_share_is_of_the_ticks_between_the_two_readings() -> None:
    assert common.steal_share([1_000, 10], (3_000, 60)) == 0.025
    assert common.steal_share(None, (3_000, 60)) is None
    assert common.steal_share([1_000, 10], None) is None
    assert common.steal_share([3_000, 60], (3_000, 60)) is None


def test_results_record_the_probe_at_both_ends_and_the_share_stolen_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    readings = iter([(10_000, 100), (14_000, 300)])
    monkeypatch.setattr(common, "cpu_ticks", lambda: next(readings))
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    doc: dict[str, Any] = {"benchmark": "probe", "machine": common.machine()}
    written = json.loads(common.write_results("probe", doc).read_text())["machine"]
    cpus = {str(cpu) for cpu in os.sched_getaffinity(0)}
    for probe in (written["speed_probe_ms_at_start"], written["speed_probe_ms_at_end"]):
        assert probe.keys() == cpus and min(probe.values()) > 0
    assert os.sched_getaffinity(0) == {int(cpu) for cpu in cpus}  # the probe gives the CPUs back
    assert written["cpu_ticks_at_start"] == [10_000, 100]
    assert written["cpu_stolen_share"] == 0.05
    assert written["code_at_end"] == written["code_at_start"]
