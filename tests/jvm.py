"""The JVM options of the tests' Spark.

Every Spark JVM that a process started by a test runs (the pipeline, a standalone cluster) lives a minute
or two: the C2 compiler spends more CPU warming up than it saves such a JVM (a session's start and ten
small jobs: 41 s of JVM CPU with it, 21 s with C1 alone), and on two cores that CPU is every other
process's time. The test process's own SparkSession is one JVM for the whole run, heavy jobs included, and
keeps the JVM's default (C1 alone made those tests slower). Deployed pipelines keep the default too.
"""

from __future__ import annotations

import os
from typing import Any

SHORT_LIVED = "-XX:TieredStopAtLevel=1"
VARIABLE = "JAVA_TOOL_OPTIONS"


def short_lived_jvms() -> None:
    """Give every JVM started from now on C1 alone, unless the caller's environment says otherwise."""
    os.environ.setdefault(VARIABLE, SHORT_LIVED)


def in_process_session(app_name: str = "aml-pipeline") -> Any:
    """The test process's SparkSession (`spark_session` of the pipeline, local[2]), its JVM started with
    the default compilers."""
    from aml_app.pipeline.runner import spark_session

    ours = os.environ.get(VARIABLE) == SHORT_LIVED
    if ours:
        del os.environ[VARIABLE]
    try:
        return spark_session("local[2]", app_name)
    finally:
        if ours:
            os.environ[VARIABLE] = SHORT_LIVED
