"""librdkafka's fetch queue backoff: what `fetch.queue.backoff.ms` does to a long read, side by side.

librdkafka stops fetching a partition whose local queue holds `queued.min.messages` (100,000 by default)
and fetches it again only after `fetch.queue.backoff.ms`, 1,000 ms by default (librdkafka issue 2879).
A consumer that drains its queue in a fraction of that waits out the rest. Two readers of ours read long
runs of one partition: the pipeline benchmark's plain consumer (its baseline) and the source's
`read_range` (a Spark task). On one private broker, N records (default 600,000) in one partition, each
reader reads all of them, with librdkafka's default backoff and with the 10 ms that both now set,
alternating, `--runs` times each; best and every run reported.

    .venv/bin/python -m bench.fetch_backoff [--payments 600000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from aml_app.kafka.broker import EmbeddedBroker, free_port, wait_until_answering
from bench.common import finish, machine, markdown_table
from bench.pipeline_throughput import UNIDLE, create_topics, produce_all, raw_consume, source_read

NAME = "fetch_backoff"
LIBRDKAFKA_DEFAULT = {"fetch.queue.backoff.ms": 1000}


def main(args: argparse.Namespace) -> dict[str, Any]:
    doc: dict[str, Any] = {"benchmark": NAME, "machine": machine(), "params": vars(args)}
    workdir = Path(tempfile.mkdtemp(prefix="aml-bench-backoff-"))
    broker = EmbeddedBroker(free_port(), log_path=workdir / "broker.log").start()
    try:
        asyncio.run(wait_until_answering([broker.bootstrap]))
        topic = f"payments-{uuid.uuid4().hex[:8]}"
        create_topics(broker.bootstrap, [topic], 1)
        ends = produce_all(broker.bootstrap, topic, args.payments, invalid_every=0)["ends"]
        readers = {
            "plain consumer": lambda extra: raw_consume(broker.bootstrap, topic, ends, extra),
            "source read_range": lambda extra: source_read(broker.bootstrap, topic, ends, extra)[0],
        }
        settings = {"librdkafka's default (1,000 ms)": LIBRDKAFKA_DEFAULT, "10 ms (ours)": UNIDLE}
        runs: dict[str, dict[str, list[float]]] = {r: {s: [] for s in settings} for r in readers}
        readers["plain consumer"](UNIDLE)  # one unmeasured read: the broker has just taken the records in
        for _ in range(args.runs):
            for reader, read in readers.items():
                for setting, extra in settings.items():
                    runs[reader][setting].append(read(extra))
        doc["runs_s"] = runs
    finally:
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return doc


def report(doc: dict[str, Any]) -> str:
    n = doc["params"]["payments"]
    rows = [
        (reader, setting, f"{n / min(seconds):,.0f}", ", ".join(f"{s:.2f}" for s in seconds))
        for reader, by_setting in doc["runs_s"].items()
        for setting, seconds in by_setting.items()
    ]
    return f"{n:,} records in one partition, read whole:\n\n" + markdown_table(
        ["reader", "fetch.queue.backoff.ms", "records/s (best)", "every run, s"], rows
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payments", type=int, default=600_000)
    parser.add_argument("--runs", type=int, default=3)
    finish(NAME, main(parser.parse_args()), report)
