"""The estimators inside scikit-learn's tooling, and what fit promises around it."""

import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import Ridge
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression, CASGDPoissonRegressor
from sklearn_casgd.datasets import make_glm_data


@pytest.fixture(scope="module")
def multiclass():
    X, y, _ = make_glm_data("multinomial", 600, 8, signal=3.0, random_state=0)
    return 10 * X + 3, np.array(["ant", "bee", "cat"])[y]


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_pipeline_grid_search(multiclass, n_jobs):
    X, y = multiclass
    pipe = make_pipeline(StandardScaler(), CASGDLogisticRegression(random_state=0))
    search = GridSearchCV(
        pipe,
        {"casgdlogisticregression__alpha": [1e-4, 1e-2], "casgdlogisticregression__s": [1, 4]},
        cv=3,
        n_jobs=n_jobs,
    ).fit(X, y)
    assert search.best_score_ > 0.7
    assert set(search.predict(X)) <= {"ant", "bee", "cat"}
    assert search.best_estimator_[-1].fit_stats_["s"] in (1, 4)


def test_cross_val_score_regressors():
    X, y, _ = make_glm_data("poisson", 500, 5, random_state=0)
    scores = cross_val_score(CASGDPoissonRegressor(random_state=0), X, y, cv=3)
    assert np.all(scores > 0.3)
    X, y, _ = make_glm_data("linear", 500, 5, noise=0.1, random_state=0)
    scores = cross_val_score(CASGDLinearRegression(random_state=0), X, y, cv=3)
    assert np.all(scores > 0.9)


def test_clone_and_pickle_round_trip(multiclass):
    X, y = multiclass
    clf = CASGDLogisticRegression(s=4, precision="bf16", random_state=0).fit(X, y)
    fresh = clone(clf)
    assert not hasattr(fresh, "coef_") and fresh.get_params() == clf.get_params()
    loaded = pickle.loads(pickle.dumps(clf))
    np.testing.assert_array_equal(loaded.predict_proba(X), clf.predict_proba(X))
    assert loaded.fit_stats_ == clf.fit_stats_
    assert isinstance(loaded.coef_, np.ndarray)


def test_shapes_and_probabilities(multiclass):
    X, y = multiclass
    clf = CASGDLogisticRegression(random_state=0).fit(X, y)
    assert clf.coef_.shape == (3, 8) and clf.intercept_.shape == (3,)
    proba = clf.predict_proba(X[:5])
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    np.testing.assert_allclose(np.log(proba), clf.predict_log_proba(X[:5]))
    np.testing.assert_array_equal(clf.classes_[proba.argmax(1)], clf.predict(X[:5]))
    binary = CASGDLogisticRegression(random_state=0).fit(X, y == "bee")
    assert binary.coef_.shape == (1, 8) and binary.decision_function(X).shape == (600,)
    np.testing.assert_allclose(binary.predict_log_proba(X[:5]), np.log(binary.predict_proba(X[:5])))


def test_same_seed_draws_same_batches_for_every_precision():
    """Different batches would move fp32 and fp64 far more than rounding does."""
    X, y, _ = make_glm_data("logistic", 500, 6, random_state=0)
    params = dict(random_state=3, max_iter=4, tol=None, batch_size=8)
    fp64 = CASGDLogisticRegression(precision="fp64", **params).fit(X, y)
    fp32 = CASGDLogisticRegression(precision="fp32", s=4, **params).fit(X, y)
    other_seed = CASGDLogisticRegression(precision="fp64", **{**params, "random_state": 4})
    other_seed.fit(X, y)
    np.testing.assert_allclose(fp32.coef_, fp64.coef_, atol=1e-5)
    assert np.abs(other_seed.coef_ - fp64.coef_).max() > 1e-3


def test_refit_is_reproducible_and_warm_start_continues():
    X, y, _ = make_glm_data("linear", 300, 4, random_state=0)
    # A fixed batch: Newton epochs (batch_size="auto" on this small problem) would
    # reach the optimum in the first fit, leaving the warm start nothing to show.
    reg = CASGDLinearRegression(batch_size=16, random_state=0, max_iter=3, tol=None)
    first = reg.fit(X, y).coef_.copy()
    np.testing.assert_array_equal(reg.fit(X, y).coef_, first)
    first_loss = reg.loss_curve_[-1]
    reg.set_params(warm_start=True)
    reg.fit(X, y)
    # A warm restart continues from the previous coefficients, not from zero,
    # towards the optimum.
    assert np.abs(reg.coef_ - first).max() < np.abs(first).max()
    assert reg.loss_curve_[0] <= first_loss
    exact = Ridge(alpha=reg.alpha * X.shape[0]).fit(X, y).coef_
    assert np.abs(reg.coef_ - exact).max() < 0.5 * np.abs(first - exact).max()


def _standardized_diabetes():
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    return StandardScaler().fit_transform(X), y


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_a_warm_start_far_from_the_new_optimum_is_not_called_converged(precision):
    """warm_start after y moved by 1e6: the stopping test must not loosen.

    Its bound was tol times the gradient where the fit started: from the
    old optimum, y + 1e6 puts 1e6 in the intercept's gradient, so the bound
    became 10, and the fit reported convergence at a gradient of 8.6
    (float64 too; on Gaussian data its coefficients were off by 5). The
    bound is now scaled at the
    cold start, wherever the fit starts: the warm fit ends where a cold one
    does.
    """
    X, y = _standardized_diabetes()
    # batch_size 32: both fits' steps reach the flat direction of s1 and s2 alike.
    params = dict(precision=precision, batch_size=32, random_state=0)
    warm = CASGDLinearRegression(**params).fit(X, y)
    warm.set_params(warm_start=True).fit(X, y + 1e6)
    cold = CASGDLinearRegression(**params).fit(X, y + 1e6)
    assert warm.fit_stats_["converged"] and cold.fit_stats_["converged"]
    assert warm.fit_stats_["gradient_max"] <= 2 * cold.fit_stats_["gradient_max"] + 1e-3
    # Both within the gradient test of the optimum (s1 and s2 are collinear).
    scale = np.abs(cold.coef_).max()
    np.testing.assert_allclose(warm.coef_, cold.coef_, rtol=0, atol=1e-4 * scale)
    assert warm.intercept_ == pytest.approx(cold.intercept_, abs=1e-4 * scale)


def test_a_warm_start_near_the_optimum_keeps_the_cold_starts_test():
    """A regularization path (warm_start, alpha up 10 %) in float32 on raw diabetes y.

    The bound was tol times the gradient at the start, and at least tol:
    from the previous optimum that is tol itself, absolute, 40x stricter
    than the same fit's cold start (y in the hundreds gives a cold gradient
    of ~40), below float32's reach. The warm fit then ran 175 epochs until
    the stall and warned. Now both measure the bound at the cold start, and
    the warm fit ends in fewer epochs than the cold one, as close to the
    optimum.
    """
    X, y = _standardized_diabetes()
    # Minibatch SVRG (a fixed batch): Newton epochs take one epoch from either start.
    estimator = CASGDLinearRegression(
        alpha=1e-3, precision="fp32", batch_size=32, random_state=0
    ).fit(X, y)
    cold_epochs = estimator.n_iter_
    estimator.set_params(warm_start=True, alpha=1.1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        estimator.fit(X, y)
    assert estimator.fit_stats_["converged"]
    assert estimator.n_iter_ < cold_epochs
    exact = Ridge(alpha=1.1e-3 * X.shape[0]).fit(X, y)

    def objective(coef, intercept):
        residual = X @ coef + intercept - y
        return 0.5 * np.mean(residual**2) + 0.5 * 1.1e-3 * coef @ coef

    best = objective(exact.coef_, exact.intercept_)
    assert objective(estimator.coef_, estimator.intercept_) - best <= 1e-7 * best


def test_fit_leaves_torch_global_state_alone():
    X, y, _ = make_glm_data("logistic", 300, 4, random_state=0)
    threads = torch.get_num_threads()
    dtype = torch.get_default_dtype()
    rng_state = torch.get_rng_state()
    CASGDLogisticRegression(s=4, precision="bf16", random_state=0).fit(X, y)
    CASGDLogisticRegression(random_state=None, max_iter=2).fit(X, y)
    assert torch.get_num_threads() == threads
    assert torch.get_default_dtype() == dtype
    assert torch.equal(torch.get_rng_state(), rng_state)


@pytest.mark.parametrize("solver", ["svrg", "sgd"])
def test_convergence_warning_names_the_gradient(solver):
    X, y, _ = make_glm_data("logistic", 400, 5, random_state=0)
    with pytest.warns(ConvergenceWarning, match="full gradient's largest entry is .* after 2"):
        clf = CASGDLogisticRegression(solver=solver, max_iter=2, random_state=0).fit(X, y)
    assert not clf.fit_stats_["converged"] and clf.fit_stats_["gradient_max"] > clf.tol
    assert clf.fit_stats_["solver"] == solver


def test_convergence_warning_and_fit_stats():
    X, y, _ = make_glm_data("logistic", 400, 5, random_state=0)
    with pytest.warns(ConvergenceWarning, match="after 2 epochs"):
        clf = CASGDLogisticRegression(s=1, max_iter=2, random_state=0).fit(X, y)
    stats = clf.fit_stats_
    b = stats["batch_size"]
    assert clf.n_iter_ == 2 and clf.t_ == 2 * int(np.ceil(400 / b))
    assert stats["n_outer"] == clf.t_ and stats["s"] == 1 and stats["world_size"] == 1
    assert stats["n_allreduce"] == 0 and stats["allreduce_bytes"] == 0
    assert stats["device"] == "cpu" and stats["train_seconds"] > 0
    assert len(clf.loss_curve_) == 2
    s8 = CASGDLogisticRegression(s=8, max_iter=2, tol=None, random_state=0).fit(X, y)
    assert s8.fit_stats_["batch_size"] == b  # s does not change the batch
    assert s8.fit_stats_["n_outer"] == 2 * int(np.ceil(np.ceil(400 / b) / 8))


@pytest.mark.parametrize("family", ["logistic", "multinomial", "linear", "poisson"])
@pytest.mark.parametrize("solver", ["svrg", "sgd"])
def test_divergence_raises_and_keeps_previous_coefficients(family, solver):
    """An absurd step is a ValueError for every family, not garbage coefficients."""
    estimator_class = {
        "logistic": CASGDLogisticRegression,
        "multinomial": CASGDLogisticRegression,
        "linear": CASGDLinearRegression,
        "poisson": CASGDPoissonRegressor,
    }[family]
    X, y, _ = make_glm_data(family, 300, 4, random_state=0)
    estimator = estimator_class(solver=solver, alpha=0.0, random_state=0, max_iter=20).fit(X, y)
    before = estimator.coef_.copy()
    estimator.set_params(eta0=1e8, learning_rate="constant", warm_start=True, tol=None)
    with pytest.raises(ValueError, match="too large"):
        estimator.fit(X, y)
    np.testing.assert_array_equal(estimator.coef_, before)


def test_sample_weight_scales_like_inverse_alpha():
    """Weights c * 1 with alpha equal ones with alpha / c, step size held fixed."""
    X, y, _ = make_glm_data("linear", 200, 3, random_state=0)
    params = dict(
        random_state=0, tol=None, max_iter=5, eta0=0.01, learning_rate="constant", precision="fp64"
    )
    weighted = CASGDLinearRegression(alpha=0.2, **params)
    weighted.set_params(eta0=0.01 / 4)
    weighted.fit(X, y, sample_weight=np.full(200, 4.0))
    plain = CASGDLinearRegression(alpha=0.05, **params).fit(X, y)
    np.testing.assert_allclose(weighted.coef_, plain.coef_, rtol=1e-10)


def _read_only(array):
    array = array.copy()
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("precision", ["fp64", "bf16"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize(
    "cls, family",
    [
        (CASGDLogisticRegression, "logistic"),
        (CASGDLinearRegression, "linear"),
        (CASGDPoissonRegressor, "poisson"),
    ],
)
def test_read_only_inputs_fit_silently_and_as_writable_ones(cls, family, sparse, precision):
    """Read-only X, y and sample_weight (pandas columns, memmaps) give the same fit, no warning."""
    X, y, _ = make_glm_data(family, n_samples=60, n_features=4, random_state=0)
    weight = np.linspace(0.5, 1.5, 60)
    if sparse:
        X = sp.csr_matrix(np.where(np.abs(X) < 0.3, 0.0, X))
        frozen_X = X.copy()
        frozen_X.data = _read_only(frozen_X.data)
    else:
        frozen_X = _read_only(X)
    frozen_y, frozen_weight = _read_only(y), _read_only(weight)
    params = dict(precision=precision, max_iter=3, tol=None, random_state=0, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frozen = cls(**params).fit(frozen_X, frozen_y, sample_weight=frozen_weight)
    writable = cls(**params).fit(X, y, sample_weight=weight)
    np.testing.assert_array_equal(frozen.coef_, writable.coef_)
    np.testing.assert_array_equal(frozen.intercept_, writable.intercept_)


def test_read_only_targets_meet_no_torch_warning_in_a_fresh_process():
    """torch warns once per process about a read-only array it is given; only a fresh one shows it.

    The engine copies the targets and weights (a pandas column's values are
    read-only): this failed with the warning before.
    """
    code = (
        "import numpy as np\n"
        "from sklearn_casgd import CASGDLinearRegression\n"
        "X = np.random.default_rng(0).standard_normal((50, 3))\n"
        "y = X @ [1.0, 2.0, 3.0]\n"
        "y.flags.writeable = False\n"
        "weight = np.ones(50)\n"
        "weight.flags.writeable = False\n"
        "CASGDLinearRegression(precision='fp64', max_iter=2, tol=None).fit(X, y, weight)\n"
    )
    completed = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
