"""The detector's freshness check (`Detector.fresh_evidence`, and `Detector.__call__` around it): an
answer of B or C whose `as_of` lacks a payment is a freshness violation; with the gate on the detector
waits and asks again about the stale payments only, until every answer includes them, and decides each
payment on the first answers that do; with the gate off it decides on what it saw and says so. A
dependency that is away is waited out. B and C are played by a fake at the seam `evidence_for` uses
(`aggregates_many`, `relations_many`); no Kafka, no HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

import pytest

from aml_app import dependency_services as registry
from aml_app.dependencies.aggregates import empty_window
from aml_app.dependencies.api import MAX_BATCH
from aml_app.dependencies.client import DependencyUnavailable, Need, NotYet
from aml_app.detection.evidence import Evidence
from aml_app.gate import Admission
from aml_app.gate import gate as gate_module
from aml_app.gate.stall import StallWatch
from aml_app.models import Payment
from aml_app.settings import ConfigError, load_settings
from aml_app.worker import detector as detector_module
from aml_app.worker.detector import LOOP_INCOMPLETE, Detector

TS = "2026-03-02T12:00:00Z"
PARTITION = 3
#: Small waits, so that a dozen rounds take milliseconds; the backoff's shape stays the detector's.
STALE_DELAYS = (0.02, 0.03)
UNAVAILABLE_DELAYS = (0.01, 0.02)
#: Asleep-at-least checks allow for the event loop's clock resolution.
SLACK = 0.002


class FakeDependencies:
    """B and C as `evidence_for` calls them: one batch call each per round, every answer of a call from
    one snapshot (one `as_of`, as the APIs answer). The n-th call of a dependency answers with its
    schedule's n-th `as_of` (the last one from then on), or raises DependencyUnavailable when n is in
    its `away` rounds. Every answer carries `round`, the call that produced it (ignored by parsing)."""

    def __init__(
        self,
        relations: Sequence[int],
        aggregates: Sequence[int],
        away: dict[str, set[int]] | None = None,
        logs: Sequence[str] = ("c:topic",),
    ) -> None:
        self.schedule = {"relations": list(relations), "aggregates": list(aggregates)}
        self.away = away or {}
        #: The log identity of each round's answers (the last one from then on), for both dependencies.
        self.logs = list(logs)
        self.calls: dict[str, list[list[str]]] = {"relations": [], "aggregates": []}
        self.called_at: list[float] = []
        self.needs: list[Any] = []
        #: The replica each call asked first (`Replicas.order`): the batch's partition.
        self.routes: list[int | None] = []
        self.not_yet: dict[str, set[int]] = {}

    def _round(self, dependency: str, accounts: list[str]) -> tuple[int, dict[str, int]]:
        n = len(self.calls[dependency])
        self.calls[dependency].append(accounts)
        if dependency == "aggregates":
            self.called_at.append(time.monotonic())
        if n in self.away.get(dependency, set()):
            raise DependencyUnavailable(f"{dependency} at http://127.0.0.1:1 is unavailable: round {n}")
        if n in self.not_yet.get(dependency, set()):
            raise NotYet(f"{dependency} has not applied what the question needs yet: round {n}")
        schedule = self.schedule[dependency]
        return n, {str(PARTITION): schedule[min(n, len(schedule) - 1)]}

    def log(self, n: int) -> str:
        return self.logs[min(n, len(self.logs) - 1)]

    async def aggregates_many(
        self, queries: Sequence[tuple[str, datetime]], need: Any = None, route: int | None = None
    ) -> list[dict[str, Any]]:
        self.needs.append(need)
        self.routes.append(route)
        n, as_of = self._round("aggregates", [account for account, _ in queries])
        return [
            {
                "account": account,
                "at": at.isoformat(),
                "as_of": as_of,
                "log": self.log(n),
                "round": n,
                "windows": {name: empty_window() for name in ("1h", "24h", "7d")},
                "near_threshold_24h": 0,
                "reporting_threshold": "10000",
                "threshold_band": "0.1",
                "late_dropped": 0,
            }
            for account, at in queries
        ]

    async def relations_many(
        self,
        accounts: Sequence[str],
        hops: int = 3,
        parts: str | Sequence[str] = "out,cycle",
        min_average: Decimal = Decimal(0),
        loops: Sequence[tuple[str, datetime, int] | None] | None = None,
        need: Any = None,
        ats: Sequence[datetime | None] | None = None,
        route: int | None = None,
    ) -> list[dict[str, Any]]:
        self.routes.append(route)
        n, as_of = self._round("relations", list(accounts))
        return [
            {
                "account": account,
                "hops": hops,
                "as_of": as_of,
                "log": self.log(n),
                "round": n,
                "out": [],
                "cycle": {"found": False, "path": []},
                "chain": [],
            }
            for account in accounts
        ]


@pytest.fixture(autouse=True)
def short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detector_module, "STALE_DELAYS", STALE_DELAYS)
    monkeypatch.setattr(detector_module, "UNAVAILABLE_DELAYS", UNAVAILABLE_DELAYS)


def batch(
    gated: bool, offsets: Sequence[int] = (10, 11), log: str | None = None
) -> list[tuple[Payment, Admission]]:
    """Payments of one partition as the gate admits them: payment `p<o>` from `payer<o>` to `payee<o>`."""
    return [
        (
            Payment(
                payment_id=f"p{o}",
                payer=f"payer{o}",
                payee=f"payee{o}",
                amount="10.00",
                currency="EUR",
                ts=TS,
            ),
            Admission(
                PARTITION, o, 12, {"relations": 12, "aggregates": 12}, waited_ms=0.0, gated=gated, log=log
            ),
        )
        for o in offsets
    ]


def accounts(*offsets: int) -> list[str]:
    """The accounts one round asks about for these payments, in `evidence_for`'s order."""
    return [account for o in offsets for account in (f"payer{o}", f"payee{o}")]


def rounds(answers: list[dict[str, Any]]) -> set[int]:
    return {answer["round"] for answer in answers}


def detector(fake: FakeDependencies, rules: Any = None) -> Detector:
    return Detector("aml", rules or (lambda evidence: []), fake)  # type: ignore[arg-type]


async def test_gate_on_asks_again_about_the_stale_payment_only_until_its_answers_include_it() -> None:
    """Offset 10 is in every answer at once; offset 11 only from the third round on."""
    fake = FakeDependencies(relations=[11, 11, 12], aggregates=[11, 11, 12])
    d = detector(fake)
    evidence = await d.fresh_evidence(batch(gated=True))
    assert fake.calls["aggregates"] == [accounts(10, 11), accounts(11), accounts(11)]
    assert fake.calls["relations"] == fake.calls["aggregates"]
    (fresh, fresh_stale_reads), (lagging, lagging_stale_reads) = evidence
    assert rounds(fresh) == {0} and fresh_stale_reads == 0, "a fresh payment is decided on its first answers"
    assert rounds(lagging) == {2} and lagging_stale_reads == 2, "the first answers that include it, after 2"
    assert [a["account"] for a in lagging] == ["payer11", "payee11", "payer11", "payee11"]
    assert d.stats.freshness_violations == 2
    assert d.stats.decided_not_fresh == 0 and d.stats.unavailable == 0
    # It waited before each question again, longer the second time (up to STALE_DELAYS[1]).
    gaps = [b - a for a, b in zip(fake.called_at, fake.called_at[1:], strict=False)]
    assert gaps[0] >= STALE_DELAYS[0] - SLACK and gaps[1] >= STALE_DELAYS[1] - SLACK, gaps


async def test_the_largest_batch_asks_each_api_one_request_it_accepts() -> None:
    """AML_MAX_BATCH payments ask each dependency QUERIES_PER_PAYMENT queries apiece in one request, which
    the API must accept (at most its MAX_BATCH queries): a batch refused for its size fails for ever."""
    with pytest.raises(ConfigError):
        load_settings({"AML_MAX_BATCH": str(MAX_BATCH // registry.QUERIES_PER_PAYMENT + 1)})
    largest = MAX_BATCH // registry.QUERIES_PER_PAYMENT
    assert load_settings({"AML_MAX_BATCH": str(largest)}).detection.max_batch == largest
    fake = FakeDependencies(relations=[largest + 1], aggregates=[largest + 1])
    await detector(fake).fresh_evidence(batch(gated=True, offsets=range(largest)))
    for dependency in ("aggregates", "relations"):
        (asked,) = fake.calls[dependency]
        assert len(asked) == largest * registry.QUERIES_PER_PAYMENT <= MAX_BATCH, dependency


async def test_the_questions_say_what_they_need_and_not_yet_asks_again() -> None:
    """B and C are told the next offset past the batch's payments, of their log; a "not yet" from every
    replica makes the batch wait and ask again, as a stale answer does. Ungated, nothing is needed."""
    fake = FakeDependencies(relations=[12], aggregates=[12])
    fake.not_yet = {"aggregates": {0, 1}}
    d = detector(fake)
    d.freshness_wait = 1.5
    evidence = await d.fresh_evidence(batch(gated=True, log="c:topic"))
    assert fake.needs[0] == Need({PARTITION: 12}, "c:topic", 1.5)
    assert set(fake.routes) == {PARTITION}, "a partition's questions go to its replica first"
    assert len(fake.calls["aggregates"]) == 3 and all(rounds(a) == {2} for a, _ in evidence)
    assert [stale for _, stale in evidence] == [2, 2] and d.stats.decided_not_fresh == 0
    await d.fresh_evidence(batch(gated=False))
    assert fake.needs[-1] is None


def test_the_event_time_gates_cut_is_needed_on_every_partition() -> None:
    """A payment admitted at a cut was decided on every partition's evidence up to that cut's W(q): the
    answers must include those offsets too, not only the payment's own."""
    d = detector(FakeDependencies(relations=[12], aggregates=[12]))
    items = batch(gated=True, log="c:topic")
    cut = {"at": TS, "frontier": None, "watermarks": {str(PARTITION): 12, "5": 40, "6": 7}}
    items[0] = (items[0][0], dataclasses.replace(items[0][1], cut=cut))
    items[1] = (items[1][0], dataclasses.replace(items[1][1], cut={**cut, "watermarks": {"5": 41}}))
    assert d.need(items) == Need({PARTITION: 12, 5: 41, 6: 7}, "c:topic", d.freshness_wait)


async def test_answers_short_of_the_event_time_cut_are_stale() -> None:
    """Admitted at a cut whose W(5) is 40, a payment's answers must reach offset 40 on partition 5 too
    (what the question needed): a replica that answered short of it, whatever its own partition's
    offset, has not shown the evidence of every payment up to the payment's time. Asked again until
    an answer reaches the cut."""
    fake = FakeDependencies(relations=[12], aggregates=[12])
    schedule = fake._round

    def with_partition_5(dependency: str, asked: list[str]) -> tuple[int, dict[str, int]]:
        n, as_of = schedule(dependency, asked)
        return n, {**as_of, "5": 39 + min(n, 1)}  # 39 at first, 40 from the second round

    fake._round = with_partition_5  # type: ignore[method-assign]
    d = detector(fake)
    cut = {"at": TS, "frontier": None, "watermarks": {str(PARTITION): 12, "5": 40}}
    items = [(p, dataclasses.replace(a, cut=cut)) for p, a in batch(gated=True, log="c:topic")]
    evidence = await d.fresh_evidence(items)
    assert len(fake.calls["aggregates"]) == 2
    assert all(rounds(answers) == {1} and stale == 1 for answers, stale in evidence)
    assert d.stats.freshness_violations == 2


@pytest.mark.parametrize(
    ("relations", "aggregates", "fresh_from"),
    [
        ([12], [11, 11, 11, 12], 3),  # C alone lags: its stale answers are enough to ask again
        ([11, 12], [12], 1),  # B alone lags, one round
        ([11, 11, 12], [11, 12], 2),  # both lag, B the longer: the payment waits for the later one
    ],
)
async def test_one_stale_answer_is_enough_to_ask_both_again(
    relations: list[int], aggregates: list[int], fresh_from: int
) -> None:
    fake = FakeDependencies(relations, aggregates)
    d = detector(fake)
    [(answers, stale_reads)] = await d.fresh_evidence(batch(gated=True, offsets=(11,)))
    assert len(fake.calls["relations"]) == len(fake.calls["aggregates"]) == fresh_from + 1
    assert rounds(answers) == {fresh_from}
    assert all(int(a["as_of"][str(PARTITION)]) > 11 for a in answers)
    assert stale_reads == d.stats.freshness_violations == fresh_from
    assert d.stats.decided_not_fresh == 0


async def test_answers_of_another_log_are_stale_whatever_their_offsets() -> None:
    """The payments topic was deleted and created again: the stores' offsets cover offset 10 of the old
    log, which is another payment. The payment waits until the answers are of its own log."""
    fake = FakeDependencies(relations=[50], aggregates=[50], logs=["c:old", "c:old", "c:new"])
    found = await detector(fake).fresh_evidence(batch(gated=True, offsets=[10], log="c:new"))
    [(answers, stale_reads)] = found
    assert stale_reads == 2 and rounds(answers) == {2}
    assert {answer["log"] for answer in answers} == {"c:new"}


async def test_gate_off_keeps_the_first_answers_and_counts_the_stale_decision() -> None:
    fake = FakeDependencies(relations=[11, 11, 12], aggregates=[11, 11, 12])
    d = detector(fake)
    (fresh, fresh_stale_reads), (lagging, lagging_stale_reads) = await d.fresh_evidence(batch(gated=False))
    assert fake.calls["aggregates"] == [accounts(10, 11)], "asked once, nothing again"
    assert fake.calls["relations"] == [accounts(10, 11)]
    assert rounds(fresh) == rounds(lagging) == {0}
    assert (fresh_stale_reads, lagging_stale_reads) == (0, 1)
    assert d.stats.freshness_violations == 1 and d.stats.decided_not_fresh == 1


async def test_a_dependency_that_is_away_is_waited_out_and_the_whole_batch_asked_again() -> None:
    fake = FakeDependencies(relations=[12], aggregates=[12], away={"aggregates": {0, 1}})
    d = detector(fake)
    evidence = await d.fresh_evidence(batch(gated=True))
    assert fake.calls["aggregates"] == [accounts(10, 11)] * 3
    assert [rounds(answers) for answers, _ in evidence] == [{2}, {2}]
    assert [stale_reads for _, stale_reads in evidence] == [0, 0]
    assert d.stats.unavailable == 2
    assert d.stats.freshness_violations == 0 and d.stats.decided_not_fresh == 0
    gaps = [b - a for a, b in zip(fake.called_at, fake.called_at[1:], strict=False)]
    assert gaps[0] >= UNAVAILABLE_DELAYS[0] - SLACK and gaps[1] >= UNAVAILABLE_DELAYS[1] - SLACK, gaps


EVIDENCE_WAIT = 0.2


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ({"away": {"aggregates": set(range(1000))}}, DependencyUnavailable),
        ({"not_yet": {"relations": set(range(1000))}}, NotYet),
        ({"stale": True}, NotYet),
    ],
    ids=["C away", "B not there yet", "answers that lack the payment"],
)
async def test_a_batch_whose_evidence_never_comes_fails_after_the_evidence_wait(
    fault: dict[str, Any], error: type[Exception], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The detector asks again for EVIDENCE_WAIT, then fails the batch with the last reason: the lane's
    handling shows it (`retrying`), counts it toward AML_MAX_ATTEMPTS and parks it on request, none of
    which applies to a handler that waits without end."""
    monkeypatch.setattr(detector_module, "EVIDENCE_WAIT", EVIDENCE_WAIT)
    behind = 10 if fault.get("stale") else 12  # an as_of of 10 lacks both payments (offsets 10 and 11)
    fake = FakeDependencies(relations=[behind], aggregates=[behind], away=fault.get("away"))
    fake.not_yet = fault.get("not_yet", {})
    started = time.monotonic()
    with pytest.raises(error):
        await asyncio.wait_for(detector(fake).fresh_evidence(batch(gated=True)), 20 * EVIDENCE_WAIT)
    assert time.monotonic() - started >= EVIDENCE_WAIT - SLACK
    assert len(fake.calls["aggregates"]) > 2, "it asked again while it waited"


async def test_an_outage_between_two_stale_rounds_asks_again_about_the_stale_payment_only() -> None:
    """Round 0: offset 11 is stale; round 1: C is away; round 2: fresh. Offset 10 is kept from round 0."""
    fake = FakeDependencies(relations=[11, 12], aggregates=[11, 12], away={"aggregates": {1}})
    d = detector(fake)
    (fresh, fresh_stale_reads), (lagging, lagging_stale_reads) = await d.fresh_evidence(batch(gated=True))
    assert fake.calls["aggregates"] == [accounts(10, 11), accounts(11), accounts(11)]
    assert rounds(fresh) == {0} and fresh_stale_reads == 0
    # B answered in round 1 while C was away: that round is dropped whole, both are asked again.
    assert fake.calls["relations"] == fake.calls["aggregates"]
    assert rounds(lagging) == {2} and lagging_stale_reads == 1
    assert d.stats.unavailable == 1 and d.stats.freshness_violations == 1 and d.stats.decided_not_fresh == 0


class Sent:
    """Stands in for `send_decision`: keeps each decision and acknowledges it at once."""

    def __init__(self) -> None:
        self.decisions: dict[str, dict[str, Any]] = {}

    async def __call__(self, payment_id: str, value: bytes) -> asyncio.Future[Any]:
        self.decisions[payment_id] = json.loads(value)
        acked = asyncio.get_running_loop().create_future()
        acked.set_result(payment_id)
        return acked


@pytest.mark.parametrize("gated", [True, False])
async def test_a_batch_is_decided_on_the_evidence_it_waited_for(
    monkeypatch: pytest.MonkeyPatch, gated: bool
) -> None:
    """`__call__` end to end without a producer: the rules see, and the decision records, the answers
    the freshness check chose; with the gate off the decision says it was made on stale evidence."""
    sent = Sent()
    monkeypatch.setattr(detector_module, "send_decision", sent)
    seen: dict[str, list[int]] = {}

    def rules(evidence: Evidence) -> list[Any]:
        answers = (
            evidence.payer_aggregates,
            evidence.payee_aggregates,
            evidence.payer_relations,
            evidence.payee_relations,
        )
        seen[evidence.payment_id] = [answer.as_of[PARTITION] for answer in answers]
        return []

    d = detector(FakeDependencies(relations=[11, 11, 12], aggregates=[11, 11, 12]), rules)
    await asyncio.wait_for(await d(batch(gated)), 5)  # type: ignore[arg-type]
    assert d.stats.decisions == 2
    first, second = sent.decisions["p10"], sent.decisions["p11"]
    assert seen["p10"] == [11] * 4 and first["evidence_as_of"] == dict.fromkeys(detector_module.ANSWERS, 11)
    assert first["fresh"] is True and first["stale_reads"] == 0 and first["note"] == ""
    assert second["offset"] == 11 and second["gated"] is gated
    if gated:
        assert seen["p11"] == [12] * 4, "the rules ran on the answers that include the payment"
        assert second["evidence_as_of"] == dict.fromkeys(detector_module.ANSWERS, 12)
        assert second["fresh"] is True and second["stale_reads"] == 2 and second["note"] == ""
        assert d.stats.decided_not_fresh == 0
    else:
        assert seen["p11"] == [11] * 4
        assert second["evidence_as_of"] == dict.fromkeys(detector_module.ANSWERS, 11)
        assert second["fresh"] is False and second["stale_reads"] == 1
        assert "did not include this payment" in second["note"]
        assert d.stats.decided_not_fresh == 1


class AlertsSent:
    """Stands in for the `alerts-sent` table: what the worker's store holds, by key."""

    def __init__(self, alerts: dict[bytes, dict[str, Any]]) -> None:
        self.data = alerts

    def get(self, key: bytes) -> Any:
        return self.data.get(key)


async def test_a_payment_alerted_on_by_an_earlier_handling_is_decided_as_its_alert_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch handled again (a failed acknowledgement, the partition's next owner): the rules now find
    nothing in p10, whose alert the earlier handling sent, and p11's id is held by another payment's
    alert. p10's decision keeps its alert's verdict, rules and typologies (it said "clear" beside the
    alert before); p11 is decided on its own."""
    from aml_app.tables.alerts import alert_key

    sent = Sent()
    monkeypatch.setattr(detector_module, "send_decision", sent)
    p10 = batch(True)[0][0]
    earlier = {
        **{field: getattr(p10, field) for field in detector_module.PAYMENT_FIELDS},
        "hits": [{"rule": "aml.fan_out", "typology": "fan-out"}],
        "typologies": ["fan-out"],
    }
    other = {**earlier, "payer": "someone else"}
    table = AlertsSent({alert_key("p10"): earlier, alert_key("p11"): other})
    monkeypatch.setattr(detector_module, "alerts_sent", table)
    d = detector(FakeDependencies(relations=[12], aggregates=[12]))
    await asyncio.wait_for(await d(batch(True)), 5)  # type: ignore[arg-type]
    first, second = sent.decisions["p10"], sent.decisions["p11"]
    assert (first["verdict"], first["rules"], first["typologies"]) == ("alert", ["aml.fan_out"], ["fan-out"])
    assert (second["verdict"], second["rules"], second["typologies"]) == ("clear", [], [])


@pytest.mark.parametrize("stops", ["while C is away", "once the evidence is in"])
async def test_a_batch_whose_lane_stopped_decides_nothing(
    monkeypatch: pytest.MonkeyPatch, stops: str
) -> None:
    """A revoke stops the lane by a cancel, which the handler's awaits can lose: the batch then still
    sees that its lane stopped, asks B and C nothing more and sends no alert and no decision, which
    the partition's next owner sends. Without the check it waits out the outage and decides both."""
    sent = Sent()
    monkeypatch.setattr(detector_module, "send_decision", sent)
    fake = FakeDependencies(relations=[12], aggregates=[12], away={"aggregates": {0, 1}})
    stopped = [False]

    def stop_when() -> bool:
        # The revoke comes after the first failed round, or after the last (answered) one.
        rounds_asked = len(fake.calls["aggregates"])
        stopped[0] = stopped[0] or rounds_asked >= (1 if stops == "while C is away" else 3)
        return stopped[0]

    items = [
        (payment, dataclasses.replace(admission, stopped=stop_when)) for payment, admission in batch(True)
    ]
    d = detector(fake)
    with pytest.raises(asyncio.CancelledError):
        await d(items)
    assert sent.decisions == {}
    assert len(fake.calls["aggregates"]) == (1 if stops == "while C is away" else 3)


async def test_a_batch_that_ends_just_after_a_stall_of_the_worker_waits_to_learn_its_lane_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker stopped past its session timeout finishes, once continued, the batches whose evidence
    came meanwhile before the revoke reaches its lanes. The batch waits a heartbeat's time after the
    stall; the revoke that comes meanwhile stops it, and nothing is sent. Without the wait it decides
    (and alerts on) payments the partition's next owner has decided already."""
    sent = Sent()
    monkeypatch.setattr(detector_module, "send_decision", sent)
    watch = StallWatch()
    watch.start(session_timeout=1.0)  # a stall is 0.5 s or more; sends then wait 0.2 s
    watch.tick()
    assert watch.last is not None
    watch.last -= 30.0  # stopped for half a minute; the ticker has not run since
    monkeypatch.setattr(gate_module, "stalls", watch)
    revoked = [False]
    asyncio.get_running_loop().call_later(0.05, lambda: revoked.__setitem__(0, True))
    items = [
        (payment, dataclasses.replace(admission, stopped=lambda: revoked[0]))
        for payment, admission in batch(True)
    ]
    d = detector(FakeDependencies(relations=[12], aggregates=[12]))
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(d(items), 5)
    assert sent.decisions == {} and watch.stalls == 1


async def test_a_decision_on_answers_c_pruned_or_b_folded_says_so_and_is_counted() -> None:
    fake = FakeDependencies(relations=[12], aggregates=[12])
    d = detector(fake)
    [(payment, admission)] = batch(gated=True, offsets=(10,))
    [(answers, stale_reads)] = await d.fresh_evidence([(payment, admission)])
    timely = json.loads(d.decision(payment, admission, [], answers, stale_reads, TS))
    assert timely["note"] == "" and d.stats.decided_on_pruned == 0
    # The payee's week reaches before what C kept; then the payee's edges are folded past the payment's time.
    for i in (1, 3):
        inexact = [{**a, "exact": False} if j == i else a for j, a in enumerate(answers)]
        pruned = json.loads(d.decision(payment, admission, [], inexact, stale_reads, TS))
        assert "C had pruned or B had folded" in pruned["note"], pruned
        assert "AML_AGGREGATES_RETENTION" in pruned["note"], pruned
    assert d.stats.decided_on_pruned == 2


async def test_a_decision_whose_loop_search_stopped_at_its_bound_says_so_and_is_counted() -> None:
    """B's `loop.complete` false: the search for a cycle through the payment stopped before it could rule
    one out, and the clear verdict read as if B had found none."""
    fake = FakeDependencies(relations=[12], aggregates=[12])
    d = detector(fake)
    [(payment, admission)] = batch(gated=True, offsets=(10,))
    [(answers, stale_reads)] = await d.fresh_evidence([(payment, admission)])
    stopped = [
        {**a, "loop": {"found": False, "path": [], "complete": False}} if j == 3 else a
        for j, a in enumerate(answers)
    ]
    decided = json.loads(d.decision(payment, admission, [], stopped, stale_reads, TS))
    assert decided["note"] == LOOP_INCOMPLETE and d.stats.decided_on_incomplete_loop == 1
    both = [{**a, "exact": False} if j == 1 else a for j, a in enumerate(stopped)]
    decided = json.loads(d.decision(payment, admission, [], both, stale_reads, TS))
    assert decided["note"].endswith(f"AML_AGGREGATES_RETENTION); {LOOP_INCOMPLETE}")
    assert json.loads(d.decision(payment, admission, [], answers, stale_reads, TS))["note"] == ""
    assert d.stats.decided_on_incomplete_loop == 2


async def test_a_derived_cs_answers_are_checked_by_its_offsets_on_its_topic() -> None:
    """C reading a topic derived from payments states its as_of in offsets of that topic: the detector
    asks it for, and holds its answers to, the group's offsets there that the admitting reading mapped
    (8 on partition 3 of that topic), not the payments' offsets (10 and 11), which B is still held to.
    Compared with the payments' offsets, C's answers at 9 would never do."""
    fake = FakeDependencies(relations=[12], aggregates=[3, 3, 9])
    d = Detector("aml", lambda evidence: [], fake, derived={"aggregates": "c-group"})  # type: ignore[arg-type]
    items = [(p, dataclasses.replace(a, derived={"c-group": {PARTITION: 8}})) for p, a in batch(gated=True)]
    async with asyncio.timeout(10):
        evidence = await d.fresh_evidence(items)
    assert [stale for _, stale in evidence] == [2, 2]
    assert all(rounds(answers) == {2} for answers, _ in evidence)  # both asked again together
    assert fake.needs[0] == Need({PARTITION: 8}, None, d.freshness_wait)
    assert d.includes("payer aggregates", {"as_of": {str(PARTITION): 8}}, items[0][1])
    assert not d.includes("payer aggregates", {"as_of": {str(PARTITION): 7}}, items[0][1])
    assert not d.includes("payee aggregates", {"as_of": {str(PARTITION): 99}}, batch(gated=True)[0][1]), (
        "an admission that recorded no offsets for the group proves nothing"
    )
    # The decision gives B's as_of at the payment's partition, none of C's (of another topic's partitions).
    answers, stale_reads = evidence[0]
    decision = json.loads(d.decision(items[0][0], items[0][1], [], answers, stale_reads, TS))
    assert decision["evidence_as_of"]["payer aggregates"] is None
    assert decision["evidence_as_of"]["payer relations"] == 12
