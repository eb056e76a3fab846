"""Text classification on a generated corpus: CA-SGD against scikit-learn's solvers, side by side.

The corpus (``_text_corpus.make_text_corpus``: Zipf word frequencies and
class-dependent topics, no download) goes through a ``TfidfVectorizer``
once; 75 % of the documents train, 25 % are held out. On the training
TF-IDF matrix, interleaved ``--repeats`` times on ``--threads`` threads:

* ``CASGDLogisticRegression(alpha)`` at its defaults, and plain SGD for
  one epoch (``solver="sgd", max_iter=1``);
* ``LogisticRegression(C=1 / (n alpha))`` with lbfgs, newton-cg and saga,
  each to its default stop: the same objective (scikit-learn's C is the
  inverse of the summed, not the mean, penalty);
* ``SGDClassifier(loss="log_loss", alpha)`` to its default stop, and for
  one epoch (``max_iter=1``).

Each row: the fit's wall time (median), the time CA-SGD's defaults took
to come within ``--gap`` of the optimum (the fit's time before its epochs
plus the training time of the first epoch there, from ``loss_curve_``),
the objective's gap to the optimum, relative, and the held-out accuracy.
The optimum is the lowest objective of newton-cg at ``tol=1e-12`` and every
fit of the run (lbfgs's own stop is up to 1e-3 above it on text). The
process's first fit is CA-SGD's defaults on the training rows, timed apart
before the repeats (a new process: numba's import and its compiled code
where it is installed; ``NUMBA_CACHE_DIR`` pointing at an empty folder
times a new machine). One more row fits the whole
``Pipeline(TfidfVectorizer(), CASGD...)`` on the raw training documents,
as a user would.

``--data rcv1`` takes ``bench_sparse.py``'s rcv1-shaped matrix instead
(``--documents`` rows, 47,236 columns, unit-norm rows; no pipeline row).

    python benchmarks/bench_text.py [--documents 50000] [--repeats 3] [--csv text.csv]
    python benchmarks/bench_text.py --data rcv1 --documents 200000
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
from _table import print_table, write_csv
from _text_corpus import make_text_corpus
from bench_sparse import rcv1_like
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression, SGDClassifier
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from threadpoolctl import threadpool_limits

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd.metrics import glm_objective

# Seconds of quiet before each timed fit: the last fit's BLAS and torch
# threads spin for about 0.1 s after their work and slow the next one.
SETTLE = 0.25


def solvers(alpha: float, n_train: int) -> dict:
    C = 1.0 / (n_train * alpha)
    return {
        "CASGD defaults": lambda: CASGDLogisticRegression(alpha=alpha, random_state=0),
        "CASGD sgd, 1 epoch": lambda: CASGDLogisticRegression(
            alpha=alpha, solver="sgd", max_iter=1, tol=None, random_state=0
        ),
        "LogisticRegression lbfgs": lambda: LogisticRegression(C=C),
        "LogisticRegression newton-cg": lambda: LogisticRegression(C=C, solver="newton-cg"),
        "LogisticRegression saga": lambda: LogisticRegression(C=C, solver="saga"),
        "SGDClassifier": lambda: SGDClassifier(loss="log_loss", alpha=alpha, random_state=0),
        "SGDClassifier, 1 epoch": lambda: SGDClassifier(
            loss="log_loss", alpha=alpha, max_iter=1, tol=None, random_state=0
        ),
    }


def objective(model, X, y, alpha: float) -> float:
    return glm_objective("logistic", X, y, np.ravel(model.coef_), model.intercept_[0], alpha)


def seconds_to_gap(model, fit_seconds: float, best: float, gap: float) -> float | None:
    """A CA-SGD fit's time to come within ``gap`` of ``best``: set-up plus its epochs to there."""
    stats = model.fit_stats_
    setup = fit_seconds - stats["train_seconds"]
    for value, seconds in zip(model.loss_curve_, stats["epoch_seconds"], strict=True):
        if value - best <= gap * best:
            return setup + seconds
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=["corpus", "rcv1"], default="corpus")
    parser.add_argument("--documents", type=int, default=50_000)
    parser.add_argument("--vocabulary", type=int, default=30_000)
    parser.add_argument("--mean-length", type=int, default=120, help="words a document")
    parser.add_argument("--alpha", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gap", type=float, default=1e-4)
    parser.add_argument("--csv")
    args = parser.parse_args()
    if args.data == "rcv1":
        X, labels = rcv1_like(args.documents, 47_236, 0.0016)
        X_train, X_test, y_train, y_test = train_test_split(
            X, labels, test_size=0.25, random_state=0
        )
    else:
        documents, labels = make_text_corpus(
            args.documents, vocabulary=args.vocabulary, mean_length=args.mean_length
        )
        train, test, y_train, y_test = train_test_split(
            documents, labels, test_size=0.25, random_state=0
        )
        vectorizer = TfidfVectorizer().fit(train)
        X_train, X_test = vectorizer.transform(train), vectorizer.transform(test)
    n_train = X_train.shape[0]
    candidates = solvers(args.alpha, n_train)
    seconds = {name: [] for name in candidates}
    fitted = {}
    with threadpool_limits(args.threads), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one-epoch fits stop before converging
        import torch

        torch.set_num_threads(args.threads)
        first = candidates["CASGD defaults"]()
        started = time.perf_counter()
        first.fit(X_train, y_train)
        first_seconds = time.perf_counter() - started
        optimum = LogisticRegression(
            C=1.0 / (n_train * args.alpha), solver="newton-cg", tol=1e-12, max_iter=10_000
        )
        optimum.fit(X_train, y_train)
        for _ in range(args.repeats):
            for name, make in candidates.items():
                model = make()
                time.sleep(SETTLE)
                started = time.perf_counter()
                model.fit(X_train, y_train)
                seconds[name].append(time.perf_counter() - started)
                fitted[name] = model
        if args.data == "corpus":
            pipeline = make_pipeline(TfidfVectorizer(), CASGDLogisticRegression(alpha=args.alpha))
            started = time.perf_counter()
            pipeline.fit(train, y_train)
            pipeline_seconds = time.perf_counter() - started
    best = min(
        objective(model, X_train, y_train, args.alpha)
        for model in [optimum, first, *fitted.values()]
    )
    header = ["model", "fit seconds", f"seconds to {args.gap:g}", "objective gap", "accuracy"]

    def row(name, model, fit_seconds, to_gap=None):
        gap = (objective(model, X_train, y_train, args.alpha) - best) / best
        shown = "" if to_gap is None else f"{to_gap:.3f}"
        return [
            name,
            f"{fit_seconds:.3f}",
            shown,
            f"{gap:.2e}",
            f"{model.score(X_test, y_test):.4f}",
        ]

    rows = [
        row(
            "CASGD defaults, the process's first fit",
            first,
            first_seconds,
            seconds_to_gap(first, first_seconds, best, args.gap),
        )
    ]
    for name, model in fitted.items():
        median = statistics.median(seconds[name])
        to_gap = None
        if name == "CASGD defaults":
            to_gap = seconds_to_gap(model, seconds[name][-1], best, args.gap)
        rows.append(row(name, model, median, to_gap))
    if args.data == "corpus":
        rows.append(
            [
                "Pipeline(Tfidf, CASGD defaults)",
                f"{pipeline_seconds:.3f}",
                "",
                "",
                f"{pipeline.score(test, y_test):.4f}",
            ]
        )
    described = "TF-IDF of a generated corpus" if args.data == "corpus" else "rcv1-shaped"
    print(
        f"{described}: {X_train.shape[0]} x {X_train.shape[1]} "
        f"({X_train.nnz / X_train.shape[0]:.0f} stored values a row) for training; "
        f"alpha={args.alpha}; {args.threads} thread(s); medians of {args.repeats}"
    )
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
