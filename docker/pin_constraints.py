"""Writes docker/constraints.txt: every runtime requirement of aml-app (pyproject.toml), recursively,
at the version installed in this environment (the one the tests ran with). Run it after changing a
dependency:

    .venv/bin/python docker/pin_constraints.py
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

HEADER = """\
# Runtime dependencies of aml-app, pinned to the versions the tests and benchmarks ran with (the
# project's .venv); the image installs with `pip install -c docker/constraints.txt .`.
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
    for raw in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]:
        closure(Requirement(raw).name, pins)
    path = Path(__file__).with_name("constraints.txt")
    path.write_text(HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    print(f"{path}: {len(pins)} pins")


if __name__ == "__main__":
    main()
