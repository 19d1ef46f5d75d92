"""Reading which log a topic is: a cluster that does not answer in time is an unknown log (which the
planner and the leader ride out), never a bare TimeoutError that stops the caller."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest

from aml_app.kafka.identity import LogIdentities, LogUnknown


class SilentAdmin:
    """An admin client whose requests never complete (a frozen broker, librdkafka still waiting)."""

    def describe_cluster(self, **options: Any) -> concurrent.futures.Future[Any]:
        return concurrent.futures.Future()

    def describe_topics(self, topics: Any, **options: Any) -> dict[str, concurrent.futures.Future[Any]]:
        return {name: concurrent.futures.Future() for name in topics.topic_names}


@pytest.mark.parametrize("cluster_too", [True, False])
def test_a_cluster_that_does_not_answer_in_time_is_an_unknown_log(cluster_too: bool) -> None:
    identities = LogIdentities({"bootstrap.servers": "127.0.0.1:1"}, timeout=0.05)
    identities.admin = SilentAdmin()  # type: ignore[assignment]
    identities.cluster_id = "c"
    with pytest.raises(LogUnknown, match="cannot tell which log topic 'payments' is: no answer within"):
        identities.read("payments", cluster_too=cluster_too)
