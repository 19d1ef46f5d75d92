"""`alerts-sent`: the payments this service has already alerted on, so a re-processed payment (after a
crash or a rebalance) never emits its alert twice.

A partitioned table on the RocksDB store (`rocksdb://`, rocksdict), co-partitioned with the payments
topic: the worker that owns payments partition p owns table partition p, recovered from its changelog
before the partition's first payment is processed. Keyed by payment id; the value records when and by
whom the alert was sent.
"""

from __future__ import annotations

import faust

from aml_app.app import app, settings

alerts_sent = app.Table(
    "alerts-sent",
    default=None,
    partitions=settings.partitions,
    schema=faust.Schema(key_type=str, key_serializer="json", value_serializer="json"),
    help="Payment id -> the alert already sent for it (dedupe across re-processing).",
)
