"""The compiled inner steps: one graph, no break, the eager arithmetic (float64).

Compiling costs seconds per shape on a CPU (more with a cold inductor
cache), so these tests compile a handful of small shapes only.
"""

import functools
import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from sklearn.datasets import load_breast_cancer
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression
from sklearn_casgd._accel.compile import StaticCompiled
from sklearn_casgd._engine import recurrence
from sklearn_casgd._engine.batch import GatherSpec, gather_outer_batch, gather_rows
from sklearn_casgd._engine.comm import LocalCommunicator
from sklearn_casgd._engine.execution import AUTO_COMPILE_MIN_OUTER, use_compiled
from sklearn_casgd._engine.precision import PRESETS
from sklearn_casgd._engine.recurrence import ca_outer_iteration, step_coefficients
from sklearn_casgd._engine.snapshot import full_pass
from sklearn_casgd._engine.state import LocalData, ModelState, Preconditioner, StepContext
from sklearn_casgd._glm.families import BinomialFamily, SquaredErrorFamily
from sklearn_casgd._glm.penalties import Penalty

FP64 = PRESETS["fp64"]


def problem(n_samples=48, n_features=6, seed=0):
    rng = np.random.default_rng(seed)
    X = torch.from_numpy(rng.standard_normal((n_samples, n_features)))
    target = torch.from_numpy((rng.random((n_samples, 1)) < 0.4).astype(np.float64))
    weight = torch.from_numpy(rng.uniform(0.5, 2.0, n_samples))
    return LocalData(X, target, weight)


def preconditioner(n_features):
    rng = np.random.default_rng(3)
    center = torch.from_numpy(rng.normal(0, 0.5, n_features))
    scale = torch.from_numpy(rng.uniform(0.5, 2.0, n_features))
    return Preconditioner(center, scale, decay_alpha=0.05 / float(scale.min()) ** 2)


@pytest.mark.parametrize("row_steps", [False, True])
def test_compiled_outer_iteration_is_one_graph_and_matches_eager_in_float64(row_steps):
    """SVRG steps (snapshot, intercept, preconditioned rows), with a ragged last batch."""
    data = problem()
    ctx = StepContext(
        BinomialFamily(), FP64, Penalty(0.05), True, LocalCommunicator(), preconditioner(6),
        row_steps=row_steps,
    )  # fmt: skip
    at = ModelState(
        torch.full((6, 1), 0.2, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    )
    data = replace(data, snapshot=full_pass(ctx, data, at, 0.0)[0])
    states = {
        compiled: ModelState(
            torch.linspace(-1, 1, 6, dtype=torch.float64)[:, None],
            torch.zeros(1, dtype=torch.float64),
        )
        for compiled in (False, True)
    }
    order = torch.randperm(48, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    groups = [(order[:24], [8, 8, 8]), (order[24:], [8, 8, 8]), (order[:21], [8, 8, 5])]
    etas = [[0.3, 0.2, 0.1], [0.05] * 3, [0.1, 0.2, 0.3]]
    losses = {}
    for compiled, state in states.items():
        run = replace(ctx, compiled=compiled)
        losses[compiled] = [
            ca_outer_iteration(run, data, state, gather_outer_batch(run, data, *group), eta)[0]
            for group, eta in zip(groups, etas, strict=True)
        ]
    assert states[True].coef.abs().max() > 0.1  # the steps moved
    torch.testing.assert_close(states[True].coef, states[False].coef, rtol=0, atol=1e-13)
    torch.testing.assert_close(states[True].intercept, states[False].intercept, rtol=0, atol=1e-13)
    for compiled_loss, eager_loss in zip(losses[True], losses[False], strict=True):
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-13, atol=0)


def test_gather_compiles_as_one_graph():
    """The gather runs eager (it is GEMM-bound) but has no graph break either."""
    data = problem()
    center, scale = preconditioner(6).center, preconditioner(6).scale
    spec = GatherSpec(
        (8, 8, 8), 1, torch.float64, torch.float64, torch.float64, torch.float64, torch.float64
    )
    compiled = torch.compile(functools.partial(gather_rows, spec), fullgraph=True, dynamic=False)
    rows = torch.arange(40, 16, -1)
    arguments = (data.X, rows, data.target, data.sample_weight, None, center, scale)
    packed, *rest = compiled(*arguments)
    expected_packed, *expected_rest = gather_rows(spec, *arguments)
    gram_part = slice(0, 8 * 8 + 8 * 16)
    torch.testing.assert_close(packed[gram_part], expected_packed[gram_part], rtol=1e-14, atol=0)
    for got, expected in zip(rest, expected_rest, strict=True):
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_step_coefficients_unroll_the_decay_and_the_snapshot_drift():
    etas, sizes, alpha = [0.5, 0.25, 0.125], [4, 4, 2], 0.2
    coefficients = step_coefficients(etas, sizes, alpha, torch.float64, torch.device("cpu"))
    decay = np.cumprod([1.0] + [1 - eta * alpha for eta in etas])  # C_0 .. C_s
    drift = [0.0]  # D_{j+1} = (1 - eta_j alpha) D_j + eta_j
    for eta in etas:
        drift.append(drift[-1] * (1 - eta * alpha) + eta)
    np.testing.assert_allclose(coefficients[0, :3], np.array(etas) / (np.array(sizes) * decay[1:]))
    np.testing.assert_allclose(coefficients[1, :3], decay[1:])
    np.testing.assert_allclose(coefficients[2], decay)
    np.testing.assert_allclose(coefficients[3], drift)
    np.testing.assert_allclose(coefficients[4], np.cumsum([0.0, *etas]))


def test_compile_true_fits_the_same_model_as_eager_and_reports_it(monkeypatch):
    """With a ragged last batch: the repeated shape compiled once, before the epochs."""
    monkeypatch.setattr(recurrence, "_COMPILED", {})
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)[:203, :8]
    y = X @ np.linspace(-1, 1, 8) + 0.1 * y[:203]
    fits = {
        compiled: CASGDLinearRegression(
            s=4, batch_size=16, precision="fp64", compile=compiled, max_iter=5, tol=None,
            random_state=0,
        ).fit(X, y)
        for compiled in (False, True)
    }  # fmt: skip
    np.testing.assert_allclose(fits[True].coef_, fits[False].coef_, rtol=0, atol=1e-12)
    assert fits[True].fit_stats_["compiled"] and not fits[False].fit_stats_["compiled"]
    assert fits[True].fit_stats_["compile_seconds"] > 0 == fits[False].fit_stats_["compile_seconds"]
    # The warm-up met every input signature that the epochs compiled (a new
    # one would compile, seconds, in the middle of training); the tail, (11,)
    # once per epoch, ran eager.
    assert [spec.sizes for spec, _ in recurrence._COMPILED] == [(16,) * 4]
    assert [len(steps.signatures) for steps in recurrence._COMPILED.values()] == [1]
    # Another fold's tail is another shape: it compiles nothing.
    CASGDLinearRegression(
        s=4, batch_size=16, precision="fp64", compile=True, max_iter=1, tol=None
    ).fit(X[:198], y[:198])
    assert [len(steps.signatures) for steps in recurrence._COMPILED.values()] == [1]


@pytest.mark.parametrize(
    "setting, device, outer, expected",
    [
        (True, "cpu", 1, True),
        (False, "cuda", 10**9, False),
        ("auto", "cpu", AUTO_COMPILE_MIN_OUTER["cpu"] - 1, False),
        ("auto", "cpu", AUTO_COMPILE_MIN_OUTER["cpu"], True),
        ("auto", "cuda", AUTO_COMPILE_MIN_OUTER["cuda"], True),
    ],
)
def test_compile_auto_compiles_only_long_epochs(setting, device, outer, expected):
    assert use_compiled(setting, torch.device(device), outer) is expected


@pytest.mark.parametrize("row_steps", [False, True])
def test_squared_error_without_intercept_compiles_too(row_steps):
    data = problem(n_samples=24)
    data = replace(data, target=data.X @ torch.ones(6, 1, dtype=torch.float64))
    ctx = StepContext(
        SquaredErrorFamily(), FP64, Penalty(0.0), False, LocalCommunicator(), row_steps=row_steps
    )
    states = {
        c: ModelState(torch.zeros((6, 1), dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
        for c in (False, True)
    }
    for compiled, state in states.items():
        run = replace(ctx, compiled=compiled)
        for _ in range(3):
            batch = gather_outer_batch(run, data, torch.arange(24), [12, 12])
            ca_outer_iteration(run, data, state, batch, [0.05, 0.05])
    assert states[True].intercept.item() == 0.0
    torch.testing.assert_close(states[True].coef, states[False].coef, rtol=0, atol=1e-13)


def scaled_update(weights, rows, scale, offset):
    """A stand-in for the steps: reads every argument, updates ``weights`` in place."""
    weights.sub_(rows.T @ (rows @ weights) * scale)
    return weights.sum() if offset is None else weights.sum() + offset.sum()


def test_static_compiled_keeps_one_graph_per_input_signature_and_matches_eager():
    """The signature stands in for dynamo's guards: strides and None-ness included."""
    compiled = StaticCompiled(scaled_update)
    rng = np.random.default_rng(0)
    rows = torch.from_numpy(rng.standard_normal((6, 4)))
    scale, offset = torch.tensor(0.01, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    calls = [
        (rows, None),
        (rows + 1.0, None),  # same signature: no new graph
        (rows, offset),  # a tensor where there was None
        (torch.from_numpy(rng.standard_normal((4, 6))).T, None),  # transposed strides
        (rows[:, :3].contiguous(), None),  # another width
    ]
    for arguments, expected_signatures in zip(calls, [1, 1, 2, 3, 4], strict=True):
        width = arguments[0].shape[1]
        got_weights = torch.linspace(-1, 1, width, dtype=torch.float64)[:, None].contiguous()
        want_weights = got_weights.clone()
        got = compiled(got_weights, arguments[0], scale, arguments[1])
        want = scaled_update(want_weights, arguments[0], scale, arguments[1])
        torch.testing.assert_close(got_weights, want_weights, rtol=1e-15, atol=0)
        torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
        assert len(compiled.signatures) == expected_signatures
    assert compiled.ahead_of_time == hasattr(torch.compile(scaled_update), "aot_compile")


def test_fit_stats_say_how_the_epochs_ran():
    """Rows, Gram or Newton steps, the exchange and every kernel switch, decided once."""
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    off = dict(fused=False, epoch_kernel=False, fused_pass=False, graphs=False)
    minibatch = CASGDLogisticRegression(batch_size=32, max_iter=2, tol=None, compile=False)
    stats = minibatch.fit(X, y).fit_stats_["execution"]
    assert stats == dict(steps="rows", exchange="none", compiled=False, **off)
    newton = CASGDLogisticRegression().fit(X, y).fit_stats_
    assert newton["plan"]["newton"] and newton["execution"]["steps"] == "newton"
    sparse = CASGDLogisticRegression(batch_size=32, max_iter=2, tol=None)
    stats = sparse.fit(sp.csr_matrix(X), y).fit_stats_["execution"]
    kernel = importlib.util.find_spec("numba") is not None  # the sparse epoch kernel runs
    assert stats["epoch_kernel"] is kernel and stats["exchange"] == "none"
    assert stats["steps"] == ("rows" if kernel else "gram")
