"""The lean FP32 SGD baseline of ``bench_gpu.py`` runs the engine's plain SGD steps."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kernel import reference_sgd

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from _lean_sgd import LeanSGD


def _problem(n=203, d=5, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    y = (rng.random(n) < 1 / (1 + np.exp(-X @ rng.standard_normal(d)))).astype(np.float64)
    return X, y


@pytest.mark.parametrize("mode", ["eager", "graphed"])
def test_lean_epoch_equals_the_numpy_reference_in_float64(mode):
    # The same batches (a ragged tail of 203 - 6 * 32 = 11 rows, scaled by
    # its own size) and two epochs: the steps are the reference's to rounding.
    X, y = _problem()
    eta, alpha, b = 0.3, 1e-2, 32
    lean = LeanSGD(torch.from_numpy(X), torch.from_numpy(y), eta=eta, alpha=alpha, batch_size=b)
    orders = [np.random.default_rng(s).permutation(len(y)) for s in (1, 2)]
    for order in orders:
        lean.epoch(torch.from_numpy(order), mode)
    batches = [order[lo : lo + b] for order in orders for lo in range(0, len(y), b)]
    coef, intercept = reference_sgd(
        "logistic", X, y[:, None], np.ones(len(y)), alpha=alpha, etas=[eta] * len(batches),
        batches=batches, coef=np.zeros((X.shape[1], 1)), intercept=np.zeros(1),
    )  # fmt: skip
    np.testing.assert_allclose(lean.coef.numpy(), coef[:, 0], rtol=1e-12, atol=1e-14)
    assert float(lean.intercept) == pytest.approx(intercept[0], rel=1e-12, abs=1e-14)
    # Fitted: the objective fell below the start's log(2).
    assert lean.loss() < np.log(2) - 0.05


def test_lean_epoch_rejects_an_unknown_mode():
    X, y = _problem(n=8)
    lean = LeanSGD(torch.from_numpy(X), torch.from_numpy(y), eta=0.1, alpha=0.0, batch_size=4)
    with pytest.raises(ValueError, match="mode must be one of"):
        lean.epoch(torch.arange(8), "fused")
