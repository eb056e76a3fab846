"""L1 and elastic-net fits at the defaults against scikit-learn's solvers, side by side.

Each problem is split 75 / 25; on the training rows, interleaved
``--repeats`` times on ``--threads`` threads:

* ``CASGD...(penalty=..., alpha)`` at its defaults (proximal SVRG to
  ``tol``), and plain proximal SGD for one epoch;
* scikit-learn's solver of the same objective at its default stop:
  ``LogisticRegression(solver="saga", l1_ratio, C=1 / (n alpha))`` for the
  classifiers, ``ElasticNet(alpha, l1_ratio)`` (coordinate descent) for
  least squares;
* ``SGDClassifier`` / ``SGDRegressor`` with the same penalty (a truncated
  gradient: it does not reach the optimum) at its default stop;
* where skglm is installed (``pip install skglm``; not a dependency), its
  working-set solvers of the same objective (``SparseLogisticRegression``,
  ``ElasticNet``), the fast L1 GLMs the issue names as the speed anchor;
* for ``penalty="l1"`` classifiers, ``LogisticRegression(solver="liblinear")``
  (coordinate descent with Newton steps, the usual pick for L1 logistic
  regression), whose objective also penalizes the intercept (its
  ``intercept_scaling`` column): the gap column says what that costs.

Each row: the fit's wall time (median), the objective's gap to the optimum
(:func:`reference`, or the lowest objective of any fit where lower),
relative; the nonzero coefficients and how many coefficients' zero-or-not
agrees with the optimum's; the held-out score.

Problems: ``logistic`` (``make_glm_data``, dense), ``linear`` (the same,
least squares), ``text`` (TF-IDF of ``_text_corpus``'s generated corpus,
sparse, binary labels).

    python benchmarks/bench_l1.py [--problems logistic,linear,text] [--repeats 3] [--csv l1.csv]

``--ranks 2`` instead times the proximal steps on pool ranks (the logistic
problem, ``batch_size=16``, 3 epochs, ``fit_stats_["train_seconds"]``):
each exchange forced, the fit's own choice, and one process.

    python benchmarks/bench_l1.py --ranks 2 --samples 20000 --features 64
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
from _exchange import EXCHANGES, forced_exchange
from _table import print_table, write_csv
from _text_corpus import make_text_corpus
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import ElasticNet, LogisticRegression, SGDClassifier, SGDRegressor
from sklearn.model_selection import train_test_split
from threadpoolctl import threadpool_limits

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective


def _saga(alpha: float, l1_ratio: float, n: int, tol: float = 1e-4) -> LogisticRegression:
    # scikit-learn 1.8 deprecates penalty= in favour of l1_ratio alone.
    return LogisticRegression(
        C=1.0 / (n * alpha), l1_ratio=l1_ratio, solver="saga", tol=tol, max_iter=100_000
    )


def problem(name: str, n_samples: int, n_features: int, documents: int):
    """``(X_train, X_test, y_train, y_test, family)`` of the named problem."""
    if name == "text":
        texts, labels = make_text_corpus(documents)
        train, test, y_train, y_test = train_test_split(
            texts, labels, test_size=0.25, random_state=0
        )
        vectorizer = TfidfVectorizer().fit(train)
        return vectorizer.transform(train), vectorizer.transform(test), y_train, y_test, "logistic"
    X, y, _ = make_glm_data(name, n_samples, n_features, random_state=0)
    return (*train_test_split(X, y, test_size=0.25, random_state=0), name)


def _skglm(family: str, alpha: float, l1_ratio: float) -> dict:
    """skglm's working-set solvers of the same objective, where skglm is installed."""
    try:
        import skglm
    except ImportError:
        return {}
    if family == "logistic":
        return {
            "skglm SparseLogisticRegression": lambda: skglm.SparseLogisticRegression(
                alpha=alpha, l1_ratio=l1_ratio
            )
        }
    return {"skglm ElasticNet": lambda: skglm.ElasticNet(alpha=alpha, l1_ratio=l1_ratio)}


def candidates(family: str, penalty: str, alpha: float, l1_ratio: float, n: int) -> dict:
    return _sklearn_candidates(family, penalty, alpha, l1_ratio, n) | _skglm(
        family, alpha, l1_ratio
    )


def _sklearn_candidates(family: str, penalty: str, alpha: float, l1_ratio: float, n: int) -> dict:
    common = dict(alpha=alpha, penalty=penalty, l1_ratio=l1_ratio, random_state=0)
    if family == "logistic":
        return {
            "CASGD defaults (proximal SVRG)": lambda: CASGDLogisticRegression(**common),
            "CASGD sgd, 1 epoch": lambda: CASGDLogisticRegression(
                **common, solver="sgd", max_iter=1, tol=None
            ),
            "LogisticRegression saga": lambda: _saga(alpha, l1_ratio, n),
            "SGDClassifier": lambda: SGDClassifier(loss="log_loss", **common),
        } | (
            {
                "LogisticRegression liblinear": lambda: LogisticRegression(
                    C=1.0 / (n * alpha), l1_ratio=1.0, solver="liblinear"
                )
            }
            if l1_ratio == 1.0
            else {}
        )
    return {
        "CASGD defaults (proximal SVRG)": lambda: CASGDLinearRegression(**common),
        "CASGD sgd, 1 epoch": lambda: CASGDLinearRegression(
            **common, solver="sgd", max_iter=1, tol=None
        ),
        "ElasticNet (coordinate descent)": lambda: ElasticNet(alpha=alpha, l1_ratio=l1_ratio),
        "SGDRegressor": lambda: SGDRegressor(**common),
    }


def reference(family: str, alpha: float, l1_ratio: float, X, y):
    """The optimum. Least squares: coordinate descent to tol=1e-12. The
    logistic loss with an L1 penalty: liblinear to tol=1e-6 with its
    intercept column scaled by 100 (its penalty on the intercept then
    negligible; lower than saga or proximal SVRG reach in minutes at these
    shapes). With an L2 part: proximal SVRG in float64 to tol=1e-9, which
    ``tests/test_l1.py`` holds to saga."""
    if family != "logistic":
        return ElasticNet(alpha=alpha, l1_ratio=l1_ratio, tol=1e-12, max_iter=100_000).fit(X, y)
    if l1_ratio == 1.0:
        return LogisticRegression(
            C=1.0 / (X.shape[0] * alpha), l1_ratio=1.0, solver="liblinear", tol=1e-6,
            intercept_scaling=100.0, max_iter=10_000, random_state=0,
        ).fit(X, y)  # fmt: skip
    return CASGDLogisticRegression(
        alpha=alpha, penalty="elasticnet", l1_ratio=l1_ratio, precision="fp64", tol=1e-9,
        max_iter=3000, random_state=1,
    ).fit(X, y)  # fmt: skip


def run(name: str, args: argparse.Namespace) -> list[list[str]]:
    X_train, X_test, y_train, y_test, family = problem(
        name, args.samples, args.features, args.documents
    )
    alpha = args.alpha if args.alpha is not None else (1e-5 if name == "text" else 1e-2)
    penalty = "l1" if args.l1_ratio == 1.0 else "elasticnet"

    def objective(model) -> float:
        coef, intercept = np.ravel(model.coef_), np.ravel(model.intercept_)[0]
        return glm_objective(
            family, X_train, y_train, coef, intercept, alpha, l1_ratio=args.l1_ratio
        )

    made = candidates(family, penalty, alpha, args.l1_ratio, X_train.shape[0])
    seconds = {label: [] for label in made}
    fitted = {}
    with threadpool_limits(args.threads), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one-epoch fits stop before converging
        import torch

        torch.set_num_threads(args.threads)
        optimum = reference(family, alpha, args.l1_ratio, X_train, y_train)
        for make in made.values():  # compiling (numba: ours, skglm's) is start-up, not the fit
            make().fit(X_train[:200], y_train[:200])
        for _ in range(args.repeats):
            for label, make in made.items():
                model = make()
                started = time.perf_counter()
                model.fit(X_train, y_train)
                seconds[label].append(time.perf_counter() - started)
                fitted[label] = model
    best = min([objective(optimum)] + [objective(model) for model in fitted.values()])
    support = np.ravel(optimum.coef_) != 0
    print(
        f"{name}: {X_train.shape[0]} x {X_train.shape[1]} for training; penalty={penalty!r}, "
        f"l1_ratio={args.l1_ratio}, alpha={alpha}; the optimum has {support.sum()} nonzero "
        f"coefficients; {args.threads} thread(s); medians of {args.repeats}"
    )
    rows = []
    for label, model in fitted.items():
        nonzero = np.ravel(model.coef_) != 0
        rows.append(
            [
                name,
                label,
                f"{statistics.median(seconds[label]):.3f}",
                f"{(objective(model) - best) / abs(best):.2e}",
                str(int(nonzero.sum())),
                f"{int((nonzero == support).sum())}/{support.size}",
                f"{model.score(X_test, y_test):.4f}",
            ]
        )
    return rows


def run_ranks(args: argparse.Namespace) -> list[list[str]]:
    """The proximal steps on ``args.ranks`` pool ranks, each exchange, and one process."""
    X, y, _ = make_glm_data("logistic", args.samples, args.features, random_state=0)
    alpha = args.alpha if args.alpha is not None else 1e-2
    params = dict(
        alpha=alpha, penalty="l1" if args.l1_ratio == 1.0 else "elasticnet",
        l1_ratio=args.l1_ratio, batch_size=16, max_iter=3, tol=None, random_state=0,
    )  # fmt: skip
    configs = [(args.ranks, exchange) for exchange in (*EXCHANGES, "auto")] + [(1, "auto")]
    seconds = {config: [] for config in configs}
    stats = {}
    with threadpool_limits(args.threads):
        for _ in range(args.repeats):
            for ranks, exchange in configs:
                model = CASGDLogisticRegression(n_devices=ranks, timeout=300, **params)
                with forced_exchange(exchange):
                    model.fit(X, y)
                seconds[ranks, exchange].append(model.fit_stats_["train_seconds"])
                stats[ranks, exchange] = model.fit_stats_
    print(
        f"logistic {args.samples} x {args.features}, {params['penalty']}, alpha={alpha}, "
        f"batch_size=16, 3 epochs; medians of {args.repeats} train_seconds"
    )
    return [
        [
            str(ranks),
            exchange,
            stats[ranks, exchange]["exchange"],
            f"{statistics.median(seconds[ranks, exchange]):.3f}",
            str(stats[ranks, exchange]["n_allreduce"]),
        ]
        for ranks, exchange in configs
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="logistic,linear,text")
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--features", type=int, default=100)
    parser.add_argument("--documents", type=int, default=20_000)
    parser.add_argument("--alpha", type=float, default=None, help="default 1e-2; text 1e-5")
    parser.add_argument("--l1-ratio", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=0, help="time the steps on pool ranks")
    parser.add_argument("--csv")
    args = parser.parse_args()
    if args.ranks:
        header = ["ranks", "exchange asked", "exchange", "train seconds", "collectives"]
        rows = run_ranks(args)
        print_table(header, rows)
        if args.csv:
            write_csv(args.csv, header, rows)
        return
    header = ["problem", "model", "fit seconds", "objective gap", "nonzero", "support", "score"]
    rows = [row for name in args.problems.split(",") for row in run(name, args)]
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
