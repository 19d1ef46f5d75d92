"""An archive of the Spark driver's classes (JDK class-data sharing), so that a pipeline starts sooner.

A Spark driver loads, parses and verifies tens of thousands of classes before its first job; a JVM that
maps them from an archive made once skips that work (`make demo`, interleaved, two runs each: the
pipeline ready after 16.7 and 18.7 s instead of 24.9 and 25.3), so the groups of a restarted pipeline,
which the gated services wait for, move again that much sooner. Its code runs no faster once started
(the demo's latencies moved within their run-to-run spread): the archive holds classes, not compiled
code, and the JIT still warms up as before.

An archive belongs to one JDK and one PySpark install: its name is a digest of both, so an archive of
another install is never used. `aml-app spark-archive` makes one (a Spark driver's start and a first job,
then the JVM's exit, which writes every class it loaded); the pipeline maps the one for its install from
`AML_SPARK_CLASS_ARCHIVES` when it is there and starts without one otherwise. A JVM that finds the
archive stale or unreadable ignores it silently, as the JDK does; its logging about the archive is off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

QUIET = "-Xlog:cds=off,cds+dynamic=off"
MAKE_DEADLINE_S = 300.0

# The exit is asked through the gateway: a JVM left to stop with its Python driver would still be writing
# the archive when the driver returns.
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


class ArchiveError(RuntimeError):
    """No archive could be made; the message says why."""


def archive_path(folder: Path) -> Path:
    """Where `folder` holds the archive of this machine's JDK and PySpark install."""
    java = shutil.which("java")
    if java is None:
        raise ArchiveError("no java on the PATH")
    import pyspark

    jdk = Path(java).resolve()
    spark_home = Path(pyspark.__file__).resolve().parent
    key = "\0".join([str(jdk), str(jdk.stat().st_mtime_ns), str(spark_home), pyspark.__version__])
    return folder / f"spark-driver-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa"


def existing_archive(folder: Path) -> Path | None:
    """This install's archive in `folder`, if one was made."""
    try:
        archive = archive_path(folder)
    except ArchiveError:
        return None
    return archive if archive.is_file() else None


def make_archive(folder: Path, java_options: str = "") -> Path:
    """This install's archive in `folder`, made now unless it is there (about a minute).

    `java_options` go to every JVM of the run (the tests give C1 alone). Raises ArchiveError, with the
    driver's last line, when the JVM cannot make one."""
    archive = archive_path(folder)
    if archive.exists():
        return archive
    folder.mkdir(parents=True, exist_ok=True)
    partial = archive.with_suffix(f".{os.getpid()}.partial")
    env = os.environ | {"JAVA_TOOL_OPTIONS": f"{java_options} {QUIET}".strip()}
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
        partial.unlink(missing_ok=True)
        raise ArchiveError(f"{exc} {''.join(last)}".strip()) from None
    return archive


def archive_options(archive: Path) -> list[str]:
    """The JVM options that map `archive`."""
    return [f"-XX:SharedArchiveFile={archive}", QUIET]
