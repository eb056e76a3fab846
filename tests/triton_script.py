"""Run by tests/test_triton.py with ``TRITON_INTERPRET=1``: fused against torch row steps.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so the
interpreter gets a process of its own. Prints one JSON object: per case,
whether the kernel ran and the largest differences of the coefficients,
the intercept and the outer iterations' losses.
"""

import json
import os
from dataclasses import replace

import numpy as np
import torch

from sklearn_casgd import CASGDLogisticRegression, _engine
from sklearn_casgd._comm import LocalCommunicator
from sklearn_casgd._families import (
    BinomialFamily,
    GammaFamily,
    PoissonFamily,
    SquaredErrorFamily,
    TweedieFamily,
)
from sklearn_casgd._kernel import (
    LocalData,
    ModelState,
    Preconditioner,
    StepContext,
    _inner_spec,
    ca_outer_iteration,
    gather_outer_batch,
)
from sklearn_casgd._precision import PRESETS
from sklearn_casgd._snapshot import full_pass
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
for name, family in FAMILIES.items():
    for solver in ("sgd", "svrg"):
        for fit_intercept in (True, False):
            data = problem(name)
            preconditioner = None
            if solver == "svrg":  # preconditioned SVRG: a snapshot and the drift terms
                rng = np.random.default_rng(3)
                center = torch.from_numpy(rng.normal(0, 0.3, 5))
                scale = torch.from_numpy(rng.uniform(0.5, 2.0, 5))
                preconditioner = Preconditioner(center, scale, 0.05 / float(scale.min()) ** 2)
            ctx = StepContext(
                family, PRESETS["fp64"], 0.05, fit_intercept, LocalCommunicator(),
                preconditioner, row_steps=True,
            )  # fmt: skip
            if solver == "svrg":
                at = ModelState(
                    torch.full((5, 1), 0.1, dtype=torch.float64),
                    torch.zeros(1, dtype=torch.float64),
                )
                data = replace(data, snapshot=full_pass(ctx, data, at, 0.0)[0])
            results[f"{name}-{solver}-{fit_intercept}"] = gaps(ctx, data, groups)

# The bf16 recipe: bf16 rows, the recurrence in float32.
policy = PRESETS["bf16"]
data = problem("logistic", n_samples=96, n_features=6)
data = LocalData(
    data.X.to(policy.x_storage),
    data.target.to(policy.recurrence),
    data.sample_weight.to(policy.recurrence),
)
ctx = StepContext(BinomialFamily(), policy, 1e-3, True, LocalCommunicator(), row_steps=True)
results["bf16"] = gaps(ctx, data, [(torch.arange(i, i + 32), [8] * 4, [0.5] * 4) for i in (0, 32)])
# Through a fit: FUSED_ROW_STEPS turned on for the CPU (the interpreter), with
# compile=True, which the fused kernel replaces.
X, y, _ = make_glm_data("logistic", 203, 6, random_state=0)
params = dict(s=4, batch_size=16, precision="fp64", max_iter=3, tol=None, random_state=0)
torch_fit = CASGDLogisticRegression(compile=False, **params).fit(X, y)
_engine.FUSED_ROW_STEPS["cpu"] = True
fused_fit = CASGDLogisticRegression(compile=True, **params).fit(X, y)
results["estimator"] = {
    "coef": float(np.abs(fused_fit.coef_ - torch_fit.coef_).max()),
    "compiled": fused_fit.fit_stats_["compiled"],
}
print(json.dumps(results))
