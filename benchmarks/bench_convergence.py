"""Objective reached at default settings against scikit-learn's exact solvers, on real data.

For each real dataset (scikit-learn's bundled ones and two of statsmodels',
as in ``tests/test_real_data.py``) and alpha, fits
``Pipeline(StandardScaler(), estimator)`` with CA-SGD's defaults
(``solver="svrg"``), with ``solver="sgd"``, and the exact solver at the same
regularization (LogisticRegression C = 1/(n alpha), Ridge alpha n,
PoissonRegressor alpha, all lbfgs at tol=1e-10 except Ridge), and prints the
relative objective gap, epochs, whether the fit reported convergence, and
seconds. ``--solvers`` picks the CA-SGD fits (``solver[:precision[:s]]``;
``svrg:bf16:8`` is the bf16 recipe at s=8). ``--raw`` fits every solver,
the exact one included, on the unscaled columns instead (columns far from
zero and in other units: what low-precision storage must keep).
``--synthetic`` runs the Gaussian problems of ``make_glm_data`` instead.
``--widen-column F`` multiplies the first column by F after the scaling,
for every solver: one column in other units (cents next to dollars) that
SVRG's preconditioning must absorb. lbfgs on such a column may stop short
itself: a negative gap is CA-SGD ending below it. ``--y-units C``
multiplies y by C where the loss carries its units (least squares,
Poisson; labels stay): the same data in other units, for every solver.
``--weight-units C`` fits CA-SGD with every sample weight C and alpha * C,
C times the same objective (C = 1/n: weights normalized to sum 1); the
gap is to the unweighted exact solver at alpha.

``--time-to-target`` prints, instead, the seconds each solver needs to come
within ``--target`` (relative) of the exact objective: every solver is
fitted with tol = 1e-1, 1e-2, ... 1e-9 and the first fit that reaches the
target counts (lbfgs; CA-SGD's SVRG; scikit-learn's SGDClassifier /
SGDRegressor where their objective is the same, binary log loss and squared
error with ``alpha``; CA-SGD's plain SGD).

``--streaming`` prints, instead, what the data-in-chunks paths reach: each
training set (75 %, standardized) cut into 10 chunks walked ``--passes``
times by ``partial_fit`` (CA-SGD's plain SGD, constant and "invscaling",
and SVRG; scikit-learn's SGD
where its objective is the same), and ``fit`` with and without
``early_stopping``: the relative objective gap on the training rows, the
test score, and epochs.

    python benchmarks/bench_convergence.py [--alphas 1/n,1e-3,1e-2] [--csv out.csv]
    python benchmarks/bench_convergence.py --alphas 1/n --solvers svrg:fp32:8,svrg:bf16:8
    python benchmarks/bench_convergence.py --raw --alphas 1e-3 --solvers svrg:fp32,svrg:bf16
    python benchmarks/bench_convergence.py --widen-column 1e4 --alphas 1e-3 --solvers svrg
    python benchmarks/bench_convergence.py --y-units 1e-4 --alphas 1e-3 --solvers svrg
    python benchmarks/bench_convergence.py --weight-units 1/n --alphas 1e-3 --solvers svrg
    python benchmarks/bench_convergence.py --datasets iris,diabetes  # a subset
    python benchmarks/bench_convergence.py --time-to-target [--target 1e-4]
    python benchmarks/bench_convergence.py --streaming [--passes 20] [--alphas 1e-3]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from _table import write_csv
from sklearn.base import clone
from sklearn.linear_model import SGDClassifier, SGDRegressor
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler

from sklearn_casgd._registry import FAMILIES
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_real_data import PROBLEMS

# The synthetic problems' families: those of the real problems (Gamma and
# Tweedie are compared with scikit-learn in tests/test_glm_families.py).
ESTIMATOR_FAMILIES = ("logistic", "multinomial", "linear", "poisson")


def synthetic_problems():
    return {
        f"synthetic-{family}": (
            lambda family=family: make_glm_data(family, 2000, 20, signal=2.0, random_state=1)[:2],
            family,
        )
        for family in ESTIMATOR_FAMILIES
    }


TOLERANCES = [10.0**-k for k in range(1, 10)]


def scaler(raw):
    """The default table's first step: StandardScaler, or none with ``--raw``."""
    return FunctionTransformer() if raw else StandardScaler()


def preprocessing(args):
    """The default table's steps before each solver: :func:`scaler`, then ``--widen-column``."""
    steps = [scaler(args.raw)]
    if args.widen_column != 1.0:

        def widen(X, factor=args.widen_column):
            X = np.array(X, dtype=np.float64)  # a copy: the caller's X stays as it is
            X[:, 0] *= factor
            return X

        steps.append(FunctionTransformer(widen))
    return steps


def contenders(family, n, alpha):
    """Solver name -> estimator whose ``tol`` the time-to-target sweep tightens."""
    solvers = {
        "lbfgs": FAMILIES[family].reference(alpha, n),
        "casgd-svrg": FAMILIES[family].estimator(alpha=alpha, random_state=0, max_iter=10_000),
        "casgd-sgd": FAMILIES[family].estimator(alpha=alpha, solver="sgd", random_state=0),
    }
    if family == "linear":
        solvers["lbfgs"] = None  # Ridge solves exactly; no iterations to time
        solvers["SGDRegressor"] = SGDRegressor(alpha=alpha, max_iter=1000, random_state=0)
    if family == "logistic":
        solvers["SGDClassifier"] = SGDClassifier(
            loss="log_loss", alpha=alpha, max_iter=1000, random_state=0
        )
    return {name: est for name, est in solvers.items() if est is not None}


def relative_gap(family, X, y, alpha, best, fitted):
    """How far above the exact objective ``best`` the fitted estimator is, relative."""
    reached = glm_objective(family, X, y, fitted.coef_, fitted.intercept_, alpha)
    return (reached - best) / abs(best)


def time_to_target(estimator, X, y, gap_of, target):
    """``(seconds, tol, gap)`` of the first fit in the tol sweep within ``target``."""
    gap = float("nan")
    for tol in TOLERANCES:
        fitted = clone(estimator).set_params(tol=tol)
        start = time.perf_counter()
        try:
            fitted.fit(X, y)
        except ValueError:  # a divergence: the target is not reached
            return None, tol, float("nan")
        seconds = time.perf_counter() - start
        gap = gap_of(fitted)
        if gap <= target:
            return seconds, tol, gap
    return None, TOLERANCES[-1], gap


def run_time_to_target(problems, args):
    header = ["dataset", "alpha", "solver", "seconds_to_target", "tol", "gap"]
    print(f"target: {args.target:g} relative to the exact objective")
    print("  ".join(header))
    rows = []
    for name, (loader, family) in problems.items():
        X, y = loader()
        X = StandardScaler().fit_transform(X)
        n = X.shape[0]
        target_y = y if family in ("linear", "poisson") else np.unique(y, return_inverse=True)[1]
        for alpha_text in args.alphas.split(","):
            alpha = 1.0 / n if alpha_text == "1/n" else float(alpha_text)
            exact = FAMILIES[family].reference(alpha, n).fit(X, y)
            best = glm_objective(family, X, target_y, exact.coef_, exact.intercept_, alpha)
            gap_of = functools.partial(relative_gap, family, X, target_y, alpha, best)

            for solver, estimator in contenders(family, n, alpha).items():
                seconds, tol, gap = time_to_target(estimator, X, y, gap_of, args.target)
                shown = "not reached" if seconds is None else f"{seconds:.3f}"
                row = [name, alpha_text, solver, shown, f"{tol:g}", f"{gap:.1e}"]
                rows.append(row)
                print("  ".join(row), flush=True)
    return header, rows


def streaming_contenders(family, alpha):
    """Solver name -> estimator fitted by partial_fit over chunks (none: fit)."""
    entry = FAMILIES[family]
    solvers = {
        "partial_fit casgd-sgd": entry.estimator(alpha=alpha, solver="sgd", random_state=0),
        "partial_fit casgd-sgd invscaling": entry.estimator(
            alpha=alpha, solver="sgd", learning_rate="invscaling", random_state=0
        ),
        "partial_fit casgd-svrg": entry.estimator(alpha=alpha, random_state=0),
    }
    # scikit-learn's SGD minimizes the same objective for these two (its eta0
    # defaults suit standardized data; "optimal" for the classifier).
    if family == "logistic":
        solvers["partial_fit SGDClassifier"] = SGDClassifier(
            loss="log_loss", alpha=alpha, random_state=0
        )
    if family == "linear":
        solvers["partial_fit SGDRegressor"] = SGDRegressor(alpha=alpha, random_state=0)
    return solvers


def run_streaming(problems, args):
    header = ["dataset", "alpha", "solver", "gap", "test_score", "epochs", "seconds"]
    print("  ".join(header))
    rows = []
    for name, (loader, family) in problems.items():
        X, y = loader()
        classifier = family in ("logistic", "multinomial")
        X_train, X_test, y_train, y_test = train_test_split(
            X, y, test_size=0.25, random_state=0, stratify=y if classifier else None
        )
        scaler = StandardScaler().fit(X_train)
        X_train, X_test = scaler.transform(X_train), scaler.transform(X_test)
        n = X_train.shape[0]
        target = np.unique(y_train, return_inverse=True)[1] if classifier else y_train
        chunks = np.array_split(np.arange(n), 10)
        for alpha_text in args.alphas.split(","):
            alpha = 1.0 / n if alpha_text == "1/n" else float(alpha_text)
            exact = FAMILIES[family].reference(alpha, n).fit(X_train, y_train)
            best = glm_objective(family, X_train, target, exact.coef_, exact.intercept_, alpha)
            gap_of = functools.partial(relative_gap, family, X_train, target, alpha, best)
            results = []
            for solver, estimator in streaming_contenders(family, alpha).items():
                extra = {"classes": np.unique(y_train)} if classifier else {}
                start = time.perf_counter()
                try:
                    for _ in range(args.passes):
                        for rows_ in chunks:
                            estimator.partial_fit(X_train[rows_], y_train[rows_], **extra)
                except ValueError as error:  # a divergence is reported, not a crash
                    results.append((solver, float("nan"), f"error: {error}"[:30], "", 0.0))
                    continue
                seconds = time.perf_counter() - start
                score = estimator.score(X_test, y_test)
                results.append((solver, gap_of(estimator), score, args.passes, seconds))
            for early_stopping in (False, True):
                estimator = FAMILIES[family].estimator(
                    alpha=alpha, early_stopping=early_stopping, random_state=0
                )
                start = time.perf_counter()
                estimator.fit(X_train, y_train)
                seconds = time.perf_counter() - start
                solver = "fit casgd-svrg" + (" early_stopping" if early_stopping else "")
                score = estimator.score(X_test, y_test)
                results.append((solver, gap_of(estimator), score, estimator.n_iter_, seconds))
            for solver, gap, score, epochs, seconds in results:
                shown = score if isinstance(score, str) else f"{score:.4f}"
                row = [name, alpha_text, solver, f"{gap:.2e}", shown, epochs, f"{seconds:.2f}"]
                rows.append(row)
                print("  ".join(str(v) for v in row), flush=True)
    return header, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alphas", default="1/n,1e-3,1e-2")
    parser.add_argument("--synthetic", action="store_true")
    parser.add_argument("--time-to-target", action="store_true")
    parser.add_argument("--target", type=float, default=1e-4)
    parser.add_argument("--streaming", action="store_true")
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument(
        "--solvers",
        default="svrg,sgd",
        help="CA-SGD fits of the default table: solver[:precision[:s]], comma-separated",
    )
    parser.add_argument(
        "--raw", action="store_true", help="the default table on the unscaled columns"
    )
    parser.add_argument(
        "--widen-column",
        type=float,
        default=1.0,
        help="multiply the first column by this after the scaling (default table only)",
    )
    parser.add_argument(
        "--y-units",
        type=float,
        default=1.0,
        help="multiply y by this where the loss carries its units (default table only)",
    )
    parser.add_argument(
        "--weight-units",
        default="1",
        help="every CA-SGD sample weight this (or 1/n), with alpha times it (default table only)",
    )
    parser.add_argument("--datasets", help="comma-separated names (default: all)")
    parser.add_argument("--csv")
    args = parser.parse_args()
    problems = synthetic_problems() if args.synthetic else PROBLEMS
    if args.datasets:
        unknown = set(args.datasets.split(",")) - set(problems)
        if unknown:
            parser.error(f"unknown datasets {sorted(unknown)}; choose from {sorted(problems)}")
        problems = {name: problems[name] for name in args.datasets.split(",")}
    warnings.simplefilter("ignore")
    if args.time_to_target or args.streaming:
        run = run_streaming if args.streaming else run_time_to_target
        header, rows = run(problems, args)
        if args.csv:
            write_csv(args.csv, header, rows)
        return
    header = ["dataset", "alpha", "solver", "gap", "epochs", "converged", "seconds"]
    print("  ".join(header))
    rows = []
    warnings.simplefilter("ignore")
    for name, (loader, family) in problems.items():
        X, y = loader()
        if family in ("linear", "poisson"):
            y = y * args.y_units
        n = X.shape[0]
        target = np.unique(y, return_inverse=True)[1] if family != "linear" else y
        if family == "poisson":
            target = y
        for alpha_text in args.alphas.split(","):
            alpha = 1.0 / n if alpha_text == "1/n" else float(alpha_text)
            start = time.perf_counter()
            exact = make_pipeline(*preprocessing(args), FAMILIES[family].reference(alpha, n))
            exact.fit(X, y)
            exact_seconds = time.perf_counter() - start
            Z = exact[:-1].transform(X)
            best = glm_objective(family, Z, target, exact[-1].coef_, exact[-1].intercept_, alpha)
            results = [("exact", 0.0, "", "", exact_seconds)]
            weight = 1.0 / n if args.weight_units == "1/n" else float(args.weight_units)
            for solver in args.solvers.split(","):
                settings = dict(zip(("solver", "precision", "s"), solver.split(":"), strict=False))
                if "s" in settings:
                    settings["s"] = int(settings["s"])
                estimator = FAMILIES[family].estimator(
                    alpha=alpha * weight, random_state=0, **settings
                )
                pipeline = make_pipeline(*preprocessing(args), estimator)
                weights = {}  # unit weights as the user passes them: none
                if weight != 1.0:
                    weights[f"{pipeline.steps[-1][0]}__sample_weight"] = np.full(n, weight)
                start = time.perf_counter()
                try:
                    fitted = pipeline.fit(X, y, **weights)[-1]
                except ValueError as error:  # a divergence is reported, not a crash
                    results.append((solver, float("nan"), "", f"error: {error}"[:40], 0.0))
                    continue
                seconds = time.perf_counter() - start
                reached = glm_objective(family, Z, target, fitted.coef_, fitted.intercept_, alpha)
                gap = (reached - best) / abs(best)
                converged = fitted.fit_stats_["converged"]
                results.append((solver, gap, fitted.n_iter_, converged, seconds))
            for solver, gap, epochs, converged, seconds in results:
                row = [name, alpha_text, solver, f"{gap:.2e}", epochs, converged, f"{seconds:.2f}"]
                rows.append(row)
                print("  ".join(str(v) for v in row), flush=True)
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
