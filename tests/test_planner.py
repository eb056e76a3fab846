"""batch_size="auto": the epochs model, the joint choice of b and s, and what fits report."""

import itertools
import math

import numpy as np
import pytest
import scipy.sparse as sp

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression
from sklearn_casgd._accel import sparse_steps
from sklearn_casgd._engine import planner
from sklearn_casgd._engine.cost import PROFILES, FitShape, predict_epoch_seconds
from sklearn_casgd._engine.planner import (
    EPOCHS_FLOOR,
    EPOCHS_STEPS,
    EPOCHS_VARIANCE,
    MIN_STEPS_PER_EPOCH,
    SGD_BATCH,
    SMALLEST_BATCH,
    SPARSE_KERNEL_REASON,
    batch_candidates,
    plan_execution,
    predict_epochs,
)
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective

PLAN = dict(n_outputs=1, solver="svrg", device_type="cpu", world_size=1, sparse=False, s="auto")


def test_predicted_epochs_follow_the_formula():
    n, ratio = 100_000, 150.0
    for b in (1, 32, 4096):
        expected = EPOCHS_FLOOR + EPOCHS_VARIANCE * ratio / (ratio + b) + EPOCHS_STEPS * b / n
        assert predict_epochs(b, n, ratio) == pytest.approx(expected)
    # Sampling noise falls with the batch, the steps' term rises with it.
    assert predict_epochs(64, n, ratio) > predict_epochs(1024, n, ratio)
    assert predict_epochs(n // 2, n, ratio) > predict_epochs(1024, n, ratio)
    # A ratio below 1 (L_max >= L always) is read as 1.
    assert predict_epochs(32, n, 0.5) == predict_epochs(32, n, 1.0)


@pytest.mark.parametrize("n", [1, 5, 20, 500, 100_000, 10**8])
def test_batch_candidates_leave_enough_steps_an_epoch(n):
    sizes = batch_candidates(n)
    assert sizes[0] == min(n, SMALLEST_BATCH)
    assert all(b == 2 * a for a, b in itertools.pairwise(sizes))
    assert all(n / b >= MIN_STEPS_PER_EPOCH for b in sizes[1:])
    # The next power of two would leave too few steps (or pass the cap).
    assert n / (2 * sizes[-1]) < MIN_STEPS_PER_EPOCH or sizes[-1] == 1 << 16


def test_auto_takes_the_candidate_of_least_predicted_time():
    plan = plan_execution(
        n_samples=400_000, width=100, smoothness_ratio=150.0, batch_size="auto", **PLAN
    )
    seconds = {c.batch_size: c.seconds for c in plan.candidates}
    assert plan.batch_size == min(seconds, key=seconds.get)
    assert plan.chosen.batch_size == plan.batch_size and plan.s == plan.chosen.s
    # The candidate's epoch time is the cost model's, plus the full pass.
    profile = PROFILES["cpu"]
    b, s = plan.batch_size, plan.s
    shape = FitShape(400_000, b, 100, 1, row_step_s=frozenset(plan.s_predictions))
    steps = predict_epoch_seconds(s, shape, profile.local_costs(b, 100, 1), None)
    assert plan.chosen.epoch_seconds == pytest.approx(steps + profile.pass_seconds(400_000, 100, 1))
    assert plan.s == min(plan.s_predictions, key=plan.s_predictions.get)
    report = plan.report()
    assert report["predicted_seconds"] == pytest.approx(plan.chosen.seconds)
    assert report["smoothness_ratio"] == 150.0
    assert set(report["candidates"]) == set(batch_candidates(400_000))


def test_noisier_rows_take_larger_batches():
    """The larger L_max / L, the more a small batch's steps are shortened by sampling."""
    chosen = [
        plan_execution(
            n_samples=200_000, width=50, smoothness_ratio=ratio, batch_size="auto", **PLAN
        ).batch_size
        for ratio in (1.0, 30.0, 1000.0)
    ]
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]


def test_the_users_batch_size_and_s_are_kept():
    both = plan_execution(
        n_samples=1000, width=10, smoothness_ratio=None, batch_size=50, **{**PLAN, "s": 4}
    )
    assert (both.batch_size, both.s, both.chosen, both.s_predictions) == (50, 4, None, None)
    assert "as given" in both.reason
    batch_only = plan_execution(
        n_samples=1000, width=10, smoothness_ratio=None, batch_size=5000, **PLAN
    )
    assert batch_only.batch_size == 1000  # at most n
    assert batch_only.s == min(batch_only.s_predictions, key=batch_only.s_predictions.get)
    s_only = plan_execution(
        n_samples=100_000, width=10, smoothness_ratio=20.0, batch_size="auto", **{**PLAN, "s": 2}
    )
    assert s_only.s == 2 and all(c.s == 2 for c in s_only.candidates)
    assert s_only.s_predictions is None  # no s was weighed


def test_several_ranks_leave_s_to_the_ranks_and_sparse_rows_take_s_1():
    ranks = plan_execution(
        n_samples=100_000, width=50, smoothness_ratio=20.0, batch_size="auto",
        **{**PLAN, "world_size": 2},
    )  # fmt: skip
    assert ranks.s is None and ranks.s_predictions is None and "ranks" in ranks.reason
    sparse = plan_execution(
        n_samples=100_000, width=12.5, smoothness_ratio=20.0, batch_size="auto",
        **{**PLAN, "sparse": True},
    )  # fmt: skip
    assert sparse.s == 1 and all(c.s == 1 for c in sparse.candidates)
    sgd = plan_execution(
        n_samples=100_000, width=50, smoothness_ratio=None, batch_size="auto",
        **{**PLAN, "solver": "sgd"},
    )  # fmt: skip
    assert sgd.batch_size == SGD_BATCH and sgd.chosen is None


@pytest.mark.parametrize("steps", ["default", "minibatch"])
def test_default_fit_reports_its_plan_and_reaches_the_optimum(steps):
    """20000 rows: the exact optimum, as scikit-learn's lbfgs, from either plan.

    At the defaults this narrow problem runs Newton epochs (predicted faster
    than every minibatch candidate); a fixed s keeps minibatch SVRG, whose
    batch size is still the planner's.
    """
    from sklearn.linear_model import LogisticRegression

    X, y, _ = make_glm_data("logistic", 20_000, 20, random_state=0)
    alpha = 1e-4
    params = {} if steps == "default" else {"s": 4}
    fitted = CASGDLogisticRegression(alpha=alpha, random_state=0, **params).fit(X, y)
    stats = fitted.fit_stats_
    plan = stats["plan"]
    fastest_minibatch = min(c["seconds"] for c in plan["candidates"].values())
    if steps == "default":
        assert plan["newton"] and stats["batch_size"] == X.shape[0]
        assert plan["predicted_seconds"] == plan["newton_candidate"]["seconds"] < fastest_minibatch
    else:
        assert not plan["newton"] and plan["newton_candidate"] is None
        assert stats["batch_size"] in plan["candidates"] and stats["batch_size"] > 32
        assert plan["predicted_seconds"] == fastest_minibatch
        assert X.shape[0] / stats["batch_size"] >= MIN_STEPS_PER_EPOCH
    assert stats["converged"]
    exact = LogisticRegression(C=1 / (alpha * X.shape[0]), tol=1e-10, max_iter=1000).fit(X, y)
    reached = glm_objective("logistic", X, y, fitted.coef_, fitted.intercept_, alpha)
    best = glm_objective("logistic", X, y, exact.coef_, exact.intercept_, alpha)
    assert reached - best <= 1e-6 * best


def test_partial_fit_keeps_the_first_chunks_batch_size():
    X, y, _ = make_glm_data("linear", 6000, 8, random_state=0)
    reg = CASGDLinearRegression(random_state=0)
    reg.partial_fit(X[:4000], y[:4000])
    first = reg.fit_stats_["batch_size"]
    assert first == reg._step_plan.batch_size
    reg.partial_fit(X[4000:4500], y[4000:4500])
    assert reg.fit_stats_["batch_size"] == first
    reg.set_params(batch_size=7).partial_fit(X[4500:], y[4500:])
    assert reg.fit_stats_["batch_size"] == 7


def test_sparse_x_in_the_epoch_kernel_takes_the_smallest_batch(monkeypatch):
    """Where minibatch steps run (Newton epochs ruled out), the epoch kernel's batch."""
    pytest.importorskip("numba")
    monkeypatch.setattr(planner, "NEWTON", False)
    X, y, _ = make_glm_data("logistic", 8000, 40, random_state=0)
    X[np.abs(X) < 1.0] = 0.0
    sparse = CASGDLogisticRegression(max_iter=3, tol=None, random_state=0).fit(sp.csr_matrix(X), y)
    assert sparse.fit_stats_["execution"]["epoch_kernel"]
    assert sparse.fit_stats_["batch_size"] == SMALLEST_BATCH
    assert sparse.fit_stats_["plan"]["reason"] == SPARSE_KERNEL_REASON
    sgd = CASGDLogisticRegression(solver="sgd", max_iter=1, tol=None).fit(sp.csr_matrix(X), y)
    assert sgd.fit_stats_["batch_size"] == SGD_BATCH  # plain SGD keeps the paper's batch


def test_sparse_x_plans_from_its_stored_values(monkeypatch):
    """Where the torch steps run the sparse rows (no numba), the cost model prices them."""
    monkeypatch.setattr(sparse_steps, "available", lambda: False)
    X, y, _ = make_glm_data("logistic", 8000, 40, random_state=0)
    X[np.abs(X) < 1.0] = 0.0
    dense = CASGDLogisticRegression(max_iter=3, tol=None, random_state=0).fit(X, y)
    sparse = CASGDLogisticRegression(max_iter=3, tol=None, random_state=0).fit(sp.csr_matrix(X), y)
    assert sparse.fit_stats_["s"] == 1
    assert math.isfinite(sparse.fit_stats_["plan"]["predicted_seconds"])
    assert (
        dense.fit_stats_["plan"]["candidates"].keys()
        == sparse.fit_stats_["plan"]["candidates"].keys()
    )


def test_newton_epochs_are_priced_by_family():
    """One epoch for least squares' constant Hessian: it wins where labels' 6 do not."""
    from sklearn_casgd._engine.planner import newton_epochs
    from sklearn_casgd._glm.families import BinomialFamily, PoissonFamily, SquaredErrorFamily

    shape = dict(n_samples=400_000, width=100, smoothness_ratio=5.0, batch_size="auto")
    plans = {
        family: plan_execution(**shape, **PLAN, newton_allowed=True, family=family)
        for family in (SquaredErrorFamily(), PoissonFamily(), BinomialFamily())
    }
    for family, plan in plans.items():
        epochs = newton_epochs(family, 1, 100, plan.curvature_rows)
        assert plan.newton_candidate.epochs == epochs
        fastest = min(c.seconds for c in plan.candidates)
        assert plan.newton == (plan.newton_candidate.seconds < fastest)
    least_squares, poisson, labels = plans.values()
    assert least_squares.newton and not labels.newton
    # A constant Hessian is formed once from every row; the others from a sample.
    assert least_squares.curvature_rows is None
    assert poisson.curvature_rows == labels.curvature_rows == planner.CURVATURE_MIN_ROWS
    assert least_squares.newton_candidate.epochs < poisson.newton_candidate.epochs
    # Every row's curvature: the log link takes fewer epochs than labels; a
    # sample's costs it more (its curvature is heavier-tailed).
    poisson_family, labels_family = PoissonFamily(), BinomialFamily()
    assert newton_epochs(poisson_family, 1, 100) < newton_epochs(labels_family, 1, 100)
    growth = {
        family: newton_epochs(family, 1, 100, 8192) / newton_epochs(family, 1, 100)
        for family in (poisson_family, labels_family)
    }
    assert growth[poisson_family] > growth[labels_family] > 1.0
    # Two ranks: the pass reads a rank's 50 columns; every rank forms the whole system.
    one = plan_execution(**shape, **PLAN, newton_allowed=True)
    ranks = plan_execution(
        **{**shape, "width": 50},
        **{**PLAN, "world_size": 2},
        newton_allowed=True,
        n_features=100,
    )
    assert ranks.curvature_rows == one.curvature_rows is not None
    assert ranks.newton_candidate.epochs == one.newton_candidate.epochs
    assert ranks.newton_candidate.epoch_seconds < one.newton_candidate.epoch_seconds
    # Sparse rows on one rank: conjugate gradients, a pass, the diagonal and the
    # products (SPARSE_NEWTON_PRODUCTS, two reads each) an epoch; never on two ranks.
    sparse = plan_execution(**shape, **{**PLAN, "sparse": True}, newton_allowed=True)
    reads = 2 + 2 * planner.SPARSE_NEWTON_PRODUCTS
    pass_seconds = PROFILES["cpu"].sparse_pass_seconds(400_000, 100, 1)
    assert sparse.newton_candidate.epoch_seconds == pytest.approx(reads * pass_seconds)
    two = plan_execution(**shape, **{**PLAN, "sparse": True, "world_size": 2}, newton_allowed=True)
    assert not two.newton and two.newton_candidate is None


def test_log_link_families_are_predicted_more_minibatch_epochs():
    """Poisson and gamma took 1.4-2.8x the model's minibatch epochs: the factor applies to
    every batch size alike (the batch chosen is unchanged), and tips Newton against it."""
    from sklearn_casgd._engine.planner import EPOCHS_LOG_LINK
    from sklearn_casgd._glm.families import BinomialFamily, GammaFamily, PoissonFamily

    labels = predict_epochs(4096, 400_000, 78.0, BinomialFamily())
    assert labels == predict_epochs(4096, 400_000, 78.0)
    for family in (PoissonFamily(), GammaFamily()):
        assert predict_epochs(4096, 400_000, 78.0, family) == pytest.approx(
            EPOCHS_LOG_LINK * labels
        )
    shape = dict(n_samples=400_000, width=28, smoothness_ratio=78.0, batch_size="auto")
    plain = plan_execution(**shape, **PLAN, newton_allowed=False, family=PoissonFamily())
    weighed = plan_execution(**shape, **PLAN, newton_allowed=True, family=PoissonFamily())
    minibatch_seconds = min(c.seconds for c in weighed.candidates)
    assert plain.batch_size == weighed.batch_size
    # Measured there: Newton epochs in 0.72x of minibatch SVRG's time to 1e-6.
    assert weighed.newton and weighed.newton_candidate.seconds < minibatch_seconds
