"""aiokafka's line for every hand assignment stays out of a worker's log; its other records do not."""

from __future__ import annotations

import inspect
import logging

import pytest
from aiokafka.consumer import subscription_state
from aiokafka.structs import TopicPartition

from aml_app.kafka.quiet import (
    ASSIGNMENT_LOGGER,
    UPDATING_SUBSCRIPTION,
    HandAssignments,
    quiet_hand_assignments,
)


@pytest.fixture
def subscription_logger():
    """aiokafka's subscription logger without filters, its own restored after the test."""
    logger = logging.getLogger(ASSIGNMENT_LOGGER)
    filters = list(logger.filters)
    for f in filters:
        logger.removeFilter(f)
    yield logger
    for f in list(logger.filters):
        logger.removeFilter(f)
    for f in filters:
        logger.addFilter(f)


def assign(partitions: int) -> None:
    """What a reader's `consumer.assign` runs: aiokafka's own subscription state (made in a running loop),
    which logs."""
    subscription_state.SubscriptionState().assign_from_user(
        {TopicPartition("payments", p) for p in range(partitions)}
    )


def test_the_filtered_text_is_still_aiokafkas():
    assert subscription_state.log.name == ASSIGNMENT_LOGGER
    assert f'"{UPDATING_SUBSCRIPTION}"' in inspect.getsource(subscription_state.SubscriptionState)


async def test_a_hand_assignment_logs_nothing_once_quieted(subscription_logger, caplog):
    caplog.set_level(logging.INFO, logger=ASSIGNMENT_LOGGER)
    assign(4)
    assert [r.msg for r in caplog.records] == [UPDATING_SUBSCRIPTION]  # aiokafka logs it unquieted
    caplog.clear()
    quiet_hand_assignments()
    quiet_hand_assignments()
    assign(4)
    assign(2)
    assert caplog.records == []
    assert sum(isinstance(f, HandAssignments) for f in subscription_logger.filters) == 1


def test_other_records_of_the_logger_pass(subscription_logger, caplog):
    caplog.set_level(logging.INFO, logger=ASSIGNMENT_LOGGER)
    quiet_hand_assignments()
    subscription_logger.warning("something else about %s", "payments")
    assert [r.getMessage() for r in caplog.records] == ["something else about payments"]
