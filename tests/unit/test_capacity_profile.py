"""`bench.py_profile`: py-spy's samples summed per function, idle waits and the frames under every sample
left out, and a process's CPU per payment split by those shares."""

from __future__ import annotations

from bench.py_profile import per_payment, summary

LOOP = "<module> (aml-app:8);main (aml_app/cli.py:40);BaseEventLoop.run_forever (asyncio/base_events.py:608)"
RAW = [
    f"{LOOP};EpollSelector.select (selectors.py:468) 50",
    f"{LOOP};Handle._run (asyncio/events.py:84);Detector.__call__ (aml_app/worker/detector.py:150);"
    "Evidence.parse (aml_app/detection/evidence.py:600);_fast (aml_app/detection/evidence.py:483) 30",
    f"{LOOP};Handle._run (asyncio/events.py:84);Detector.__call__ (aml_app/worker/detector.py:170) 10",
    f"{LOOP};Handle._run (asyncio/events.py:84);Admitter.take (aml_app/gate/admit.py:90) 10",
    "Thread._bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:81) 40",
    "Thread._bootstrap (threading.py:1002);Condition.wait (threading.py:320) 5",
    "garbage without a count",
]


def test_shares_are_of_busy_samples_by_function() -> None:
    found = summary(RAW)
    assert (found["busy"], found["idle"]) == (50, 95)
    # two stacks, one function
    assert found["inclusive"]["Detector.__call__ (aml_app/worker/detector.py)"] == 0.8
    assert found["inclusive"]["Evidence.parse (aml_app/detection/evidence.py)"] == 0.6
    assert found["self"] == {
        "_fast (aml_app/detection/evidence.py)": 0.6,
        "Detector.__call__ (aml_app/worker/detector.py)": 0.2,
        "Admitter.take (aml_app/gate/admit.py)": 0.2,
    }


def test_files_count_each_sample_once() -> None:
    files = summary(RAW)["files"]
    assert files["aml_app/worker/detector.py"] == 0.8
    assert files["aml_app/detection/evidence.py"] == 0.6  # two functions of it on one stack: counted once
    assert files["aml_app/gate/admit.py"] == 0.2


def test_frames_under_every_sample_are_left_out() -> None:
    shown = summary(RAW)["inclusive"]
    assert not [f for f in shown if "base_events" in f or "cli.py" in f or "events.py" in f or "aml-app" in f]


def test_cpu_per_payment_follows_the_shares() -> None:
    found = summary(RAW)
    assert per_payment(found, 500.0)["Evidence.parse (aml_app/detection/evidence.py)"] == 300.0
    assert per_payment(found, 500.0, "files")["aml_app/gate/admit.py"] == 100.0
    assert per_payment(found, None) == {}
    assert per_payment({"error": "no ptrace"}, 500.0) == {}


def test_nothing_busy() -> None:
    found = summary([f"{LOOP};EpollSelector.select (selectors.py:468) 7"])
    assert (found["busy"], found["idle"], found["inclusive"], found["self"]) == (0, 7, {}, {})
