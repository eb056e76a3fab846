"""Exact-arithmetic identities of the engine (float64).

s-step SGD is plain SGD on the same batches, so in float64 the two must
agree to rounding; both must agree with an independent numpy SGD loop.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import objective
from scipy.special import expit, softmax

from sklearn_casgd import (
    CASGDGammaRegressor,
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)
from sklearn_casgd._engine.batch import gather_outer_batch
from sklearn_casgd._engine.comm import LocalCommunicator
from sklearn_casgd._engine.epochs import outer_iterations
from sklearn_casgd._engine.exchange import prefer_row_exchange
from sklearn_casgd._engine.precision import PRESETS
from sklearn_casgd._engine.recurrence import (
    SMALLEST_DECAY_PRODUCT,
    ca_outer_iteration,
    longest_recurrence,
    recurrence_step,
    sgd_step,
    step_coefficients,
)
from sklearn_casgd._engine.snapshot import full_pass
from sklearn_casgd._engine.solver import run_epochs
from sklearn_casgd._engine.solver_state import SVRG_GROWTH, SolverConfig, StepSchedule
from sklearn_casgd._engine.state import (
    CENTERED_PRODUCTS_SPREADS,
    LocalData,
    ModelState,
    Preconditioner,
    RowExchange,
    StepContext,
)
from sklearn_casgd._glm.families import (
    BinomialFamily,
    GammaFamily,
    MultinomialFamily,
    PoissonFamily,
    SquaredErrorFamily,
    TweedieFamily,
)
from sklearn_casgd._glm.penalties import Penalty
from sklearn_casgd.datasets import make_glm_data

FAMILIES = {
    "logistic": (BinomialFamily(), CASGDLogisticRegression),
    "multinomial": (MultinomialFamily(), CASGDLogisticRegression),
    "linear": (SquaredErrorFamily(), CASGDLinearRegression),
    "poisson": (PoissonFamily(), CASGDPoissonRegressor),
    "gamma": (GammaFamily(), CASGDGammaRegressor),
    "tweedie": (TweedieFamily(1.5), CASGDTweedieRegressor),  # the estimator's default power
}


def numpy_gradient(name, raw, target):
    if name == "logistic":
        return expit(raw) - target
    if name == "multinomial":
        return softmax(raw, axis=1) - target
    if name == "linear":
        return raw - target
    if name == "gamma":
        return 1 - target * np.exp(-raw)
    if name == "tweedie":  # power 1.5
        return np.exp(0.5 * raw) - target * np.exp(-0.5 * raw)
    return np.exp(raw) - target


def reference_sgd(name, X, target, weight, *, alpha, etas, batches, coef, intercept):
    """Plain minibatch SGD in numpy, step by step, as `docs/design.md`, section 2, writes it."""
    coef, intercept = coef.copy(), intercept.copy()
    for rows, eta in zip(batches, etas, strict=True):
        raw = X[rows] @ coef + intercept
        residual = weight[rows, None] * numpy_gradient(name, raw, target[rows])
        scale = eta / len(rows)
        coef = (1 - eta * alpha) * coef - scale * X[rows].T @ residual
        intercept = intercept - scale * residual.sum(axis=0)
    return coef, intercept


def reference_svrg(
    name, X, target, weight, *, alpha, etas, batches, coef, intercept, penalty=None, decay=None
):
    """SVRG in numpy (`docs/design.md`, section 3): one snapshot per epoch of ``batches``.

    ``etas`` and ``batches`` hold one list per epoch. ``penalty`` (per column)
    and ``decay`` give the preconditioned form: the steps decay at the scalar
    ``decay`` and the rest of the penalty, ``(penalty - decay) * coef~``, is
    taken at the snapshot.
    """
    n_samples = X.shape[0]
    penalty = np.full(X.shape[1], alpha) if penalty is None else penalty
    decay = alpha if decay is None else decay
    coef, intercept = coef.copy(), intercept.copy()
    for epoch_etas, epoch_batches in zip(etas, batches, strict=True):
        snapshot_gradient = numpy_gradient(name, X @ coef + intercept, target)
        weighted = weight[:, None] * snapshot_gradient
        mu = X.T @ weighted / n_samples + (penalty - decay)[:, None] * coef
        mu_intercept = weighted.sum(axis=0) / n_samples
        for rows, eta in zip(epoch_batches, epoch_etas, strict=True):
            raw = X[rows] @ coef + intercept
            residual = weight[rows, None] * (
                numpy_gradient(name, raw, target[rows]) - snapshot_gradient[rows]
            )
            scale = eta / len(rows)
            coef = (1 - eta * decay) * coef - eta * mu - scale * X[rows].T @ residual
            intercept = intercept - eta * mu_intercept - scale * residual.sum(axis=0)
    return coef, intercept


def epoch_batches(n_samples, batch_size, seed, epochs):
    """The batches the engine draws: one seeded permutation per epoch."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(epochs):
        order = torch.randperm(n_samples, generator=generator).numpy()
        batches.append([order[i : i + batch_size] for i in range(0, n_samples, batch_size)])
    return batches


def make_problem(name, n_samples=203, n_features=7, seed=0):
    family = FAMILIES[name][0]
    X, y, _ = make_glm_data(name, n_samples, n_features, random_state=seed)
    n_classes = 3 if name == "multinomial" else None
    target = family.encode_target(y, n_classes)
    weight = np.random.default_rng(seed).uniform(0.2, 2.0, n_samples)
    return family, X, target, weight


def engine_fit(
    name,
    X,
    target,
    weight,
    *,
    s,
    alpha,
    eta0,
    seed,
    epochs,
    kind="invscaling",
    solver="sgd",
    preconditioner=None,
    row_steps=False,
):
    family = FAMILIES[name][0]
    policy = PRESETS["fp64"]
    k = target.shape[1]
    ctx = StepContext(
        family,
        policy,
        Penalty(alpha),
        True,
        LocalCommunicator(),
        preconditioner,
        row_steps=row_steps,
    )
    data = LocalData(torch.from_numpy(X), torch.from_numpy(target), torch.from_numpy(weight))
    state = ModelState(
        torch.zeros((X.shape[1], k), dtype=torch.float64),
        torch.as_tensor(family.intercept_start(target, weight)).clone(),
    )
    config = SolverConfig(
        s=s,
        batch_size=16,
        max_iter=epochs,
        tol=None,
        n_iter_no_change=5,
        shuffle=True,
        seed=seed,
        solver=solver,
    )
    offset = family.loss_offset(target, weight)
    result = run_epochs(ctx, data, state, config, StepSchedule(kind, eta0, 0.5), offset)
    return state, result


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("s, row_steps", [(1, False), (4, False), (4, True)])
def test_engine_matches_numpy_reference_sgd(name, s, row_steps):
    """s=4 from the Gram and from the rows (row steps), with a ragged last outer iteration."""
    family, X, target, weight = make_problem(name)
    eta0, alpha, seed, epochs = 0.05, 0.01, 3, 2
    state, result = engine_fit(
        name, X, target, weight, s=s, alpha=alpha, eta0=eta0, seed=seed, epochs=epochs,
        row_steps=row_steps,
    )  # fmt: skip
    batches = [batch for epoch in epoch_batches(X.shape[0], 16, seed, epochs) for batch in epoch]
    # A ragged batch takes its share of the step (203 rows: a tail of 11 of 16).
    etas = [eta0 / (t + 1) ** 0.5 * len(rows) / 16 for t, rows in enumerate(batches)]
    coef, intercept = reference_sgd(
        name,
        X,
        target,
        weight,
        alpha=alpha,
        etas=etas,
        batches=batches,
        coef=np.zeros((X.shape[1], target.shape[1])),
        intercept=family.intercept_start(target, weight),
    )
    assert result.n_steps == len(batches)
    np.testing.assert_allclose(state.coef.numpy(), coef, rtol=0, atol=1e-12)
    np.testing.assert_allclose(state.intercept.numpy(), intercept, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("s, row_steps", [(1, False), (4, False), (4, True)])
@pytest.mark.parametrize("preconditioned", [False, True])
def test_svrg_engine_matches_numpy_reference_svrg(name, s, row_steps, preconditioned):
    """Every SVRG epoch kept (a small step), so the step grows by SVRG_GROWTH each epoch.

    Preconditioned, the steps run on v = D w over the rows (x - m) / D with the
    scalar decay alpha / min D^2.
    """
    family, X, target, weight = make_problem(name)
    alpha, eta0, seed, epochs = 0.01, 0.02, 3, 3
    if name == "tweedie" and preconditioned:
        # At 0.02 one epoch here lowers the objective but not the largest gradient
        # entry, so the step does not grow there; the reference assumes it does.
        eta0 = 0.005
    center, scale = np.zeros(X.shape[1]), np.ones(X.shape[1])
    preconditioner = None
    if preconditioned:
        rng = np.random.default_rng(5)
        center, scale = rng.normal(0, 0.5, X.shape[1]), rng.uniform(0.5, 3.0, X.shape[1])
        decay = alpha / np.min(scale**2)
        preconditioner = Preconditioner(torch.tensor(center), torch.tensor(scale), decay)
    state, result = engine_fit(
        name, X, target, weight, s=s, alpha=alpha, eta0=eta0, seed=seed, epochs=epochs,
        kind="constant", solver="svrg", preconditioner=preconditioner, row_steps=row_steps,
    )  # fmt: skip
    assert np.all(np.diff(result.loss_curve) < 0)  # no epoch undone
    batches = epoch_batches(X.shape[0], 16, seed, epochs)
    etas = [
        [eta0 * SVRG_GROWTH**epoch * len(rows) / 16 for rows in batches[epoch]]
        for epoch in range(epochs)
    ]
    coef, intercept = reference_svrg(
        name,
        (X - center) / scale,
        target,
        weight,
        alpha=alpha,
        etas=etas,
        batches=batches,
        coef=np.zeros((X.shape[1], target.shape[1])),
        intercept=family.intercept_start(target, weight),
        penalty=alpha / scale**2,
        decay=alpha / np.min(scale**2),
    )
    assert np.abs(coef).max() > 1e-2  # the fit moved
    np.testing.assert_allclose(state.coef.numpy(), coef, rtol=0, atol=1e-12)
    np.testing.assert_allclose(state.intercept.numpy(), intercept, rtol=0, atol=1e-12)
    # The measured objective is the user's: w = v / D and beta = beta' - m . w.
    w = coef / scale[:, None]
    y = target.argmax(axis=1) if name == "multinomial" else target[:, 0]
    expected = objective(name, X, y, w.T, intercept - center @ w, alpha, weight)
    assert result.loss_curve[-1] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", FAMILIES)
def test_full_pass_measures_the_exact_objective_and_gradient(name):
    family, X, target, weight = make_problem(name)
    alpha = 0.03
    rng = np.random.default_rng(1)
    k = target.shape[1]
    coef, intercept = 0.3 * rng.standard_normal((X.shape[1], k)), rng.standard_normal(k)
    ctx = StepContext(family, PRESETS["fp64"], Penalty(alpha), True, LocalCommunicator())
    data = LocalData(torch.from_numpy(X), torch.from_numpy(target), torch.from_numpy(weight))
    state = ModelState(torch.tensor(coef), torch.tensor(intercept))
    offset = family.loss_offset(target, weight)
    snapshot, measured = full_pass(ctx, data, state, offset)
    y = target.argmax(axis=1) if name == "multinomial" else target[:, 0]
    expected = objective(name, X, y, coef.T, intercept, alpha, weight)
    assert measured.objective == pytest.approx(expected, rel=1e-12)
    weighted = weight[:, None] * numpy_gradient(name, X @ coef + intercept, target)
    gradient = X.T @ weighted / X.shape[0] + alpha * coef
    gradient_intercept = weighted.mean(axis=0)
    np.testing.assert_allclose(snapshot.mean_gradient.numpy(), gradient - alpha * coef, atol=1e-14)
    np.testing.assert_allclose(snapshot.mean_gradient_intercept.numpy(), gradient_intercept)
    largest = max(np.abs(gradient).max(), np.abs(gradient_intercept).max())
    assert measured.gradient_max == pytest.approx(largest, rel=1e-12)


@pytest.mark.parametrize("name", ["logistic", "multinomial", "poisson"])
@pytest.mark.parametrize("offset", [1.5, 40.0])
def test_a_pass_over_preconditioned_rows_equals_one_over_the_rows_stored_so(name, offset):
    """The full pass on ``(x - m) D^{-1}``: read as stored, scaled through its products
    where every center is within CENTERED_PRODUCTS_SPREADS spreads of zero, else scaled
    into a buffer first; either way the pass over the rows stored preconditioned
    (float64)."""
    from sklearn_casgd._data.storage import CenteredRows
    from sklearn_casgd._engine.snapshot import row_blocks

    family, X, target, weight = make_problem(name)
    X = X * np.linspace(0.5, 3.0, X.shape[1]) + offset * np.arange(X.shape[1]) / X.shape[1]
    center, spread = X.mean(axis=0), X.std(axis=0)
    scale = spread * np.linspace(0.3, 1.2, X.shape[1])
    k = target.shape[1]
    rng = np.random.default_rng(2)
    state = ModelState(torch.tensor(rng.standard_normal((X.shape[1], k))), torch.ones(k) / 3)
    state.intercept = state.intercept.double()
    passes = {}
    for stored in (False, True):
        preconditioner = Preconditioner(
            *(torch.tensor(v) for v in (center, scale)), 0.01, torch.tensor(spread), stored
        )
        ctx = StepContext(
            family, PRESETS["fp64"], Penalty(0.01), True, LocalCommunicator(), preconditioner
        )
        rows = (X - center) / scale if stored else X
        data = LocalData(torch.tensor(rows), torch.tensor(target), torch.tensor(weight))
        passes[stored] = full_pass(ctx, data, state, 0.0)
        if not stored:
            near = bool((np.abs(center) <= CENTERED_PRODUCTS_SPREADS * spread).all())
            assert near == (offset == 1.5)  # both paths are taken
            assert (ctx.product_centering is not None) == near
            first = next(row_blocks(ctx, data.X, products_only=True))[2]
            assert isinstance(first, CenteredRows) == near
    (read, measured), (stored, expected) = passes[False], passes[True]
    assert measured.objective == pytest.approx(expected.objective, rel=1e-13)
    assert measured.gradient_max == pytest.approx(expected.gradient_max, rel=1e-12)
    for name_ in ("gradient", "mean_gradient", "mean_gradient_intercept"):
        torch.testing.assert_close(
            getattr(read, name_), getattr(stored, name_), rtol=1e-12, atol=1e-13
        )


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("solver", ["sgd", "svrg"])
@pytest.mark.parametrize("s", [2, 5, 8])
def test_s_step_equals_plain_sgd_in_float64(name, s, solver):
    """Through the public estimator: intercept, L2, sample weights, invscaling."""
    _, X, _, weight = make_problem(name)
    _, y, _ = make_glm_data(name, X.shape[0], X.shape[1], random_state=0)
    estimator_class = FAMILIES[name][1]
    params = dict(
        alpha=0.01,
        batch_size=16,
        learning_rate="invscaling",
        eta0=0.05,
        max_iter=3,
        tol=None,
        precision="fp64",
        random_state=7,
        device="cpu",
        solver=solver,
    )
    plain = estimator_class(s=1, **params).fit(X, y, sample_weight=weight)
    ca = estimator_class(s=s, **params).fit(X, y, sample_weight=weight)
    assert ca.fit_stats_["s"] == s
    assert ca.t_ == plain.t_ == 3 * int(np.ceil(X.shape[0] / 16))
    assert np.abs(plain.coef_).max() > 1e-2  # the fit moved
    np.testing.assert_allclose(ca.coef_, plain.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(ca.intercept_, plain.intercept_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(ca.loss_curve_, plain.loss_curve_, rtol=1e-10)


@pytest.mark.parametrize("name", ["logistic", "multinomial"])
@pytest.mark.parametrize("with_snapshot", [False, True])
def test_one_outer_iteration_with_s_one_is_one_sgd_step(name, with_snapshot):
    family, X, target, weight = make_problem(name, n_samples=40)
    ctx = StepContext(family, PRESETS["fp64"], Penalty(0.1), True, LocalCommunicator())
    data = LocalData(torch.from_numpy(X), torch.from_numpy(target), torch.from_numpy(weight))
    k = target.shape[1]
    if with_snapshot:
        at = ModelState(
            torch.full((X.shape[1], k), 0.1, dtype=torch.float64),
            torch.ones(k, dtype=torch.float64),
        )
        data = replace(data, snapshot=full_pass(ctx, data, at, 0.0)[0])
    rng = np.random.default_rng(0)
    start = rng.standard_normal((X.shape[1], k))
    plain = ModelState(torch.tensor(start), torch.zeros(k, dtype=torch.float64))
    ca = ModelState(torch.tensor(start), torch.zeros(k, dtype=torch.float64))
    rows = torch.arange(5, 25)
    loss_plain = sgd_step(ctx, data, plain, rows, 0.3)
    loss_ca, following = ca_outer_iteration(
        ctx, data, ca, gather_outer_batch(ctx, data, rows, [20]), [0.3]
    )
    assert following is None
    torch.testing.assert_close(ca.coef, plain.coef, rtol=0, atol=1e-13)
    torch.testing.assert_close(ca.intercept, plain.intercept, rtol=0, atol=1e-13)
    torch.testing.assert_close(loss_ca, loss_plain, rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "n_samples, batch_size, s, expected",
    [
        (10, 3, 2, [(0, [3, 3]), (6, [3, 1])]),
        (9, 3, 2, [(0, [3, 3]), (6, [3])]),
        (5, 8, 4, [(0, [5])]),
        (7, 2, 1, [(0, [2]), (2, [2]), (4, [2]), (6, [1])]),
    ],
)
def test_outer_iterations_cover_every_sample(n_samples, batch_size, s, expected):
    plan = outer_iterations(n_samples, batch_size, s)
    assert plan == expected
    assert sum(sum(sizes) for _, sizes in plan) == n_samples


@pytest.mark.parametrize("precision", ["fp64", "bf16"])
def test_the_batch_gathered_during_the_all_reduce_is_the_one_gathered_after_it(precision):
    family, X, target, weight = make_problem("logistic", n_samples=60)
    ctx = StepContext(family, PRESETS[precision], Penalty(0.1), True, LocalCommunicator())
    policy = PRESETS[precision]
    data = LocalData(
        torch.from_numpy(X).to(policy.x_storage),
        torch.from_numpy(target).to(policy.recurrence),
        torch.from_numpy(weight).to(policy.recurrence),
    )
    state = ModelState(
        torch.ones((X.shape[1], 1), dtype=policy.weight_storage),
        torch.zeros(1, dtype=policy.recurrence),
    )
    first = gather_outer_batch(ctx, data, torch.arange(0, 30), [10, 10, 10])
    upcoming = (torch.arange(59, 29, -1), [10, 10, 10])
    _, following = ca_outer_iteration(ctx, data, state, first, [0.1] * 3, upcoming)
    fresh = gather_outer_batch(ctx, data, *upcoming)
    gram_part = slice(0, fresh.margin_start)
    assert following.margin_start == fresh.margin_start == 10 * 10 + 10 * 20
    torch.testing.assert_close(following.packed[gram_part], fresh.packed[gram_part], rtol=0, atol=0)
    torch.testing.assert_close(following.Y, fresh.Y, rtol=0, atol=0)
    torch.testing.assert_close(following.target, fresh.target, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["fp64", "bf16"])
def test_row_steps_form_no_gram_and_need_every_column(precision):
    family, X, target, weight = make_problem("logistic", n_samples=60)
    policy = PRESETS[precision]
    data = LocalData(
        torch.from_numpy(X).to(policy.x_storage),
        torch.from_numpy(target).to(policy.recurrence),
        torch.from_numpy(weight).to(policy.recurrence),
    )
    rows, sizes = torch.arange(30), [10, 10, 10]
    by_gram = StepContext(family, policy, Penalty(0.1), True, LocalCommunicator())
    by_rows = replace(by_gram, row_steps=True)
    gram_batch = gather_outer_batch(by_gram, data, rows, sizes)
    row_batch = gather_outer_batch(by_rows, data, rows, sizes)
    assert gram_batch.packed.numel() == 10 * 10 + 10 * 20 + 30
    assert row_batch.margin_start == 0 and row_batch.packed.numel() == 30  # the margins only
    torch.testing.assert_close(row_batch.Y, gram_batch.Y, rtol=0, atol=0)
    with pytest.raises(ValueError, match="row_steps=True"):
        replace(by_gram, exchange=RowExchange((4, 3)))


@pytest.mark.parametrize(
    "sizes, widths, device_type, gather",
    [
        # Timed both ways on 2 gloo ranks, bf16, epoch seconds reduced /
        # gathered (the table in docs/distributed.md):
        ([32] * 2, (128, 128), "cpu", True),  # d=256, b=32, s=2: 1.506 / 0.210
        ([32] * 8, (128, 128), "cpu", True),  # s=8: 0.272 / 0.127
        ([32] * 32, (128, 128), "cpu", True),  # s=32: 0.293 / 0.128
        ([32] * 2, (512, 512), "cpu", True),  # d=1024, s=2: 1.200 / 0.336
        ([32] * 4, (512, 512), "cpu", True),  # s=4: 0.435 / 0.262
        ([32] * 8, (512, 512), "cpu", True),  # s=8: 0.294 / 0.231
        ([32] * 2, (2048, 2048), "cpu", False),  # d=4096 (n=16384), s=2: 0.213 / 0.229
        ([32] * 4, (2048, 2048), "cpu", False),  # s=4: 0.172 / 0.191
        ([32] * 8, (2048, 2048), "cpu", False),  # s=8: 0.180 / 0.178, even
        ([64] * 8, (32, 32), "cpu", True),  # d=64, b=64, s=8: 0.184 / 0.080
        ([256] * 8, (8, 8), "cpu", True),  # d=16, b=256, s=8: 0.276 / 0.033
        # Where GEMMs are cheap and latency is not priced, bytes decide.
        ([32] * 16, (512, 512), "cuda", False),
        ([32] * 2, (128, 128), "cuda", False),
        ([8] * 3, (1, 1, 0), "cpu", True),  # fewer features than ranks
        ([32] * 8, (256,), "cpu", False),  # one rank: nothing to exchange
    ],
)
def test_rows_are_gathered_where_that_costs_less(sizes, widths, device_type, gather):
    assert prefer_row_exchange(sizes, widths, 1, PRESETS["bf16"], device_type) is gather


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eta_alpha", [1e-6, 0.1, 0.5, 0.9, 0.99, 1.0 - 2.0**-52])
def test_longest_recurrence_keeps_the_decay_product_in_range(dtype, eta_alpha):
    """The longest s keeps C_s at or above the floor, one more step would not.

    The step coefficients of that s are then finite in ``dtype`` (the
    factor of ``U_j`` divides by ``C_{j+1}``), and :func:`recurrence_step`
    of that s allows the step back.
    """
    alpha = 3.0
    s = longest_recurrence(eta_alpha / alpha, alpha, dtype)
    decay = 1.0 - eta_alpha
    smallest = SMALLEST_DECAY_PRODUCT[dtype]
    assert s >= 1
    if s > 1:
        assert decay**s >= smallest * (1.0 - 1e-12)
    assert decay ** (s + 1) < smallest * (1.0 + 1e-12)
    if s < 1000:
        coefficients = step_coefficients(
            [eta_alpha / alpha] * s, [4] * s, alpha, dtype, torch.device("cpu")
        )
        assert torch.isfinite(coefficients).all()
        assert coefficients[2, s] > 0.0
        assert recurrence_step(s, alpha, dtype) >= eta_alpha / alpha * (1.0 - 1e-12)
    assert recurrence_step(s + 1, alpha, dtype) < eta_alpha / alpha * (1.0 + 1e-12)


def test_longest_recurrence_without_a_penalty_is_unbounded():
    assert longest_recurrence(1.0, 0.0, torch.float32) > 10**9
    assert recurrence_step(10**6, 0.0, torch.float32) == float("inf")
