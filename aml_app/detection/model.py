"""A learned AML model: gradient-boosted trees over what B and C say about a payment, opt-in.

Why: on real AMLworld data the rules leave attempts that B and C's answers do describe, but in no shape a
threshold names (a hub paid by three payers over five days, a lone heavy edge). Gradient-boosted trees
over graph features are the literature's strongest non-GNN baseline there. The model is trained on the
simulator calibrated to AMLworld (`make model`, which runs `aml-app train-model --simulated`), never on the
real files it is scored on, and is evaluated against the rules by `bench.model_vs_rules`.

It is off unless `AML_MODEL` names a model (`amlworld`: the one shipped with the package; or a path):
trained on one generator's traffic, it alerts far more of traffic shaped otherwise (BENCHMARKS.md,
"Rules, a model, or both"), so a deployment turns it on after checking its own traffic against the
calibrated simulator. With it on, the model decides with the rules whose precision on the training runs
was high (`alerting_rules` in the model file); the other rules' hits are its features, not alerts. A file
that names a `rule_veto` lets those rules alert only where the model does not find the payment at least
that likely benign (`Model.keeps_rules`). A file with `names_past_rules` has the model name the likeliest
typology the rules alerting beside it have not named on the payment: one payment graph carries several
typologies in AMLworld (an A -> B -> A pair is a stack, a cycle, a scatter-gather or a gather-scatter), and
a second name gives the analyst a second hypothesis where the same one would add nothing.

Inference needs numpy only: the trees are exported to JSON at training and compiled here (`_Walk`) into
one bit mask per feature, bin and tree, so that the worker scores a lane's whole batch in a few array
operations (`Model.detect_many`; `Model.detect` is a batch of one, with the same hits). Each alert says
why: the probability of benign against the cut, and the features that moved the verdict most, each with
the payment's value and a typical benign payment's (occlusion: the change in the probability of benign
when that one feature takes the benign value, read off the few leaves that value changes).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from importlib import resources
from math import log1p
from pathlib import Path
from typing import Any

import numpy as np

from aml_app.detection.evidence import Evidence
from aml_app.detection.exchange import CENT, ExchangeRates
from aml_app.detection.model_settings import mismatch, trained_with
from aml_app.detection.rules import TYPOLOGIES, Hit, aml_rules
from aml_app.detection.thresholds import AmlThresholds
from aml_app.errors import ConfigError

MODEL_VARIABLE = "AML_MODEL"
BUDGET_VARIABLE = "AML_ALERT_BUDGET"
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
# on what came in". The `*_amount_*` figures set the payment's amount (log(1 + x)) against the account's
# own flows, since a tree splits one feature at a time and cannot draw a ratio: `vs_received`, what the
# payer received in the window (0: a hop passing on what came in, as AMLworld's random walks and stacks
# do); `vs_*_mean`, the account's mean payment out or in over the week (log(1 + total) - log(count):
# parts of one split alike); `share`, the week's total out of the payer or into the payee.
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
    "payer_24h_amount_vs_received",
    "payer_7d_amount_vs_received",
    "payer_7d_amount_vs_sent_mean",
    "payee_7d_amount_vs_received_mean",
    "payer_7d_amount_share",
    "payee_7d_amount_share",
    *(f"rule_{typology}" for typology in TYPOLOGIES),
    *(f"format_{name}" for name in PAYMENT_FORMATS),
)
_WEEK = timedelta(days=7)
#: Where a week's horizon stops for a payment in the contract's first week (year 0001) instead of overflowing.
_EARLIEST = datetime.min.replace(tzinfo=UTC)
_WINDOWS = ("1h", "24h", "7d")
#: Where the payer's 24 h and 7 d sent totals are in a row (its received totals follow them).
_PAYER_24H_SENT = FEATURES.index("payer_24h_sent_total")
_PAYER_7D_SENT = FEATURES.index("payer_7d_sent_total")
#: Where the payer's 7 d sent count and the payee's 7 d received count and total are in a row.
_PAYER_7D_SENT_COUNT = FEATURES.index("payer_7d_sent_count")
_PAYEE_7D_RECEIVED_COUNT = FEATURES.index("payee_7d_received_count")
_PAYEE_7D_RECEIVED = FEATURES.index("payee_7d_received_total")


def _log(value: float) -> float:
    return math.log1p(max(value, 0.0))


def features(evidence: Evidence, hits: Sequence[Hit], thresholds: AmlThresholds) -> list[float]:
    """What the detector sees about one payment, as the numbers the model reads (FEATURES)."""
    rates = thresholds.rates
    amount = rates.convert(evidence.amount, evidence.currency)
    payer_aggregates, payee_aggregates = evidence.payer_aggregates, evidence.payee_aggregates
    payer, payee = evidence.payer_relations, evidence.payee_relations
    # The figures that enter as log(1 + x), in the order of FEATURES.
    plain: list[float] = [float(amount or 0)]
    for answer in (payer_aggregates, payee_aggregates):
        windows = answer.windows
        for name in _WINDOWS:
            sent_count, received_count, payees, payers, sent, received = _window_figures(windows[name])
            plain += (
                sent_count,
                received_count,
                payees,
                payers,
                _in_reporting(rates, sent) if sent else 0.0,
                _in_reporting(rates, received) if received else 0.0,
            )
    edge = payer.out.get(evidence.payee)  # as of the payment's time: it counts this payment
    week_ago = evidence.ts - _WEEK if evidence.ts - _EARLIEST > _WEEK else _EARLIEST
    plain += (
        payer_aggregates.near_threshold_24h,
        payee_aggregates.near_threshold_24h,
        len(payer.out),
        sum(1 for e in payer.out.values() if e.first_seen > week_ago),
        edge.count if edge else 0,
        (evidence.ts - edge.first_seen).total_seconds() / 3600 if edge else 0,
    )
    row = list(map(log1p, plain)) if min(plain) >= 0 else list(map(_log, plain))
    amount_in = row[0]
    sent_count, received_count = plain[_PAYER_7D_SENT_COUNT], plain[_PAYEE_7D_RECEIVED_COUNT]
    row += (
        row[_PAYER_24H_SENT] - row[_PAYER_24H_SENT + 1],  # payer_24h_forwarded
        row[_PAYER_7D_SENT] - row[_PAYER_7D_SENT + 1],  # payer_7d_forwarded
        float(payee.loop.hops),
        float(len(payee.chain)),
        log1p(len(payee.sources)),
        log1p(len(payee.co_payees)),
        amount_in - row[_PAYER_24H_SENT + 1],  # payer_24h_amount_vs_received
        amount_in - row[_PAYER_7D_SENT + 1],  # payer_7d_amount_vs_received
        # payer_7d_amount_vs_sent_mean, payee_7d_amount_vs_received_mean
        amount_in - row[_PAYER_7D_SENT] + math.log(sent_count) if sent_count > 0 else 0.0,
        amount_in - row[_PAYEE_7D_RECEIVED] + math.log(received_count) if received_count > 0 else 0.0,
        amount_in - row[_PAYER_7D_SENT],  # payer_7d_amount_share
        amount_in - row[_PAYEE_7D_RECEIVED],  # payee_7d_amount_share
    )
    row += _rule_flags(frozenset(hit.typology for hit in hits)) if hits else _NO_RULE
    row += _format_flags(evidence.channel)
    return row


_window_figures = operator.attrgetter(*_WINDOW_FIGURES, "sent", "received")


def _in_reporting(rates: ExchangeRates, sums: Mapping[str, Decimal]) -> float:
    """`rates.total(sums)` as a float: per-currency sums in the reporting currency, to the cent (a sum in
    one currency, the usual case, without `total`'s loop)."""
    if len(sums) != 1:
        return float(rates.total(sums))
    ((currency, amount),) = sums.items()
    converted = rates.convert(amount, currency)
    return 0.0 if converted is None else float(converted.quantize(CENT, ROUND_HALF_EVEN))


@functools.lru_cache(maxsize=1024)
def _rule_flags(fired: frozenset[str]) -> tuple[float, ...]:
    """Which rules fired, one flag per TYPOLOGIES."""
    return tuple(float(typology in fired) for typology in TYPOLOGIES)


_NO_RULE = _rule_flags(frozenset())


@functools.lru_cache(maxsize=256)
def _format_flags(channel: str | None) -> tuple[float, ...]:
    """The payment's format as AMLworld names it (its channel), one flag per PAYMENT_FORMATS."""
    name = (channel or "").strip().lower().replace(" ", "_")
    return tuple(float(name == known) for known in PAYMENT_FORMATS)


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
    #: (share of benign payments alerted, cut, rules alerting beside the model), lowest share first: what
    #: `within` chooses from.
    budgets: tuple[tuple[float, float, frozenset[str]], ...] = ()
    #: A rule beside the model alerts a payment only where the model's probability of benign is below
    #: this (`keeps_rules`); None (a file trained without it): wherever the rule fires.
    rule_veto: float | None = None
    #: Name the likeliest typology the rules alerting beside the model have not named on the payment
    #: (`typologies_named`); False (a file trained without it): the likeliest.
    names_past_rules: bool = False

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
        if len(doc["baseline"]) != len(classes) or any(not 0 <= t["class"] < len(classes) for t in trees):
            raise ValueError(
                f"the model's baseline and trees do not match its {len(classes)} classes (written by an "
                "aml-app train-model that exported two-class models wrong: train it again)"
            )
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
            budgets=tuple(
                sorted(
                    (float(b["benign_rate"]), float(b["cut"]), frozenset(b["alerting_rules"]))
                    for b in doc.get("alert_budgets", [])
                )
            ),
            rule_veto=None if doc.get("rule_veto") is None else float(doc["rule_veto"]),
            names_past_rules=bool(doc.get("names_past_rules", False)),
        )

    def within(self, budget: float) -> Model:
        """This model cut for an alert budget (`AML_ALERT_BUDGET`: a share of benign payments alerted):
        the largest budget of the model file not above it, with its cut and the rules that alert beside
        the model there. Analysts size their queue by a budget; the file's budgets were set on held-out
        runs, as its own cut was. Raises ValueError in one sentence when the file has none that fits."""
        fitting = [b for b in self.budgets if b[0] <= budget]
        if not fitting:
            offered = ", ".join(f"{rate:g}" for rate, _, _ in self.budgets) or "none"
            raise ValueError(
                f"the model has no alert budget at or below {budget:g} (its budgets: {offered}; "
                "aml-app train-model writes them)"
            )
        _, cut, rules = fitting[-1]
        return dataclasses.replace(self, cut=cut, alerting_rules=rules)

    def keeps_rules(self, benign: float) -> bool:
        """Whether the rules beside the model alert a payment the model puts at probability `benign` of
        being benign (NaN: a self-payment, which it does not score). Not where the model finds it at least
        `rule_veto` likely benign: the trees read every rule's verdict as a feature, and where they still
        call the payment benign they have seen that rule fire on payments like it that were (a hub paying
        many parties fires the fan-out rule on every payment)."""
        return rules_kept(benign, self.rule_veto)

    @functools.cached_property
    def _walk(self) -> _Walk:
        """The trees compiled for walking many rows at once (built once per model, on first use)."""
        return _Walk.of(self)

    def _raw(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per row: the bins of its features, the leaf it reaches in each tree (`_Walk.leaves`: as a
        mask and as an index), and the raw scores per class."""
        walk = self._walk
        bins = walk.bins(rows)
        reached, leaves = walk.leaves(bins)
        return bins, reached, leaves, self.baseline + walk.raw(leaves)

    def probabilities(self, rows: np.ndarray) -> np.ndarray:
        """(rows, classes) class probabilities: every tree walked for every row at once. A row's
        probabilities do not depend on the other rows scored with it."""
        rows = np.atleast_2d(np.asarray(rows, dtype=float))
        return _softmax(self._raw(rows)[3])

    def _verdict(self, p: np.ndarray, beside: frozenset[str] = frozenset()) -> str | None:
        """The typology the model names for one row's probabilities when benign is below the cut, else
        None (`typologies_named`); `beside`: the typologies the rules alerting beside the model name."""
        return self._names(np.asarray(p)[None, :], [beside])[0]

    def _names(self, p: np.ndarray, beside: Sequence[frozenset[str]] | None = None) -> list[str | None]:
        """`_verdict` of each row of probabilities, `beside` each (None: no rule names any)."""
        benign = self.classes.index(BENIGN)
        named: list[str | None] = [None] * len(p)
        alerting = np.flatnonzero(p[:, benign] < self.cut)
        if len(alerting):
            past = (
                None
                if beside is None or not self.names_past_rules
                else [beside[j] for j in alerting.tolist()]
            )
            names = typologies_named(p[alerting], self.classes, self.naming, past)
            for j, name in zip(alerting.tolist(), names, strict=True):
                named[j] = name
        return named

    def verdicts(self, rows: np.ndarray, beside: Sequence[frozenset[str]] | None = None) -> list[str | None]:
        """Per row of features, the typology the model alerts (what `hit` says), or None: many rows at
        once, for the benches that score a model on features replayed once. `beside`: per row, the
        typologies the rules alerting beside the model name (`beside`)."""
        return self._names(self.probabilities(rows), beside)

    def hit(self, evidence: Evidence, hits: Sequence[Hit], thresholds: AmlThresholds) -> Hit | None:
        """The model's alert about this payment, saying why, or None."""
        return self.hits([evidence], [hits], thresholds)[0]

    def hits(
        self, evidences: Sequence[Evidence], rule_hits: Sequence[Sequence[Hit]], thresholds: AmlThresholds
    ) -> list[Hit | None]:
        """The model's alert about each payment (`rule_hits`: the rules' hits, which the model reads),
        saying why, or None. The payments' features are scored in one walk of the trees, and the
        explanations of those that alert found together: each payment's alert is what it would be alone."""
        return self.judge(evidences, rule_hits, thresholds)[0]

    def rows(
        self, evidences: Sequence[Evidence], rule_hits: Sequence[Sequence[Hit]], thresholds: AmlThresholds
    ) -> tuple[list[int], np.ndarray]:
        """The payments the model scores (every one but a self-payment), by index, and their feature rows:
        what `judge` reads, and what `bench.model_cost` times on its own."""
        scored = [i for i, evidence in enumerate(evidences) if evidence.payer != evidence.payee]
        rows = np.fromiter(
            itertools.chain.from_iterable(features(evidences[i], rule_hits[i], thresholds) for i in scored),
            dtype=float,
            count=len(scored) * len(FEATURES),
        ).reshape(len(scored), len(FEATURES))
        return scored, rows

    def judge(
        self, evidences: Sequence[Evidence], rule_hits: Sequence[Sequence[Hit]], thresholds: AmlThresholds
    ) -> tuple[list[Hit | None], list[float]]:
        """`hits`, and each payment's probability of benign (NaN for a self-payment: not scored), which
        says whether the rules beside the model alert it (`beside`)."""
        found: list[Hit | None] = [None] * len(evidences)
        benign_p = [math.nan] * len(evidences)
        scored, rows = self.rows(evidences, rule_hits, thresholds)
        if not scored:
            return found, benign_p
        bins, reached, leaves, raw = self._raw(rows)
        p = _softmax(raw)
        benign = self.classes.index(BENIGN)
        for i, value in zip(scored, p[:, benign].tolist(), strict=True):
            benign_p[i] = value
        beside = [frozenset(hit.typology for hit in self.beside(rule_hits[i], benign_p[i])) for i in scored]
        named = self._names(p, beside)
        alerting = np.array([j for j, typology in enumerate(named) if typology is not None], dtype=np.intp)
        if not len(alerting):
            return found, benign_p
        # Occlusion: how much each feature alone, at a typical benign payment's value, raises the
        # probability of benign; the (at most three) that raise it most are the most telling.
        moved = np.zeros((len(alerting), len(FEATURES)))
        moved[:, self._walk.used] = self._walk.moved(
            bins[alerting], reached[alerting], leaves[alerting], raw[alerting], p[alerting, benign], benign
        )
        most = np.argsort(-moved, axis=1)[:, :3]
        rises = np.take_along_axis(moved, most, axis=1).tolist()
        values = np.take_along_axis(rows[alerting], most, axis=1).tolist()
        for j, order, rise, value, probabilities in zip(
            alerting.tolist(), most.tolist(), rises, values, p[alerting].tolist(), strict=True
        ):
            typology = named[j]
            assert typology is not None
            telling = [(i, v) for i, up, v in zip(order, rise, value, strict=True) if up > 0]
            found[scored[j]] = self._explained(telling, probabilities, typology, beside[j])
        return found, benign_p

    def _explained(
        self, telling: list[tuple[int, float]], p: list[float], typology: str, beside: frozenset[str]
    ) -> Hit:
        """The model's alert naming `typology`: the probabilities against the cut, the typologies it passed
        over because the rules beside it name them, and the most telling features (index, the payment's
        value) with a typical benign payment's value."""
        benign, best = self.classes.index(BENIGN), self.classes.index(typology)
        typical = self._typical_shown
        shown = [(FEATURES[i], _shown(FEATURES[i], value), typical[i]) for i, value in telling]
        because = "; ".join(f"{name} {value} (benign typically {usual})" for name, value, usual in shown)
        return Hit(
            rule="aml.model",
            typology=typology,
            reason=(
                f"the model puts the chance that this payment is benign at {p[benign]:.4f}, below its cut "
                f"{self.cut:.4f}, and names {typology} (probability {p[best]:.4f})"
                + (
                    f", the likeliest the rules beside it do not name ({', '.join(sorted(beside))})"
                    if self.names_past_rules and beside
                    else ""
                )
                + "; most telling: "
                + (because or "no single feature")
                + "."
            ),
            figures={
                "benign_probability": f"{p[benign]:.6f}",
                "cut": f"{self.cut:.6f}",
                f"{typology}_probability": f"{p[best]:.6f}",
                **{name: value for name, value, _ in shown},
            },
        )

    @functools.cached_property
    def _typical_shown(self) -> list[str]:
        """A typical benign payment's value of each feature, as `_shown` shows it."""
        return [
            _shown(name, value) for name, value in zip(FEATURES, self.benign_typical.tolist(), strict=True)
        ]

    def detect(self, evidence: Evidence, thresholds: AmlThresholds) -> list[Hit]:
        """The rules that alert beside the model, then the model's own alert."""
        return self.detect_many([evidence], thresholds)[0]

    def detect_many(self, evidences: Sequence[Evidence], thresholds: AmlThresholds) -> list[list[Hit]]:
        """`detect` for each of a batch of payments, the model scoring them all at once: the same hits as
        one by one, at a fraction of the cost per payment."""
        rules = [aml_rules(evidence, thresholds) for evidence in evidences]
        found, benign = self.judge(evidences, rules, thresholds)
        return [
            scored(self.beside(hits, p) + ([mine] if mine is not None else []), p)
            for hits, mine, p in zip(rules, found, benign, strict=True)
        ]

    def beside(self, rule_hits: Sequence[Hit], benign: float) -> list[Hit]:
        """The rules' hits that alert beside the model on a payment it puts at probability `benign` of
        being benign (NaN: not scored): those of `alerting_rules`, unless the model vetoes them."""
        if not self.keeps_rules(benign):
            return []
        return [hit for hit in rule_hits if hit.rule in self.alerting_rules]


def scored(hits: list[Hit], benign: float) -> list[Hit]:
    """`hits` on one payment, each with the model's score of it (`Hit.score`): 1 less its probability of
    benign, none for a self-payment (NaN: not scored). Analysts work a queue top down; the score orders
    it as the report's precision at the top of the queue does (`holdout.queue_precision`). The trees learn
    each class weighed alike, so it ranks payments rather than estimates a share of them."""
    if not hits or math.isnan(benign):
        return hits
    return [dataclasses.replace(hit, score=1.0 - benign) for hit in hits]


def typologies_named(
    p: np.ndarray,
    classes: Sequence[str],
    prior: np.ndarray,
    past: Sequence[frozenset[str]] | None = None,
) -> list[str]:
    """Per row of class probabilities, the typology the model names: the likeliest once each is weighed by
    the naming prior (`aml_app.training.fit.naming_prior`), past those the row's `past` holds (what the
    rules beside the model name on the payment: `names_past_rules`) unless it holds them all."""
    weighed = np.log(np.maximum(p, 1e-300)) + prior
    weighed[:, classes.index(BENIGN)] = -np.inf
    if past is not None:
        column = {name: c for c, name in enumerate(classes)}
        for row, names in enumerate(past):
            taken = [column[name] for name in names if name in column]
            if taken and len(taken) < len(classes) - 1:
                weighed[row, taken] = -np.inf
    return [classes[c] for c in weighed.argmax(axis=1).tolist()]


def rules_kept(benign: float, veto: float | None) -> bool:
    """`Model.keeps_rules` for a file whose `rule_veto` is `veto` (training sets cuts with it)."""
    return veto is None or not benign >= veto


def _softmax(raw: np.ndarray) -> np.ndarray:
    """Class probabilities from raw scores, along the last axis."""
    raw = raw - raw.max(axis=-1, keepdims=True)
    exp = np.exp(raw)
    return exp / exp.sum(axis=-1, keepdims=True)


#: Rows whose masks are gathered at once (`_Walk.leaves`): 8 rows of the shipped model gather 800 KB.
_CHUNK = 8


@dataclass(frozen=True)
class _Walk:
    """The trees compiled to be walked for many rows at once, without going from node to node.

    Where a row goes at a node depends only on where its value of the node's feature falls among the
    thresholds the trees compare that feature with: its bin. So for each feature and bin, which leaves of
    each tree the row can still reach is one bit mask per tree (bit i: the tree's i-th leaf from the
    left), computed here once (QuickScorer's idea: Lucchese et al., SIGIR 2015). A row's leaf in a tree is
    the one leaf that every feature's mask leaves it: a gather of one row of masks per feature and an AND
    over them. A missing value (NaN) has a bin of its own, which goes where each node sends it.

    For the explanations (occlusion: one feature at a time takes the benign-typical value), the trees
    and leaves whose leaf a feature's typical value changes are found here too (`flip_*`): on the leaf's
    path, the first node of that feature that the typical value sends the other way; the new leaf is then
    under that node's other child, and only the features split on there are read again.
    """

    cuts: np.ndarray  # (cuts,) complex: each distinct (feature, threshold) as u + threshold * 1j, sorted
    starts: np.ndarray  # (used,): each feature's first cut
    used: np.ndarray  # (used,): the features the trees split on
    nan_bin: np.ndarray  # (used,): the bin of a missing value, past the one above every threshold
    base: np.ndarray  # (used,): each feature's first row in `reachable`
    reachable: np.ndarray  # (bins of every used feature, trees): the leaves each bin leaves reachable
    leaf_value: np.ndarray  # (trees * width,): tree t's i-th leaf's value at t * width + i
    tree_base: np.ndarray  # (trees,): t * width
    width: int  # the most leaves of a tree
    class_starts: np.ndarray  # (classes with trees,): each one's first tree, the trees ordered by class
    class_index: np.ndarray  # (classes with trees,): those classes
    classes: int
    # Per tree and leaf (t * width + i), the flips: the features whose typical value moves a row off it,
    # each as its feature * classes + the tree's class (a slot of the raw scores' change).
    fixed_leaves: np.ndarray  # (trees,): per tree, a mask of the leaves with such flips
    fixed_count: np.ndarray  # (trees * width,): the flips to a leaf the typical value alone decides
    fixed_start: np.ndarray  # (trees * width,): the first of them
    fixed_slot: np.ndarray  # (fixed flips,)
    fixed_change: np.ndarray  # (fixed flips,): the new leaf's value less the old
    walk_leaves_of: np.ndarray  # (trees,): per tree, a mask of the leaves with such flips
    walk_count: np.ndarray  # (trees * width,): the flips to a leaf that other features decide too
    walk_start: np.ndarray  # (trees * width,): the first of them
    # (walked flips, 3): the slot; how many features split on under the other child; the first of them
    # in `need`
    walk: np.ndarray
    walk_mask: np.ndarray  # (walked flips,): the leaves under the other child that the typical value allows
    walk_change: np.ndarray  # (walked flips * width,): per new leaf, its value less the old leaf's
    need: np.ndarray  # (needs,): those features (their indices in `used`)
    need_tree: np.ndarray  # (needs,): the tree

    @classmethod
    def of(cls, model: Model) -> _Walk:
        """Compile `model`'s node arrays. Raises ValueError on a tree that is not one, or of more than 64
        leaves."""
        tree_class = np.asarray(model.tree_class).argmax(axis=1)
        order = np.argsort(tree_class, kind="stable")  # by class, in training order within each
        left, right = model.left.tolist(), model.right.tolist()
        feature, threshold = model.feature.tolist(), model.threshold.tolist()
        missing_left = model.missing_left.tolist()
        trees = [_Tree.of(left, right, feature, root) for root in model.roots[order].tolist()]
        width = max(len(tree.leaves) for tree in trees)
        if width > 64:
            raise ValueError(f"a tree has {width} leaves; at most 64 are supported")
        dtype = np.uint16 if width <= 16 else np.uint32 if width <= 32 else np.uint64
        leaf_value = np.zeros(len(trees) * width)
        for t, tree in enumerate(trees):
            leaf_value[t * width : t * width + len(tree.leaves)] = model.value[tree.leaves]

        thresholds: dict[int, set[float]] = {}
        for tree in trees:
            for node in tree.internal:
                thresholds.setdefault(feature[node], set()).add(threshold[node])
        used = sorted(thresholds)
        cuts = {f: sorted(thresholds[f]) for f in used}
        rank = {f: {value: j for j, value in enumerate(values)} for f, values in cuts.items()}
        position = {f: u for u, f in enumerate(used)}
        counts = np.array([len(cuts[f]) for f in used], dtype=np.intp)
        base = np.concatenate([[0], np.cumsum(counts + 2)[:-1]]).astype(np.intp)
        full = [_span(0, len(tree.leaves)) for tree in trees]
        reachable = np.tile(np.array(full, dtype=dtype), (int((counts + 2).sum()), 1))
        # Each internal node on every bin of its feature: going left leaves out the leaves on its right,
        # going right those on its left; bins up to its threshold's rank go left, and the missing
        # value's bin goes where the node sends it.
        nodes = [(t, node) for t, tree in enumerate(trees) for node in tree.internal]
        if nodes:
            of_tree = np.array([t for t, _ in nodes], dtype=np.intp)
            of_feature = np.array([position[feature[node]] for _, node in nodes], dtype=np.intp)
            of_rank = np.array([rank[feature[node]][threshold[node]] for _, node in nodes], dtype=np.intp)
            nan_left = np.array([missing_left[node] for _, node in nodes], dtype=bool)
            not_left, not_right = [], []
            for t, node in nodes:
                (lo, hi), middle = trees[t].spans[node], trees[t].spans[left[node]][1]
                not_left.append(full[t] ^ _span(lo, middle))
                not_right.append(full[t] ^ _span(middle, hi))
            size = counts[of_feature] + 2
            row = _ranges(base[of_feature], size)
            bin_of = row - np.repeat(base[of_feature], size)
            goes_left = np.where(
                bin_of == np.repeat(size - 1, size),
                np.repeat(nan_left, size),
                bin_of <= np.repeat(of_rank, size),
            )
            mask = np.where(
                goes_left,
                np.repeat(np.array(not_right, dtype=dtype), size),
                np.repeat(np.array(not_left, dtype=dtype), size),
            )
            np.bitwise_and.at(reachable, (row, np.repeat(of_tree, size)), mask)

        # Sorted as complex numbers (by real part, then imaginary), the cuts of one feature are a run in
        # threshold order, and one search finds every feature's bin.
        complex_cuts = np.array([complex(u, value) for u, f in enumerate(used) for value in cuts[f]])
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.intp)
        typical = _bins(
            np.asarray(model.benign_typical, dtype=float)[None, :],
            complex_cuts,
            starts,
            np.array(used, dtype=np.intp),
            counts + 1,
        )[0].tolist()

        # The flips of each tree and leaf, in the order of the leaf's path: those whose new leaf the typical
        # value alone decides (`fixed_*`), and those for which other features decide it (`walk_*`).
        classes = len(model.classes)
        fixed_count = np.zeros(len(trees) * width, dtype=np.intp)
        walk_count = np.zeros(len(trees) * width, dtype=np.intp)
        fixed: list[tuple[int, float]] = []  # (feature * classes + class, change)
        # (feature * classes + class, mask, tree, needed, the old leaf's value)
        walk: list[tuple[int, int, int, list[int], float]] = []
        for t, tree in enumerate(trees):
            slot = int(tree_class[order[t]])
            for i, path in enumerate(tree.paths):
                moved: set[int] = set()
                for node, went_left in path:
                    u = position[feature[node]]
                    if u in moved:
                        continue
                    b = typical[u]
                    nan = b == counts[u] + 1
                    goes_left = missing_left[node] if nan else b <= rank[feature[node]][threshold[node]]
                    if goes_left == went_left:
                        continue
                    moved.add(u)
                    other = right[node] if went_left else left[node]
                    lo, hi = tree.spans[other]
                    allowed = int(reachable[base[u] + b, t]) & _span(lo, hi)
                    # The features that decide among the allowed leaves: those of the nodes under the
                    # other child with allowed leaves on both sides.
                    needed = sorted(
                        {
                            position[feature[n]]
                            for n in tree.internal
                            if lo <= tree.spans[n][0]
                            and tree.spans[n][1] <= hi
                            and allowed & _span(tree.spans[n][0], tree.spans[left[n]][1])
                            and allowed & _span(tree.spans[left[n]][1], tree.spans[n][1])
                        }
                    )
                    if needed:
                        walk.append((u * classes + slot, allowed, t, needed, leaf_value[t * width + i]))
                        walk_count[t * width + i] += 1
                    else:
                        new = leaf_value[t * width + allowed.bit_length() - 1]
                        fixed.append((u * classes + slot, float(new - leaf_value[t * width + i])))
                        fixed_count[t * width + i] += 1
        need_count = np.array([len(flip[3]) for flip in walk], dtype=np.intp)
        need_start = np.cumsum(need_count) - need_count
        return cls(
            cuts=complex_cuts,
            starts=starts,
            used=np.array(used, dtype=np.intp),
            nan_bin=counts + 1,
            base=base,
            reachable=reachable,
            leaf_value=leaf_value,
            tree_base=np.arange(len(trees), dtype=np.intp) * width,
            width=width,
            class_starts=np.flatnonzero(np.diff(tree_class[order], prepend=-1)),
            class_index=np.unique(tree_class),
            classes=classes,
            fixed_leaves=_leaves_with(fixed_count, width, dtype),
            fixed_count=fixed_count,
            fixed_start=np.cumsum(fixed_count) - fixed_count,
            fixed_slot=np.array([flip[0] for flip in fixed], dtype=np.intp),
            fixed_change=np.array([flip[1] for flip in fixed], dtype=float),
            walk_leaves_of=_leaves_with(walk_count, width, dtype),
            walk_count=walk_count,
            walk_start=np.cumsum(walk_count) - walk_count,
            walk=np.array(
                [
                    (flip[0], len(flip[3]), start)
                    for flip, start in zip(walk, need_start.tolist(), strict=True)
                ],
                dtype=np.intp,
            ).reshape(len(walk), 3),
            walk_mask=np.array([flip[1] for flip in walk], dtype=dtype),
            walk_change=(
                leaf_value.reshape(-1, width)[[flip[2] for flip in walk]]
                - np.array([flip[4] for flip in walk])[:, None]
            ).ravel(),
            need=np.array([u for flip in walk for u in flip[3]], dtype=np.intp),
            need_tree=np.array([flip[2] for flip in walk for _ in flip[3]], dtype=np.intp),
        )

    def bins(self, rows: np.ndarray) -> np.ndarray:
        """(rows, used): where each row's value of each used feature falls: the number of the feature's
        thresholds below it (a node goes left when that number is at most the rank of its threshold), or
        `nan_bin` for a missing value."""
        return _bins(rows, self.cuts, self.starts, self.used, self.nan_bin)

    def leaves(self, bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, trees) twice: the leaf each row reaches in each tree as a one-bit mask, and as
        t * width + its index from the left."""
        reached = np.empty((len(bins), len(self.tree_base)), dtype=self.reachable.dtype)
        if not len(self.used):  # every tree is one leaf
            reached[:] = 1
        at = bins + self.base
        for start in range(0, len(bins) if len(self.used) else 0, _CHUNK):
            gathered = np.take(self.reachable, at[start : start + _CHUNK], axis=0)
            np.bitwise_and.reduce(gathered, axis=1, out=reached[start : start + _CHUNK])
        return reached, self.tree_base + self.leaf(reached)

    def leaf(self, reached: np.ndarray) -> np.ndarray:
        """The index of the leaf (from the left) that a one-bit mask names."""
        return _leaf_of(reached)

    def raw(self, leaves: np.ndarray) -> np.ndarray:
        """(rows, classes): the leaf values summed per class, in the same order for every row."""
        sums = np.add.reduceat(np.take(self.leaf_value, leaves), self.class_starts, axis=-1)
        if len(self.class_index) == self.classes:
            return sums
        out = np.zeros((len(leaves), self.classes))
        out[:, self.class_index] = sums
        return out

    def moved(
        self,
        bins: np.ndarray,
        reached: np.ndarray,
        leaves: np.ndarray,
        raw: np.ndarray,
        benign_p: np.ndarray,
        benign: int,
    ) -> np.ndarray:
        """(rows, used): how much the probability of benign rises when each used feature alone takes the
        benign-typical value (occlusion), for rows walked already (`bins`, `reached` and `leaves`, `raw`
        scores): the raw scores moved by the change of every leaf the value changes (the flips of each
        row's leaves); 0 where they move none."""
        rows, used, classes, trees = len(bins), len(self.used), self.classes, len(self.tree_base)
        leaves = leaves.ravel()
        slots, changes = [], []
        pairs = np.flatnonzero(reached & self.fixed_leaves)  # row * trees + tree
        if len(pairs):
            counts = np.take(self.fixed_count, leaves[pairs])
            flip = _ranges(np.take(self.fixed_start, leaves[pairs]), counts)
            row = np.repeat(pairs // trees, counts)
            slots.append(row * (used * classes) + np.take(self.fixed_slot, flip))
            changes.append(np.take(self.fixed_change, flip))
        pairs = np.flatnonzero(reached & self.walk_leaves_of)
        if len(pairs):
            # The new leaf: the AND of the masks of the features split on under the other child (a
            # row's mask of feature u in tree t is `reachable` at (its bin's row) * trees + t), and of
            # the typical value's mask there.
            counts = np.take(self.walk_count, leaves[pairs])
            flip = _ranges(np.take(self.walk_start, leaves[pairs]), counts)
            row = np.repeat(pairs // trees, counts)
            slot, needs, first = np.take(self.walk, flip, axis=0).T
            need = _ranges(first, needs)
            at = ((bins + self.base) * trees).ravel()
            where = np.take(at, np.repeat(row * used, needs) + np.take(self.need, need))
            masks = np.take(self.reachable.ravel(), where + np.take(self.need_tree, need))
            new = np.bitwise_and.reduceat(masks, np.cumsum(needs) - needs) & np.take(self.walk_mask, flip)
            slots.append(row * (used * classes) + slot)
            changes.append(np.take(self.walk_change, flip * self.width + self.leaf(new)))
        out = np.zeros(rows * used)
        if not slots:
            return out.reshape(rows, used)
        shift = np.bincount(
            np.concatenate(slots), weights=np.concatenate(changes), minlength=rows * used * classes
        ).reshape(rows * used, classes)
        moving = np.flatnonzero((shift != 0).any(axis=1))  # row * used + feature
        of_row = moving // used
        out[moving] = _softmax(raw[of_row] + shift[moving])[:, benign] - benign_p[of_row]
        return out.reshape(rows, used)


@dataclass(frozen=True)
class _Tree:
    """One tree's shape, read from the model's node arrays: its leaves from left to right, its internal
    nodes, and per node the leaves under it (`spans`: the first and one past the last) and the features
    split on under it, and each leaf's path from the root (the nodes and whether it went left at each)."""

    leaves: list[int]
    internal: list[int]
    spans: dict[int, tuple[int, int]]
    under: dict[int, frozenset[int]]
    paths: list[list[tuple[int, bool]]]

    @classmethod
    def of(cls, left: list[int], right: list[int], feature: list[int], root: int) -> _Tree:
        """The tree at `root`; a ValueError if it is not a tree of at most 64 leaves."""
        leaves: list[int] = []
        internal: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        under: dict[int, frozenset[int]] = {}
        paths: list[list[tuple[int, bool]]] = []

        def visit(node: int, path: list[tuple[int, bool]]) -> None:
            if node in spans:
                raise ValueError(f"the tree at node {root} reaches node {node} twice: it is not a tree")
            if len(path) > 64:
                raise ValueError(f"the tree at node {root} is deeper than 64 nodes")
            first = len(leaves)
            spans[node] = (first, first)
            if left[node] == node:  # a leaf's children are itself
                leaves.append(node)
                paths.append(path)
                spans[node], under[node] = (first, first + 1), frozenset()
                return
            internal.append(node)
            visit(left[node], [*path, (node, True)])
            visit(right[node], [*path, (node, False)])
            spans[node] = (first, len(leaves))
            under[node] = under[left[node]] | under[right[node]] | {feature[node]}

        visit(root, [])
        return cls(leaves, internal, spans, under, paths)


def _bins(
    rows: np.ndarray, cuts: np.ndarray, starts: np.ndarray, used: np.ndarray, nan_bin: np.ndarray
) -> np.ndarray:
    """`_Walk.bins` with the walk's cuts."""
    values = np.take(rows, used, axis=1)
    asked = np.empty(values.shape, dtype=complex)
    asked.real, asked.imag = np.arange(len(used)), values
    bins = np.searchsorted(cuts, asked.ravel()).reshape(values.shape) - starts
    if np.isnan(values).any():
        bins = np.where(np.isnan(values), nan_bin, bins)
    return bins


def _leaf_by_count(reached: np.ndarray) -> np.ndarray:
    """The index of the bit a one-bit mask sets: the bits below it, counted."""
    return np.bitwise_count(reached - 1)


def _leaf_by_exponent(reached: np.ndarray) -> np.ndarray:
    """The same, for numpy before 2.0 (no `bitwise_count`): a power of two's exponent."""
    return np.frexp(reached.astype(np.float64))[1] - 1


_leaf_of = _leaf_by_count if hasattr(np, "bitwise_count") else _leaf_by_exponent


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """starts[0], starts[0] + 1, ..., starts[0] + counts[0] - 1, starts[1], ...: ranges laid end to end."""
    ends = np.cumsum(counts)
    return np.arange(ends[-1]) + np.repeat(starts - ends + counts, counts)


def _leaves_with(count: np.ndarray, width: int, dtype: Any) -> np.ndarray:
    """Per tree, the mask of the leaves whose `count` (by t * width + leaf) is not 0."""
    return np.array(
        [sum(1 << i for i in range(width) if row[i]) for row in count.reshape(-1, width).tolist()],
        dtype=dtype,
    )


def _span(lo: int, hi: int) -> int:
    """The bit mask of leaves lo..hi-1."""
    return (1 << hi) - (1 << lo)


def _shown(name: str, value: float) -> str:
    """A feature as the analyst reads it: counts and sums undone from log(1 + x)."""
    if name.startswith("rule_"):
        return "fired" if value else "did not fire"
    if name.startswith("format_"):
        return "yes" if value else "no"
    if name.endswith("_hops") or name == "payee_flow_accounts":
        return str(int(value))
    if name.endswith(("_forwarded", "_amount_vs_received")):
        return f"{math.exp(value):.2f} times what came in"
    if name.endswith("_mean"):
        return f"{math.exp(value):.2f} times its mean payment"
    if name.endswith("_amount_share"):
        return f"{math.exp(value):.2f} of the week's total"
    plain = math.expm1(value)
    return f"{plain:.2f}" if "total" in name or name == "amount" else str(round(plain))


@functools.cache
def load(
    source: str, budget: float | None = None, deployed: tuple[tuple[str, str], ...] | None = None
) -> Model | None:
    """The model `AML_MODEL` names: '' (off, None), 'amlworld' (shipped) or a path, cut for `budget`
    (`AML_ALERT_BUDGET`, `Model.within`) if given; read once per process. A model that cannot be read,
    has no such budget, or was trained with other settings than `deployed` (`Settings.model_settings`)
    is a configuration error: the command line reads it before the worker starts, so it stops there with
    one sentence."""
    source = source.strip()
    if not source or source.lower() == "off":
        return None
    try:
        if source == SHIPPED:
            text = resources.files("aml_app.detection").joinpath(SHIPPED_FILE).read_text()
        else:
            text = Path(source).read_text()
        model = Model.from_json(json.loads(text))
        trained_with(model.training)  # a record that is not one is an unreadable file
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"{MODEL_VARIABLE}={source!r} is not a readable AML model: {exc}.") from None
    if deployed is not None and (differs := mismatch(trained_with(model.training), dict(deployed))):
        raise ConfigError(
            f"{MODEL_VARIABLE}={source!r} was {differs}: train a model with this deployment's settings "
            "(aml-app train-model), or run it with the settings it was trained with."
        )
    if budget is not None:
        try:
            model = model.within(budget)
        except ValueError as exc:
            raise ConfigError(
                f"{BUDGET_VARIABLE}={budget:g} does not fit {MODEL_VARIABLE}={source!r}: {exc}."
            ) from None
    try:
        model._walk  # noqa: B018  # compiled now (once), so that a model it cannot walk stops the start-up
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"{MODEL_VARIABLE}={source!r} is not a readable AML model: {exc}.") from None
    return model
