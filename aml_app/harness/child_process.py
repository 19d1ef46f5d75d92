"""`aml-app <command>` as a child process: what the demo, the tests and the benchmarks run from outside.

One place for starting a command in a process group of its own with its output in a log file, asking
whether it lives, reading its log, and killing it like a crash would. The kinds of process built on it
(workers, the pipeline, the APIs) differ only in how they stop and what they answer.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Self

ERROR_LINE = re.compile(r"\[ERROR\]|\sERROR\s")  # Faust's, and Python logging's and Spark's layouts


def installed_executable(name: str) -> str | None:
    """The executable `name` next to this interpreter (a virtualenv's, often not on PATH), else the one
    on PATH; None without one."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def aml_app_executable() -> str:
    """`aml-app` next to this interpreter (the venv), else the one on PATH."""
    found = installed_executable("aml-app")
    if found is None:
        raise FileNotFoundError(f"no aml-app executable next to {sys.executable} or on PATH")
    return found


class AmlAppProcess:
    """`aml-app <args>` in its own process group, stdout and stderr in `log_path`.

    The log is emptied on start unless `append` (a restart that keeps the earlier run's lines).
    `executable` is the `aml-app` to run (default: `aml_app_executable()`), e.g. one installed elsewhere.
    """

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        log_path: Path,
        cwd: Path | None = None,
        append: bool = False,
        executable: str | None = None,
    ) -> None:
        self.args, self.env, self.log_path, self.cwd, self.append = args, env, log_path, cwd, append
        self.executable = executable
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        with open(self.log_path, "ab" if self.append else "wb") as log:
            self.process = subprocess.Popen(
                [self.executable or aml_app_executable(), *self.args],
                env=self.env,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_text(self) -> str:
        return self.log_path.read_bytes().decode(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the log, without Java stack frames (the exception line above them stays)."""
        kept = [line for line in self.log_text().splitlines() if not line.lstrip().startswith("at ")]
        return "\n".join(kept[-lines:])

    def first_error(self) -> str | None:
        """The log's first ERROR line: a crash at start-up is logged there, above a long shutdown."""
        return next((line for line in self.log_text().splitlines() if ERROR_LINE.search(line)), None)

    def signal_group(self, sig: int) -> None:
        """`sig` to the whole process group, while the process lives (once reaped, its pid and group id
        may belong to someone else)."""
        if self.alive():
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the process group, as a crash would."""
        self.signal_group(signal.SIGKILL)
        self.wait(10)

    def wait(self, timeout: float) -> bool:
        """Whether the process has ended within `timeout` seconds."""
        if self.process is None:
            return True
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
