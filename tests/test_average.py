"""Averaged SGD (``average``): the mean of the iterates, in s-step form.

The reference is averaged SGD written in numpy on the same batches (rows in
order, ``shuffle=False``): the mean of the weights after each minibatch
step, counted once the rows stepped on reach ``average``. In float64 the
engine's plain steps (s=1) and its s-step outer iterations, whose sum of
the iterates unrolls like the weights, both equal it to 1e-12.
"""

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.special import expit
from sklearn import datasets
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression

EXACT = dict(precision="fp64", device="cpu", shuffle=False, tol=None, solver="sgd")


def _asgd(X, y, gradient, alpha, eta, batch_size, epochs, start, intercept):
    """Averaged minibatch SGD in numpy: (mean coef, mean intercept, last coef, last intercept)."""
    n, d = X.shape
    w, b = np.zeros(d), intercept
    total_w, total_b, count, seen = np.zeros(d), 0.0, 0, 0
    for _ in range(epochs):
        for lo in range(0, n, batch_size):
            rows = slice(lo, lo + batch_size)
            size = len(y[rows])
            step = eta * size / batch_size  # a ragged batch takes its share of the step
            r = gradient(X[rows] @ w + b, y[rows])
            w = (1.0 - step * alpha) * w - step / size * (X[rows].T @ r)
            b -= step / size * r.sum()
            seen += size
            if seen >= start:
                total_w, total_b, count = total_w + w, total_b + b, count + 1
    return total_w / count, total_b / count, w, b


def _diabetes():
    X, y = datasets.load_diabetes(return_X_y=True)
    return StandardScaler().fit_transform(X)[:203], y[:203]  # a ragged last batch


@pytest.mark.parametrize("start", [True, 100, 700])
@pytest.mark.parametrize("s", [1, 4, 8])
def test_averaged_sgd_equals_numpy_asgd_on_the_same_batches(s, start):
    X, y = _diabetes()
    est = CASGDLinearRegression(
        alpha=0.01, average=start, s=s, batch_size=16, learning_rate="constant", eta0=0.05,
        max_iter=4, **EXACT,
    ).fit(X, y)  # fmt: skip
    mean_w, mean_b, w, b = _asgd(
        X, y, lambda z, t: z - t, 0.01, 0.05, 16, 4, int(start), float(np.mean(y))
    )
    np.testing.assert_allclose(est.coef_, mean_w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(est.intercept_, mean_b, rtol=0, atol=1e-12)
    np.testing.assert_allclose(est._average_iterate[0][0], w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(est._average_iterate[1], b, rtol=0, atol=1e-12)
    assert est.fit_stats_["s"] == s
    assert est.solver_state_["average_samples"] == 4 * 203


@pytest.mark.parametrize("s", [1, 5])
def test_averaged_logistic_regression_without_intercept(s):
    X, y = datasets.load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    est = CASGDLogisticRegression(
        alpha=1e-3, average=True, s=s, batch_size=32, learning_rate="invscaling", eta0=0.5,
        fit_intercept=False, max_iter=3, **EXACT,
    ).fit(X, y)  # fmt: skip
    # invscaling: eta_t = eta0 / (t + 1)^0.5 at step t; the reference walks the same steps.
    n, d = X.shape
    w, total, count, t = np.zeros(d), np.zeros(d), 0, 0
    for _ in range(3):
        for lo in range(0, n, 32):
            rows = slice(lo, lo + 32)
            size = len(y[rows])
            step = 0.5 / (t + 1) ** 0.5 * size / 32
            r = expit(X[rows] @ w) - y[rows]
            w = (1.0 - step * 1e-3) * w - step / size * (X[rows].T @ r)
            total, count, t = total + w, count + 1, t + 1
    np.testing.assert_allclose(est.coef_[0], total / count, rtol=0, atol=1e-12)
    assert est.intercept_[0] == 0.0


def test_partial_fit_continues_the_average():
    """Chunks of one stream: the same mean and iterate as one epoch over their concatenation."""
    X, y = _diabetes()
    # Chunks that permute one another's rows: the first chunk's intercept start
    # (its targets' mean) is then the whole stream's.
    orders = [np.arange(48)] + [np.random.default_rng(i).permutation(48) for i in range(3)]
    X, y = np.concatenate([X[o] for o in orders]), np.concatenate([y[o] for o in orders])
    params = dict(alpha=0.01, average=40, s=3, batch_size=16, learning_rate="constant", eta0=0.05)
    whole = CASGDLinearRegression(max_iter=1, **params, **EXACT).fit(X, y)
    chunked = CASGDLinearRegression(**params, **EXACT)
    for lo in range(0, 192, 48):
        chunked.partial_fit(X[lo : lo + 48], y[lo : lo + 48])
    np.testing.assert_allclose(chunked.coef_, whole.coef_, rtol=0, atol=1e-12)
    np.testing.assert_allclose(chunked.intercept_, whole.intercept_, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        chunked._average_iterate[0], whole._average_iterate[0], rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_two_ranks_equal_one_rank(sparse):
    X, y = _diabetes()
    if sparse:
        X = sp.csr_matrix(np.where(np.abs(X) < 0.5, 0.0, X))
    params = dict(
        alpha=0.01, average=True, s=4, batch_size=16, max_iter=3, timeout=60, random_state=0,
        **{**EXACT, "shuffle": True},
    )  # fmt: skip
    one = CASGDLinearRegression(n_devices=1, **params).fit(X, y)
    two = CASGDLinearRegression(n_devices=2, **params).fit(X, y)
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.intercept_, one.intercept_, rtol=0, atol=1e-10)
    assert two.fit_stats_["world_size"] == 2


def test_the_average_is_what_predicts_and_what_the_stopping_test_measures():
    X, y = _diabetes()
    est = CASGDLinearRegression(
        alpha=0.01, average=True, batch_size=16, max_iter=5, precision="fp64", solver="sgd",
        tol=1e-3, n_iter_no_change=100, random_state=0,
    )  # fmt: skip
    with pytest.warns(Warning):  # plain SGD does not converge in 5 epochs
        est.fit(X, y)
    np.testing.assert_allclose(est.predict(X), X @ est.coef_ + est.intercept_, rtol=1e-12)
    # The full gradient at the average, in float64, against the gradient bound's report.
    r = X @ est.coef_ + est.intercept_ - y
    gradient = np.append(X.T @ r / len(y) + 0.01 * est.coef_, r.mean())
    assert est.fit_stats_["gradient_max"] == pytest.approx(np.abs(gradient).max(), rel=1e-9)


def test_average_with_svrg_is_refused():
    X, y = _diabetes()
    with pytest.raises(ValueError, match="solver='sgd'"):
        CASGDLinearRegression(average=True).fit(X, y)


def test_negative_average_is_refused():
    X, y = _diabetes()
    with pytest.raises(ValueError, match="average"):
        CASGDLinearRegression(average=-1, solver="sgd").fit(X, y)


def test_compiled_steps_sum_the_same_iterates():
    """The compiled outer iteration hands back its residuals like the eager one."""
    X, y = _diabetes()
    params = dict(
        alpha=0.01, average=True, s=4, batch_size=16, learning_rate="constant", eta0=0.05,
        max_iter=3, **EXACT,
    )  # fmt: skip
    compiled = CASGDLinearRegression(compile=True, **params).fit(X, y)
    eager = CASGDLinearRegression(compile=False, **params).fit(X, y)
    assert compiled.fit_stats_["compiled"] and not eager.fit_stats_["compiled"]
    np.testing.assert_allclose(compiled.coef_, eager.coef_, rtol=0, atol=1e-12)
    np.testing.assert_allclose(compiled.intercept_, eager.intercept_, rtol=0, atol=1e-12)
