"""The handler of a detecting service (AML, fraud): fresh evidence from B and C, rules, decision, alert.

For each batch of payments of one partition that the gate let through (`AML_MAX_BATCH` at most):
1. ask B and C about them, one request to each for the whole batch (`aml_app.dependencies.client`),
   saying what the answers must include (the next offset past the batch, of its log): each service waits
   up to `AML_FRESHNESS_WAIT` for its store to get there or answers "not yet", and the batch waits and
   asks again, as it does while a service is away, for up to EVIDENCE_WAIT; then it fails, and the lane
   retries it (shown, counted toward the retry ceiling, parked on request);
2. check freshness: every answer's `as_of` must include the payment, and be of the payment's log (the
   identity the admitting row carries, `aml_app.kafka.identity`), and reach every W(q) of the event-time
   cut it was admitted at. The gate makes this true; if it is not, that is a freshness violation:
   counted, and with the gate on the payment waits and asks again, so no decision is ever made on
   evidence that lacks it. With the gate off (the comparison mode) the violation is counted and the
   service decides on what it saw, as an ungated consumer would;
3. run the service's rules (pure functions of the evidence);
4. send the alert, once: the alert record is also the changelog entry of `alerts-sent` (RocksDB table),
   so a payment processed again after a crash or a rebalance finds it and does not alert twice; alerts
   are keyed by payment id, so a compacted topic agrees downstream. A payment handled again while its
   alert's acknowledgement is still to come (its batch retried, its partition back after a rebalance)
   waits for it; after a send that failed (the broker may hold the alert all the same: a timeout after
   the write) the partition of the alerts topic is read back before any alert goes there again, from
   where that alert can be (after the last alert acknowledged there before it was sent), and stays in
   doubt if another send failed during the read;
5. send the decisions (every payment, keyed by payment id, as JSON straight to the producer); the lane
   goes on with its next batch and acks this one once the broker has every alert (then remembered in the
   table's local store) and every decision.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, NamedTuple

from aml_app import dependency_services as dependency_registry
from aml_app.app import alerts_topic, app, send_decision, settings
from aml_app.backoff import Backoff
from aml_app.dependencies.client import (
    DependencyClient,
    DependencyUnavailable,
    Need,
    NotYet,
    evidence_for,
    includes,
)
from aml_app.dependencies.relations import LOOP_HOPS, MinAverage
from aml_app.detection.evidence import Evidence
from aml_app.detection.rules import Hit
from aml_app.gate import Admission, GatedConsumer
from aml_app.gate.handling import LeftToComplete
from aml_app.kafka.deadlines import DeadlineExceeded, within
from aml_app.models import Alert, Payment, decision_json
from aml_app.tables.alerts import alert_key, alerts_sent, applied_to, read_back
from aml_app.tables.watermarks import WorkerGate

log = logging.getLogger(__name__)

Rules = Callable[[Evidence], list[Hit]]
#: A service's rules over a whole batch at once (the AML model scores a batch in one walk of its trees).
BatchRules = Callable[[list[Evidence]], list[list[Hit]]]
ANSWERS = ("payer aggregates", "payee aggregates", "payer relations", "payee relations")
#: What tells two payments apart beside their id (`Detector.note_reuse`).
PAYMENT_FIELDS = ("payer", "payee", "amount", "currency", "ts")


class SentAlert(NamedTuple):
    """An alert handed to the producer, and the broker's acknowledgement of it to come."""

    payment_id: str
    alert: Alert
    ack: asyncio.Future[Any]
    partition: int = 0
    #: The lowest offset the alert can be at: after the last alert acknowledged on its partition when it
    #: was sent, since a log only grows (None: after what the store recovered).
    floor: int | None = None


@dataclass
class Doubt:
    """An alerts partition where a send failed: the broker may hold its alert all the same."""

    #: The lowest offset such an alert can be at (None: after what the store recovered).
    start: int | None
    #: Failures recorded, so that a read-back clears only the doubt it began after.
    marks: int = 1

    def add(self, floor: int | None) -> None:
        self.start = None if self.start is None or floor is None else min(self.start, floor)
        self.marks += 1


#: How long a payment handled again waits for the acknowledgement of its earlier alert, and for the
#: alerts topic to be read back; then its batch fails and is retried (shown as `retrying`).
ALERT_SETTLE_WAIT = 30.0


#: Waits between asking again: a dependency that is away, and evidence that is not fresh yet.
UNAVAILABLE_DELAYS = (0.1, 5.0)
STALE_DELAYS = (0.05, 1.0)
#: How long one attempt at a batch asks again for fresh evidence (a dependency away, one that has not
#: applied the payments yet, answers that lack them); then the batch fails with the last reason and is
#: retried as any failure is: shown as `retrying`, counted toward AML_MAX_ATTEMPTS, parked on request.
EVIDENCE_WAIT = 30.0


#: The note's sentence when B's loop search stopped at its bound: a clear verdict that has not ruled out
#: a cycle through the payment (asking again stops at the same place).
LOOP_INCOMPLETE = (
    "B's search for a cycle through the payment stopped at its bound before it could rule one out"
)


def note(admission: Admission, fresh: bool, exact: bool = True, loop_complete: bool = True) -> str:
    """Why a decision was not made on the gate's guarantee, in words (empty when it was), and what its
    evidence could not rule out."""
    why = _why(admission, fresh, exact)
    if loop_complete:
        return why
    return f"{why}; {LOOP_INCOMPLETE}" if why else LOOP_INCOMPLETE


def _why(admission: Admission, fresh: bool, exact: bool) -> str:
    if admission.stale is not None:
        return (
            f"decided stale after waiting {admission.stale:g} s at the gate (AML_WAIT_POLICY=decide-stale); "
            "sent to the review topic"
        )
    if not fresh:
        return "decided on evidence that did not include this payment (gate off)"
    if not exact:
        return (
            "decided on answers that B and C could not give exactly as of the payment's time (C had pruned "
            "or B had folded its payments: the payment is older than their newest event time by more than "
            "AML_AGGREGATES_RETENTION)"
        )
    return ""


@dataclass
class DetectorStats:
    decisions: int = 0
    alerts: int = 0
    duplicates_suppressed: int = 0
    #: Suppressed alerts whose id an alert of another payment holds (`Detector.note_reuse`).
    ids_reused: int = 0
    freshness_violations: int = 0
    decided_not_fresh: int = 0
    #: Decided on answers that lacked payments C had pruned or B had folded: maybe not a timely decision.
    decided_on_pruned: int = 0
    decided_on_incomplete_loop: int = 0
    unavailable: int = 0
    #: Seconds spent per step, summed over payments (where a payment's time goes, for the benchmarks).
    seconds: dict[str, float] = field(
        default_factory=lambda: {"evidence": 0.0, "rules": 0.0, "alert": 0.0, "decision": 0.0}
    )

    def lap(self, step: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[step] += now - since
        return now


class Detector:
    """A gated service's handler; one per worker, shared by every partition lane."""

    def __init__(
        self,
        service: str,
        rules: Rules,
        client: DependencyClient,
        min_average: MinAverage = Decimal(0),
        loop_hops: int = LOOP_HOPS,
        freshness_wait: float = 2.0,
        batch_rules: BatchRules | None = None,
        derived: Mapping[str, str] | None = None,
    ) -> None:
        self.service = service
        #: Per dependency (relations, aggregates) that reads a topic derived from payments, its group: its
        #: answers' `as_of` are offsets on that topic, checked against the group's offsets the admitting
        #: reading mapped (`Admission.derived`).
        self.derived = dict(derived or {})
        self.rules = rules
        self.batch_rules = batch_rules  # when None, `rules` one payment at a time
        self.client = client
        self.min_average = min_average  # what a heavy edge is, for B's layering parts
        self.loop_hops = loop_hops  # the longest cycle B looks for
        self.freshness_wait = freshness_wait  # how long B and C may wait for their stores, per question
        self.stats = DetectorStats()
        #: Alerts handed to the producer and not acknowledged yet, by payment id.
        self.unsettled: dict[str, SentAlert] = {}
        #: Alerts partitions where a send failed: read back before the next alert goes there.
        self.in_doubt: dict[int, Doubt] = {}
        #: Alerts partition -> the offset after the last alert the broker acknowledged here.
        self.read_from: dict[int, int] = {}
        #: (partition, start, timeout) -> the records of the alerts topic's partition from start to its end.
        self.read_back = read_back

    async def __call__(self, items: list[tuple[Payment, Admission]]) -> LeftToComplete:
        """Decide a batch of admitted payments of one partition; return the broker's acknowledgement of
        their alerts and decisions, which the lane waits for before acking them."""
        started = time.perf_counter()
        evidence = await self.fresh_evidence(items)
        started = self.stats.lap("evidence", started)
        parsed: list[Evidence] = []
        for (payment, _), (answers, _) in zip(items, evidence, strict=True):
            payer_aggregates, payee_aggregates, payer_relations, payee_relations = answers
            parsed.append(
                Evidence.parse(
                    payment_id=payment.payment_id,
                    payer=payment.payer,
                    payee=payment.payee,
                    amount=Decimal(payment.amount),
                    currency=payment.currency,
                    ts=payment.ts,
                    payer_aggregates=payer_aggregates,
                    payee_aggregates=payee_aggregates,
                    payer_relations=payer_relations,
                    payee_relations=payee_relations,
                    channel=payment.channel,
                )
            )
        # The service's rules over the whole batch at once.
        decided = [
            (payment, admission, hits, answers, stale_reads)
            for (payment, admission), (answers, stale_reads), hits in zip(
                items, evidence, self.run_rules(parsed), strict=True
            )
        ]
        decided_at = datetime.now(UTC).isoformat(timespec="microseconds")
        started = self.stats.lap("rules", started)
        await items[0][1].still_ours()  # a lane's batch: its partition may be another worker's by now
        alerts = await self.send_alerts([(p, a, hits) for p, a, hits, _, _ in decided if hits], decided_at)
        sent = {alert.payment_id for alert in alerts}
        standing: dict[str, Mapping[str, Any]] = {}
        for payment, admission, *_ in decided:
            if payment.payment_id not in sent and (earlier := await self.standing_alert(payment, admission)):
                standing[payment.payment_id] = earlier
        started = self.stats.lap("alert", started)
        await items[0][1].still_ours()  # the alerts may have waited for earlier ones (`settle`, `read_back`)
        sends = []
        for payment, admission, hits, answers, stale_reads in decided:
            decision = self.decision(
                payment, admission, hits, answers, stale_reads, decided_at, standing.get(payment.payment_id)
            )
            sends.append(await send_decision(payment.payment_id, decision))
        self.stats.lap("decision", started)
        # The payments are acked (and later committed) only after the broker has every alert and every
        # decision; the lane goes on with its next batch meanwhile. A decision counts once the broker has it.
        return asyncio.ensure_future(self.acknowledged(alerts, sends))

    def run_rules(self, facts: list[Evidence]) -> list[list[Hit]]:
        """Each payment's hits: the service's batch rules over the whole batch, else its rules per payment."""
        if self.batch_rules is not None:
            return self.batch_rules(facts)
        return [self.rules(one) for one in facts]

    def decision(
        self,
        payment: Payment,
        admission: Admission,
        hits: list[Hit],
        answers: list[dict],
        stale_reads: int,
        decided_at: str,
        standing: Mapping[str, Any] | None = None,
    ) -> bytes:
        """The decision record's JSON (the fields of `aml_app.models.Decision`). A payment whose alert an
        earlier handling sent is decided as that alert says, whatever the rules say now: the decision and the
        alert an analyst reads never disagree."""
        fresh = all(self.includes(name, a, admission) for name, a in zip(ANSWERS, answers, strict=True))
        exact = all(answer.get("exact", True) for answer in answers)
        if not exact:
            self.stats.decided_on_pruned += 1
        loop_complete = all((answer.get("loop") or {}).get("complete", True) for answer in answers)
        if not loop_complete:
            self.stats.decided_on_incomplete_loop += 1
        return decision_json(
            payment_id=payment.payment_id,
            partition=admission.partition,
            offset=admission.offset,
            service=self.service,
            verdict="alert" if hits or standing else "clear",
            rules=[hit.rule for hit in hits]
            if standing is None
            else [hit["rule"] for hit in standing["hits"]],
            typologies=sorted({hit.typology for hit in hits}) if standing is None else standing["typologies"],
            note=note(admission, fresh, exact, loop_complete),
            watermark=admission.watermark,
            dependencies=admission.dependencies,
            waited_ms=admission.waited_ms,
            decided_at=decided_at,
            worker=settings.worker_id,
            gated=admission.gated,
            cut=admission.cut,
            stale=admission.stale is not None,
            fresh=fresh,
            stale_reads=stale_reads,
            # At the payment's partition; null for a dependency reading a derived topic, whose `as_of`
            # is of that topic's partitions.
            evidence_as_of={
                name: None
                if name.split()[-1] in self.derived
                else int(answer.get("as_of", {}).get(str(admission.partition), 0))
                for name, answer in zip(ANSWERS, answers, strict=True)
            },
        )

    async def fresh_evidence(self, items: list[tuple[Payment, Admission]]) -> list[tuple[list[dict], int]]:
        """For each payment: B's and C's answers about it, and how many rounds of them were stale.

        One POST to B and one to C for the whole batch. A payment whose answers do not include it is a
        freshness violation: with the gate on it is asked about again (alone with the other stale ones)
        until they do; with the gate off its stale answers are kept. A dependency that is away or not
        there yet is asked again too; after EVIDENCE_WAIT the batch fails with the last reason.
        """
        results: dict[int, tuple[list[dict], int]] = {}
        stale_reads = dict.fromkeys(range(len(items)), 0)
        todo = list(range(len(items)))
        unavailable, stale_wait = Backoff(*UNAVAILABLE_DELAYS), Backoff(*STALE_DELAYS)
        give_up_at = time.monotonic() + EVIDENCE_WAIT

        def patience(exc: Exception) -> float:
            """Seconds this attempt may still wait before asking again, or raise `exc`: it has waited
            EVIDENCE_WAIT, and the batch's failure is the lane's to retry, show and park."""
            left = give_up_at - time.monotonic()
            if left <= 0:
                raise exc
            return left

        while todo:
            items[0][1].go_on()  # a lane's batch; a stopped lane waits out no outage for its successor
            questions = [
                (items[i][0].payer, items[i][0].payee, datetime.fromisoformat(items[i][0].ts).astimezone(UTC))
                for i in todo
            ]
            try:
                asked = [items[i] for i in todo]
                answers = await evidence_for(
                    self.client,
                    questions,
                    self.min_average,
                    self.loop_hops,
                    self.need(asked),
                    items[0][1].partition,  # a lane's batch is of one partition
                    needs={
                        dependency: self.derived_need(asked, group)
                        for dependency, group in self.derived.items()
                    },
                )
            except NotYet as exc:  # B or C has not applied these payments yet: ask again shortly
                self.stats.freshness_violations += len(todo)
                for i in todo:
                    stale_reads[i] += 1
                log.warning("%d payment(s) wait for their dependencies: %s", len(todo), exc)
                await stale_wait.sleep(patience(exc))
                continue
            except DependencyUnavailable as exc:
                self.stats.unavailable += 1
                first = items[todo[0]][1]
                log.warning(
                    "%d payment(s) from %d:%d wait: %s", len(todo), first.partition, first.offset, exc
                )
                await unavailable.sleep(patience(exc))
                continue
            again = []
            for i, four in zip(todo, answers, strict=True):
                admission = items[i][1]
                stale = [n for n, a in zip(ANSWERS, four, strict=True) if not self.includes(n, a, admission)]
                if stale:
                    stale_reads[i] += 1
                    self.stats.freshness_violations += 1
                if stale and admission.wants_fresh:
                    other = sorted({str(a.get("log")) for a in four if a.get("log") != admission.log})
                    log.warning(
                        "freshness violation: %s about payment %s at %d:%d lacks it%s; asking again",
                        ", ".join(stale),
                        items[i][0].payment_id,
                        admission.partition,
                        admission.offset,
                        f" (answered from log {', '.join(other)}, not {admission.log})"
                        if admission.log is not None and other
                        else "",
                    )
                    again.append(i)
                    continue
                if stale:
                    self.stats.decided_not_fresh += 1
                results[i] = (list(four), stale_reads[i])
            todo = again
            if todo:
                first = items[todo[0]][1]
                lacking = NotYet(
                    f"the answers about {len(todo)} payment(s) from {first.partition}:{first.offset} "
                    f"still lack them after {EVIDENCE_WAIT:g} s"
                )
                await stale_wait.sleep(patience(lacking))
        return [results[i] for i in range(len(items))]

    def includes(self, answer_name: str, answer: Mapping[str, Any], admission: Admission) -> bool:
        """Whether an answer (one of ANSWERS) proves it includes the admitted payment: past its offset, of
        its log, and at or past every partition's W(q) of the event-time cut it was admitted at (what the
        question needed: a replica that answered short of it proves nothing); for a dependency reading a
        derived topic, at or past the group's offsets there that the admitting reading mapped (none
        recorded: not proved)."""
        group = self.derived.get(answer_name.split()[-1])
        if group is None:
            return includes(answer, admission.partition, admission.offset, admission.log) and covers_cut(
                answer, admission.cut
            )
        needed = admission.derived.get(group)
        if needed is None:
            return False
        as_of = answer.get("as_of", {})
        return all(int(as_of.get(str(d), 0)) >= o for d, o in needed.items())

    def derived_need(self, items: list[tuple[Payment, Admission]], group: str) -> Need | None:
        """What the answers of `group` (reading a derived topic) must include for the gated payments: its
        offsets on that topic, the highest any admission's reading mapped (of any log of that topic)."""
        as_of: dict[int, int] = {}
        gated = [admission for _, admission in items if admission.wants_fresh]
        for admission in gated:
            for d, o in admission.derived.get(group, {}).items():
                as_of[d] = max(as_of.get(d, 0), o)
        return Need(as_of, None, self.freshness_wait) if gated else None

    def need(self, items: list[tuple[Payment, Admission]]) -> Need | None:
        """What B's and C's answers must include: the next offset past each gated payment, and with the
        event-time gate every partition's W(q) of the cut it was admitted at, of its log.
        An ungated service (the comparison mode) reads what is there, as an ungated consumer would."""
        gated = [admission for _, admission in items if admission.wants_fresh]
        if not gated:
            return None
        as_of: dict[int, int] = {}
        for admission in gated:
            as_of[admission.partition] = max(as_of.get(admission.partition, 0), admission.offset + 1)
            # The event-time gate decided on every partition's evidence up to its cut: a replica must
            # have that too.
            for q, w in ((admission.cut or {}).get("watermarks") or {}).items():
                as_of[int(q)] = max(as_of.get(int(q), 0), w)
        logs = {admission.log for admission in gated}
        return Need(as_of, logs.pop() if len(logs) == 1 else None, self.freshness_wait)

    async def acknowledged(self, alerts: list[SentAlert], sends: list[Awaitable[Any]]) -> list[Any]:
        """The broker's acknowledgements of a batch's alerts (then remembered) and decisions, the
        decisions counted once all are in."""
        await self.remember_alerts(alerts)
        acks = await asyncio.gather(*sends)
        self.stats.decisions += len(acks)
        return acks

    async def send_alerts(
        self, flagged: list[tuple[Payment, Admission, list[Hit]]], decided_at: str
    ) -> list[SentAlert]:
        """Send the alerts of a batch's flagged payments, except those alerted on before (a re-processing);
        `remember_alerts` awaits their acknowledgements."""
        sent = []
        for payment, admission, hits in flagged:
            if await self.alerted_before(payment.payment_id, admission.partition):
                self.stats.duplicates_suppressed += 1
                self.note_reuse(payment, admission)
                continue
            # `alerted_before` may have waited (for an earlier alert, a read-back): the partition may be
            # another worker's by now, which alerts on the payment itself.
            await admission.still_ours()
            alert = Alert(
                payment_id=payment.payment_id,
                partition=admission.partition,
                offset=admission.offset,
                service=self.service,
                payer=payment.payer,
                payee=payment.payee,
                amount=payment.amount,
                currency=payment.currency,
                ts=payment.ts,
                typologies=sorted({hit.typology for hit in hits}),
                hits=[hit.as_json() for hit in hits],
                decided_at=decided_at,
                worker=settings.worker_id,
                score=max((hit.score for hit in hits if hit.score is not None), default=None),
            )
            # Claimed before the send, which awaits: another handling of the payment waits for this one.
            claim: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            floor = self.read_from.get(admission.partition)
            entry = SentAlert(payment.payment_id, alert, claim, admission.partition, floor)
            self.unsettled[payment.payment_id] = entry
            try:
                # The alert, on the payment's own partition, is also `alerts-sent`'s changelog entry (see
                # tables/alerts.py): once the broker has it, a replacement recovers it; nothing else is
                # written.
                ack = await alerts_topic.send(
                    key=payment.payment_id, value=alert, partition=admission.partition
                )
            except BaseException as exc:  # not handed to the producer: nothing of it can reach the broker
                if self.unsettled.get(payment.payment_id) is entry:
                    del self.unsettled[payment.payment_id]
                claim.set_exception(exc if isinstance(exc, Exception) else RuntimeError("send cancelled"))
                claim.exception()  # retrieved: a claim nobody waits for logs nothing
                raise
            asyncio.ensure_future(ack).add_done_callback(functools.partial(_settle_claim, claim))
            sent.append(entry)
        return sent

    def note_reuse(self, payment: Payment, admission: Admission) -> None:
        """Say which payment an alert was suppressed for. A payment id names one payment (docs/contract.md):
        an alert on the same id for other parties, amount or time is another payment's, whose producer
        reused the id, and the alert that payment deserves is not sent: a warning, and `ids_reused`."""
        stored = alerts_sent.get(alert_key(payment.payment_id))
        if not isinstance(stored, dict) or alerted_on(stored, payment):
            log.info("payment %s was alerted on before: not alerting again", payment.payment_id)
            return
        self.stats.ids_reused += 1
        log.warning(
            "payment id %r of %d:%d was alerted on before for another payment "
            "(%s:%s: %s -> %s, %s %s at %s): payment ids must be unique; this one is not alerted on",
            payment.payment_id,
            admission.partition,
            admission.offset,
            *(stored.get(field) for field in ("partition", "offset", *PAYMENT_FIELDS)),
        )

    async def standing_alert(self, payment: Payment, admission: Admission) -> Mapping[str, Any] | None:
        """The alert an earlier handling of this payment sent (the batch handled again after a failure or
        by the partition's next owner, whose evidence can differ), or None. An alert of another payment
        that reused the id is not this payment's (`note_reuse`)."""
        if payment.payment_id in self.unsettled or admission.partition in self.in_doubt:
            await self.alerted_before(payment.payment_id, admission.partition)
        stored = alerts_sent.get(alert_key(payment.payment_id))
        return stored if isinstance(stored, dict) and alerted_on(stored, payment) else None

    async def alerted_before(self, payment_id: str, partition: int) -> bool:
        """Whether the broker has this payment's alert: remembered, or sent by an earlier handling whose
        acknowledgement is awaited now, or found by reading the partition back after a failed send.

        Returns False only while no other handling of the payment has its alert in flight, with no await
        since that check: the caller's claim (`send_alerts`) follows at once, so two handlings of one
        payment at the same time (the same batch handled again while its first handling still runs)
        cannot both send."""
        while (earlier := self.unsettled.get(payment_id)) is not None:
            await self.settle(earlier, payment_id, partition)
        doubt = self.in_doubt.get(partition)
        if alerts_sent.get(alert_key(payment_id)) is None and doubt is not None:
            marks = doubt.marks
            start = applied_to(partition) if doubt.start is None else doubt.start
            for key, value in await self.read_back(partition, start, ALERT_SETTLE_WAIT):
                if key is not None and value is not None:
                    alerts_sent.data[key] = json.loads(value)
            # A send that failed during the read may have been written after the end it read to.
            if self.in_doubt.get(partition) is doubt and doubt.marks == marks:
                del self.in_doubt[partition]
            if payment_id in self.unsettled:  # claimed by another handling meanwhile
                return await self.alerted_before(payment_id, partition)
        return alerts_sent.get(alert_key(payment_id)) is not None

    async def settle(self, earlier: SentAlert, payment_id: str, partition: int) -> None:
        """Wait for the outcome of an alert in flight: remembered once acknowledged, its partition in doubt
        if the send failed; either way no longer in flight."""
        try:
            await within(asyncio.shield(earlier.ack), ALERT_SETTLE_WAIT, f"the alert of {payment_id}")
        except DeadlineExceeded:
            raise  # still unknown: this batch fails and is handled again later, never sent twice
        except Exception:  # failed or cancelled (`CancelledWithin`): the broker may have it all the same
            self.doubt(earlier)
        else:
            self.remember(earlier)
        finally:
            if self.unsettled.get(payment_id) is earlier and earlier.ack.done():
                del self.unsettled[payment_id]

    async def remember_alerts(self, alerts: list[SentAlert]) -> None:
        """Remember every alert the broker acknowledged, even when another one failed; then raise that
        failure, so that the batch is handled again and sends only what was not remembered."""
        acks = await asyncio.gather(*(a.ack for a in alerts), return_exceptions=True)
        failure = None
        for alert, ack in zip(alerts, acks, strict=True):
            if self.unsettled.get(alert.payment_id) is alert:
                del self.unsettled[alert.payment_id]
            if isinstance(ack, BaseException):
                failure = failure or ack
                self.doubt(alert)
                continue
            self.remember(alert)
            offset = getattr(ack, "offset", None)
            if isinstance(offset, int):
                self.read_from[alert.partition] = max(self.read_from.get(alert.partition, 0), offset + 1)
            self.stats.alerts += 1
        if failure is not None:
            raise failure

    def doubt(self, alert: SentAlert) -> None:
        """The alert's send failed: its partition is read back, from where the alert can be, before the
        next alert goes there (an alert acknowledged after it, at a higher offset, moves nothing)."""
        doubt = self.in_doubt.get(alert.partition)
        if doubt is None:
            self.in_doubt[alert.partition] = Doubt(alert.floor)
        else:
            doubt.add(alert.floor)

    def remember(self, alert: SentAlert) -> None:
        """The local store only: a table write would send a second record."""
        alerts_sent.data[alert_key(alert.payment_id)] = alert.alert.asdict()


def alerted_on(alert: Mapping[str, Any], payment: Payment) -> bool:
    """Whether a stored alert is of this payment, field by field, not of another that reused its id."""
    return all(str(alert.get(field)) == str(getattr(payment, field)) for field in PAYMENT_FIELDS)


def covers_cut(answer: Mapping[str, Any], cut: Mapping[str, Any] | None) -> bool:
    """Whether an answer's `as_of` reaches every partition's W(q) of an event-time cut (None: no cut):
    the evidence of every payment up to the admitted one's time, which the event-time gate waited for."""
    watermarks = (cut or {}).get("watermarks") or {}
    as_of = answer.get("as_of", {})
    return all(int(as_of.get(str(q), 0)) >= int(w) for q, w in watermarks.items())


def _settle_claim(claim: asyncio.Future[Any], done: asyncio.Future[Any]) -> None:
    """Give an alert's claim the outcome of its send."""
    if claim.done():
        return
    if done.cancelled():
        claim.cancel()
    elif (exc := done.exception()) is not None:
        claim.set_exception(exc)
    else:
        claim.set_result(done.result())


def stats_json(detector: Detector) -> dict[str, Any]:
    s, c = detector.stats, detector.client.stats
    return {
        "service": detector.service,
        "decisions": s.decisions,
        "alerts": s.alerts,
        "duplicates_suppressed": s.duplicates_suppressed,
        "ids_reused": s.ids_reused,
        "freshness_violations": s.freshness_violations,
        "decided_not_fresh": s.decided_not_fresh,
        "decided_on_pruned": s.decided_on_pruned,
        "decided_on_incomplete_loop": s.decided_on_incomplete_loop,
        "dependency_unavailable": s.unavailable,
        "dependency_not_yet": c.not_yet,
        "dependency_went_back": c.went_back,
        "seconds": {step: round(value, 3) for step, value in s.seconds.items()},
        "http": {
            "requests": c.requests,
            "failures": c.failures,
            "mean_ms": round(1000 * c.seconds / c.requests, 3) if c.requests else None,
            "last_error": c.last_error,
        },
    }


def detecting_service(
    worker_gate: WorkerGate, service: str, rules: Rules, batch_rules: BatchRules | None = None
) -> tuple[GatedConsumer, Detector]:
    """Build the detector of this worker's service and register its gated agent, gated by `worker_gate`.
    `batch_rules`, when given, decides a batch at once and must give each payment what `rules` gives it."""
    from aml_app.worker.agent import gated_agent

    client = DependencyClient(
        settings.relations_urls,
        settings.aggregates_urls,
        settings.dependencies.http_timeout,
        token=settings.dependencies.api_token,
    )
    thresholds = settings.detection.aml_thresholds
    heavy = thresholds.rates.in_each(thresholds.graph_min_average)  # the same sum in every currency
    derived = {
        name: group
        for name in dependency_registry.NAMES
        if (group := dependency_registry.service(name).group(settings)) in settings.derived_dependencies
    }
    detector = Detector(
        service,
        rules,
        client,
        heavy,
        thresholds.cycle_max_hops,
        settings.dependencies.freshness_wait,
        batch_rules,
        derived,
    )
    gated = gated_agent(worker_gate, batch_handler=detector, max_batch=settings.detection.max_batch)

    # mode types a signal's receivers so that no function matches them (not even `def f(*a, **k)`).
    @app.on_before_shutdown.connect  # type: ignore[arg-type]
    async def close_client(app: Any, **kwargs: Any) -> None:
        await client.close()

    return gated, detector
