"""`aml-app park` when the cluster does not answer: one sentence and exit 1, no traceback."""

from __future__ import annotations

import gc
import os
import socket
import warnings

import pytest
from click.testing import CliRunner

from aml_app.gate.park_command import park_command


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once the socket closes


def test_park_with_the_broker_down_says_so_in_one_sentence() -> None:
    runner = CliRunner()
    env = {"KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{closed_port()}"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = runner.invoke(park_command, ["0:1", "--timeout", "2"], env=env)
        gc.collect()
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: the Kafka cluster at 127.0.0.1:"), result.output
    assert "did not answer within 2 s" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "Traceback" not in result.output
    unclosed = [w for w in caught if "Unclosed" in str(w.message)]
    assert unclosed == [], [str(w.message) for w in unclosed]


def test_park_refuses_a_place_or_a_timeout_it_cannot_use() -> None:
    runner = CliRunner()
    for args in (
        ["\u00b2:1"],
        ["0:1", "--timeout", "0"],
        ["0:1", "--timeout", "inf"],
        ["0:1", "--timeout", "nan"],
    ):
        result = runner.invoke(park_command, args, env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
        assert result.exit_code == 2 and "Traceback" not in result.output, (args, result.output)


def test_park_refuses_a_partition_the_topic_does_not_have() -> None:
    """`park 999:5` with four partitions said it asked the workers, and no lane would ever match."""
    result = CliRunner().invoke(
        park_command, ["4:5"], env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "AML_PARTITIONS": "4"}
    )
    assert result.exit_code == 2 and "partitions 0..3 (AML_PARTITIONS), not 4" in result.output, result.output
    assert "Traceback" not in result.output


def test_the_operator_is_named_by_uid_without_a_login_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under an arbitrary uid (Kubernetes, OpenShift) with no USER and no passwd entry getuser raises."""
    import getpass

    from aml_app.gate import park_command as module

    def no_login() -> str:
        raise KeyError("getpwuid(): uid not found: 1000650000")

    monkeypatch.setattr(getpass, "getuser", no_login)
    assert module.operator() == f"uid {os.getuid()}"
