"""The docs against the code: README's shape, links that resolve, paths that exist, and a settings page
that names exactly the variables the code reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aml_app import dependency_services as registry

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [README, ROOT / "BENCHMARKS.md", *PAGES]
CODE = [p for folder in ("aml_app", "agents", "tables") for p in (ROOT / folder).rglob("*.py")]
VARIABLE = re.compile(r"\b((?:AML|KAFKA)_[A-Z0-9_]*[A-Z0-9])\b")


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 250
    first_block = text.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block
    assert "## Limits" in text


def test_the_benchmarks_are_a_reference_of_current_figures() -> None:
    """At most 40 KB: each benchmark's command, code version, load and current figures; the history of
    how they moved is in git and bench/results/."""
    assert len((ROOT / "BENCHMARKS.md").read_bytes()) <= 40_000


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_relative_links_resolve(document: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", document.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        assert resolved.exists(), f"{document.name}: link to {target} goes nowhere"
        if anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(), re.MULTILINE)
            slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{document.name}: no heading #{anchor} in {path or document.name}"


@pytest.mark.parametrize("document", [README, *PAGES], ids=lambda p: p.name)
def test_named_files_exist(document: Path) -> None:
    """Every repository path the docs name in backticks (`aml_app/gate/gate.py`, `bench/`) exists.

    Not BENCHMARKS.md: it describes the code of each run's recorded commit."""
    pattern = r"`((?:aml_app|agents|tables|tests|bench|docker|docs)/[\w./-]*)`"
    for path in re.findall(pattern, document.read_text()):
        assert (ROOT / path).exists(), f"{document.name} names {path}, which does not exist"


def variables_read_by_the_code() -> set[str]:
    """Every variable named in the code, and the ones the settings derive from each dependency
    service's name (`AML_<NAME>_GROUP`, `_PORT`, `_URL`)."""
    found: set[str] = set()
    for path in CODE:
        for name in re.findall(r"[\"']((?:AML|KAFKA)_[A-Z0-9_]+)[\"']", path.read_text()):
            found.add(name)
    for service in registry.SERVICES.values():
        found.update((service.group_env, service.port_env, service.urls_env))
    return found


def test_the_settings_page_names_exactly_what_the_code_reads() -> None:
    documented = set(VARIABLE.findall((ROOT / "docs" / "configuration.md").read_text()))
    read = {name for name in variables_read_by_the_code() if not name.startswith("AML_RULE_")}
    documented.discard("AML_RULE")  # `AML_RULE_*`: one row for every threshold (docs/detection.md)
    assert read - documented == set(), "read by the code, missing from docs/configuration.md"
    assert documented - read == set(), "in docs/configuration.md, read by nothing"
