"""The learned AML model: its trees walked here as scikit-learn walks them, its training reproducible, the
shipped file what the training command makes, its figures on real AMLworld data as published, and each
alert saying why. Services B and C are the naive reference (`aml_app/training/replay.py`)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from aml_app.detection.evidence import Cycle
from aml_app.detection.model import (
    BENIGN,
    FEATURES,
    PAYMENT_FORMATS,
    SHIPPED,
    Model,
    _shown,
    features,
    load,
    typologies_named,
)
from aml_app.detection.rules import RULE_STRENGTH, TYPOLOGIES, Hit, aml_rules, strengthened
from aml_app.detection.thresholds import AmlThresholds
from aml_app.settings import ConfigError, load_settings
from aml_app.training.fit import (
    ALERT_BUDGETS,
    CUT_RATE,
    PARAMS,
    RULE_VETO,
    RUNS,
    SCORED_SEEDS,
    SHIPPED_PATH,
    SHIPPED_VETO,
    Replayed,
    calibrated_run,
    named_right,
    naming_prior,
    replay,
    sample_weights,
    train,
)
from aml_app.training.holdout import queue_of, rules_queue, within_budgets
from aml_app.training.replay import Services, timeline_of
from bench.amlworld_detection import judge, with_evidence
from bench.model_spread import CUT_SEEDS, TRAININGS, alerts
from bench.model_vs_rules import detectors, ours
from tests.real_amlworld import real_decided, real_files

SMALL = {"max_iter": 20, "max_leaf_nodes": 7, "learning_rate": 0.1}

#: The shipped model (`AML_MODEL=amlworld`) on the real data, gate on (docs/detection.md, BENCHMARKS.md).
PUBLISHED = {"own_recall": 0.818, "any_recall": 0.989, "benign_alerted": 48, "f1": 0.971}


@pytest.fixture(scope="module")
def small_runs() -> list[Replayed]:
    """Two runs to learn from and one to set the cut on."""
    return [replay(*calibrated_run(seed, days=2, per_hour=50, attempts=4)) for seed in (5, 6, 7)]


@pytest.fixture(scope="module")
def small_model(small_runs: list[Replayed]) -> dict[str, Any]:
    """The model file trained on the small runs (SMALL), once for the tests that read it."""
    doc, _ = train(small_runs[:2], small_runs[2:], SMALL)
    return doc


@pytest.fixture(scope="module")
def real() -> tuple[Any, Any, list[Any]]:
    return real_files()


@pytest.mark.parametrize("leaves", [7, 40])
def test_the_trees_walked_here_give_scikit_learns_probabilities(
    small_runs: list[Replayed], leaves: int
) -> None:
    """Trees of up to 16 leaves and wider ones (walked with wider masks); a row scored alone or with the
    others has the same probabilities."""
    doc, fitted = train(small_runs[:2], small_runs[2:], {**SMALL, "max_leaf_nodes": leaves})
    model = Model.from_json(json.loads(json.dumps(doc)))
    assert (max(sum(tree["leaf"]) for tree in doc["trees"]) > 16) == (leaves > 16)
    rows = np.array([row for run in small_runs for row in run.rows])
    assert list(model.classes) == [str(c) for c in fitted.classes_]
    np.testing.assert_allclose(model.probabilities(rows), fitted.predict_proba(rows), rtol=0, atol=1e-12)
    with_gaps = rows.copy()
    with_gaps[::3, 0] = np.nan  # a missing value goes the way the tree learned for it
    np.testing.assert_allclose(
        model.probabilities(with_gaps), fitted.predict_proba(with_gaps), rtol=0, atol=1e-12
    )
    assert np.array_equal(
        model.probabilities(with_gaps[:300]), np.vstack([model.probabilities(row) for row in with_gaps[:300]])
    )


def test_a_two_class_model_file_gives_scikit_learns_probabilities(small_runs: list[Replayed]) -> None:
    """A history labelled by payment only (a transactions file, no patterns): scikit-learn fits one tree
    an iteration, the log-odds of the second class. Exported as the first class's, the file's P(benign)
    was the trees' P(laundering) (0.87 apart on a real sample), and a file written so is refused."""
    binary = [
        dataclasses.replace(run, labels=[BENIGN if label == BENIGN else "laundering" for label in run.labels])
        for run in small_runs
    ]
    doc, fitted = train(binary[:2], binary[2:], SMALL)
    assert fitted.n_trees_per_iteration_ == 1 and doc["classes"] == [BENIGN, "laundering"]
    model = Model.from_json(json.loads(json.dumps(doc)))
    rows = np.array([row for run in binary for row in run.rows])
    np.testing.assert_allclose(model.probabilities(rows), fitted.predict_proba(rows), rtol=0, atol=1e-12)
    wrong = {**doc, "baseline": doc["baseline"][1:], "trees": [{**t, "class": 0} for t in doc["trees"]]}
    with pytest.raises(ValueError, match="do not match its 2 classes"):
        Model.from_json(wrong)


def test_the_tests_fit_trees_on_one_openmp_thread_per_process() -> None:
    """`make test`'s two processes share two cores: a second OpenMP thread in each only contends with
    the other process's trees."""
    importlib.import_module("sklearn.ensemble")  # loads the OpenMP runtime the trees are fitted on
    pools = [pool for pool in threadpool_info() if pool["user_api"] == "openmp"]
    assert pools and [pool["num_threads"] for pool in pools] == [1] * len(pools)


def test_training_weighs_each_attempt_alike_and_each_class_alike() -> None:
    """A lone payment's attempt weighs as much as a four-payment attempt of its typology; self-payments
    are not trained on; every class weighs the same in all."""
    pay = lambda payer, payee: SimpleNamespace(payer=payer, payee=payee)  # noqa: E731
    run = Replayed(
        payments=[pay("a", "b"), pay("c", "d"), pay("d", "e"), pay("e", "f"), pay("f", "g"), pay("h", "h")]
        + [pay("x", "y")] * 3,
        labels=["fan_out"] * 5 + [BENIGN] * 4,
        attempts=[("fan_out", [0]), ("fan_out", [1, 2, 3, 4])],
    )
    weight = sample_weights([run])
    assert len(weight) == 8  # the self-payment h -> h is left out
    np.testing.assert_allclose(weight[:5], [2.0, 0.5, 0.5, 0.5, 0.5])  # lone: 4 times each of the four's
    assert weight[:5].sum() == pytest.approx(weight[5:].sum()) == pytest.approx(4.0)
    np.testing.assert_allclose(sample_weights([run], attempts_alike=False)[:5], [0.8] * 5)


def test_training_gives_the_same_file_from_the_same_seeds(
    small_runs: list[Replayed], small_model: dict[str, Any]
) -> None:
    """A seed's run, replayed again, gives the same rows; the same rows train the same file."""
    again = replay(*calibrated_run(7, days=2, per_hour=50, attempts=4))
    assert again.rows == small_runs[2].rows and again.labels == small_runs[2].labels
    second, _ = train(small_runs[:2], [again], SMALL)
    assert json.dumps(small_model, sort_keys=True) == json.dumps(second, sort_keys=True)


def test_the_cut_holds_the_whole_detector_to_its_benign_rate_on_runs_it_never_saw(
    small_runs: list[Replayed], small_model: dict[str, Any]
) -> None:
    """The model and the rules that alert beside it together alert at most CUT_RATE of the held-out run's
    benign payments; the rules' share, where the model does not veto them, is taken from the model's."""
    doc = small_model
    model = Model.from_json(doc)
    assert model.rule_veto == RULE_VETO
    held = small_runs[2]
    benign = [i for i, label in enumerate(held.labels) if label == BENIGN]
    probability = model.probabilities(np.array(held.rows))[:, model.classes.index(BENIGN)]
    two_party = {i for i in benign if held.payments[i].payer != held.payments[i].payee}
    fired = {i for i in benign if model.alerting_rules.intersection(held.rules[i])}
    by_rules = {i for i in fired if i not in two_party or model.keeps_rules(probability[i])}
    by_model = {i for i in two_party if probability[i] < model.cut}
    assert fired, "the held-out run gives the rules beside the model benign payments to alert"
    assert fired - by_rules, "and the model vetoes some of them, which the cut does not count"
    assert len(by_rules | by_model) <= int(CUT_RATE * len(benign))
    assert doc["training"]["held_out"] == {
        "benign_payments": len(benign),
        "alerted_by_rules": len(by_rules),
        "left_to_the_model": int(CUT_RATE * len(benign)) - len(by_rules),
    }


def test_the_shipped_model_is_what_the_training_command_makes(shipped: Model) -> None:
    """`aml-app train-model` with its defaults writes the shipped file (compared byte for byte
    when it was trained: BENCHMARKS.md); here, that the file records those defaults."""
    doc = json.loads(SHIPPED_PATH.read_text())
    assert doc["features"] == list(FEATURES)
    assert doc["training"]["runs"] == RUNS
    assert doc["training"]["params"] == PARAMS
    assert doc["training"]["attempts_alike"] is True
    assert doc["training"]["cut_rate"] == CUT_RATE
    assert shipped.alerting_rules == {"aml.cycle", "aml.pass_through", "aml.random", "aml.scatter_gather"}
    assert "rule_veto" not in doc and SHIPPED_VETO is None and shipped.rule_veto is None
    assert [b["benign_rate"] for b in doc["alert_budgets"]] == list(ALERT_BUDGETS)
    budgeted = load(SHIPPED, 0.001)  # AML_ALERT_BUDGET=0.001: a tighter cut, two rules beside it
    assert budgeted is not None and budgeted.cut < shipped.cut
    assert budgeted.alerting_rules == {"aml.cycle", "aml.scatter_gather"}


def test_the_calibrated_runs_models_are_scored_on_are_none_they_learn_from_or_cut_on() -> None:
    assert not set(SCORED_SEEDS) & (set(RUNS["seeds"]) | set(RUNS["held_out"]))
    for training in TRAININGS.values():
        assert not set(SCORED_SEEDS) & (set(training.seeds) | set(training.held_out))
    assert not set(SCORED_SEEDS) & set(CUT_SEEDS)


@pytest.fixture(scope="module")
def fired_on_real(shipped: Model, real: tuple[Any, Any, list[Any]]) -> dict[str, Any]:
    """What the rules and the shipped model alert on the real data, replayed once for the tests."""
    fired, _ = detectors(real[2], shipped, pairs=real_decided())
    return fired


def test_the_shipped_model_on_real_amlworld_holds_the_published_figures(
    real: tuple[Any, Any, list[Any]], fired_on_real: dict[str, Any]
) -> None:
    patterns, background, timeline = real
    fired = fired_on_real
    doc = judge(patterns, background, fired["model"], with_evidence(timeline))
    assert doc["all"]["own_recall"] == pytest.approx(PUBLISHED["own_recall"], abs=0.001)
    assert doc["all"]["any_recall"] == pytest.approx(PUBLISHED["any_recall"], abs=0.001)
    assert doc["benign"]["alerted"] <= PUBLISHED["benign_alerted"], doc["benign"]
    assert doc["payments"]["f1"] >= PUBLISHED["f1"]
    rules = judge(patterns, background, fired["rules"], with_evidence(timeline))
    assert doc["all"]["own_recall"] > rules["all"]["own_recall"]


def test_the_shipped_budgets_on_real_amlworld_hold_the_published_figures(
    shipped: Model, real: tuple[Any, Any, list[Any]]
) -> None:
    """BENCHMARKS.md, "Rules, a model, or both": at 0.2 % the shipped file alerts 4 of the 7,494 real
    benign payments, the goal's share, keeping cycle and scatter-gather beside the model; at 0.1 %
    none."""
    patterns, background, _ = real
    found = {
        b["budget"]: b for b in within_budgets(shipped, replay(patterns, background, pairs=real_decided()))
    }
    assert (found[0.001]["own_typology"], found[0.001]["benign_alerted"]) == (
        pytest.approx(0.781, abs=0.001),
        0,
    )
    assert (found[0.002]["own_typology"], found[0.002]["benign_alerted"]) == (
        pytest.approx(0.796, abs=0.001),
        4,
    )


def test_the_shipped_models_queue_on_real_amlworld_is_the_one_its_alerts_scores_rank(
    shipped: Model, real: tuple[Any, Any, list[Any]]
) -> None:
    """BENCHMARKS.md, "Rules, a model, or both": ranked by their `score`, the shipped model's 3,780 alerts
    on the real files hold their first benign one at place 3,204. The detector's alerts, ranked by the
    score each carries (none: last), make that queue, place for place."""
    patterns, background, _ = real
    queue = queue_of(shipped, replay(patterns, background, pairs=real_decided()))
    assert (queue["alerts"], queue["first_benign"]) == (3780, 3204)
    assert {v for at in queue["precision_at_top"].values() for v in at.values()} == {1.0}
    decided = real_decided()
    scored = []
    for start in range(0, len(decided), 100):
        batch = decided[start : start + 100]
        for (payment, _), hits in zip(
            batch, shipped.detect_many([e for _, e in batch], AmlThresholds()), strict=True
        ):
            if hits:
                scored.append((max(h.score or 0.0 for h in hits), payment.is_laundering))
    ranked = sorted(scored, key=lambda alert: -alert[0])
    assert len(ranked) == queue["alerts"]
    assert [laundering for _, laundering in ranked].index(False) + 1 == queue["first_benign"]


def test_the_rules_queue_on_real_amlworld_ranks_by_their_strength(real: tuple[Any, Any, list[Any]]) -> None:
    """BENCHMARKS.md, "Rules, a model, or both": ranked by the strongest rule that fired (`RULE_STRENGTH`;
    alerts of one score benign first), the rules' 2,432 alerts on the real files hold their first benign
    one at place 786; in the order the payments came, the first alert is benign. The worker's hits,
    strengthened, rank that queue."""
    patterns, background, _ = real
    queue = rules_queue(replay(patterns, background, pairs=real_decided()))
    assert (queue["alerts"], queue["first_benign"]) == (2432, 786)
    assert {v for at in queue["precision_at_top"].values() for v in at.values()} == {1.0}
    scored = [
        (max(hit.score or 0.0 for hit in hits), payment.is_laundering)
        for payment, evidence in real_decided()
        if (hits := strengthened(aml_rules(evidence, AmlThresholds())))
    ]
    ranked = sorted(scored, key=lambda alert: (-alert[0], alert[1]))
    assert len(ranked) == queue["alerts"]
    assert [laundering for _, laundering in ranked].index(False) + 1 == queue["first_benign"]
    assert not scored[0][1]


def test_a_data_set_without_payment_formats_is_judged_too() -> None:
    """Our own simulator's payments carry no AMLworld format: its lone benign payments count as unknown."""
    patterns, background = ours(11, 1000)
    doc = judge(patterns, background, {}, with_evidence(timeline_of(patterns, background)))
    assert doc["benign"]["lone"] > 0 and doc["benign"]["lone_by_format"] == {"unknown": doc["benign"]["lone"]}


def test_scoring_replayed_features_gives_the_detectors_alerts(
    shipped: Model, real: tuple[Any, Any, list[Any]], fired_on_real: dict[str, Any]
) -> None:
    """`bench.model_spread` scores models on features replayed once; its alerts must be the detector's,
    payment for payment, as `bench.model_vs_rules` replays it."""
    patterns, background, _ = real
    from_rows = alerts(shipped, replay(patterns, background, pairs=real_decided()))
    assert from_rows == fired_on_real["model"]
    assert any("aml.model" in hit for hits in from_rows.values() for hit in hits)


def _evidence(timeline: list[Any], wanted: Any) -> Any:
    """The evidence about the first payment of `timeline` (the real files') for which `wanted(evidence)`
    is true."""
    assert timeline == real_files()[2]
    for _, evidence in real_decided():
        if wanted(evidence):
            return evidence
    raise AssertionError("no such payment")


def test_a_model_alert_says_why(shipped: Model, real: tuple[Any, Any, list[Any]]) -> None:
    thresholds = AmlThresholds()
    evidence = _evidence(real[2], lambda e: shipped.hit(e, aml_rules(e, thresholds), thresholds) is not None)
    hit = shipped.hit(evidence, aml_rules(evidence, thresholds), thresholds)
    assert hit is not None and hit.rule == "aml.model" and hit.typology in shipped.classes
    assert float(hit.figures["benign_probability"]) < shipped.cut
    assert (
        "below its cut" in hit.reason and "most telling: " in hit.reason and "benign typically" in hit.reason
    )
    named = [name for name in hit.figures if name in FEATURES]
    assert 1 <= len(named) <= 3 and all(name in hit.reason for name in named)
    strict = dataclasses.replace(shipped, cut=0.0)
    assert strict.hit(evidence, aml_rules(evidence, thresholds), thresholds) is None


def test_a_self_payment_is_never_alerted_by_the_model(
    shipped: Model, real: tuple[Any, Any, list[Any]]
) -> None:
    thresholds = AmlThresholds()
    evidence = _evidence(real[2], lambda e: e.payer == e.payee)
    assert dataclasses.replace(shipped, cut=1.01).hit(evidence, [], thresholds) is None


def unscored(hits: list[Hit]) -> list[Hit]:
    """`hits` without the model's score of their payment (`Hit.score`): the rules' hits as they fired."""
    return [dataclasses.replace(hit, score=None) for hit in hits]


@pytest.fixture(scope="module")
def fanning(real: tuple[Any, Any, list[Any]]) -> tuple[Any, list[Any]]:
    """A real payment on which the fan-out rule fires (a rule the shipped model keeps as a feature), and
    the rules' hits on it."""
    thresholds = AmlThresholds()
    evidence = _evidence(real[2], lambda e: any(h.rule == "aml.fan_out" for h in aml_rules(e, thresholds)))
    return evidence, aml_rules(evidence, thresholds)


def test_only_the_models_alerting_rules_alert_beside_it(
    shipped: Model, fanning: tuple[Any, list[Any]]
) -> None:
    thresholds = AmlThresholds()
    evidence, rules = fanning
    quiet = dataclasses.replace(shipped, cut=0.0)  # the model itself never alerts
    assert unscored(quiet.detect(evidence, thresholds)) == [
        h for h in rules if h.rule in shipped.alerting_rules
    ]
    assert "aml.fan_out" not in {h.rule for h in quiet.detect(evidence, thresholds)}
    everything = dataclasses.replace(quiet, alerting_rules=frozenset(h.rule for h in rules))
    assert unscored(everything.detect(evidence, thresholds)) == rules


def test_the_rules_beside_the_model_are_vetoed_where_it_finds_the_payment_benign(
    shipped: Model, fanning: tuple[Any, list[Any]]
) -> None:
    thresholds = AmlThresholds()
    evidence, rules = fanning
    everything = dataclasses.replace(shipped, cut=0.0, alerting_rules=frozenset(h.rule for h in rules))
    [mine], [benign] = everything.judge([evidence], [rules], thresholds)
    assert mine is None and 0 < benign < 1
    assert everything.rule_veto is None and unscored(everything.detect(evidence, thresholds)) == rules
    vetoed = dataclasses.replace(everything, rule_veto=benign)  # as likely benign as the veto: no alert
    assert vetoed.detect(evidence, thresholds) == []
    kept = dataclasses.replace(everything, rule_veto=math.nextafter(benign, 1.0))
    assert unscored(kept.detect(evidence, thresholds)) == rules
    assert vetoed.keeps_rules(math.nan)  # a self-payment: the model does not score it, so vetoes nothing
    doc = {**json.loads(SHIPPED_PATH.read_text()), "rule_veto": 0.5}
    assert Model.from_json(doc).rule_veto == 0.5 and Model.from_json(doc).within(0.001).rule_veto == 0.5


def test_the_model_names_past_what_the_rules_beside_it_name(
    shipped: Model, real: tuple[Any, Any, list[Any]]
) -> None:
    """A file with `names_past_rules`: on a real payment where a rule beside the model names a typology
    the model finds likeliest too, the model names the likeliest other one and says why; where no rule
    beside it names one, or without the flag, it names the likeliest."""
    thresholds = AmlThresholds()
    evidence = _evidence(
        real[2],
        lambda e: (
            len({h.typology for h in aml_rules(e, thresholds) if h.rule in shipped.alerting_rules}) == 1
        ),
    )
    rules = aml_rules(evidence, thresholds)
    [beside] = {h.typology for h in rules if h.rule in shipped.alerting_rules}
    leaning = np.where(np.array(shipped.classes) == beside, 50.0, 0.0)  # the rule's typology the likeliest
    plain = dataclasses.replace(shipped, cut=1.01, naming=leaning, rule_veto=None, names_past_rules=False)
    past = dataclasses.replace(plain, names_past_rules=True)
    [mine] = [h for h in plain.detect(evidence, thresholds) if h.rule == "aml.model"]
    assert mine.typology == beside and "do not name" not in mine.reason
    found = past.detect(evidence, thresholds)
    assert unscored([h for h in found if h.rule != "aml.model"]) == [
        h for h in rules if h.rule in shipped.alerting_rules
    ]
    [second] = [h for h in found if h.rule == "aml.model"]
    p = past.probabilities(np.array(past.rows([evidence], [rules], thresholds)[1]))[0]
    others = [c for c, name in enumerate(past.classes) if name not in (BENIGN, beside)]
    assert second.typology == past.classes[max(others, key=lambda c: math.log(p[c]) + leaning[c])]
    assert f"the likeliest the rules beside it do not name ({beside})" in second.reason
    alone = dataclasses.replace(past, alerting_rules=frozenset())  # no rule beside it: the likeliest
    assert [h.typology for h in alone.detect(evidence, thresholds)] == [beside]
    named_past = typologies_named(
        np.array([[0.1, 0.5, 0.4], [0.1, 0.5, 0.4]]),
        [BENIGN, "a", "b"],
        np.zeros(3),
        [frozenset({"a"}), frozenset({"a", "b"})],
    )
    assert named_past == ["b", "a"]  # every typology named beside it: the likeliest
    assert Model.from_json(json.loads(SHIPPED_PATH.read_text())).names_past_rules
    doc = json.loads(SHIPPED_PATH.read_text())
    del doc["names_past_rules"]  # a file trained without it names the likeliest
    assert not Model.from_json(doc).names_past_rules


def test_aml_model_is_off_by_default_and_a_bad_one_fails_at_start_up(tmp_path: Path) -> None:
    assert load_settings({}).detection.aml_model == "" and load("") is None
    assert load_settings({"AML_MODEL": "off"}).detection.aml_model == ""
    assert load_settings({"AML_MODEL": "amlworld"}).detection.aml_model == "amlworld"
    with pytest.raises(
        ConfigError, match=r"^AML_MODEL='/no/such/file' is neither 'amlworld', 'off' nor a model"
    ):
        load_settings({"AML_MODEL": "/no/such/file"})
    other = json.loads(SHIPPED_PATH.read_text())
    other["features"] = other["features"][:-1]
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ConfigError, match="trained on other features"):
        load(str(tmp_path / "other.json"))
    # The command line reads the model before anything starts (the broker here answers nothing), and
    # stops with the sentence.
    env = {**os.environ, "AML_MODEL": str(tmp_path / "other.json"), "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    done = subprocess.run(
        [sys.executable, "-m", "aml_app.cli", "worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done
    assert done.stderr.startswith("aml-app: configuration error: AML_MODEL="), done.stderr
    assert "trained on other features" in done.stderr


def test_the_features_read_only_the_parts_the_detector_asks_b_for() -> None:
    """B answers the detector `PAYER_PARTS` about the payer and `PAYEE_PARTS` about the payee; the other
    parts are empty in the worker, so a feature that read one would mean one thing in training and another
    in production."""
    thresholds = AmlThresholds()
    services = Services(thresholds)
    timeline = [
        SimpleNamespace(
            payment_id=f"p{i}",
            payer=payer,
            payee=payee,
            amount=Decimal("5000"),
            currency="USD",
            ts=f"2022-09-01T00:{i:02d}:00+00:00",
        )
        for i, (payer, payee) in enumerate([("c", "a"), ("a", "b"), ("b", "a")])
    ]
    for payment in timeline:
        services.feed(payment)
    evidence = services.evidence(timeline[-1])
    edge = next(iter(evidence.payer_relations.out.values()))
    cycle = Cycle(found=True, path=("b", "a", "b"))
    unasked = {"in_": {"a": edge}, "cycle": cycle, "neighbourhood": {"a": 1, "c": 2}}
    told = dataclasses.replace(
        evidence,
        payer_relations=dataclasses.replace(evidence.payer_relations, **unasked),
        payee_relations=dataclasses.replace(evidence.payee_relations, out={"b": edge}, **unasked),
    )
    hits = aml_rules(evidence, thresholds)
    assert features(told, hits, thresholds) == features(evidence, hits, thresholds)


def test_the_amount_figures_set_the_payment_against_the_accounts_own_flows() -> None:
    """A hop that passes on what it received reads 0 against what came in; three like parts of a split
    read 0 against the payer's mean; a payee paid by four alike holds a quarter of its week's inflow."""
    thresholds = AmlThresholds()
    services = Services(thresholds)
    paid = [
        ("source", "hop", "9000"),  # the hop receives 9,000 ...
        ("hop", "next", "9000"),  # ... and passes it on
        *((f"payer{i}", "collector", "2500") for i in range(4)),  # a collector paid by four alike
        *(("splitter", f"part{i}", "3000") for i in range(3)),  # a split into three like parts
    ]
    timeline = [
        SimpleNamespace(
            payment_id=f"p{i}",
            payer=payer,
            payee=payee,
            amount=Decimal(amount),
            currency="USD",
            ts=f"2022-09-01T{i:02d}:00:00+00:00",
        )
        for i, (payer, payee, amount) in enumerate(paid)
    ]
    for payment in timeline:
        services.feed(payment)

    def figures(index: int) -> dict[str, float]:
        evidence = services.evidence(timeline[index])
        row = features(evidence, aml_rules(evidence, thresholds), thresholds)
        return {name: value for name, value in zip(FEATURES, row, strict=True) if "_amount_" in name}

    hop, collector, part = figures(1), figures(5), figures(8)
    assert hop["payer_24h_amount_vs_received"] == pytest.approx(0.0)
    assert hop["payer_7d_amount_vs_received"] == pytest.approx(0.0)
    assert hop["payer_7d_amount_share"] == pytest.approx(0.0)  # its only payment out
    assert part["payer_7d_amount_vs_sent_mean"] == pytest.approx(
        math.log1p(3000) - math.log1p(9000) + math.log(3)
    )
    assert part["payer_7d_amount_share"] == pytest.approx(math.log1p(3000) - math.log1p(9000))
    assert part["payer_7d_amount_vs_received"] == pytest.approx(math.log1p(3000))  # nothing came in
    assert collector["payee_7d_amount_share"] == pytest.approx(math.log1p(2500) - math.log1p(10000))
    assert collector["payee_7d_amount_vs_received_mean"] == pytest.approx(
        math.log1p(2500) - math.log1p(10000) + math.log(4)
    )
    # As an alert's explanation shows them: ratios, not counts undone from log(1 + x).
    assert (
        _shown("payer_7d_amount_vs_received", hop["payer_7d_amount_vs_received"]) == "1.00 times what came in"
    )
    assert _shown("payer_7d_amount_vs_sent_mean", math.log(0.5)) == "0.50 times its mean payment"
    assert _shown("payee_7d_amount_share", math.log(0.25)) == "0.25 of the week's total"


def test_the_model_reads_the_payments_format_as_amlworld_names_it() -> None:
    """AMLworld's formats are the payment's channel (`import-amlworld` writes `ACH` as `ach`); any other
    channel, or none, leaves every format feature 0."""
    thresholds = AmlThresholds()
    services = Services(thresholds)
    payment = SimpleNamespace(
        payment_id="p0",
        payer="a",
        payee="b",
        amount=Decimal("5000"),
        currency="USD",
        ts="2022-09-01T00:00:00Z",
    )
    services.feed(payment)
    columns = [i for i, name in enumerate(FEATURES) if name.startswith("format_")]
    assert [FEATURES[i] for i in columns] == [f"format_{name}" for name in PAYMENT_FORMATS]

    def formats(channel: str | None) -> dict[str, float]:
        evidence = services.evidence(SimpleNamespace(**vars(payment), channel=channel))
        assert evidence.channel == channel
        row = features(evidence, [], thresholds)
        return {FEATURES[i]: row[i] for i in columns if row[i]}

    assert formats("ach") == formats("ACH") == {"format_ach": 1.0}
    assert formats("Credit Card") == formats("credit_card") == {"format_credit_card": 1.0}
    assert formats(None) == formats("web") == formats("reinvestment") == {}


def test_the_naming_prior_names_what_catches_most_attempts_and_leaves_the_alerts_as_they_are() -> None:
    """Payments alike in two typologies (a stack's first layer is a bipartite edge): the trees name
    bipartite, the likelier per payment, though two attempts of three are stacks. The prior found on the
    held-out runs names stack there; which payments alert stays the cut's."""
    classes = [BENIGN, "bipartite", "stack"]
    alike = [0.01, 0.50, 0.49]
    fitted = SimpleNamespace(
        classes_=np.array(classes), predict_proba=lambda rows: np.array([alike] * len(rows))
    )
    payments = [SimpleNamespace(payer=f"a{i}", payee=f"b{i}") for i in range(3)]
    run = Replayed(
        payments=payments,
        rows=[[0.0]] * 3,
        labels=["stack", "stack", "bipartite"],
        rules=[[], [], []],
        typologies=[[], [], []],
        attempts=[("stack", [0]), ("stack", [1]), ("bipartite", [2])],
    )
    probabilities = fitted.predict_proba(run.rows)
    assert named_right(probabilities, classes, 0.05, run, set(), np.zeros(3)) == 1
    prior = naming_prior([probabilities], classes, 0.05, [run], set())
    assert prior["stack"] > prior["bipartite"]
    weights = np.array([0.0, prior["bipartite"], prior["stack"]])
    assert named_right(probabilities, classes, 0.05, run, set(), weights) == 2
    assert named_right(probabilities, classes, 0.005, run, set(), weights) == 0  # none alerts: none named

    shipped = load("amlworld")
    assert shipped is not None
    p = np.zeros(len(shipped.classes))
    (
        p[shipped.classes.index(BENIGN)],
        p[shipped.classes.index("bipartite")],
        p[shipped.classes.index("stack")],
    ) = alike
    plain = dataclasses.replace(shipped, naming=np.zeros(len(shipped.classes)))
    assert plain._verdict(p) == "bipartite"
    leaning = dataclasses.replace(plain, naming=np.where(np.array(shipped.classes) == "stack", 0.25, 0.0))
    assert leaning._verdict(p) == "stack"
    p[shipped.classes.index(BENIGN)] = 0.9
    assert leaning._verdict(p) is None
    doc = json.loads(SHIPPED_PATH.read_text())
    assert set(doc["naming_prior"]) == set(shipped.classes) - {BENIGN}
    del doc["naming_prior"]  # a model trained without one names the likeliest
    assert not Model.from_json(doc).naming.any()


def test_training_counts_the_models_second_name_beside_a_rule() -> None:
    """An A -> B -> A pair the file calls a stack: the cycle rule beside the model names its second
    payment cycle, and the trees find cycle likeliest there too. The training's count (what the naming
    prior and the budgets' rules are chosen by) takes the model's name past the rule's: stack, right."""
    classes = [BENIGN, "cycle", "stack"]
    payments = [SimpleNamespace(payer="a", payee="b"), SimpleNamespace(payer="b", payee="a")]
    run = Replayed(
        payments=payments,
        rows=[[0.0]] * 2,
        labels=["stack", "stack"],
        rules=[[], ["aml.cycle"]],
        typologies=[[], ["cycle"]],
        attempts=[("stack", [0, 1])],
    )
    probabilities = np.array([[0.9, 0.06, 0.04], [0.01, 0.6, 0.39]])  # only the second alerts
    assert named_right(probabilities, classes, 0.05, run, {"aml.cycle"}, np.zeros(3)) == 1
    assert named_right(probabilities, classes, 0.05, run, set(), np.zeros(3)) == 0  # no rule: cycle
    # the model vetoes the rule where it finds the payment benign enough: then it names cycle itself
    assert named_right(probabilities, classes, 0.05, run, {"aml.cycle"}, np.zeros(3), veto=0.005) == 0


def test_a_payment_dated_in_the_first_week_of_year_one_gets_its_features(
    shipped: Model, real: tuple[Any, Any, list[Any]]
) -> None:
    """The contract accepts years 0001-9999; the model's week-long horizon stops at the earliest instant
    rather than overflow (B and C clamp their windows the same way)."""
    thresholds = AmlThresholds()
    evidence = _evidence(real[2], lambda e: e.payer != e.payee and e.payer_relations.out)
    early = datetime(1, 1, 2, tzinfo=UTC)
    dated = dataclasses.replace(
        evidence,
        ts=early,
        payer_aggregates=dataclasses.replace(evidence.payer_aggregates, at=early),
        payee_aggregates=dataclasses.replace(evidence.payee_aggregates, at=early),
    )
    row = features(dated, [], thresholds)
    assert len(row) == len(FEATURES)
    # Every payee B knows of was first paid after the week's start, which is the earliest instant.
    assert row[FEATURES.index("payer_new_payees_7d")] == row[FEATURES.index("payer_payees")] > 0
    shipped.hit(dated, aml_rules(dated, thresholds), thresholds)


def test_the_rules_strengths_are_their_precision_on_the_runs_the_shipped_model_learns_from() -> None:
    """The rules alone rank their alerts by `RULE_STRENGTH`: what the shipped model's training measured
    on its calibrated runs, every AML rule's, and each hit scored by its own rule's."""
    precision = json.loads(SHIPPED_PATH.read_text())["training"]["rule_precision"]
    assert RULE_STRENGTH == precision
    assert set(RULE_STRENGTH) == {f"aml.{typology}" for typology in TYPOLOGIES}
    hits = [Hit("aml.cycle", "cycle", "r"), Hit("aml.fan_out", "fan_out", "r")]
    assert [hit.score for hit in strengthened(hits)] == [precision["aml.cycle"], precision["aml.fan_out"]]
