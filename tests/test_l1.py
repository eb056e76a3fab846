"""L1 and elastic-net penalties: proximal steps to the exact optimum.

References: scikit-learn's saga (logistic, multinomial) and coordinate
descent (Lasso, ElasticNet) run to tol=1e-12, and, for the log-link
families scikit-learn does not penalize by L1, a numpy proximal-gradient
(FISTA) solver written here from the objective alone. The engine's
proximal SGD is also held to a numpy loop on the same batches in float64.
"""

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from sklearn import datasets
from sklearn.linear_model import ElasticNet, LogisticRegression
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import (
    CASGDGammaRegressor,
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)
from sklearn_casgd._glm.penalties import Penalty
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective

EXACT = dict(precision="fp64", device="cpu", random_state=0, tol=1e-9, max_iter=5000)


def _scaled(X):
    return StandardScaler().fit_transform(np.asarray(X, dtype=np.float64))


def _saga(X, y, alpha, l1_ratio):
    """LogisticRegression's saga at ``C = 1 / (n alpha)``: the same objective."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # its penalty= is deprecated in 1.8
        return LogisticRegression(
            C=1.0 / (X.shape[0] * alpha),
            penalty="elasticnet",
            l1_ratio=l1_ratio,
            solver="saga",
            tol=1e-12,
            max_iter=200_000,
        ).fit(X, y)


def _log_link_gradient(family, raw, y, power):
    """d/dz of the half deviance (log link), per row."""
    if family == "poisson":
        return np.exp(raw) - y
    if family == "gamma":
        return 1.0 - y * np.exp(-raw)
    return np.exp((2.0 - power) * raw) - y * np.exp((1.0 - power) * raw)


def _fista(family, X, y, alpha, l1_ratio, power=1.5, iterations=20_000):
    """Proximal gradient with backtracking and restarts, numpy float64: the reference."""
    n, d = X.shape
    l1, l2 = alpha * l1_ratio, alpha * (1.0 - l1_ratio)

    def smooth(w):  # loss and the L2 part; w[-1] is the unpenalized intercept
        return glm_objective(family, X, y, w[:-1], w[-1], l2, power=power)

    def gradient(w):
        g = _log_link_gradient(family, X @ w[:-1] + w[-1], y, power)
        return np.append(X.T @ g / n + l2 * w[:-1], g.mean())

    def prox(w, step):
        out = w.copy()
        out[:-1] = np.sign(w[:-1]) * np.maximum(np.abs(w[:-1]) - step * l1, 0.0)
        return out

    def total(w):
        return smooth(w) + l1 * np.abs(w[:-1]).sum()

    w = np.zeros(d + 1)
    w[-1] = np.log(np.mean(y))
    momentum, t, step = w.copy(), 1.0, 1.0
    for _ in range(iterations):
        f, g = smooth(momentum), gradient(momentum)
        while True:
            candidate = prox(momentum - step * g, step)
            shift = candidate - momentum
            if smooth(candidate) <= f + g @ shift + shift @ shift / (2 * step):
                break
            step /= 2
        if total(candidate) > total(w):  # restart
            momentum, t = w.copy(), 1.0
            continue
        t_next = (1 + np.sqrt(1 + 4 * t * t)) / 2
        momentum = candidate + (t - 1) / t_next * (candidate - w)
        if np.max(np.abs(candidate - w)) < 1e-15:
            w = candidate
            break
        w, t = candidate, t_next
    return w[:-1], w[-1]


def _scotland():
    sm = pytest.importorskip("statsmodels.api")
    data = sm.datasets.scotland.load_pandas()
    return data.exog.to_numpy(float), data.endog.to_numpy(float)


def test_soft_threshold_and_residual_against_closed_forms():
    penalty = Penalty(0.5, 0.4)
    assert (penalty.l1, penalty.l2) == pytest.approx((0.2, 0.3))
    w = torch.tensor([[1.0], [-0.05], [0.3], [-2.0], [0.0]], dtype=torch.float64)
    Penalty.soft_threshold_(w, 0.1)
    np.testing.assert_allclose(w.numpy().ravel(), [0.9, 0.0, 0.2, -1.9, 0.0], rtol=1e-15)
    assert not torch.signbit(w[[1, 4]]).any()  # exact, positive zeros
    # Per-row thresholds (preconditioned columns).
    w = torch.tensor([[1.0, -1.0], [1.0, -1.0]], dtype=torch.float64)
    Penalty.soft_threshold_(w, torch.tensor([[0.5], [2.0]], dtype=torch.float64))
    np.testing.assert_array_equal(w.numpy(), [[0.5, -0.5], [0.0, 0.0]])
    # The residual: g + l1 sign(w) off zero; at zero what exceeds l1.
    gradient = torch.tensor([0.5, -0.1, 0.25, -0.3], dtype=torch.float64)
    coef = torch.tensor([1.0, -2.0, 0.0, 0.0], dtype=torch.float64)
    residual = penalty.optimality_residual(gradient, coef)
    np.testing.assert_allclose(residual.numpy(), [0.7, -0.3, 0.05, -0.1], rtol=1e-15)
    assert penalty.value(penalty.norms(coef[:, None])) == pytest.approx(0.2 * 3 + 0.15 * 5)


def test_l2_penalty_is_unchanged_by_the_l1_seam():
    penalty = Penalty(0.3)
    gradient = torch.tensor([0.5, -0.1], dtype=torch.float64)
    assert penalty.optimality_residual(gradient, torch.zeros(2)) is gradient
    assert not penalty.proximal and penalty.l2 == 0.3


@pytest.mark.parametrize("penalty, l1_ratio", [("l1", None), ("elasticnet", 0.5)])
@pytest.mark.parametrize("load", ["breast_cancer", "wine"])
def test_logistic_reaches_saga_objective_and_support(load, penalty, l1_ratio):
    X, y = getattr(datasets, f"load_{load}")(return_X_y=True)
    X = _scaled(X)
    alpha, share = 0.02, 1.0 if l1_ratio is None else l1_ratio
    est = CASGDLogisticRegression(
        alpha=alpha, penalty=penalty, l1_ratio=share if l1_ratio else 0.15, **EXACT
    ).fit(X, y)
    ref = _saga(X, y, alpha, share)
    target = y if load == "breast_cancer" else np.searchsorted(np.unique(y), y)
    family = "logistic" if load == "breast_cancer" else "multinomial"
    ours = glm_objective(family, X, target, est.coef_, est.intercept_, alpha, l1_ratio=share)
    theirs = glm_objective(family, X, target, ref.coef_, ref.intercept_, alpha, l1_ratio=share)
    assert ours - theirs < 1e-6
    assert est.fit_stats_["converged"] and est.fit_stats_["s"] == 1
    assert "proximal step" in est.fit_stats_["plan"]["reason"]
    np.testing.assert_array_equal(est.coef_ == 0, ref.coef_ == 0)
    assert (est.coef_ == 0).sum() > 0  # a penalty that selects


@pytest.mark.parametrize("l1_ratio, alpha", [(1.0, 0.5), (0.5, 2.0)])
def test_linear_regression_matches_lasso_and_elastic_net_on_diabetes(l1_ratio, alpha):
    X, y = datasets.load_diabetes(return_X_y=True)
    X = _scaled(X)
    penalty = "l1" if l1_ratio == 1.0 else "elasticnet"
    est = CASGDLinearRegression(alpha=alpha, penalty=penalty, l1_ratio=l1_ratio, **EXACT).fit(X, y)
    ref = ElasticNet(alpha=alpha, l1_ratio=l1_ratio, tol=1e-14, max_iter=100_000).fit(X, y)
    ours = glm_objective("linear", X, y, est.coef_, est.intercept_, alpha, l1_ratio=l1_ratio)
    theirs = glm_objective("linear", X, y, ref.coef_, ref.intercept_, alpha, l1_ratio=l1_ratio)
    assert ours - theirs < 1e-6 * max(1.0, abs(theirs))
    np.testing.assert_array_equal(est.coef_ == 0, ref.coef_ == 0)
    assert 0 < (est.coef_ == 0).sum() < X.shape[1]


@pytest.mark.parametrize(
    "estimator, family, load",
    [
        (CASGDPoissonRegressor(), "poisson", lambda: datasets.load_diabetes(return_X_y=True)),
        (CASGDGammaRegressor(), "gamma", _scotland),
        (
            CASGDTweedieRegressor(power=1.5),
            "tweedie",
            lambda: datasets.load_diabetes(return_X_y=True),
        ),
    ],
    ids=["poisson-diabetes", "gamma-scotland", "tweedie-diabetes"],
)
def test_log_link_families_reach_the_proximal_gradient_optimum(estimator, family, load):
    X, y = load()
    X = _scaled(X)
    alpha, l1_ratio = 0.05, 0.7
    # Poisson and Tweedie stop on rounding short of tol=1e-9 (a ConvergenceWarning).
    params = {**EXACT, "tol": 1e-7}
    est = estimator.set_params(alpha=alpha, penalty="elasticnet", l1_ratio=l1_ratio, **params)
    est.fit(X, y)
    coef, intercept = _fista(family, X, y, alpha, l1_ratio)
    ours = glm_objective(family, X, y, est.coef_, est.intercept_, alpha, l1_ratio=l1_ratio)
    theirs = glm_objective(family, X, y, coef, intercept, alpha, l1_ratio=l1_ratio)
    assert abs(ours - theirs) < 1e-6 * max(1.0, abs(theirs))
    np.testing.assert_array_equal(est.coef_ == 0, coef == 0)


def _prox_sgd_reference(X, y, alpha, l1_ratio, eta, batch_size, epochs):
    """Plain proximal minibatch SGD on the squared error, rows in order (numpy float64)."""
    n, d = X.shape
    l1, l2 = alpha * l1_ratio, alpha * (1.0 - l1_ratio)
    w, b = np.zeros(d), float(np.mean(y))
    for _ in range(epochs):
        for start in range(0, n, batch_size):
            rows = slice(start, start + batch_size)
            size = len(y[rows])
            step = eta * size / batch_size  # a ragged batch takes its share of the step
            r = X[rows] @ w + b - y[rows]
            w = (1.0 - step * l2) * w - step / size * (X[rows].T @ r)
            b -= step / size * r.sum()
            w = np.sign(w) * np.maximum(np.abs(w) - step * l1, 0.0)
    return w, b


@pytest.mark.parametrize("s", [1, 8])
def test_proximal_sgd_equals_a_numpy_loop_on_the_same_batches(s):
    """Any s asked runs s=1 (the proximal step is not linear): the same iterates either way."""
    X, y = datasets.load_diabetes(return_X_y=True)
    X = _scaled(X)[:203]  # a ragged last batch
    y = y[:203]
    params = dict(alpha=0.4, penalty="elasticnet", l1_ratio=0.6, solver="sgd")
    est = CASGDLinearRegression(
        **params,
        s=s,
        batch_size=16,
        learning_rate="constant",
        eta0=0.05,
        shuffle=False,
        max_iter=4,
        tol=None,
        precision="fp64",
        device="cpu",
    ).fit(X, y)
    w, b = _prox_sgd_reference(X, y, 0.4, 0.6, 0.05, 16, 4)
    np.testing.assert_allclose(est.coef_, w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(est.intercept_, b, rtol=0, atol=1e-12)
    assert est.fit_stats_["s"] == 1


def test_sparse_rows_equal_dense_rows():
    """Sparse rows run the torch steps (the epoch kernel takes no proximal step)."""
    X, y = datasets.load_breast_cancer(return_X_y=True)
    X = _scaled(X)
    X[np.abs(X) < 0.5] = 0.0
    params = dict(alpha=0.01, penalty="l1", **EXACT)
    dense = CASGDLogisticRegression(**params).fit(X, y)
    sparse = CASGDLogisticRegression(**params).fit(sp.csr_matrix(X), y)
    np.testing.assert_allclose(sparse.coef_, dense.coef_, rtol=0, atol=1e-8)
    np.testing.assert_array_equal(sparse.coef_ == 0, dense.coef_ == 0)
    assert sparse.fit_stats_["execution"]["epoch_kernel"] is False


@pytest.mark.parametrize("solver", ["svrg", "sgd"])
def test_two_ranks_equal_one_rank_in_float64(solver):
    X, y, _ = make_glm_data("logistic", 300, 9, random_state=0)
    params = dict(
        alpha=0.2,
        penalty="elasticnet",
        l1_ratio=0.8,
        solver=solver,
        batch_size=8,
        precision="fp64",
        max_iter=3,
        tol=None,
        device="cpu",
        random_state=0,
        timeout=60,
    )
    one = CASGDLogisticRegression(n_devices=1, **params).fit(X, y)
    two = CASGDLogisticRegression(n_devices=2, **params).fit(X, y)
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.intercept_, one.intercept_, rtol=0, atol=1e-10)
    np.testing.assert_array_equal(two.coef_ == 0, one.coef_ == 0)
    assert (one.coef_ == 0).any()
    assert two.fit_stats_["world_size"] == 2 and two.fit_stats_["s"] == 1


def test_l1_coefficients_sparsify_and_predict_the_same():
    X, y = datasets.load_breast_cancer(return_X_y=True)
    X = _scaled(X)
    est = CASGDLogisticRegression(alpha=0.05, penalty="l1", **EXACT).fit(X, y)
    proba = est.predict_proba(X)
    assert sp.issparse(est.sparsify().coef_)
    np.testing.assert_allclose(est.predict_proba(X), proba, rtol=1e-12)


@pytest.mark.parametrize("l1_ratio", [-0.1, 1.5])
def test_l1_ratio_outside_the_unit_interval_is_refused(l1_ratio):
    X, y = datasets.load_breast_cancer(return_X_y=True)
    with pytest.raises(ValueError, match="l1_ratio"):
        CASGDLogisticRegression(penalty="elasticnet", l1_ratio=l1_ratio).fit(X, y)


def test_unknown_penalty_is_refused():
    X, y = datasets.load_breast_cancer(return_X_y=True)
    with pytest.raises(ValueError, match="penalty"):
        CASGDLogisticRegression(penalty="l3").fit(X, y)


@pytest.mark.parametrize("solver", ["svrg", "sgd"])
def test_two_ranks_gathering_rows_equal_one_rank(solver, force_exchange):
    """The row exchange: each rank thresholds the replica of every rank's weights
    (preconditioned for SVRG: each column by its own scale), one all-gather per many steps."""
    force_exchange("all-gather")
    X, y = datasets.load_breast_cancer(return_X_y=True)  # unscaled: the scales differ
    params = dict(
        alpha=0.05, penalty="l1", solver=solver, batch_size=16, precision="fp64",
        max_iter=3, tol=None, device="cpu", random_state=0, timeout=60,
    )  # fmt: skip
    one = CASGDLogisticRegression(n_devices=1, **params).fit(X, y)
    two = CASGDLogisticRegression(n_devices=2, **params).fit(X, y)
    assert two.fit_stats_["exchange"] == "all-gather"
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.intercept_, one.intercept_, rtol=0, atol=1e-10)
    np.testing.assert_array_equal(two.coef_ == 0, one.coef_ == 0)
    assert (one.coef_ == 0).any()
    # Far fewer collectives than one per step.
    assert two.fit_stats_["n_allreduce"] < one.t_ / 4


def _text_like(n=2000, d=3000, per_row=30, seed=0):
    """Sparse unit rows over Zipf-popular columns, labels from 20 informative columns."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, d + 1) ** 1.1
    rows = np.repeat(np.arange(n), per_row)
    cols = rng.choice(d, size=n * per_row, p=popularity / popularity.sum())
    values = rng.uniform(0.5, 2.0, n * per_row)
    X = sp.csr_matrix((values, (rows, cols)), shape=(n, d))  # repeated words summed
    X = sp.csr_matrix(X.multiply(1.0 / np.sqrt(X.multiply(X).sum(axis=1))))
    coef = np.zeros(d)
    coef[rng.choice(200, 20, replace=False)] = rng.normal(scale=8.0, size=20)
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-(X @ coef)))).astype(int)
    return X, y


def test_sparse_text_like_rows_reach_saga_and_liblinear():
    """Rare columns (no preconditioner): the proximal sparse kernel, to the optimum."""
    X, y = _text_like()
    alpha = 1e-3
    est = CASGDLogisticRegression(alpha=alpha, penalty="l1", **{**EXACT, "tol": 1e-8}).fit(X, y)
    assert est.fit_stats_["execution"]["epoch_kernel"] is (sparse_steps_available())
    saga = _saga(X, y, alpha, 1.0)
    ours = glm_objective("logistic", X, y, est.coef_, est.intercept_, alpha, l1_ratio=1.0)
    theirs = glm_objective("logistic", X, y, saga.coef_, saga.intercept_, alpha, l1_ratio=1.0)
    assert ours - theirs < 1e-6 * theirs
    np.testing.assert_array_equal(est.coef_ == 0, saga.coef_ == 0)
    assert 0 < (est.coef_ != 0).sum() < 100


def sparse_steps_available():
    from sklearn_casgd._accel import sparse_steps

    return sparse_steps.available()
