"""`aml-app status` exits with the code a monitoring check reads (0 ok, 1 warning, 2 critical, 3 unknown),
computed from the same document it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner

from aml_app.views.status import health_code, status_command


def doc(*statuses: str, **extra: Any) -> dict[str, Any]:
    """A status document with one dependency per status and a gate with nothing wrong."""
    body: dict[str, Any] = {
        "dependencies": [{"group": f"g{i}", "status": s} for i, s in enumerate(statuses)],
        "gate": {"breached_partitions": [], "admin_error": None},
        "recovering": False,
        "partitions": [{"partition": 0, "untrusted": None}],
    }
    body.update(extra)
    return body


def test_all_ok_is_zero() -> None:
    assert health_code(doc("ok", "ok")) == 0
    assert health_code(doc("ok", refresh={"state": "ok"}, retrying=[])) == 0


def test_a_lagging_dependency_or_a_retried_payment_warns() -> None:
    assert health_code(doc("ok", "lagging")) == 1
    assert health_code(doc("ok", retrying=[{"partition": 0, "offset": 7}])) == 1


@pytest.mark.parametrize("status", ["stalled", "error", "unknown group"])
def test_a_dependency_that_holds_payments_back_or_is_unread_is_critical(status: str) -> None:
    assert health_code(doc("ok", "lagging", status)) == 2


def test_a_breached_partition_a_failed_refresh_or_a_stuck_one_is_critical_whatever_the_statuses() -> None:
    assert health_code(doc("ok", gate={"breached_partitions": [3], "admin_error": None})) == 2
    assert health_code(doc("ok", gate={"breached_partitions": [], "admin_error": "timed out"})) == 2
    assert health_code(doc("ok", refresh={"state": "stuck"})) == 2


def test_a_worker_still_recovering_is_unknown() -> None:
    assert health_code({"recovering": True, "partitions": []}) == 3


def test_a_row_the_gate_distrusts_is_critical_though_every_dependency_is_ok() -> None:
    """The gate stays closed there (an old row, another log, an earlier generation): it exited 0."""
    old = "the row is 120.0 s old (more than 5 s): the leader has not refreshed it"
    gate = {"breached_partitions": [], "admin_error": None, "untrusted_partitions": [0]}
    assert health_code(doc("ok", "ok", gate=gate)) == 2
    assert health_code(doc("ok", cut={"untrusted": old, "unread": []})) == 2
    assert health_code(doc("ok", cut={"untrusted": None, "unread": [1]})) == 2
    assert health_code(doc("ok", cut={"untrusted": None, "unread": []})) == 0


def test_no_watermark_yet_is_unknown_and_a_failing_first_refresh_critical() -> None:
    """With no row no group is known (it said "unknown group" and blamed the names) and the refresh's
    error lived only in the leader's `refresh.last_error`."""
    assert health_code(doc(partitions=[])) == 3
    failing = doc(partitions=[], refresh={"state": "ok", "last_error": "topic 'payments' does not exist"})
    assert health_code(failing) == 2


def test_a_check_that_cannot_run_is_unknown_not_critical() -> None:
    """A wrong setting would page someone as critical (2); the check itself is what is broken. The
    command line reads every setting before any command: it exited 2 there."""
    result = CliRunner().invoke(status_command, [], env={"AML_LAG_WARN": "abc"})
    assert result.exit_code == 3
    assert "configuration error: AML_LAG_WARN='abc'" in result.output
    run = subprocess.run(
        [sys.executable, "-m", "aml_app.cli", "status"],
        env={**os.environ, "AML_LAG_WARN": "abc"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 3 and "configuration error: AML_LAG_WARN='abc'" in run.stderr


@pytest.mark.parametrize("timeout", ["0", "-1", "inf", "nan"])
def test_a_timeout_that_is_no_deadline_is_refused(timeout: str) -> None:
    """aiohttp takes a total of 0 or less for no deadline at all."""
    result = CliRunner().invoke(status_command, ["--timeout", timeout])
    assert result.exit_code == 2 and "--timeout" in result.output
