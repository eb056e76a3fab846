"""Newton epochs on sparse rows, and the float64 polish that certifies a float32 fit's gap.

Sparse Newton epochs solve each step by conjugate gradients on the
curvature's products (Jacobi-preconditioned; never formed): references are
scikit-learn's exact solvers on the same sparse X, and the same fit on the
dense copy of X (dense Newton factors the curvature instead: another path
to the same optimum).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression, PoissonRegressor
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import CASGDLogisticRegression, CASGDPoissonRegressor
from sklearn_casgd._engine import planner
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective


def _text_like(n_rows=3000, n_columns=2000, seed=0):
    """Rare columns (a Zipf-like popularity), unit-norm rows, labels from a sparse truth."""
    rng = np.random.default_rng(seed)
    per_row = 12
    popularity = 1.0 / (np.arange(n_columns) + 5.0) ** 1.1
    columns = rng.choice(n_columns, size=n_rows * per_row, p=popularity / popularity.sum())
    rows = np.repeat(np.arange(n_rows), per_row)
    X = sp.csr_matrix((rng.uniform(0.5, 2.0, rows.size), (rows, columns)), (n_rows, n_columns))
    X = sp.diags(1.0 / np.sqrt(X.multiply(X).sum(axis=1).A.ravel())) @ X
    truth = rng.normal(scale=3.0, size=n_columns)
    y = (rng.random(n_rows) < 1 / (1 + np.exp(-(X @ truth)))).astype(int)
    return X.tocsr(), y


def _objective(family, model, X, y, alpha):
    if family == "logistic":
        return glm_objective(family, X, y, model.coef_.ravel(), model.intercept_[0], alpha)
    return glm_objective(family, X, y, model.coef_, model.intercept_, alpha)


def test_the_planner_takes_newton_epochs_on_sparse_text():
    X, y = _text_like()
    model = CASGDLogisticRegression(alpha=1e-5, random_state=0).fit(X, y)
    stats = model.fit_stats_
    assert stats["plan"]["newton"] and stats["execution"]["steps"] == "newton"
    assert stats["converged"] and stats["gap_bound"] <= stats["gap_target"]
    assert model.n_iter_ <= 10


def test_sparse_newton_epochs_reach_scikit_learns_optimum_on_rare_columns():
    X, y = _text_like()
    alpha = 1e-5
    reference = LogisticRegression(
        C=1.0 / (X.shape[0] * alpha), solver="newton-cg", tol=1e-12, max_iter=1000
    ).fit(X, y)
    best = _objective("logistic", reference, X, y, alpha)
    model = CASGDLogisticRegression(alpha=alpha, precision="fp64", tol=1e-9).fit(X, y)
    assert model.fit_stats_["plan"]["newton"]
    reached = _objective("logistic", model, X, y, alpha)
    assert reached - best <= 1e-10 * best
    np.testing.assert_allclose(model.coef_, reference.coef_, rtol=1e-4, atol=1e-5)


def test_sparse_newton_equals_dense_newton_in_float64():
    """The same objective on the same rows: CG on sparse rows, Cholesky on dense ones."""
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    X[np.abs(X) < 0.5] = 0.0  # a table with zeros, in either container
    params = dict(alpha=1e-3, precision="fp64", tol=1e-10)
    dense = CASGDLogisticRegression(**params).fit(X, y)
    sparse = CASGDLogisticRegression(**params).fit(sp.csr_matrix(X), y)
    assert dense.fit_stats_["plan"]["newton"] and sparse.fit_stats_["plan"]["newton"]
    assert sparse._step_plan.column_scale is not None  # preconditioned: stored in most rows
    np.testing.assert_allclose(sparse.coef_, dense.coef_, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(sparse.intercept_, dense.intercept_, rtol=1e-7, atol=1e-9)


def test_sparse_newton_epochs_of_ten_classes_reach_scikit_learns_optimum():
    X, y = load_digits(return_X_y=True)
    X = sp.csr_matrix(X / 16.0)
    alpha = 1e-3
    reference = LogisticRegression(C=1.0 / (X.shape[0] * alpha), tol=1e-12, max_iter=10_000)
    reference.fit(X, y)
    model = CASGDLogisticRegression(alpha=alpha, precision="fp64", tol=1e-8).fit(X, y)
    assert model.fit_stats_["plan"]["newton"] and model.fit_stats_["converged"]
    labels = np.unique(y, return_inverse=True)[1]
    best = glm_objective("multinomial", X, labels, reference.coef_, reference.intercept_, alpha)
    reached = glm_objective("multinomial", X, labels, model.coef_, model.intercept_, alpha)
    assert reached - best <= 1e-9 * best


def test_sparse_newton_epochs_reach_poisson_regressors_optimum_with_weights():
    rng = np.random.default_rng(0)
    n = 4000
    codes = rng.integers(50, size=n)
    X = sp.hstack(
        [sp.csr_matrix((np.ones(n), (np.arange(n), codes)), (n, 50)), rng.normal(size=(n, 3))],
        format="csr",
    )
    y = rng.poisson(np.exp(0.3 * rng.normal(size=50)[codes] + X[:, 50:].toarray() @ [0.2, -0.1, 0]))
    weight = rng.uniform(0.5, 2.0, n)
    alpha = 1e-4
    reference = PoissonRegressor(alpha=alpha, tol=1e-12, max_iter=10_000)
    reference.fit(X, y, sample_weight=weight * n / weight.sum())
    model = CASGDPoissonRegressor(alpha=alpha, precision="fp64", tol=1e-9)
    model.fit(X, y, sample_weight=weight * n / weight.sum())
    assert model.fit_stats_["plan"]["newton"]
    np.testing.assert_allclose(model.coef_, reference.coef_, rtol=1e-5, atol=1e-6)


def test_newton_can_be_ruled_out_on_sparse_rows(monkeypatch):
    monkeypatch.setattr(planner, "NEWTON", False)
    X, y = _text_like()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model = CASGDLogisticRegression(alpha=1e-5, max_iter=3, random_state=0).fit(X, y)
    assert not model.fit_stats_["plan"]["newton"]


def test_a_float32_fit_finishes_in_float64_where_its_rounding_hides_the_gap():
    """Poisson counts at a small alpha: float32's gradient floor is above what tol names.

    The fit hands over to Newton epochs in float64 once its bound stalls;
    they certify the gap, and the coefficients are float64's.
    """
    X, y, _ = make_glm_data("poisson", 2000, 20, signal=2.0, random_state=0)
    X = StandardScaler().fit_transform(X)
    model = CASGDPoissonRegressor(alpha=1e-5).fit(X, y)  # no ConvergenceWarning
    stats = model.fit_stats_
    assert stats["precision"] == "fp32" and 1 <= stats["polished_epochs"] <= 2
    assert stats["converged"] and stats["gap_bound"] <= stats["gap_target"]
    exact = CASGDPoissonRegressor(alpha=1e-5, precision="fp64", tol=1e-8).fit(X, y)
    assert exact.fit_stats_["polished_epochs"] == 0
    np.testing.assert_allclose(model.coef_, exact.coef_, rtol=1e-5, atol=1e-7)


def test_no_polish_with_an_l1_part():
    X, y = load_breast_cancer(return_X_y=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model = CASGDLogisticRegression(
            alpha=1e-2, penalty="elasticnet", l1_ratio=0.5, max_iter=30, random_state=0
        ).fit(X, y)
    assert model.fit_stats_["polished_epochs"] == 0


@pytest.mark.parametrize("batch_size", [8, 64])
def test_a_minibatch_fit_in_float32_is_certified_after_its_polish(batch_size):
    """Unscaled columns: the gradient in their units floors above what tol=1e-5 names."""
    X, y = load_breast_cancer(return_X_y=True)
    model = CASGDLogisticRegression(alpha=1e-2, batch_size=batch_size, random_state=0).fit(X, y)
    stats = model.fit_stats_
    assert stats["converged"] and stats["polished_epochs"] >= 1
    reference = LogisticRegression(C=1.0 / (X.shape[0] * 1e-2), tol=1e-12, max_iter=100_000)
    best = _objective("logistic", reference.fit(X, y), X, y, 1e-2)
    assert _objective("logistic", model, X, y, 1e-2) - best <= 10 * stats["gap_target"] * best


@pytest.mark.parametrize("newton", [True, False])
def test_a_fit_leaves_an_unsorted_csr_input_as_it_was(monkeypatch, newton):
    """TF-IDF's rows store their columns unsorted: nothing may sort them in place."""
    monkeypatch.setattr(planner, "NEWTON", newton)
    X, y = _text_like()
    rng = np.random.default_rng(1)
    for row in range(X.shape[0]):  # each row's entries in a random order
        lo, hi = X.indptr[row], X.indptr[row + 1]
        order = lo + rng.permutation(hi - lo)
        X.indices[lo:hi], X.data[lo:hi] = X.indices[order], X.data[order]
    X.has_sorted_indices = False
    before = [a.copy() for a in (X.data, X.indices, X.indptr)]
    reference = sp.csr_matrix(X.toarray())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        params = dict(alpha=1e-4, max_iter=5, precision="fp64", random_state=0)
        model = CASGDLogisticRegression(**params).fit(X, y)
        canonical = CASGDLogisticRegression(**params).fit(reference, y)
    for after, kept in zip((X.data, X.indices, X.indptr), before, strict=True):
        np.testing.assert_array_equal(after, kept)
    np.testing.assert_allclose(model.coef_, canonical.coef_, rtol=1e-8, atol=1e-10)


@pytest.mark.distributed
def test_two_ranks_polish_to_the_one_process_model():
    """The float64 polish runs on column blocks too: the same Newton epochs, split."""
    X, y, _ = make_glm_data("poisson", 2000, 20, signal=2.0, random_state=0)
    X = StandardScaler().fit_transform(X)
    one = CASGDPoissonRegressor(alpha=1e-5).fit(X, y)
    two = CASGDPoissonRegressor(alpha=1e-5, n_devices=2).fit(X, y)
    assert one.fit_stats_["polished_epochs"] >= 1 and two.fit_stats_["polished_epochs"] >= 1
    assert two.fit_stats_["converged"] and two.fit_stats_["world_size"] == 2
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=1e-9, atol=1e-11)
