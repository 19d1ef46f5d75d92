"""The AMLworld importer's parsing: every mapped field, event-time order, skipped Bitcoin rows, labels, and
one sentence naming the line for each kind of malformed row (aml_app/simulation/amlworld.py)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from aml_app.contract import validate_payment
from aml_app.kafka.broker import free_port
from aml_app.simulation.amlworld import (
    CURRENCIES,
    AmlworldPayment,
    is_patterns_file,
    read_amlworld,
    read_patterns,
    read_patterns_import,
)
from aml_app.simulation.amlworld_command import import_amlworld_command

HEADER = (
    "Timestamp,From Bank,Account,To Bank,Account,Amount Received,Receiving Currency,Amount Paid,"
    "Payment Currency,Payment Format,Is Laundering"
)
ROWS = [
    # line 2: a self-payment, as AMLworld's reinvestments are
    "2022/09/01 00:20,010,8000EBD30,010,8000EBD30,3697.34,US Dollar,3697.34,US Dollar,Reinvestment,0",
    # line 3: earlier than line 2; received in Euro, paid in US Dollar: Amount Paid and Payment Currency count
    "2022/09/01 00:05,0211,80A1B2C3D,00030,80F00F001,100.00,Euro,108.2301,US Dollar,Credit Card,1",
    # line 4: the same minute as line 2, so after it
    "2022/09/01 00:20,00030,80F00F001,0211,80A1B2C3D,7.5,Yuan,7.5,Yuan,Cheque,0",
    # line 5: paid in Bitcoin and labelled laundering: skipped, counted
    "2022/09/01 00:01,070,81000BEEF,010,8000EBD30,0.00012345,Bitcoin,0.00012345,Bitcoin,Bitcoin,1",
    # line 6: the earliest, on the day before
    "2022/08/31 23:59,1,A,2,B,0.01,UK Pound,0.01,UK Pound,Wire,0",
    # line 7
    "2022/09/01 01:00,0211,80A1B2C3D,070,81000BEEF,15000,Yen,15000,Yen,Cash,1",
    # line 8: Bitcoin, not laundering
    "2022/09/01 00:02,070,81000BEEF,070,81000BEEF,1.5,Bitcoin,1.5,Bitcoin,Bitcoin,0",
    # line 9
    "2022/09/01 00:30,010,8000EBD30,0211,80A1B2C3D,250.00,Euro,250.00,Euro,ACH,0",
    # line 10: the same payer as lines 3 and 7, earlier than both: its payments leave out of file order
    "2022/09/01 00:00,0211,80A1B2C3D,1,A,12.34,Rupee,12.34,Rupee,ACH,0",
]


def write(tmp_path: Path, rows: list[str], header: str = HEADER, name: str = "HI-Tiny_Trans.csv") -> Path:
    path = tmp_path / name
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def test_every_field_is_mapped_and_payments_come_in_event_time_order(tmp_path: Path) -> None:
    imported = read_amlworld(write(tmp_path, ROWS))
    assert imported.rows_read == 9
    got = [
        (p.payment_id, p.payer, p.payee, p.amount, p.currency, p.ts, p.channel, p.is_laundering)
        for p in imported.payments
    ]
    assert got == [
        ("amlworld-0000006", "1:A", "2:B", "0.01", "GBP", "2022-08-31T23:59:00Z", "wire", False),
        ("amlworld-0000010", "0211:80A1B2C3D", "1:A", "12.34", "INR", "2022-09-01T00:00:00Z", "ach", False),
        (
            "amlworld-0000003",
            "0211:80A1B2C3D",
            "00030:80F00F001",
            "108.2301",
            "USD",
            "2022-09-01T00:05:00Z",
            "credit_card",
            True,
        ),
        (
            "amlworld-0000002",
            "010:8000EBD30",
            "010:8000EBD30",
            "3697.34",
            "USD",
            "2022-09-01T00:20:00Z",
            "reinvestment",
            False,
        ),
        (
            "amlworld-0000004",
            "00030:80F00F001",
            "0211:80A1B2C3D",
            "7.5",
            "CNY",
            "2022-09-01T00:20:00Z",
            "cheque",
            False,
        ),
        (
            "amlworld-0000009",
            "010:8000EBD30",
            "0211:80A1B2C3D",
            "250.00",
            "EUR",
            "2022-09-01T00:30:00Z",
            "ach",
            False,
        ),
        (
            "amlworld-0000007",
            "0211:80A1B2C3D",
            "070:81000BEEF",
            "15000",
            "JPY",
            "2022-09-01T01:00:00Z",
            "cash",
            True,
        ),
    ]


def test_values_pass_the_contract_keyed_by_payer(tmp_path: Path) -> None:
    imported = read_amlworld(write(tmp_path, ROWS), prefix="hi-small")
    for payment in imported.payments:
        fields = validate_payment(payment.key, payment.value(), 65536)
        assert payment.key == payment.payer.encode()
        assert fields == {
            "payment_id": payment.payment_id,
            "payer": payment.payer,
            "payee": payment.payee,
            "amount": payment.amount,
            "currency": payment.currency,
            "ts": payment.ts,
            "channel": payment.channel,
        }
        assert payment.payment_id.startswith("hi-small-")


def test_bitcoin_rows_are_skipped_and_counted_and_labels_are_kept(tmp_path: Path) -> None:
    imported = read_amlworld(write(tmp_path, ROWS))
    assert dict(imported.skipped) == {"Bitcoin": 2}
    assert imported.skipped_laundering == 1
    assert len(imported.payments) + sum(imported.skipped.values()) == imported.rows_read
    assert imported.laundering == {"amlworld-0000003", "amlworld-0000007"}


def test_the_ground_truth_lists_the_laundering_payments_in_event_time(tmp_path: Path) -> None:
    imported = read_amlworld(write(tmp_path, ROWS))
    truth = tmp_path / "truth.jsonl"
    imported.write_ground_truth(truth)
    assert [json.loads(line) for line in truth.read_text().splitlines()] == [
        {"payment_id": "amlworld-0000003", "is_laundering": True},
        {"payment_id": "amlworld-0000007", "is_laundering": True},
    ]


@pytest.mark.parametrize(("name", "code"), sorted(CURRENCIES.items()))
def test_each_currency_name_maps_to_its_iso_code(tmp_path: Path, name: str, code: str) -> None:
    row = f"2022/09/01 00:20,010,A,020,B,5.00,{name},5.00,{name},Wire,0"
    (payment,) = read_amlworld(write(tmp_path, [row])).payments
    assert payment.currency == code
    validate_payment(payment.key, payment.value(), 65536)


def test_the_fourteen_currencies_are_the_expected_codes() -> None:
    assert sorted(CURRENCIES.values()) == sorted(
        ["USD", "EUR", "CNY", "JPY", "GBP", "INR", "RUB", "CAD", "AUD", "CHF", "MXN", "BRL", "SAR", "ILS"]
    )


def test_limit_reads_only_the_first_rows(tmp_path: Path) -> None:
    broken_after = [*ROWS[:3], "this row is not read"]
    imported = read_amlworld(write(tmp_path, broken_after), limit=3)
    assert imported.rows_read == 3
    assert [p.payment_id for p in imported.payments] == [
        "amlworld-0000003",
        "amlworld-0000002",
        "amlworld-0000004",
    ]
    with pytest.raises(ValueError, match="line 5"):
        read_amlworld(write(tmp_path, broken_after), limit=4)


GOOD = "2022/09/01 00:20,010,A,020,B,5.00,Euro,5.00,Euro,Wire,0"


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("2022/09/01 00:20,010,A,020,B,5.00,Euro,5.00,Euro,Wire", "10 column(s), expected 11"),
        (GOOD + ",0", "12 column(s), expected 11"),
        ("", "0 column(s), expected 11"),
        (GOOD.replace("2022/09/01 00:20", "2022-09-01 00:20"), "Timestamp must be YYYY/MM/DD HH:MM"),
        (GOOD.replace("2022/09/01 00:20", "2022/02/30 00:20"), "Timestamp must be YYYY/MM/DD HH:MM"),
        (GOOD.replace("2022/09/01 00:20", "2022/09/01 24:00"), "Timestamp must be YYYY/MM/DD HH:MM"),
        (GOOD.replace(",5.00,Euro,Wire", ",abc,Euro,Wire"), "Amount Paid must be a decimal number above 0"),
        (GOOD.replace(",5.00,Euro,Wire", ",0.00,Euro,Wire"), "Amount Paid must be a decimal number above 0"),
        (GOOD.replace(",5.00,Euro,Wire", ",-5,Euro,Wire"), "Amount Paid must be a decimal number above 0"),
        (GOOD.replace(",5.00,Euro,Wire", ",1e3,Euro,Wire"), "Amount Paid must be a decimal number above 0"),
        (GOOD.replace(",5.00,Euro,Wire", ",5.123456,Euro,Wire"), "more than 4 decimal places"),
        (GOOD.replace(",5.00,Euro,Wire", ",1000000000000000,Euro,Wire"), "implausibly large"),
        (GOOD[:-1] + "2", "Is Laundering must be 0 or 1, got '2'"),
        (GOOD[:-1] + "yes", "Is Laundering must be 0 or 1, got 'yes'"),
        (GOOD.replace(",Euro,Wire", ",Dogecoin,Wire"), "unknown Payment Currency 'Dogecoin'"),
        (GOOD.replace(",A,", ",,"), "Account (column 3) is empty"),
        (GOOD.replace(",020,", ",,"), "To Bank (column 4) is empty"),
        (GOOD.replace(",Wire,", ",,"), "Payment Format (column 10) is empty"),
        (
            GOOD.replace("5.00,Euro,5.00,Euro", "5.00,Bitcoin,5.00,Bitcoin").replace("00:20", "0:20"),
            "Timestamp",
        ),
    ],
)
def test_a_malformed_row_is_one_sentence_naming_the_file_and_line(
    tmp_path: Path, bad: str, says: str
) -> None:
    path = write(tmp_path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(ValueError) as caught:
        read_amlworld(path)
    message = str(caught.value)
    assert message.startswith(f"{path} line 4: ")
    assert says in message
    assert message.endswith(".") and "\n" not in message


def test_a_wrong_header_names_line_1(tmp_path: Path) -> None:
    renamed = HEADER.replace("From Bank,Account,To Bank,Account", "From Bank,From Account,To Bank,To Account")
    path = write(tmp_path, [GOOD], header=renamed)
    with pytest.raises(ValueError, match=rf"^{path} line 1: the header is .*From Account"):
        read_amlworld(path)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match=rf"^{empty} is empty"):
        read_amlworld(empty)


def test_a_bad_file_sends_nothing_and_says_so_in_one_sentence(tmp_path: Path) -> None:
    """Parsed before connecting: with no broker at all, the answer is still the file's fault."""
    path = write(tmp_path, [GOOD, GOOD.replace(",5.00,Euro,Wire", ",x,Euro,Wire")])
    result = CliRunner().invoke(
        import_amlworld_command, [str(path)], env={"KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}"}
    )
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"amlworld: reading {path}",
        f"Error: {path} line 3: Amount Paid must be a decimal number above 0, got 'x'; nothing was sent.",
    ]


def test_a_broker_that_cannot_be_reached_is_one_sentence(tmp_path: Path) -> None:
    port = free_port()
    result = CliRunner().invoke(
        import_amlworld_command,
        [str(write(tmp_path, [GOOD]))],
        env={"KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{port}"},
    )
    assert result.exit_code == 1
    assert (
        result.output.strip()
        .splitlines()[-1]
        .startswith(f"Error: could not send to Kafka at 127.0.0.1:{port}: ")
    )
    assert "Traceback" not in result.output


def test_a_configuration_error_is_one_sentence(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        import_amlworld_command, [str(write(tmp_path, [GOOD]))], env={"AML_PARTITIONS": "zero"}
    )
    assert result.exit_code == 1
    assert result.output.startswith("Error: configuration error: ")
    assert len(result.output.strip().splitlines()) == 1


REAL = Path(__file__).resolve().parents[1] / "data" / "amlworld"
ROW_OK = "2022/09/01 00:29,0110994,80A0ECCF0,0110320,804F34520,311.90,Euro,311.90,Euro,ACH,1"


def test_the_real_patterns_file_reads_as_its_attempts() -> None:
    """LI-Medium's patterns file: 456 attempts of eight typologies; its one Bitcoin row is skipped."""
    patterns = read_patterns(REAL / "LI-Medium_Patterns.txt")
    per = Counter(a.typology for a in patterns.attempts)
    assert per == {
        "bipartite": 72,
        "cycle": 46,
        "fan_in": 47,
        "fan_out": 69,
        "gather_scatter": 43,
        "random": 49,
        "scatter_gather": 63,
        "stack": 67,
    }
    assert len(patterns.payments) == 3908 and patterns.skipped == {"Bitcoin": 1}
    assert sum(len(a.payment_ids) for a in patterns.attempts) == 3908
    assert [p.ts for p in patterns.payments] == sorted(p.ts for p in patterns.payments)
    first = patterns.attempts[0]
    assert (first.typology, first.detail, len(first.payment_ids)) == ("scatter_gather", "", 22)
    fan_out = next(a for a in patterns.attempts if a.typology == "fan_out")
    assert fan_out.detail.startswith("Max ") and fan_out.detail.endswith("-degree Fan-Out")


@pytest.mark.parametrize(
    "text, fault",
    [
        ("BEGIN LAUNDERING ATTEMPT - SMURFING\n", "line 1: unknown laundering typology 'SMURFING'"),
        (f"{ROW_OK}\n", "line 1: a payment outside any laundering attempt"),
        (
            "BEGIN LAUNDERING ATTEMPT - CYCLE:  Max 2 hops\nEND LAUNDERING ATTEMPT\n",
            "line 2: an attempt ends",
        ),
        ("BEGIN LAUNDERING ATTEMPT - CYCLE\n" + ROW_OK.replace(",1", ",0") + "\n", "line 2: a payment of an"),
        ("BEGIN LAUNDERING ATTEMPT - CYCLE\n" + ROW_OK + "\n", "ends inside a laundering attempt"),
    ],
)
def test_a_malformed_patterns_file_is_one_sentence(tmp_path: Path, text: str, fault: str) -> None:
    path = tmp_path / "Patterns.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=fault):
        read_patterns(path)


def test_a_byte_that_is_not_utf8_is_named_at_its_own_line(tmp_path: Path) -> None:
    """Far into the file too (a text wrapper decodes 8 KB ahead and named line 1963 for line 2002)."""
    path = tmp_path / "Trans.csv"
    rows = [ROW_OK.replace(",1", ",0")] * 2000 + [ROW_OK.replace("ACH", "Ch\xe8que")]
    path.write_bytes("\n".join([HEADER, *rows]).encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=r"Trans\.csv line 2002: not UTF-8 text"):
        read_amlworld(path)
    patterns = tmp_path / "Patterns.txt"
    patterns.write_bytes(f"BEGIN LAUNDERING ATTEMPT - CYCLE\n{rows[-1]}\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"Patterns\.txt line 2: not UTF-8 text"):
        read_patterns(patterns)


def test_a_limit_reads_no_row_beyond_it(tmp_path: Path) -> None:
    path = tmp_path / "Trans.csv"
    path.write_bytes(f"{HEADER}\n{ROW_OK}\n".encode() + b'2022/09/01 00:21,"010\xe8\n')
    assert len(read_amlworld(path, limit=1).payments) == 1


def test_an_attempt_paid_only_in_bitcoin_is_skipped_whole(tmp_path: Path) -> None:
    """Its rows are skipped as every Bitcoin row is; the attempt, with nothing left to send, is skipped and
    counted, not taken for an attempt with no payment (which refused the whole file)."""
    bitcoin = ROW_OK.replace("Euro", "Bitcoin")
    path = tmp_path / "Patterns.txt"
    path.write_text(
        f"BEGIN LAUNDERING ATTEMPT - FAN-OUT\n{bitcoin}\n{bitcoin}\nEND LAUNDERING ATTEMPT\n"
        f"BEGIN LAUNDERING ATTEMPT - CYCLE\n{ROW_OK}\n{bitcoin}\nEND LAUNDERING ATTEMPT\n"
    )
    patterns = read_patterns(path)
    assert [a.typology for a in patterns.attempts] == ["cycle"] and patterns.skipped_attempts == 1
    assert patterns.skipped == {"Bitcoin": 3} and len(patterns.payments) == 1
    imported = read_patterns_import(path)
    assert imported.skipped_attempts == 1 and imported.rows_read == 4


def test_a_patterns_file_replays_into_a_transactions_file(tmp_path: Path) -> None:
    """The layouts are told apart by their first line; merged, the attempts' payments take their places in
    the background's event time, and the ground truth names each one's typology and attempt."""
    background = tmp_path / "Trans.csv"
    background.write_text("\n".join([HEADER, *ROWS]) + "\n")
    patterns = tmp_path / "Patterns.txt"
    pattern_row = ROW_OK.replace("2022/09/01 00:29", "2022/09/01 00:30")
    patterns.write_text(
        f"\nBEGIN LAUNDERING ATTEMPT - CYCLE:  Max 2 hops\n{pattern_row}\nEND LAUNDERING ATTEMPT\n"
    )
    assert is_patterns_file(patterns) and not is_patterns_file(background)
    merged = read_amlworld(background, prefix="t").merged(read_patterns_import(patterns, prefix="t-pattern"))
    assert [p.ts for p in merged.payments] == sorted(p.ts for p in merged.payments)
    alone = read_amlworld(background, prefix="t")
    assert len(merged.payments) == len(alone.payments) + 1 and merged.rows_read == alone.rows_read + 1
    assert merged.laundering == alone.laundering | {"t-pattern-0000003"}
    truth = tmp_path / "truth.jsonl"
    merged.write_ground_truth(truth)
    lines = [json.loads(line) for line in truth.read_text().splitlines()]
    assert {
        "payment_id": "t-pattern-0000003",
        "is_laundering": True,
        "typology": "cycle",
        "attempt": "t-pattern-attempt-1",
    } in lines
    assert len(lines) == len(merged.laundering)


def test_two_files_of_one_layout_are_refused_before_sending(tmp_path: Path) -> None:
    path = write(tmp_path, [GOOD])
    result = CliRunner().invoke(
        import_amlworld_command,
        [str(path), str(path)],
        env={"KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}"},
    )
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: 2 transactions and 0 patterns files were given; give at most one of each; nothing was sent."
    ]


def test_paced_sending_spreads_event_time_over_wall_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --days-per-second, payments go out in steps of event time: a chunk waits until its first
    payment is due. The producer is replaced at its seam; time is the fake clock the sleeps advance."""
    from aml_app.simulation import amlworld_command

    clock = [0.0]
    sent: list[tuple[float, list[str]]] = []

    async def fake_producer(*args: object, **kwargs: object) -> Any:
        class Producer:
            async def stop(self) -> None:
                return None

        return Producer()

    async def fake_produce(producer: object, topic: str, records: list[tuple[Any, Any, Any]]) -> list[Any]:
        sent.append((clock[0], [json.loads(value)["payment_id"] for _, _, value in records]))
        return []

    async def fake_sleep(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr(amlworld_command, "started_producer", fake_producer)
    monkeypatch.setattr(amlworld_command, "produce", fake_produce)
    monkeypatch.setattr(amlworld_command.asyncio, "sleep", fake_sleep)
    monkeypatch.setattr(amlworld_command.time, "monotonic", lambda: clock[0])
    days = ["2022-09-01T00:00:00Z", "2022-09-01T01:00:00Z", "2022-09-02T00:00:00Z", "2022-09-05T00:00:00Z"]
    payments = [
        AmlworldPayment(f"p{i}", "a", "b", "1.00", "USD", ts, "ach", False) for i, ts in enumerate(days)
    ]
    asyncio.run(amlworld_command.send_payments(["x"], "t", payments, days_per_second=1.0))
    # One day of event time per second: p0 and p1 (an hour apart) together at once, p2 at 1 s, p3 at 4 s.
    assert sent == [(0.0, ["p0", "p1"]), (1.0, ["p2"]), (4.0, ["p3"])]
    sent.clear()
    clock[0] = 0.0
    asyncio.run(amlworld_command.send_payments(["x"], "t", payments))
    assert sent == [(0.0, ["p0", "p1", "p2", "p3"])]  # unpaced: all at once


def test_a_long_read_says_how_far_it_is_at_what_rate_and_how_long_is_left(tmp_path: Path) -> None:
    row = "2022/09/01 00:30,010,8000EBD30,0211,80A1B2C3D,250.00,Euro,250.00,Euro,ACH,0"
    path = write(tmp_path, [row] * 30_000)
    said: list[str] = []
    imported = read_amlworld(path, progress=said.append, progress_interval=0.0)
    assert len(imported.payments) == 30_000
    assert len(said) == 3, said  # checked every 10,000 rows
    first, last = said[0], said[-1]
    assert first.startswith(f"amlworld: reading {path}: 10,000 rows, ") and "rows/s, about " in first
    assert last.startswith(f"amlworld: reading {path}: 30,000 rows, 100% of ") and last.endswith(
        "about 0 s left"
    )
    shares = [int(line.split("rows, ")[1].split("%")[0]) for line in said]
    assert shares == sorted(shares) and 20 <= shares[0] <= 45, shares
    assert read_amlworld(path, progress=said.append).payments == imported.payments  # default: every 5 s
