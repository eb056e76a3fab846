"""Non-uniform sample weights against references outside the library.

The estimators minimize ``sum_i s_i loss_i / n + alpha / 2 ||w||^2``. scikit-learn's
LogisticRegression minimizes ``C sum_i s_i loss_i + ||w||^2 / 2``: the same
objective at ``C = 1 / (n alpha)``, whatever the weights. Its GLMs
(PoissonRegressor, GammaRegressor, TweedieRegressor) divide by ``sum(s)``
instead of ``n``: the same objective at ``alpha * n / sum(s)``. Integer
weights stand for repeated rows on that scale too. A fit that read the
weights against the wrong rows, or dropped some, cannot meet these.
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer, load_diabetes
from sklearn.linear_model import (
    GammaRegressor,
    LogisticRegression,
    PoissonRegressor,
    TweedieRegressor,
)
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import (
    CASGDGammaRegressor,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)

EXACT = dict(precision="fp64", tol=1e-10)


def _weights(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.2, 3.0, n)


def _regression_data():
    X, y = load_diabetes(return_X_y=True)
    return StandardScaler().fit_transform(X), y / 100.0


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda a: CASGDPoissonRegressor(alpha=a, **EXACT), lambda a: PoissonRegressor(alpha=a)),
        (lambda a: CASGDGammaRegressor(alpha=a, **EXACT), lambda a: GammaRegressor(alpha=a)),
        (
            lambda a: CASGDTweedieRegressor(power=1.5, alpha=a, **EXACT),
            lambda a: TweedieRegressor(power=1.5, link="log", alpha=a),
        ),
    ],
    ids=["poisson", "gamma", "tweedie"],
)
def test_weighted_glms_equal_scikit_learns(ours, theirs):
    X, y = _regression_data()
    weight = _weights(len(y))
    alpha = 1e-3
    fitted = ours(alpha).fit(X, y, sample_weight=weight)
    reference = theirs(alpha * len(y) / weight.sum()).set_params(
        solver="newton-cholesky", tol=1e-12, max_iter=1000
    )
    reference.fit(X, y, sample_weight=weight)
    np.testing.assert_allclose(fitted.coef_, reference.coef_, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(fitted.intercept_, reference.intercept_, rtol=1e-7, atol=1e-9)


def test_weighted_logistic_regression_equals_scikit_learns():
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    weight = _weights(len(y), seed=1)
    alpha = 1e-3
    fitted = CASGDLogisticRegression(alpha=alpha, **EXACT).fit(X, y, sample_weight=weight)
    reference = LogisticRegression(
        C=1.0 / (len(y) * alpha), solver="newton-cholesky", tol=1e-12, max_iter=1000
    )
    reference.fit(X, y, sample_weight=weight)
    np.testing.assert_allclose(fitted.coef_, reference.coef_, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(fitted.intercept_, reference.intercept_, rtol=1e-8, atol=1e-10)


def test_integer_weights_stand_for_repeated_rows():
    X, y = _regression_data()
    counts = np.random.default_rng(2).integers(0, 4, len(y))
    alpha = 1e-3
    weighted = CASGDPoissonRegressor(alpha=alpha, **EXACT).fit(X, y, sample_weight=counts)
    repeated_rows = np.repeat(np.arange(len(y)), counts)
    # Repeated, the mean runs over sum(counts) rows: alpha scales to match.
    scale = len(y) / counts.sum()
    repeated = CASGDPoissonRegressor(alpha=alpha * scale, **EXACT)
    repeated.fit(X[repeated_rows], y[repeated_rows])
    np.testing.assert_allclose(weighted.coef_, repeated.coef_, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(weighted.intercept_, repeated.intercept_, rtol=1e-7, atol=1e-9)
