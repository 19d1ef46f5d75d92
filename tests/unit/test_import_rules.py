"""Import rules: what the pipeline, the APIs and the tools load. They must not build the Faust app (a
Faust app opens clients, registers agents and tables, and reads the worker's settings) or import Faust.

Each check runs in a fresh interpreter, so what an earlier test imported cannot hide a violation.
"""

from __future__ import annotations

import ast
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
        "aml_app.dependencies.api aml_app.dependencies.store aml_app.dependencies.guard",
        "aml_app.harness.embedded_postgres aml_app.kafka.broker aml_app.kafka.topics",
        "aml_app.simulation.command",
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


# --- imports flow one way (read from the source, so a lazy import counts too) ----------------------

ROOT = Path(__file__).resolve().parents[2]
#: Lowest first: a room may import its own modules and those of the rooms before it, never after.
#: `harness` (the whole system as local processes) and `cli` sit on top; nothing below imports them.
LAYERS = [
    ("aml_app.currencies", "aml_app.contract"),
    (
        "aml_app.kafka.security",
        "aml_app.settings",
        "aml_app.detection.thresholds",
        "aml_app.detection.exchange",
        "aml_app.models",
    ),
    ("aml_app.faust_internals", "aml_app.kafka"),
    ("aml_app.detection.rules", "aml_app.detection.evidence", "aml_app.detection.fraud_rules"),
    ("aml_app.gate.offsets", "aml_app.gate.watermark", "aml_app.gate.retry", "aml_app.gate.event_time"),
    ("aml_app.gate.unapplied",),
    ("aml_app.dependencies", "aml_app.pipeline", "aml_app.simulation"),
    ("aml_app.gate.delivery", "aml_app.gate.consumer", "aml_app.gate.gate", "aml_app.gate.health"),
    ("aml_app.gate",),
    ("aml_app.app", "aml_app.tables", "aml_app.gate.agent", "aml_app.detection", "aml_app.views"),
    ("aml_app.agents",),
    ("aml_app.harness", "aml_app.cli"),
]


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[0] in ("agents", "tables"):
        parts.insert(0, "aml_app")  # installed as aml_app.agents / aml_app.tables (pyproject.toml)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] in ("aml_app", "tests", "bench")}


def layer_of(module: str) -> int:
    """The layer of the most specific prefix that names the module."""
    best, depth = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    return best


def our_modules() -> dict[str, Path]:
    paths = [*ROOT.joinpath("aml_app").rglob("*.py"), *ROOT.joinpath("agents").glob("*.py")]
    paths += ROOT.joinpath("tables").glob("*.py")
    return {module_name(p): p for p in paths}


def test_every_module_has_a_layer() -> None:
    modules = our_modules()
    assert len(modules) > 40
    assert [m for m in modules if m != "aml_app" and layer_of(m) < 0] == []


def test_imports_flow_one_way() -> None:
    """No module imports one of a higher layer (the harness and the command line are on top), and nothing
    in the package imports the tests or the benchmarks."""
    modules = our_modules()
    wrong: set[str] = set()
    for module, path in sorted(modules.items()):
        if module == "aml_app":
            continue
        mine = layer_of(module)
        for name in sorted(imported(path)):
            if name.split(".")[0] in ("tests", "bench"):
                wrong.add(f"{module} imports {name}")
                continue
            target = next((n for n in (name, name.rsplit(".", 1)[0]) if n in modules), None)
            if target is not None and layer_of(target) > mine:
                wrong.add(f"{module} (layer {mine}) imports {target} (layer {layer_of(target)})")
    assert sorted(wrong) == []


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The negative control: a lower module importing the harness is reported."""
    fake = tmp_path / "x.py"
    fake.write_text("def f():\n    from aml_app.harness.demo import run_demo\n")
    assert "aml_app.harness.demo" in imported(fake)
    assert layer_of("aml_app.harness.demo") > layer_of("aml_app.gate.consumer")


#: The modules that make up the Faust app (importing them builds and registers it, as Faust requires),
#: and the two that plug a handler into it.
FAUST_APP_MODULES = ("aml_app.app", "aml_app.agents", "aml_app.tables", "aml_app.views.web")
PLUG_INS = ("aml_app.gate.agent", "aml_app.detection.detector")


def test_importing_anything_outside_the_faust_app_has_no_side_effects(tmp_path: Path) -> None:
    """Every other module, the harness and the command line included, imports without building the app,
    starting a thread or writing a file."""
    app_side = FAUST_APP_MODULES + PLUG_INS
    modules = sorted(m for m in our_modules() if not m.startswith(tuple(f"{n}." for n in app_side)))
    modules = [m for m in modules if m not in app_side]
    probe = (
        "import importlib, json, os, sys, threading\n"
        f"for m in {modules!r}:\n    importlib.import_module(m)\n"
        "print(json.dumps([threading.active_count(), os.listdir('.'), 'aml_app.app' in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path
    )
    threads, files, app_built = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(modules) > 30
    assert (threads, files, app_built) == (1, [], False)
