"""Fixtures the unit tests of several modules share."""

from __future__ import annotations

import pytest

from aml_app.detection.model import Model, load


@pytest.fixture(scope="module")
def shipped() -> Model:
    """The shipped AML model (`AML_MODEL=amlworld`)."""
    model = load("amlworld")
    assert model is not None
    return model
