"""The simulator calibrated to AMLworld (`aml_app.simulation.calibrated`) against the real rows and the
real patterns file, within the bounds of `aml_app.simulation.calibration`; our own simulator is the
negative control that shows the bounds can fail."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from aml_app.simulation import calibrated
from aml_app.simulation.amlworld import PATTERN_TYPOLOGIES, read_amlworld, read_patterns
from aml_app.simulation.calibrated import simulate_calibrated
from aml_app.simulation.calibrated_command import simulate_amlworld_command
from aml_app.simulation.calibration import (
    BackgroundMeasures,
    PatternMeasures,
    background_gaps,
    measure,
    measure_patterns,
    pattern_gaps,
)
from aml_app.simulation.traffic import simulate
from bench.attempt_shapes import repeated_edges

DATA = Path(__file__).resolve().parents[1] / "data" / "amlworld"
TYPOLOGIES = set(PATTERN_TYPOLOGIES.values())  # AMLworld's eight, in our names


@pytest.fixture(scope="module")
def real_background() -> BackgroundMeasures:
    return measure(
        p for p in read_amlworld(DATA / "HI-Small_Trans_rows1-7500.csv").payments if not p.is_laundering
    )


@pytest.fixture(scope="module")
def real_file() -> Any:
    """LI-Medium's patterns file, read once."""
    return read_patterns(DATA / "LI-Medium_Patterns.txt")


@pytest.fixture(scope="module")
def real_patterns(real_file: Any) -> dict[str, PatternMeasures]:
    return measure_patterns(real_file.attempts, real_file.payments)


def test_the_background_is_the_real_rows_within_bounds(
    tmp_path: Path, real_background: BackgroundMeasures
) -> None:
    # Half an hour at the real rows' rate, among as many accounts as a large AMLworld set has.
    run = simulate_calibrated(5, days=0.5 / 24, per_hour=15_000, attempts=0, accounts=500_000)
    transactions, _ = run.write(tmp_path)
    simulated = measure(read_amlworld(transactions).payments)
    assert background_gaps(real_background, simulated) == []
    assert simulated.currencies == {"USD": 1.0}


def test_our_own_simulator_is_out_of_the_background_bounds(real_background: BackgroundMeasures) -> None:
    ours = simulate(seed=11, count=7500, rate=50, start=datetime(2026, 3, 2, tzinfo=UTC), instances=0)
    gaps = background_gaps(real_background, measure(ours.payments))
    assert any(gap.startswith("self_share") for gap in gaps)
    assert any(gap.startswith("amount p50") for gap in gaps)


def test_the_attempts_are_the_patterns_file_within_bounds(
    tmp_path: Path, real_patterns: dict[str, PatternMeasures]
) -> None:
    run = simulate_calibrated(5, days=14, per_hour=1, attempts=200)
    _, patterns_file = run.write(tmp_path)
    patterns = read_patterns(patterns_file)
    simulated = measure_patterns(patterns.attempts, patterns.payments)
    assert set(simulated) == set(real_patterns) == TYPOLOGIES
    assert pattern_gaps(real_patterns, simulated) == []
    assert Counter(a.typology for a in patterns.attempts) == {t: 200 for t in TYPOLOGIES}


def _calibrated_patterns(folder: Path) -> Any:
    """The attempts of a calibrated run with as many as the patterns file's (456), read back."""
    run = simulate_calibrated(5, days=14, per_hour=1, attempts=57)
    return read_patterns(run.write(folder)[1])


@pytest.fixture(scope="module")
def calibrated_file(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`_calibrated_patterns` with the simulator as it is, made once for the tests that compare it."""
    return _calibrated_patterns(tmp_path_factory.mktemp("calibrated"))


def _edge_reuse(patterns: Any) -> dict[str, float]:
    """The shares of attempts paying again along an earlier attempt's edge, and against one."""
    found = repeated_edges(patterns.attempts, patterns.payments)
    return {way: found[way] / found["attempts"] for way in ("repeated", "reversed")}


def test_attempts_pay_again_along_earlier_attempts_edges_as_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, real_file: Any, calibrated_file: Any
) -> None:
    real = _edge_reuse(real_file)
    assert real == pytest.approx({"repeated": 69 / 456, "reversed": 72 / 456})
    simulated = _edge_reuse(calibrated_file)
    assert simulated == pytest.approx(real, abs=0.05)
    monkeypatch.setattr(calibrated, "REUSED_EDGE_SHARE", (0.0, 0.0, 0.0))  # each attempt's accounts afresh
    fresh = _edge_reuse(_calibrated_patterns(tmp_path / "fresh"))  # only chance meetings among 1,000 accounts
    assert fresh["repeated"] < 0.05 and fresh["reversed"] < 0.05


def _reuse_by_size(patterns: Any) -> dict[str, float]:
    """Per attempt size (1, 2, 3+ payments), the share paying between accounts an earlier attempt paid
    between."""
    found = repeated_edges(patterns.attempts, patterns.payments)["by_size"]
    return {size: reused / attempts for size, (reused, attempts) in found.items()}


def test_small_attempts_reuse_earlier_attempts_edges_as_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, real_file: Any, calibrated_file: Any
) -> None:
    real = _reuse_by_size(real_file)
    assert real == pytest.approx({"1": 30 / 51, "2": 33 / 77, "3+": 20 / 328})
    assert _reuse_by_size(calibrated_file) == pytest.approx(real, abs=0.1)
    monkeypatch.setattr(calibrated, "REUSED_EDGE_SHARE", (0.3, 0.3, 0.3))  # one share whatever the size
    alike = _reuse_by_size(_calibrated_patterns(tmp_path / "alike"))
    assert alike["1"] < real["1"] - 0.1 and alike["3+"] > real["3+"] + 0.1


def _loops_back(patterns: Any) -> dict[str, float]:
    """Per typology, the share of attempts in which an account pays back one that paid it (A -> B -> A)."""
    by_id = {p.payment_id: p for p in patterns.payments}
    found: dict[str, list[bool]] = {}
    for attempt in patterns.attempts:
        edges = {(by_id[pid].payer, by_id[pid].payee) for pid in attempt.payment_ids}
        found.setdefault(attempt.typology, []).append(any((b, a) in edges for a, b in edges))
    return {typology: sum(loops) / len(loops) for typology, loops in found.items()}


def test_money_goes_back_where_it_came_from_as_often_as_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, real_file: Any, calibrated_file: Any
) -> None:
    real = _loops_back(real_file)
    assert real["gather_scatter"] == pytest.approx(18 / 43) and real["stack"] == pytest.approx(22 / 67)
    assert _loops_back(calibrated_file) == pytest.approx(real, abs=0.12)
    monkeypatch.setattr(calibrated, "BACK_TO_SENDERS", 0.0)
    monkeypatch.setattr(calibrated, "STACK_LOOP_SHARE", 0.0)
    chains = _loops_back(_calibrated_patterns(tmp_path / "chains"))
    assert chains["gather_scatter"] == 0 and chains["stack"] == 0


def test_the_pattern_bounds_catch_a_shape_out_of_line(real_patterns: dict[str, PatternMeasures]) -> None:
    fans = real_patterns["fan_in"]
    short = {**real_patterns, "fan_in": PatternMeasures(**{**fans.as_json(), "span_hours": 24.0})}
    assert pattern_gaps(real_patterns, short) == [
        "fan_in: span_hours is 24.0, real 125.2 (within a factor 1.4)"
    ]
    assert pattern_gaps(real_patterns, {}) == [f"{t}: no attempt simulated" for t in real_patterns]


def test_a_run_is_reproducible_and_spans_its_days(tmp_path: Path) -> None:
    one = simulate_calibrated(9, days=13, per_hour=3, attempts=4)
    assert one == simulate_calibrated(9, days=13, per_hour=3, attempts=4)
    assert one != simulate_calibrated(10, days=13, per_hour=3, attempts=4)
    assert max(row.at for a in one.attempts for row in a.rows) <= 13 * 86400
    short = simulate_calibrated(9, days=1, per_hour=3, attempts=4)  # attempts of up to 12 days, compressed
    assert max(row.at for a in short.attempts for row in a.rows) <= 86400
    transactions, patterns = one.write(tmp_path)
    background = read_amlworld(transactions)
    assert len(background.payments) == len(one.background) == 13 * 24 * 3 and not background.laundering
    assert len(read_patterns(patterns).payments) == sum(len(a.rows) for a in one.attempts)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"days": 0}, "days and per_hour must be positive"),
        ({"per_hour": float("nan")}, "days and per_hour must be positive"),
        ({"attempts": -1}, "attempts must be a whole number"),
        ({"accounts": 10}, "accounts must be at least 100"),
    ],
)
def test_impossible_parameters_are_refused(arguments: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate_calibrated(1, **arguments)  # type: ignore[arg-type]


def test_the_command_writes_both_files(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        simulate_amlworld_command,
        [str(tmp_path / "run"), "--days", "1", "--per-hour", "10", "--attempts", "2"],
    )
    assert result.exit_code == 0, result.output
    assert "240 background payment(s)" in result.output and "16 attempt(s)" in result.output
    assert f"aml-app import-amlworld {tmp_path / 'run' / 'Trans.csv'}" in result.output
    assert len(read_patterns(tmp_path / "run" / "Patterns.txt").attempts) == 16
