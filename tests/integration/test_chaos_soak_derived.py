"""A short chaos soak with Service C on the derived topic (`bench.chaos_soak --derived`), as the Procfile
and the compose file run it: the enrichment stage and an API replica killed with -9, the broker frozen for
15 s, the pipeline killed; then every promise is checked by the soak's own clients, C's position read
from every record of the stage's topic (its reader must reach the topic's end, or the verdict fails).

The soak runs its own broker and PostgreSQL server (it freezes the broker), so this test uses none of the
session's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos_soak import Options
from tests.soaks import injected, soaked

pytestmark = pytest.mark.integration


DERIVED_FAULTS = ("broker-freeze-long", "kill-stage", "kill-api", "kill-pipeline")


@pytest.mark.timeout(1500)
async def test_a_short_chaos_soak_with_c_on_the_derived_topic_keeps_every_promise(tmp_path: Path) -> None:
    options = Options(
        seed=7,
        duration=75,
        rate=100,
        faults=DERIVED_FAULTS,
        gap=(16.0, 18.0),  # the 15 s freeze is over before the next fault
        catch_up=420,
        derived=True,
        results=tmp_path / "chaos_soak_derived.json",
    )
    doc = await soaked(options, ("failures", "groups", "readers"))
    assert injected(doc) == sorted(DERIVED_FAULTS), doc["faults"]
    assert doc["premature"]["decisions"] == 0, doc["premature"]
    assert doc["lost"]["payments"] == 0, doc["lost"]
    assert doc["alerts"]["alerted_twice"] == 0, doc["alerts"]
    malformed = doc["malformed"]
    assert malformed["dead_lettered"] == dict.fromkeys(
        ("relations", "enrichment", "aml"), malformed["produced"]
    )
    assert doc["derived_reader_behind"] == 0, doc["readers"]
    assert doc["readers"]["derived"]["records"] >= doc["produced"]["valid"], doc["readers"]
    assert doc["stores"]["agree"], doc["stores"]
    for group, state in doc["groups"].items():
        assert state["at_end"], f"{group} is not at the log end after the catch-up: {state}"
    assert doc["unexpected_exits"] == [], doc["unexpected_exits"]
    assert doc["ok"], doc["failures"]
