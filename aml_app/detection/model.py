"""A learned AML model: gradient-boosted trees over what B and C say about a payment, opt-in.

Why: on real AMLworld data the rules leave attempts that B and C's answers do describe, but in no shape a
threshold names (a hub paid by three payers over five days, a lone heavy edge). Gradient-boosted trees
over graph features are the literature's strongest non-GNN baseline there. The model is trained on the
simulator calibrated to AMLworld (`aml-app train-model`, `aml_app.detection.training`), never on the
real files it is scored on, and is evaluated against the rules by `bench.model_vs_rules`.

It is off unless `AML_MODEL` names a model (`amlworld`: the one shipped with the package; or a path):
trained on one generator's traffic, it alerts far more of traffic shaped otherwise (BENCHMARKS.md,
"Rules, a model, or both"), so a deployment turns it on after checking its own traffic against the
calibrated simulator. With it on, the model decides with the rules whose precision on the training runs
was high (`alerting_rules` in the model file); the other rules' hits are its features, not alerts.

Inference needs numpy only: the trees are exported to JSON at training and walked here, all at once.
Each alert says why: the probability of benign against the cut, and the features that moved the
verdict most, each with the payment's value and a typical benign payment's (occlusion: the change in the
probability of benign when that one feature takes the benign value).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from aml_app.detection.evidence import Evidence
from aml_app.detection.rules import TYPOLOGIES, Hit, aml_rules
from aml_app.detection.thresholds import AmlThresholds
from aml_app.errors import ConfigError

MODEL_VARIABLE = "AML_MODEL"
SHIPPED = "amlworld"
SHIPPED_FILE = "amlworld_model.json"
BENIGN = "benign"
#: AMLworld's payment formats of payments between two parties (its `reinvestment` is a self-payment, which
# the model never scores). Every payment of LI-Medium's laundering attempts but one is ACH, against about
# one in seven of the real benign payments between two parties: the format is the strongest single sign.
# A payment whose channel is none of these (our own simulator's `card`, `web`, ...) has them all 0.
PAYMENT_FORMATS = ("ach", "wire", "cheque", "credit_card", "cash", "bitcoin")
#: The model's features, in the order of `features`: the payment, C's windows of payer and payee, what B
# says about the payer's payees (the one this payment goes to among them) and the payee's layering parts,
# the rules' verdicts and the payment's format. Every one reads a part the detector asks B for
# (`PAYER_PARTS`, `PAYEE_PARTS`): any other part is empty in the worker. Counts, sums and hours enter as
# log(1 + x); a payer's `*_forwarded` is log(1 + sent) - log(1 + received) in the window, so 0 is "paid
# on what came in".
_WINDOW_FIGURES = ("sent_count", "received_count", "sent_counterparties", "received_counterparties")
FEATURES: tuple[str, ...] = (
    "amount",
    *(
        f"{side}_{window}_{figure}"
        for side in ("payer", "payee")
        for window in ("1h", "24h", "7d")
        for figure in (*_WINDOW_FIGURES, "sent_total", "received_total")
    ),
    "payer_near_threshold_24h",
    "payee_near_threshold_24h",
    "payer_payees",
    "payer_new_payees_7d",
    "edge_payments",
    "edge_age_hours",
    "payer_24h_forwarded",
    "payer_7d_forwarded",
    "payee_loop_hops",
    "payee_flow_accounts",
    "payee_sources",
    "payee_co_payees",
    *(f"rule_{typology}" for typology in TYPOLOGIES),
    *(f"format_{name}" for name in PAYMENT_FORMATS),
)
_WEEK = timedelta(days=7)


def _log(value: float) -> float:
    return math.log1p(max(value, 0.0))


def features(evidence: Evidence, hits: Sequence[Hit], thresholds: AmlThresholds) -> list[float]:
    """What the detector sees about one payment, as the numbers the model reads (FEATURES)."""
    rates = thresholds.rates
    amount = rates.convert(evidence.amount, evidence.currency)
    row = [_log(float(amount or 0))]
    forwarded = []
    for answer in (evidence.payer_aggregates, evidence.payee_aggregates):
        for name in ("1h", "24h", "7d"):
            window = answer.window(name)
            sent, received = _log(float(rates.total(window.sent))), _log(float(rates.total(window.received)))
            row += [_log(getattr(window, figure)) for figure in _WINDOW_FIGURES] + [sent, received]
            if answer is evidence.payer_aggregates and name != "1h":
                forwarded.append(sent - received)
    row += [
        _log(evidence.payer_aggregates.near_threshold_24h),
        _log(evidence.payee_aggregates.near_threshold_24h),
    ]
    payer, payee = evidence.payer_relations, evidence.payee_relations
    edge = payer.out.get(evidence.payee)  # as of the payment's time: it counts this payment
    row += [
        _log(len(payer.out)),
        _log(sum(1 for e in payer.out.values() if evidence.ts - e.first_seen < _WEEK)),
        _log(edge.count if edge else 0),
        _log((evidence.ts - edge.first_seen).total_seconds() / 3600 if edge else 0),
        *forwarded,
        float(payee.loop.hops),
        float(len(payee.chain)),
        _log(len(payee.sources)),
        _log(len(payee.co_payees)),
    ]
    fired = {hit.typology for hit in hits}
    row += [float(typology in fired) for typology in TYPOLOGIES]
    channel = (evidence.channel or "").strip().lower().replace(" ", "_")
    row += [float(channel == name) for name in PAYMENT_FORMATS]
    return row


@dataclass(frozen=True)
class Model:
    """Exported gradient-boosted trees (multinomial), with the cut and the rules that alert beside it."""

    classes: tuple[str, ...]
    baseline: np.ndarray  # (classes,)
    tree_class: np.ndarray  # (trees, classes): one-hot, the class each tree adds to
    roots: np.ndarray  # (trees,): index of each tree's root in the node arrays
    feature: np.ndarray  # (nodes,)
    threshold: np.ndarray  # (nodes,): go left when the feature is <= it
    missing_left: np.ndarray  # (nodes,) bool
    left: np.ndarray  # (nodes,) global node index; a leaf's is itself
    right: np.ndarray  # (nodes,)
    value: np.ndarray  # (nodes,): a leaf's contribution to its class's raw score
    depth: int
    cut: float  # alert when the probability of benign is below it
    naming: np.ndarray  # (classes,): log weight added to each typology's probability before naming one
    alerting_rules: frozenset[str]
    benign_typical: np.ndarray  # (features,): a typical benign payment, for the explanation
    training: Mapping[str, Any]

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Model:
        if list(doc["features"]) != list(FEATURES):
            raise ValueError("the model was trained on other features than this program computes")
        trees = doc["trees"]
        roots, offset = [], 0
        columns: dict[str, list[Any]] = {
            k: [] for k in ("feature", "threshold", "missing_left", "left", "right", "leaf", "value")
        }
        for tree in trees:
            roots.append(offset)
            for key in columns:
                values = tree[key]
                if key in ("left", "right"):
                    values = [v + offset for v in values]
                columns[key] += values
            offset += len(tree["feature"])
        leaf = np.array(columns["leaf"], dtype=bool)
        itself = np.arange(len(leaf))
        left = np.where(leaf, itself, np.array(columns["left"], dtype=int))
        right = np.where(leaf, itself, np.array(columns["right"], dtype=int))
        classes = tuple(doc["classes"])
        if BENIGN not in classes:
            raise ValueError(f"the model has no {BENIGN!r} class")
        return cls(
            classes=classes,
            baseline=np.array(doc["baseline"], dtype=float),
            tree_class=np.eye(len(classes))[[t["class"] for t in trees]],
            roots=np.array(roots, dtype=int),
            feature=np.array(columns["feature"], dtype=int),
            threshold=np.array(columns["threshold"], dtype=float),
            missing_left=np.array(columns["missing_left"], dtype=bool),
            left=left,
            right=right,
            value=np.array(columns["value"], dtype=float),
            depth=int(doc["depth"]),
            cut=float(doc["cut"]),
            naming=np.array([float(doc.get("naming_prior", {}).get(c, 0.0)) for c in classes]),
            alerting_rules=frozenset(doc["alerting_rules"]),
            benign_typical=np.array(doc["benign_typical"], dtype=float),
            training=dict(doc.get("training", {})),
        )

    def probabilities(self, rows: np.ndarray) -> np.ndarray:
        """(rows, classes) class probabilities: every tree walked for every row at once."""
        rows = np.atleast_2d(np.asarray(rows, dtype=float))
        at = np.broadcast_to(self.roots, (len(rows), len(self.roots))).copy()
        index = np.arange(len(rows))[:, None]
        missing = bool(np.isnan(rows).any())
        for _ in range(self.depth):  # a leaf's children are itself: walking on stays there
            x = rows[index, self.feature[at]]
            go_left = x <= self.threshold[at]
            if missing:
                go_left = np.where(np.isnan(x), self.missing_left[at], go_left)
            at = np.where(go_left, self.left[at], self.right[at])
        raw = self.baseline + self.value[at] @ self.tree_class
        raw -= raw.max(axis=1, keepdims=True)
        exp = np.exp(raw)
        return exp / exp.sum(axis=1, keepdims=True)

    def _verdict(self, p: np.ndarray) -> str | None:
        """The typology the model names for one row's probabilities when benign is below the cut, else
        None: the likeliest once each is weighed by the naming prior (`bench.train_model.naming_prior`)."""
        benign = self.classes.index(BENIGN)
        if not p[benign] < self.cut:
            return None
        weighed = np.log(np.maximum(p, 1e-300)) + self.naming
        weighed[benign] = -np.inf
        return self.classes[int(weighed.argmax())]

    def verdicts(self, rows: np.ndarray) -> list[str | None]:
        """Per row of features, the typology the model alerts (what `hit` says), or None: many rows at
        once, for the benches that score a model on features replayed once."""
        return [self._verdict(p) for p in self.probabilities(rows)]

    def hit(self, evidence: Evidence, hits: Sequence[Hit], thresholds: AmlThresholds) -> Hit | None:
        """The model's alert about this payment, saying why, or None."""
        if evidence.payer == evidence.payee:
            return None
        row = np.array(features(evidence, hits, thresholds))
        benign = self.classes.index(BENIGN)
        p = self.probabilities(row)[0]
        typology = self._verdict(p)
        if typology is None:
            return None
        best = self.classes.index(typology)
        # Occlusion: each feature in turn takes a typical benign payment's value.
        occluded = np.tile(row, (len(row), 1))
        np.fill_diagonal(occluded, self.benign_typical)
        moved = self.probabilities(occluded)[:, benign] - p[benign]
        telling = [i for i in np.argsort(-moved)[:3] if moved[i] > 0]
        because = [
            f"{FEATURES[i]} {_shown(FEATURES[i], row[i])} "
            f"(benign typically {_shown(FEATURES[i], self.benign_typical[i])})"
            for i in telling
        ]
        return Hit(
            rule="aml.model",
            typology=self.classes[best],
            reason=(
                f"the model puts the chance that this payment is benign at {p[benign]:.4f}, below its cut "
                f"{self.cut:.4f}, and names {self.classes[best]} (probability {p[best]:.4f}); most telling: "
                + ("; ".join(because) or "no single feature")
                + "."
            ),
            figures={
                "benign_probability": f"{p[benign]:.6f}",
                "cut": f"{self.cut:.6f}",
                f"{self.classes[best]}_probability": f"{p[best]:.6f}",
                **{FEATURES[i]: _shown(FEATURES[i], row[i]) for i in telling},
            },
        )

    def detect(self, evidence: Evidence, thresholds: AmlThresholds) -> list[Hit]:
        """The rules that alert beside the model, then the model's own alert."""
        hits = aml_rules(evidence, thresholds)
        model_hit = self.hit(evidence, hits, thresholds)
        kept = [hit for hit in hits if hit.rule in self.alerting_rules]
        return kept + ([model_hit] if model_hit is not None else [])


def _shown(name: str, value: float) -> str:
    """A feature as the analyst reads it: counts and sums undone from log(1 + x)."""
    if name.startswith("rule_"):
        return "fired" if value else "did not fire"
    if name.startswith("format_"):
        return "yes" if value else "no"
    if name.endswith("_hops") or name == "payee_flow_accounts":
        return str(int(value))
    if name.endswith("_forwarded"):
        return f"{math.exp(value):.2f} times what came in"
    plain = math.expm1(value)
    return f"{plain:.2f}" if "total" in name or name == "amount" else str(round(plain))


@functools.cache
def load(source: str) -> Model | None:
    """The model `AML_MODEL` names: '' (off, None), 'amlworld' (shipped) or a path; read once per
    process. A model that cannot be read is a configuration error: the command line reads it before the
    worker starts, so it stops there with one sentence."""
    source = source.strip()
    if not source or source.lower() == "off":
        return None
    try:
        if source == SHIPPED:
            text = resources.files("aml_app.detection").joinpath(SHIPPED_FILE).read_text()
        else:
            text = Path(source).read_text()
        return Model.from_json(json.loads(text))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{MODEL_VARIABLE}={source!r} is not a readable AML model: {exc}.") from None
