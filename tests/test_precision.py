"""The precision policy: presets, the Gram recipe, range checks."""

import dataclasses
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from conftest import objective

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression
from sklearn_casgd._data.storage import as_storage, stores_preconditioned
from sklearn_casgd._engine.batch import gather_outer_batch
from sklearn_casgd._engine.comm import LocalCommunicator
from sklearn_casgd._engine.precision import (
    PRESETS,
    gram_block,
    gram_operand,
    policy_for_solver,
    resolve_policy,
)
from sklearn_casgd._engine.state import LocalData, Preconditioner, StepContext, precondition_rows
from sklearn_casgd._glm.families import BinomialFamily
from sklearn_casgd._glm.penalties import Penalty
from sklearn_casgd._registry import FAMILIES
from sklearn_casgd.datasets import make_glm_data


def relative_error(approx, exact):
    return float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_gram_accumulates_and_returns_in_float32(low):
    """The recipe's Gram has fp32 accumulation error (~1e-7), not bf16 output error (~1e-3)."""
    policy = PRESETS[low]
    rng = np.random.default_rng(0)
    Y = torch.from_numpy(rng.standard_normal((256, 512))).to(policy.x_storage)
    rounded = Y.to(torch.float64).numpy()  # exactly the stored low-precision values
    exact = rounded[128:] @ rounded[:128].T

    operand = gram_operand(Y, policy)
    G = gram_block(operand[128:], operand[:128], policy.gram_accumulate)
    assert G.dtype == torch.float32
    assert relative_error(G.to(torch.float64).numpy(), exact) < 1e-6

    # What the test guards against: a GEMM in the storage dtype rounds its output.
    naive = (Y[128:] @ Y[:128].T).to(torch.float64).numpy()
    assert relative_error(naive, exact) > 1e-4


def test_presets_name_nine_choices():
    fields = [f.name for f in dataclasses.fields(PRESETS["bf16"]) if f.name != "name"]
    assert len(fields) == 9
    bf16 = PRESETS["bf16"]
    assert bf16.x_storage == bf16.margin_storage == bf16.gram_input == torch.bfloat16
    assert bf16.gram_accumulate == bf16.gram_comm == bf16.recurrence == torch.float32
    assert bf16.update_accumulate == bf16.weight_storage == torch.float32
    for name in ("fp64", "fp32"):
        dtypes = {getattr(PRESETS[name], f) for f in fields}
        assert dtypes == {getattr(torch, {"fp64": "float64", "fp32": "float32"}[name])}
    with pytest.raises(dataclasses.FrozenInstanceError):
        bf16.x_storage = torch.float32


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_svrg_keeps_the_margins_in_the_recurrence_dtype_and_sgd_the_recipe(low):
    recipe = PRESETS[low]
    svrg = policy_for_solver(recipe, "svrg")
    assert svrg.margin_storage == recipe.recurrence == torch.float32
    assert dataclasses.replace(svrg, margin_storage=recipe.margin_storage) == recipe
    assert policy_for_solver(recipe, "sgd") == recipe
    assert policy_for_solver(PRESETS["fp64"], "svrg") == PRESETS["fp64"]


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_preconditioned_rows_are_the_rows_the_gram_is_formed_from(low):
    """The Gram of a preconditioned outer iteration is Y Y^T of the rows the margins use.

    (x - m) / D is computed in float32 and the Gram reads it in the low
    dtype: unless the rows are rounded once, for every use, the recurrence's
    Gram and its rows differ by that rounding (~1e-3), not by float32's.
    """
    policy = PRESETS[low]
    rng = np.random.default_rng(0)
    X = torch.from_numpy(rng.standard_normal((48, 20)) * 3 + 1).to(policy.x_storage)
    center = torch.from_numpy(rng.normal(1, 0.1, 20)).float()
    scale = torch.from_numpy(rng.uniform(2.0, 4.0, 20)).float()
    preconditioner = Preconditioner(center, scale, decay_alpha=0.01)
    ctx = StepContext(
        BinomialFamily(), policy, Penalty(0.01), True, LocalCommunicator(), preconditioner
    )
    data = LocalData(X, torch.zeros(48, 1), torch.ones(48))
    batch = gather_outer_batch(ctx, data, torch.arange(48), [16, 16, 16])
    Y = batch.Y.to(torch.float64)
    assert torch.equal(Y, Y.to(policy.gram_input).to(torch.float64))  # values of the Gram dtype
    # The full pass (SVRG's snapshot) sees the same rows as the steps.
    assert torch.equal(ctx.rows(X).to(torch.float64), Y)
    full = (Y @ Y.T).numpy()
    for lo, hi in ((16, 32), (32, 48)):
        block = full[lo:hi, :lo]
        start = 0 if lo == 16 else 16 * 16
        G = batch.packed[start : start + block.size].view(block.shape).to(torch.float64).numpy()
        assert relative_error(G, block) < 1e-6


def test_auto_precision_is_fp32_on_cpu():
    assert resolve_policy("auto", torch.device("cpu")).name == "fp32"
    with pytest.raises(ValueError, match="precision"):
        resolve_policy("int8", torch.device("cpu"))


@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16", "fp16"])
def test_fit_stats_report_precision(precision):
    X = np.random.default_rng(0).standard_normal((100, 4))
    y = (X[:, 0] > 0).astype(int)
    clf = CASGDLogisticRegression(precision=precision, max_iter=5, tol=None).fit(X, y)
    assert clf.fit_stats_["precision"] == precision
    assert clf.coef_.dtype == np.float64
    assert clf.predict_proba(X).dtype == np.float64


def test_data_outside_fp16_range_is_rejected():
    """Plain SGD stores X as it is: a value beyond float16's range is a clear error."""
    X = np.random.default_rng(0).standard_normal((50, 3))
    X[3, 1] = 1e6  # > 65504, the largest float16
    y = X[:, 0]
    X_before = X.copy()
    with pytest.raises(ValueError, match=r"range of torch\.float16"):
        CASGDLinearRegression(precision="fp16", solver="sgd").fit(X, y)
    np.testing.assert_array_equal(X, X_before)
    # bf16 has float32's range: the same data fits.
    reg = CASGDLinearRegression(precision="bf16", solver="sgd", max_iter=3, tol=None).fit(X, y)
    assert np.all(np.isfinite(reg.coef_))
    # SVRG stores the preconditioned rows (x - m) / D, which float16 holds.
    reg = CASGDLinearRegression(precision="fp16", max_iter=3, tol=None).fit(X, y)
    assert np.all(np.isfinite(reg.coef_))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("solver", ["sgd", "svrg"])
def test_fp64_fits_of_any_float_x_warn_nothing(dtype, solver):
    """Comparing the storage's range with X's must not overflow into a RuntimeWarning."""
    X, y, _ = make_glm_data("linear", 60, 3, random_state=0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        CASGDLinearRegression(precision="fp64", solver=solver, max_iter=2, tol=None).fit(X, y)


def test_preconditioned_rows_outside_fp16_range_are_rejected():
    """What SVRG stores in float16 is (x - m) / D: its range is checked, not only X's.

    A column of spread 1e-3 whose one outlying row barely counts (weight
    1e-12) keeps a scale D near its spread's floor: the outlier, within
    float16's range itself, is ~1e6 once divided by D.
    """
    rng = np.random.default_rng(0)
    X = rng.standard_normal((200, 2))
    X[:, 1] *= 1e-3
    X[0, 1] = 6e4
    weight = np.ones(200)
    weight[0] = 1e-12
    y = X[:, 0]
    with pytest.raises(ValueError, match=r"\(x - m\) / D.*range of torch\.float16"):
        CASGDLinearRegression(precision="fp16").fit(X, y, sample_weight=weight)
    reg = CASGDLinearRegression(precision="bf16", max_iter=3, tol=None)
    assert np.all(np.isfinite(reg.fit(X, y, sample_weight=weight).coef_))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_storage_keeps_columns_far_from_zero(precision):
    """Columns 1000 + N(0, 1) fit as well as N(0, 1) in bf16 and fp16 storage.

    Rounded as they are, such values keep little of their spread (bf16's
    spacing at 1000 is 8, float16's 0.5). SVRG stores the rows its
    preconditioner centered and scaled, computed from the caller's float64
    values and rounded once, so the shift costs nothing: both fits reach
    the exact objective of their data.
    """
    X, y, _ = make_glm_data("logistic", 2000, 5, random_state=0)
    alpha = 1e-3
    reference = FAMILIES["logistic"].reference(alpha, X.shape[0]).fit(X, y)
    best = objective("logistic", X, y, reference.coef_, reference.intercept_, alpha)
    for shift in (0.0, 1000.0):
        fitted = CASGDLogisticRegression(alpha=alpha, precision=precision, random_state=0)
        fitted.fit(X + shift, y)
        # Shifted columns have the same optimum: the intercept takes the shift.
        intercept = fitted.intercept_ + shift * fitted.coef_.sum()
        reached = objective("logistic", X, y, fitted.coef_, intercept, alpha)
        assert (reached - best) / best < 1e-4, shift


def test_storage_holds_the_preconditioned_rows_rounded_once():
    """The stored block is ``(x - m) / D`` of the caller's values, rounded once to the dtype."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((300, 4)) * 20 + 500
    center, scale = X.mean(axis=0), X.std(axis=0)
    stored = as_storage(X, torch.device("cpu"), torch.bfloat16, center, scale)
    expected = torch.from_numpy((X - center) / scale).to(torch.bfloat16)
    assert torch.equal(stored, expected)
    # Rounded raw, the stored values would lose the columns' spread.
    raw = as_storage(X, torch.device("cpu"), torch.bfloat16)
    assert not torch.equal(
        precondition_rows(raw, *map(torch.from_numpy, (center, scale)), torch.bfloat16), expected
    )


def test_only_rows_rounded_to_a_narrower_dtype_are_stored_preconditioned():
    """Storing preconditioned rows is a copy: made only where X is copied and rounded anyway."""
    X64, X32 = np.ones((3, 2)), np.ones((3, 2), dtype=np.float32)
    assert stores_preconditioned(X64, torch.bfloat16)
    assert stores_preconditioned(X64, torch.float32)
    assert stores_preconditioned(X32, torch.float16)
    assert not stores_preconditioned(X32, torch.float32)  # shared with the caller
    assert not stores_preconditioned(X64, torch.float64)
    assert not stores_preconditioned(sp.csr_matrix(X64), torch.bfloat16)  # stays sparse


def test_float32_input_is_not_copied_to_float64(monkeypatch):
    """fp32 policy on float32 input shares the user's array (no copy of X at all)."""
    import sklearn_casgd._data.storage as storage

    seen = {}
    original = storage.as_tensor

    def spy(array, device, dtype):
        tensor = original(array, device, dtype)
        seen["shares_memory"] = tensor.data_ptr() == array.ctypes.data
        seen["input_dtype"] = array.dtype
        return tensor

    monkeypatch.setattr(storage, "as_tensor", spy)
    X = np.random.default_rng(0).standard_normal((64, 3)).astype(np.float32)
    CASGDLinearRegression(precision="fp32", max_iter=2, tol=None).fit(X, X[:, 0])
    assert seen == {"shares_memory": True, "input_dtype": np.float32}


@pytest.mark.parametrize("family", ["logistic", "multinomial", "linear", "poisson", "gamma"])
def test_coefficients_come_in_the_dtype_of_X(family):
    """float32 X gives float32 coef_ and intercept_, as scikit-learn's linear models do."""
    X, y, _ = make_glm_data(family, 300, 4, random_state=0)
    fits = {
        dtype: FAMILIES[family].estimator(max_iter=20, random_state=0).fit(X.astype(dtype), y)
        for dtype in (np.float32, np.float64)
    }
    for dtype, fitted in fits.items():
        assert fitted.coef_.dtype == dtype
        assert np.asarray(fitted.intercept_).dtype == dtype
    np.testing.assert_allclose(fits[np.float32].coef_, fits[np.float64].coef_, atol=1e-4)
