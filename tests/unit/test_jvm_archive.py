"""Spark drivers map Spark's classes from the class archive: the tests' (`tests.jvm`), and a pipeline's
from its folder of archives (`AML_SPARK_CLASS_ARCHIVES`, `aml_app.pipeline.class_archive`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.jvm import ARCHIVES, SHORT_LIVED, VARIABLE, archive_options

START_A_DRIVER = """
import logging
import sys
from pathlib import Path
logging.basicConfig(level=logging.INFO)
from aml_app.pipeline.runner import spark_session
folder = Path(sys.argv[1]) if sys.argv[1:] else None
spark_session("local[2]", "aml-archive-check", class_archives=folder).stop()
"""


def classes_loaded(tmp_path: Path, options: list[str], *args: str) -> tuple[dict[str, str], str]:
    """Class -> where the driver JVM loaded it from, for a driver started as the pipeline starts one
    (`args`: its folder of class archives), and what the driver logged."""
    log = tmp_path / "classes.log"
    logging = f"-Xlog:class+load=info:file={log}"
    env = os.environ | {VARIABLE: " ".join([SHORT_LIVED, *options, logging])}
    run = subprocess.run(
        [sys.executable, "-c", START_A_DRIVER, *args], env=env, capture_output=True, timeout=180, check=True
    )
    found: dict[str, str] = {}
    for line in log.read_text().splitlines():  # the last JVM to write is the driver, after the launcher
        _, _, rest = line.partition("[class,load] ")
        name, _, source = rest.partition(" source: ")
        found[name] = source
    return found, run.stderr.decode(errors="replace")


def test_a_driver_maps_sparks_classes_from_the_archive(tmp_path: Path) -> None:
    options = archive_options()
    assert options, "no class archive could be made: the line tests.jvm printed at the start says why"
    shared, _ = classes_loaded(tmp_path, options)
    # "(top)": the archive on top of the JDK's own; without it the class comes from Spark's jar.
    assert shared["org.apache.spark.SparkContext"] == "shared objects file (top)"


def test_a_pipeline_maps_the_archive_of_its_install_from_its_folder(tmp_path: Path) -> None:
    """Only the folder brings the archive here: the JVM's own options name none."""
    assert archive_options(), (
        "no class archive could be made: the line tests.jvm printed at the start says why"
    )
    mapped, said = classes_loaded(tmp_path, [], str(ARCHIVES))
    assert mapped["org.apache.spark.SparkContext"] == "shared objects file (top)"
    assert "no Spark class archive" not in said
    elsewhere = tmp_path / "no-archives"
    elsewhere.mkdir()
    loaded, said = classes_loaded(tmp_path, [], str(elsewhere))
    assert loaded["org.apache.spark.SparkContext"].endswith(".jar")
    assert f"no Spark class archive for this install in {elsewhere}" in said  # and how to make one
    assert "aml-app spark-archive" in said
