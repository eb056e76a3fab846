"""partial_fit and the solver state: continuing a fit takes exactly the steps of one long fit.

References are float64 identities: chunks walked in order equal one epoch
of ``fit`` over their concatenation, and k calls on the same rows equal
``fit`` with ``max_iter=k``; both need the step count, the step size and
the batch-order generator to carry over between calls.
"""

import copyreg
import io
import pickle
import re
import warnings

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer, load_diabetes
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import (
    CASGDLinearRegression,
    CASGDLogisticRegression,
    PickleVersionWarning,
)
from sklearn_casgd._engine.solver_state import SolverState, StepSchedule
from sklearn_casgd._engine.stepsize import largest_eigenvalue, largest_row_smoothness
from sklearn_casgd._registry import FAMILIES
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective

EXACT = dict(precision="fp64", device="cpu", random_state=0, tol=None, compile=False)


def _fit_kwargs(name):
    return (
        {"classes": np.unique(_chunked_data(name)[1])}
        if name in ("logistic", "multinomial")
        else {}
    )


def _chunked_data(name, n_chunks=4, chunk=96):
    """Chunks that are row permutations of one another.

    Every chunk then has the targets' mean of the whole data, so the first
    chunk's intercept start (the intercept-only fit) is the whole data's.
    """
    X, y, _ = make_glm_data(name, n_samples=chunk, n_features=5, n_classes=3, random_state=0)
    rng = np.random.default_rng(1)
    orders = [np.arange(chunk)] + [rng.permutation(chunk) for _ in range(n_chunks - 1)]
    return np.concatenate([X[o] for o in orders]), np.concatenate([y[o] for o in orders])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_chunks_equal_one_epoch_over_their_concatenation(name):
    X, y = _chunked_data(name)
    params = dict(
        EXACT,
        solver="sgd",
        shuffle=False,
        s=3,
        batch_size=16,
        eta0=0.02,
        learning_rate="invscaling",
    )
    estimator = FAMILIES[name].estimator
    full = estimator(max_iter=1, **params).fit(X, y)
    chunked = estimator(**params)
    for lo in range(0, X.shape[0], 96):
        chunked.partial_fit(X[lo : lo + 96], y[lo : lo + 96], **_fit_kwargs(name))
    np.testing.assert_allclose(chunked.coef_, full.coef_, rtol=0, atol=1e-12)
    np.testing.assert_allclose(chunked.intercept_, full.intercept_, rtol=0, atol=1e-12)
    assert chunked.t_ == full.t_ == X.shape[0] // 16
    assert chunked.solver_state_["steps"] == full.solver_state_["steps"]


def test_repeated_partial_fit_equals_fit_on_real_data():
    """Shuffled epochs: the batch-order generator and the step count carry over."""
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    params = dict(EXACT, solver="sgd", s=4, batch_size=32, eta0=0.1, learning_rate="invscaling")
    full = CASGDLogisticRegression(max_iter=6, **params).fit(X, y)
    chunked = CASGDLogisticRegression(**params)
    for _ in range(6):
        chunked.partial_fit(X, y, classes=[0, 1])
    np.testing.assert_allclose(chunked.coef_, full.coef_, rtol=0, atol=1e-12)
    np.testing.assert_allclose(chunked.intercept_, full.intercept_, rtol=0, atol=1e-12)
    assert chunked.solver_state_["epochs"] == full.solver_state_["epochs"] == 6
    assert chunked.solver_state_["generator"] == full.solver_state_["generator"]


def test_svrg_on_chunks_keeps_its_step_from_growing():
    """Each chunk's epoch lowers that chunk's objective: no evidence for a longer step.

    With growth, 20 passes over 10 chunks of breast_cancer grew the step 160x
    and ended 1.7 (relative) above the optimum's objective; without, 0.13.
    """
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    estimator = CASGDLogisticRegression(alpha=1e-3, **EXACT)
    for _ in range(3):
        for rows in np.array_split(np.arange(X.shape[0]), 10):
            estimator.partial_fit(X[rows], y[rows], classes=[0, 1])
    assert estimator.solver_state_["eta"] <= estimator.fit_stats_["eta0"]
    # fit, on the same rows and batch size (minibatch SVRG, not Newton epochs), grows it.
    batch_size = estimator.fit_stats_["batch_size"]
    fitted = CASGDLogisticRegression(alpha=1e-3, max_iter=5, batch_size=batch_size, **EXACT)
    fitted.fit(X, y)
    assert fitted.fit_stats_["eta"] > fitted.fit_stats_["eta0"]


def test_first_chunk_step_treats_the_chunk_as_a_sample():
    """partial_fit's eta0 is 1 / L(b) of a stream: (b-1)/b L + L_max/b, not the chunk's own L(b).

    A chunk barely larger than a batch has L(b) close to its full-batch L,
    too long a step for rows to come (one-row chunks of linnerud diverged).
    """
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X)[:40]
    params = dict(EXACT, solver="sgd", alpha=0.0)
    chunk = CASGDLinearRegression(**params).partial_fit(X, y[:40]).fit_stats_["eta0"]
    whole = CASGDLinearRegression(max_iter=1, **params).fit(X, y[:40]).fit_stats_["eta0"]
    full = largest_eigenvalue(X, np.ones(40), True)
    largest = largest_row_smoothness(X, np.ones(40), True)
    assert chunk == pytest.approx(1.0 / (31 / 32 * full + largest / 32), rel=1e-12)
    assert chunk < whole


def test_pickled_estimator_is_a_checkpoint():
    """Pickle mid-way, resume in the copy: the same coefficients as the uninterrupted run."""
    X, y = load_diabetes(return_X_y=True)
    params = dict(EXACT, solver="svrg", s=2, batch_size=32)
    straight = CASGDLinearRegression(**params)
    for _ in range(4):
        straight.partial_fit(X, y)
    first = CASGDLinearRegression(**params)
    for _ in range(2):
        first.partial_fit(X, y)
    resumed = pickle.loads(pickle.dumps(first))
    for _ in range(2):
        resumed.partial_fit(X, y)
    np.testing.assert_array_equal(resumed.coef_, straight.coef_)
    assert resumed.solver_state_ == straight.solver_state_


def test_a_pickle_names_no_internal_module_but_the_estimators():
    """Internal modules may move between versions; a fitted estimator's pickle names none."""
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    for solver in ("svrg", "sgd"):
        fitted = CASGDLogisticRegression(**EXACT, solver=solver, max_iter=2).fit(X, y)
        data = pickle.dumps(fitted)
        assert set(re.findall(rb"sklearn_casgd\.[\w.]*", data)) == {
            b"sklearn_casgd._estimators._logistic"
        }
        loaded = pickle.loads(data)
        for name, value in vars(fitted._step_plan).items():
            np.testing.assert_array_equal(getattr(loaded._step_plan, name), value)
        loaded.partial_fit(X, y)  # the restored step plan continues the fit


def _pickled_by_an_earlier_version(estimator, dropped):
    """The bytes an earlier version wrote: no version key, without attributes it lacked."""
    state = estimator.__getstate__()
    for name in ("_sklearn_casgd_version", *dropped):
        del state[name]

    class EarlierPickler(pickle.Pickler):
        def reducer_override(self, obj):
            if obj is estimator:
                return copyreg.__newobj__, (type(obj),), state
            return NotImplemented

    buffer = io.BytesIO()
    EarlierPickler(buffer).dump(estimator)
    return buffer.getvalue()


def test_an_estimator_pickled_by_an_earlier_version_predicts_and_warns():
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    fitted = CASGDLogisticRegression(**EXACT, batch_size=64, max_iter=3).fit(X, y)
    old = _pickled_by_an_earlier_version(
        fitted, ["early_stopping", "validation_fraction", "_step_plan"]
    )
    with pytest.warns(PickleVersionWarning, match=r"before 0\.1\.0.*early_stopping"):
        loaded = pickle.loads(old)
    np.testing.assert_array_equal(loaded.predict_proba(X), fitted.predict_proba(X))
    assert "CASGDLogisticRegression(" in repr(loaded)
    assert loaded.get_params()["early_stopping"] is False  # the default
    with pytest.raises(ValueError, match="pickled by another version"):
        loaded.partial_fit(X, y)
    np.testing.assert_array_equal(loaded.fit(X, y).coef_, fitted.coef_)  # a new fit works
    with warnings.catch_warnings():
        warnings.simplefilter("error", PickleVersionWarning)  # this version's own: silent
        assert pickle.loads(pickle.dumps(fitted)).get_params() == fitted.get_params()


def test_solver_state_round_trips_and_rejects_foreign_dicts():
    state = SolverState(steps=7, epochs=2, eta=0.3, generator=b"\x01\x02", no_progress=1)
    assert SolverState.from_state_dict(state.state_dict()) == state
    with pytest.raises(ValueError, match="Not a solver state"):
        SolverState.from_state_dict({"steps": 1})


@pytest.mark.parametrize(
    "change, named",
    [
        ({"steps": -1}, "steps=-1"),
        ({"steps": 1e30}, "steps=1e+30"),
        ({"epochs": True}, "epochs=True"),
        ({"eta": -1.0}, "eta=-1.0"),
        ({"eta": float("nan")}, "eta=nan"),
        ({"eta": float("inf")}, "eta=inf"),
        ({"generator": "seed"}, "generator of type str"),
        ({"best_loss": float("nan")}, "best_loss=nan"),
        ({"any_kept": 1}, "any_kept=1"),
    ],
)
def test_a_bad_solver_state_is_a_clear_error_before_any_work(change, named):
    """A state from a user's hands or a damaged pickle: named, and the estimator unchanged."""
    X, y, _ = make_glm_data("linear", n_samples=100, n_features=3, random_state=0)
    estimator = CASGDLinearRegression(**EXACT, solver="svrg", batch_size=20).partial_fit(X, y)
    coef = estimator.coef_.copy()
    estimator.solver_state_ = {**estimator.solver_state_, **change}
    with pytest.raises(ValueError, match=r"solver_state_ cannot be continued.*" + re.escape(named)):
        estimator.partial_fit(X, y)
    np.testing.assert_array_equal(estimator.coef_, coef)
    assert estimator.t_ == 5 and isinstance(estimator.t_, int)


def test_fit_after_partial_fit_starts_over():
    """fit resets the schedule (as scikit-learn's SGD): t_ counts the new fit's steps only."""
    X, y, _ = make_glm_data("linear", n_samples=200, n_features=4, random_state=0)
    params = dict(EXACT, solver="sgd", s=2, batch_size=20, max_iter=3)
    reference = CASGDLinearRegression(**params).fit(X, y)
    estimator = CASGDLinearRegression(**params).partial_fit(X, y).partial_fit(X, y)
    estimator.fit(X, y)
    assert estimator.t_ == reference.t_ == 30
    np.testing.assert_array_equal(estimator.coef_, reference.coef_)


def test_partial_fit_float32_chunk_gives_float32_coefficients():
    X, y, _ = make_glm_data("logistic", n_samples=128, n_features=3, random_state=0)
    estimator = CASGDLogisticRegression(random_state=0, device="cpu")
    estimator.partial_fit(X.astype(np.float32), y, classes=[0, 1])
    assert estimator.coef_.dtype == np.float32
    assert estimator.n_iter_ == 1


def test_partial_fit_bad_input_is_a_clear_error():
    X, y, _ = make_glm_data("multinomial", n_samples=90, n_features=3, n_classes=3, random_state=0)
    X_before, y_before = X.copy(), y.copy()
    with pytest.raises(ValueError, match="classes must be passed on the first call"):
        CASGDLogisticRegression().partial_fit(X, y)
    with pytest.raises(ValueError, match="not in classes"):
        CASGDLogisticRegression().partial_fit(X, y, classes=[0, 1])
    with pytest.raises(ValueError, match="not supported by partial_fit"):
        CASGDLogisticRegression(class_weight="balanced").partial_fit(X, y, classes=[0, 1, 2])
    estimator = CASGDLogisticRegression(random_state=0, device="cpu")
    estimator.partial_fit(X, y, classes=[0, 1, 2])
    with pytest.raises(ValueError, match="not the same as on the previous fit"):
        estimator.partial_fit(X, y, classes=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="features"):
        estimator.partial_fit(X[:, :2], y)
    with pytest.raises(ValueError, match="NaN"):
        estimator.partial_fit(np.where(X > 1, np.nan, X), y)
    np.testing.assert_array_equal(X, X_before)
    np.testing.assert_array_equal(y, y_before)


def test_partial_fit_on_two_ranks_equals_one(tmp_path):
    """The solver state travels to spawned ranks and back (fp64, gloo on 127.0.0.1)."""
    X, y = _chunked_data("poisson", n_chunks=2)
    params = dict(EXACT, solver="svrg", s=2, batch_size=16)
    estimators = [
        FAMILIES["poisson"].estimator(n_devices=n_devices, **params) for n_devices in (1, 2)
    ]
    for estimator in estimators:
        for lo in range(0, X.shape[0], 96):
            estimator.partial_fit(X[lo : lo + 96], y[lo : lo + 96])
    one, two = estimators
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)
    assert two.solver_state_["steps"] == one.solver_state_["steps"]
    assert two.fit_stats_["world_size"] == 2


def test_ragged_batch_takes_its_share_of_the_step():
    schedule = StepSchedule("invscaling", 0.5, power_t=1.0)
    assert schedule.step_sizes(1, [16, 16, 4], 16) == [0.25, 0.5 / 3, 0.5 / 4 * 4 / 16]


def _scaled_breast_cancer():
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), y


@pytest.mark.parametrize("solver", ["sgd", "svrg"])
def test_partial_fit_after_set_params_alpha_takes_the_new_alpha(solver):
    """The step and the decay follow a new alpha, as sklearn's partial_fit honours it.

    Before, the first call's step plan was kept: plain SGD at alpha=10 ran
    with a step whose decay factor 1 - eta0 * alpha was negative (a fresh
    fit refuses it), and after the 60 passes below plain SGD was 0.11 from
    the optimum (now 0.010), SVRG 4.8e-3 (then 4e-7; 1.4e-5 since the
    initial step keeps the decay factor 1 - eta0 * alpha at 1/2 or more).
    """
    X, y = _scaled_breast_cancer()
    first, rest = np.arange(100), np.arange(100, X.shape[0])
    estimator = CASGDLogisticRegression(alpha=1e-4, solver=solver, **EXACT)
    estimator.partial_fit(X[first], y[first], classes=[0, 1])
    estimator.set_params(alpha=10.0)
    estimator.partial_fit(X[rest], y[rest])
    # The step a first call with alpha=10 chooses from the same first chunk
    # (and, for SVRG, in the same preconditioned coordinates).
    fresh = CASGDLogisticRegression(alpha=10.0, solver=solver, **EXACT)
    fresh_plan = fresh.partial_fit(X[first], y[first], classes=[0, 1])._step_plan
    if solver == "sgd":
        assert estimator.fit_stats_["eta0"] == fresh.fit_stats_["eta0"]  # bit for bit
    else:
        scale = estimator._step_plan.column_scale
        assert estimator._step_plan.decay_alpha == 10.0 / np.min(scale**2)
        assert fresh_plan.decay_alpha != estimator._step_plan.decay_alpha  # its own D
    assert estimator.fit_stats_["eta0"] * estimator._step_plan.decay_alpha < 1.0
    # It then goes to the optimum of the new alpha (scikit-learn's lbfgs).
    for _ in range(60):
        estimator.partial_fit(X, y)
    reference = LogisticRegression(C=1.0 / (10.0 * X.shape[0]), tol=1e-12, max_iter=10_000)
    reference.fit(X, y)
    tolerance = 3e-2 if solver == "sgd" else 5e-5  # plain SGD settles near it
    np.testing.assert_allclose(estimator.coef_, reference.coef_, atol=tolerance)


def test_partial_fit_after_set_params_eta0_takes_the_new_step():
    X, y = _scaled_breast_cancer()
    params = dict(EXACT, solver="sgd", learning_rate="constant")
    estimator = CASGDLogisticRegression(eta0=0.05, **params)
    estimator.partial_fit(X[:100], y[:100], classes=[0, 1])
    unchanged = estimator._step_plan
    estimator.partial_fit(X[100:200], y[100:200])
    assert estimator._step_plan is unchanged  # same parameters: the same plan
    estimator.set_params(eta0=0.01).partial_fit(X[200:300], y[200:300])
    assert estimator.fit_stats_["eta0"] == estimator.solver_state_["eta"] == 0.01
    # From the user's step to "auto": the step comes from the rows at hand, as a stream.
    estimator.set_params(eta0="auto").partial_fit(X[300:400], y[300:400])
    auto = CASGDLogisticRegression(**params).partial_fit(X[300:400], y[300:400], classes=[0, 1])
    assert estimator.fit_stats_["eta0"] == auto.fit_stats_["eta0"]
    # A step too long for the new alpha is refused, as fit refuses it.
    estimator.set_params(eta0=0.5, alpha=3.0)
    with pytest.raises(ValueError, match=r"eta0 \* alpha = 1.5 >= 1"):
        estimator.partial_fit(X[400:], y[400:])


@pytest.mark.parametrize("wide", [1.0, 1e4])
def test_a_column_unseen_in_the_first_chunk_still_learns(wide):
    """A one-hot column all 0 in the first chunk, beside a column ``wide`` times wider.

    SVRG's preconditioner comes from the first chunk, where the column has no
    data. It took the widest column's scale: beside a column 1e4 wider its
    coefficient stayed 0 over ten passes. It now takes the median column's
    scale.
    """
    rng = np.random.default_rng(0)
    n, chunk = 6000, 1000
    X = rng.standard_normal((n, 6))
    rare = (rng.random(n) < 0.3).astype(float)
    rare[:chunk] = 0.0
    X = np.c_[X, rare]
    y = (X[:, 0] + 2.0 * rare - 0.6 + rng.logistic(size=n) > 0).astype(int)
    X[:, 1] *= wide
    alpha = 1e-3
    estimator = CASGDLogisticRegression(alpha=alpha, random_state=0)
    estimator.partial_fit(X[:chunk], y[:chunk], classes=[0, 1])
    for _ in range(10):
        for lo in range(chunk, n, chunk):
            estimator.partial_fit(X[lo : lo + chunk], y[lo : lo + chunk])
    reference = LogisticRegression(C=1.0 / (alpha * n), tol=1e-12, max_iter=100_000).fit(X, y)
    assert estimator.coef_[0, -1] == pytest.approx(reference.coef_[0, -1], rel=0.1)
    reached = glm_objective("logistic", X, y, estimator.coef_, estimator.intercept_, alpha)
    best = glm_objective("logistic", X, y, reference.coef_, reference.intercept_, alpha)
    assert reached - best <= 2e-2 * best  # SVRG on chunks settles near the optimum


def test_a_stream_of_single_rows_takes_one_step_per_row():
    """batch_size="auto" is bounded by the first chunk's rows: one row, then a step per row,
    as scikit-learn's SGD takes (numpy SGD on the same rows, float64)."""
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X)[:40]
    y = y[:40] / 100.0
    est = CASGDLinearRegression(
        solver="sgd", learning_rate="constant", eta0=0.01, alpha=0.0, precision="fp64",
        shuffle=False, random_state=0,
    )  # fmt: skip
    for i in range(40):
        est.partial_fit(X[i : i + 1], y[i : i + 1])
    w, b = np.zeros(X.shape[1]), y[0]  # the first row's intercept start: its target
    for i in range(40):
        r = X[i] @ w + b - y[i]
        w, b = w - 0.01 * r * X[i], b - 0.01 * r
    assert est.t_ == 40 and est._step_plan.batch_size == 1
    np.testing.assert_allclose(est.coef_, w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(est.intercept_, b, rtol=0, atol=1e-12)
