"""Precision and recall of alerts against the simulator's ground truth, per typology (pure).

Definitions, at the instance level (a pattern is caught once, however many of its payments alert):
- An alert is identified by (payment_id, typology); duplicates count once.
- An instance of typology T is detected if at least one of its payments got an alert of typology T
  (an alert of another typology on it does not detect it).
- recall(T) = detected instances of T / instances of T.
- precision(T) = alerts of typology T on payments that belong to an instance of T / all alerts of
  typology T. An alert on a background payment, or on another typology's instance, is a false positive.
- A zero denominator gives None (no instances: recall undefined; no alerts: precision undefined),
  shown as "n/a": neither 0 nor 1 would be true.

And over payments, as the AMLworld paper and the papers that use it report (minority-class F1): a payment
is laundering if it belongs to any instance, flagged if any alert of any typology is on it. Precision,
recall and F1 of "flagged" against "laundering". Rules fire when a pattern becomes visible, so the
payments of an instance before its completing one are missed by design: payment recall stays below 1
even when every instance is caught.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from aml_app.detection.rules import TYPOLOGIES
from aml_app.simulation.traffic import Instance


@dataclass(frozen=True)
class TypologyScore:
    """Counts behind one typology's precision and recall."""

    typology: str
    instances: int
    detected: int
    alerts: int
    true_alerts: int

    @property
    def recall(self) -> float | None:
        return self.detected / self.instances if self.instances else None

    @property
    def precision(self) -> float | None:
        return self.true_alerts / self.alerts if self.alerts else None


def score(alerts: Iterable[tuple[str, str]], ground_truth: Iterable[Instance]) -> dict[str, TypologyScore]:
    """Per typology (every AML typology, plus any other found in the inputs): see the module docstring.

    `alerts` are (payment_id, typology) pairs.
    """
    instances = list(ground_truth)
    unique = set(alerts)
    # payment -> typologies of the instances it belongs to (in general a payment may be in several).
    member: dict[str, set[str]] = {}
    for instance in instances:
        for payment_id in instance.payment_ids:
            member.setdefault(payment_id, set()).add(instance.typology)
    extra = sorted(({i.typology for i in instances} | {t for _, t in unique}) - set(TYPOLOGIES))
    scores = {}
    for typology in (*TYPOLOGIES, *extra):
        flagged = {payment_id for payment_id, t in unique if t == typology}
        own = [i for i in instances if i.typology == typology]
        scores[typology] = TypologyScore(
            typology=typology,
            instances=len(own),
            detected=sum(1 for i in own if flagged.intersection(i.payment_ids)),
            alerts=len(flagged),
            true_alerts=sum(1 for p in flagged if typology in member.get(p, ())),
        )
    return scores


@dataclass(frozen=True)
class PaymentScore:
    """The minority class (laundering) over payments: flagged vs. labelled."""

    flagged: int
    laundering: int
    true_flags: int

    @property
    def precision(self) -> float | None:
        return self.true_flags / self.flagged if self.flagged else None

    @property
    def recall(self) -> float | None:
        return self.true_flags / self.laundering if self.laundering else None

    @property
    def f1(self) -> float | None:
        """2 TP / (flagged + laundering): the harmonic mean of precision and recall, 0 when nothing
        laundering is flagged, undefined only when there is neither a flag nor a laundering payment."""
        total = self.flagged + self.laundering
        return 2 * self.true_flags / total if total else None


def payment_score(alerts: Iterable[tuple[str, str]], ground_truth: Iterable[Instance]) -> PaymentScore:
    """Minority-class precision, recall and F1 over payments (see the module docstring)."""
    flagged = {payment_id for payment_id, _ in alerts}
    laundering = {payment_id for instance in ground_truth for payment_id in instance.payment_ids}
    return PaymentScore(len(flagged), len(laundering), len(flagged & laundering))


def format_payment_score(s: PaymentScore) -> str:
    return (
        f"payments: {s.laundering} laundering, {s.flagged} flagged, {s.true_flags} of them laundering; "
        f"precision {ratio_text(s.precision)}, recall {ratio_text(s.recall)}, F1 {ratio_text(s.f1)}"
    )


def ratio_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def format_scores(scores: Mapping[str, TypologyScore]) -> str:
    """A small fixed-width table, one line per typology."""
    lines = [
        f"{'typology':<14} {'instances':>9} {'detected':>8} {'recall':>7} {'alerts':>6} {'precision':>9}"
    ]
    for s in scores.values():
        lines.append(
            f"{s.typology:<14} {s.instances:>9} {s.detected:>8} {ratio_text(s.recall):>7} "
            f"{s.alerts:>6} {ratio_text(s.precision):>9}"
        )
    return "\n".join(lines)
