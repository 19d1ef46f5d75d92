"""`aml-app park` when the cluster does not answer: one sentence and exit 1, no traceback."""

from __future__ import annotations

import gc
import socket
import warnings

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
