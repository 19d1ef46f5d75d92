"""`alerts-sent`: the payments this service has already alerted on, so a re-processed payment (after a
crash or a rebalance) never emits its alert twice.

The table's changelog IS the alerts topic (`<service>.alerts`): the alert record, sent to the payment's
own partition, is at the same time the table's entry for it. There is no second write, so no crash can
fall between "alerted" and "remembered" (the window an alert-then-changelog design has). The detector
sends the alert itself, awaiting the broker's acknowledgement, and then writes only the local RocksDB
store (`alerts_sent.data`), because a table write would send a second copy.

A partitioned table on the RocksDB store (`rocksdb://`, rocksdict), co-partitioned with the payments
topic: the worker that owns payments partition p owns table partition p, recovered from the alerts
topic's partition p before the partition's first payment is processed. Keyed by the payment id's UTF-8
bytes; the value is the alert.
"""

from __future__ import annotations

from aml_app.app import alerts_topic, app, settings

alerts_sent = app.Table(
    "alerts-sent",
    default=None,
    partitions=settings.partitions,
    # Faust encodes a table's keys by key type (bytes: raw, anything else: JSON), not by its schema; bytes
    # keys are the alerts topic's own key bytes (the payment id, UTF-8), so a recovered entry is found.
    key_type=bytes,
    changelog_topic=alerts_topic,
    help="Payment id (UTF-8 bytes) -> the alert sent for it; its changelog is the alerts topic itself.",
)


def alert_key(payment_id: str) -> bytes:
    """The table's key of a payment: the alerts topic's key bytes."""
    return payment_id.encode()
