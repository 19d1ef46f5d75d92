"""`aml-app` as a new user meets it: our help and version, `-h` for help, Faust's unrelated commands out of
the listing, and help that a bad setting does not block. Runs the installed executable, as a user does."""

from __future__ import annotations

import os
import subprocess
from importlib import metadata

import pytest

from aml_app.cli import HIDDEN_FAUST_COMMANDS, OWN_COMMANDS
from aml_app.harness.child_process import aml_app_executable

AML_APP = aml_app_executable()


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [AML_APP, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False
    )


def listed_commands(help_text: str) -> set[str]:
    lines = help_text.split("Commands:", 1)[1].splitlines()
    return {line.split()[0] for line in lines if line.startswith("  ") and line.strip()}


def test_version_is_ours_with_the_engines_beside_it() -> None:
    done = run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"aml-app {metadata.version('aml-app')} (faust-streaming {metadata.version('faust-streaming')}, "
        f"aiokafka {metadata.version('aiokafka')})"
    )


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_lists_our_commands_and_hides_fausts_unrelated_ones(flag: str) -> None:
    done = run(flag)
    assert done.returncode == 0, done.stderr
    assert "Freshness-gated stream processing for payments" in done.stdout
    assert "faust-streaming.github.io" not in done.stdout
    commands = listed_commands(done.stdout)
    assert set(OWN_COMMANDS) <= commands
    assert {"worker", "agents", "tables"} <= commands
    assert not commands & set(HIDDEN_FAUST_COMMANDS), commands & set(HIDDEN_FAUST_COMMANDS)


def test_a_hidden_faust_command_still_runs() -> None:
    done = run("models", "--help")
    assert done.returncode == 0, done.stderr
    assert "Usage: aml-app models" in done.stdout


def test_our_commands_take_h_for_help() -> None:
    done = run("status", "-h")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: aml-app status")


def test_a_bad_setting_does_not_block_help_but_names_itself() -> None:
    for args in (["--help"], ["-h"], ["worker", "--help"], ["topics", "-h"], ["--version"]):
        done = run(*args, AML_PARTITIONS="many")
        assert done.returncode == 0, (args, done.stderr)
        assert "Usage: aml-app" in done.stdout or done.stdout.startswith("aml-app "), (args, done.stdout)
        assert done.stderr.strip() == (
            "aml-app: configuration error: AML_PARTITIONS='many' is not a whole number; expected 1..10000."
        ), (args, done.stderr)


def test_a_bad_setting_still_stops_every_command_in_one_sentence() -> None:
    for args in (["worker"], ["worker", "-h", "0.0.0.0"], ["topics"], []):
        done = run(*args, AML_PARTITIONS="many")
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stdout == "", (args, done.stdout)
        assert done.stderr.count("\n") == 1 and "AML_PARTITIONS='many'" in done.stderr, (args, done.stderr)


def test_a_worker_that_would_call_a_listening_address_stops_in_one_sentence() -> None:
    """The image sets AML_SERVICES_HOST=0.0.0.0 for the APIs to listen on every address; a worker left
    without AML_RELATIONS_URL would call 0.0.0.0, itself. With the URLs set it goes on (to the broker)."""
    done = run("worker", AML_SERVICES_HOST="0.0.0.0", KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "aml-app: configuration error: AML_RELATIONS_URL is not set and AML_SERVICES_HOST=0.0.0.0 is an "
        "address to listen on, not one to call: set AML_RELATIONS_URL to the relations API's replicas "
        "(http://host:port,...).\n"
    )
