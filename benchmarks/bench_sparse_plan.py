"""Sparse X: the planner's predicted epochs and seconds against the measured ones, per solver.

For each generated sparse problem (no download) this fits CA-SGD three
ways, interleaved ``--repeats`` times: at its defaults (what the planner
chose), with Newton epochs forced (conjugate gradients on the curvature's
products, :mod:`sklearn_casgd._engine.curvature`) and with them ruled out
(minibatch SVRG at the planner's batch size: the sparse epoch kernel where
numba is installed, else the torch steps). Each row gives the planner's
predicted epochs and seconds for that solver, the epochs the fit ran and
its median wall seconds, the objective's gap to the optimum and the
certificate's bound on it (``fit_stats_["gap_bound"]``). The optimum is a
float64 CA-SGD fit to ``tol=1e-10``, whose certificate bounds its own gap
by about ``1e-11``, or a lower objective of the run.

Problems: ``text`` (a generated corpus's TF-IDF, about 40 values a row,
30,000 words), ``rcv1`` (``bench_sparse.rcv1_like``: 47,236 columns, 75 a
row), ``tables`` (breast_cancer unscaled, as CSR: columns stored in every
row), ``digits`` (ten classes, pixels / 16 as CSR) and ``onehot`` (Poisson
counts on six one-hot categorical factors of 5-500 levels and five numeric
columns, about 11 values a row).

    python benchmarks/bench_sparse_plan.py [--problems text,rcv1] [--rows 100000] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import scipy.sparse as sp
import torch
from _table import print_table, write_csv
from _text_corpus import make_text_corpus
from bench_sparse import rcv1_like
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.feature_extraction.text import TfidfVectorizer
from threadpoolctl import threadpool_limits

from sklearn_casgd import CASGDLogisticRegression, CASGDPoissonRegressor
from sklearn_casgd._engine import planner
from sklearn_casgd.metrics import glm_objective


def onehot_counts(n_rows: int, seed: int = 0):
    """Poisson counts on one-hot categorical factors and numeric columns, as CSR."""
    rng = np.random.default_rng(seed)
    levels = [5, 10, 20, 50, 100, 500]
    blocks, raw = [], np.zeros(n_rows)
    for count in levels:
        codes = rng.integers(count, size=n_rows)
        effect = rng.normal(0.0, 0.3, count)
        raw += effect[codes]
        blocks.append(sp.csr_matrix((np.ones(n_rows), (np.arange(n_rows), codes)), (n_rows, count)))
    numeric = rng.normal(size=(n_rows, 5))
    raw += numeric @ rng.normal(0.0, 0.2, 5)
    X = sp.hstack([*blocks, sp.csr_matrix(numeric)], format="csr")
    exposure = rng.uniform(0.2, 1.0, n_rows)
    y = rng.poisson(exposure * np.exp(raw - 2.0)) / exposure
    return X.astype(np.float32), y, "poisson", exposure


def problem(name: str, n_rows: int):
    """``(X, y, family, sample_weight)`` of a named problem."""
    if name == "text":
        documents, labels = make_text_corpus(n_rows, vocabulary=30_000, mean_length=50)
        X = TfidfVectorizer().fit_transform(documents).astype(np.float32)
        return X, labels, "logistic", None
    if name == "rcv1":
        X, labels = rcv1_like(n_rows, 47_236, 0.0016)
        return X, labels, "logistic", None
    if name == "tables":
        X, labels = load_breast_cancer(return_X_y=True)
        return sp.csr_matrix(X), labels, "logistic", None
    if name == "digits":
        X, labels = load_digits(return_X_y=True)
        return sp.csr_matrix(X / 16.0), labels, "multinomial", None
    return onehot_counts(n_rows)


def estimator(family: str, alpha: float, **params):
    if family == "poisson":
        return CASGDPoissonRegressor(alpha=alpha, **params)
    return CASGDLogisticRegression(alpha=alpha, random_state=0, **params)


def objective(family, model, X, y, alpha, sample_weight) -> float:
    if family == "multinomial":
        y = np.unique(y, return_inverse=True)[1]
    coef = model.coef_.ravel() if family == "logistic" else model.coef_
    intercept = model.intercept_[0] if family == "logistic" else model.intercept_
    return glm_objective(family, X, y, coef, intercept, alpha, sample_weight=sample_weight)


SOLVERS = {"defaults": None, "Newton forced": True, "minibatch forced": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="text,rcv1,tables,digits,onehot")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--alpha", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--csv")
    args = parser.parse_args()
    header = [
        "problem", "solver", "planned", "predicted epochs", "epochs", "predicted s",
        "seconds", "gap", "gap bound", "converged",
    ]  # fmt: skip
    rows = []
    torch.set_num_threads(args.threads)
    with threadpool_limits(args.threads), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for name in args.problems.split(","):
            X, y, family, weight = problem(name, args.rows)
            reference = estimator(family, args.alpha, precision="fp64", tol=1e-10)
            reference.fit(X, y, sample_weight=weight)  # also the process's first fit
            best = objective(family, reference, X, y, args.alpha, weight)
            seconds = {solver: [] for solver in SOLVERS}
            fitted = {}
            for _ in range(args.repeats):
                for solver, newton in SOLVERS.items():
                    planner.NEWTON = newton
                    model = estimator(family, args.alpha)
                    started = time.perf_counter()
                    model.fit(X, y, sample_weight=weight)
                    seconds[solver].append(time.perf_counter() - started)
                    fitted[solver] = model
            planner.NEWTON = None
            best = min(
                [best] + [objective(family, m, X, y, args.alpha, weight) for m in fitted.values()]
            )
            for solver, model in fitted.items():
                stats = model.fit_stats_
                plan = stats["plan"] or {}
                newton = plan.get("newton", False)
                candidate = plan.get("newton_candidate") if newton else None
                predicted_epochs = (candidate or {}).get("epochs", plan.get("predicted_epochs"))
                predicted_seconds = (candidate or {}).get("seconds", plan.get("predicted_seconds"))
                gap = (objective(family, model, X, y, args.alpha, weight) - best) / best
                bound = stats["gap_bound"]
                rows.append([
                    f"{name} {X.shape[0]}x{X.shape[1]}", solver,
                    "Newton" if newton else f"minibatch b={stats['batch_size']}",
                    "-" if predicted_epochs is None else f"{predicted_epochs:.1f}",
                    model.n_iter_,
                    "-" if predicted_seconds is None else f"{predicted_seconds:.3f}",
                    f"{statistics.median(seconds[solver]):.3f}", f"{gap:.1e}",
                    "-" if bound is None else f"{bound:.1e}", stats["converged"],
                ])  # fmt: skip
                print("  ".join(str(v) for v in rows[-1]), flush=True)
    print(f"alpha={args.alpha}, {args.threads} threads, medians of {args.repeats}")
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
