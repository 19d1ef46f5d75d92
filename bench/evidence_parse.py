"""A worker's price of reading a payment's evidence: decoding B's and C's answers and parsing them into
`Evidence`, per payment, against the same work at a git revision.

At 300 payments/s a detector worker spends about a fifth of its samples (py-spy) decoding the JSON of B's
and C's batch answers and parsing each payment's four answers into typed evidence. This benchmark times
that work alone, on answers shaped as the services send them: the simulator's traffic (`simulate`, seed
5: merchants that hundreds pay), fed to the replay's reference B and C (`aml_app.training.replay`), which
answer what the APIs answer with the gate on; the last `--decided` payments are asked about, their
answers (with `as_of` and `log`, as the APIs add them) in batch bodies of 50 payments, a lane's batch.

Per payment, CPU time (`time.process_time`), best of `--repeat` rounds (the garbage collector paused;
the parse's cache of amount texts emptied before each round, so a round is one pass over the stream):
- decoding the two batch bodies: `json.loads` (what aiohttp's `response.json` runs) and msgspec's
  decoder (what the dependency client runs);
- parsing the four answers: `Evidence.parse` as it stands, and `aml_app/detection/evidence.py` at
  `--against REV`, their rounds interleaved, with the median of their ratios; every payment's two
  parses are checked equal field by field;
- the answers alone, as `Evidence.parse` reads them (`from_json`: msgspec checks their shape) and field by
  field in Python (`checked`: what reads a malformed answer to say what is wrong);
- writing the two request bodies that ask about a batch, as the dependency client builds them
  (`evidence_for`, caught where the client sends them): `json.dumps` (what aiohttp's `json=` runs) and
  msgspec's encoder (what the client runs), the two checked to carry the same JSON.

    .venv/bin/python -m bench.evidence_parse [--decided 2000] [--repeat 5] [--against REV]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import json
import statistics
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import msgspec

from aml_app.dependencies.client import DependencyClient, Need, evidence_for
from aml_app.detection import evidence
from aml_app.detection.evidence import Aggregates, Evidence, Relations, parse_instant
from aml_app.detection.thresholds import AmlThresholds
from aml_app.simulation.traffic import simulate
from aml_app.training.replay import Services, row_of
from bench.common import finish, machine, markdown_table, module_at

NAME = "evidence_parse"
BATCH = 50  # payments a batch body answers: a lane's batch under load
AS_OF = {"0": 41_233, "1": 40_877, "2": 41_502, "3": 40_990}


def corpus(decided: int) -> list[tuple[list[dict[str, Any]], list[bytes]]]:
    """The asked payments, `BATCH` at a time: their fields, and the two bodies (C's, then B's) that
    answer them."""
    payments = sorted(
        simulate(5, decided * 3, 500.0, datetime(2026, 11, 30, tzinfo=UTC)).payments, key=lambda p: p.ts
    )
    services = Services(AmlThresholds())
    asked = []
    for i, payment in enumerate(payments):
        services.feed(payment)
        if i < len(payments) - decided:
            continue
        at = row_of(payment).ts
        stamp = {"as_of": AS_OF, "log": "bench-log"}
        asked.append(
            (
                payment,
                [{**services.aggregates(a, at), **stamp} for a in (payment.payer, payment.payee)],
                [
                    {**services.relations(payment.payer, at), **stamp},
                    {**services.payee_relations(payment.payee, payment.payer, at), **stamp},
                ],
            )
        )
    batches = []
    for start in range(0, len(asked), BATCH):
        part = asked[start : start + BATCH]
        fields = [
            {
                "payment_id": p.payment_id,
                "payer": p.payer,
                "payee": p.payee,
                "amount": Decimal(p.amount),
                "currency": p.currency,
                "ts": p.ts,
                "channel": getattr(p, "channel", None),
            }
            for p, _, _ in part
        ]
        bodies = [
            json.dumps({"answers": [answer for _, c, _ in part for answer in c]}).encode(),
            json.dumps({"answers": [answer for _, _, b in part for answer in b]}).encode(),
        ]
        batches.append((fields, bodies))
    return batches


class RequestBodies(DependencyClient):
    """A dependency client that sends nothing: it keeps each request body where the client would send it
    and answers every question with an empty answer."""

    def __init__(self) -> None:
        super().__init__("http://relations.invalid", "http://aggregates.invalid")
        self.bodies: list[Any] = []

    async def _send_to(self, dependency: str, url: Any, body: Any) -> dict[str, Any]:
        self.bodies.append(body)
        return {"answers": [{} for _ in body["queries"]]}


def request_bodies(batches: list) -> list[Any]:
    """The bodies of the requests the client sends to ask about each batch (its payments' evidence)."""
    client = RequestBodies()
    need = Need({int(p): o for p, o in AS_OF.items()}, "bench-log", 2.0)
    thresholds = AmlThresholds()
    heavy = thresholds.rates.in_each(thresholds.graph_min_average)  # as the detectors ask

    async def ask() -> None:
        for fields, _ in batches:
            questions = [(f["payer"], f["payee"], parse_instant(f["ts"], "ts")) for f in fields]
            await evidence_for(client, questions, heavy, thresholds.cycle_max_hops, need, route=0)

    asyncio.run(ask())
    return client.bodies


def parse_all(parse: Callable[..., Any], batches: list, decoded: list) -> list[Any]:
    """Every payment's evidence, parsed by `parse` (an `Evidence.parse`) from the decoded bodies."""
    found = []
    for (fields, _), (aggregates, relations) in zip(batches, decoded, strict=True):
        for i, payment in enumerate(fields):
            found.append(
                parse(
                    **payment,
                    payer_aggregates=aggregates["answers"][2 * i],
                    payee_aggregates=aggregates["answers"][2 * i + 1],
                    payer_relations=relations["answers"][2 * i],
                    payee_relations=relations["answers"][2 * i + 1],
                )
            )
    return found


def read_answers(way: str, decoded: list) -> None:
    """Every answer parsed alone, by `from_json` (msgspec's check) or by `checked` (field by field)."""
    parse_aggregates, parse_relations = getattr(Aggregates, way), getattr(Relations, way)
    for aggregates, relations in decoded:
        for answer in aggregates["answers"]:
            parse_aggregates(answer)
        for answer in relations["answers"]:
            parse_relations(answer)


def plain(value: Any) -> Any:
    """A parsed value as plain data, whatever classes hold it (dataclasses or msgspec structs)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, msgspec.Struct):
        return {name: plain(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def _round(work: Callable[[], object], parser: Any = evidence) -> float:
    """CPU seconds of one `work()`, the garbage collector paused, as `timeit` pauses it: its passes over
    the corpus's objects are this process's. The cache of amount texts of `parser` (the evidence module
    the work parses with) starts empty, as a worker's does before the stream: each round is one pass over
    the stream, never over texts read in a round before."""
    cache = getattr(parser, "_amount", None)
    if cache is not None:
        cache.cache_clear()
    gc.collect()
    gc.disable()
    try:
        started = time.process_time()
        work()
        return time.process_time() - started
    finally:
        gc.enable()


def _figures(rounds: list[float], payments: int) -> dict[str, Any]:
    return {
        "us_per_payment": round(1e6 * min(rounds) / payments, 1),
        "us_per_payment_every_round": [round(1e6 * r / payments, 1) for r in rounds],
    }


def best(work: Callable[[], object], repeat: int, payments: int) -> dict[str, Any]:
    """Microseconds of CPU a payment: the best round's and every round's."""
    return _figures([_round(work) for _ in range(repeat)], payments)


def side_by_side(
    works: Mapping[str, tuple[Callable[[], object], Any]], repeat: int, payments: int
) -> tuple[dict[str, dict[str, Any]], float]:
    """`best` of each (work, the evidence module it parses with), their rounds interleaved (the order
    turned every round, so a machine that slows down weighs on both); and the median of the first work's
    round over the second's."""
    rounds: dict[str, list[float]] = {name: [] for name in works}
    for r in range(repeat):
        for name in list(works)[:: 1 if r % 2 == 0 else -1]:
            rounds[name].append(_round(*works[name]))
    first, second = rounds.values()
    ratio = statistics.median(a / b for a, b in zip(first, second, strict=True))
    return {name: _figures(times, payments) for name, times in rounds.items()}, round(ratio, 3)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    info = machine()
    started = time.monotonic()
    batches = corpus(args.decided)
    payments = sum(len(fields) for fields, _ in batches)
    print(f"{payments} payments' answers in {len(batches)} batch bodies ({time.monotonic() - started:.0f} s)")
    decoded = [[msgspec.json.decode(body) for body in bodies] for _, bodies in batches]
    assert decoded == [[json.loads(body) for body in bodies] for _, bodies in batches]
    doc: dict[str, Any] = {
        "benchmark": NAME,
        "machine": info,
        "params": vars(args),
        "payments": payments,
        "answer_bytes_per_payment": round(sum(len(b) for _, bodies in batches for b in bodies) / payments),
        "decode": {
            "json.loads": best(
                lambda: [json.loads(body) for _, bodies in batches for body in bodies], args.repeat, payments
            ),
            "msgspec": best(
                lambda: [msgspec.json.decode(body) for _, bodies in batches for body in bodies],
                args.repeat,
                payments,
            ),
        },
        "answers": {
            way: best(functools.partial(read_answers, way, decoded), args.repeat, payments)
            for way in ("from_json", "checked")
        },
    }
    requests = request_bodies(batches)
    written = [msgspec.json.encode(b) for b in requests]
    if [json.loads(b) for b in written] != [json.loads(json.dumps(b)) for b in requests]:
        raise SystemExit("msgspec and json.dumps write different request bodies")
    doc["request_bytes_per_payment"] = round(sum(map(len, written)) / payments)
    doc["encode"] = {
        "json.dumps": best(lambda: [json.dumps(b).encode() for b in requests], args.repeat, payments),
        "msgspec": best(lambda: [msgspec.json.encode(b) for b in requests], args.repeat, payments),
    }
    current = functools.partial(parse_all, Evidence.parse, batches, decoded)
    if args.against:
        then = module_at(args.against, "aml_app/detection/evidence.py")
        old = functools.partial(parse_all, then.Evidence.parse, batches, decoded)
        if [plain(e) for e in current()] != [plain(e) for e in old()]:
            raise SystemExit(f"the evidence parsed at {args.against} differs from the current parse's")
        works = {"current": (current, evidence), "against": (old, then)}
        doc["parse"], doc["parse_ratio_median"] = side_by_side(works, args.repeat, payments)
    else:
        doc["parse"] = {"current": best(current, args.repeat, payments)}
    return doc


def report(doc: dict[str, Any]) -> str:
    decode, parse = doc["decode"], doc["parse"]
    against = doc["params"]["against"]
    rows = [
        ("decode the batch bodies: json.loads", decode["json.loads"]),
        ("decode the batch bodies: msgspec", decode["msgspec"]),
        ("parse the four answers: as it stands", parse["current"]),
    ]
    if "against" in parse:
        rows.append((f"parse the four answers: at {against}", parse["against"]))
    rows += [(f"the four answers alone: {way}", v) for way, v in doc["answers"].items()]
    rows += [(f"write the request bodies: {way}", v) for way, v in doc.get("encode", {}).items()]
    table = markdown_table(
        ["work", "us of CPU a payment, best", "every round"],
        [(name, v["us_per_payment"], v["us_per_payment_every_round"]) for name, v in rows],
    )
    ratio = (
        f"\n\nthe parse as it stands over the parse at {against}, rounds interleaved: median "
        f"{doc['parse_ratio_median']}"
        if "against" in parse
        else ""
    )
    return (
        f"{doc['payments']} payments, {doc['answer_bytes_per_payment']} bytes of answers each, "
        f"in bodies of {BATCH} payments\n\n{table}{ratio}"
    )


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decided", type=int, default=2_000, help="payments whose answers are parsed")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=NAME, help="the results file's name in bench/results/")
    parser.add_argument("--against", help="a git revision whose evidence.py is timed beside this one")
    args = parser.parse_args()
    finish(args.out, measure(args), report)


if __name__ == "__main__":
    cli()
