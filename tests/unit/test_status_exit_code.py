"""`aml-app status` exits with the code a monitoring check reads (0 ok, 1 warning, 2 critical, 3 unknown),
computed from the same document it prints."""

from __future__ import annotations

from typing import Any

import pytest

from aml_app.views.status import health_code


def doc(*statuses: str, **extra: Any) -> dict[str, Any]:
    """A status document with one dependency per status and a gate with nothing wrong."""
    body: dict[str, Any] = {
        "dependencies": [{"group": f"g{i}", "status": s} for i, s in enumerate(statuses)],
        "gate": {"breached_partitions": [], "admin_error": None},
        "recovering": False,
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
