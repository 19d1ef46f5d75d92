"""The capacity benchmark tells the JIT's share of the pipeline JVM's CPU from the JVM's own threads."""

from __future__ import annotations

import os
import select
import subprocess
from pathlib import Path

import pytest

from bench.capacity import Sample, jit_threads, jit_used

#: A JVM that keeps its JIT busy: a hot method, then a sleep that leaves the JVM alive to be read.
WARM = """
public class Warm {
    static long f(long x) { return x * 31 + (x >>> 3); }
    public static void main(String[] args) throws Exception {
        long s = 0;
        for (long i = 0; i < 50_000_000L; i++) s = f(s + i);
        System.out.println("warm " + s);
        System.out.flush();
        Thread.sleep(60_000);
    }
}
"""


def sample(jit: dict[int, float]) -> Sample:
    return Sample(0.0, {}, {}, {}, 0, jit=jit)


def test_the_jit_threads_of_a_running_jvm_are_found_and_have_used_cpu(tmp_path: Path) -> None:
    source = tmp_path / "Warm.java"
    source.write_text(WARM)
    # Both compilers, as a deployed pipeline's JVM has them (the tests give short-lived JVMs C1 alone).
    env = {k: v for k, v in os.environ.items() if k != "JAVA_TOOL_OPTIONS"}
    jvm = subprocess.Popen(["java", str(source)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert jvm.stdout is not None
        ready, _, _ = select.select([jvm.stdout], [], [], 60)
        assert ready, "the JVM ran its hot loop for a minute"
        line = jvm.stdout.readline()  # the hot loop has run: the JIT compiled it
        assert line.startswith("warm"), line
        found = jit_threads([jvm.pid])
        names = {Path(f"/proc/{jvm.pid}/task/{t}/comm").read_text().strip() for t in found}
        assert any(n.startswith("C2 Compiler") for n in names), names
        assert any(n.startswith("C1 Compiler") for n in names), names
        assert sum(found.values()) > 0
        all_threads = os.listdir(f"/proc/{jvm.pid}/task")
        assert len(found) < len(all_threads)  # the JVM's other threads are not the JIT's
    finally:
        jvm.kill()
        jvm.wait(timeout=30)


def test_a_process_without_a_jit_and_an_ended_one_have_none() -> None:
    assert jit_threads([os.getpid()]) == {}
    assert jit_threads([2**22 + 1]) == {}  # above Linux's largest pid: no such process


@pytest.mark.parametrize(
    ("start", "end", "used"),
    [
        ({1: 2.0, 2: 1.0}, {1: 3.5, 2: 1.25}, 1.75),  # both threads ran on
        ({1: 2.0}, {1: 2.0, 3: 0.5}, 0.5),  # a thread started in between counts from nothing
        ({1: 2.0, 2: 9.0}, {1: 2.5}, 0.5),  # one that ended took its CPU along: not counted
    ],
)
def test_the_jit_used_between_two_samples_is_over_the_threads_of_the_later(
    start: dict[int, float], end: dict[int, float], used: float
) -> None:
    assert jit_used(sample(start), sample(end)) == pytest.approx(used)
