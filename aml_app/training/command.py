"""`aml-app train-model`: train the AML model (`AML_MODEL=<path>`) on a labelled history, and report what
it scores on a part of that history it never read.

A bank does not have AMLworld's traffic; it has its own labelled payments. The history (AMLworld-layout
files, `aml_app.training.history`) is replayed once through the reference of Services B and C, so every
payment's features are what the gated detector would see about it; then split (`aml_app.training.holdout`)
into the part the trees learn from, the part that sets the cut, and the part only the report reads. With
`--folds K` (the default, 5) the first two are pooled and cut into K folds: trees fitted to the other folds
score each fold, the cut, the alert budgets and the naming prior are set on those scores, and the trees
written learn from the whole pool; the scored part stays unread. With `--cross-validate N` the history is
cut into N parts instead, each scored by a model trained so on the others, and the report pools them:
every attempt is scored once, by a model that never read it; the model written learns from all of it.
`--simulated` trains the model shipped with the package instead, from the calibrated simulator's runs
(`make model`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from aml_app.click_types import FiniteRange
from aml_app.detection.model import BENIGN
from aml_app.detection.thresholds import AmlThresholds
from aml_app.settings import load_settings
from aml_app.training.fit import (
    CUT_RATE,
    MAX_BENIGN_FIT,
    PARAMS,
    RUNS,
    SHIPPED_VETO,
    Replayed,
    calibrated_run,
    cross_fitted,
    replay_timeline,
    train,
    write,
)
from aml_app.training.history import read_history
from aml_app.training.holdout import PARTS, SPLITS, crossed, folded, rendered, scored, scored_each, split
from aml_app.training.replay import Reporting, timeline_of

PROGRESS_INTERVAL = 5.0
#: Folds of the pooled learning and cut parts (`--folds`). A cut part of 1,500 benign payments cannot
#: place a budget of 0.05 % (under one payment) but above all of them; scored out of fold, the whole pool
#: of about 7,500 sets it (BENCHMARKS.md, "Trained on the real files").
FOLDS = 5


def _shares(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) <= 0:
        raise click.BadParameter(
            f"{text!r}: expected three positive numbers, learn,cut,score", param_hint="--shares"
        )
    return values[0], values[1], values[2]


def _seeds(text: str, hint: str) -> list[int]:
    """Calibrated runs to score: none that the shipped training reads."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected seeds such as 1,20", param_hint=hint) from None
    if read := sorted(set(seeds) & {*RUNS["seeds"], *RUNS["held_out"]}):
        raise click.BadParameter(f"seeds {read} are read by the training; score on others", param_hint=hint)
    return seeds


@click.command("train-model")
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--out", type=click.Path(dir_okay=False, writable=True), required=True, help="The model file to write."
)
@click.option(
    "--split",
    "by",
    type=click.Choice(SPLITS),
    default="time",
    show_default=True,
    help="How the history is cut into its parts: by event time, by attempt (a hash of each attempt and "
    "benign payment), or by account (of each payer, so that the report scores payers training never read).",
)
@click.option(
    "--shares",
    default="0.6,0.2,0.2",
    show_default=True,
    help="The shares of payments the trees learn from, that set the cut, and that only the report reads.",
)
@click.option(
    "--cut-rate",
    type=FiniteRange(0, 1, min_open=True, max_open=True),
    default=CUT_RATE,
    show_default=True,
    help="The share of benign payments of the cut part that the detector alerts.",
)
@click.option(
    "--folds",
    type=click.IntRange(min=0),
    default=FOLDS,
    show_default=True,
    help="Pool the learning and cut parts and set the cut on each of this many folds scored by trees "
    "fitted to the others (0 or 1: the cut part alone sets it).",
)
@click.option(
    "--by-look/--by-attempt",
    default=None,
    help="Label a laundering payment that looks like another typology by that typology where other "
    "payments name its attempt right (the default with FILES), or every payment by its attempt's "
    "typology (the default with --simulated).",
)
@click.option(
    "--cross-validate",
    "parts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Cut the history into this many parts (as --split cuts it), score each with a model trained on "
    "the others and report them pooled, so that every attempt is scored once; the model written learns "
    "from the whole history (--shares is unused). 0: one scored part.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Of the hash that splits by attempt or account."
)
@click.option(
    "--max-benign",
    type=click.IntRange(min=1),
    default=MAX_BENIGN_FIT,
    show_default=True,
    help="The most benign payments between two parties each fit of the trees learns from; where there "
    "are more, a uniform sample (the cut and the alert budgets are still set on all of them).",
)
@click.option(
    "--max-iter",
    type=click.IntRange(min=1),
    default=PARAMS["max_iter"],
    show_default=True,
    help="Boosting iterations of each fit of the trees (scikit-learn's max_iter): fewer fit sooner and "
    "may name fewer attempts; the report on the scored part shows what they cost.",
)
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write the report on the scored part here (JSON).",
)
@click.option(
    "--simulated",
    is_flag=True,
    help="Train the shipped model from the calibrated simulator's runs; no FILES.",
)
@click.option(
    "--score-seeds",
    default="1",
    show_default=True,
    help="With --simulated: the calibrated runs the report scores.",
)
def train_model_command(
    files: tuple[str, ...],
    out: str,
    by: str,
    shares: str,
    cut_rate: float,
    folds: int,
    by_look: bool | None,
    parts: int,
    seed: int,
    max_benign: int,
    max_iter: int,
    report_path: str | None,
    simulated: bool,
    score_seeds: str,
) -> None:
    """Train the AML model on FILES (an AMLworld-layout transactions CSV with `Is Laundering`, and
    optionally a patterns file naming the attempts' typologies), and report what it scores on the part of
    them it never read. Use the file with AML_MODEL=<path>."""
    started = time.monotonic()

    def say(text: str) -> None:
        click.echo(f"train-model: {text} ({time.monotonic() - started:.0f} s)", err=True)

    if simulated == bool(files):
        raise click.UsageError(
            "give labelled FILES or --simulated (the shipped model's training), one of the two"
        )
    for written in (out, report_path):
        # Before the training, which takes minutes: not a traceback at its end.
        folder = Path(written).resolve().parent if written is not None else None
        if folder is not None and not (folder.is_dir() and os.access(folder, os.W_OK)):
            raise click.UsageError(f"cannot write {written}: {folder} is not a folder this user may write")
    if parts and (parts < 2 or folds < 2 or simulated):
        raise click.UsageError(
            "--cross-validate takes at least 2 parts, labelled FILES and --folds of at least 2"
        )
    params = {**PARAMS, "max_iter": max_iter}
    # The deployment's thresholds, rates and C's band, which the worker runs the model with: the replay
    # computes the features with them, and the file records them (`aml_app.detection.model_settings`).
    settings = load_settings()
    thresholds = settings.detection.aml_thresholds
    reporting = Reporting(
        thresholds.rates, settings.dependencies.reporting_threshold, settings.dependencies.threshold_band
    )
    if by_look is None:
        # Labels by look name about as many of a history's own held-out attempts as labels by attempt
        # (the real files, cross-validated); the shipped model, learnt on the simulator and judged on
        # real files, names fewer with them (BENCHMARKS.md).
        by_look = not simulated
    if simulated:
        doc, scored_runs = _simulated(
            _seeds(score_seeds, "--score-seeds"), by_look, params, say, (thresholds, reporting)
        )
        report: dict[str, Any] = {
            "scored": "calibrated seeds " + score_seeds,
            **scored(doc, Replayed.pooled(scored_runs)),
        }
    else:
        try:
            history = read_history(files, progress=say)
        except ValueError as exc:
            raise click.ClickException(f"{str(exc).rstrip('.')}; no model was written.") from None
        except OSError as exc:
            raise click.ClickException(f"could not read {exc.filename}: {exc.strerror}.") from None
        say(
            f"read {len(history.payments):,} payments ({history.laundering:,} laundering, "
            f"{len(history.attempts):,} attempts named by typology; {history.skipped:,} rows skipped: "
            "currencies without an ISO code)"
        )
        run = replay_timeline(
            history.payments,
            history.attempts,
            unnamed=True,
            progress=_replaying(say),
            thresholds=thresholds,
            reporting=reporting,
        )
        how = _Training(by, folds, seed, cut_rate, by_look, max_benign, params, say)
        if parts:
            doc, report = _cross_validated(run, parts, how)
        else:
            doc, report = _split(run, _shares(shares), how)
        doc["training"]["history"] = {
            "files": history.files,
            "split": by,
            **({"cross_validated": parts} if parts else {"shares": list(_shares(shares))}),
            "folds": folds if folds >= 2 else 0,
        }
    doc["training"]["settings"] = dict(settings.model_settings())  # what a worker compares at start-up
    try:
        write(doc, Path(out))
        if report_path is not None:
            Path(report_path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise click.ClickException(f"could not write {exc.filename}: {exc.strerror or exc}.") from None
    alerting = ", ".join(doc["alerting_rules"]) or "none"
    say(f"wrote {out}; cut {doc['cut']:.4f}; rules that alert beside it: {alerting}")
    for line in rendered(report):
        click.echo(line)


@dataclass(frozen=True)
class _Training:
    """How the command trains each model: the split's kind and hash seed, the inner folds, the cut rate,
    the labels, the most benign payments a fit learns from, the trees' parameters, and where progress
    goes."""

    by: str
    folds: int
    seed: int
    cut_rate: float
    by_look: bool
    max_benign: int
    params: dict[str, Any]
    say: Callable[[str], None]

    def trained(self, pool: Replayed) -> dict[str, Any]:
        """The model file's document: the trees learn from `pool`, whose folds, each scored by trees
        fitted to the others, set the cut, the alert budgets and the naming prior."""
        pieces = folded(pool, self.by, self.folds, self.seed)
        out_of_fold = cross_fitted(
            pieces, self.params, progress=self.say, by_look=self.by_look, max_benign=self.max_benign
        )
        self.say("fitting the trees to every fold")
        doc, _ = train(
            pieces,
            pieces,
            self.params,
            cut_rate=self.cut_rate,
            progress=self.say,
            held_out_probabilities=out_of_fold,
            by_look=self.by_look,
            max_benign=self.max_benign,
        )
        return doc


def _split(
    run: Replayed, shares: tuple[float, float, float], how: _Training
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model trained on the learning and cut parts, and the report on the scored part."""
    parts = split(run, how.by, shares, how.seed)
    for name in PARTS:
        part = getattr(parts, name)
        how.say(f"{name}: {len(part.payments):,} payments, {len(part.attempts):,} attempts")
    _enough(parts.learn, parts.cut, parts.score)
    if how.folds >= 2:
        doc = how.trained(Replayed.pooled([parts.learn, parts.cut]))
    else:
        how.say("fitting the trees")
        doc, _ = train(
            [parts.learn],
            [parts.cut],
            how.params,
            cut_rate=how.cut_rate,
            progress=how.say,
            by_look=how.by_look,
            max_benign=how.max_benign,
        )
    return doc, {"scored": f"the {PARTS[2]} part", **scored(doc, parts.score)}


def _cross_validated(run: Replayed, parts: int, how: _Training) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model trained on the whole history, and the report of `parts` models, each trained on all
    but one part and scoring that one (`aml_app.training.holdout.scored_each`).

    Why: a part of a fifth of a history of 450 attempts measures recall to about 0.04, so one split's
    figure says as much about the split as about the model; scored once each, all of them measure it."""
    pieces = crossed(run, how.by, parts, how.seed)
    docs = []
    for k, piece in enumerate(pieces):
        rest = Replayed.pooled([other for j, other in enumerate(pieces) if j != k])
        how.say(
            f"cross-validation {k + 1} of {parts}: training without part {k + 1} "
            f"({len(piece.payments):,} payments, {len(piece.attempts):,} attempts)"
        )
        _enough(rest, rest)
        docs.append(how.trained(rest))
    how.say("training the model written on the whole history")
    doc = how.trained(run)
    return doc, {
        "scored": f"each of {parts} parts by a model trained on the others",
        "cross_validated": parts,
        **scored_each(list(zip(docs, pieces, strict=True))),
    }


def _enough(learn: Replayed, cut: Replayed, score: Replayed | None = None) -> None:
    """One sentence when a part cannot train or be scored: the trees need benign and laundering payments
    between two parties to learn from (they never read a self-payment), the cut benign ones to be set on,
    and the report laundering attempts to measure."""
    labels = {learn.labels[i] for i in learn.between()}
    if labels == {BENIGN} or BENIGN not in labels:
        raise click.ClickException(
            "the learning part needs both benign and laundering payments between two parties; give a "
            "longer history, other --shares, or --split attempt (for files that are not one stretch of time)."
        )
    if all(cut.labels[i] != BENIGN for i in cut.between()):
        raise click.ClickException(
            "the cut part holds no benign payment between two parties; give a longer history or other "
            "--shares."
        )
    if score is not None and not score.attempts:
        raise click.ClickException(
            "the scored part holds no laundering attempt, so the report could measure nothing; give a "
            "longer history, other --shares or --seed, or --split attempt."
        )


def _simulated(
    score_seeds: Sequence[int],
    by_look: bool,
    params: dict[str, Any],
    say: Callable[[str], None],
    deployment: tuple[AmlThresholds, Reporting],
) -> tuple[dict[str, Any], list[Replayed]]:
    """The shipped model's training (`RUNS`), and the scored runs replayed with `deployment`'s thresholds
    and C's reporting."""
    thresholds, reporting = deployment

    order = [*RUNS["seeds"], *RUNS["held_out"], *score_seeds]

    def replayed(s: int) -> Replayed:
        patterns, background = calibrated_run(s, RUNS["days"], RUNS["per_hour"], RUNS["attempts"])
        say(f"replaying calibrated seed {s}, run {order.index(s) + 1} of {len(order)}")
        timeline = timeline_of(patterns, background)
        return replay_timeline(
            timeline, patterns.attempts, progress=_replaying(say), thresholds=thresholds, reporting=reporting
        )

    learn = [replayed(s) for s in RUNS["seeds"]]
    held_out = [replayed(s) for s in RUNS["held_out"]]
    say("fitting the trees")
    doc, _ = train(learn, held_out, params, progress=say, veto=SHIPPED_VETO, by_look=by_look)
    doc["training"]["runs"] = dict(RUNS)
    return doc, [replayed(s) for s in score_seeds]


def _replaying(say: Callable[[str], None]) -> Callable[[int, int], None]:
    """A replay's progress, said every PROGRESS_INTERVAL seconds at most: how far, how fast, how long left."""
    started = last = time.monotonic()

    def progress(done: int, of: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= PROGRESS_INTERVAL:
            last = now
            rate = done / (now - started)
            say(
                f"replayed {done:,} of {of:,} payments, {rate:,.0f}/s, about {(of - done) / rate:,.0f} s left"
            )

    return progress
