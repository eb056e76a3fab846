"""The sparse epoch kernel (numba, one CPU process) takes the torch steps' steps.

The torch steps on sparse rows (:func:`sklearn_casgd._engine.recurrence.sgd_step`,
an eager dense update) are the reference and the fallback where numba is
missing: in float64 both fits end at the same weights (1e-12) and loss
curve (1e-12), in every family, plain SGD and SVRG, with and without the
preconditioner's implicit centering (folded into the kernel's scalar
weights), with sample weights, and when the lazily scaled weights must be
renormalised within an epoch. Real data: scikit-learn's digits (sparse,
non-negative pixels) and diabetes; statsmodels' Scotland election counts.
"""

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from sklearn.datasets import load_diabetes, load_digits

from sklearn_casgd import (
    CASGDGammaRegressor,
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)
from sklearn_casgd._accel import sparse_steps
from sklearn_casgd._data.storage import CSRMatrix
from sklearn_casgd._engine import fit_plan
from sklearn_casgd._engine.stepsize import entries_once, squared_row_norms

pytest.importorskip("numba")

EXACT = dict(precision="fp64", random_state=0, max_iter=4, tol=None)


def _digits(n_classes):
    X, y = load_digits(n_class=n_classes, return_X_y=True)
    return sp.csr_matrix(X / 16.0), y  # ~50 % zeros; uncentered columns


def _diabetes_counts():
    """diabetes' columns made sparse and positive; its target scaled to counts."""
    X, y = load_diabetes(return_X_y=True)
    X = np.where(X > 0.0, X * 10.0, 0.0)
    return sp.csr_matrix(X), np.round(y / 25.0)


def _scotland():
    sm = pytest.importorskip("statsmodels.api")
    data = sm.datasets.scotland.load_pandas()
    X = data.exog.to_numpy(dtype=np.float64)
    X = (X - X.min(axis=0)) / (X.max(axis=0) - X.min(axis=0))
    X[X < 0.3] = 0.0
    return sp.csr_matrix(X), data.endog.to_numpy(dtype=np.float64)


CASES = {
    "logistic, digits": (CASGDLogisticRegression, lambda: _digits(2), {}),
    "multinomial, digits": (CASGDLogisticRegression, lambda: _digits(4), {}),
    "linear, diabetes": (CASGDLinearRegression, _diabetes_counts, {}),
    "poisson, diabetes": (CASGDPoissonRegressor, _diabetes_counts, {}),
    "gamma, scotland": (CASGDGammaRegressor, _scotland, {}),
    "tweedie 1.5, diabetes": (
        CASGDTweedieRegressor,
        lambda: (lambda X, y: (X, y + 1.0))(*_diabetes_counts()),
        {"power": 1.5},
    ),
}


def _fit_both(force_plan, estimator, X, y, **params):
    """The same fit with the kernel and with the torch steps; both estimators."""
    fits = []
    for kernel in (True, False):
        force_plan(epoch_kernel=kernel)
        fits.append(estimator(**params).fit(X, y))
        assert fits[-1].fit_stats_["execution"]["epoch_kernel"] is kernel
    return fits


def _assert_same(kernel, torch_steps, atol=1e-12):
    np.testing.assert_allclose(kernel.coef_, torch_steps.coef_, rtol=0, atol=atol)
    np.testing.assert_allclose(kernel.intercept_, torch_steps.intercept_, rtol=0, atol=atol)
    np.testing.assert_allclose(kernel.loss_curve_, torch_steps.loss_curve_, rtol=1e-12)


@pytest.mark.parametrize(
    ("solver", "precondition"),
    [("sgd", False), ("svrg", False), ("svrg", True)],  # plain SGD is never preconditioned
    ids=["sgd", "svrg, rows as stored", "svrg, centered"],
)
@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_takes_the_torch_steps_in_float64(
    force_plan, monkeypatch, case, solver, precondition
):
    estimator, load, params = CASES[case]
    monkeypatch.setattr(fit_plan, "PRECONDITION_SPARSE", precondition)
    X, y = load()
    kernel, torch_steps = _fit_both(
        force_plan, estimator, X, y, solver=solver, batch_size=16, **EXACT, **params
    )
    _assert_same(kernel, torch_steps)
    if precondition:  # the centering is exercised: the columns' centers are far from zero
        assert np.abs(kernel._step_plan.column_center).max() > 0.1


def test_sample_weights_and_no_intercept(force_plan):
    X, y = _digits(3)
    weight = np.random.default_rng(0).uniform(0.2, 3.0, X.shape[0])
    for solver in ("sgd", "svrg"):
        params = dict(EXACT, solver=solver, batch_size=8, fit_intercept=False)
        fits = []
        for kernel in (True, False):
            force_plan(epoch_kernel=kernel)
            fits.append(CASGDLogisticRegression(**params).fit(X, y, sample_weight=weight))
        _assert_same(*fits)


def test_the_scale_is_renormalised_within_an_epoch(force_plan):
    """alpha * eta = 0.5: the weights' scale halves every step and falls under
    1e-9 after 30 of the 56 steps an epoch; the result is the eager update's."""
    X, y = _digits(2)
    kernel, torch_steps = _fit_both(
        force_plan, CASGDLogisticRegression, X, y,
        solver="sgd", alpha=0.5, eta0=1.0, learning_rate="constant", batch_size=8, **EXACT,
    )  # fmt: skip
    _assert_same(kernel, torch_steps)
    assert np.abs(kernel.coef_).max() > 1e-3  # not decayed to nothing


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_narrow_precisions_stay_close_to_the_torch_steps(force_plan, precision):
    """The kernel computes in float64 from the stored values: closer to exact
    than the torch steps' float32, so the fits differ by those steps' rounding."""
    X, y = _digits(2)
    params = dict(EXACT, precision=precision, solver="svrg", batch_size=16)
    kernel, torch_steps = _fit_both(force_plan, CASGDLogisticRegression, X, y, **params)
    scale = np.abs(torch_steps.coef_).max()
    np.testing.assert_allclose(kernel.coef_, torch_steps.coef_, rtol=0, atol=1e-4 * scale)
    exact = CASGDLogisticRegression(**{**params, "precision": "fp64"}).fit(X, y)
    np.testing.assert_allclose(kernel.coef_, exact.coef_, rtol=0, atol=1e-4 * scale)


def test_without_numba_the_torch_steps_run(monkeypatch):
    X, y = _digits(2)
    params = dict(EXACT, solver="svrg", batch_size=16)
    kernel = CASGDLogisticRegression(**params).fit(X, y)
    monkeypatch.setattr(sparse_steps, "available", lambda: False)
    fallback = CASGDLogisticRegression(**params).fit(X, y)
    assert kernel.fit_stats_["execution"]["epoch_kernel"]
    assert not fallback.fit_stats_["execution"]["epoch_kernel"]
    _assert_same(kernel, fallback)


def _with_duplicates(X):
    """X with each entry stored as two halves, shuffled within each row (not canonical)."""
    rng = np.random.default_rng(0)
    data, indices = [], []
    for lo, hi in zip(X.indptr[:-1], X.indptr[1:], strict=True):
        order = rng.permutation(2 * (hi - lo))
        indices.append(np.tile(X.indices[lo:hi], 2)[order])
        data.append(np.tile(X.data[lo:hi] / 2.0, 2)[order])
    return sp.csr_matrix(
        (np.concatenate(data), np.concatenate(indices), 2 * X.indptr), shape=X.shape
    )


def test_duplicate_entries_act_as_their_sum():
    """A CSR X with unsorted, duplicated entries fits as its canonical form
    (the preconditioner's squares included), and the caller's X is unchanged."""
    X, y = _digits(2)
    duplicated = _with_duplicates(X)
    assert not duplicated.has_canonical_format
    saved = [array.copy() for array in (duplicated.data, duplicated.indices, duplicated.indptr)]
    params = dict(EXACT, solver="svrg", batch_size=16)
    fitted = CASGDLogisticRegression(**params).fit(duplicated, y)
    canonical = CASGDLogisticRegression(**params).fit(X, y)
    np.testing.assert_allclose(fitted.coef_, canonical.coef_, rtol=0, atol=1e-10)
    for array, before in zip(
        (duplicated.data, duplicated.indices, duplicated.indptr), saved, strict=True
    ):
        np.testing.assert_array_equal(array, before)


def test_the_column_indices_are_int32_and_shared():
    X, _ = _digits(2)
    stored = CSRMatrix.from_scipy(X, torch.device("cpu"), torch.float64)
    assert stored.col.dtype == torch.int32
    assert np.shares_memory(stored.col.numpy(), X.indices)


def test_unsorted_rows_are_squared_in_place_and_duplicates_found():
    """Unsorted rows without a repeated column (TF-IDF's) are used as they are:
    no canonical copy of X for the row norms; a repeated column is summed first."""
    X, _ = _digits(2)
    rng = np.random.default_rng(0)
    unsorted = X.copy()
    for lo, hi in zip(X.indptr[:-1], X.indptr[1:], strict=True):
        order = lo + rng.permutation(hi - lo)
        unsorted.indices[lo:hi], unsorted.data[lo:hi] = X.indices[order], X.data[order]
    unsorted.has_sorted_indices = False
    assert not unsorted.has_canonical_format
    assert sparse_steps.has_duplicates(unsorted) is False
    assert entries_once(unsorted) is unsorted
    duplicated = _with_duplicates(X)
    assert sparse_steps.has_duplicates(duplicated) is True
    once = entries_once(duplicated)
    assert once.has_canonical_format and once is not duplicated
    np.testing.assert_allclose(once.toarray(), X.toarray(), rtol=1e-15)
    np.testing.assert_allclose(
        squared_row_norms(duplicated, False), squared_row_norms(X, False), rtol=1e-14
    )


@pytest.mark.parametrize("solver", ["sgd", "svrg"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_proximal_kernel_takes_the_torch_steps_in_float64(
    force_plan, monkeypatch, case, solver
):
    """An L1 part: the kernel catches each column up over the steps that did not read it.

    Rows as stored (the proximal kernel takes no preconditioner: preconditioned
    sparse rows run the torch steps, ``test_a_preconditioned_proximal_fit_runs_the_torch_steps``).
    """
    monkeypatch.setattr(fit_plan, "PRECONDITION_SPARSE", False)
    estimator, load, params = CASES[case]
    X, y = load()
    penalty = dict(penalty="elasticnet", l1_ratio=0.8, alpha=0.02)
    kernel, torch_steps = _fit_both(
        force_plan, estimator, X, y, solver=solver, batch_size=16, **penalty, **EXACT, **params
    )
    _assert_same(kernel, torch_steps)
    np.testing.assert_array_equal(kernel.coef_ == 0, torch_steps.coef_ == 0)


@pytest.mark.parametrize(
    "params",
    [
        dict(alpha=0.05, penalty="l1", learning_rate="invscaling", eta0=0.5),  # every step differs
        dict(alpha=0.5, penalty="elasticnet", l1_ratio=0.5, learning_rate="constant", eta0=1.0),
        dict(alpha=0.002, penalty="l1", learning_rate="constant", eta0=1.0),  # few zeros
    ],
    ids=["invscaling", "strong decay", "weak l1"],
)
def test_the_proximal_kernel_over_step_schedules(force_plan, params):
    X, y = _digits(3)
    kernel, torch_steps = _fit_both(
        force_plan, CASGDLogisticRegression, X, y, solver="sgd", batch_size=8, **EXACT, **params
    )
    _assert_same(kernel, torch_steps)
    np.testing.assert_array_equal(kernel.coef_ == 0, torch_steps.coef_ == 0)
    assert 0 < (kernel.coef_ == 0).sum() < kernel.coef_.size


@pytest.mark.parametrize("a", [1.0, 0.999, 0.9, 0.3])
def test_repeated_proximal_map_in_closed_form_equals_its_steps(a):
    """m steps of x <- S_tau(a x - e): the pieces' closed forms against the loop."""
    from sklearn_casgd._accel.sparse_prox_kernel import _repeat_prox, _soft_threshold

    rng = np.random.default_rng(0)
    for _ in range(400):
        x, e, tau = rng.normal(scale=3.0), rng.normal(scale=0.1), abs(rng.normal(scale=0.1))
        m = int(rng.integers(1, 3000))
        expected = x
        for _ in range(m):
            expected = _soft_threshold(a * expected - e, tau)
        got = _repeat_prox(x, m, a, e, tau)
        assert (got == 0.0) == (expected == 0.0)
        assert got == pytest.approx(expected, rel=1e-11, abs=1e-13)


def test_a_preconditioned_proximal_fit_runs_the_torch_steps(monkeypatch):
    monkeypatch.setattr(fit_plan, "PRECONDITION_SPARSE", True)
    X, y = _digits(2)
    est = CASGDLogisticRegression(penalty="l1", alpha=0.01, **EXACT).fit(X, y)
    assert est.fit_stats_["execution"]["epoch_kernel"] is False
    assert est._step_plan.column_scale is not None
