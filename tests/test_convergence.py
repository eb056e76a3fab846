"""Convergence against references: scikit-learn's exact solvers, and fp32 SGD."""

import numpy as np
import pytest
from conftest import objective
from sklearn.linear_model import LogisticRegression, PoissonRegressor, Ridge
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression, CASGDPoissonRegressor
from sklearn_casgd.datasets import make_glm_data

ESTIMATORS = {
    "logistic": CASGDLogisticRegression,
    "multinomial": CASGDLogisticRegression,
    "linear": CASGDLinearRegression,
    "poisson": CASGDPoissonRegressor,
}


def exact_solution(family, X, y, alpha):
    """scikit-learn's exact solver at the same regularization."""
    n = X.shape[0]
    if family in ("logistic", "multinomial"):
        ref = LogisticRegression(C=1.0 / (n * alpha), tol=1e-10, max_iter=10_000)
    elif family == "linear":
        ref = Ridge(alpha=alpha * n)
    else:
        ref = PoissonRegressor(alpha=alpha, tol=1e-10, max_iter=10_000)
    ref.fit(X, y)
    return ref.coef_, ref.intercept_


@pytest.mark.parametrize("family", list(ESTIMATORS))
@pytest.mark.parametrize("alpha", [1e-5, 1e-3, 1e-1, 1.0])
def test_defaults_reach_the_exact_objective(family, alpha, global_random_seed):
    X, y, _ = make_glm_data(family, 2000, 20, signal=2.0, random_state=global_random_seed)
    X = StandardScaler().fit_transform(X)
    estimator = ESTIMATORS[family](alpha=alpha, random_state=global_random_seed).fit(X, y)
    assert estimator.fit_stats_["converged"]
    reached = objective(family, X, y, estimator.coef_, estimator.intercept_, alpha)
    best = objective(family, X, y, *exact_solution(family, X, y, alpha), alpha)
    assert best <= reached < best * 1.01


@pytest.mark.parametrize("family", list(ESTIMATORS))
def test_bf16_s8_matches_fp32_sgd_loss(family, global_random_seed):
    """The paper's claim: mixed-precision CA-SGD within 0.5 % of FP32 SGD's loss."""
    X, y, _ = make_glm_data(family, 4000, 32, random_state=global_random_seed)
    params = dict(alpha=1e-4, random_state=global_random_seed, max_iter=20, tol=None)
    fp32 = ESTIMATORS[family](s=1, precision="fp32", **params).fit(X, y)
    bf16 = ESTIMATORS[family](s=8, precision="bf16", **params).fit(X, y)
    assert bf16.fit_stats_["precision"] == "bf16" and bf16.fit_stats_["s"] == 8
    loss_fp32 = objective(family, X, y, fp32.coef_, fp32.intercept_, 1e-4)
    loss_bf16 = objective(family, X, y, bf16.coef_, bf16.intercept_, 1e-4)
    assert abs(loss_bf16 - loss_fp32) < 0.005 * loss_fp32
    assert abs(bf16.loss_curve_[-1] - fp32.loss_curve_[-1]) < 0.005 * fp32.loss_curve_[-1]
    # bf16 did change the arithmetic: identical results would mean it was not used.
    assert not np.array_equal(bf16.coef_, fp32.coef_)
