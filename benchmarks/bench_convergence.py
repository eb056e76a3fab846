"""Objective reached by the default settings against scikit-learn's exact solvers.

For each family and alpha, fits the CA-SGD estimator with its defaults on
standardized synthetic data and the exact solver at the same regularization
(LogisticRegression C = 1/(n alpha), Ridge alpha n, PoissonRegressor alpha),
and prints both objectives and the relative gap.

    python benchmarks/bench_convergence.py [--n-samples 2000] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import time
import warnings

from sklearn.linear_model import LogisticRegression, PoissonRegressor, Ridge
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression, CASGDPoissonRegressor
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective

ALPHAS = [1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]


def exact(family, n, alpha):
    if family in ("logistic", "multinomial"):
        return LogisticRegression(C=1.0 / (n * alpha), tol=1e-10, max_iter=10_000)
    if family == "linear":
        return Ridge(alpha=alpha * n)
    return PoissonRegressor(alpha=alpha, tol=1e-10, max_iter=10_000)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=2000)
    parser.add_argument("--n-features", type=int, default=20)
    parser.add_argument("--csv")
    args = parser.parse_args()
    estimators = {
        "logistic": CASGDLogisticRegression,
        "multinomial": CASGDLogisticRegression,
        "linear": CASGDLinearRegression,
        "poisson": CASGDPoissonRegressor,
    }
    header = ["family", "alpha", "exact", "casgd", "gap_pct", "epochs", "seconds"]
    rows = []
    warnings.simplefilter("ignore")
    for family, estimator in estimators.items():
        X, y, _ = make_glm_data(family, args.n_samples, args.n_features, signal=2.0, random_state=1)
        X = StandardScaler().fit_transform(X)
        for alpha in ALPHAS:
            ref = exact(family, args.n_samples, alpha).fit(X, y)
            start = time.perf_counter()
            est = estimator(alpha=alpha, random_state=0).fit(X, y)
            seconds = time.perf_counter() - start
            best = glm_objective(family, X, y, ref.coef_, ref.intercept_, alpha)
            reached = glm_objective(family, X, y, est.coef_, est.intercept_, alpha)
            gap = 100 * (reached - best) / best
            rows.append(
                [
                    family,
                    alpha,
                    f"{best:.5f}",
                    f"{reached:.5f}",
                    f"{gap:.3f}",
                    est.n_iter_,
                    f"{seconds:.2f}",
                ]
            )
            print("  ".join(str(v) for v in rows[-1]), flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            csv.writer(handle).writerows([header, *rows])


if __name__ == "__main__":
    main()
