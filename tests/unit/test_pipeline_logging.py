"""The pipeline logs its own lines at INFO and py4j's at WARNING."""

from __future__ import annotations

import logging

import pytest

from aml_app.pipeline.runner import configure_logging


@pytest.fixture
def levels():
    """The root's and py4j's levels, restored after the test."""
    root, py4j = logging.getLogger(), logging.getLogger("py4j")
    before = root.level, py4j.level
    root.setLevel(logging.INFO)  # as basicConfig sets it in the pipeline's process
    yield
    root.setLevel(before[0])
    py4j.setLevel(before[1])


def test_py4j_connection_lines_stay_out_and_the_pipelines_stay_in(levels):
    configure_logging()
    clientserver = logging.getLogger("py4j.clientserver")  # "Closing down clientserver connection", INFO
    assert not clientserver.isEnabledFor(logging.INFO)
    assert clientserver.isEnabledFor(logging.WARNING)
    assert logging.getLogger("aml_app.pipeline").isEnabledFor(logging.INFO)
