"""Faust's Kafka transport with one knob Faust does not expose: the consumer's fetch wait.

Faust hard-codes `fetch_max_wait_ms=1500` for its worker consumer. On Apache Kafka a fetch returns as
soon as data arrives, so that is only the idle wait; a broker that holds fetches for the full wait
(the embedded Tansu does) adds up to that much delay to every hop: the payment itself, and for a
follower worker the demand and watermark updates that travel through table changelogs. The gate's
latency is made of such hops, so the wait is a setting (`AML_FETCH_MAX_WAIT_MS`).
"""

from __future__ import annotations

from typing import Any

import aiokafka
from faust.transport.drivers import aiokafka as faust_aiokafka


def transport_with_fetch_wait(fetch_max_wait_ms: int) -> type[faust_aiokafka.Transport]:
    class TunedConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
        def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
            consumer = super()._create_worker_consumer(transport)
            # aiokafka reads this when the consumer starts, which is after this call.
            consumer._fetch_max_wait_ms = fetch_max_wait_ms
            return consumer

    class TunedConsumer(faust_aiokafka.Consumer):
        def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
            return TunedConsumerThread(self, loop=self.loop, beacon=self.beacon)

    class TunedTransport(faust_aiokafka.Transport):
        Consumer = TunedConsumer

    return TunedTransport
