"""The penalty seam: what the engine asks of a penalty, against closed forms."""

import numpy as np
import pytest
import torch

from sklearn_casgd._engine.comm import LocalCommunicator
from sklearn_casgd._engine.precision import PRESETS
from sklearn_casgd._engine.snapshot import full_pass
from sklearn_casgd._engine.state import LocalData, ModelState, StepContext
from sklearn_casgd._glm.families import SquaredErrorFamily
from sklearn_casgd._glm.penalties import Penalty


def test_l2_value_is_half_alpha_times_the_squared_norm():
    coef = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    penalty = Penalty(0.25)
    assert penalty.l2 == 0.25
    assert penalty.value(penalty.norms(coef)) == pytest.approx(0.5 * 0.25 * 14.25, rel=1e-15)
    assert penalty.value(penalty.norms(torch.zeros(3, 1))) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_norms_of_column_blocks_add_up_to_those_of_the_whole(dtype):
    """Each rank forms the sums over its columns; one all-reduce adds them (float64 sums)."""
    rng = np.random.default_rng(0)
    coef = torch.tensor(rng.normal(size=(11, 3))).to(dtype)
    penalty = Penalty(0.3)
    blocks = [coef[:4], coef[4:5], coef[5:5], coef[5:]]
    summed = sum(penalty.norms(block) for block in blocks)
    assert summed.dtype == torch.float64
    whole = penalty.norms(coef)
    torch.testing.assert_close(summed, whole, rtol=1e-14, atol=0)
    exact = 0.5 * 0.3 * float((coef.to(torch.float64) ** 2).sum())
    assert penalty.value(summed) == pytest.approx(exact, rel=1e-14)


def test_the_engine_objective_and_gradient_carry_the_penalty():
    """The full pass: the objective adds value(), the gradient adds l2 * w (closed form)."""
    rng = np.random.default_rng(1)
    X, y = rng.normal(size=(50, 4)), rng.normal(size=(50, 1))
    coef = rng.normal(size=(4, 1))
    for alpha in (0.0, 0.7):
        ctx = StepContext(
            SquaredErrorFamily(), PRESETS["fp64"], Penalty(alpha), False, LocalCommunicator()
        )
        data = LocalData(torch.tensor(X), torch.tensor(y), torch.ones(50, dtype=torch.float64))
        state = ModelState(torch.tensor(coef), torch.zeros(1, dtype=torch.float64))
        snapshot, measured = full_pass(ctx, data, state, 0.0)
        residual = X @ coef - y
        objective = 0.5 * np.mean(residual**2) + 0.5 * alpha * np.sum(coef**2)
        gradient = X.T @ residual / 50 + alpha * coef
        assert measured.objective == pytest.approx(objective, rel=1e-13)
        assert measured.gradient_max == pytest.approx(np.abs(gradient).max(), rel=1e-12)
        np.testing.assert_allclose(snapshot.mean_gradient.numpy(), X.T @ residual / 50, rtol=1e-12)
