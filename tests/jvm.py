"""The JVM options of the tests' Spark.

Every Spark JVM that a process started by a test runs (the pipeline, a standalone cluster) lives a minute
or two: the C2 compiler spends more CPU warming up than it saves such a JVM (a session's start and ten
small jobs: 41 s of JVM CPU with it, 21 s with C1 alone), and on two cores that CPU is every other
process's time. The test process's own SparkSession is one JVM for the whole run, heavy jobs included, and
keeps the JVM's default (C1 alone made those tests slower). Deployed pipelines keep the default too.

Every driver JVM also maps Spark's classes from the class archive (`aml_app.pipeline.class_archive`)
made once per machine in `var/jvm/`, the pipeline's default folder of archives. A JVM whose class path
differs from the archive's (Spark's launcher, a standalone cluster's daemons) ignores it silently.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from aml_app.pipeline import class_archive as class_archive_module

SHORT_LIVED = "-XX:TieredStopAtLevel=1"
VARIABLE = "JAVA_TOOL_OPTIONS"
ARCHIVES = Path(__file__).resolve().parents[1] / "var" / "jvm"


def short_lived_jvms() -> None:
    """Give every JVM started from now on C1 alone and the class archive, unless the caller's
    environment says otherwise."""
    if VARIABLE not in os.environ:
        os.environ[VARIABLE] = " ".join([SHORT_LIVED, *archive_options()])


def archive_options() -> list[str]:
    """The options that map the archive, made first if this machine has none ([] if it cannot be)."""
    archive = class_archive()
    return class_archive_module.archive_options(archive) if archive is not None else []


def class_archive() -> Path | None:
    """This machine's archive of a Spark driver's classes; None, with a line saying why, when the JVM
    cannot make one."""
    try:
        archive = class_archive_module.archive_path(ARCHIVES)
        if not archive.exists():
            print(
                f"making the JVM class archive {archive} (once per machine, about a minute)", file=sys.stderr
            )
        return class_archive_module.make_archive(ARCHIVES, SHORT_LIVED)
    except class_archive_module.ArchiveError as exc:
        print(f"no JVM class archive, Spark's JVMs start without one: {exc}", file=sys.stderr)
        return None


def in_process_session(app_name: str = "aml-pipeline") -> Any:
    """The test process's SparkSession (`spark_session` of the pipeline, local[2]), its JVM started with
    the default compilers (and the class archive)."""
    from aml_app.pipeline.runner import spark_session

    ours = os.environ.get(VARIABLE)
    if ours is not None and ours.startswith(SHORT_LIVED):
        os.environ.pop(VARIABLE)
        if rest := ours.removeprefix(SHORT_LIVED).strip():
            os.environ[VARIABLE] = rest
    try:
        return spark_session("local[2]", app_name)
    finally:
        if ours is not None:
            os.environ[VARIABLE] = ours
