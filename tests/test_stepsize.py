"""The smoothness estimates behind the default step, against their exact float64 values."""

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.datasets import load_breast_cancer, load_digits

from sklearn_casgd._engine import stepsize
from sklearn_casgd._engine.stepsize import (
    jacobi_preconditioner,
    largest_eigenvalue,
    largest_row_smoothness,
    squared_row_norms,
)


def _preconditioned_rows(X, fit_intercept, center, scale):
    """``[(X - m) / D, 1]`` as a dense float64 array (the last column only with an intercept)."""
    dense = X.toarray() if sp.issparse(X) else np.asarray(X, dtype=np.float64)
    rows = (dense - center) / scale
    ones = np.ones((rows.shape[0], 1)) if fit_intercept else np.zeros((rows.shape[0], 1))
    return np.hstack([rows, ones])


def _exact_largest_eigenvalue(X, weight, fit_intercept, center, scale):
    rows = _preconditioned_rows(X, fit_intercept, center, scale)
    return np.linalg.eigvalsh(rows.T @ (weight[:, None] * rows) / rows.shape[0])[-1]


def _raw_digits():
    X, _ = load_digits(return_X_y=True)
    return X[:600]


@pytest.mark.parametrize("loader", [_raw_digits, lambda: load_breast_cancer().data])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("fit_intercept", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_largest_eigenvalue_is_the_exact_one_within_its_tolerance(
    loader, sparse, fit_intercept, dtype
):
    X = loader().astype(dtype)
    weight = np.random.default_rng(0).uniform(0.1, 1.0, X.shape[0])
    center, scale, _, _ = jacobi_preconditioner(X, weight, 1e-3, fit_intercept)
    X_in = sp.csr_matrix(X) if sparse else X
    estimate = largest_eigenvalue(X_in, weight, fit_intercept, center, scale)
    exact = _exact_largest_eigenvalue(X, weight, fit_intercept, center, scale)
    assert estimate == pytest.approx(exact, rel=stepsize._EIGEN_RTOL)


@pytest.mark.parametrize("n_features", [1, 3, 40])
def test_few_or_many_unknowns_take_the_same_eigenvalue(n_features):
    # Up to _LANCZOS_VECTORS unknowns the operator is formed whole; above, Lanczos.
    X = np.random.default_rng(1).standard_normal((500, n_features)) * np.arange(1, n_features + 1)
    weight = np.full(500, 0.25)
    exact = _exact_largest_eigenvalue(X, weight, True, np.zeros(n_features), np.ones(n_features))
    assert largest_eigenvalue(X, weight, True) == pytest.approx(exact, rel=stepsize._EIGEN_RTOL)


def test_a_row_subsample_estimates_the_eigenvalue_from_above(monkeypatch):
    """More rows than _MAX_EIGEN_ROWS: a subsample's largest eigenvalue, which errs upwards.

    A sample covariance's largest eigenvalue exceeds the population's (the
    step is then shorter, not longer); here within 15%.
    """
    monkeypatch.setattr(stepsize, "_MAX_EIGEN_ROWS", 500)
    rng = np.random.default_rng(2)
    X = rng.standard_normal((20_000, 30))
    X[:, :3] *= 5.0
    weight = np.ones(X.shape[0])
    exact = _exact_largest_eigenvalue(X, weight, False, np.zeros(30), np.ones(30))
    estimate = largest_eigenvalue(X, weight, False)
    assert exact <= estimate <= 1.15 * exact


def test_no_convergence_falls_back_to_the_trace_an_upper_bound(monkeypatch):
    from scipy.sparse.linalg import ArpackNoConvergence

    def not_converging(*args, **kwargs):
        raise ArpackNoConvergence("no convergence", np.array([]), np.array([]))

    X = load_breast_cancer().data
    weight = np.full(X.shape[0], 0.25)
    center, scale, _, _ = jacobi_preconditioner(X, weight, 1e-3, True)
    exact = _exact_largest_eigenvalue(X, weight, True, center, scale)
    monkeypatch.setattr(stepsize, "eigsh", not_converging)
    bound = largest_eigenvalue(X, weight, True, center, scale)
    trace = np.trace(
        (lambda A: A.T @ (weight[:, None] * A) / A.shape[0])(
            _preconditioned_rows(X, True, center, scale)
        )
    )
    assert bound == pytest.approx(trace, rel=1e-9)
    assert bound >= exact


@pytest.mark.parametrize("sparse", [False, True])
def test_squared_row_norms_and_the_largest_row_smoothness(sparse):
    X = _raw_digits()
    weight = np.random.default_rng(3).uniform(0.1, 1.0, X.shape[0])
    center, scale, _, _ = jacobi_preconditioner(X, weight, 1e-3, True)
    rows = _preconditioned_rows(X, True, center, scale)
    X_in = sp.csr_matrix(X) if sparse else X
    norms = squared_row_norms(X_in, True, center, scale)
    np.testing.assert_allclose(norms, np.square(rows).sum(axis=1), rtol=1e-10)
    largest = largest_row_smoothness(X_in, weight, True, center, scale)
    assert largest == pytest.approx(np.max(weight * np.square(rows).sum(axis=1)), rel=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_column_statistics_of_float32_x_keep_the_spread_of_far_off_columns(dtype):
    """float32 X is read in float32 about a shift near each column's mean: a column
    1000 + N(0, 1) keeps its spread's digits, as in float64 (numpy, exact)."""
    rng = np.random.default_rng(4)
    n = 5000
    X = np.column_stack(
        [rng.standard_normal(n), 1000.0 + rng.standard_normal(n), 3.0 * rng.exponential(size=n)]
    ).astype(dtype)
    weight = rng.uniform(0.2, 2.0, n)
    center, scale, spread, _ = jacobi_preconditioner(X, weight, 1e-3, True)
    X64 = X.astype(np.float64)
    expected_center = weight @ X64 / weight.sum()
    moment = weight @ np.square(X64 - expected_center) / n
    expected_scale = np.sqrt((moment + 1e-3) / (weight.sum() / n))
    expected_spread = np.sqrt(np.mean(np.square(X64 - expected_center), axis=0))
    rtol = 1e-5 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(center, expected_center, rtol=rtol)
    np.testing.assert_allclose(scale, expected_scale, rtol=rtol)
    np.testing.assert_allclose(spread, expected_spread, rtol=rtol)
    norms = squared_row_norms(X, True, center, scale)
    exact = np.square((X64 - center) / scale).sum(axis=1) + 1
    np.testing.assert_allclose(norms, exact, rtol=10 * rtol)


def test_float32_squares_beyond_its_range_are_taken_in_float64():
    values = [3e19, -3e19, 1e19]
    X = np.array([[v, float(i)] for i, v in enumerate(values)], dtype=np.float32)
    _, scale, spread, _ = jacobi_preconditioner(X, np.ones(3), 1e-3, True)
    exact = np.std(X.astype(np.float64)[:, 0])
    assert np.isfinite(scale).all() and spread[0] == pytest.approx(exact, rel=1e-6)
    norms = squared_row_norms(X, True)  # unscaled: x^2 itself overflows float32
    expected = np.square(X.astype(np.float64)).sum(axis=1) + 1
    np.testing.assert_allclose(norms, expected, rtol=1e-6)
