"""Bad input gets a clear error and leaves the user's arrays as they were."""

import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.utils._param_validation import InvalidParameterError

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression, CASGDPoissonRegressor

ALL = [CASGDLogisticRegression, CASGDLinearRegression, CASGDPoissonRegressor]


def data(n=40, d=3):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, d))
    y = (X[:, 0] > 0).astype(float) + 1.0  # counts, labels and real targets at once
    return X, y


def fit_keeps_inputs(estimator, X, y, match, error=ValueError, **fit_params):
    snapshots = [np.array(a, copy=True) for a in (X, y, *fit_params.values())]
    with pytest.raises(error, match=match):
        estimator.fit(X, y, **fit_params)
    for before, after in zip(snapshots, (X, y, *fit_params.values()), strict=True):
        np.testing.assert_array_equal(np.asarray(after), before)


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_X(cls, bad):
    X, y = data()
    X[5, 1] = bad
    fit_keeps_inputs(cls(), X, y, "Input X contains (NaN|infinity)")


@pytest.mark.parametrize("cls", [CASGDLinearRegression, CASGDPoissonRegressor])
def test_non_finite_y(cls):
    X, y = data()
    y[3] = np.nan
    fit_keeps_inputs(cls(), X, y, "Input y contains NaN")


def test_negative_poisson_targets():
    X, y = data()
    y[0] = -1.0
    fit_keeps_inputs(CASGDPoissonRegressor(), X, y, "negative")


def test_poisson_all_zero_targets():
    X, y = data()
    fit_keeps_inputs(CASGDPoissonRegressor(), X, np.zeros_like(y), "weighted sum of y is zero")


def test_one_class():
    X, y = data()
    fit_keeps_inputs(CASGDLogisticRegression(), X, np.ones_like(y), "only one class")


@pytest.mark.parametrize("cls", ALL)
def test_empty_and_badly_shaped_X(cls):
    X, y = data()
    fit_keeps_inputs(cls(), X[:0], y[:0], "0 sample")
    fit_keeps_inputs(cls(), X[:, :0], y, "0 feature")
    fit_keeps_inputs(cls(), X.reshape(40, 3, 1), y, "3 dimensions|dim 3")
    fit_keeps_inputs(cls(), X[:, 0], y, "Expected 2D array")


@pytest.mark.parametrize("cls", [CASGDLinearRegression, CASGDPoissonRegressor])
def test_string_targets_for_regressors(cls):
    X, _ = data()
    y = np.array(["a", "b"] * 20)
    fit_keeps_inputs(cls(), X, y, "could not convert|numeric")


@pytest.mark.parametrize("cls", ALL)
def test_mismatched_lengths(cls):
    X, y = data()
    fit_keeps_inputs(cls(), X, y[:-1], "inconsistent numbers of samples")
    fit_keeps_inputs(cls(), X, y, "sample_weight.shape", sample_weight=np.ones(39))


@pytest.mark.parametrize("cls", ALL)
def test_bad_sample_weights(cls):
    X, y = data()
    weights = np.ones(40)
    weights[7] = -0.5
    fit_keeps_inputs(
        cls(), X, y, "Negative values in data passed to `sample_weight`", sample_weight=weights
    )
    fit_keeps_inputs(cls(), X, y, "at least one non-zero", sample_weight=np.zeros(40))
    weights = np.ones(40)
    weights[0] = np.nan
    fit_keeps_inputs(cls(), X, y, "NaN", sample_weight=weights)


def test_class_weight_zeroing_everything():
    X, y = data()
    fit_keeps_inputs(
        CASGDLogisticRegression(class_weight={1.0: 0.0, 2.0: 0.0}), X, y, "class_weight"
    )


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize(
    "params",
    [
        {"alpha": -1.0},
        {"s": 0},
        {"s": "many"},
        {"batch_size": 0},
        {"eta0": 0.0},
        {"eta0": "fast"},
        {"max_iter": 0},
        {"tol": -1e-3},
        {"n_iter_no_change": 0},
        {"learning_rate": "optimal"},
        {"precision": "int8"},
        {"n_devices": 0},
        {"device": 3},
        {"timeout": 1e15},
        {"timeout": 0.0},
        {"solver": "lbfgs"},
    ],
    ids=repr,
)
def test_out_of_range_parameters(cls, params):
    X, y = data()
    fit_keeps_inputs(cls(**params), X, y, next(iter(params)), error=InvalidParameterError)


@pytest.mark.parametrize("device", ["tpu", "cuda:banana", "cuda:99"])
def test_unknown_or_missing_device(device):
    X, y = data()
    fit_keeps_inputs(CASGDLinearRegression(device=device), X, y, "device")


@pytest.mark.parametrize("solver, eta0", [("sgd", 0.5), ("svrg", 5.0)])
def test_decay_factor_must_stay_positive(solver, eta0):
    """SVRG's decay rate is alpha over the preconditioned columns' curvature (~alpha / 11 here)."""
    X, y = data()
    estimator = CASGDLinearRegression(alpha=10.0, eta0=eta0, solver=solver)
    fit_keeps_inputs(estimator, X, y, "eta0 \\* alpha")


def test_predict_checks_its_input():
    X, y = data()
    reg = CASGDLinearRegression(max_iter=3, tol=None).fit(X, y)
    with pytest.raises(ValueError, match="3 features"):
        reg.predict(X[:, :2])
    X_bad = X.copy()
    X_bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        reg.predict(X_bad)


@pytest.mark.parametrize("class_weight", [{0: -1.0, 1: 1.0}, {0: np.inf, 1: 1.0}])
def test_negative_or_infinite_class_weight(class_weight):
    X, y = data()
    y = (y > np.median(y)).astype(int)
    estimator = CASGDLogisticRegression(class_weight=class_weight)
    fit_keeps_inputs(estimator, X, y, "class_weight must be finite and non-negative")


@pytest.mark.parametrize("solver", ["svrg", "sgd"])
def test_values_whose_squares_overflow_float64(solver):
    """1e200 fits no statistic of X: a clear error, not NaN steps or a step of 0."""
    X, y = data()
    X[:, 2] *= 1e200
    for precision in ["fp32", "fp64"]:
        estimator = CASGDLinearRegression(solver=solver, precision=precision)
        fit_keeps_inputs(estimator, X, y, "overflow float64")


@pytest.mark.parametrize(
    "precision, wider", [("fp16", "'fp64' or 'fp32' or 'bf16'"), ("fp32", "'fp64'")]
)
def test_range_error_names_only_wider_precisions(precision, wider):
    """The advice of a range error names the precisions that hold X (not fp32 to fp32)."""
    X, y = data()
    X[0, 1] = 1e6 if precision == "fp16" else 1e39
    fit_keeps_inputs(
        CASGDLinearRegression(solver="sgd", precision=precision), X, y, f"precision={wider}\\."
    )


@pytest.mark.parametrize("solver", ["svrg", "sgd"])
def test_auto_step_where_the_penalty_outweighs_the_loss(solver):
    """Tiny sample weights leave the penalty alone: eta0="auto" still takes a valid step.

    Before, 1 / (L + alpha) rounded to 1 / alpha and the fit refused its own
    step ("eta0 * alpha = 1 >= 1"); the optimum is then within rounding of 0.
    """
    X, y = data()
    weight = np.full(X.shape[0], 1e-30)
    estimator = CASGDLogisticRegression(solver=solver).fit(X, y, sample_weight=weight)
    # the steps' decay rate: alpha, or alpha / min D^2 under SVRG's preconditioning
    decay_alpha = estimator._step_plan.decay_alpha
    assert estimator.fit_stats_["eta0"] * decay_alpha <= 0.5 + 1e-12
    assert np.abs(estimator.coef_).max() < 1e-24


def test_step_too_large_for_alpha_names_the_solver_it_applies_to():
    X, y = data()
    with pytest.raises(ValueError, match=r"eta0 \* alpha = 2 >= 1: the L2 decay"):
        CASGDLogisticRegression(solver="sgd", eta0=2.0, alpha=1.0).fit(X, y)
    # Under SVRG the decay is alpha / min D^2, near the curvature 1/4 for a large alpha.
    with pytest.raises(ValueError, match="SVRG's preconditioned columns"):
        CASGDLogisticRegression(solver="svrg", eta0=10.0, alpha=100.0).fit(X, y)


def test_auto_step_keeps_a_strong_penalty_finite_over_s_steps():
    """A step near 1 / alpha left a decay factor near 0, and s of them underflowed.

    At alpha=1000 the auto step was 1 / (L + alpha), a decay factor 1 - eta0 *
    alpha of 1.4e-3 per step here; 32 steps of it (5e-92) underflow float32,
    and the fit ended in NaN, reported as divergence. The step now keeps the
    factor at 1/2, as the step's growth does.
    """
    rng = np.random.default_rng(0)
    X = rng.standard_normal((200, 5))
    y = (X[:, 0] > 0).astype(int)
    params = dict(alpha=1000.0, solver="sgd", s=32, batch_size=4, precision="fp32")
    estimator = CASGDLogisticRegression(random_state=0, **params)
    with warnings.catch_warnings():  # plain SGD settles near the optimum, here within tol's gap
        warnings.simplefilter("ignore", ConvergenceWarning)
        estimator.fit(X, y)
    assert estimator.fit_stats_["eta0"] * 1000.0 == pytest.approx(0.5)
    reference = LogisticRegression(C=1.0 / (1000.0 * X.shape[0])).fit(X, y)
    # within plain SGD's settling distance (0.6 % here) of lbfgs
    scale = np.abs(reference.coef_).max()
    np.testing.assert_allclose(estimator.coef_, reference.coef_, atol=2e-2 * scale)


@pytest.mark.parametrize(
    "s, eta0_times_alpha",
    [
        (64, 0.99),  # C_64 = 1e-128: the user's constant step
        (200, 0.5),  # C_200 = 6e-61: the auto step's largest factor, 1/2
    ],
)
def test_a_long_outer_iteration_does_not_underflow_its_decay(s, eta0_times_alpha):
    """s steps of decay factor f make C_s = f^s, which the recurrence divides by.

    Where f^s fell below float32's range (s=64 at eta0 * alpha = 0.99,
    s=200 at the auto step's 1/2) the fit ended in NaN and said "SGD
    diverged ... the step size is too large"; the same fit in float64 (or
    with s=1) was fine. The engine now takes at most the steps per outer
    iteration whose C_s float32 holds, which leaves the iterates as they
    were: the float32 fit matches plain SGD (s=1) in float64.
    """
    rng = np.random.default_rng(0)
    X = rng.standard_normal((4000, 5))
    y = X @ rng.standard_normal(5) + rng.standard_normal(4000)
    alpha = 100.0
    params = dict(
        alpha=alpha,
        eta0=eta0_times_alpha / alpha,
        learning_rate="constant",
        solver="sgd",
        batch_size=4,
        max_iter=1,
        tol=None,
        random_state=0,
    )
    fit = CASGDLinearRegression(s=s, precision="fp32", **params).fit(X, y)
    reference = CASGDLinearRegression(s=1, precision="fp64", **params).fit(X, y)
    assert 1 < fit.fit_stats_["s"] < s
    assert (1.0 - eta0_times_alpha) ** fit.fit_stats_["s"] >= 2.0**-48
    scale = np.abs(reference.coef_).max()
    np.testing.assert_allclose(fit.coef_, reference.coef_, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("batch_size", ["auto", 8])
def test_weights_that_round_to_zero_and_alpha_that_overflows_name_the_cause(cls, batch_size):
    """Both used to end as "The fit overflowed" with figures that did not matter."""
    X, y = data()
    estimator = cls(batch_size=batch_size, precision="fp32", random_state=0)
    fit_keeps_inputs(
        estimator, X, y, r"sample_weight.*1e-300.*rounds to 0", sample_weight=np.full(40, 1e-300)
    )
    fit_keeps_inputs(cls(alpha=1e300, batch_size=batch_size), X, y, r"alpha=1e\+300 is beyond")
    # float64 steps represent both: the fits run (coefficients 0 to working precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        tiny = cls(precision="fp64", batch_size=batch_size)
        tiny.fit(X, y, sample_weight=np.full(40, 1e-300))
    # A stall at fp64's rounding advises a larger tol, not the precision it ran in.
    assert not any("or precision='fp64'" in str(w.message) for w in caught)
    strong = cls(precision="fp64", alpha=1e300, batch_size=batch_size).fit(X, y)
    assert np.all(np.abs(tiny.coef_) < 1e-12) and np.all(np.abs(strong.coef_) < 1e-12)
