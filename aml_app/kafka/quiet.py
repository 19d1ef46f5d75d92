"""aiokafka's INFO line for every hand assignment, left out of a worker's log.

The leader's event-time reader (`aml_app.gate.unapplied`), the log-end reader and the delivery check
assign partitions by hand for each read, and aiokafka logs every assignment at INFO ("Updating
subscribed topics to: ..."), which mode's formatter renders as a five-line table: 3,321 of the 3,521
lines of the AML leader's log in a 130 s run at 10 payments/s. Faust logs its own consumer's
subscription ("Subscribed to topic(s)"), so nothing an operator reads is lost.
"""

from __future__ import annotations

import logging

#: The only record `aiokafka.consumer.subscription_state` logs (`SubscriptionState._change_subscription`;
#: tests/unit/test_quiet_assignments.py checks the text is still aiokafka's).
ASSIGNMENT_LOGGER = "aiokafka.consumer.subscription_state"
UPDATING_SUBSCRIPTION = "Updating subscribed topics to: %s"


class HandAssignments(logging.Filter):
    """Drops aiokafka's "Updating subscribed topics" line; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != UPDATING_SUBSCRIPTION


def quiet_hand_assignments() -> None:
    """Install `HandAssignments` on aiokafka's subscription logger (once per process)."""
    logger = logging.getLogger(ASSIGNMENT_LOGGER)
    if not any(isinstance(f, HandAssignments) for f in logger.filters):
        logger.addFilter(HandAssignments())
