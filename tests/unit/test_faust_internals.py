"""The one module that touches Faust's and aiokafka's private names checks them at import."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from aml_app import faust_internals
from aml_app.faust_internals import IncompatibleFaust, check, incompatibility, missing_names


def test_every_private_name_is_there_in_the_pinned_versions() -> None:
    assert missing_names() == []
    assert faust_internals.BUILT_FOR == {"faust-streaming": "0.15.3", "aiokafka": "0.14.0"}


def test_a_missing_name_is_one_sentence_naming_the_versions_it_was_built_for() -> None:
    module = types.ModuleType("faust.fake")

    class Consumer:
        _paused: set[int]

        def __init__(self) -> None:
            self._kept = 1

    required = [
        (module, "_current_event", "attr"),
        (Consumer, "_paused", "annotation"),
        (Consumer, "_active", "annotation"),
        (Consumer, "_kept", "source:__init__"),
        (Consumer, "_gone", "source:__init__"),
    ]
    assert missing_names(required) == [
        "faust.fake._current_event",
        f"{__name__}.test_a_missing_name_is_one_sentence_naming_the_versions_it_was_built_for."
        "<locals>.Consumer._active",
        f"{__name__}.test_a_missing_name_is_one_sentence_naming_the_versions_it_was_built_for."
        "<locals>.Consumer._gone",
    ]
    with pytest.raises(IncompatibleFaust) as raised:
        check(required)
    sentence = str(raised.value)
    assert "\n" not in sentence
    assert sentence.startswith("aml-app was built for faust-streaming 0.15.3 and aiokafka 0.14.0, but ")
    assert "faust.fake._current_event" in sentence and "pyproject.toml" in sentence
    assert incompatibility(["x"]).count(".") >= 1


def test_the_worker_refuses_to_start_with_one_line_when_a_name_is_gone() -> None:
    """As after a Faust upgrade that renamed a private name: `aml-app worker` stops at once."""
    script = (
        "import sys, faust.streams\n"
        "del faust.streams._current_event\n"
        "sys.argv = ['aml-app', 'worker']\n"
        "from aml_app.cli import main\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("aml-app was built for faust-streaming 0.15.3")
    assert "faust.streams._current_event" in lines[0]
