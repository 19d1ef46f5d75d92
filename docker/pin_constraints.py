"""Writes docker/constraints.txt, the project's one lock file: every requirement of aml-app and of its
extras (pyproject.toml; `dev` names the others), recursively, at the version installed in this
environment (the one the tests ran with). `make` and the Docker images install with it (`pip install
-c`); a constraint only pins, it installs nothing, so the images get no test tools. Run it after changing
a dependency:

    .venv/bin/python docker/pin_constraints.py
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

HEADER = """\
# The lock file of aml-app: its dependencies and those of its extras, pinned to the versions the tests
# and benchmarks ran with. `make` installs with `pip install -c docker/constraints.txt -e '.[dev]'`, the
# images with `pip install -c docker/constraints.txt .` (workers, APIs) and `'.[pipeline]'` (constraints
# pin, they install nothing).
# Written by docker/pin_constraints.py: run it again after changing a dependency in pyproject.toml.
"""


def closure(name: str, found: dict[str, str]) -> dict[str, str]:
    """`name` and everything it requires (no extras), with the installed versions."""
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in found:
        return found
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return found
    found[key] = dist.version
    for raw in dist.requires or []:
        requirement = Requirement(raw)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            closure(requirement.name, found)
    return found


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    pins: dict[str, str] = {}
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    for raw in [*project["dependencies"], *(r for extra in extras for r in extra)]:
        if Requirement(raw).name != project["name"]:  # `aml-app[demo]`: the extras themselves
            closure(Requirement(raw).name, pins)
    path = Path(__file__).with_name("constraints.txt")
    path.write_text(HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    print(f"{path}: {len(pins)} pins")


if __name__ == "__main__":
    main()
