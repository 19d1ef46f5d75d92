"""The project as the image installs it: a wheel built from what docker/Dockerfile copies, installed
into a fresh virtualenv outside the repository, every module imported from there, and a gated worker
run from the installed `aml-app`.

The development install (`make`) is editable: its finder serves every folder under aml_app/, so a
package missing from pyproject's hand-written list goes unnoticed there and breaks only a wheel (and the
image's `pip install .`). Nothing is downloaded to install: the new environment sees this environment's
dependencies through a `.pth` file, which adds their folder to sys.path without running the `.pth`
files inside it, so the editable finder of this checkout stays inactive there (the tests check that
every module comes from the new environment).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from aml_app.cli import OWN_COMMANDS
from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka.tools import produce
from tests.harness import Worker, ends_of, payments_for, wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: The folders that install as aml_app's subpackages (agents/ -> aml_app.agents, ...).
PACKAGE_DIRS = {"aml_app": "aml_app", **PYPROJECT["tool"]["setuptools"].get("package-dir", {})}
#: What docker/Dockerfile.dockerignore keeps out of the image's build context.
IGNORED = shutil.ignore_patterns("__pycache__", "*.egg-info")
#: Variables that would let the installed code see this checkout, or configure it from the caller.
LEAKS = re.compile(r"^(PYTHONPATH|PYTHONHOME|AML_[A-Z0-9_]+|KAFKA_[A-Z0-9_]+)$")


@dataclass(frozen=True)
class Installed:
    venv: Path
    site_packages: Path
    outside: Path  # a working directory outside the repository

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def aml_app(self) -> Path:
        return self.venv / "bin" / "aml-app"


def run(args: list[str | Path], timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    """Run a command; fail with its output if it fails."""
    result = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    assert result.returncode == 0, (
        f"{shlex.join(str(a) for a in args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    )
    return result


def outside_env(**extra: str) -> dict[str, str]:
    """The caller's environment without PYTHONPATH and without any of the service's settings."""
    return {**{k: v for k, v in os.environ.items() if not LEAKS.match(k)}, **extra}


def stage_image_context(stage: Path) -> None:
    """Copy into `stage` what the image's build copies (the Dockerfile's COPY lines), so the wheel is built
    from what `pip install .` sees in the image, and the build's own files stay out of the checkout."""
    copies = 0
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    lines = re.sub(r"\\\n", " ", "\n".join(x for x in dockerfile.splitlines() if not x.startswith("#")))
    for line in lines.splitlines():
        if line.split(maxsplit=1)[:1] != ["COPY"]:
            continue
        words = shlex.split(line)
        *sources, destination = [w for w in words[1:] if not w.startswith("--")]
        for source in sources:
            into_folder = len(sources) > 1 or destination.endswith("/")
            target = stage / destination / source if into_folder else stage / destination
            target.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=IGNORED)
            else:
                shutil.copy2(ROOT / source, target)
            copies += 1
    assert copies and (stage / "pyproject.toml").is_file(), "the Dockerfile copies no pyproject.toml"


def builds_without_isolation() -> bool:
    """Whether this environment can build the wheel offline: it satisfies pyproject's [build-system] and
    its setuptools has `bdist_wheel` (its own from 70.1 on, before that from the `wheel` package)."""
    try:
        for text in PYPROJECT["build-system"]["requires"]:
            requirement = Requirement(text)
            if not requirement.specifier.contains(version(requirement.name), prereleases=True):
                return False
        if Version(version("setuptools")) >= Version("70.1"):
            return True
        version("wheel")
    except PackageNotFoundError:
        return False
    return True


def build_wheel(folder: Path) -> Path:
    stage = folder / "context"
    stage_image_context(stage)
    dist = folder / "dist"
    # Offline when this environment can build it; otherwise pip fetches the [build-system] requirements
    # from the package index into an isolated build environment, as the image's build does.
    offline = ["--no-build-isolation"] if builds_without_isolation() else []
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", *offline, "-w", dist, stage],
        300,
        cwd=folder,
    )
    (wheel,) = dist.glob("aml_app-*.whl")
    return wheel


def this_environments_site_packages() -> list[str]:
    return list(dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel, installed into a new virtualenv that borrows this environment's dependencies."""
    folder = tmp_path_factory.mktemp("wheel")
    assert not folder.is_relative_to(ROOT)
    wheel = build_wheel(folder)
    venv = folder / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=120)
    python = venv / "bin" / "python"
    # Installed before the .pth exists, so pip sees an empty environment and never touches this one's.
    run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel],
        timeout=300,
        env=outside_env(),
    )
    site_packages = Path(
        run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], timeout=60
        ).stdout.strip()
    )
    assert site_packages.is_relative_to(venv)
    (site_packages / "_aml_app_dependencies.pth").write_text(
        "\n".join(this_environments_site_packages()) + "\n"
    )
    outside = folder / "outside"
    outside.mkdir()
    return Installed(venv, site_packages, outside)


def source_modules() -> set[str]:
    """Every module of the source tree, by the name it installs as (aml_app.agents.aml, ...)."""
    names = set()
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.add(".".join((package, *parts)))
    names.discard("aml_app")
    return names


def services() -> list[str]:
    """The gated services: one module each in agents/ (as aml_app.settings.available_services)."""
    folder = ROOT / PACKAGE_DIRS["aml_app.agents"]
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


#: Imports every module of the installed aml_app in one process: the modules are found by walking the
#: installed package, so a module missing from the wheel is missing from `walked`. Importing registers
#: no agent (`aml_app.agents.compose` does), so every service's module imports beside the others.
IMPORT_ALL = """
import importlib, json, pkgutil, sys, traceback
import aml_app

service, report = sys.argv[1], sys.argv[2]
failed = {}
walked = sorted(
    m.name
    for m in pkgutil.walk_packages(
        aml_app.__path__, "aml_app.", onerror=lambda name: failed.setdefault(name, traceback.format_exc())
    )
)
for name in walked:
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc()
files = {n: getattr(m, "__file__", None) for n, m in sys.modules.items() if n.split(".")[0] == "aml_app"}
with open(report, "w") as out:
    json.dump({"walked": walked, "failed": failed, "files": files}, out)
"""


def test_the_installed_package_is_the_wheels_and_has_every_module_of_the_source(installed: Installed) -> None:
    expected = source_modules()
    assert {"aml_app.agents.probe", "aml_app.kafka.tools", "aml_app.views.web"} <= expected
    imported: set[str] = set()
    for service in services():
        report = installed.outside / f"imports-{service}.json"
        run(
            [installed.python, "-c", IMPORT_ALL, service, report],
            timeout=120,
            cwd=installed.outside,
            env=outside_env(AML_SERVICE=service),
        )
        result = json.loads(report.read_text())
        assert set(result["walked"]) == expected, (
            f"AML_SERVICE={service}: the wheel lacks {sorted(expected - set(result['walked']))}, "
            f"has extra {sorted(set(result['walked']) - expected)}"
        )
        assert result["failed"] == {}, f"AML_SERVICE={service}: " + "\n".join(result["failed"].values())
        elsewhere = {
            name: file
            for name, file in result["files"].items()
            if file is None or not Path(file).is_relative_to(installed.site_packages)
        }
        assert elsewhere == {}, "modules not loaded from the installed wheel"
        imported |= set(result["files"])
    assert expected <= imported


#: What a worker's start-up does: Faust's autodiscovery, which also scans the app's origin module with
#: venusian, then the composition of the worker (`aml-app worker` calls it). Records the agents the app
#: then has and what the discovery logged as failing.
DISCOVER = """
import json, logging, sys

errors = []


class Keep(logging.Handler):
    def emit(self, record):
        errors.append(record.getMessage())


logging.getLogger("faust").addHandler(Keep(logging.WARNING))
from aml_app.app import app, settings

app.discover()
from aml_app.agents import compose

compose(settings.service)
with open(sys.argv[1], "w") as out:
    json.dump({"agents": sorted(app.agents), "errors": errors}, out)
"""


@pytest.mark.parametrize("service", services())
def test_an_installed_worker_runs_only_its_own_service(installed: Installed, service: str) -> None:
    # In the wheel agents/ lies inside aml_app/, where a scan of the whole package would reach every
    # service's module; the editable install maps it from the repository root, outside the scanned
    # folder, so only an installed worker could meet the other services' agents.
    report = installed.outside / f"discover-{service}.json"
    run(
        [installed.python, "-c", DISCOVER, report],
        timeout=120,
        cwd=installed.outside,
        env=outside_env(AML_SERVICE=service),
    )
    result = json.loads(report.read_text())
    assert result == {"agents": [service], "errors": []}


def test_the_installed_command_answers_help(installed: Installed) -> None:
    # The script runs the new environment's interpreter, so a worker started from it runs the wheel.
    assert installed.aml_app.read_text().splitlines()[0] == f"#!{installed.python}"
    result = run([installed.aml_app, "--help"], timeout=120, cwd=installed.outside, env=outside_env())
    for command in ["worker", *OWN_COMMANDS]:
        assert re.search(rf"^\s+{re.escape(command)}\s", result.stdout, re.MULTILINE), command


async def test_an_installed_worker_decides_each_payment_only_after_its_dependencies(
    installed, broker, names, producer, deps, decision_log, workers, tmp_path
):
    placed = await produce(producer, names.payments, payments_for(names.partitions, 6, "wheel"))
    ends = ends_of(placed)
    worker = Worker(broker.bootstrap, names, tmp_path, executable=str(installed.aml_app))
    for name in [k for k in worker.env if k in ("PYTHONPATH", "PYTHONHOME")]:
        del worker.env[name]
    workers.append(worker.start())
    await worker.wait_ready(set(range(names.partitions)), timeout=90)

    # The dependencies have committed nothing: every partition waits at its first payment.
    first = {str(p): 0 for p in range(names.partitions)}

    async def held() -> bool:
        state = await worker.state()
        return bool(state) and state["waiting"] == first

    await wait_until(held, 30, "every partition to wait at its first payment")
    await decision_log.poll(0.5)
    assert decision_log.decided() == set()

    # The dependencies move on two payments per partition at a time; each step opens exactly that far.
    timeline = CommitTimeline()
    for position in range(2, max(ends.values()) + 2, 2):
        await timeline.commit(deps, {p: min(position, end) for p, end in ends.items()})
        await decision_log.wait_for({(p, o) for p, o in placed if o < position}, timeout=30)
        early = {(p, o) for p, o in decision_log.decided() if o >= position}
        assert early == set(), f"decided before the dependencies committed past them: {sorted(early)}"

    made = decision_log.decisions()
    assert {d["payment_id"] for d in made} == {
        f"wheel-{p}-{i}" for p in range(names.partitions) for i in range(6)
    }
    assert {d["worker"] for d in made} == {worker.worker_id}
    assert premature(made, names.deps, timeline) == []
