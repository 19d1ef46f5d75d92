"""`alerts-sent`: the payments this service has already alerted on, so a re-processed payment (after a
crash or a rebalance) never emits its alert twice.

The table's changelog IS the alerts topic (`<service>.alerts`): the alert record, sent to the payment's
own partition, is at the same time the table's entry for it. There is no second write, so no crash can
fall between "alerted" and "remembered" (the window an alert-then-changelog design has). The detector
sends the alert itself, awaiting the broker's acknowledgement, and then writes only the local RocksDB
store (`alerts_sent.data`), because a table write would send a second copy.

A partitioned table on the RocksDB store (`rocksdb://`, rocksdict), co-partitioned with the payments
topic: the worker that owns payments partition p owns table partition p, recovered from the alerts
topic's partition p before the partition's first payment is processed. Recovery reads to the end a
fetch reports (`aml_app.faust_internals.highwaters_from_fetches`), never to a ListOffsets answer alone.
Keyed by the payment id's UTF-8 bytes; the value is the alert.

Faust's check that a recovered store is not ahead of its changelog is off for the whole app (the
watermark table trips it routinely), so `check_store_against_changelog` keeps it for this table: a
store that has applied offsets its changelog does not hold (the topic was recreated, or the data
directory came from another cluster) would hide alerts of the new log, and stops the worker.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

from aiokafka import AIOKafkaConsumer, TopicPartition
from faust.tables.manager import TableManager
from faust.types import TP

from aml_app.app import alerts_topic, app, settings
from aml_app.kafka.deadlines import close_within, within
from aml_app.kafka.security import aiokafka_kwargs

log = logging.getLogger(__name__)

alerts_sent = app.Table(
    "alerts-sent",
    default=None,
    partitions=settings.kafka.partitions,
    # Faust encodes a table's keys by key type (bytes: raw, anything else: JSON), not by its schema; bytes
    # keys are the alerts topic's own key bytes (the payment id, UTF-8), so a recovered entry is found.
    key_type=bytes,
    changelog_topic=alerts_topic,
    help="Payment id (UTF-8 bytes) -> the alert sent for it; its changelog is the alerts topic itself.",
)


def alert_key(payment_id: str) -> bytes:
    """The table's key of a payment: the alerts topic's key bytes."""
    return payment_id.encode()


def copartitioning_problem() -> str | None:
    """The sentence that stops a worker whose payments and alerts topics differ in partition count (None
    when they agree, or before the consumer knows both).

    The alerts topic is the changelog of `alerts-sent`, partitioned like the payments: Faust assigns
    topics of different partition counts separately, so after partitions are added to one of them alone
    the worker deciding payments partition p need not hold `alerts-sent` partition p, and an alert on a
    new partition has nowhere to go. Nothing is processed under such an assignment.
    """
    payments = app.consumer.topic_partitions(settings.kafka.payments_topic)
    alerts = app.consumer.topic_partitions(settings.kafka.alerts_topic)
    if payments is None or alerts is None or payments == alerts:
        return None
    return (
        f"{settings.kafka.payments_topic} has {payments} partitions but {settings.kafka.alerts_topic} has "
        f"{alerts}: the alerts topic is the changelog of {alerts_sent.name} and needs as many, or an alert "
        f"could be sent twice; grow the smaller with `AML_PARTITIONS={max(payments, alerts)} aml-app topics "
        "--create --grow` and start the workers again"
    )


def applied_to(partition: int) -> int:
    """The offset after the last alerts record this worker's store of `partition` recovered (0: none)."""
    applied = alerts_sent.persisted_offset(TP(settings.kafka.alerts_topic, partition))
    return 0 if applied is None else applied + 1


async def read_back(partition: int, start: int, timeout: float) -> list[tuple[bytes | None, bytes | None]]:
    """Every record of the alerts topic's `partition` from offset `start` to its end (as a fetch reports
    it, not ListOffsets), read outside any group: what the broker holds after a send whose outcome this
    worker does not know. Raises TimeoutError (`DeadlineExceeded`) when it cannot read them in time."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=list(settings.kafka.bootstrap_servers),
        group_id=None,
        enable_auto_commit=False,
        client_id="aml-alerts-read-back",
        # A start that retention deleted: every alert left counts, not only those sent from now on.
        auto_offset_reset="earliest",
        **aiokafka_kwargs(settings.kafka.security),
    )
    deadline = time.monotonic() + timeout
    found: list[tuple[bytes | None, bytes | None]] = []
    try:
        await within(consumer.start(), timeout, "starting the alerts reader")
        tp = TopicPartition(settings.kafka.alerts_topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, start)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"reading {tp.topic}:{partition} from {start} took longer than {timeout:g} s"
                )
            batch = await consumer.getmany(tp, timeout_ms=int(min(left, 0.5) * 1000))
            found += [(r.key, r.value) for r in batch.get(tp, [])]
            end = consumer.highwater(tp)
            if end is not None and await within(consumer.position(tp), left, "the reader's position") >= end:
                return found
    finally:
        await close_within(consumer.stop(), timeout, "stopping the alerts reader")


class StoreAheadOfChangelog(RuntimeError):
    """The local `alerts-sent` store has applied offsets its changelog does not hold."""


def recovered_to() -> dict[int, dict[str, int | None]]:
    """Per alerts partition this worker owns: the offset after the last changelog record its store has
    applied (None: none) and the changelog's end as recovery read it (None: not read yet)."""
    # `recovery` is TableManager's; Faust types app.tables as TableManagerT, which lacks it.
    recovery = cast(TableManager, app.tables).recovery
    out = {}
    for tp in sorted(recovery.actives_for_table.get(alerts_sent, set())):
        applied = alerts_sent.persisted_offset(tp)
        last = recovery.active_highwaters.get(tp)
        out[tp.partition] = {
            "applied_to": None if applied is None else applied + 1,
            "log_end": None if last is None else last + 1,
        }
    return out


def store_ahead(tp: TP, applied: int | None, last: int | None) -> str | None:
    """The sentence an operator sees when the store has applied `applied`, past the changelog's `last`
    record (-1: empty), or None when they agree."""
    if applied is None or last is None or applied <= last:
        return None
    return (
        f"the {alerts_sent.name} store of {tp.topic} partition {tp.partition} has applied offset {applied}, "
        f"but that partition ends at {last + 1}: the store belongs to another log (the topic was recreated, "
        f"or the data directory {app.conf.datadir} comes from another cluster); move that directory away "
        f"and start the worker again to rebuild the store from the topic"
    )


# mode types a signal's receivers so that no function matches them (not even `def f(*a, **k)`).
@app.on_rebalance_complete.connect  # type: ignore[arg-type]
async def check_store_against_changelog(sender: Any, **kwargs: Any) -> None:
    """After each recovery, before any payment of the new assignment is processed.

    The end is read now, not taken from when recovery began: the previous owner of a partition may still
    have written alerts meanwhile, which recovery then applied (a store ahead of the end recovery read is
    routine then, which is why Faust's own check trips)."""
    tps = sorted(cast(TableManager, app.tables).recovery.actives_for_table.get(alerts_sent, set()))
    ends = await app.consumer.highwaters(*tps) if tps else {}
    for tp in tps:
        end = ends.get(tp)
        problem = store_ahead(tp, alerts_sent.persisted_offset(tp), None if end is None else end - 1)
        if problem is not None:
            log.error("%s", problem)
            error = StoreAheadOfChangelog(problem)
            app.add_future(app.crash(error))
            raise error  # and the recovery stops here: no payment of this assignment is processed
