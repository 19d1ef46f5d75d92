"""Import rules: what the pipeline, the APIs and the tools load. They must not build the Faust app (a
Faust app opens clients, registers agents and tables, and reads the worker's settings) or import Faust.

Each check runs in a fresh interpreter, so what an earlier test imported cannot hide a violation.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

FAUST_SIDE = ("aml_app.app", "faust", "aml_app.agents", "aml_app.tables")


def last_line(code: str, cwd: Path | None = None) -> str:
    """The last line `code` prints, run in a fresh interpreter (our settings' defaults) in `cwd`."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, cwd=cwd
    )
    return out.stdout.strip().splitlines()[-1]


def loaded_after(code: str) -> set[str]:
    """The modules loaded after running `code` in a fresh interpreter."""
    return set(json.loads(last_line(f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))")))


def faust_side(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m in FAUST_SIDE or m.startswith(tuple(f"{n}." for n in FAUST_SIDE)))


@pytest.mark.parametrize(
    "modules",
    [
        "aml_app.pipeline.runner aml_app.pipeline.jobs aml_app.pipeline.transforms",
        "aml_app.dependencies.api aml_app.dependencies.store aml_app.dependencies.guard",
        "aml_app.harness.embedded_postgres aml_app.kafka.broker aml_app.topics",
        "aml_app.simulation.command",
        "aml_app.simulation.amlworld aml_app.simulation.amlworld_command",
    ],
)
def test_the_pipeline_the_apis_and_the_tools_do_not_load_faust(modules: str) -> None:
    code = "\n".join(f"import {m}" for m in modules.split())
    assert faust_side(loaded_after(code)) == []


@pytest.mark.parametrize(
    "command", ["pipeline", "serve", "rebuild", "postgres", "topics", "import-amlworld", "train-model"]
)
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
    no_agents, no_tables, agents_path, tables_path = json.loads(last_line(probe, cwd=tmp_path))
    assert no_agents and no_tables
    root = Path(__file__).resolve().parents[2]
    assert [Path(p).resolve() for p in agents_path] == [root / "agents"]
    assert [Path(p).resolve() for p in tables_path] == [root / "tables"]


# --- packages import one way (read from the source, so lazy and type-only imports count too) -------

ROOT = Path(__file__).resolve().parents[2]
#: The rooms of the package, lowest first: a room imports only itself and the rooms before it. A room is
#: a subpackage of `aml_app` or one of its top-level modules. The Faust app (`app`) and what is built on
#: it (`tables`, `worker`, `views`, `agents`) sit above everything the pipeline, the APIs and the tools
#: use; `harness` (the whole system as local processes) and `cli` are on top.
PACKAGES = [
    (
        "errors",
        "numbers",
        "currencies",
        "contract",
        "dependency_services",
        "failpoints",
        "loopback",
        "tokens",
        "backoff",
        "click_types",
    ),
    ("collector",),
    ("metrics_server",),
    ("models",),
    ("kafka",),
    ("faust_internals",),
    ("detection",),
    ("settings",),
    ("gate",),
    ("dependencies",),
    ("pipeline",),
    ("enrichment",),
    ("simulation",),
    ("training",),
    ("topics", "topics_command"),
    ("app",),
    ("tables",),
    ("worker",),
    ("views",),
    ("agents",),
    ("harness",),
    ("cli",),
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
    """Every absolute import of ours in the file, wherever it is (in a function, under TYPE_CHECKING)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] in ("aml_app", "tests", "bench")}


def package_of(module: str) -> str:
    """`aml_app.gate.consumer` -> `gate`; `aml_app.settings` -> `settings`."""
    parts = module.split(".")
    return parts[1] if parts[0] == "aml_app" and len(parts) > 1 else module


def our_modules() -> dict[str, Path]:
    paths = [*ROOT.joinpath("aml_app").rglob("*.py"), *ROOT.joinpath("agents").glob("*.py")]
    paths += ROOT.joinpath("tables").glob("*.py")
    return {module_name(p): p for p in paths}


def package_imports(modules: dict[str, Path]) -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> the module imports behind it, for every import across rooms."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in sorted(modules.items()):
        for name in sorted(imported(path)):
            target = next((n for n in (name, name.rsplit(".", 1)[0]) if n in modules), None)
            if module == "aml_app" or target is None or target == "aml_app":
                continue
            pair = (package_of(module), package_of(target))
            how = f"{module} imports {target}"
            if pair[0] != pair[1] and how not in edges.get(pair, []):
                edges.setdefault(pair, []).append(how)
    return edges


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one room (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def rank(package: str) -> int:
    return next((i for i, names in enumerate(PACKAGES) if package in names), -1)


def test_every_room_has_a_place() -> None:
    rooms = {package_of(m) for m in our_modules() if m != "aml_app"}
    assert len(rooms) == sum(len(names) for names in PACKAGES)
    assert sorted(r for r in rooms if rank(r) < 0) == []


def test_no_package_cycle() -> None:
    assert cycles(package_imports(our_modules())) == []


def test_packages_import_one_way() -> None:
    """No room imports one placed after it, and nothing in the package imports the tests or benchmarks."""
    modules = our_modules()
    wrong = [
        f"{a} -> {b}: {', '.join(how)}"
        for (a, b), how in sorted(package_imports(modules).items())
        if rank(b) > rank(a)
    ]
    wrong += [
        f"{module} imports {name}"
        for module, path in sorted(modules.items())
        for name in sorted(imported(path))
        if name.split(".")[0] in ("tests", "bench")
    ]
    assert wrong == []


def test_the_checks_see_a_lazy_import_that_closes_a_cycle(tmp_path: Path) -> None:
    """The negative control: a room importing a higher one inside a function (as `tables` imported the
    web view's metrics, and the settings the detection thresholds) is a cycle and an upward import."""
    fake = tmp_path / "x.py"
    fake.write_text("def f():\n    from aml_app.views.metrics import registry\n")
    assert "aml_app.views.metrics" in imported(fake)
    modules = {**our_modules(), "aml_app.tables.x": fake}
    edges = package_imports(modules)
    assert edges[("tables", "views")] == ["aml_app.tables.x imports aml_app.views.metrics"]
    assert ["tables", "views", "worker"] in cycles(edges)
    assert rank("views") > rank("tables")


#: The modules that make up the Faust app (importing them builds and registers it, as Faust requires),
#: and the two that plug a handler into it.
FAUST_APP_MODULES = ("aml_app.app", "aml_app.agents", "aml_app.tables", "aml_app.views.web")
PLUG_INS = ("aml_app.worker.agent", "aml_app.worker.detector")


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
    threads, files, app_built = json.loads(last_line(probe, cwd=tmp_path))
    assert len(modules) > 30
    assert (threads, files, app_built) == (1, [], False)


def module_imports(modules: dict[str, Path], package: str) -> list[tuple[str, str]]:
    """(module, module) for every import between two modules of `package` (`aml_app.gate`)."""
    inside = {m: p for m, p in modules.items() if m.startswith(f"{package}.")}
    edges = []
    for module, path in sorted(inside.items()):
        for name in sorted(imported(path)):
            target = next((n for n in (name, name.rsplit(".", 1)[0]) if n in inside), None)
            if target is not None and target != module:
                edges.append((module, target))
    return edges


def test_no_cycle_inside_the_gate() -> None:
    """Each step of a lane (admit, handling, acks, repairs, the sink) imports only what is below it."""
    assert cycles(module_imports(our_modules(), "aml_app.gate")) == []


def test_the_cycle_check_sees_a_cycle_between_modules() -> None:
    """The negative control: two modules that import each other are a cycle."""
    assert cycles([("aml_app.gate.a", "aml_app.gate.b"), ("aml_app.gate.b", "aml_app.gate.a")]) == [
        ["aml_app.gate.a", "aml_app.gate.b"]
    ]


def oversized(path: Path, class_lines: int, function_lines: int) -> list[str]:
    """The classes and functions of a file longer than the bounds (decorators and docstrings counted)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            bound = class_lines if isinstance(node, ast.ClassDef) else function_lines
            if lines > bound:
                found.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_gate_is_made_of_small_parts() -> None:
    """No class of the gate over 300 lines, no function over 60: a maintainer reads one step at a time."""
    gate = sorted(ROOT.joinpath("aml_app", "gate").glob("*.py"))
    assert [found for path in gate for found in oversized(path, 300, 60)] == []


def test_the_size_check_sees_a_long_function(tmp_path: Path) -> None:
    """The negative control: a function of 61 lines is named."""
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * 60)
    assert oversized(long, 300, 60) == ["long.py:1 f (61 lines)"]


def test_the_registry_names_every_service_module_and_registers_nothing_at_import() -> None:
    """`aml_app.agents.SERVICES` is how a worker finds its service (`AML_SERVICE`), in static imports the
    rules above see; importing it builds no gate and registers no agent (`compose` does)."""
    code = (
        "import json\n"
        "from aml_app.agents import SERVICES\n"
        "from aml_app.app import app\n"
        "from aml_app.settings import available_services\n"
        "print(json.dumps([sorted(SERVICES), available_services(), sorted(app.agents), "
        "len(app._extra_services)]))"
    )
    names, available, agents, services = json.loads(last_line(code))
    assert names == available == ["aml", "fraud", "probe"]
    assert agents == [] and services == 0


def test_the_worker_is_composed_in_one_place_and_the_views_import_no_service() -> None:
    """No module reaches a service through `importlib` (an import the rules cannot see)."""
    sources = [ROOT / "aml_app" / "views" / "web.py", ROOT / "aml_app" / "app.py", *ROOT.glob("agents/*.py")]
    assert [p.name for p in sources if "import_module" in p.read_text()] == []


def test_a_service_missing_from_the_registry_is_one_sentence() -> None:
    """A module of agents/ that `SERVICES` does not name cannot run: `compose` (and `aml-app worker`,
    before it reaches the cluster) says so in one sentence."""
    code = (
        "from aml_app.agents import compose, unregistered\n"
        "from aml_app.errors import ConfigError\n"
        "assert unregistered('aml') is None\n"
        "try:\n    compose('newly_added')\nexcept ConfigError as exc:\n    print(exc)"
    )
    sentence = last_line(code)
    assert sentence.startswith("AML_SERVICE='newly_added' is not in the registry of gated services")
    assert "aml, fraud, probe" in sentence
