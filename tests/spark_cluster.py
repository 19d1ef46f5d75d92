"""A Spark standalone cluster (one master, one worker) started from the PySpark wheel, for the tests that
run the pipeline on a cluster rather than in `local[2]`: `spark-class` runs the same Master and Worker
daemons that `sbin/start-master.sh` would, in the foreground, each in a process group of its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pyspark

from aml_app.kafka.broker import free_port, port_open

SPARK_HOME = Path(pyspark.__file__).parent


class StandaloneCluster:
    def __init__(self, folder: Path, cores: int = 2, memory: str = "2g") -> None:
        self.folder = folder
        self.port, self.ui_port, self.worker_ui_port = free_port(), free_port(), free_port()
        self.cores, self.memory = cores, memory
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def master(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _daemon(self, name: str, *args: str) -> None:
        env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1"}
        with open(self.folder / f"{name}.log", "wb") as log:
            self.processes.append(
                subprocess.Popen(
                    [str(SPARK_HOME / "bin" / "spark-class"), *args],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def start(self, timeout: float = 120) -> StandaloneCluster:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._daemon(
            "master", "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(self.ui_port),
        )  # fmt: skip
        self._wait(lambda: port_open("127.0.0.1", self.port), timeout, "the master")
        self._daemon(
            "worker", "org.apache.spark.deploy.worker.Worker", self.master,
            "--host", "127.0.0.1", "--cores", str(self.cores), "--memory", self.memory,
            "--webui-port", str(self.worker_ui_port), "--work-dir", str(self.folder / "work"),
        )  # fmt: skip
        self._wait(lambda: len(self.state().get("workers", [])) == 1, timeout, "the worker to register")
        return self

    def state(self) -> dict[str, Any]:
        """The master's own view (its web UI's /json): workers, applications, executors."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=2) as answer:
                return json.load(answer)
        except (OSError, ValueError):  # not up yet; while it starts, the UI may answer its HTML page
            return {}

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for process in self.processes:
                if process.poll() is not None:
                    raise AssertionError(f"a Spark daemon exited while waiting for {what}; see {self.folder}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}; see {self.folder}")
            time.sleep(0.2)

    def stop(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
