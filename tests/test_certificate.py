"""The gap certificate: an upper bound on the objective's gap to the optimum, and what stops on it.

The bound's arithmetic is checked against exact float64 optima (scipy's
Newton) at random points near and far from them, family by family; the
fits' reported bound against the true gap of their coefficients (the
optimum from scikit-learn at tight tolerance, or a float64 fit to a far
smaller certified gap); and the stopping test against the battery of
ill-conditioned problems that fooled the gradient test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from scipy.optimize import minimize
from scipy.special import expit, logsumexp
from sklearn.datasets import load_breast_cancer, load_diabetes
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression, PoissonRegressor, Ridge
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import (
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)
from sklearn_casgd._engine.certificate import GapCertificate
from sklearn_casgd._glm.families import (
    BinomialFamily,
    MultinomialFamily,
    SquaredErrorFamily,
    TweedieFamily,
)
from sklearn_casgd.metrics import glm_objective

# Per-sample loss, its derivative and its second derivative in z (numpy), k = 1.
SCALAR_LOSSES = {
    "logistic": (
        lambda z, y: np.logaddexp(0.0, z) - y * z,
        lambda z, y: expit(z) - y,
        lambda z, y: expit(z) * (1 - expit(z)),
    ),
    "squared": (
        lambda z, y: 0.5 * (z - y) ** 2,
        lambda z, y: z - y,
        lambda z, y: np.ones_like(z),
    ),
    "poisson": (
        lambda z, y: np.exp(z) - y * z,
        lambda z, y: np.exp(z) - y,
        lambda z, y: np.exp(z),
    ),
    "gamma": (
        lambda z, y: z + y * np.exp(-z),
        lambda z, y: 1 - y * np.exp(-z),
        lambda z, y: y * np.exp(-z),
    ),
    "tweedie": (
        lambda z, y: np.exp(0.5 * z) / 0.5 - y * np.exp(-0.5 * z) / -0.5,
        lambda z, y: np.exp(0.5 * z) - y * np.exp(-0.5 * z),
        lambda z, y: 0.5 * np.exp(0.5 * z) + 0.5 * y * np.exp(-0.5 * z),
    ),
}
FAMILIES = {
    "logistic": BinomialFamily(),
    "squared": SquaredErrorFamily(),
    "poisson": TweedieFamily(1.0),
    "gamma": TweedieFamily(2.0),
    "tweedie": TweedieFamily(1.5),
}


def _scalar_problem(name: str, rng: np.random.Generator, n: int = 300, d: int = 6):
    X = rng.normal(size=(n, d)) * rng.uniform(0.3, 3.0, d)
    truth = rng.normal(scale=0.3, size=d)
    z = X @ truth + 0.2
    if name == "logistic":
        y = (rng.random(n) < expit(z)).astype(float)
    elif name == "squared":
        y = z + rng.normal(size=n)
    elif name == "poisson":
        y = rng.poisson(np.exp(z)).astype(float)
    else:
        y = rng.gamma(2.0, np.exp(z) / 2.0)
    weight = rng.uniform(0.2, 2.0, n)
    return X, y, weight


def _objective(loss, X, y, weight, alpha, theta):
    w, b = theta[:-1], theta[-1]
    return float(weight @ loss(X @ w + b, y)) / X.shape[0] + 0.5 * alpha * float(w @ w)


def _exact_optimum(loss, gradient, curvature, X, y, weight, alpha):
    """The float64 optimum by Newton's method with a line search, to the rounding floor."""
    n, d = X.shape
    A = np.column_stack([X, np.ones(n)])
    theta = np.zeros(d + 1)
    penalty = np.r_[np.full(d, alpha), 0.0]
    for _ in range(100):
        z = A @ theta
        g = A.T @ (weight * gradient(z, y)) / n + penalty * theta
        H = A.T @ (A * (weight * curvature(z, y))[:, None]) / n + np.diag(penalty)
        step = np.linalg.solve(H, g)
        value = _objective(loss, X, y, weight, alpha, theta)
        length = 1.0
        while (
            _objective(loss, X, y, weight, alpha, theta - length * step) > value and length > 1e-10
        ):
            length /= 2
        theta = theta - length * step
        if np.abs(g).max() < 1e-13:
            break
    return _objective(loss, X, y, weight, alpha, theta), theta


@pytest.mark.parametrize("name", sorted(SCALAR_LOSSES))
def test_the_bound_holds_near_and_far_from_the_optimum(name):
    """At points around the exact optimum the bound is at least the true gap, and tightens."""
    rng = np.random.default_rng(0)
    loss, gradient, curvature = SCALAR_LOSSES[name]
    X, y, weight = _scalar_problem(name, rng)
    n, d = X.shape
    alpha = 1e-2
    best, theta_star = _exact_optimum(loss, gradient, curvature, X, y, weight, alpha)
    family = FAMILIES[name]
    certificate = GapCertificate(
        alpha, family.self_concordance, True, False, float(np.square(X).sum())
    )
    bounds = []
    for radius in (1e-6, 1e-4, 1e-2, 1e-1, 0.5):
        for _ in range(5):
            theta = theta_star + radius * rng.normal(size=d + 1)
            w, b = theta[:-1], theta[-1]
            z = X @ w + b
            residual = weight * gradient(z, y)
            g_w = X.T @ residual / n + alpha * w
            g_b = residual.sum() / n
            traces = weight * curvature(z, y)
            value = _objective(loss, X, y, weight, alpha, theta)
            absolute, relative = certificate.bound(
                value,
                float(g_w @ g_w),
                torch.tensor([g_b]),
                torch.tensor([[traces.sum()]]),
                float(traces @ traces),
                n,
            )
            true_gap = value - best
            assert absolute >= true_gap * (1 - 1e-9) - 1e-15, (radius, absolute, true_gap)
            if math.isfinite(relative):
                assert relative >= true_gap / best * (1 - 1e-9) - 1e-15
            bounds.append((radius, absolute, true_gap))
    # Near the optimum the bound is finite and within a few times the gap times
    # the condition number that strong convexity leaves: lambda_max(H) / alpha.
    A = np.column_stack([X, np.ones(n)])
    z = A @ theta_star
    hessian = A.T @ (A * (weight * curvature(z, y))[:, None]) / n
    condition = np.linalg.eigvalsh(hessian)[-1] / alpha
    close = [(a, t) for r, a, t in bounds if r == 1e-6]
    assert all(math.isfinite(a) and a <= 10 * condition * t for a, t in close)


def test_the_bound_of_the_multinomial_holds_with_its_shift_invariance():
    """Ten classes: the intercepts' common shift is ignored, the bound still holds."""
    rng = np.random.default_rng(1)
    n, d, k = 400, 5, 4
    X = rng.normal(size=(n, d))
    labels = rng.integers(k, size=n)
    Y = np.eye(k)[labels]
    weight = rng.uniform(0.5, 1.5, n)
    alpha = 1e-2

    def value(theta):
        W, b = theta[: d * k].reshape(d, k), theta[d * k :]
        Z = X @ W + b
        return float(weight @ (logsumexp(Z, axis=1) - (Z * Y).sum(1))) / n + 0.5 * alpha * float(
            (W**2).sum()
        )

    def grad(theta):
        W, b = theta[: d * k].reshape(d, k), theta[d * k :]
        Z = X @ W + b
        P = np.exp(Z - logsumexp(Z, axis=1, keepdims=True))
        R = weight[:, None] * (P - Y)
        return np.r_[(X.T @ R / n + alpha * W).ravel(), R.sum(0) / n]

    result = minimize(value, np.zeros(d * k + k), jac=grad, method="BFGS", options={"gtol": 1e-12})
    best = result.fun
    certificate = GapCertificate(
        alpha, MultinomialFamily().self_concordance, True, True, float(np.square(X).sum())
    )
    family = MultinomialFamily()
    for radius in (1e-5, 1e-3, 1e-1):
        for _ in range(5):
            theta = result.x + radius * rng.normal(size=result.x.size)
            W, b = theta[: d * k].reshape(d, k), theta[d * k :]
            g = grad(theta)
            raw = torch.from_numpy(X @ W + b)
            hessian, traces = family.hessian_sums(
                raw, torch.from_numpy(Y), torch.from_numpy(weight)
            )
            traces = traces.numpy() * weight
            absolute, _ = certificate.bound(
                value(theta),
                float(g[: d * k] @ g[: d * k]),
                torch.from_numpy(g[d * k :]),
                hessian,
                float(traces @ traces),
                n,
            )
            assert absolute >= (value(theta) - best) * (1 - 1e-9) - 1e-15


def _reference_logistic(X, y, alpha):
    """The optimum's objective from scikit-learn's lbfgs at a tight tolerance."""
    model = LogisticRegression(C=1.0 / (X.shape[0] * alpha), tol=1e-13, max_iter=100_000)
    model.fit(X, y)
    return glm_objective("logistic", X, y, model.coef_.ravel(), model.intercept_[0], alpha)


@pytest.mark.parametrize("max_iter", [1, 2, 3, 5, 100])
@pytest.mark.parametrize("batch_size", ["auto", 16])
def test_a_fits_reported_bound_is_at_least_its_true_gap(max_iter, batch_size):
    """Along Newton's and minibatch SVRG's paths on breast_cancer: bound >= true gap."""
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    alpha = 1e-3
    best = _reference_logistic(X, y, alpha)
    with pytest.warns(ConvergenceWarning) if max_iter < 5 else _no_warning():
        model = CASGDLogisticRegression(
            alpha=alpha, max_iter=max_iter, batch_size=batch_size, precision="fp64",
            random_state=0,
        ).fit(X, y)  # fmt: skip
    gap = (
        glm_objective("logistic", X, y, model.coef_.ravel(), model.intercept_[0], alpha) - best
    ) / best
    bound = model.fit_stats_["gap_bound"]
    assert bound is not None and bound >= gap - 1e-14
    assert model.fit_stats_["gap_bound_method"].startswith("strong convexity")
    if model.fit_stats_["converged"]:
        assert bound <= model.fit_stats_["gap_target"] == pytest.approx(1e-6)


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore", ConvergenceWarning)

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


@pytest.mark.parametrize(
    "make, reference",
    [
        (
            lambda a: CASGDLinearRegression(alpha=a, precision="fp64"),
            lambda X, y, a: Ridge(alpha=a * X.shape[0], tol=1e-14, solver="cholesky"),
        ),
        (
            lambda a: CASGDPoissonRegressor(alpha=a, precision="fp64"),
            lambda X, y, a: PoissonRegressor(alpha=a, tol=1e-14, max_iter=100_000),
        ),
    ],
)
def test_the_bound_holds_on_regression_against_scikit_learn(make, reference):
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    family = "linear" if isinstance(make(1.0), CASGDLinearRegression) else "poisson"
    if family == "poisson":
        y = y / 100.0
    alpha = 1e-3
    best_model = reference(X, y, alpha).fit(X, y)
    best = glm_objective(family, X, y, best_model.coef_, best_model.intercept_, alpha)
    for max_iter in (1, 2, 50):
        with _no_warning():
            model = make(alpha).set_params(max_iter=max_iter).fit(X, y)
        value = glm_objective(family, X, y, model.coef_, model.intercept_, alpha)
        assert model.fit_stats_["gap_bound"] >= (value - best) / best - 1e-13


def test_no_bound_without_an_l2_part_and_the_gradient_test_decides():
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    with _no_warning():
        model = CASGDLogisticRegression(alpha=1e-2, penalty="l1", random_state=0).fit(X, y)
    stats = model.fit_stats_
    assert stats["gap_bound"] is None and stats["gap_target"] is None
    assert stats["gap_bound_method"].startswith("none: the penalty has no L2 part")


def test_no_bound_where_the_loss_is_not_convex_in_the_raw_prediction():
    """Tweedie's power 3 (inverse Gaussian, log link): the gradient test alone."""
    assert TweedieFamily(3.0).self_concordance is None
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    with _no_warning():
        model = CASGDTweedieRegressor(power=3.0, alpha=1e-2).fit(X, y)
    stats = model.fit_stats_
    assert stats["gap_bound"] is None
    assert stats["gap_bound_method"].startswith("none: the loss is not convex")


def test_elastic_net_is_certified_by_its_l2_part():
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    model = CASGDLogisticRegression(
        alpha=1e-2, penalty="elasticnet", l1_ratio=0.5, random_state=0, precision="fp64"
    ).fit(X, y)
    stats = model.fit_stats_
    assert stats["converged"] and stats["gap_bound"] <= stats["gap_target"]


def test_separable_classes_without_a_penalty_do_not_converge():
    """alpha=0 on separable data: no finite optimum; the fit says so instead of converging."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(int)
    with pytest.warns(ConvergenceWarning, match="separable"):
        model = CASGDLogisticRegression(alpha=0.0, random_state=0).fit(X, y)
    assert not model.fit_stats_["converged"]


@pytest.mark.parametrize(
    "case",
    ["rare sparse features", "unscaled columns", "heavy-tailed counts", "near separable",
     "ill-conditioned minibatch", "imbalanced minibatch", "imbalanced defaults"],
)  # fmt: skip
def test_no_fit_reports_convergence_far_above_the_gap_its_tol_names(case):
    """The issue's battery: a converged fit is within 10x the gap tol names, and bound >= gap."""
    X, y, make, family = _battery(case)
    model = make()
    with _no_warning():
        model.fit(X, y)
    alpha = model.alpha
    # Newton epochs in float64 to a far smaller certified gap.
    reference = make().set_params(precision="fp64", tol=1e-9, batch_size="auto", max_iter=200)
    with _no_warning():
        reference.fit(X, y)
    best = min(_value(family, m, X, y, alpha) for m in (model, reference))
    gap = (_value(family, model, X, y, alpha) - best) / best
    stats = model.fit_stats_
    assert stats["gap_bound"] is not None and stats["gap_bound"] >= gap - 1e-12
    if stats["converged"]:
        assert gap <= 10 * stats["gap_target"]


def _value(family, model, X, y, alpha):
    coef = model.coef_.ravel() if family == "logistic" else model.coef_
    intercept = model.intercept_[0] if family == "logistic" else model.intercept_
    return glm_objective(family, X, y, coef, intercept, alpha)


def _battery(case: str):
    rng = np.random.default_rng(0)
    if case == "rare sparse features":
        n, d = 3000, 2000
        rows = np.repeat(np.arange(n), 8)
        cols = np.minimum((rng.pareto(1.1, n * 8) * 20).astype(int), d - 1)
        X = sp.csr_matrix((rng.uniform(0.5, 1.5, n * 8), (rows, cols)), shape=(n, d))
        truth = rng.normal(size=d)
        y = (rng.random(n) < expit(X @ truth)).astype(int)
        return X, y, lambda: CASGDLogisticRegression(alpha=1e-6, random_state=0), "logistic"
    if case == "unscaled columns":
        X = rng.normal(size=(5000, 6)) * np.array([1e-3, 1e-1, 1, 10, 1e3, 1e4])
        y = (rng.random(5000) < expit(X @ (1 / np.array([1e-3, 1e-1, 1, 10, 1e3, 1e4])))).astype(
            int
        )
        return X, y, lambda: CASGDLogisticRegression(alpha=1e-5, random_state=0), "logistic"
    if case == "heavy-tailed counts":
        X = rng.normal(size=(5000, 5))
        y = np.floor(rng.pareto(1.5, 5000) * np.exp(0.3 * X[:, 0]))
        return X, y, lambda: CASGDPoissonRegressor(alpha=1e-5), "poisson"
    if case == "near separable":
        X = rng.normal(size=(5000, 5))
        y = (X[:, 0] + 0.05 * rng.normal(size=5000) > 0).astype(int)
        return X, y, lambda: CASGDLogisticRegression(alpha=1e-6, random_state=0), "logistic"
    if case == "ill-conditioned minibatch":
        low = rng.normal(size=(5000, 5)) @ rng.normal(size=(5, 30))
        X = low + 0.01 * rng.normal(size=low.shape)
        y = (rng.random(5000) < expit(X[:, 0])).astype(int)
        make = lambda: CASGDLogisticRegression(  # noqa: E731
            alpha=1e-7, batch_size=32, max_iter=100, random_state=0
        )
        return X, y, make, "logistic"
    X = rng.normal(size=(20_000, 5))
    y = np.zeros(20_000, dtype=int)
    y[:3] = 1
    if case == "imbalanced minibatch":
        make = lambda: CASGDLogisticRegression(alpha=1e-4, batch_size=32, random_state=0)  # noqa: E731
    else:
        make = lambda: CASGDLogisticRegression(alpha=1e-4, random_state=0)  # noqa: E731
    return X, y, make, "logistic"
