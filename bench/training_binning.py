"""Training's price of binning weighted features: scikit-learn's binning against one sort a feature
(`aml_app.training.binning`), alternated in one run.

Every fit of the trees weighs its rows (each class alike). Below 200,000 rows scikit-learn 1.9 bins each
weighted feature with one sort per threshold; `faster_weighted_binning` gives the same thresholds from one.
Two measures, each alternated (scikit-learn's, one sort, scikit-learn's, ...), `--rounds` times:
- one fit of one iteration on 71 random features (as many as the model's) with random weights, at each of
  `--sizes` rows: the binning and a tree, what every fit of train-model pays before its iterations;
- `aml-app train-model` on the real files (`--split attempt`, the other options the defaults) in this
  process, each model file's digest recorded: both ways must write the same file.

    .venv/bin/python -m bench.training_binning [--sizes 20000,100000,190000] [--rounds 2] [--no-real]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import PROJECT, finish, machine, markdown_table

NAME = "training_binning"
FEATURES = 71
REAL = (
    PROJECT / "tests/data/amlworld/HI-Small_Trans_rows1-7500.csv",
    PROJECT / "tests/data/amlworld/LI-Medium_Patterns.txt",
)


@contextlib.contextmanager
def binned(faster: bool) -> Iterator[None]:
    """The fits of this block bin as `faster` says: one sort a feature, or scikit-learn's own."""
    import aml_app.training.fit as fit
    from aml_app.training.binning import faster_weighted_binning

    @contextlib.contextmanager
    def scikit_learns() -> Iterator[bool]:
        yield False

    chosen = faster_weighted_binning if faster else scikit_learns
    kept, fit.faster_weighted_binning = fit.faster_weighted_binning, chosen  # type: ignore[assignment]
    try:
        with chosen() as used:
            assert used == faster, "scikit-learn's functions are not the ones one_sort was adapted from"
            yield
    finally:
        fit.faster_weighted_binning = kept  # type: ignore[assignment]


def one_fit(rows: int, faster: bool) -> float:
    from sklearn.ensemble import HistGradientBoostingClassifier

    rng = np.random.default_rng(rows)
    x = rng.lognormal(size=(rows, FEATURES))
    y = rng.integers(0, 3, rows)
    weights = rng.uniform(0.5, 2.0, rows)
    with binned(faster):
        started = time.perf_counter()
        HistGradientBoostingClassifier(max_iter=1, early_stopping=False, random_state=0).fit(
            x, y, sample_weight=weights
        )
        return time.perf_counter() - started


def train_real(faster: bool, folder: Path) -> dict[str, Any]:
    from aml_app.training.command import train_model_command

    out = folder / f"model_{'one_sort' if faster else 'scikit_learn'}.json"
    args = [*map(str, REAL), "--split", "attempt", "--out", str(out)]
    with binned(faster), open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        with contextlib.redirect_stderr(quiet):
            started = time.perf_counter()
            train_model_command.main(args, standalone_mode=False)
            seconds = time.perf_counter() - started
    return {"seconds": seconds, "model_sha256": hashlib.sha256(out.read_bytes()).hexdigest()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    doc: dict[str, Any] = {"machine": machine(), "args": vars(args), "fits": [], "real": []}
    ways = [False, True] * args.rounds
    for rows in args.sizes:
        seconds: dict[str, list[float]] = {"scikit_learn": [], "one_sort": []}
        for faster in ways:
            seconds["one_sort" if faster else "scikit_learn"].append(one_fit(rows, faster))
        print(f"one fit of {rows:,} rows: {seconds}", flush=True)
        doc["fits"].append({"rows": rows, **seconds})
    if args.real:
        with tempfile.TemporaryDirectory(prefix="aml-training-binning-") as folder:
            for faster in ways:
                done = {
                    "binning": "one_sort" if faster else "scikit_learn",
                    **train_real(faster, Path(folder)),
                }
                print(f"train-model on the real files: {done}", flush=True)
                doc["real"].append(done)
        doc["real_models_identical"] = len({r["model_sha256"] for r in doc["real"]}) == 1
    return doc


def report(doc: dict[str, Any]) -> str:
    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.1f}"

    def listed(values: list[float]) -> str:
        return " / ".join(f"{s:.1f}" for s in values)

    rows = [
        [
            f"{f['rows']:,}",
            listed(f["scikit_learn"]),
            listed(f["one_sort"]),
            f"{statistics.median(f['scikit_learn']) / statistics.median(f['one_sort']):.1f}x",
        ]
        for f in doc["fits"]
    ]
    lines = [
        f"one fit of one iteration, {FEATURES} features, weighted (s, in the order run)",
        markdown_table(["rows", "scikit-learn's binning", "one sort a feature", "median ratio"], rows),
    ]
    if doc["real"]:
        by = {
            way: [r["seconds"] for r in doc["real"] if r["binning"] == way]
            for way in ("scikit_learn", "one_sort")
        }
        lines.append(
            f"\ntrain-model on the real files (--split attempt): scikit-learn's binning "
            f"{' / '.join(f'{s:.0f}' for s in by['scikit_learn'])} s (median {median(by['scikit_learn'])}), "
            f"one sort {' / '.join(f'{s:.0f}' for s in by['one_sort'])} s (median {median(by['one_sort'])}); "
            f"model files identical: {doc['real_models_identical']}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[20_000, 100_000, 190_000]
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--no-real", dest="real", action="store_false", help="skip train-model on the real files"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before scikit-learn starts its OpenMP pool
    doc = run(parse_args(argv))
    finish(NAME, doc, report)


if __name__ == "__main__":
    main()
