"""`aml-app train-model`: a labelled history read once, split into what training reads and what only the
report reads, and the report. Services B and C are the naive reference (`aml_app.training.replay`)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from aml_app.detection.model import BENIGN, Model, load
from aml_app.detection.model_settings import DEFAULT_BAND, DEFAULT_THRESHOLD, record
from aml_app.detection.thresholds import AmlThresholds
from aml_app.errors import ConfigError
from aml_app.settings import load_settings
from aml_app.training import fit as fit_module
from aml_app.training.fit import (
    ALERT_BUDGETS,
    LOOK_BENIGN_PER_LAUNDERING,
    LOOK_FOLDS,
    UNNAMED,
    UNSCORED_ROW,
    Replayed,
    beside_for,
    calibrated_run,
    cross_fitted,
    fit_rows,
    fit_trees,
    labelled_by_look,
    replay,
    replay_timeline,
    sample_weights,
    train,
)
from aml_app.training.history import read_history
from aml_app.training.holdout import (
    BASE_RATES,
    PARTS,
    _measured,
    _queue,
    benign_rate_bound,
    crossed,
    estimates,
    folded,
    part_of,
    per_size,
    queue_precision,
    rendered,
    scored,
    scored_each,
    size_band,
    split,
    within_budgets,
)
from aml_app.training.replay import Services
from tests.real_amlworld import real_decided, real_files

SMALL = {"max_iter": 20, "max_leaf_nodes": 7, "learning_rate": 0.1}
HEADER = (
    "Timestamp,From Bank,Account,To Bank,Account,Amount Received,Receiving Currency,Amount Paid,"
    "Payment Currency,Payment Format,Is Laundering"
)


def row(minute: int, payer: str, payee: str, amount: str, laundering: int, fmt: str = "ACH") -> str:
    return (
        f"2022/09/01 00:{minute:02d},001,{payer},002,{payee},{amount},US Dollar,{amount},US Dollar,{fmt},"
        f"{laundering}"
    )


@pytest.fixture(scope="module")
def run() -> Replayed:
    """Three days of the calibrated simulator, replayed once."""
    return replay(*calibrated_run(41, days=3, per_hour=50, attempts=6))


def test_a_laundering_row_that_a_pattern_lists_takes_its_typology_and_is_not_doubled(tmp_path: Path) -> None:
    transactions = tmp_path / "Trans.csv"
    transactions.write_text(
        "\n".join(
            [
                HEADER,
                row(1, "A", "B", "10.00", 0),
                row(2, "B", "C", "500.00", 1),  # listed by the pattern below
                row(3, "C", "D", "700.00", 1),  # listed by no pattern
            ]
        )
        + "\n"
    )
    patterns = tmp_path / "Patterns.txt"
    patterns.write_text(
        "BEGIN LAUNDERING ATTEMPT - FAN-OUT\n"
        + row(2, "B", "C", "500.00", 1)
        + "\n"
        + row(4, "B", "E", "300.00", 1)  # the transactions lack it: replayed into them
        + "\nEND LAUNDERING ATTEMPT\n"
    )
    history = read_history([transactions, patterns])
    assert len(history.payments) == 4
    assert [a.typology for a in history.attempts] == ["fan_out"]
    ids = {(p.payer[4:], p.payee[4:]): p.payment_id for p in history.payments}
    assert history.attempts[0].payment_ids == (ids["B", "C"], ids["B", "E"])
    assert history.laundering == 3
    replayed = replay_timeline(history.payments, history.attempts, unnamed=True)
    by_pair = dict(zip(((p.payer[4:], p.payee[4:]) for p in replayed.payments), replayed.labels, strict=True))
    assert by_pair == {("A", "B"): BENIGN, ("B", "C"): "fan_out", ("B", "E"): "fan_out", ("C", "D"): UNNAMED}
    assert sorted(t for t, _ in replayed.attempts) == ["fan_out", UNNAMED]


def test_a_self_payment_is_replayed_without_features(run: Replayed) -> None:
    """The model never scores a self-payment: the replay computes no features for one, and each payment
    between two parties has its own row."""
    selves = [i for i, payment in enumerate(run.payments) if payment.payer == payment.payee]
    assert selves and all(run.rows[i] is UNSCORED_ROW for i in selves)
    assert not any(run.rows[i] is UNSCORED_ROW or not any(run.rows[i]) for i in run.between())


def test_a_replay_asks_b_and_c_about_payments_between_two_parties(monkeypatch: pytest.MonkeyPatch) -> None:
    """A self-payment's evidence is never read (no rule asks about one, the model scores none), so the
    replay does not ask for it, and gives what a replay of every payment's evidence gives, byte for byte."""
    patterns, _, timeline = real_files()
    every = replay_timeline(timeline, patterns.attempts, pairs=real_decided())
    asked: list[str] = []
    evidence = Services.evidence

    def counted(services: Services, payment: Any) -> Any:
        asked.append(payment.payment_id)
        return evidence(services, payment)

    monkeypatch.setattr(Services, "evidence", counted)
    replayed = replay_timeline(timeline, patterns.attempts)
    between = [p.payment_id for p in timeline if p.payer != p.payee]
    assert asked == between and len(timeline) - len(between) > 5_000  # the half hour's self-payments
    assert replayed == every


def test_a_history_in_the_wrong_layout_is_one_sentence(tmp_path: Path) -> None:
    bad = tmp_path / "Trans.csv"
    bad.write_text("when,who\n1,2\n")
    with pytest.raises(ValueError, match="line 1: the header is"):
        read_history([bad])


@pytest.mark.parametrize("by", ["time", "attempt", "account"])
def test_the_parts_cover_the_history_once_and_keep_each_attempt_whole(run: Replayed, by: str) -> None:
    parts = part_of(run, by, (0.6, 0.2, 0.2))
    assert set(parts) == {0, 1, 2}
    for _, members in run.attempts:
        assert len({parts[i] for i in members}) == 1
    payers: dict[str, set[int]] = {}
    for i, label in enumerate(run.labels):
        if label == BENIGN:
            payers.setdefault(run.payments[i].payer, set()).add(parts[i])
    in_several = sum(len(found) > 1 for found in payers.values())
    # By account a payer's benign payments and the attempts it starts share a part; otherwise (the
    # control) many payers straddle, and some attempts lie apart from their payer's benign payments.
    assert in_several == 0 if by == "account" else in_several > len(payers) / 10
    starters = [(parts[min(m)], payers[run.payments[min(m)].payer]) for _, m in run.attempts if m]
    apart = sum(part not in found for part, found in starters)
    assert len(starters) > 10 and (apart == 0 if by == "account" else apart > 0)
    pieces = split(run, by)
    assert sum(len(getattr(pieces, name).payments) for name in PARTS) == len(run.payments)
    ids = [{p.payment_id for p in getattr(pieces, name).payments} for name in PARTS]
    assert not ids[0] & ids[1] and not ids[0] & ids[2] and not ids[1] & ids[2]
    assert sum(len(getattr(pieces, name).attempts) for name in PARTS) == len(
        [m for _, m in run.attempts if m]
    )
    if by == "time":  # benign payments in time order: the learning part first, the scored part last
        benign = [p for p, label in zip(run.payments, run.labels, strict=True) if label == BENIGN]
        position = {p.payment_id: n for n, p in enumerate(benign)}
        last_learned = max(position[p.payment_id] for p in pieces.learn.payments if p.payment_id in position)
        first_scored = min(position[p.payment_id] for p in pieces.score.payments if p.payment_id in position)
        assert last_learned < first_scored


def _scrambled(part: Replayed) -> Replayed:
    """The same payments with other features and labels: what training must never read."""
    other = copy.deepcopy(part)
    other.rows = [[value + 1.0 for value in features] for features in other.rows]
    other.labels = [BENIGN if label != BENIGN else "fan_in" for label in other.labels]
    return other


def test_training_reads_nothing_of_the_scored_part(run: Replayed) -> None:
    """The model file is the same whatever the scored part holds; the negative control: scrambling the
    part that sets the cut changes it."""
    parts = split(run, "attempt")
    doc, _ = train([parts.learn], [parts.cut], SMALL)
    assert scored(doc, parts.score) != scored(doc, _scrambled(parts.score))  # the report reads it
    whole = Replayed.pooled([parts.learn, parts.cut, _scrambled(parts.score)])
    again = split(whole, "attempt")
    assert [p.payment_id for p in again.score.payments] == [p.payment_id for p in parts.score.payments]
    assert train([again.learn], [again.cut], SMALL)[0] == doc
    control, _ = train([parts.learn], [_scrambled(parts.cut)], SMALL)
    assert control != doc


@pytest.mark.parametrize("by", ["time", "attempt", "account"])
def test_the_cross_validated_parts_cover_the_history_once_and_leave_every_fold_filled(
    run: Replayed, by: str
) -> None:
    pieces = crossed(run, by, 3)
    ids = [[p.payment_id for p in piece.payments] for piece in pieces]
    assert all(ids) and sorted(i for piece in ids for i in piece) == sorted(
        p.payment_id for p in run.payments
    )
    assert sum(len(piece.attempts) for piece in pieces) == len([m for _, m in run.attempts if m])
    for k in range(3):  # the folds of the other parts, which set each model's cut, are none of them empty
        rest = Replayed.pooled([piece for j, piece in enumerate(pieces) if j != k])
        assert all(fold.payments for fold in folded(rest, by, 3))
    with pytest.raises(ValueError, match="at least 2"):
        crossed(run, by, 1)


def test_a_cross_validated_report_adds_up_what_each_model_alerts_on_its_own_part(run: Replayed) -> None:
    """Each part is scored by its own model: the pooled counts are the sum of the parts' reports, which
    differ from one model scoring both (the control)."""
    first, second = crossed(run, "attempt", 2)
    doc_a, _ = train([first], [first], SMALL)
    doc_b, _ = train([second], [second], {**SMALL, "max_iter": 5})
    pooled = scored_each([(doc_a, second), (doc_b, first)])
    alone = [scored(doc_a, second), scored(doc_b, first)]

    def counts(report: dict) -> tuple[int, ...]:
        own = [round(v["own_typology"] * v["attempts"]) for v in report["per_typology"].values()]
        budgets = [b["benign_alerted"] for b in report["alert_budgets"]]
        return (report["attempts"], report["benign"]["alerted"], sum(own), *budgets)

    assert counts(pooled) == tuple(map(sum, zip(*map(counts, alone), strict=True)))
    one_model = scored(doc_a, Replayed.pooled([second, first]))
    assert counts(one_model) != counts(pooled)
    # The allowance on the pooled scored parts, each benign payment once: summed over the models where
    # each was set, with N parts every benign payment counted N - 1 times (four times too many at 5).
    budget = pooled["alert_budgets"][0]
    scored_parts = Replayed.pooled([second, first])
    benign = sum(label == BENIGN for label in scored_parts.labels)  # self-payments too, as the cut counts
    assert budget["allowed_where_set"] == int(budget["budget"] * benign)
    assert budget["allowed_where"] == "at its rate on the scored parts"
    assert all(r["alert_budgets"][0]["allowed_where"] == "where it was set" for r in alone)


def test_the_folds_cover_the_pool_once_and_keep_each_attempt_whole(run: Replayed) -> None:
    parts = split(run, "attempt")
    pool = Replayed.pooled([parts.learn, parts.cut])
    pieces = folded(pool, "attempt", 4)
    ids = [[p.payment_id for p in piece.payments] for piece in pieces]
    assert all(ids) and sorted(i for piece in ids for i in piece) == sorted(
        p.payment_id for p in pool.payments
    )
    assert sum(len(piece.attempts) for piece in pieces) == len([m for _, m in pool.attempts if m])
    with pytest.raises(ValueError, match="at least 2"):
        folded(pool, "attempt", 1)


def test_each_fold_is_scored_by_trees_that_never_saw_it(run: Replayed) -> None:
    """A fold's probabilities are those of the trees fitted to the other folds: scrambling the fold's own
    labels leaves them as they are and moves the other folds' (the control)."""
    pieces = folded(run, "attempt", 3)
    found = cross_fitted(pieces, SMALL)
    classes = sorted({piece.labels[i] for piece in pieces for i in piece.between()})
    for k, fold in enumerate(pieces):
        others = fit_trees([piece for j, piece in enumerate(pieces) if j != k], SMALL)
        assert [str(c) for c in others.classes_] == classes
        between = fold.between()
        assert np.array_equal(
            found[k][between], others.predict_proba(np.array(fold.rows, dtype=float))[between]
        )
        # A self-payment, which the model never scores, is not scored here either.
        selves = sorted(set(range(len(fold.payments))) - set(between))
        assert selves and not found[k][selves].any()
    everything = fit_trees(pieces, SMALL)
    between = pieces[0].between()
    assert not np.array_equal(
        found[0][between], everything.predict_proba(np.array(pieces[0].rows, dtype=float))[between]
    )
    scrambled_labels = copy.deepcopy(pieces[0])
    scrambled_labels.labels = [BENIGN if label != BENIGN else "fan_in" for label in scrambled_labels.labels]
    same_rows = cross_fitted([scrambled_labels, *pieces[1:]], SMALL)
    assert np.array_equal(same_rows[0], found[0])
    assert not all(np.array_equal(a, b) for a, b in zip(same_rows[1:], found[1:], strict=True))


def test_a_fit_learns_from_every_laundering_payment_and_at_most_its_share_of_benign_ones(
    run: Replayed,
) -> None:
    """Past `max_benign`, a fit learns from a fixed sample of the benign payments between two parties and
    from every laundering one, each class weighing the same; below it, from all, as `sample_weights`
    weighs them."""
    between = run.between()
    x, y, weights = fit_rows([run])
    assert y == [run.labels[i] for i in between] and np.array_equal(weights, sample_weights([run]))
    benign = y.count(BENIGN)
    assert benign > 100
    x_kept, y_kept, w_kept = fit_rows([run], max_benign=100)
    assert y_kept.count(BENIGN) == 100
    assert Counter(label for label in y_kept if label != BENIGN) == Counter(
        label for label in y if label != BENIGN
    )
    rows = iter(zip(x.tolist(), y, strict=True))  # the rows kept, in order, with their own labels
    assert all(pair in rows for pair in zip(x_kept.tolist(), y_kept, strict=True))
    totals = {name: w_kept[np.array(y_kept) == name].sum() for name in set(y_kept)}
    assert max(totals.values()) == pytest.approx(min(totals.values()))
    again = fit_rows([run], max_benign=100)
    assert np.array_equal(again[0], x_kept) and again[1] == y_kept
    # The cut is still set on every benign payment, each scored by trees fitted to the other folds.
    pieces = folded(run, "attempt", 3)
    capped, _ = train(
        pieces,
        pieces,
        SMALL,
        held_out_probabilities=cross_fitted(pieces, SMALL, max_benign=100),
        max_benign=100,
    )
    assert capped["training"]["benign_learnt"] == 100
    assert capped["training"]["held_out"]["benign_payments"] == run.labels.count(BENIGN)
    whole, _ = train(pieces, pieces, SMALL, held_out_probabilities=cross_fitted(pieces, SMALL))
    assert "benign_learnt" not in whole["training"] and whole["cut"] != capped["cut"]


def _looks(benign: int = 200) -> Replayed:
    """A history whose payments look one of three ways (the one feature x): benign (0), shared by two
    typologies (1) and fan-in's own (2). Forty fan-in attempts pay once each way, sixty fan-out attempts
    once the shared way; ten fan-in attempts pay the shared way only, and one pays it to itself; then
    `benign` benign payments."""
    out = Replayed()

    def pay(x: float, label: str, payer: str, payee: str) -> int:
        out.payments.append(SimpleNamespace(payment_id=f"p{len(out.payments)}", payer=payer, payee=payee))
        out.rows.append([x])
        out.labels.append(label)
        out.rules.append([])
        out.typologies.append([])
        return len(out.payments) - 1

    for n in range(40):
        out.attempts.append(("fan_in", [pay(1, "fan_in", f"a{n}", "h"), pay(2, "fan_in", f"b{n}", "h")]))
    for n in range(60):
        out.attempts.append(("fan_out", [pay(1, "fan_out", "s", f"c{n}")]))
    for n in range(10):
        out.attempts.append(("fan_in", [pay(1, "fan_in", f"d{n}", "g")]))
    out.attempts.append(("fan_in", [pay(1, "fan_in", "e", "e"), pay(2, "fan_in", "f", "e")]))
    for n in range(benign):
        pay(0, BENIGN, f"x{n}", f"y{n}")
    return out


def _looks_relabelled(history: Replayed) -> list[str]:
    """`_looks`'s labels by look: the shared payment of each of the forty fan-in attempts that pay both ways
    labelled fan-out."""
    labels = list(history.labels)
    for _, (shared, _own) in history.attempts[:40]:
        labels[shared] = "fan_out"
    return labels


def test_a_payment_takes_the_typology_it_looks_like_where_its_attempt_is_named_right() -> None:
    """The shared look is fan-out's (all of fan-out's weight is there, half of fan-in's): a fan-in attempt
    that its own look names right has its shared payment labelled fan-out; one that pays only the shared
    way keeps its label, as do fan-out, the benign payments and a self-payment, which is never named."""
    history = _looks()
    relabelled, moved = labelled_by_look([history], SMALL)
    assert moved == 40
    assert relabelled.labels == _looks_relabelled(history)
    assert relabelled.attempts == history.attempts and relabelled.rows == history.rows
    # The trees learn what the labels by look say, and the file says how many were moved.
    by_look = fit_trees([history], SMALL, by_look=True)
    assert np.array_equal(
        by_look.predict_proba(np.array(history.rows, dtype=float)),
        fit_trees([relabelled], SMALL).predict_proba(np.array(history.rows, dtype=float)),
    )
    doc, _ = train([history], [history], SMALL, by_look=True)
    assert doc["training"]["labelled_by_look"] == moved
    assert doc["training"]["per_class"]["fan_in"] == history.labels.count("fan_in") - moved - 1


def test_the_trees_that_label_by_look_learn_from_a_sample_of_the_benign_payments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long history is almost all benign: each fit of the look's trees learns from every laundering
    payment of its folds and a sample of `LOOK_BENIGN_PER_LAUNDERING` benign ones for each laundering one
    of the history, and the looks are the same as with every benign payment learnt."""
    history = _looks(benign=2000)
    laundering = sum(history.labels[i] != BENIGN for i in history.between())
    learnt: list[Counter[str]] = []
    real_rows = fit_module.fit_rows

    def counted(*args: Any, **kwargs: Any) -> tuple[np.ndarray, list[str], np.ndarray]:
        x, y, weights = real_rows(*args, **kwargs)
        learnt.append(Counter(y))
        return x, y, weights

    monkeypatch.setattr(fit_module, "fit_rows", counted)
    relabelled, moved = labelled_by_look([history], SMALL)
    assert len(learnt) == LOOK_FOLDS
    assert all(counts[BENIGN] == LOOK_BENIGN_PER_LAUNDERING * laundering for counts in learnt)
    assert sum(counts.total() - counts[BENIGN] for counts in learnt) == (LOOK_FOLDS - 1) * laundering
    assert moved == 40
    assert relabelled.labels == _looks_relabelled(history)


def test_labels_by_look_need_no_benign_payment() -> None:
    """A history of laundering alone (as a fold of one may be) is relabelled all the same."""
    history = _looks()
    laundering = history.subset([i for i, label in enumerate(history.labels) if label != BENIGN])
    relabelled, moved = labelled_by_look([laundering], SMALL)
    assert moved == 40 and BENIGN not in relabelled.labels


def test_out_of_fold_every_benign_payment_of_the_pool_sets_the_cut(run: Replayed) -> None:
    """Cross-fitted, the cut and the budgets are set on the whole pool's benign payments, not on the cut
    part's alone; the scored part is still never read."""
    parts = split(run, "attempt")
    pool = Replayed.pooled([parts.learn, parts.cut])
    pieces = folded(pool, "attempt", 3)
    out_of_fold = cross_fitted(pieces, SMALL)
    doc, _ = train(pieces, pieces, SMALL, held_out_probabilities=out_of_fold)
    assert doc["training"]["held_out"]["benign_payments"] == pool.labels.count(BENIGN)
    alone, _ = train([parts.learn], [parts.cut], SMALL)
    assert alone["training"]["held_out"]["benign_payments"] == parts.cut.labels.count(BENIGN)
    whole = Replayed.pooled([parts.learn, parts.cut, _scrambled(parts.score)])
    again = split(whole, "attempt")
    pieces_again = folded(Replayed.pooled([again.learn, again.cut]), "attempt", 3)
    redone, _ = train(
        pieces_again, pieces_again, SMALL, held_out_probabilities=cross_fitted(pieces_again, SMALL)
    )
    assert redone == doc
    with pytest.raises(ValueError, match="other classes"):
        train(pieces, pieces, SMALL, held_out_probabilities=[p[:, :1] for p in out_of_fold])


def test_the_report_counts_what_the_model_and_its_rules_alert(run: Replayed) -> None:
    parts = split(run, "attempt")
    doc, _ = train([parts.learn], [parts.cut], SMALL)
    report = scored(doc, parts.score)
    assert report["payments"] == len(parts.score.payments)
    assert report["attempts"] == len(parts.score.attempts)
    assert sum(v["attempts"] for v in report["per_typology"].values()) == report["attempts"]
    benign = report["benign"]
    assert benign["payments"] == parts.score.labels.count(BENIGN)
    assert 0 <= benign["alerted"] <= benign["payments"]
    hi = report["estimated_at_base_rate"]["HI (1 in 900)"]
    li = report["estimated_at_base_rate"]["LI (1 in 1,750)"]
    assert hi["precision"] >= li["precision"]  # more laundering per payment, more of the alerts right
    for budget in report["alert_budgets"]:  # each budget's recall, typology by typology, adds up
        each = budget["own_typology_each"]
        assert each.keys() == report["per_typology"].keys()
        right = sum(round(each[t] * v["attempts"]) for t, v in report["per_typology"].items())
        assert right == round(budget["own_typology"] * report["attempts"])
    no_rules = {**doc, "alerting_rules": [], "cut": 0.0}  # nothing alerts
    silent = scored(no_rules, parts.score)
    assert silent["benign"]["alerted"] == 0 and silent["any_alert"] == 0


def test_the_report_counts_the_payers_its_benign_alerts_come_from(run: Replayed) -> None:
    """An analyst clears one account's alerts together: four benign alerts from two payers are two
    accounts to look at. Neither the payments alerted nor every payer alerted (a laundering one too)."""
    payers = ["hub", "hub", "hub", "hub", "shop", "shop", "mule"]
    toy = Replayed(
        payments=[SimpleNamespace(payer=p, payee="x", payment_id=str(i)) for i, p in enumerate(payers)],
        labels=[BENIGN] * 6 + ["fan_out"],
        attempts=[("fan_out", [6])],
    )
    named = [{"fan_out"}, {"fan_out"}, {"fan_out"}, set(), {"fan_in"}, set(), {"fan_out"}]
    measured = _measured(named, toy)
    assert (measured["benign_alerted"], measured["benign_payers_alerted"]) == (4, 2)
    parts = split(run, "attempt")
    doc, _ = train([parts.learn], [parts.cut], SMALL)
    report = scored({**doc, "alerting_rules": [], "cut": 1.0}, parts.score)  # every two-party payment
    benign = [p for p, label in zip(parts.score.payments, parts.score.labels, strict=True) if label == BENIGN]
    two_party = {p.payer for p in benign if p.payer != p.payee}
    assert report["benign"]["payers_alerted"] == len(two_party) < report["benign"]["alerted"]
    assert f"from {len(two_party):,} payers;" in next(
        line for line in rendered(report) if line.startswith("benign alerted:")
    )


def test_recall_by_the_attempts_payments_counts_each_attempt_in_its_band_once() -> None:
    assert [size_band(n) for n in (1, 2, 3, 5, 6, 40)] == ["1", "2", "3-5", "3-5", "6+", "6+"]
    run = Replayed(
        labels=["fan_in", "cycle", "cycle", "stack", "stack", "stack", "random", "random"],
        attempts=[("fan_in", [0]), ("cycle", [1, 2]), ("stack", [3, 4, 5]), ("random", [6, 7])],
    )
    # fan-in named right; the cycle alerted under another name; the stack right by its second payment;
    # the random walk not alerted.
    named = [{"fan_in"}, {"stack"}, set(), set(), {"stack"}, set(), set(), set()]
    found = per_size(named, run)
    assert list(found) == ["1", "2", "3-5"]
    assert {k: (v["attempts"], v["right"], v["alerted"]) for k, v in found.items()} == {
        "1": (1, 1, 1),
        "2": (2, 0, 1),
        "3-5": (1, 1, 1),
    }


def test_the_report_gives_recall_by_the_attempts_payments(run: Replayed) -> None:
    parts = split(run, "attempt")
    doc, _ = train([parts.learn], [parts.cut], SMALL)
    report = scored(doc, parts.score)
    sizes = [len(members) for _, members in parts.score.attempts]
    by_hand = {"1": 0, "2": 0, "3-5": 0, "6+": 0}
    for n in sizes:
        by_hand["1" if n == 1 else "2" if n == 2 else "3-5" if n <= 5 else "6+"] += 1
    assert {k: v["attempts"] for k, v in report["per_size"].items()} == {
        k: v for k, v in by_hand.items() if v
    }
    own = sum(round(v["own_typology"] * v["attempts"]) for v in report["per_size"].values())
    assert own == round(report["own_typology"] * report["attempts"])
    for budget in report["alert_budgets"]:  # each budget's recall, band by band, adds up
        right = sum(
            round(share * report["per_size"][k]["attempts"])
            for k, share in budget["own_typology_by_size"].items()
        )
        assert right == round(budget["own_typology"] * report["attempts"])
    lines = rendered(report)
    assert any(line.startswith("by the attempt's payments: ") for line in lines)
    assert sum("own typology by the attempt's payments: " in line for line in lines) == len(
        report["alert_budgets"]
    )


def test_a_budget_shows_its_lowest_typology_and_laundering_no_attempt_names_is_none(run: Replayed) -> None:
    parts = split(run, "attempt")
    doc, _ = train([parts.learn], [parts.cut], SMALL)
    report = scored(doc, parts.score)
    budget = report["alert_budgets"][0]
    budget["own_typology_each"] = {UNNAMED: 0.0, "random": 0.5, "cycle": 0.9}
    lines = [line for line in rendered(report) if line.startswith("alert budget ")]
    assert "(lowest random 0.500)" in lines[0]


def train_model(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aml_app.cli", "train-model", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two days of the calibrated simulator in AMLworld's layout (Trans.csv, Patterns.txt)."""
    folder = tmp_path_factory.mktemp("history")
    small = ("--days", "2", "--per-hour", "50", "--attempts", "6", "--seed", "43")
    simulate = subprocess.run(
        [sys.executable, "-m", "aml_app.cli", "simulate-amlworld", str(folder), *small],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert simulate.returncode == 0, simulate.stderr
    return folder


def test_the_command_trains_a_model_the_worker_loads_and_reports_on_the_scored_part(
    tmp_path: Path, history: Path
) -> None:
    folder = history
    out, report = tmp_path / "model.json", tmp_path / "report.json"
    done = train_model(
        str(folder / "Trans.csv"),
        str(folder / "Patterns.txt"),
        "--split",
        "attempt",
        "--folds",
        "2",
        "--max-benign",
        "300",
        "--max-iter",
        "20",
        "--out",
        str(out),
        "--report",
        str(report),
    )
    assert done.returncode == 0, done.stderr
    assert "train-model: read " in done.stderr and "fitting the trees" in done.stderr
    model = load(str(out))
    assert model is not None and BENIGN in model.classes
    doc = json.loads(out.read_text())
    assert doc["training"]["history"]["split"] == "attempt"
    written = json.loads(report.read_text())
    assert written["attempts"] > 0 and "estimated at the base rate HI" in done.stdout
    assert f"the queue, ranked by each alert's score: {written['queue']['alerts']:,} alerts" in done.stdout
    read = re.search(r"read ([0-9,]+) payments", done.stderr)
    assert read is not None, done.stderr
    # The trees learned from the learning and cut parts' payments (in two folds), the report read the
    # scored part only.
    assert doc["training"]["history"]["folds"] == 2 and "scoring fold 2 of 2" in done.stderr
    # By default the laundering payments are learnt by the typology they look like.
    assert "labelled_by_look" in doc["training"] and "by the typology they look like" in done.stderr
    assert 0 < doc["training"]["payments"] < 0.8 * int(read[1].replace(",", ""))
    assert 0 < written["payments"] < 0.4 * int(read[1].replace(",", ""))
    # Each fit learnt from 300 of the benign payments, the cut was set on all of them.
    assert doc["training"]["benign_learnt"] == 300 < doc["training"]["per_class"][BENIGN]
    assert f"trees to 300 of {doc['training']['per_class'][BENIGN]:,} benign payments" in done.stderr
    # Every fit took the iterations asked for (`--max-iter`): 20 rounds of each class's trees.
    assert doc["training"]["params"]["max_iter"] == 20
    assert f"fitted {20 * len(doc['classes']):,} trees to 300" in done.stderr
    assert doc["training"]["held_out"]["benign_payments"] > doc["training"]["per_class"][BENIGN]


def test_the_model_is_trained_with_the_deployments_settings_and_runs_only_with_them(
    tmp_path: Path, history: Path
) -> None:
    """The features read the rules' hits, amounts in the reporting currency and C's near-threshold count:
    a model trained with the defaults and run in euros, or with another rule threshold, reads numbers it
    never learnt from. The command replays with the deployment's settings and records them; the worker
    starts only with the settings its model was trained with."""
    euros = {"AML_REPORTING_CURRENCY": "EUR", "AML_RULE_FAN_IN_MIN_COUNTERPARTIES": "5"}
    out = tmp_path / "model.json"
    small = ("--split", "attempt", "--folds", "2", "--max-benign", "300", "--max-iter", "5")
    done = train_model(
        str(history / "Trans.csv"), str(history / "Patterns.txt"), *small, "--out", str(out), env=euros
    )
    assert done.returncode == 0, done.stderr
    in_dollars = tmp_path / "dollars.json"
    done = train_model(
        str(history / "Trans.csv"), str(history / "Patterns.txt"), *small, "--out", str(in_dollars)
    )
    assert done.returncode == 0, done.stderr
    # The replay computed the features in euros: a typical benign payment's amount is another number.
    typical = {path: json.loads(path.read_text())["benign_typical"][0] for path in (out, in_dollars)}
    assert typical[out] != typical[in_dollars], typical
    recorded = json.loads(out.read_text())["training"]["settings"]
    assert recorded == record(AmlThresholds.from_env(euros), DEFAULT_THRESHOLD, DEFAULT_BAND), (
        "the file records the settings the command ran with"
    )
    assert load(str(out), None, load_settings(euros).model_settings()) is not None
    with pytest.raises(
        ConfigError,
        match=r"^AML_MODEL='.*model.json' was trained with AML_REPORTING_CURRENCY=EUR, but this worker has "
        r"AML_REPORTING_CURRENCY=USD: train a model with this deployment's settings",
    ):
        load(str(out), None, load_settings({}).model_settings())
    with pytest.raises(
        ConfigError, match=r"trained with AML_RULE_FAN_IN_MIN_COUNTERPARTIES=5, but this worker has .*=4"
    ):
        load(
            str(out),
            None,
            load_settings({**euros, "AML_RULE_FAN_IN_MIN_COUNTERPARTIES": ""}).model_settings(),
        )
    # The shipped model records nothing: it was trained with the defaults.
    assert load("amlworld", None, load_settings({}).model_settings()) is not None
    with pytest.raises(
        ConfigError, match=r"^AML_MODEL='amlworld' was trained with AML_REPORTING_CURRENCY=USD"
    ):
        load("amlworld", None, load_settings({"AML_REPORTING_CURRENCY": "EUR"}).model_settings())


def test_cross_validated_the_command_scores_every_attempt_once_and_writes_a_model_of_all(
    tmp_path: Path, history: Path
) -> None:
    out, report = tmp_path / "model.json", tmp_path / "report.json"
    files = (str(history / "Trans.csv"), str(history / "Patterns.txt"))
    done = train_model(
        *files, "--split", "attempt", "--folds", "2", "--cross-validate", "2", "--by-attempt",
        "--max-iter", "20", "--out", str(out), "--report", str(report),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "cross-validation 2 of 2: training without part 2" in done.stderr
    whole = read_history(files)
    replayed = replay_timeline(whole.payments, whole.attempts, unnamed=True)
    written = json.loads(report.read_text())
    assert written["cross_validated"] == 2 and "rules beside each model" in done.stdout
    assert written["payments"] == len(whole.payments)
    assert written["attempts"] == len([m for _, m in replayed.attempts if m]) > 0
    doc = json.loads(out.read_text())
    assert doc["training"]["history"]["cross_validated"] == 2
    two_party = sum(p.payer != p.payee for p in whole.payments)
    assert doc["training"]["payments"] == two_party  # the model written learnt from every payment


@pytest.mark.parametrize("given", [("--cross-validate", "1"), ("--cross-validate", "3", "--folds", "0")])
def test_a_cross_validation_the_history_cannot_hold_is_refused(
    tmp_path: Path, given: tuple[str, ...]
) -> None:
    history = tmp_path / "Trans.csv"  # refused before it is read
    history.write_text(HEADER + "\n")
    done = train_model(str(history), "--out", str(tmp_path / "m.json"), *given)
    assert done.returncode == 2
    assert "--cross-validate takes at least 2 parts" in done.stderr


def test_the_command_refuses_a_bad_history_in_one_sentence(tmp_path: Path) -> None:
    bad = tmp_path / "Trans.csv"
    bad.write_text("when,who\n1,2\n")
    done = train_model(str(bad), "--out", str(tmp_path / "model.json"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("Error: ")
    assert "no model was written" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "model.json").exists()
    both = train_model("--simulated", str(bad), "--out", str(tmp_path / "model.json"))
    assert both.returncode == 2 and "one of the two" in both.stderr
    scored_on_training = train_model("--simulated", "--score-seeds", "1,3", "--out", str(tmp_path / "m.json"))
    assert (
        scored_on_training.returncode == 2
        and "seeds [3] are read by the training" in scored_on_training.stderr
    )


def test_a_history_without_laundering_to_learn_from_is_refused(tmp_path: Path) -> None:
    benign = tmp_path / "Trans.csv"
    benign.write_text("\n".join([HEADER, *(row(m, f"A{m}", f"B{m}", "10.00", 0) for m in range(30))]) + "\n")
    done = train_model(str(benign), "--out", str(tmp_path / "model.json"))
    assert done.returncode == 1 and "needs both benign and laundering payments" in done.stderr


def test_a_history_whose_only_laundering_is_a_self_payment_is_refused(tmp_path: Path) -> None:
    """The trees learn only from payments between two parties: it wrote a benign-only model that could
    never alert."""
    own = row(3, "L", "L", "9000.00", 1).replace(",002,", ",001,")  # one bank, one account: a self-payment
    rows = [row(m, f"A{m}", f"B{m}", "10.00", 0) for m in range(30)] + [own]
    history = tmp_path / "Trans.csv"
    history.write_text("\n".join([HEADER, *rows]) + "\n")
    done = train_model(str(history), "--split", "attempt", "--out", str(tmp_path / "model.json"))
    assert done.returncode == 1 and "benign and laundering payments between two parties" in done.stderr
    assert not (tmp_path / "model.json").exists()


def test_a_scored_part_without_an_attempt_is_refused_before_training(tmp_path: Path) -> None:
    """Its report formatted no figures (a traceback after the model was written)."""
    rows = [row(m, f"A{m}", f"B{m}", "10.00", 0) for m in range(60)]
    rows += [row(m, f"L{m}", f"M{m}", "9000.00", 1) for m in range(1, 9)]
    history = tmp_path / "Trans.csv"
    history.write_text("\n".join([HEADER, *rows]) + "\n")
    done = train_model(str(history), "--max-iter", "5", "--out", str(tmp_path / "model.json"))
    assert done.returncode == 1, done.stderr
    assert "the scored part holds no laundering attempt" in done.stderr and "Traceback" not in done.stderr


def test_an_out_or_report_in_a_missing_folder_is_refused_before_the_history_is_read(tmp_path: Path) -> None:
    history = tmp_path / "Trans.csv"
    history.write_text(HEADER + "\n")
    for option in ("--out", "--report"):
        others = ["--out", str(tmp_path / "m.json")] if option == "--report" else []
        done = train_model(str(history), *others, option, str(tmp_path / "none" / "x.json"))
        assert done.returncode == 2, done.stderr
        assert "is not a folder this user may write" in done.stderr and "Traceback" not in done.stderr


def test_precision_at_the_top_of_the_queue_weighs_benign_alerts_by_the_base_rate() -> None:
    """100 laundering alerts and 20 benign ones; the part holds 100 laundering and 1,000 benign payments,
    so at one in 900 each benign alert stands for 899 / 10 of them."""
    ranked_right = queue_precision(
        [1.0 - i / 1000 for i in range(120)], [i < 100 for i in range(120)], 100, 1000
    )
    assert ranked_right["in the part"] == {"10": 1.0, "50": 1.0, "100": 1.0}
    assert ranked_right["HI (1 in 900)"] == {"10": 1.0, "50": 1.0, "100": 1.0}
    one_benign_first = queue_precision(
        [1.0 - i / 1000 for i in range(120)], [0 < i <= 100 for i in range(120)], 100, 1000
    )
    assert one_benign_first["in the part"] == {"10": 0.9, "50": 0.98, "100": 0.99}
    assert one_benign_first["HI (1 in 900)"]["10"] == 0.0  # the benign alert alone fills the top 10
    assert one_benign_first["HI (1 in 900)"]["100"] == round(11 / (89.9 + 11), 4)  # the first to hold 100
    assert queue_precision([0.5], [True], 1, 1)["in the part"]["10"] is None  # a queue shorter than k


def test_the_queue_places_the_first_benign_alert_by_score() -> None:
    """Alerts ranked by their score, the highest first and ties benign first (the worst they allow); a
    payment not alerted is not in the queue, however high its score; places count from 1."""
    run = Replayed(labels=[BENIGN, "cycle", BENIGN, "stack", BENIGN])
    named = [{"cycle"}, {"cycle"}, set(), {"stack"}, {"fan_in"}]
    score = np.array([0.5, 0.9, 0.99, 0.7, 0.5])
    queue = _queue(named, score, run, 2, 3)
    assert (queue["alerts"], queue["first_benign"]) == (4, 3)  # 0.9, 0.7, then the first of the 0.5s
    assert queue["precision_at_top"]["in the part"]["10"] is None  # four alerts: no top 10
    assert _queue([set(), {"cycle"}, set(), {"stack"}, set()], score, run, 2, 3)["first_benign"] is None
    tied = _queue([{"cycle"}, {"cycle"}], np.array([0.5, 0.5]), Replayed(labels=["cycle", BENIGN]), 1, 1)
    assert tied["first_benign"] == 1  # the benign alert of the tie first, though it came later


def test_a_benign_rate_of_none_alerted_is_bounded_and_the_precision_from_it_is_a_floor() -> None:
    """None alerted of 1,500 bounds the rate at about 0.18 % (one-sided 95 %), not at 0; the bound grows
    with what was alerted and never falls below it; precision with the rate at its bound is a floor."""
    assert 0.0017 < benign_rate_bound(0, 1500) < 0.0019
    bounds = [benign_rate_bound(k, 1500) for k in range(0, 30)]
    assert bounds == sorted(bounds) and all(b > k / 1500 for k, b in enumerate(bounds))
    assert benign_rate_bound(1500, 1500) == pytest.approx(1.0) and benign_rate_bound(0, 0) == 1.0
    found = estimates(0.6, 0.0, benign_rate_bound(0, 1500))
    hi = found["HI (1 in 900)"]
    assert hi["precision"] == 1.0 and 0 < hi["precision_at_least"] < 1.0
    p = BASE_RATES["HI (1 in 900)"]
    assert hi["precision_at_least"] == round(p * 0.6 / (p * 0.6 + (1 - p) * benign_rate_bound(0, 1500)), 4)
    assert (
        estimates(0.6, 0.01, 0.02)["LI (1 in 1,750)"]["precision_at_least"]
        < estimates(0.6, 0.01, 0.02)["LI (1 in 1,750)"]["precision"]
    )


def test_each_alert_budget_holds_the_detector_to_its_share_of_the_benign_payments(run: Replayed) -> None:
    """On the part that set them, the detector cut for a budget alerts at most that share of the benign
    payments, with some of the trained rules beside the model or none."""
    parts = split(run, "attempt")
    doc, _ = train([parts.learn], [parts.cut], SMALL)
    model = Model.from_json(doc)
    assert [rate for rate, _, _ in model.budgets] == sorted(ALERT_BUDGETS)
    benign = [i for i, label in enumerate(parts.cut.labels) if label == BENIGN]
    on_cut = within_budgets(model, parts.cut)
    on_scored = within_budgets(model, parts.score)
    for (rate, _, rules), cut_part, scored_part in zip(model.budgets, on_cut, on_scored, strict=True):
        assert model.within(rate).alerting_rules == rules and rules <= model.alerting_rules
        assert cut_part["budget"] == scored_part["budget"] == rate
        assert cut_part["benign_alerted"] <= int(rate * len(benign))
        assert cut_part["benign_share_upper_95"] == round(
            benign_rate_bound(cut_part["benign_alerted"], len(benign)), 5
        )
        assert set(cut_part["estimated_at_base_rate"]) == set(BASE_RATES)
    assert on_cut[-1]["benign_alerted"] > 0  # the largest budget alerts something: the check can fail


def test_an_alert_budget_picks_the_largest_of_the_files_not_above_it(tmp_path: Path, run: Replayed) -> None:
    parts = split(run, "attempt")
    doc, _ = train([parts.learn], [parts.cut], SMALL)
    model = Model.from_json(doc)
    budgets = {rate: (cut, rules) for rate, cut, rules in model.budgets}
    assert model.within(0.0015).cut == budgets[0.001][0]
    assert model.within(0.01).alerting_rules == budgets[0.01][1]
    with pytest.raises(ValueError, match=r"no alert budget at or below 0\.0001"):
        model.within(0.0001)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(doc))
    loaded = load(str(path), 0.002)
    assert loaded is not None and loaded.cut == budgets[0.002][0]
    with pytest.raises(ConfigError, match=r"^AML_ALERT_BUDGET=0.0001 does not fit AML_MODEL="):
        load(str(path), 0.0001)
    with pytest.raises(ConfigError, match="set AML_MODEL too"):
        load_settings({"AML_ALERT_BUDGET": "0.001"})
    with pytest.raises(ConfigError, match="out of range"):
        load_settings({"AML_ALERT_BUDGET": "2", "AML_MODEL": str(path)})
    budgeted = load_settings({"AML_ALERT_BUDGET": "0.001", "AML_MODEL": str(path)})
    assert budgeted.detection.aml_alert_budget == 0.001


def test_a_budget_keeps_the_rules_that_pay_their_way_and_drops_the_others() -> None:
    """A budget of 2 benign alerts in 1,000: a precise rule (cycle: 5 attempts, no benign alert) beside
    the model names what the model cannot see, a noisy one (fan-out: 5 benign alerts) does not fit. Taking
    every rule or none, the budget would have had the model alone, naming nothing."""
    classes = [BENIGN, "cycle", "fan_out"]
    benign, attempts = 1000, 5
    run = Replayed(
        payments=[SimpleNamespace(payer=f"a{i}", payee=f"b{i}") for i in range(benign + attempts)],
        labels=[BENIGN] * benign + ["cycle"] * attempts,
        rules=[["aml.fan_out"] if i < 5 else [] for i in range(benign)] + [["aml.cycle"]] * attempts,
        typologies=[["fan_out"] if i < 5 else [] for i in range(benign)] + [["cycle"]] * attempts,
        attempts=[("cycle", [benign + k]) for k in range(attempts)],
    )
    run.rows = [[0.0]] * len(run.payments)
    p = np.tile([0.9, 0.05, 0.05], (len(run.payments), 1))  # the model finds every payment benign
    p[:3] = [[0.1, 0.1, 0.8], [0.2, 0.1, 0.7], [0.3, 0.1, 0.6]]  # but three benign ones
    cut, rules = beside_for(0.002, [p], classes, [run], {"aml.cycle", "aml.fan_out"}, {})
    assert rules == {"aml.cycle"}
    assert 0.2 < cut < 0.3  # the two benign alerts the cycle rule leaves go to the model
    cut, rules = beside_for(0.0005, [p], classes, [run], {"aml.cycle", "aml.fan_out"}, {})
    assert rules == {"aml.cycle"} and cut == 0.0  # nothing left to the model, and the rule costs none
