"""A short chaos soak (`bench.chaos_soak`): under two minutes of traffic through the whole system while
a worker, the pipeline and an API replica are killed with -9, PostgreSQL is stopped hard, the broker is
frozen, a worker is frozen until its partitions move, payments stamped 2099 and 1971 arrive and the
workers are scaled 2 -> 3 -> 2; then every promise is checked by the soak's own clients.

The soak runs its own broker and PostgreSQL server (it freezes and stops them), so this test uses none of
the session's. Every wait in the soak has a deadline; the test's timeout covers their sum on a busy
two-core machine (Spark alone may take three minutes to start). `test_chaos_soak_derived` soaks the
layout with C on the derived topic.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos_soak import Options
from tests.soaks import injected, soaked

pytestmark = pytest.mark.integration

SHORT = (
    "kill-worker",
    "kill-pipeline",
    "kill-api",
    "postgres-stop",
    "broker-freeze",
    "freeze-worker",
    "odd-timestamps",
    "scale",
)


@pytest.mark.timeout(1800)
async def test_a_short_chaos_soak_keeps_every_promise(tmp_path: Path) -> None:
    options = Options(
        seed=11,
        duration=110,
        rate=100,
        faults=SHORT,
        gap=(9.0, 11.0),  # nine faults in under two minutes, each while the last one's effects may last
        catch_up=420,
        results=tmp_path / "chaos_soak.json",
    )
    doc = await soaked(options, ("failures", "groups", "decided_twice"))
    expected = [
        "broker-freeze",
        "freeze-worker",
        "kill-api",
        "kill-pipeline",
        "kill-worker",
        "odd-timestamps",
        "postgres-stop",
    ]
    assert injected(doc) == sorted([*expected, "scale-up", "scale-down"]), doc["faults"]
    assert [x["fault"] for x in doc["skipped"]] == ["add-partitions"], doc["skipped"]
    assert doc["produced"]["valid"] >= 0.9 * options.rate * options.duration, doc["produced"]
    assert doc["produced"]["malformed"] >= 10, doc["produced"]

    assert doc["premature"]["decisions"] == 0, doc["premature"]
    assert doc["premature"]["undated"] == 0, doc["premature"]
    assert doc["lost"]["payments"] == 0, doc["lost"]
    assert doc["alerts"]["alerted_twice"] == 0, doc["alerts"]
    assert doc["alerts"]["payments"] > 0, "no alert at all: the detector did not run"
    malformed = doc["malformed"]
    assert malformed["dead_lettered"] == dict.fromkeys(
        ("relations", "aggregates", "aml"), malformed["produced"]
    )
    assert malformed["decided"] == 0, malformed
    assert doc["stores"]["agree"], doc["stores"]
    assert doc["stores"]["payers"] == 50 and len(doc["stores"]["replicas"]) == 4, doc["stores"]
    for group, state in doc["groups"].items():
        assert state["at_end"], f"{group} is not at the log end after the catch-up: {state}"
    assert doc["decided_twice"]["beyond_in_flight"] == 0, doc["decided_twice"]
    assert doc["unexpected_exits"] == [], doc["unexpected_exits"]
    assert doc["odd_timestamps"]["failures"] == [], doc["odd_timestamps"]
    assert doc["poller"]["regressions"] == [], doc["poller"]
    assert doc["ok"], doc["failures"]
