"""Run by tests/test_triton.py with ``TRITON_INTERPRET=1``: the kernels against torch steps.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so the
interpreter gets a process of its own. Prints one JSON object: per case,
whether the kernel ran and the largest differences of the coefficients,
the intercept and the losses; the fused row steps against the torch row
steps, the epoch kernel against :func:`sgd_step` one batch at a time.
"""

import json
import os
from dataclasses import replace

import numpy as np
import torch

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._engine import execution
from sklearn_casgd._engine.batch import gather_outer_batch
from sklearn_casgd._engine.comm import LocalCommunicator
from sklearn_casgd._engine.epoch_kernel import run_epoch
from sklearn_casgd._engine.precision import PRESETS
from sklearn_casgd._engine.recurrence import _inner_spec, ca_outer_iteration, sgd_step
from sklearn_casgd._engine.snapshot import full_pass
from sklearn_casgd._engine.state import LocalData, ModelState, Preconditioner, StepContext
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

assert os.environ.get("TRITON_INTERPRET") == "1"
torch.set_num_threads(1)
FAMILIES = {
    "logistic": BinomialFamily(),
    "linear": SquaredErrorFamily(),
    "poisson": PoissonFamily(),
    "gamma": GammaFamily(),
    "tweedie": TweedieFamily(1.5),
}


def problem(name, n_samples=64, n_features=5, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_samples, n_features))
    raw = X @ rng.uniform(-0.3, 0.3, n_features)
    if name == "multinomial":  # three classes, one-hot
        labels = rng.integers(0, 3, n_samples)
        target = torch.nn.functional.one_hot(torch.from_numpy(labels), 3).double()
        weight = torch.from_numpy(rng.uniform(0.5, 2.0, n_samples))
        return LocalData(torch.from_numpy(X), target, weight)
    if name == "logistic":
        y = (rng.random(n_samples) < 1 / (1 + np.exp(-raw))).astype(float)
    elif name == "linear":
        y = raw + 0.1 * rng.standard_normal(n_samples)
    elif name == "poisson":
        y = rng.poisson(np.exp(raw)).astype(float)
    else:  # gamma, tweedie: positive targets
        y = rng.gamma(2.0, np.exp(raw) / 2.0)
    weight = rng.uniform(0.5, 2.0, n_samples)
    return LocalData(torch.from_numpy(X), torch.from_numpy(y[:, None]), torch.from_numpy(weight))


def run(ctx, data, groups):
    state = ModelState(
        torch.linspace(-0.2, 0.2, data.X.shape[1], dtype=ctx.policy.weight_storage)[:, None],
        torch.full((1,), 0.1, dtype=ctx.policy.recurrence),
    )
    losses = []
    for rows, sizes, etas in groups:
        batch = gather_outer_batch(ctx, data, rows, sizes)
        losses.append(ca_outer_iteration(ctx, data, state, batch, etas)[0])
    return state, torch.stack(losses)


def gaps(torch_steps, data, groups):
    fused = replace(torch_steps, fused=True)
    ran = _inner_spec(fused, gather_outer_batch(fused, data, *groups[0][:2])).fused
    expected, expected_losses = run(torch_steps, data, groups)
    got, got_losses = run(fused, data, groups)
    return {
        "fused": ran,
        "moved": (expected.coef.double() + 0.0).abs().max().item(),
        "coef": (got.coef - expected.coef).abs().max().item(),
        "intercept": (got.intercept - expected.intercept).abs().max().item(),
        "loss": ((got_losses - expected_losses).abs() / expected_losses.abs()).max().item(),
    }


results = {}
order = torch.randperm(64, generator=torch.Generator().manual_seed(1))
# s=3, b=7: neither b nor d=5 a power of two (masked tiles); a ragged outer
# iteration last, which the torch steps take.
groups = [
    (order[:21], [7, 7, 7], [0.3, 0.2, 0.1]),
    (order[21:42], [7, 7, 7], [0.05] * 3),
    (order[42:63], [7, 7, 7], [0.1, 0.2, 0.3]),
    (order[43:62], [7, 7, 5], [0.2, 0.1, 0.1]),
]


def float64_case(name, family, solver, fit_intercept):
    """The problem and a float64 row-step context; SVRG preconditioned, with a snapshot."""
    data = problem(name)
    k = data.target.shape[1]
    preconditioner = None
    if solver == "svrg":  # preconditioned SVRG: a snapshot and the drift terms
        rng = np.random.default_rng(3)
        center = torch.from_numpy(rng.normal(0, 0.3, 5))
        scale = torch.from_numpy(rng.uniform(0.5, 2.0, 5))
        preconditioner = Preconditioner(center, scale, 0.05 / float(scale.min()) ** 2)
    ctx = StepContext(
        family, PRESETS["fp64"], Penalty(0.05), fit_intercept, LocalCommunicator(),
        preconditioner, row_steps=True,
    )  # fmt: skip
    if solver == "svrg":
        at = ModelState(
            torch.full((5, k), 0.1, dtype=torch.float64),
            torch.zeros(k, dtype=torch.float64),
        )
        data = replace(data, snapshot=full_pass(ctx, data, at, 0.0)[0])
    return ctx, data


for name, family in FAMILIES.items():
    for solver in ("sgd", "svrg"):
        for fit_intercept in (True, False):
            ctx, data = float64_case(name, family, solver, fit_intercept)
            results[f"{name}-{solver}-{fit_intercept}"] = gaps(ctx, data, groups)

# The bf16 recipe: bf16 rows, the recurrence in float32.
policy = PRESETS["bf16"]
data = problem("logistic", n_samples=96, n_features=6)
data = LocalData(
    data.X.to(policy.x_storage),
    data.target.to(policy.recurrence),
    data.sample_weight.to(policy.recurrence),
)
ctx = StepContext(
    BinomialFamily(), policy, Penalty(1e-3), True, LocalCommunicator(), row_steps=True
)
results["bf16"] = gaps(ctx, data, [(torch.arange(i, i + 32), [8] * 4, [0.5] * 4) for i in (0, 32)])
# Through a fit: FUSED_ROW_STEPS turned on for the CPU (the interpreter), with
# compile=True, which the fused kernel replaces.
X, y, _ = make_glm_data("logistic", 203, 6, random_state=0)
params = dict(s=4, batch_size=16, precision="fp64", max_iter=3, tol=None, random_state=0)
torch_fit = CASGDLogisticRegression(compile=False, **params).fit(X, y)
execution.FUSED_ROW_STEPS["cpu"] = True
fused_fit = CASGDLogisticRegression(compile=True, **params).fit(X, y)
results["estimator"] = {
    "coef": float(np.abs(fused_fit.coef_ - torch_fit.coef_).max()),
    "compiled": fused_fit.fit_stats_["compiled"],
}


# The epoch kernel: 64 rows in batches of 7 (a ragged last of 1), a step size
# a batch, against sgd_step one batch at a time.
def epoch_gaps(ctx, data, order, etas, batch_size, with_loss):
    k = data.target.shape[1]
    start = torch.linspace(-0.2, 0.2, data.X.shape[1] * k, dtype=ctx.policy.weight_storage)
    expected = ModelState(start.view(-1, k).clone(), torch.full((k,), 0.1).to(start.dtype))
    got = ModelState(start.view(-1, k).clone(), torch.full((k,), 0.1).to(start.dtype))
    expected_loss = torch.zeros((), dtype=torch.float64)
    for j, lo in enumerate(range(0, order.shape[0], batch_size)):
        loss = sgd_step(ctx, data, expected, order[lo : lo + batch_size], etas[j], with_loss)
        if with_loss:
            expected_loss += loss.double()
    got_loss = run_epoch(
        replace(ctx, epoch_kernel=True), data, got, order, etas, batch_size, with_loss
    )
    return {
        "moved": (expected.coef.double() - start.view(-1, k).double()).abs().max().item(),
        "coef": (got.coef - expected.coef).abs().max().item(),
        "intercept": (got.intercept - expected.intercept).abs().max().item(),
        "loss": 0.0
        if not with_loss
        else abs(got_loss.double().item() - expected_loss.item()) / abs(expected_loss.item()),
    }


EPOCH_FAMILIES = {**FAMILIES, "multinomial": MultinomialFamily()}
order = torch.randperm(64, generator=torch.Generator().manual_seed(2))
etas = [0.3, 0.2, 0.1, 0.05, 0.1, 0.2, 0.3, 0.2, 0.1, 0.3 / 7]
for name, family in EPOCH_FAMILIES.items():
    for solver in ("sgd", "svrg"):
        for fit_intercept in (True, False):
            ctx, data = float64_case(name, family, solver, fit_intercept)
            key = f"epoch-{name}-{solver}-{fit_intercept}"
            results[key] = epoch_gaps(ctx, data, order, etas, 7, solver == "sgd")

# float32 (the fp32 preset, preconditioned SVRG), and the bf16 recipe: bf16
# rows preconditioned and rounded to bf16, margins rounded to bf16, float32
# steps. A margin whose float32 sum lies near a bf16 rounding boundary may
# round the other way in the kernel's summation order (one bf16 ulp, ~0.4 %),
# so bf16 is held to its own resolution, and to be nearer the torch bf16
# steps than the same steps without its roundings (the fp32 preset on the
# same bf16 rows).
for name in ("fp32", "bf16"):
    policy = PRESETS[name]
    data = problem("logistic", n_samples=96, n_features=6)
    data = LocalData(
        data.X.to(policy.x_storage),
        data.target.to(policy.recurrence),
        data.sample_weight.to(policy.recurrence),
    )
    preconditioner = Preconditioner(torch.full((6,), 0.1), torch.linspace(0.5, 2.0, 6), 4e-3)
    ctx = StepContext(
        BinomialFamily(),
        policy,
        Penalty(1e-3),
        True,
        LocalCommunicator(),
        preconditioner,
        row_steps=True,
    )
    results[f"epoch-{name}"] = epoch_gaps(ctx, data, torch.arange(96), [0.5] * 12, 8, True)
    if name == "bf16":
        unrounded = replace(ctx, policy=PRESETS["fp32"])
        got = ModelState(torch.zeros((6, 1)), torch.zeros(1))
        run_epoch(
            replace(ctx, epoch_kernel=True), data, got, torch.arange(96), [0.5] * 12, 8, False
        )
        for label, reference_ctx in (("torch bf16", ctx), ("torch unrounded", unrounded)):
            expected = ModelState(torch.zeros((6, 1)), torch.zeros(1))
            for lo in range(0, 96, 8):
                sgd_step(reference_ctx, data, expected, torch.arange(lo, lo + 8), 0.5, False)
            results[f"epoch-bf16 against {label}"] = (got.coef - expected.coef).abs().max().item()

# Through fits: EPOCH_KERNEL on for the CPU (the interpreter). Plain SGD at
# s=4 against the torch s-step fit (the same iterates in exact arithmetic),
# SVRG on iris's three classes against its torch steps.
params = dict(s=4, batch_size=16, precision="fp64", max_iter=3, tol=None, random_state=0)
torch_fit = CASGDLogisticRegression(solver="sgd", **params).fit(X, y)
from sklearn.datasets import load_iris  # noqa: E402

X_iris, y_iris = load_iris(return_X_y=True)
iris_params = dict(batch_size=16, precision="fp64", max_iter=4, tol=None, random_state=0)
iris_torch = CASGDLogisticRegression(**iris_params).fit(X_iris, y_iris)
execution.EPOCH_KERNEL["cpu"] = True
kernel_fit = CASGDLogisticRegression(solver="sgd", **params).fit(X, y)
iris_kernel = CASGDLogisticRegression(**iris_params).fit(X_iris, y_iris)
execution.EPOCH_KERNEL["cpu"] = False
results["epoch-estimator"] = {
    "coef": float(np.abs(kernel_fit.coef_ - torch_fit.coef_).max()),
    "loss": float(np.abs(np.subtract(kernel_fit.loss_curve_, torch_fit.loss_curve_)).max()),
    "moved": float(np.abs(torch_fit.coef_).max()),
    "iris coef": float(np.abs(iris_kernel.coef_ - iris_torch.coef_).max()),
    "iris moved": float(np.abs(iris_torch.coef_).max()),
}


# The fused pass against the torch pass: 3000 rows in three blocks (a ragged
# last), preconditioned; SVRG keeps each row's derivative, Newton's none.
def pass_gaps(ctx, data, state):
    expected, expected_measured = full_pass(ctx, data, state, 0.0)
    got, measured = full_pass(replace(ctx, fused_pass=True), data, state, 0.0)
    gaps = {
        "mean_gradient": (got.mean_gradient - expected.mean_gradient).abs().max().item(),
        "intercept": (got.mean_gradient_intercept - expected.mean_gradient_intercept)
        .abs()
        .max()
        .item(),
        "objective": abs(measured.objective - expected_measured.objective)
        / abs(expected_measured.objective),
        "gradient_max": abs(measured.gradient_max - expected_measured.gradient_max),
        "raw_max": abs(measured.raw_max - expected_measured.raw_max),
        "resolution": abs(measured.resolution / expected_measured.resolution - 1),
        "scale": expected.mean_gradient.abs().max().item(),
    }
    if expected.gradient is not None:
        gaps["rows"] = (got.gradient - expected.gradient).abs().max().item()
    return gaps


for name, family in EPOCH_FAMILIES.items():
    for solver in ("svrg", "newton"):
        data = problem(name, n_samples=3000)
        k = data.target.shape[1]
        rng = np.random.default_rng(4)
        preconditioner = Preconditioner(
            torch.from_numpy(rng.normal(0, 0.3, 5)), torch.from_numpy(rng.uniform(0.5, 2, 5)), 0.01
        )
        ctx = StepContext(
            family, PRESETS["fp64"], Penalty(0.05), True, LocalCommunicator(), preconditioner,
            row_steps=True, newton=solver == "newton",
        )  # fmt: skip
        state = ModelState(
            torch.linspace(-0.2, 0.2, 5 * k, dtype=torch.float64).view(5, k),
            torch.full((k,), 0.1, dtype=torch.float64),
        )
        results[f"pass-{name}-{solver}"] = pass_gaps(ctx, data, state)

policy = PRESETS["bf16"]
data = problem("logistic", n_samples=3000, n_features=6)
data = LocalData(
    data.X.to(policy.x_storage),
    data.target.to(policy.recurrence),
    data.sample_weight.to(policy.recurrence),
)
preconditioner = Preconditioner(torch.full((6,), 0.1), torch.linspace(0.5, 2.0, 6), 4e-3)
ctx = StepContext(
    BinomialFamily(),
    policy,
    Penalty(1e-3),
    True,
    LocalCommunicator(),
    preconditioner,
    row_steps=True,
)
state = ModelState(torch.linspace(-0.5, 0.5, 6)[:, None], torch.full((1,), 0.1))
results["pass-bf16"] = pass_gaps(ctx, data, state)

# Through fits: FUSED_PASS on for the CPU; minibatch SVRG and Newton epochs.
from sklearn.datasets import load_breast_cancer  # noqa: E402

X_bc, y_bc = load_breast_cancer(return_X_y=True)
fits = {
    "minibatch": dict(batch_size=32, s=1, precision="fp64", max_iter=5, tol=None),
    # tol=None: the fused pass forms no certificate's sums, so it runs fits without one.
    "newton": dict(precision="fp64", tol=None, max_iter=8),
}
for label, fit_params in fits.items():
    torch_pass = CASGDLogisticRegression(random_state=0, **fit_params).fit(X_bc, y_bc)
    execution.FUSED_PASS["cpu"] = True
    fused_pass = CASGDLogisticRegression(random_state=0, **fit_params).fit(X_bc, y_bc)
    execution.FUSED_PASS["cpu"] = False
    results[f"pass-estimator-{label}"] = {
        "coef": float(np.abs(fused_pass.coef_ - torch_pass.coef_).max()),
        "moved": float(np.abs(torch_pass.coef_).max()),
        "newton": bool((fused_pass.fit_stats_["plan"] or {}).get("newton")),
        "epochs": [fused_pass.n_iter_, torch_pass.n_iter_],
        "fused_pass": bool(fused_pass.fit_stats_["execution"]["fused_pass"]),
    }
print(json.dumps(results))
