"""Fit on one part, score on another: a replayed history cut into the part the trees learn from, the part
that sets the cut, and the part only the report reads; and that report.

By time (the default, a deployment's history): the first `learn` share of the payments, in event-time
order, then the next `cut` share, then the rest. Every payment's features still read the history before
it, as the detector's evidence does; what a part holds is which labels training may read. By attempt (for
files that are not one stretch of time, such as AMLworld's patterns replayed into another set's
background): each attempt and each benign payment falls in a part by a hash of its id. By account:
each benign payment and each attempt falls in the part of its (first payment's) payer, so that no benign
payer the report scores is one the trees learnt from, as on another bank's traffic; an attempt's other
payers, and a payer laundering in attempts of several parts, may be in more than one part (19 of the
95 scored attempts of the real files at seed 0 have a payer the trees learnt from). Either way an attempt
lies wholly in one part (by time, its first payment's), so no scored attempt teaches the trees its
other payments.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aml_app.detection.model import BENIGN, Model
from aml_app.detection.rules import RULE_STRENGTH
from aml_app.training.fit import UNNAMED, Replayed

SPLITS = ("time", "attempt", "account")
PARTS = ("learn", "cut", "score")
#: Laundering payments per payment in AMLworld's HI and LI sets (Altman et al. 2023, Table 4), the base
#: rates at which the report estimates precision.
BASE_RATES = {"HI (1 in 900)": 1 / 900, "LI (1 in 1,750)": 1 / 1750}
TOP_K = (10, 50, 100)
#: Bands of an attempt's payments (name, most payments), for recall by size: one payment shows B and C
#: no shape to name (AMLworld gives lone payments several typologies), from three on the shape shows.
SIZE_BANDS = (("1", 1), ("2", 2), ("3-5", 5), ("6+", 2**62))
#: One-sided 95 % normal quantile, for the bound on the benign alert rate (`benign_rate_bound`).
Z_95 = 1.645


def benign_rate_bound(alerted: int, payments: int) -> float:
    """An upper bound (one-sided, 95 %) on the benign alert rate of which `alerted` of `payments` is a
    sample: Wilson's score bound. A scored part of 1,500 benign payments with none alerted says the rate
    is below about 0.18 %, not that it is 0, and the precision estimated from it is a floor, not 1."""
    if payments <= 0:
        return 1.0
    share, z2 = alerted / payments, Z_95 * Z_95
    centre = share + z2 / (2 * payments)
    spread = Z_95 * np.sqrt(share * (1 - share) / payments + z2 / (4 * payments * payments))
    return float(min(1.0, (centre + spread) / (1 + z2 / payments)))


def _measured(named: Sequence[set[str]], run: Replayed) -> dict[str, Any]:
    """What the detector's alerts (`named`, per payment) measure on `run`: the benign payments alerted
    and the payers they come from (an analyst clears one account's alerts together), the laundering
    payments' recall, the benign rate's bound and the estimates at the base rates."""
    benign = [i for i, label in enumerate(run.labels) if label == BENIGN]
    laundering = [i for i, label in enumerate(run.labels) if label != BENIGN]
    alerted = sum(bool(named[i]) for i in benign)
    payers = len({run.payments[i].payer for i in benign if named[i]})
    recall = sum(bool(named[i]) for i in laundering) / len(laundering) if laundering else 0.0
    bound = benign_rate_bound(alerted, len(benign))
    return {
        "benign": benign,
        "laundering": laundering,
        "benign_alerted": alerted,
        "benign_payers_alerted": payers,
        "recall": recall,
        "bound": bound,
        "estimated": estimates(recall, alerted / len(benign) if benign else 0.0, bound),
    }


def estimates(recall: float, benign_rate: float, bound: float) -> dict[str, dict[str, float]]:
    """Precision and F1 at each of BASE_RATES from the payment recall r and the benign alert rate b
    (p r / (p r + (1 - p) b) at base rate p), and the precision that holds with b at its upper `bound`."""

    def precision(p: float, b: float) -> float:
        return p * recall / (p * recall + (1 - p) * b) if recall or b else 0.0

    found = {}
    for name, p in BASE_RATES.items():
        at = precision(p, benign_rate)
        f1 = 2 * at * recall / (at + recall) if at + recall else 0.0
        found[name] = {
            "precision": round(at, 4),
            "f1": round(f1, 4),
            "precision_at_least": round(precision(p, bound), 4),
        }
    return found


@dataclass(frozen=True)
class Parts:
    learn: Replayed
    cut: Replayed
    score: Replayed


def part_of(run: Replayed, by: str, shares: Sequence[float], seed: int | str = 0) -> list[int]:
    """Per payment of `run`, the index of its part (`shares` in order: PARTS for `split`)."""
    if by not in SPLITS:
        raise ValueError(f"split by {by!r}: expected one of {', '.join(SPLITS)}")
    bounds = np.cumsum(shares)[:-1] / sum(shares)
    attempt_of = {i: a for a, (_, members) in enumerate(run.attempts) for i in members}
    n = len(run.payments)
    if by == "time":  # the run is in event-time order
        by_position = [int(np.searchsorted(bounds, i / n, side="right")) for i in range(n)]
        first = {a: by_position[min(members)] for a, (_, members) in enumerate(run.attempts) if members}
        return [first[attempt_of[i]] if i in attempt_of else by_position[i] for i in range(n)]

    def hashed(key: str) -> int:
        digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
        return int(np.searchsorted(bounds, int.from_bytes(digest[:8], "big") / 2**64, side="right"))

    def key(payment: Any) -> str:
        return f"payer:{payment.payer}" if by == "account" else str(payment.payment_id)

    # An attempt is known by its first payment, whatever order the attempts are listed in.
    starter = {a: key(run.payments[min(members)]) for a, (_, members) in enumerate(run.attempts) if members}
    return [hashed(starter[attempt_of[i]] if i in attempt_of else key(run.payments[i])) for i in range(n)]


def split(run: Replayed, by: str = "time", shares: Sequence[float] = (0.6, 0.2, 0.2), seed: int = 0) -> Parts:
    """`run` in the three PARTS (`shares` of its payments, in that order)."""
    if len(shares) != len(PARTS) or min(shares) <= 0:
        raise ValueError(f"shares {list(shares)}: expected three positive numbers (learn, cut, score)")
    parts = part_of(run, by, shares, seed)
    return Parts(*(run.subset([i for i, p in enumerate(parts) if p == k]) for k in range(len(PARTS))))


def folded(run: Replayed, by: str, folds: int, seed: int = 0) -> list[Replayed]:
    """`run` in `folds` parts of about equal size, cut as `part_of` cuts (each attempt wholly in one), for
    `aml_app.training.fit.cross_fitted`."""
    if folds < 2:
        raise ValueError(f"{folds} folds: expected at least 2")
    parts = part_of(run, by, [1.0] * folds, f"fold:{seed}")  # not the split's hash: it would fill k - 1
    return [run.subset([i for i, p in enumerate(parts) if p == k]) for k in range(folds)]


def crossed(run: Replayed, by: str, parts: int, seed: int = 0) -> list[Replayed]:
    """`run` in `parts` parts of about equal size, cut as `split` cuts (by time: stretches one after the
    other; by attempt: a hash; each attempt wholly in one), for a cross-validated report: each part is
    scored by a model trained on the others (`scored_each`). Its own hash, so that `folded` fills every
    fold of the other parts."""
    if parts < 2:
        raise ValueError(f"{parts} parts: expected at least 2")
    found = part_of(run, by, [1.0] * parts, f"cross:{seed}")
    return [run.subset([i for i, p in enumerate(found) if p == k]) for k in range(parts)]


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def scored(doc: Mapping[str, Any], run: Replayed) -> dict[str, Any]:
    """What the model file `doc` (with the rules that alert beside it) alerts on `run`: per typology the
    attempts named by their own typology and those with any alert; the benign payments alerted, as a
    share of all and of those between two parties; and precision and F1 estimated at BASE_RATES from the
    payment recall and the benign alert rate (precision = p r / (p r + (1 - p) b) at base rate p)."""
    return scored_each([(doc, run)])


def scored_each(pairs: Sequence[tuple[Mapping[str, Any], Replayed]]) -> dict[str, Any]:
    """`scored` of each run by its own model file, as one report on the runs pooled: a cross-validation's,
    where each part of a history is scored by a model trained on the others, so that every attempt and
    payment is scored once and the figures rest on the whole history rather than on one part of it."""
    models = [(Model.from_json(doc), part) for doc, part in pairs]
    run = Replayed.pooled([part for _, part in pairs])
    named: list[set[str]] = []
    scores: list[float] = []
    for model, part in models:
        names, probability = _named(model, part)
        named += names
        scores += probability.tolist()
    score = np.array(scores)
    per_typology = _per_typology(named, run)
    attempts = len(run.attempts)
    measured = _measured(named, run)
    benign, laundering, benign_alerted = (
        measured["benign"],
        measured["laundering"],
        measured["benign_alerted"],
    )
    two_party = [i for i in benign if run.payments[i].payer != run.payments[i].payee]
    return {
        "payments": len(run.payments),
        "attempts": attempts,
        "own_typology": _ratio(sum(v["right"] for v in per_typology.values()), attempts),
        "any_alert": _ratio(sum(v["alerted"] for v in per_typology.values()), attempts),
        "per_typology": _shares(per_typology),
        "per_size": _shares(per_size(named, run)),
        "laundering_payments": len(laundering),
        "payment_recall": round(measured["recall"], 4),
        "benign": {
            "payments": len(benign),
            "between_two_parties": len(two_party),
            "alerted": benign_alerted,
            "payers_alerted": measured["benign_payers_alerted"],
            "share_of_all": _ratio(benign_alerted, len(benign)),
            "share_of_two_party": _ratio(sum(bool(named[i]) for i in two_party), len(two_party)),
            "share_of_all_upper_95": round(measured["bound"], 5),
        },
        "estimated_at_base_rate": measured["estimated"],
        "alert_budgets": _within_budgets(models),
        "queue": _queue(named, score, run, len(laundering), len(benign)),
    }


def queue_of(model: Model, run: Replayed) -> dict[str, Any]:
    """`_queue` of what `model` and the rules beside it alert on `run`."""
    return _queue_of_run(*_named(model, run), run)


def rules_queue(run: Replayed) -> dict[str, Any]:
    """`_queue` of what the rules alone alert on `run`, each alert ranked by the strongest rule that fired
    (`RULE_STRENGTH`), as the AML worker scores them without a model."""
    named = [set(typologies) for typologies in run.typologies]
    score = np.array([max((RULE_STRENGTH[r] for r in rules), default=0.0) for rules in run.rules])
    return _queue_of_run(named, score, run)


def _queue_of_run(named: Sequence[set[str]], score: np.ndarray, run: Replayed) -> dict[str, Any]:
    """`_queue` with the laundering and benign payments counted off `run`'s labels."""
    laundering = sum(label != BENIGN for label in run.labels)
    return _queue(named, score, run, laundering, len(run.labels) - laundering)


def _queue(
    named: Sequence[set[str]], score: np.ndarray, run: Replayed, laundering: int, benign: int
) -> dict[str, Any]:
    """The analysts' queue of the payments `named` alerts, ranked by the score each alert carries: how
    many alerts, the place of the first benign one (from 1; None: none), and the precision at its top
    (`queue_precision`), both in `queue_order`."""
    alerted = [i for i, names in enumerate(named) if names]
    scores = [float(score[i]) for i in alerted]
    bad = [run.labels[i] != BENIGN for i in alerted]
    return {
        "alerts": len(alerted),
        "first_benign": next(
            (place for place, j in enumerate(queue_order(scores, bad), start=1) if not bad[j]), None
        ),
        "precision_at_top": queue_precision(scores, bad, laundering, benign),
    }


def queue_order(scores: Sequence[float], laundering: Sequence[bool]) -> np.ndarray:
    """The alerts' places in the analysts' queue: the highest score first, and alerts of one score benign
    first, the worst the ties allow (the rules alone score each rule's alerts alike)."""
    return np.lexsort((np.asarray(laundering, dtype=bool), -np.asarray(scores, dtype=float)))


def _per_typology(named: Sequence[set[str]], run: Replayed) -> dict[str, dict[str, Any]]:
    """Per typology of `run`'s attempts: how many, how many `named` names by their own typology (right)
    and with any alert, and those as shares."""
    return _per_group(named, run, lambda typology, members: typology)


def size_band(payments: int) -> str:
    """The band of SIZE_BANDS an attempt of `payments` payments falls in."""
    return next(name for name, most in SIZE_BANDS if payments <= most)


def per_size(named: Sequence[set[str]], run: Replayed) -> dict[str, dict[str, Any]]:
    """`_per_typology` per band of the attempts' payments (SIZE_BANDS), smallest first."""
    found = _per_group(named, run, lambda typology, members: size_band(len(members)))
    return {name: found[name] for name, _ in SIZE_BANDS if name in found}


def _per_group(
    named: Sequence[set[str]], run: Replayed, group: Callable[[str, list[int]], str]
) -> dict[str, dict[str, Any]]:
    """Per `group` of `run`'s attempts (of their typology and payments): how many, how many `named`
    names by their own typology (right) and with any alert, and those as shares."""
    counts: dict[str, list[int]] = {}
    for typology, members in run.attempts:
        count = counts.setdefault(group(typology, members), [0, 0, 0])
        count[0] += 1
        count[1] += any(typology in named[i] for i in members)
        count[2] += any(named[i] for i in members)
    return {
        name: {
            "attempts": attempts,
            "right": right,
            "alerted": alerted,
            "own_typology": _ratio(right, attempts),
            "any_alert": _ratio(alerted, attempts),
        }
        for name, (attempts, right, alerted) in sorted(counts.items())
    }


def _shares(groups: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A report's view of `_per_group`: attempts and the shares, not the counts behind them."""
    return {name: {k: v[k] for k in ("attempts", "own_typology", "any_alert")} for name, v in groups.items()}


def _named(model: Model, run: Replayed) -> tuple[list[set[str]], np.ndarray]:
    """Per payment, the typologies the model and the rules beside it alert (`Model.keeps_rules`), and the
    model's probability that the payment is not benign (0 for a self-payment, which it never scores)."""
    between = run.between()
    benign = np.full(len(run.payments), np.nan)
    rows = np.array([run.rows[i] for i in between], dtype=float)
    if between:
        benign[between] = model.probabilities(rows)[:, model.classes.index(BENIGN)]
    named = [
        {t for r, t in zip(rules, typologies, strict=True) if r in model.alerting_rules}
        if model.keeps_rules(p)
        else set()
        for rules, typologies, p in zip(run.rules, run.typologies, benign.tolist(), strict=True)
    ]
    if between:
        beside = [frozenset(named[i]) for i in between]
        for i, verdict in zip(between, model.verdicts(rows, beside), strict=True):
            if verdict is not None:
                named[i].add(verdict)
    return named, np.where(np.isnan(benign), 0.0, 1.0 - benign)


def within_budgets(model: Model, run: Replayed) -> list[dict[str, Any]]:
    """Per alert budget of the model file (`AML_ALERT_BUDGET`): what the detector cut for it alerts on
    `run`, the attempts named by their own typology and with any alert, and the benign payments."""
    return _within_budgets([(model, run)])


def _within_budgets(models: Sequence[tuple[Model, Replayed]]) -> list[dict[str, Any]]:
    """`within_budgets` of each run by its own model, pooled (`scored_each`); the models' files carry the
    same budgets, as `aml_app.training.fit.train` writes them."""
    run = Replayed.pooled([part for _, part in models])
    found = []
    for n, rate in enumerate(rate for rate, _, _ in models[0][0].budgets):
        named = [names for model, part in models for names in _named(model.within(rate), part)[0]]
        # Benign alerts the budget allows: where the one model's was set (at 0 the cut alerts nothing);
        # for several (cross-validated), on the scored parts they pool, each benign payment once (summed
        # where each was set, every payment counted in all the models but its own: N - 1 times).
        if len(models) == 1:
            held_out = models[0][0].training.get("held_out", {})
            allowed, where = int(rate * int(held_out.get("benign_payments", 0))), "where it was set"
        else:  # a budget is a share of every benign payment, self-payments too (as where it was set)
            benign = sum(label == BENIGN for label in run.labels)
            allowed, where = int(rate * benign), "at its rate on the scored parts"
        beside = [len(model.budgets[n][2]) for model, _ in models]  # per model
        per_typology = _per_typology(named, run)
        own = sum(v["right"] for v in per_typology.values())
        alerted = sum(v["alerted"] for v in per_typology.values())
        measured = _measured(named, run)
        benign_alerted = measured["benign_alerted"]
        found.append(
            {
                "budget": rate,
                "allowed_where_set": allowed,
                "allowed_where": where,
                "rules_beside": beside,
                "own_typology": _ratio(own, len(run.attempts)),
                "any_alert": _ratio(alerted, len(run.attempts)),
                "own_typology_each": {t: v["own_typology"] for t, v in per_typology.items()},
                "own_typology_by_size": {k: v["own_typology"] for k, v in per_size(named, run).items()},
                "benign_alerted": benign_alerted,
                "benign_payers_alerted": measured["benign_payers_alerted"],
                "benign_share": _ratio(benign_alerted, len(measured["benign"])),
                "benign_share_upper_95": round(measured["bound"], 5),
                "payment_recall": round(measured["recall"], 4),
                "estimated_at_base_rate": measured["estimated"],
            }
        )
    return found


def queue_precision(
    scores: Sequence[float], laundering: Sequence[bool], laundering_payments: int, benign_payments: int
) -> dict[str, dict[str, float | None]]:
    """Precision at the top k of the alert queue, alerts ranked by their score (the model's probability
    that they are not benign, or the rules' strength; an analyst works the queue top down): in the part
    as it is, and estimated at each of BASE_RATES, where each benign alert stands for as many as the base
    rate's benign payments per laundering one outnumber the part's (so in a part of one laundering
    payment in three, at one in 900 each benign alert weighs about 450). None where the queue is shorter
    than k."""
    bad = np.asarray(laundering, dtype=bool)[queue_order(scores, laundering)]
    found: dict[str, dict[str, float | None]] = {}
    weights = {"in the part": 1.0}
    if laundering_payments and benign_payments:
        for name, p in BASE_RATES.items():
            weights[name] = (1 - p) / p * laundering_payments / benign_payments
    for name, weight in weights.items():
        size = np.cumsum(np.where(bad, 1.0, weight))
        right = np.cumsum(bad)
        found[name] = {}
        for k in TOP_K:
            reach = int(np.searchsorted(size, k))  # the first position whose queue holds k alerts
            found[name][str(k)] = round(float(right[reach] / size[reach]), 4) if reach < len(size) else None
    return found


def rendered(report: Mapping[str, Any]) -> list[str]:
    """The report as lines of text, a table per typology then the benign alerts and the estimates."""
    lines = [f"{'typology':<16}{'attempts':>9}{'own typology':>14}{'any alert':>11}"]
    for typology, v in report["per_typology"].items():
        lines.append(f"{typology:<16}{v['attempts']:>9}{v['own_typology']:>14.3f}{v['any_alert']:>11.3f}")
    if report["attempts"]:
        lines.append(
            f"{'all':<16}{report['attempts']:>9}{report['own_typology']:>14.3f}{report['any_alert']:>11.3f}"
        )
    if sizes := report.get("per_size"):
        lines.append(
            "by the attempt's payments: "
            + "; ".join(
                f"{name} ({v['attempts']:,}): own typology {v['own_typology']:.3f}, "
                f"any alert {v['any_alert']:.3f}"
                for name, v in sizes.items()
            )
        )
    b = report["benign"]
    lines.append(
        f"benign alerted: {b['alerted']:,} of {b['payments']:,} ({_percent(b['share_of_all'])} of all, "
        f"{_percent(b['share_of_two_party'])} of the {b['between_two_parties']:,} between two parties) "
        f"from {_payers(b['payers_alerted'])}; "
        f"laundering payments alerted: {report['payment_recall']:.3f} of {report['laundering_payments']:,}"
    )
    lines.append(
        f"benign alert rate below {_percent(b.get('share_of_all_upper_95'))} (one-sided 95 %, Wilson's bound)"
    )
    for name, v in report["estimated_at_base_rate"].items():
        lines.append(
            f"estimated at the base rate {name}: precision {v['precision']:.3f}, F1 {v['f1']:.3f} "
            f"(precision at least {v['precision_at_least']:.3f} with the benign rate at its bound)"
        )
    for b in report.get("alert_budgets", []):
        hi = next(iter(b["estimated_at_base_rate"].values()))
        lines.append(
            f"alert budget {b['budget']:g} ({b['allowed_where_set']:,} benign alerts "
            f"{b.get('allowed_where', 'where it was set')}, "
            f"{_rules_beside(b['rules_beside'])}): own typology "
            f"{b['own_typology']:.3f}{_lowest(b['own_typology_each'])}, any alert {b['any_alert']:.3f}, "
            f"benign alerted {b['benign_alerted']:,} from {_payers(b['benign_payers_alerted'])} "
            f"({_percent(b['benign_share'])}, below "
            f"{_percent(b['benign_share_upper_95'])}); precision at {next(iter(BASE_RATES))} "
            f"{hi['precision']:.3f}, at least {hi['precision_at_least']:.3f}"
        )
        if sizes := b.get("own_typology_by_size"):
            shown = ", ".join(f"{name}: {share:.3f}" for name, share in sizes.items())
            lines.append(f"  own typology by the attempt's payments: {shown}")
    queue = report["queue"]
    first = queue["first_benign"]
    lines.append(
        f"the queue, ranked by each alert's score: {queue['alerts']:,} alerts, "
        + ("none benign" if first is None else f"the first benign one at place {first:,}")
    )
    for name, at in queue["precision_at_top"].items():
        shown = ", ".join(f"top {k}: {'n/a' if v is None else f'{v:.3f}'}" for k, v in at.items())
        lines.append(f"precision at the top of the queue, {name}: {shown}")
    return lines


def _payers(count: int) -> str:
    """How many payers a report's benign alerts come from, as its text says it."""
    return f"{count:,} payer{'' if count == 1 else 's'}"


def _lowest(each: Mapping[str, float | None]) -> str:
    """The typology named least often by its own name, as the report shows it beside a budget's recall:
    laundering that no attempt names (`UNNAMED`) has no typology to be named by."""
    shares = {t: v for t, v in each.items() if t != UNNAMED and v is not None}
    if not shares:
        return ""
    typology = min(shares, key=lambda t: (shares[t], t))
    return f" (lowest {typology} {shares[typology]:.3f})"


def _rules_beside(counts: Sequence[int]) -> str:
    """How many rules alert beside the model, or beside each of a cross-validation's models."""
    if len(counts) == 1:
        return f"{counts[0]} rules beside the model"
    fewest, most = min(counts), max(counts)
    return f"{fewest if fewest == most else f'{fewest} to {most}'} rules beside each model"


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.2f} %"
