"""One embedded broker, one PostgreSQL server and one in-process SparkSession for the whole session; fresh
names, a fresh database and a work folder per test."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from aml_app.harness.embedded_postgres import EmbeddedPostgres
from aml_app.kafka.broker import EmbeddedBroker, create_topics, free_port, wait_until_answering
from aml_app.kafka.tools import GroupCommitter
from tests.harness import DecisionLog, Names, Worker
from tests.jvm import in_process_session, short_lived_jvms

short_lived_jvms()
# `make test` runs two test processes on two cores: scikit-learn's OpenMP pool (sized when it first loads)
# takes one thread in each, so two processes fitting trees at once never spin waiting on each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    log = tmp_path_factory.mktemp("broker") / "broker.log"
    embedded = EmbeddedBroker(free_port(), log_path=log).start()
    asyncio.run(wait_until_answering([embedded.bootstrap]))
    yield embedded
    embedded.stop()


def private_postgres(prefix: str, statements: bool = False) -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL server in a folder outside pytest's (mode 700) temporary folders, since a root test run
    hands it to an unprivileged user that must be able to enter it."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    folder.chmod(0o755)
    server = EmbeddedPostgres(folder / "server", free_port(), statements=statements).start()
    yield server
    server.stop("immediate")
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres() -> Iterator[EmbeddedPostgres]:
    """The session's PostgreSQL server."""
    yield from private_postgres("aml-test-postgres-")


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The test process's SparkSession (the pipeline's settings, local[2]), started by the first test that
    asks: one JVM and one SparkContext for every test that runs Spark in-process."""
    session = in_process_session()
    yield session
    session.stop()


@pytest.fixture
def own_postgres() -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL server of this test's own, for tests that stop and start it."""
    yield from private_postgres("aml-test-own-postgres-")


@pytest.fixture
def store_url(postgres: EmbeddedPostgres) -> str:
    """A fresh, empty database for this test's stores."""
    return postgres.create_database(f"test_{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def names(broker: EmbeddedBroker) -> Names:
    fresh = Names()
    await create_topics(
        [broker.bootstrap],
        [fresh.payments, fresh.decisions, fresh.alerts, fresh.dlq, fresh.review],
        fresh.partitions,
    )
    return fresh


@pytest.fixture
async def producer(broker: EmbeddedBroker) -> AsyncIterator[AIOKafkaProducer]:
    prod = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, max_request_size=4_000_000)
    await prod.start()
    yield prod
    await prod.stop()


@pytest.fixture
async def workers(broker: EmbeddedBroker, names: Names, tmp_path: Path) -> AsyncIterator[list[Worker]]:
    """Workers started by the test; stopped after it. Their last state is printed (shown on failure)."""
    started: list[Worker] = []
    yield started
    for worker in started:
        if worker.alive():
            print(f"state of {worker.worker_id}: {json.dumps(await worker.state())}")
        worker.stop(grace=10)


@pytest.fixture
def new_worker(broker: EmbeddedBroker, names: Names, tmp_path: Path, workers: list[Worker]):
    def start(**env: str) -> Worker:
        worker = Worker(broker.bootstrap, names, tmp_path, **env).start()
        workers.append(worker)
        return worker

    return start


@pytest.fixture
async def deps(broker: EmbeddedBroker, names: Names) -> AsyncIterator[dict[str, GroupCommitter]]:
    """The dependency groups, played by the test: group -> committer."""
    committers = {
        g: await GroupCommitter([broker.bootstrap], g, names.payments).start(range(names.partitions))
        for g in names.deps
    }
    yield committers
    for committer in committers.values():
        await committer.stop()


@pytest.fixture
async def decision_log(broker: EmbeddedBroker, names: Names) -> AsyncIterator[DecisionLog]:
    log = await DecisionLog(broker.bootstrap, names.decisions, names.partitions).start()
    yield log
    await log.stop()
