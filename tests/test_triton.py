"""The fused row steps (one Triton kernel) against the torch row steps.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors: the
same kernel source, executed op by op in numpy. Triton reads
``TRITON_INTERPRET`` when it is first imported, so the comparison runs in
a process of its own (``tests/triton_script.py``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_iris

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._accel.triton import MAX_TILE, epoch_supports, supports
from sklearn_casgd._engine import execution
from sklearn_casgd._engine.comm import LocalCommunicator
from sklearn_casgd._engine.precision import PRESETS
from sklearn_casgd._engine.state import StepContext
from sklearn_casgd._glm.families import BinomialFamily, MultinomialFamily, PoissonFamily
from sklearn_casgd._glm.penalties import Penalty
from sklearn_casgd.datasets import make_glm_data

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def interpreted_gaps():
    pytest.importorskip("triton")
    completed = subprocess.run(
        [sys.executable, str(HERE / "triton_script.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", ["logistic", "linear", "poisson", "gamma", "tweedie"])
@pytest.mark.parametrize("solver", ["sgd", "svrg"])
@pytest.mark.parametrize("fit_intercept", [True, False])
def test_fused_row_steps_equal_the_torch_row_steps_in_float64(
    interpreted_gaps, name, solver, fit_intercept
):
    """Three outer iterations of s=3, b=7 on d=5 (masked tiles); SVRG preconditioned."""
    gaps = interpreted_gaps[f"{name}-{solver}-{fit_intercept}"]
    assert gaps["fused"]  # the kernel ran, not the torch steps
    assert gaps["moved"] > 0.05  # the steps moved the weights
    assert gaps["coef"] <= 1e-12
    assert gaps["intercept"] <= 1e-12
    assert gaps["loss"] <= 1e-12


def test_the_fused_kernel_runs_the_bf16_recipe_in_float32(interpreted_gaps):
    gaps = interpreted_gaps["bf16"]
    assert gaps["fused"] and gaps["moved"] > 0.05
    assert gaps["coef"] <= 1e-5 and gaps["loss"] <= 1e-5


def test_a_fit_with_the_fused_steps_is_the_torch_steps_fit_and_compiles_nothing(
    interpreted_gaps,
):
    """FUSED_ROW_STEPS on for the CPU in that process; 203 rows: a ragged tail too."""
    gaps = interpreted_gaps["estimator"]
    assert gaps["coef"] <= 1e-12
    assert gaps["compiled"] is False  # compile=True, but the kernel replaces it


EPOCH_FAMILIES = ["logistic", "linear", "poisson", "gamma", "tweedie", "multinomial"]


@pytest.mark.parametrize("name", EPOCH_FAMILIES)
@pytest.mark.parametrize("solver", ["sgd", "svrg"])
@pytest.mark.parametrize("fit_intercept", [True, False])
def test_the_epoch_kernel_takes_sgd_steps_in_float64(interpreted_gaps, name, solver, fit_intercept):
    """64 rows in batches of 7 (a ragged last of 1), a step size a batch; SVRG preconditioned."""
    gaps = interpreted_gaps[f"epoch-{name}-{solver}-{fit_intercept}"]
    assert gaps["moved"] > 0.05
    assert gaps["coef"] <= 1e-12
    assert gaps["intercept"] <= 1e-12
    assert gaps["loss"] <= 1e-12


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_epoch_kernel_takes_the_float32_and_bf16_steps(interpreted_gaps, precision):
    gaps = interpreted_gaps[f"epoch-{precision}"]
    assert gaps["moved"] > 0.05
    assert gaps["coef"] <= 1e-6 and gaps["intercept"] <= 1e-6 and gaps["loss"] <= 1e-6


def test_the_epoch_kernel_rounds_the_rows_and_margins_to_bf16(interpreted_gaps):
    """Nearer the torch bf16 steps than the same steps without their roundings.

    Triton's interpreter truncates in ``.to(tl.bfloat16)``: the kernel
    rounds by the bits, to nearest even as torch does.
    """
    assert interpreted_gaps["epoch-bf16 against torch bf16"] <= 1e-6
    assert interpreted_gaps["epoch-bf16 against torch unrounded"] >= 1e-4


def test_fits_with_the_epoch_kernel_are_the_torch_fits(interpreted_gaps):
    """Plain SGD at s=4 (the s-step iterates are plain SGD's) and SVRG on iris's 3 classes."""
    gaps = interpreted_gaps["epoch-estimator"]
    assert gaps["moved"] > 0.1 and gaps["iris moved"] > 0.1
    assert gaps["coef"] <= 1e-12 and gaps["loss"] <= 1e-12
    assert gaps["iris coef"] <= 1e-12


@pytest.mark.parametrize("name", EPOCH_FAMILIES)
@pytest.mark.parametrize("solver", ["svrg", "newton"])
def test_the_fused_pass_is_the_torch_pass_in_float64(interpreted_gaps, name, solver):
    """3000 rows in blocks of 1024 (a ragged last), preconditioned, as full_pass measures them.

    SVRG's pass keeps each row's derivative; Newton's keeps none.
    """
    gaps = interpreted_gaps[f"pass-{name}-{solver}"]
    assert gaps["scale"] > 1e-3
    assert gaps["mean_gradient"] <= 1e-14 and gaps["intercept"] <= 1e-14
    assert gaps["objective"] <= 1e-14 and gaps["gradient_max"] <= 1e-14
    assert gaps["raw_max"] <= 1e-14 and gaps["resolution"] <= 1e-12
    assert ("rows" in gaps) is (solver == "svrg")
    assert gaps.get("rows", 0.0) <= 1e-14


def test_the_fused_pass_takes_the_bf16_rows_as_the_steps_do(interpreted_gaps):
    """The preconditioned rows rounded to bf16, the sums in float32 (float64 the objective)."""
    gaps = interpreted_gaps["pass-bf16"]
    assert gaps["mean_gradient"] <= 1e-6 * gaps["scale"] * 10 and gaps["rows"] <= 1e-6
    assert gaps["objective"] <= 1e-7


@pytest.mark.parametrize("solver", ["minibatch", "newton"])
def test_fits_with_the_fused_pass_are_the_torch_fits(interpreted_gaps, solver):
    """breast_cancer: minibatch SVRG (5 epochs) and Newton epochs (8): the fused pass ran."""
    gaps = interpreted_gaps[f"pass-estimator-{solver}"]
    assert gaps["moved"] > 0.5 and gaps["newton"] is (solver == "newton")
    assert gaps["fused_pass"]
    assert gaps["epochs"][0] == gaps["epochs"][1]
    assert gaps["coef"] <= 1e-12


@pytest.mark.parametrize(
    "family, batch_size, n_outputs, width, expected",
    [
        (BinomialFamily(), 1024, 1, 28, True),  # HIGGS: a 1024 x 32 tile
        (MultinomialFamily(), 32, 10, 28, True),  # 32 x 32 x 16
        (MultinomialFamily(), 256, 10, 28, False),  # 256 x 32 x 16
        (BinomialFamily(), 256, 1, 1000, False),
    ],
)
def test_the_epoch_kernel_covers_a_bounded_tile(family, batch_size, n_outputs, width, expected):
    assert epoch_supports(family, batch_size, n_outputs, width) is expected


def test_the_epoch_kernel_runs_only_one_devices_minibatch_steps():
    with pytest.raises(ValueError, match="one device's minibatch steps"):
        StepContext(
            BinomialFamily(), PRESETS["fp64"], Penalty(0.1), True, LocalCommunicator(),
            epoch_kernel=True, newton=True,
        )  # fmt: skip


@pytest.mark.parametrize(
    "family, sizes, n_outputs, width, expected",
    [
        (BinomialFamily(), (32,) * 8, 1, 28, True),
        (PoissonFamily(), (1024,) * 16, 1, 28, True),  # HIGGS: a 1024 x 32 tile
        (MultinomialFamily(), (32,) * 8, 3, 28, False),  # k > 1
        (BinomialFamily(), (32, 32, 5), 1, 28, False),  # a ragged tail
        (BinomialFamily(), (256,) * 8, 1, 1000, False),  # a 256 x 1024 tile
    ],
)
def test_the_kernel_covers_one_output_one_batch_size_and_a_bounded_tile(
    family, sizes, n_outputs, width, expected
):
    assert MAX_TILE == 1 << 16
    assert supports(family, sizes, n_outputs, width) is expected


def test_fused_steps_need_the_row_steps():
    with pytest.raises(ValueError, match="row_steps=True"):
        StepContext(
            BinomialFamily(), PRESETS["fp64"], Penalty(0.1), True, LocalCommunicator(), fused=True
        )


@pytest.mark.parametrize("case", ["multinomial", "wide tile"])
def test_a_fit_the_kernel_does_not_cover_compiles_its_steps(case, monkeypatch):
    """With the fused steps on, a fit they cannot run (k > 1, a tile over MAX_TILE) compiles.

    Such fits once counted as fused and compiled nothing, even with
    ``compile=True``: the eager torch steps ran every outer iteration.
    The kernel is never launched here, so the interpreter is only named.
    """
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel counts as available on the CPU
    monkeypatch.setitem(execution.FUSED_ROW_STEPS, "cpu", True)
    if case == "multinomial":
        X, y = load_iris(return_X_y=True)
        batch_size = 16
    else:
        X, y, _ = make_glm_data("logistic", 300, 300, random_state=0)
        batch_size = 256  # a 256 x 512 tile
    params = dict(s=2, batch_size=batch_size, max_iter=1, tol=None, precision="fp64")
    params.update(random_state=0)
    fitted = CASGDLogisticRegression(compile=True, **params).fit(X, y)
    assert fitted.fit_stats_["compiled"]
    eager = CASGDLogisticRegression(compile=False, **params).fit(X, y)
    np.testing.assert_allclose(fitted.coef_, eager.coef_, rtol=0, atol=1e-12)


def test_a_kernel_that_cannot_launch_leaves_the_fit_to_the_torch_steps():
    """Triton may fail at the first launch (no driver, no writable cache): warn, not crash.

    Every kernel: the fused row steps, the epoch kernel and the fused pass.

    The fused steps are on by default on CUDA; before this, such a fit
    raised Triton's RuntimeError ("0 active drivers" here).
    """
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    completed = subprocess.run(
        [sys.executable, str(HERE / "triton_failure_script.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(completed.stdout.splitlines()[-1])
    for kernel, message in [
        ("fused", "The fused Triton kernel failed to run (RuntimeError"),
        ("epoch", "The Triton epoch kernel failed to run (RuntimeError"),
        ("pass", "The fused Triton pass failed to run (RuntimeError"),
    ]:
        result = results[kernel]
        assert len(result["warnings"]) == 1, result
        assert result["warnings"][0].startswith(message)
        assert result["coef"] == 0.0
