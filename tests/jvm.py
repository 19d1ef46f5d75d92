"""The JVM options of the tests' Spark.

Every Spark JVM that a process started by a test runs (the pipeline, a standalone cluster) lives a minute
or two: the C2 compiler spends more CPU warming up than it saves such a JVM (a session's start and ten
small jobs: 41 s of JVM CPU with it, 21 s with C1 alone), and on two cores that CPU is every other
process's time. The test process's own SparkSession is one JVM for the whole run, heavy jobs included, and
keeps the JVM's default (C1 alone made those tests slower). Deployed pipelines keep the default too.

Every driver JVM also maps Spark's classes from a class-data archive (JDK CDS) made once per machine, in
`var/jvm/`: a driver's start and first job then take about 16 s of CPU instead of 23, 7 s of wall time
less, since the classes are neither parsed nor verified again. A JVM whose class path differs from the
archive's (Spark's launcher, a standalone cluster's daemons) ignores it silently, as every JVM does when
the archive is missing or stale; its logging is off so that no JVM prints a line about it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

SHORT_LIVED = "-XX:TieredStopAtLevel=1"
QUIET_ARCHIVE = "-Xlog:cds=off,cds+dynamic=off"
VARIABLE = "JAVA_TOOL_OPTIONS"
ARCHIVES = Path(__file__).resolve().parents[1] / "var" / "jvm"
MAKE_DEADLINE_S = 300.0

# A driver's start and a first job (JSON, a grouping, code generation), then the JVM's exit, where the
# JVM writes the archive of every class it loaded. The exit is asked through the gateway: a JVM left to
# stop with its Python driver would still be writing when the driver returns.
MAKE_ARCHIVE = """
import sys
from aml_app.pipeline.runner import spark_session
spark = spark_session(
    "local[2]", "aml-class-archive",
    {"spark.driver.extraJavaOptions": "-Dlog4j.rootLogger=WARN -XX:ArchiveClassesAtExit=" + sys.argv[1]},
)
rows = spark.createDataFrame([(i % 3, '{"a": "%d"}' % i) for i in range(100)], "k int, doc string")
assert len(rows.selectExpr("k", "from_json(doc, 'a string') AS d").groupBy("k").count().collect()) == 3
jvm = spark._jvm
try:
    jvm.java.lang.System.exit(0)
except Exception:  # the gateway's connection closes under the call
    pass
"""


def short_lived_jvms() -> None:
    """Give every JVM started from now on C1 alone and the class archive, unless the caller's
    environment says otherwise."""
    if VARIABLE not in os.environ:
        os.environ[VARIABLE] = " ".join([SHORT_LIVED, *archive_options()])


def archive_options() -> list[str]:
    """The options that map the archive, made first if this machine has none ([] if it cannot be)."""
    archive = class_archive()
    return [f"-XX:SharedArchiveFile={archive}", QUIET_ARCHIVE] if archive is not None else []


def class_archive() -> Path | None:
    """This machine's archive of a Spark driver's classes: one per JDK and PySpark install (its name is a
    digest of both); None, with a line saying why, when the JVM cannot make one."""
    java = shutil.which("java")
    if java is None:
        print("no JVM class archive: no java on the PATH", file=sys.stderr)
        return None
    import pyspark

    jdk = Path(java).resolve()
    spark_home = Path(pyspark.__file__).resolve().parent
    key = "\0".join([str(jdk), str(jdk.stat().st_mtime_ns), str(spark_home), pyspark.__version__])
    archive = ARCHIVES / f"spark-driver-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa"
    if archive.exists():
        return archive
    ARCHIVES.mkdir(parents=True, exist_ok=True)
    partial = archive.with_suffix(f".{os.getpid()}.partial")
    env = os.environ | {VARIABLE: f"{SHORT_LIVED} {QUIET_ARCHIVE}"}
    print(f"making the JVM class archive {archive} (once per machine, about a minute)", file=sys.stderr)
    try:
        subprocess.run(
            [sys.executable, "-c", MAKE_ARCHIVE, str(partial)],
            env=env,
            capture_output=True,
            timeout=MAKE_DEADLINE_S,
            check=True,
        )
        os.replace(partial, archive)
    except (OSError, subprocess.SubprocessError) as exc:
        said = getattr(exc, "stderr", None) or b""
        last = said.decode(errors="replace").strip().splitlines()[-1:]
        print(f"no JVM class archive, Spark's JVMs start without one: {exc} {''.join(last)}", file=sys.stderr)
        partial.unlink(missing_ok=True)
        return None
    return archive


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
