"""Quickstart: CA-SGD estimators beside scikit-learn's solver of the same objective.

Four generated problems (20,000 x 50); each is fitted at the defaults by the
CA-SGD estimator and by scikit-learn's estimator of the same objective, and
a short table compares the held-out score and the fit time. Run with
``python examples/quickstart.py``.
"""

import time

from sklearn.linear_model import LogisticRegression, PoissonRegressor, Ridge
from sklearn.model_selection import train_test_split

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression, CASGDPoissonRegressor
from sklearn_casgd.datasets import make_glm_data

ALPHA = 1e-4  # the mean loss plus ALPHA / 2 ||coef||^2, in each library's own terms below


def timed_fit(estimator, X, y):
    started = time.perf_counter()
    estimator.fit(X, y)
    return estimator, time.perf_counter() - started


def main():
    problems = [
        ("logistic", CASGDLogisticRegression, lambda n: LogisticRegression(C=1 / (n * ALPHA))),
        ("multinomial", CASGDLogisticRegression, lambda n: LogisticRegression(C=1 / (n * ALPHA))),
        ("linear", CASGDLinearRegression, lambda n: Ridge(alpha=ALPHA * n)),
        ("poisson", CASGDPoissonRegressor, lambda n: PoissonRegressor(alpha=ALPHA)),
    ]
    print(f"{'problem':<12}{'model':<26}{'test score':>11}{'seconds':>9}  how CA-SGD ran")
    for family, casgd_class, sklearn_model in problems:
        X, y, _ = make_glm_data(family, n_samples=20_000, n_features=50, random_state=0)
        X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=0)
        casgd, casgd_seconds = timed_fit(casgd_class(alpha=ALPHA, random_state=0), X_train, y_train)
        baseline, baseline_seconds = timed_fit(sklearn_model(len(y_train)), X_train, y_train)
        plan = casgd.fit_stats_["plan"]
        epochs = f"{casgd.n_iter_} epoch{'s' if casgd.n_iter_ != 1 else ''}"
        how = f"{epochs}, " + ("Newton" if plan and plan["newton"] else "minibatch SVRG")
        for model, seconds, note in (
            (casgd, casgd_seconds, how),
            (baseline, baseline_seconds, ""),
        ):
            score = model.score(X_test, y_test)
            name = type(model).__name__
            print(f"{family:<12}{name:<26}{score:>11.4f}{seconds:>9.3f}  {note}")
    print("(scores: accuracy, R^2, and D^2 of the Poisson deviance; fit_stats_ says more)")


if __name__ == "__main__":
    main()
