"""Newton epochs: SVRG's full-batch steps preconditioned by the curvature (``curvature``)."""

import numpy as np
import pytest
import torch
from sklearn.datasets import (
    load_breast_cancer,
    load_diabetes,
    load_digits,
    load_iris,
    load_wine,
)
from sklearn.linear_model import LogisticRegression, PoissonRegressor, Ridge
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import (
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
)
from sklearn_casgd._engine import curvature as _curvature
from sklearn_casgd._engine.comm import LocalCommunicator
from sklearn_casgd._engine.curvature import CurvatureSums
from sklearn_casgd._engine.planner import MAX_NEWTON_WIDTH, plan_execution
from sklearn_casgd._engine.precision import PRESETS
from sklearn_casgd._engine.snapshot import full_pass
from sklearn_casgd._engine.state import LocalData, ModelState, Preconditioner, StepContext
from sklearn_casgd._glm.families import (
    BinomialFamily,
    MultinomialFamily,
    PoissonFamily,
    SquaredErrorFamily,
)
from sklearn_casgd._glm.penalties import Penalty


def _standardized(loader):
    X, y = loader(return_X_y=True)
    return StandardScaler().fit_transform(X), y


def _mean_loss_hessian(family, A, target, weight):
    """The exact Hessian of ``mean_i weight_i loss(A_i theta)`` in ``theta`` (autograd, float64)."""
    k = target.shape[1]

    def objective(theta):
        raw = A @ theta.reshape(k, -1).T
        return (family.loss(raw, target) * weight).mean()

    generator = torch.Generator().manual_seed(1)
    theta = torch.randn(k * A.shape[1], dtype=torch.float64, generator=generator)
    hessian = torch.autograd.functional.hessian(objective, theta)
    raw = A @ theta.reshape(k, -1).T
    return hessian, raw


def _problem(family, k, n=40, d=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, d, dtype=torch.float64, generator=generator)
    if k == 1:
        target = torch.randint(0, 3, (n, 1), generator=generator).to(torch.float64)
        target = target.clamp(max=1) if isinstance(family, BinomialFamily) else target
    else:
        target = torch.nn.functional.one_hot(torch.randint(0, k, (n,), generator=generator), k)
        target = target.to(torch.float64)
    weight = torch.rand(n, dtype=torch.float64, generator=generator) + 0.5
    return rows, target, weight


def _chunks(rows, size=16):
    return [
        (lo, min(len(rows), lo + size), rows[lo : lo + size]) for lo in range(0, len(rows), size)
    ]


@pytest.mark.parametrize(
    "family, k",
    [(BinomialFamily(), 1), (MultinomialFamily(), 3), (PoissonFamily(), 1)],
)
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("band_columns", [128, 2])
def test_curvature_sums_equal_the_exact_hessians_class_blocks(
    monkeypatch, family, k, grouped, band_columns
):
    # The sums over chunks, divided by n, are the Hessian of the mean
    # weighted loss in (coef, intercept) for one output, and its classes'
    # diagonal blocks for several; the classes' blocks from one product, or
    # one each (not grouped); the columns in one band, or in bands of 2 (5
    # columns: a ragged last band) formed below the diagonal and mirrored.
    monkeypatch.setattr(_curvature, "_BAND_COLUMNS", band_columns)
    if not grouped:
        monkeypatch.setattr(_curvature, "_PRODUCT_VALUES", 1)
    rows, target, weight = _problem(family, k)
    n, d = rows.shape
    A = torch.cat([rows, torch.ones(n, 1, dtype=torch.float64)], dim=1)
    expected, raw = _mean_loss_hessian(family, A, target, weight)

    sums = CurvatureSums(d, k, fit_intercept=True, device="cpu")
    for lo, hi, chunk in _chunks(rows):  # as the formation adds them
        curvature = family.hessian_diagonal(raw[lo:hi], target[lo:hi])
        sums.add(chunk, curvature * weight[lo:hi, None])
    size = d + 1
    for c in range(k):
        block = expected[c * size : (c + 1) * size, c * size : (c + 1) * size]
        np.testing.assert_allclose(sums.hessian(n)[c], block, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("band_columns", [128, 2])
def test_curvature_sums_without_intercept_in_bands(monkeypatch, band_columns):
    monkeypatch.setattr(_curvature, "_BAND_COLUMNS", band_columns)
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(50, 7, dtype=torch.float64, generator=generator)
    weight = torch.rand(50, dtype=torch.float64, generator=generator)
    sums = CurvatureSums(7, 1, fit_intercept=False, device="cpu")
    sums.add(rows[:20], weight[:20, None])
    sums.add(rows[20:], weight[20:, None])
    expected = rows.T @ (rows * weight[:, None]) / 50
    np.testing.assert_allclose(sums.hessian(50)[0], expected, rtol=1e-12, atol=1e-14)


def _coupled_system(fit_intercept, seed=0, k=4):
    """A multinomial's exact curvature plus a penalty (autograd), and its NewtonSystem."""
    family = MultinomialFamily()
    rows, target, weight = _problem(family, k, n=60, d=5, seed=seed)
    n, d = rows.shape
    A = torch.cat([rows, torch.ones(n, 1, dtype=torch.float64)], dim=1) if fit_intercept else rows
    hessian, raw = _mean_loss_hessian(family, A, target, weight)
    penalty = torch.rand(d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    sums = CurvatureSums(d, k, fit_intercept, "cpu", class_shift_invariant=True)
    chunks = _chunks(rows)
    for lo, hi, chunk in chunks:
        sums.add(chunk, family.hessian_diagonal(raw[lo:hi], target[lo:hi]) * weight[lo:hi, None])
        sums.products.add(family.hessian_product(raw[lo:hi], target[lo:hi]), weight[lo:hi])
    system = sums.factor(n, penalty, lambda: chunks)
    full_penalty = torch.cat([penalty, penalty.new_zeros(int(fit_intercept))])
    return hessian + torch.diag(full_penalty.repeat(k)), system


@pytest.mark.parametrize("fit_intercept", [True, False])
def test_curvature_products_equal_the_exact_hessian_times_a_direction(fit_intercept):
    # The coupled classes' curvature is never formed: its products, from
    # the rows read again in chunks and each row's softmax, are the exact
    # Hessian's (autograd, class-major) plus the penalty's diagonal.
    expected, system = _coupled_system(fit_intercept)
    k = 4
    generator = torch.Generator().manual_seed(5)
    direction = torch.randn(expected.shape[0] // k, k, dtype=torch.float64, generator=generator)
    product = (expected @ direction.T.reshape(-1)).reshape(k, -1).T
    np.testing.assert_allclose(system.products(direction), product, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fit_intercept", [True, False])
def test_conjugate_gradients_solve_the_coupled_system(fit_intercept):
    # With a forcing term of 1e-10 (a gradient of 1e-20 at most), the
    # preconditioned conjugate gradients return the exact solve on the
    # classes' differences (the curvature is singular along a common shift
    # of the intercepts; the penalty alone holds the coefficients' shift).
    expected, system = _coupled_system(fit_intercept, seed=1)
    k = 4
    generator = torch.Generator().manual_seed(6)
    gradient = torch.randn(expected.shape[0] // k, k, dtype=torch.float64, generator=generator)
    gradient = 1e-20 * (gradient - gradient.mean(dim=1, keepdim=True))
    solved = torch.linalg.pinv(expected) @ gradient.T.reshape(-1)
    direction = _curvature._conjugate_gradients(system, gradient)
    np.testing.assert_allclose(direction, solved.reshape(k, -1).T, rtol=1e-8, atol=1e-28)
    # A loose forcing term stops early: one product on a gradient of 0.25.
    loose = _curvature._conjugate_gradients(system, gradient / gradient.abs().max() / 4)
    assert not torch.allclose(loose, direction / gradient.abs().max() / 4, rtol=1e-6)


def test_one_newton_epoch_solves_least_squares_in_float64():
    # The squared error's curvature is constant: the first Newton step lands
    # on the ridge solution (closed form), within the factor's relative
    # ridge (1e-8); a second step removes that.
    X, y = _standardized(load_diabetes)
    alpha = 0.01
    # sklearn's Ridge minimizes ||y - Xw||^2 + a ||w||^2: a = n alpha for ours.
    ridge = Ridge(alpha=alpha * X.shape[0], solver="cholesky").fit(X, y)
    one = CASGDLinearRegression(alpha=alpha, precision="fp64", max_iter=1, tol=None).fit(X, y)
    assert one.fit_stats_["plan"]["newton"] and one.n_iter_ == 1
    np.testing.assert_allclose(one.coef_, ridge.coef_, rtol=1e-5)
    model = CASGDLinearRegression(alpha=alpha, precision="fp64", tol=1e-10).fit(X, y)
    assert model.fit_stats_["converged"] and model.n_iter_ <= 2
    np.testing.assert_allclose(model.coef_, ridge.coef_, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(model.intercept_, ridge.intercept_, rtol=1e-12)


@pytest.mark.parametrize("loader", [load_breast_cancer, load_iris, load_wine, load_digits])
def test_newton_epochs_reach_scikit_learns_optimum(loader):
    X, y = _standardized(loader)
    C = 1.0
    model = CASGDLogisticRegression(alpha=1.0 / (C * X.shape[0]), precision="fp64", tol=1e-8)
    model.fit(X, y)
    stats = model.fit_stats_
    assert stats["plan"]["newton"] and stats["batch_size"] == X.shape[0]
    assert stats["converged"] and model.n_iter_ <= 15
    reference = LogisticRegression(C=C, tol=1e-12, max_iter=10_000).fit(X, y)
    np.testing.assert_allclose(model.coef_, reference.coef_, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(model.intercept_, reference.intercept_, rtol=1e-4, atol=1e-5)


def test_newton_epochs_reach_poisson_regressors_optimum():
    X, y = _standardized(load_diabetes)
    alpha = 1e-3
    model = CASGDPoissonRegressor(alpha=alpha, precision="fp64", tol=1e-8).fit(X, y)
    assert model.fit_stats_["plan"]["newton"]
    reference = PoissonRegressor(alpha=alpha, tol=1e-12, max_iter=10_000).fit(X, y)
    np.testing.assert_allclose(model.coef_, reference.coef_, rtol=1e-5, atol=1e-7)


def test_newton_epochs_in_bf16_reach_the_fp64_optimum():
    X, y = _standardized(load_breast_cancer)
    alpha = 1e-3
    exact = CASGDLogisticRegression(alpha=alpha, precision="fp64", tol=1e-8).fit(X, y)
    mixed = CASGDLogisticRegression(alpha=alpha, tol=1e-4).fit(X, y)
    assert mixed.fit_stats_["plan"]["newton"] and mixed.fit_stats_["converged"]
    gap = mixed.loss_curve_[-1] - exact.loss_curve_[-1]
    # Against the bf16-rounded X's optimum: the rounding of X, not the solver.
    assert abs(gap) < 1e-3 * exact.loss_curve_[-1]


@pytest.mark.parametrize(
    "params",
    [
        {"batch_size": 32},
        {"s": 1},
        {"eta0": 0.1},
        {"learning_rate": "constant"},
        {"solver": "sgd"},
        {"compile": True},
    ],
)
def test_a_step_setting_keeps_minibatch_steps(params):
    X, y = _standardized(load_breast_cancer)
    model = CASGDLogisticRegression(max_iter=2, tol=None, **params).fit(X, y)
    plan = model.fit_stats_["plan"]
    assert plan is None or not plan["newton"]
    assert model.fit_stats_["batch_size"] < X.shape[0]


def test_partial_fit_after_newton_epochs_takes_minibatch_steps():
    X, y = _standardized(load_breast_cancer)
    model = CASGDLogisticRegression(alpha=1e-3).fit(X, y)
    assert model.fit_stats_["plan"]["newton"]
    coef = model.coef_.copy()
    model.partial_fit(X, y)
    assert model.fit_stats_["batch_size"] < X.shape[0]
    assert np.all(np.isfinite(model.coef_))
    # From the optimum, one minibatch epoch stays near it (no step of Newton's length).
    np.testing.assert_allclose(model.coef_, coef, atol=0.05 * np.abs(coef).max())


def _counting_smoothness(monkeypatch):
    """Record the ``stream`` flag of every smoothness measurement an estimator makes."""
    from sklearn_casgd._engine import fit_plan

    streams = []
    original = fit_plan.loss_smoothness

    def counting(*args, **kwargs):
        streams.append(kwargs["stream"])
        return original(*args, **kwargs)

    monkeypatch.setattr(fit_plan, "loss_smoothness", counting)
    return streams


def test_newton_epochs_faster_than_minibatch_at_its_best_measure_no_smoothness(monkeypatch):
    """Minibatch epochs are fastest where every row is as smooth as the loss (L_max = L).

    Newton epochs predicted faster than that need no power iteration; the
    plan reports no ratio, and a later partial_fit takes its step from its
    own rows (as a stream).
    """
    streams = _counting_smoothness(monkeypatch)
    X, y = _standardized(load_diabetes)
    model = CASGDLinearRegression(alpha=1e-3, precision="fp64", tol=1e-8).fit(X, y)
    plan = model.fit_stats_["plan"]
    assert plan["newton"] and plan["smoothness_ratio"] is None
    assert streams == []
    expected = Ridge(alpha=1e-3 * X.shape[0]).fit(X, y)
    np.testing.assert_allclose(model.coef_, expected.coef_, rtol=1e-4)
    model.partial_fit(X, y)
    assert streams == [True]
    assert model.fit_stats_["batch_size"] < X.shape[0]
    # One minibatch epoch from the optimum stays near it.
    np.testing.assert_allclose(
        model.coef_, expected.coef_, atol=0.05 * np.abs(expected.coef_).max()
    )


@pytest.mark.parametrize("newton_wins", [True, False])
def test_a_sample_of_rows_bounds_l_max_before_every_row_is_measured(monkeypatch, newton_wins):
    """Between the best case (nothing measured) and every row's L_max: L and the
    largest row of the rows L is measured on, a lower bound of L_max, so that the
    minibatch's predicted time there is still its best. Newton epochs faster than
    that need no pass over every row's norm; slower, every row is measured, and L
    is not measured again."""
    from sklearn_casgd._engine import fit_plan, planner, stepsize

    monkeypatch.setattr(stepsize, "_MAX_EIGEN_ROWS", 64)  # digits' 1797 rows are sampled
    if not newton_wins:
        monkeypatch.setattr(planner, "NEWTON_EPOCHS_BOUNDED_CURVATURE", 1e4)
    calls = []
    original = fit_plan.loss_smoothness

    def recording(*args, **kwargs):
        smoothness = original(*args, **kwargs)
        calls.append((kwargs["every_row"], kwargs["full"], smoothness))
        return smoothness

    monkeypatch.setattr(fit_plan, "loss_smoothness", recording)
    X, y = _standardized(load_digits)
    model = CASGDLogisticRegression(alpha=1e-3, max_iter=1, tol=None).fit(X, y)
    plan = model.fit_stats_["plan"]
    sampled = calls[0][2]
    assert calls[0][:2] == (False, None) and sampled.sampled
    with pytest.raises(ValueError, match="lower bound"):
        sampled.at(32)
    if newton_wins:
        assert plan["newton"] and len(calls) == 1
        assert plan["smoothness_ratio"] == pytest.approx(sampled.ratio)
    else:
        assert not plan["newton"] and len(calls) == 2
        every_row, full, exact = calls[1]
        assert every_row and full == sampled.full == exact.full
        assert exact.largest_row > sampled.largest_row  # the largest row was not sampled
        assert plan["smoothness_ratio"] == pytest.approx(exact.ratio)


def test_a_minibatch_plan_measures_the_smoothness(monkeypatch):
    streams = _counting_smoothness(monkeypatch)
    X, y = _standardized(load_diabetes)
    model = CASGDLinearRegression(batch_size=16, max_iter=2, tol=None).fit(X, y)
    assert streams == [False]
    assert model.fit_stats_["plan"]["smoothness_ratio"] is None  # batch_size and s as given
    assert model.fit_stats_["batch_size"] == 16


def test_the_planner_weighs_newton_against_minibatch_steps():
    X, y = _standardized(load_breast_cancer)
    plan = CASGDLogisticRegression(max_iter=1, tol=None).fit(X, y).fit_stats_["plan"]
    assert plan["newton"]
    newton_seconds = plan["newton_candidate"]["seconds"]
    assert all(newton_seconds < c["seconds"] for c in plan["candidates"].values())
    # Many wide rows: forming the curvature (n d^2 each epoch) costs more than
    # the minibatch epochs. Wider than MAX_NEWTON_WIDTH: not weighed.
    shape = dict(
        n_samples=400_000, n_outputs=1, smoothness_ratio=5.0, batch_size="auto", s="auto",
        solver="svrg", device_type="cpu", world_size=1, sparse=False, newton_allowed=True,
        family=BinomialFamily(),
    )  # fmt: skip
    wide = plan_execution(width=500, **shape)
    assert not wide.newton
    assert wide.newton_candidate.seconds > min(c.seconds for c in wide.candidates)
    assert plan_execution(width=MAX_NEWTON_WIDTH, **shape).newton_candidate is None


def _counting_formations(monkeypatch):
    """Record the snapshot of every curvature the solver forms."""
    from sklearn_casgd._engine import solver

    formed = []
    original = solver.form_newton_system

    def counting(ctx, data, state, *args):
        formed.append(data.snapshot)
        return original(ctx, data, state, *args)

    monkeypatch.setattr(solver, "form_newton_system", counting)
    return formed


def test_newton_epochs_keep_a_curvature_that_still_works(monkeypatch):
    """In Newton's quadratic phase the factor of an earlier snapshot is stepped from again.

    An epoch kept at full length that shrank the gradient NEWTON_REUSE_FACTOR
    times over keeps its factor for the next epoch: fewer formations than
    epochs, and the optimum of forming one at every snapshot.
    """
    formed = _counting_formations(monkeypatch)
    X, y = _standardized(load_diabetes)
    params = dict(alpha=1e-4, precision="fp64", tol=1e-6)
    reused = CASGDPoissonRegressor(**params).fit(X, y)
    n_reused = len(formed)
    formed.clear()
    from sklearn_casgd._engine import solver

    monkeypatch.setattr(solver, "NEWTON_REUSE_FACTOR", float("inf"))
    every = CASGDPoissonRegressor(**params).fit(X, y)
    assert reused.fit_stats_["plan"]["newton"] and reused.fit_stats_["converged"]
    assert len(formed) == every.n_iter_ and n_reused < reused.n_iter_
    # A reused factor's step meets the gradient test; the certificate may take one more.
    assert reused.n_iter_ <= every.n_iter_ + 1
    np.testing.assert_allclose(reused.coef_, every.coef_, rtol=1e-4, atol=1e-6)
    expected = PoissonRegressor(alpha=1e-4, tol=1e-10, max_iter=10_000).fit(X, y)
    np.testing.assert_allclose(reused.coef_, expected.coef_, rtol=1e-4, atol=1e-6)


def test_a_common_shift_of_the_classes_is_solved_apart():
    """The softmax does not see a shift of every class: the Hessian is singular there.

    Solved through the ridge, rounding along that shift was amplified ~1e8
    (the intercepts drifted 5e-8 together between two equal fits). Apart,
    the intercepts keep their start's zero sum, and a shift of the
    coefficients (a warm start) is the penalty's alone: Newton's step
    removes it whole.
    """
    X, y = _standardized(load_wine)
    params = dict(alpha=1e-3, precision="fp64", tol=1e-8)
    model = CASGDLogisticRegression(**params).fit(X, y)
    assert model.fit_stats_["plan"]["newton"] and model.fit_stats_["converged"]
    assert abs(model.intercept_.sum()) < 1e-12
    assert np.abs(model.coef_.sum(axis=0)).max() < 1e-12
    optimum = model.coef_.copy()
    model.coef_ = model.coef_ + 1.0  # every class's coefficients up by 1: same probabilities
    model.set_params(warm_start=True).fit(X, y)
    assert model.fit_stats_["converged"] and model.n_iter_ <= 2
    assert np.abs(model.coef_.sum(axis=0)).max() < 1e-12
    # Both within tol of the optimum (curvature ~alpha: coefficients within ~1e-5).
    np.testing.assert_allclose(model.coef_, optimum, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["least squares", "logistic"])
def test_the_curvature_is_formed_once_per_snapshot_that_steps(monkeypatch, case):
    """Formed where an epoch steps from a new snapshot, not by the pass that ends the fit.

    Least squares' Hessian does not move: formed once, whatever the epochs.
    """
    formed = _counting_formations(monkeypatch)
    if case == "least squares":
        X, y = _standardized(load_diabetes)
        model = CASGDLinearRegression(precision="fp64", max_iter=3, tol=None).fit(X, y)
        assert model.fit_stats_["plan"]["newton"] and model.n_iter_ == 3
        assert len(formed) == 1
    else:
        X, y = _standardized(load_breast_cancer)
        model = CASGDLogisticRegression(alpha=1e-3, precision="fp64", tol=1e-8).fit(X, y)
        assert model.fit_stats_["plan"]["newton"] and model.fit_stats_["converged"]
        # One per snapshot stepped from: distinct, at most one per epoch.
        assert len({id(snapshot) for snapshot in formed}) == len(formed) <= model.n_iter_


def test_sampled_rows_spread_over_x_and_move_between_formations():
    cpu = torch.device("cpu")
    assert _curvature.sampled_rows(1000, None, 0, cpu) is None
    assert _curvature.sampled_rows(1000, 501, 0, cpu) is None  # more than half: every row
    drawn = [_curvature.sampled_rows(1000, 300, f, cpu) for f in range(4)]
    assert all(sample.scale is None for sample in drawn)
    samples = [sample.index for sample in drawn]
    for sample in samples:
        assert sample.numel() == 300 and sample.unique().numel() == 300
        assert 0 <= int(sample.min()) and int(sample.max()) < 1000
        assert int(sample.max()) >= 1000 - 1000 // 300 - 1  # reaches X's last rows
    assert not torch.equal(samples[0], samples[1]) and not torch.equal(samples[1], samples[2])
    assert torch.equal(samples[0], samples[3])  # offsets cycle through the stride of 3


def test_rows_drawn_by_curvature_estimate_the_mean_where_an_even_spread_misses():
    """A heavy tail in 20 of 100,000 rows: the weighted sample's mean still finds it."""
    cpu = torch.device("cpu")
    n, rows = 100_000, 2_000
    generator = torch.Generator().manual_seed(0)
    curvature = torch.rand(n, generator=generator, dtype=torch.float64)
    heavy = torch.randperm(n, generator=generator)[:20]
    curvature[heavy] = 5_000.0  # 2/3 of the total in 0.02 % of the rows
    mean = float(curvature.mean())
    for formation in range(3):
        sample = _curvature.sampled_rows(n, rows, formation, cpu, curvature.float())
        index, scale = sample.index, sample.scale
        assert index.numel() == rows and torch.all(index[1:] >= index[:-1])
        assert 0 <= int(index.min()) and int(index.max()) < n
        assert bool(torch.isin(heavy, index).all())  # every heavy row is in
        # 1 / (n p_i) <= 1 / (1 - share): no row's weight explodes.
        assert float(scale.max()) <= 1.0 / (1.0 - _curvature.IMPORTANCE_SHARE) + 1e-12
        estimate = float((curvature[index] * scale).mean())
        assert estimate == pytest.approx(mean, rel=0.02)
        spread = _curvature.sampled_rows(n, rows, formation, cpu).index
        assert abs(float(curvature[spread].mean()) / mean - 1.0) > 0.5
    # No curvature anywhere (or not finite): the even spread.
    assert _curvature.sampled_rows(n, rows, 0, cpu, torch.zeros(n)).scale is None
    nan = torch.full((n,), float("nan"))
    assert _curvature.sampled_rows(n, rows, 0, cpu, nan).scale is None


@pytest.mark.parametrize(
    "case, estimator, reference",
    [
        ("logistic", CASGDLogisticRegression, LogisticRegression),
        ("poisson", CASGDPoissonRegressor, PoissonRegressor),
    ],
)
def test_a_sampled_curvature_reaches_the_same_optimum(monkeypatch, case, estimator, reference):
    """Newton epochs from the curvature of a sample of rows: the exact gradient keeps the optimum.

    The planner is made to take the sample (no extra epochs priced, small
    samples allowed); every formation uses that many rows, and they differ.
    """
    from sklearn_casgd._engine import planner, solver

    monkeypatch.setattr(planner, "CURVATURE_MIN_ROWS", 64)
    monkeypatch.setattr(planner, "CURVATURE_ROWS_PER_UNKNOWN", 4)
    monkeypatch.setattr(planner, "SAMPLED_CURVATURE_EPOCHS", 0.0)
    monkeypatch.setattr(planner, "SAMPLED_CURVATURE_EPOCHS_LOG_LINK", 0.0)
    samples = []
    original = solver.form_newton_system

    def recording(ctx, data, state, sample=None, *args):
        samples.append(sample)
        return original(ctx, data, state, sample, *args)

    monkeypatch.setattr(solver, "form_newton_system", recording)
    X, y = _standardized(load_breast_cancer if case == "logistic" else load_diabetes)
    n = X.shape[0]
    alpha = 1e-3
    model = estimator(alpha=alpha, precision="fp64", tol=1e-9).fit(X, y)
    plan = model.fit_stats_["plan"]
    rows = max(64, 4 * (X.shape[1] + 1))
    assert plan["newton"] and plan["curvature_rows"] == rows and model.fit_stats_["converged"]
    assert samples and all(sample.index.numel() == rows for sample in samples)
    assert len({tuple(sample.index.tolist()) for sample in samples}) > 1
    # Poisson's unbounded curvature draws rows by it; labels' spread them evenly.
    assert all((sample.scale is not None) == (case == "poisson") for sample in samples)
    if case == "logistic":
        expected = reference(C=1.0 / (alpha * n), tol=1e-12, max_iter=10_000)
    else:
        expected = reference(alpha=alpha, tol=1e-12, max_iter=10_000)
    expected.fit(X, y)
    np.testing.assert_allclose(
        model.coef_, expected.coef_.reshape(model.coef_.shape), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(model.intercept_, expected.intercept_, rtol=1e-6, atol=1e-6)


def _last_step_run(start, end, current=1.0, same_snapshot=False):
    """A run whose last Newton step went from x = start to x = end on f(x) = x^2 / 2."""
    from types import SimpleNamespace

    from sklearn_casgd._engine.solver import _Run

    kept, snapshot = object(), object()
    step = torch.tensor([[start - end]], dtype=torch.float64)  # subtracted from x
    run = SimpleNamespace(
        newton_last=(kept, torch.tensor([[start]], dtype=torch.float64), step),
        schedule=SimpleNamespace(current=current),
    )
    at = kept if same_snapshot else snapshot
    return _Run.newton_extrapolation(run, at, torch.tensor([[end]], dtype=torch.float64))


def test_newton_extrapolation_places_the_lines_minimum_by_its_slopes():
    # On a quadratic line the secant of the slopes is exact: from x = 4 a
    # step to 3 reached a quarter of the way, the minimum is 4 such steps.
    assert _last_step_run(4.0, 3.0) == pytest.approx(4.0)
    assert _last_step_run(4.0, 2.0) == pytest.approx(2.0)
    # At most NEWTON_EXTRAPOLATION; never below Newton's own length.
    assert _last_step_run(10.0, 9.0) == pytest.approx(4.0)
    assert _last_step_run(4.0, -1.0) == 1.0  # the minimum passed
    assert _last_step_run(4.0, 0.0) == 1.0  # reached
    assert _last_step_run(4.0, 0.2) == 1.0  # nearly: 1.05 steps away
    # An undone step (the snapshot did not move) or a shortened schedule: none.
    assert _last_step_run(4.0, 3.0, same_snapshot=True) == 1.0
    assert _last_step_run(4.0, 3.0, current=0.5) == 1.0


@pytest.mark.parametrize("loader", [load_wine, load_breast_cancer])
def test_lengthened_newton_steps_reach_the_same_optimum_in_fewer_epochs(monkeypatch, loader):
    # Far from a nearly separable optimum each full Newton step only halves
    # the loss: lengthened along their lines they get there sooner.
    X, y = _standardized(loader)
    params = dict(alpha=1e-4, precision="fp64", tol=1e-8)
    lengthened = CASGDLogisticRegression(**params).fit(X, y)
    monkeypatch.setattr("sklearn_casgd._engine.solver.NEWTON_EXTRAPOLATION", 1.0)
    plain = CASGDLogisticRegression(**params).fit(X, y)
    assert lengthened.fit_stats_["converged"] and plain.fit_stats_["converged"]
    assert lengthened.n_iter_ < plain.n_iter_
    np.testing.assert_allclose(lengthened.coef_, plain.coef_, rtol=1e-5, atol=1e-6)


def test_the_gradient_maximum_is_the_users_not_newtons_steps_coordinates():
    """Preconditioned Newton epochs: the pass also carries the gradient in the steps'
    coordinates (``g / D``, larger where D < 1); the stopping test reads the user's."""
    rng = np.random.default_rng(2)
    X, y = rng.normal(size=(60, 3)), rng.normal(size=(60, 1))
    center, scale, alpha = np.zeros(3), np.full(3, 0.1), 0.2
    preconditioner = Preconditioner(
        torch.tensor(center), torch.tensor(scale), alpha / float(np.min(scale**2))
    )
    ctx = StepContext(
        SquaredErrorFamily(), PRESETS["fp64"], Penalty(alpha), False, LocalCommunicator(),
        preconditioner, newton=True,
    )  # fmt: skip
    v = rng.normal(size=(3, 1))  # the steps' coordinates: w = v / D
    data = LocalData(torch.tensor(X), torch.tensor(y), torch.ones(60, dtype=torch.float64))
    state = ModelState(torch.tensor(v), torch.zeros(1, dtype=torch.float64))
    snapshot, measured = full_pass(ctx, data, state, 0.0)
    w = v / scale[:, None]
    gradient = X.T @ (X @ w - y) / 60 + alpha * w  # the user's coordinates
    assert measured.gradient_max == pytest.approx(np.abs(gradient).max(), rel=1e-12)
    # The steps' coordinates' gradient is 10x larger here: it must not be the one read.
    assert snapshot.newton_gradient.abs().max().item() > 5 * np.abs(gradient).max()
