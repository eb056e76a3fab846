"""Time to a fitted model: wall seconds for each solver to come within a gap of the optimum.

The project's headline table. For each problem and solver it prints the wall
time of a fit at the solver's defaults, the relative objective gap it ends
at, and the wall time to reach the gaps ``--gaps`` (default 1e-2, 1e-4,
1e-6) of the exact optimum, the median of ``--repeats`` runs interleaved
solver by solver (each repeat fits every solver once, in the same order).

Problems (float32 X, standardized columns, ``alpha`` per ``--alphas``):

* synthetic: ``--families`` x ``--n`` x ``--d``. Logistic and multinomial
  (10 classes) are ``make_classification`` with half the features
  informative, least squares and Poisson ``make_glm_data``;
* ``--real``: scikit-learn's and statsmodels' datasets of
  ``tests/test_real_data.py`` (standardized; float64, as loaded);
* ``--libsvm PATH``: a LIBSVM file (binary labels: logistic; else least
  squares), standardized when dense.

Solvers on the same objective (``mean loss + alpha / 2 ||coef||^2``):
scikit-learn's lbfgs and newton-cholesky (LogisticRegression,
PoissonRegressor), Ridge (least squares), SGDClassifier / SGDRegressor
(binary log loss, squared error) and CA-SGD at its defaults, in this
process and, with ``--ranks 1,2``, on a warm pool of 2 worker processes.
With ``--minibatch``, where the defaults run Newton epochs, also CA-SGD's
minibatch SVRG at the batch size the planner weighed fastest among
minibatch plans ("CA-SGD minibatch": what the defaults ran before Newton
epochs, side by side).
The optimum is the lowest objective among newton-cholesky (lbfgs for
least squares' Ridge) at tol 1e-10 and every fit of the run.

How a time to a gap is measured: scikit-learn's iterative solvers are fitted
again with tol 1e-1, 1e-2, ... (each a whole fit, timed); the first fit
within the gap counts. CA-SGD records the exact objective and the training
time after every epoch (``loss_curve_``, ``fit_stats_["epoch_seconds"]``):
its time to a gap is the fit's time before the epochs (validation,
planning) plus the training time of the first epoch within it. A gap that
the default fit did not reach is ``-``; SGD's estimators are fitted at
their defaults only.

    python benchmarks/bench_time_to_optimum.py   # logistic, poisson; n=1e5,4e5; d=28,100
    python benchmarks/bench_time_to_optimum.py --full --csv t.csv  # the whole grid (long)
    python benchmarks/bench_time_to_optimum.py --real --families none
    python benchmarks/bench_time_to_optimum.py --ranks 1,2 --plot gaps.png
    python benchmarks/bench_time_to_optimum.py --minibatch  # Newton epochs against minibatch
    python benchmarks/bench_time_to_optimum.py --grid-search  # 10 alphas x 5 folds, digits
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from _table import print_table, write_csv
from sklearn.base import clone
from sklearn.datasets import load_svmlight_file, make_classification
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import (
    LogisticRegression,
    PoissonRegressor,
    Ridge,
    SGDClassifier,
    SGDRegressor,
)
from sklearn.preprocessing import StandardScaler

from sklearn_casgd._registry import FAMILIES
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SWEEP = [10.0**-k for k in range(1, 11)]
# Seconds of quiet before each timed fit: a threaded BLAS call (scikit-learn's
# solvers, numpy's products) leaves its threads spinning for about 0.1 s, and
# torch's threads after their work, which slows whatever runs next on the
# same cores; each fit is timed from a quiet machine.
SETTLE = 0.25
FULL_GRID = {"families": "logistic,multinomial,linear,poisson", "n": "1e5,4e5,2e6",
             "d": "28,100,500"}  # fmt: skip


@dataclass
class Problem:
    name: str
    family: str
    X: np.ndarray
    y: np.ndarray  # as the estimators take it (labels, counts, values)
    alpha: float

    @property
    def target(self) -> np.ndarray:
        """y as glm_objective reads it: class indices for classifiers."""
        if self.family in ("logistic", "multinomial"):
            return np.unique(self.y, return_inverse=True)[1]
        return self.y

    def objective(self, fitted) -> float:
        return glm_objective(
            self.family, self.X, self.target, fitted.coef_, fitted.intercept_, self.alpha
        )


@dataclass
class Run:
    """One fit: its wall seconds, final objective and the (seconds, objective) path to it."""

    seconds: float
    objective: float
    path: list[tuple[float, float]] = field(default_factory=list)
    converged: bool | None = None
    note: str = ""


def synthetic(family: str, n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    if family in ("logistic", "multinomial"):
        X, y = make_classification(
            n_samples=n,
            n_features=d,
            n_informative=max(2, d // 2),
            n_classes=2 if family == "logistic" else 10,
            random_state=0,
        )
    else:
        X, y, _ = make_glm_data(family, n, d, random_state=0)
    return StandardScaler().fit_transform(X).astype(np.float32), y


def problems(args) -> list[Problem]:
    found = []
    families = [] if args.families == "none" else args.families.split(",")
    for family in families:
        for n in (int(float(v)) for v in args.n.split(",")):
            for d in (int(v) for v in args.d.split(",")):
                X, y = synthetic(family, n, d)
                for alpha in alphas(args, n):
                    found.append(Problem(f"{family} {n:.0e}x{d}", family, X, y, alpha))
    if args.real:
        from test_real_data import PROBLEMS

        for name, (loader, family) in PROBLEMS.items():
            X, y = loader()
            X = StandardScaler().fit_transform(X)
            for alpha in alphas(args, X.shape[0]):
                found.append(Problem(name, family, X, y, alpha))
    if args.libsvm:
        X, y = load_svmlight_file(args.libsvm)
        family = "logistic" if np.unique(y).size == 2 else "linear"
        if not sp.issparse(X) or X.shape[1] <= 1000:
            X = StandardScaler().fit_transform(X.toarray() if sp.issparse(X) else X)
        for alpha in alphas(args, X.shape[0]):
            found.append(Problem(Path(args.libsvm).name, family, X, y, alpha))
    return found


def alphas(args, n: int) -> list[float]:
    return [1.0 / n if a == "1/n" else float(a) for a in args.alphas.split(",")]


def scikit_learn_solvers(problem: Problem) -> dict[str, object]:
    """The solvers a user would otherwise pick for this objective, at their defaults."""
    family, alpha, n = problem.family, problem.alpha, problem.X.shape[0]
    if family in ("logistic", "multinomial"):
        solvers = {
            "lbfgs": LogisticRegression(C=1.0 / (alpha * n)),
            "newton-cholesky": LogisticRegression(C=1.0 / (alpha * n), solver="newton-cholesky"),
        }
        if family == "logistic":
            solvers["SGDClassifier"] = SGDClassifier(loss="log_loss", alpha=alpha, random_state=0)
        return solvers
    if family == "linear":
        return {
            "Ridge": Ridge(alpha=alpha * n),
            "SGDRegressor": SGDRegressor(alpha=alpha, random_state=0),
        }
    if family == "poisson":
        return {
            "lbfgs": PoissonRegressor(alpha=alpha),
            "newton-cholesky": PoissonRegressor(alpha=alpha, solver="newton-cholesky"),
        }
    return {"lbfgs": FAMILIES[family].reference(alpha, n).set_params(tol=1e-4)}


def exact_objective(problem: Problem) -> float:
    """The optimum's objective from an exact solver at tol 1e-10 (in float64)."""
    X = problem.X.astype(np.float64) if not sp.issparse(problem.X) else problem.X
    n = X.shape[0]
    if problem.family == "linear":
        exact = Ridge(alpha=problem.alpha * n, solver="svd" if n * X.shape[1] < 1e7 else "auto")
    elif problem.family in ("logistic", "multinomial"):
        exact = LogisticRegression(
            C=1.0 / (problem.alpha * n), solver="newton-cholesky", tol=1e-10, max_iter=1000
        )
    elif problem.family == "poisson":
        exact = PoissonRegressor(
            alpha=problem.alpha, solver="newton-cholesky", tol=1e-10, max_iter=1000
        )
    else:
        exact = FAMILIES[problem.family].reference(problem.alpha, n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        exact.fit(X, problem.y)
    return problem.objective(exact)


def timed_fit(estimator, problem: Problem) -> tuple[object, float]:
    """The fitted estimator and its wall seconds, from a machine left quiet (:data:`SETTLE`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        time.sleep(SETTLE)
        start = time.perf_counter()
        estimator.fit(problem.X, problem.y)
        return estimator, time.perf_counter() - start


def run_scikit_learn(name: str, estimator, problem: Problem) -> Run:
    """The default fit, then the tol sweep for the path (iterative solvers, but SGD's)."""
    fitted, seconds = timed_fit(clone(estimator), problem)
    run = Run(seconds, problem.objective(fitted))
    if "tol" in estimator.get_params() and not name.startswith("SGD"):
        for tol in SWEEP:
            swept, swept_seconds = timed_fit(clone(estimator).set_params(tol=tol), problem)
            run.path.append((swept_seconds, problem.objective(swept)))
    run.path.append((seconds, run.objective))
    return run


def run_casgd(problem: Problem, n_devices: int, batch_size: int | str = "auto") -> Run:
    estimator = FAMILIES[problem.family].estimator(
        alpha=problem.alpha, n_devices=n_devices, batch_size=batch_size, random_state=0
    )
    fitted, seconds = timed_fit(estimator, problem)
    stats = fitted.fit_stats_
    before_epochs = seconds - stats["train_seconds"]
    path = [
        (before_epochs + t, objective)
        for t, objective in zip(stats["epoch_seconds"], fitted.loss_curve_, strict=True)
    ]
    note = f"b={stats['batch_size']} s={stats['s']} epochs={fitted.n_iter_}"
    return Run(seconds, problem.objective(fitted), path, stats["converged"], note)


def minibatch_alternative(problem: Problem) -> int | None:
    """The planner's fastest minibatch batch size where the defaults run Newton epochs."""
    plan = run_casgd_plan(problem)
    if not plan["newton"]:
        return None
    seconds = {b: c["seconds"] for b, c in plan["candidates"].items()}
    return min(seconds, key=seconds.get)


def run_casgd_plan(problem: Problem) -> dict:
    estimator = FAMILIES[problem.family].estimator(alpha=problem.alpha, max_iter=1, tol=None)
    return timed_fit(estimator, problem)[0].fit_stats_["plan"]


def time_to(run: Run, objective: float) -> float | None:
    """Seconds of the first point of ``run.path`` within ``objective`` (None: not reached).

    A point counts only if the fit's own end is also within it (the engine's
    per-epoch objective is in its own precision).
    """
    if run.objective > objective:
        return None
    reached = [seconds for seconds, value in run.path if value <= objective]
    return min(reached) if reached else run.seconds


def grid_search(repeats: int) -> None:
    """``--grid-search``: 10 alphas x 5 folds on standardized digits, as a user tunes alpha.

    ``Pipeline(StandardScaler(), estimator)`` in ``GridSearchCV(n_jobs=1)``:
    LogisticRegression over ``C = 1 / (n_train alpha)`` and CA-SGD over
    ``alpha``, alpha from 1e-5 to 1; the median wall time of ``repeats``
    interleaved searches, and each search's best mean accuracy.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import make_pipeline

    from sklearn_casgd import CASGDLogisticRegression

    X, y = load_digits(return_X_y=True)
    grid = np.logspace(-5, 0, 10)
    n_train = X.shape[0] * 4 // 5
    searches = {
        "LogisticRegression": GridSearchCV(
            make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)),
            {"logisticregression__C": list(1.0 / (n_train * grid))},
            cv=5,
        ),
        "CASGDLogisticRegression": GridSearchCV(
            make_pipeline(StandardScaler(), CASGDLogisticRegression(random_state=0)),
            {"casgdlogisticregression__alpha": list(grid)},
            cv=5,
        ),
    }
    seconds: dict[str, list[float]] = {name: [] for name in searches}
    scores = {}
    for _ in range(repeats):
        for name, search in searches.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                start = time.perf_counter()
                search.fit(X, y)
                seconds[name].append(time.perf_counter() - start)
            scores[name] = search.best_score_
    reference = statistics.median(seconds["LogisticRegression"])
    rows = [
        [name, f"{statistics.median(t):.2f}", f"{statistics.median(t) / reference:.2f}x",
         f"{scores[name]:.4f}"]
        for name, t in seconds.items()
    ]  # fmt: skip
    print_table(["search (digits, 10 alphas x 5 folds)", "seconds", "vs lbfgs", "best score"], rows)


def main() -> None:
    global SETTLE  # --settle sets it for every timed fit
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="logistic,poisson")
    parser.add_argument("--n", default="1e5,4e5")
    parser.add_argument("--d", default="28,100")
    parser.add_argument("--alphas", default="1e-4", help="comma-separated; 1/n allowed")
    parser.add_argument("--full", action="store_true", help="the issue's grid (long)")
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--libsvm")
    parser.add_argument("--ranks", default="1", help="CA-SGD fits: 1 and/or 2 worker ranks")
    parser.add_argument(
        "--minibatch",
        action="store_true",
        help="where the defaults run Newton epochs, also time minibatch SVRG at the "
        "planner's fastest minibatch batch size",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--grid-search", action="store_true", help="only the GridSearchCV on digits"
    )
    parser.add_argument("--gaps", default="1e-2,1e-4,1e-6")
    parser.add_argument("--csv")
    parser.add_argument("--plot", help="write gap against seconds per solver to this image")
    parser.add_argument("--settle", type=float, default=SETTLE, help="seconds before each fit")
    args = parser.parse_args()
    SETTLE = args.settle
    if args.grid_search:
        grid_search(args.repeats)
        return
    if args.full:
        for key, value in FULL_GRID.items():
            setattr(args, key, value)
    gaps = [float(g) for g in args.gaps.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    if max(ranks) > 1:  # start the pool before any timing
        from sklearn_casgd import CASGDLinearRegression

        data = np.random.default_rng(0).standard_normal((64, 4))
        CASGDLinearRegression(n_devices=max(ranks)).fit(data, data[:, 0])

    header = ["problem", "alpha", "solver", "seconds", "gap", *[f"t({g:g})" for g in gaps],
              "vs lbfgs", "note"]  # fmt: skip
    rows, paths = [], {}
    for problem in problems(args):
        best = exact_objective(problem)
        solvers = scikit_learn_solvers(problem)
        runs: dict[str, list[Run]] = {}
        minibatch = minibatch_alternative(problem) if args.minibatch else None
        for _ in range(args.repeats):
            for name, estimator in solvers.items():
                runs.setdefault(name, []).append(run_scikit_learn(name, estimator, problem))
            for k in ranks:
                name = "CA-SGD" if k == 1 else f"CA-SGD {k} ranks"
                runs.setdefault(name, []).append(run_casgd(problem, k))
            if minibatch is not None:
                runs.setdefault("CA-SGD minibatch", []).append(run_casgd(problem, 1, minibatch))
        best = min(best, *(r.objective for rs in runs.values() for r in rs))
        scale = abs(best) if best else 1.0
        reference = next((n for n in ("lbfgs", "Ridge") if n in runs), None)
        reference_seconds = statistics.median(r.seconds for r in runs[reference])
        for name, solver_runs in runs.items():
            seconds = statistics.median(r.seconds for r in solver_runs)
            gap = statistics.median((r.objective - best) / scale for r in solver_runs)
            reached = []
            for g in gaps:
                times = [time_to(r, best + g * scale) for r in solver_runs]
                met = [t for t in times if t is not None]
                reached.append(statistics.median(met) if len(met) == len(times) else None)
            ratio = reached[-1] / reference_seconds if reached[-1] is not None else None
            note = solver_runs[0].note
            if solver_runs[0].converged is not None:
                note += " converged" if all(r.converged for r in solver_runs) else " NOT converged"
            rows.append([
                problem.name, f"{problem.alpha:g}", name, f"{seconds:.3f}", f"{gap:.1e}",
                *["-" if t is None else f"{t:.3f}" for t in reached],
                "-" if ratio is None else f"{ratio:.2f}x", note,
            ])  # fmt: skip
            paths[problem.name, problem.alpha, name] = [
                (t, (value - best) / scale) for t, value in sorted(solver_runs[0].path)
            ]
            print("  ".join(rows[-1]), flush=True)
    print()
    print("vs lbfgs: the solver's time to the last gap over lbfgs's (Ridge's) default fit time")
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)
    if args.plot:
        plot(paths, args.plot)


def plot(paths: dict, filename: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems_ = sorted({key[:2] for key in paths})
    columns = min(3, len(problems_))
    rows = -(-len(problems_) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for axis, (name, alpha) in zip(axes.flat, problems_, strict=False):
        for (problem, a, solver), path in paths.items():
            if (problem, a) != (name, alpha):
                continue
            seconds, gap = zip(*path, strict=True)
            axis.plot(seconds, np.maximum(gap, 1e-12), marker=".", label=solver)
        axis.set(xscale="log", yscale="log", title=f"{name}, alpha={alpha:g}")
        axis.set(xlabel="seconds", ylabel="relative objective gap")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(filename, dpi=110)


if __name__ == "__main__":
    main()
