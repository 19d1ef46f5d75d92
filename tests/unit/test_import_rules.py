"""Import rules: what the pipeline, the APIs and the tools load. They must not build the Faust app (a
Faust app opens clients, registers agents and tables, and reads the worker's settings) or import Faust.

Each check runs in a fresh interpreter, so what an earlier test imported cannot hide a violation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FAUST_SIDE = ("aml_app.app", "faust", "aml_app.agents", "aml_app.tables")


def loaded_after(code: str) -> set[str]:
    """The modules loaded after running `code` in a fresh interpreter (our settings' defaults)."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def faust_side(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m in FAUST_SIDE or m.startswith(tuple(f"{n}." for n in FAUST_SIDE)))


@pytest.mark.parametrize(
    "modules",
    [
        "aml_app.pipeline.runner aml_app.pipeline.jobs aml_app.pipeline.transforms",
        "aml_app.services.api aml_app.services.store aml_app.services.guard",
        "aml_app.embedded_postgres aml_app.broker aml_app.topics aml_app.simulation.command",
        "aml_app.simulation.amlworld aml_app.simulation.amlworld_command",
    ],
)
def test_the_pipeline_the_apis_and_the_tools_do_not_load_faust(modules: str) -> None:
    code = "\n".join(f"import {m}" for m in modules.split())
    assert faust_side(loaded_after(code)) == []


@pytest.mark.parametrize("command", ["pipeline", "serve", "rebuild", "postgres", "topics", "import-amlworld"])
def test_own_commands_run_without_the_faust_app(command: str) -> None:
    """`aml-app <command> --help` goes through our command line only (the command's body imports the
    same modules as above)."""
    code = (
        "import sys\n"
        f"sys.argv = ['aml-app', '{command}', '--help']\n"
        "from aml_app import cli\n"
        "try:\n    cli.main()\nexcept SystemExit as exit:\n    assert not exit.code, exit.code"
    )
    assert faust_side(loaded_after(code)) == []


def test_the_worker_command_still_builds_the_faust_app() -> None:
    """The negative control: the check above would see the app if it were built."""
    code = (
        "import sys\n"
        "sys.argv = ['aml-app', 'worker', '--help']\n"
        "from aml_app import cli\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass"
    )
    assert "aml_app.app" in faust_side(loaded_after(code))


def test_the_installed_package_puts_no_bare_agents_or_tables_module_on_the_path(tmp_path: Path) -> None:
    """The design's `agents/` and `tables/` folders install as `aml_app.agents` and `aml_app.tables`: a
    bare `tables` would shadow PyTables for everyone who installs us. Run from elsewhere, so that the
    repository's root is not on the path (as for a user of the installed package)."""
    probe = (
        "import importlib.util as u, json; import aml_app.agents, aml_app.tables; "
        "print(json.dumps([u.find_spec('agents') is None, u.find_spec('tables') is None, "
        "list(aml_app.agents.__path__), list(aml_app.tables.__path__)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path
    )
    no_agents, no_tables, agents_path, tables_path = json.loads(out.stdout.strip().splitlines()[-1])
    assert no_agents and no_tables
    root = Path(__file__).resolve().parents[2]
    assert [Path(p).resolve() for p in agents_path] == [root / "agents"]
    assert [Path(p).resolve() for p in tables_path] == [root / "tables"]
