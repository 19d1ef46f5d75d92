"""PostgreSQL's time by statement (`bench.pg_statements`, in the capacity benchmark's stages): an embedded
server asked to count statements counts them in every database it creates, and each of the services'
statements is told apart by its own piece of text, so none hides under "other"."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from aml_app.dependencies.relations import ALL_PARTS, Query
from aml_app.harness.embedded_postgres import EmbeddedPostgres, PostgresError
from bench import pg_statements
from tests.conftest import private_postgres
from tests.payments import PaymentRow
from tests.stores import aggregates_answers, apply_payments, relations_answers

T0 = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)
#: Heavy payments a minute apart: a loop A -> B -> C -> A that C -> A closes, A's other payees first (so
#: that the loop search steps backward from C too) and a fan into D; every part has work to do.
HOPS = [("A", "B"), ("A", "E"), ("A", "F"), ("B", "C"), ("C", "A"), ("B", "D"), ("C", "D"), ("A", "D")]
CLOSING = 4


@pytest.fixture
def counting_postgres() -> Iterator[EmbeddedPostgres]:
    yield from private_postgres("aml-test-statements-", statements=True)


async def test_every_statement_of_the_services_is_counted_under_its_own_kind(
    counting_postgres: EmbeddedPostgres, spark: Any
) -> None:
    url = counting_postgres.create_database("aml")
    payments = [
        PaymentRow(0, k, f"p{k}", payer, payee, Decimal(5000), "USD", T0 + timedelta(minutes=k))
        for k, (payer, payee) in enumerate(HOPS)
    ]
    for service in ("relations", "aggregates"):
        apply_payments(spark, url, service, payments)
    closing = payments[CLOSING]
    (answer,) = await relations_answers(url, [Query("A", 3, ALL_PARTS, Decimal(1000), "C", closing.ts)])
    assert answer["loop"]["path"] == ["A", "B", "C", "A"]
    await aggregates_answers(url, [("D", payments[-1].ts)])

    counted = await pg_statements.read(url)

    assert counted is not None
    missing = [kind for kind, _ in pg_statements.KINDS if kind not in counted]
    assert not missing, f"statements not told apart: {missing}; counted {sorted(counted)}"
    assert all(calls > 0 for _, calls in counted.values())


async def test_a_server_that_does_not_count_statements_reads_as_none(store_url: str) -> None:
    assert await pg_statements.read(store_url) is None


def test_counting_statements_without_the_module_is_refused_in_one_sentence(tmp_path: Path) -> None:
    server = EmbeddedPostgres(tmp_path / "server", statements=True)
    server.bin = tmp_path / "bin"  # a PostgreSQL installed without its contrib modules
    with pytest.raises(PostgresError, match="pg_stat_statements was asked for, but this PostgreSQL has no"):
        server.start()
