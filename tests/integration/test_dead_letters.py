"""Malformed payments go to the dead-letter topic with their reason and original bytes; the rest flow."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from aml_app.contract import SET_ASIDE_PART_BYTES
from aml_app.harness.verify import CommitTimeline, premature
from aml_app.kafka.tools import payment_json, produce
from tests.harness import TopicReader, ends_of, read_records, wait_until

pytestmark = pytest.mark.integration

GOOD = {
    "payment_id": "x",
    "payer": "acct-1",
    "payee": "acct-2",
    "amount": "5.00",
    "currency": "EUR",
    "ts": "2026-11-20T10:15:00Z",
}


#: A malformed record's own headers and time (a day before the test's other records).
TRACED = [("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), ("origin", b"core")]
SENT_AT = 1_763_634_600_123


def bad(**changes) -> bytes:
    doc = {**GOOD, **changes}
    return json.dumps({k: v for k, v in doc.items() if v is not None}).encode()


# (key, value, expected substring of the reason)
MALFORMED = [
    (b"acct-1", b"{not json", "not JSON"),
    (b"acct-1", bad(payee=None), "missing field(s): payee"),
    (b"acct-1", bad(amount=5), "must be a decimal string"),
    (b"acct-1", bad(amount="-3.00"), "greater than zero"),
    (b"acct-1", bad(currency="XXQ"), "ISO 4217"),
    (b"acct-1", bad(ts="yesterday"), "RFC 3339"),
    (b"acct-1", b'{"payload": "' + b"A" * 200_000 + b'"}', "over the limit"),
    (b"acct-1", os.urandom(64) + b"\xff\xfe", "not UTF-8"),
    (None, payment_json("nokey", "acct-1", "acct-2", "5.00", "2026-11-20T10:15:00Z"), "key is missing"),
    (b"acct-1", b"[1, 2, 3]", "must be a JSON object"),
    (b"acct-1", bad(payee="acct-\x00"), "field 'payee' holds a NUL character"),
]


async def test_each_malformed_payment_is_dead_lettered_and_the_rest_decided(
    broker, names, producer, new_worker, deps, decision_log
):
    records = []
    for i, (key, value, _) in enumerate(MALFORMED):
        records.append((0, key, value))
        good = payment_json(f"good-{i}", "acct-1", "acct-2", "1.00", "2026-11-20T10:15:00Z")
        records.append((0, b"acct-1", good))
    placed = await produce(producer, names.payments, records)
    # One more, as a producer with tracing writes it: its headers and time go with its dead letter.
    traced = await (
        await producer.send(
            names.payments, key=b"acct-1", value=b"{traced", partition=0, headers=TRACED, timestamp_ms=SENT_AT
        )
    )
    placed.append((traced.partition, traced.offset))
    worker = new_worker()
    await worker.wait_ready(set(range(names.partitions)))
    timeline = CommitTimeline()
    await timeline.commit(deps, {p: ends_of(placed).get(p, 0) for p in range(names.partitions)})

    good_placed = {placed[i] for i in range(1, len(records), 2)}
    await decision_log.wait_for(good_placed, timeout=30)
    assert decision_log.decided() == good_placed
    assert premature(decision_log.decisions(), names.deps, timeline) == []

    dlq = await TopicReader(broker.bootstrap, names.dlq, names.partitions).start()
    try:

        async def all_dead_lettered() -> bool:
            await dlq.poll(0.2)
            return len(dlq.records) >= len(MALFORMED)

        await wait_until(all_dead_lettered, 30, "every malformed payment in the DLQ", interval=0)
        assert len(dlq.records) == len(MALFORMED) + 1
        by_offset = {int(dict(r.headers)["dlq.offset"]): r for r in dlq.records}
        letter = by_offset[traced.offset]
        assert letter.timestamp == SENT_AT, "the original record's time"
        assert list(letter.headers[: len(TRACED)]) == TRACED, "the original headers first, in order"
        assert dict(letter.headers)["dlq.reason"].startswith(b"value is not JSON")
        for i, (key, value, reason) in enumerate(MALFORMED):
            partition, offset = placed[2 * i]
            record = by_offset[offset]
            headers = {k: v.decode() for k, v in record.headers}
            assert reason in headers["dlq.reason"], (reason, headers["dlq.reason"])
            assert record.value == value, "the original bytes, unchanged"
            assert record.key == key
            assert headers["dlq.partition"] == str(partition)
            assert headers["dlq.topic"] == names.payments
    finally:
        await dlq.stop()
    state = await worker.state()
    assert state["dead_lettered"] == len(MALFORMED) + 1


async def test_a_payment_too_large_for_one_record_is_dead_lettered_in_parts_and_the_rest_decided(
    broker, names, producer, new_worker, deps, decision_log
):
    """1.5 MB: larger than the worker's producer sends at once (1 MB by default). Sent whole, the dead
    letter is refused for ever and holds its partition."""
    huge = b'{"payload": "' + os.urandom(750_000).hex().encode() + b'"}'
    good = payment_json("after-huge", "acct-1", "acct-2", "1.00", "2026-11-20T10:15:00Z")
    placed = await produce(producer, names.payments, [(0, b"acct-1", huge), (0, b"acct-1", good)])
    worker = new_worker()
    await CommitTimeline().commit(deps, {p: ends_of(placed).get(p, 0) for p in range(names.partitions)})
    await decision_log.wait_for({placed[1]}, timeout=60)
    dlq = await TopicReader(broker.bootstrap, names.dlq, names.partitions).start()
    try:

        async def whole() -> list | None:
            await dlq.poll(0.2)
            return dlq.records if sum(len(r.value) for r in dlq.records) >= len(huge) else None

        parts = await wait_until(whole, 30, "every part of the dead letter", interval=0)
    finally:
        await dlq.stop()
    headers = [{k: v.decode() for k, v in r.headers} for r in parts]
    order = sorted(range(len(parts)), key=lambda i: int(headers[i]["dlq.part"].split("/")[0]))
    assert [headers[i]["dlq.part"] for i in order] == [f"{n}/3" for n in (1, 2, 3)]
    assert b"".join(parts[i].value for i in order) == huge, "the original bytes, in parts"
    assert {(h["dlq.offset"], h["dlq.bytes"]) for h in headers} == {(str(placed[0][1]), str(len(huge)))}
    assert all("over the limit" in h["dlq.reason"] for h in headers)
    assert (await worker.state())["dead_lettered"] == 1


async def test_the_pipeline_dead_letters_more_records_than_its_producer_queues_at_once(broker, names):
    """librdkafka's producer queues `queue.buffering.max.messages` records (100,000 by default) and
    raises BufferError past them; a batch of more dead letters must wait for room, not fail at every
    restart. Here the queue holds 5."""
    from aml_app.pipeline.progress import DeadLetters, Rejected

    config = {"bootstrap.servers": broker.bootstrap, "queue.buffering.max.messages": 5, "linger.ms": 50}
    dead_letters = DeadLetters(config, names.dlq, names.payments, "relations")
    # Each keeps its record's time and, read from a derived topic, the payment it names.
    records = [
        Rejected(
            0,
            n,
            b"acct-1",
            b"{not json %d" % n,
            "value is not JSON",
            SENT_AT + n,
            f"3:{n}" if n % 2 else None,
        )
        for n in range(40)
    ]
    try:
        assert dead_letters.send(records) == 40
    finally:
        dead_letters.close()
    found = await read_records(broker.bootstrap, names.dlq, names.partitions, 40)
    assert sorted(int(dict(r.headers)["dlq.offset"]) for r in found) == list(range(40))
    for record in found:
        n = int(dict(record.headers)["dlq.offset"])
        assert record.timestamp == SENT_AT + n
        assert dict(record.headers).get("aml-source") == (f"3:{n}".encode() if n % 2 else None)


async def test_a_record_whose_key_and_value_are_too_large_together_is_dead_lettered_in_parts(broker, names):
    """Every part carries the record's key: a key of 500 KB beside a value part of 512 KiB is larger
    than the producer sends (1,000,000 bytes), refused at every restart. The parts leave room for it."""
    key, value = b"k" * 500_000, os.urandom(600_000)
    parts = -(-len(value) // (SET_ASIDE_PART_BYTES - len(key)))  # 25
    found, headers, joined = await _dead_lettered_in_parts(broker, names, key, value, parts)
    assert joined == value and {r.key for r in found} == {key}
    assert {h["dlq.bytes"] for h in headers} == {str(len(value))}


async def test_a_record_whose_key_alone_fills_a_record_is_dead_lettered_with_its_key_in_the_value(
    broker, names
):
    """A key of about 1 MB leaves no room for a part of any size beside it: the producer refuses every
    record that carries it with 4 KiB of the value (MSG_SIZE_TOO_LARGE), at every restart. The key goes
    at the front of the value, which then takes three parts."""
    key, value = os.urandom(999_000), os.urandom(50_000)
    found, headers, joined = await _dead_lettered_in_parts(broker, names, key, value, 3)
    assert len({r.partition for r in found}) == 1, "the parts share one partition"
    cut = int(headers[0]["dlq.key-bytes"])
    assert (joined[:cut], joined[cut:]) == (key, value)


async def _dead_lettered_in_parts(
    broker: Any, names: Any, key: bytes, value: bytes, parts: int
) -> tuple[list, list[dict[str, str]], bytes]:
    """Dead-letter one record with the pipeline's `DeadLetters` and read back its `parts` parts: the
    records, their headers and their values joined in part order."""
    from aml_app.pipeline.progress import DeadLetters, Rejected

    dead_letters = DeadLetters(
        {"bootstrap.servers": broker.bootstrap}, names.dlq, names.payments, "relations"
    )
    try:
        assert dead_letters.send([Rejected(1, 7, key, value, "too large")]) == 1
    finally:
        dead_letters.close()
    found = await read_records(broker.bootstrap, names.dlq, names.partitions, parts)
    assert len(found) == parts
    headers = [{k: v.decode() for k, v in r.headers} for r in found]
    order = sorted(range(len(found)), key=lambda i: int(headers[i]["dlq.part"].split("/")[0]))
    return found, headers, b"".join(found[i].value for i in order)
