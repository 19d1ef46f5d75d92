"""The learned AML model scoring a lane's batch at once (`Model.detect_many`) decides as it does one payment
at a time, on every real AMLworld payment: the same hits, reasons and figures. A row's probabilities do not
depend on the rows scored with it, and the compiled walk of the trees and its explanations (occlusion read
off the leaves a typical value changes) give what walking every tree node by node and scoring each
occluded row gives. Services B and C are the naive reference (`aml_app/training/replay.py`). How fast it is
belongs to `bench/model_cost.py`."""

from __future__ import annotations

import dataclasses
import json
import math
from decimal import Decimal
from typing import Any

import numpy as np
import pytest

from aml_app.detection import model as model_module
from aml_app.detection.evidence import Evidence
from aml_app.detection.exchange import ExchangeRates
from aml_app.detection.model import BENIGN, FEATURES, Model, features, load
from aml_app.detection.rules import Hit, aml_rules
from aml_app.detection.thresholds import AmlThresholds
from aml_app.errors import ConfigError
from aml_app.training.fit import SHIPPED_PATH
from tests.real_amlworld import real_decided

THRESHOLDS = AmlThresholds()


@pytest.fixture(scope="module")
def evidences() -> list[Evidence]:
    """The evidence of every payment of the real files, gate on."""
    assert THRESHOLDS == AmlThresholds()  # the thresholds the shared replay ran with
    return [evidence for _, evidence in real_decided()]


@pytest.fixture(scope="module")
def one_by_one(shipped: Model, evidences: list[Evidence]) -> list[list[Hit]]:
    return [shipped.detect(evidence, THRESHOLDS) for evidence in evidences]


@pytest.fixture(scope="module")
def rows(evidences: list[Evidence]) -> np.ndarray:
    """The feature rows of the real payments between two parties."""
    return np.array(
        [features(e, aml_rules(e, THRESHOLDS), THRESHOLDS) for e in evidences if e.payer != e.payee]
    )


def walked_node_by_node(model: Model, rows: np.ndarray) -> np.ndarray:
    """Class probabilities with every tree walked from its root, one level at a time (scikit-learn's
    rule: a missing value goes where the node says, else left when the value is at most the threshold)."""
    rows = np.atleast_2d(rows)
    at = np.broadcast_to(model.roots, (len(rows), len(model.roots))).copy()
    index = np.arange(len(rows))[:, None]
    for _ in range(model.depth):  # a leaf's children are itself
        x = rows[index, model.feature[at]]
        go_left = np.where(np.isnan(x), model.missing_left[at], x <= model.threshold[at])
        at = np.where(go_left, model.left[at], model.right[at])
    raw = model.baseline + model.value[at] @ model.tree_class
    exp = np.exp(raw - raw.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


def hit_node_by_node(model: Model, evidence: Evidence, thresholds: AmlThresholds) -> Hit | None:
    """The model's alert as scored one payment at a time: its row walked node by node, and for an alert
    each feature in turn given a typical benign payment's value, every row walked in the same pass (so
    that a row on the same leaves as the payment's has its probabilities to the last bit)."""
    if evidence.payer == evidence.payee:
        return None
    rules = aml_rules(evidence, thresholds)
    row = np.array(features(evidence, rules, thresholds))
    occluded = np.tile(row, (len(row), 1))
    np.fill_diagonal(occluded, model.benign_typical)
    walked = walked_node_by_node(model, np.vstack([row, occluded]))
    p, benign = walked[0], model.classes.index(BENIGN)
    beside = frozenset(hit.typology for hit in model.beside(rules, float(p[benign])))
    typology = model._verdict(p, beside)
    if typology is None:
        return None
    moved = walked[1:, benign] - p[benign]
    telling = [(int(i), float(row[i])) for i in np.argsort(-moved)[:3] if moved[i] > 0]
    return model._explained(telling, p.tolist(), typology, beside)


def test_a_batch_gives_each_payment_the_hits_it_gets_alone_on_every_real_payment(
    shipped: Model, evidences: list[Evidence], one_by_one: list[list[Hit]]
) -> None:
    """Every real payment, in batches of the sizes a lane takes: the same hits (rule, typology, reason,
    figures) as `Model.detect` one payment at a time."""
    assert len(evidences) == 11403
    alerted = sum(any(hit.rule == "aml.model" for hit in hits) for hits in one_by_one)
    assert alerted > 3000, "the real files give the model thousands of alerts to explain"
    for size in (7, 50, 200):
        batched = [
            hits
            for start in range(0, len(evidences), size)
            for hits in shipped.detect_many(evidences[start : start + size], THRESHOLDS)
        ]
        assert batched == one_by_one, f"batches of {size}"
    assert shipped.detect_many([], THRESHOLDS) == []


def test_the_compiled_walk_and_its_explanations_are_those_of_the_trees_walked_node_by_node(
    shipped: Model, evidences: list[Evidence], one_by_one: list[list[Hit]], rows: np.ndarray
) -> None:
    """The probabilities of every real row equal the node-by-node walk's (to the rounding of their
    sums); and one payment in ten, alerts and their reasons included, is alerted as the node-by-node walk
    with one occluded row per feature alerts it."""
    np.testing.assert_allclose(shipped.probabilities(rows), walked_node_by_node(shipped, rows), atol=1e-12)
    gaps = rows.copy()
    gaps[::3, FEATURES.index("amount")] = np.nan
    gaps[1::3, FEATURES.index("format_ach")] = np.nan
    np.testing.assert_allclose(shipped.probabilities(gaps), walked_node_by_node(shipped, gaps), atol=1e-12)
    checked = 0
    for evidence, hits in list(zip(evidences, one_by_one, strict=True))[::10]:
        mine = [dataclasses.replace(hit, score=None) for hit in hits if hit.rule == "aml.model"]
        assert (mine[0] if mine else None) == hit_node_by_node(shipped, evidence, THRESHOLDS)
        checked += bool(mine)
    assert checked > 300


def test_every_hit_on_a_payment_the_model_scores_carries_its_score(
    shipped: Model, evidences: list[Evidence], one_by_one: list[list[Hit]]
) -> None:
    """An alerted payment between two parties: each of its hits, the model's and the rules' beside it,
    carries 1 less the model's probability of benign, which ranks the analysts' queue; a self-payment's
    hits (the model does not score it) and the rules' without a model carry none."""
    benign = shipped.classes.index(BENIGN)
    scored = 0
    for evidence, hits in zip(evidences, one_by_one, strict=True):
        if hits:
            assert evidence.payer != evidence.payee  # no rule fires on a real self-payment
            row = features(evidence, aml_rules(evidence, THRESHOLDS), THRESHOLDS)
            p = float(shipped.probabilities(np.array([row]))[0, benign])
            assert [hit.score for hit in hits] == pytest.approx([1.0 - p] * len(hits), abs=1e-12)
            scored += 1
    assert scored > 3000
    hit = Hit(rule="aml.cycle", typology="cycle", reason="a loop.")
    assert model_module.scored([hit], math.nan) == [hit]  # a self-payment: not scored
    assert model_module.scored([hit], 0.25) == [dataclasses.replace(hit, score=0.75)]
    assert any(hit.rule != "aml.model" and hit.score is not None for hits in one_by_one for hit in hits), (
        "the rules beside the model alert some real payments"
    )
    rules_alone = [hit for evidence in evidences[:2000] for hit in aml_rules(evidence, THRESHOLDS)]
    assert rules_alone and all(hit.score is None for hit in rules_alone)


def test_a_rows_probabilities_do_not_depend_on_the_rows_scored_with_it(
    shipped: Model, rows: np.ndarray
) -> None:
    together = shipped.probabilities(rows)
    assert np.array_equal(together, np.vstack([shipped.probabilities(row) for row in rows]))
    assert np.array_equal(together[::-1], shipped.probabilities(rows[::-1]))
    assert shipped.verdicts(rows) == [shipped._verdict(p) for p in together]


def test_occlusion_read_off_the_trees_is_each_occluded_row_scored(shipped: Model, rows: np.ndarray) -> None:
    """For alerting rows, the rise of the probability of benign when each feature alone takes the typical
    value equals scoring that occluded row (0 exactly where the value moves no leaf)."""
    walk, benign = shipped._walk, shipped.classes.index(BENIGN)
    chosen = rows[:: max(1, len(rows) // 300)]
    bins, reached, leaves, raw = shipped._raw(chosen)
    p = model_module._softmax(raw)
    moved = walk.moved(bins, reached, leaves, raw, p[:, benign], benign)
    for k, row in enumerate(chosen[:60]):
        occluded = np.tile(row, (len(walk.used), 1))
        occluded[np.arange(len(walk.used)), walk.used] = shipped.benign_typical[walk.used]
        expected = shipped.probabilities(occluded)[:, benign] - p[k, benign]
        np.testing.assert_allclose(moved[k], expected, rtol=0, atol=1e-12)
        same = shipped._walk.bins(occluded) == shipped._walk.bins(row[None, :])
        assert (moved[k][same.all(axis=1)] == 0).all()


def test_the_leaf_of_a_mask_without_numpy_2s_bit_count() -> None:
    for dtype, bits in ((np.uint16, 16), (np.uint32, 32), (np.uint64, 64)):
        masks = np.array([1 << i for i in range(bits)], dtype=dtype)
        assert model_module._leaf_by_exponent(masks).tolist() == list(range(bits))
        assert model_module._leaf_by_count(masks).tolist() == list(range(bits))


def test_sums_in_the_reporting_currency_are_the_exchange_rates_totals(evidences: list[Evidence]) -> None:
    rates = THRESHOLDS.rates
    sums = [
        s
        for e in evidences[::7]
        for answer in (e.payer_aggregates, e.payee_aggregates)
        for window in answer.windows.values()
        for s in (window.sent, window.received)
    ]
    sums += [
        {},
        {"EUR": Decimal("1.005")},
        {"EUR": Decimal("0.015"), "USD": Decimal("2.675")},
        {"XXX": Decimal("12")},
        {"XXX": Decimal("12"), "JPY": Decimal("100000.129")},
        {"USD": Decimal("0.005")},
        {"USD": Decimal("0.015")},
    ]
    other = ExchangeRates("EUR", {"EUR": Decimal(1), "USD": Decimal("0.85")})
    for case in sums:
        assert model_module._in_reporting(rates, case) == float(rates.total(case)), case
        assert model_module._in_reporting(other, case) == float(other.total(case)), case


def test_trees_of_more_than_16_leaves_and_trees_that_are_not_trees(tmp_path: Any, rows: np.ndarray) -> None:
    """A tree of 40 leaves walks with 64-bit masks as node by node; a node reached twice, or a tree too
    deep for 64 leaves, is refused at start-up with one sentence."""
    doc = json.loads(SHIPPED_PATH.read_text())
    wide = json.loads(json.dumps(doc))
    wide["trees"][0] = chain(40, FEATURES.index("amount"))
    wide["depth"] = max(doc["depth"], 40)
    model = Model.from_json(wide)
    amounts = rows[::10].copy()
    amounts[:, FEATURES.index("amount")] = np.linspace(-1, 80, len(amounts))
    amounts[::7, FEATURES.index("amount")] = np.nan
    np.testing.assert_allclose(model.probabilities(amounts), walked_node_by_node(model, amounts), atol=1e-12)
    assert model._walk.reachable.dtype == np.uint64
    looping = json.loads(json.dumps(doc))
    tree = looping["trees"][0]
    internal = [i for i, leaf in enumerate(tree["leaf"]) if not leaf]
    tree["right"][internal[-1]] = internal[0]  # a node under the first one points back to it
    (tmp_path / "looping.json").write_text(json.dumps(looping))
    with pytest.raises(ConfigError, match="is not a tree"):
        load(str(tmp_path / "looping.json"))
    deep = json.loads(json.dumps(doc))
    deep["trees"][0] = chain(70, 0)
    (tmp_path / "deep.json").write_text(json.dumps(deep))
    with pytest.raises(ConfigError, match="deeper than 64"):
        load(str(tmp_path / "deep.json"))


def chain(leaves: int, feature: int) -> dict[str, Any]:
    """A tree of `leaves` leaves: node 2k splits `feature` at 2k, its left child is a leaf (value k / 10)
    and its right child the next split; the last node is a leaf too."""
    nodes = 2 * leaves - 1
    tree: dict[str, Any] = {"class": 0}
    internal = [i % 2 == 0 and i < nodes - 1 for i in range(nodes)]
    tree["feature"] = [feature] * nodes
    tree["threshold"] = [float(i) for i in range(nodes)]
    tree["missing_left"] = [i % 4 == 0 for i in range(nodes)]
    tree["left"] = [i + 1 if inner else 0 for i, inner in enumerate(internal)]
    tree["right"] = [i + 2 if inner else 0 for i, inner in enumerate(internal)]
    tree["leaf"] = [not inner for inner in internal]
    tree["value"] = [i / 20 for i in range(nodes)]
    return tree


def test_the_handler_runs_a_batch_through_the_batch_rules_once() -> None:
    """The detector hands a batch's evidence to the service's batch rules in one call; a service with
    per-payment rules only (fraud) gets them run one payment at a time."""
    from aml_app.worker.detector import Detector

    batches: list[list[str]] = []

    def many(facts: list[Any]) -> list[list[Hit]]:
        batches.append([f.payment_id for f in facts])
        return [[] for _ in facts]

    facts: list[Any] = [dataclasses.make_dataclass("F", ["payment_id"])(f"p{i}") for i in range(3)]
    Detector("aml", lambda one: [], None, batch_rules=many).run_rules(facts)  # type: ignore[arg-type]
    assert batches == [["p0", "p1", "p2"]]
    seen: list[str] = []
    Detector("fraud", lambda one: seen.append(one.payment_id) or [], None).run_rules(facts)  # type: ignore
    assert seen == ["p0", "p1", "p2"]
