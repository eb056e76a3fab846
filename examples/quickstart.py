"""Quickstart: fit the three CA-SGD estimators on generated data.

Run with ``python examples/quickstart.py``.
"""

from pprint import pprint

from sklearn.model_selection import train_test_split

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression, CASGDPoissonRegressor
from sklearn_casgd.datasets import make_glm_data


def main():
    problems = [
        ("logistic", CASGDLogisticRegression),
        ("multinomial", CASGDLogisticRegression),
        ("linear", CASGDLinearRegression),
        ("poisson", CASGDPoissonRegressor),
    ]
    for family, estimator_class in problems:
        X, y, _ = make_glm_data(family, n_samples=20_000, n_features=50, random_state=0)
        X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=0)
        estimator = estimator_class(s=8, random_state=0).fit(X_train, y_train)
        print(f"\n{family}: {estimator_class.__name__}(s=8)")
        print(f"  test score  {estimator.score(X_test, y_test):.4f}")
        print(
            f"  epochs      {estimator.n_iter_}, final training objective "
            f"{estimator.loss_curve_[-1]:.5f}"
        )
        pprint(estimator.fit_stats_, indent=2)


if __name__ == "__main__":
    main()
