"""One matrix of execution modes, each held to the numpy reference of its solver in float64.

Every way a fit can run here (one rank or two; dense or CSR rows; the steps
from the rows or from their Gram; eager or compiled; the Gram all-reduce or
the rows' all-gather; outer iterations replayed as CUDA graphs would replay
them) takes the same batches, so in float64 it ends where a plain numpy
loop over those batches ends (`tests/test_kernel.py`'s references). Each
cell also asserts that its mode is the one that ran (``fit_stats_``), so a
mode that silently fell back to another cannot pass.

The sparse epoch kernel (numba, on the CPU) is a cell of its own. The
Triton modes (fused row steps, the epoch kernel, the fused pass) run in
Triton's interpreter, which must be set before triton is imported: they have
their own float64 identities in a subprocess (`tests/test_triton.py`). Sparse
rows are never compiled nor exchanged as rows (the engine refuses both),
and CUDA graphs replay one device's outer iterations only.
"""

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.datasets import load_breast_cancer
from sklearn.preprocessing import StandardScaler
from sklearn.utils import check_random_state
from test_kernel import epoch_batches, reference_sgd, reference_svrg

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._glm.families import BinomialFamily

ALPHA, BATCH, S, EPOCHS, SEED = 1e-3, 32, 4, 3, 0
ETA0 = {"sgd": 0.05, "svrg": 0.02}

# id: (n_devices, sparse X, plan fields forced, what fit_stats_ must report)
CELLS = {
    "1 rank, rows": (1, False, {}, {"steps": "rows", "exchange": "none"}),
    "1 rank, compiled": (1, False, {"compile": True}, {"steps": "rows", "compiled": True}),
    "1 rank, graphs": (1, False, {"graphs": True}, {"steps": "rows", "graphs": True}),
    "1 rank, sparse": (1, True, {}, {"steps": "gram", "exchange": "none"}),
    "1 rank, sparse, epoch kernel": (1, True, {"epoch_kernel": True}, {"epoch_kernel": True}),
    "2 ranks, all-reduce": (2, False, {"exchange": "all-reduce"}, {"exchange": "all-reduce"}),
    "2 ranks, all-gather": (2, False, {"exchange": "all-gather"}, {"exchange": "all-gather"}),
    "2 ranks, sparse": (2, True, {}, {"steps": "gram", "exchange": "all-reduce"}),
    "2 ranks, all-gather, compiled": (
        2, False, {"exchange": "all-gather", "compile": True}, {"compiled": True},
    ),
}  # fmt: skip
# Every cell runs with the Triton kernels off (see the module's docstring).
TRITON_OFF = {"fused": False, "epoch_kernel": False, "fused_pass": False}


@pytest.fixture(scope="module")
def problem():
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), y.astype(np.float64)


def _batches(n_samples):
    """The estimator's batches: its seed is drawn from random_state as plan_fit draws it."""
    seed = int(check_random_state(SEED).randint(np.iinfo(np.int32).max))
    return epoch_batches(n_samples, BATCH, seed, EPOCHS)


def _reference(solver, X, y, fitted):
    """Where the numpy loop of ``solver`` ends on the estimator's batches, in user coordinates."""
    family = BinomialFamily()
    target = y[:, None]
    weight = np.ones(X.shape[0])
    start = family.intercept_start(target, weight)
    batches = _batches(X.shape[0])
    # A ragged batch takes its share of the step.
    shares = [[len(rows) / BATCH for rows in epoch] for epoch in batches]
    if solver == "sgd":
        etas = [ETA0["sgd"] * share for epoch in shares for share in epoch]
        flat = [rows for epoch in batches for rows in epoch]
        coef, intercept = reference_sgd(
            "logistic", X, target, weight, alpha=ALPHA, etas=etas, batches=flat,
            coef=np.zeros((X.shape[1], 1)), intercept=start,
        )  # fmt: skip
        return coef[:, 0], intercept
    # SVRG steps on v = D w over the rows (x - m) / D; every epoch here is kept and
    # lengthens the step by SVRG_GROWTH (asserted by the caller from the loss curve).
    from sklearn_casgd._engine.solver_state import SVRG_GROWTH

    plan = fitted._step_plan
    center, scale = plan.column_center, plan.column_scale
    etas = [
        [ETA0["svrg"] * SVRG_GROWTH**e * share for share in epoch] for e, epoch in enumerate(shares)
    ]
    v, beta = reference_svrg(
        "logistic", (X - center) / scale, target, weight, alpha=ALPHA, etas=etas,
        batches=batches, coef=np.zeros((X.shape[1], 1)), intercept=start,
        penalty=ALPHA / scale**2, decay=plan.decay_alpha,
    )  # fmt: skip
    coef = v[:, 0] / scale
    return coef, beta - center @ coef


@pytest.mark.parametrize("solver", ["sgd", "svrg"])
@pytest.mark.parametrize("cell", list(CELLS))
def test_every_execution_mode_ends_where_the_numpy_reference_does(
    problem, force_plan, precondition_sparse, cell, solver
):
    n_devices, sparse, fields, expected = CELLS[cell]
    if sparse and fields.get("epoch_kernel"):
        pytest.importorskip("numba")
    X, y = problem
    force_plan(**{**TRITON_OFF, "graphs": False, **fields})
    clf = CASGDLogisticRegression(
        solver=solver, learning_rate="constant", eta0=ETA0[solver], alpha=ALPHA,
        batch_size=BATCH, s=S, max_iter=EPOCHS, tol=None, precision="fp64",
        random_state=SEED, n_devices=n_devices,
    )  # fmt: skip
    clf.fit(sp.csr_matrix(X) if sparse else X, y)

    ran = clf.fit_stats_["execution"]
    assert {name: ran[name] for name in expected} == expected
    assert clf.fit_stats_["s"] == S
    if solver == "svrg":
        assert np.all(np.diff(clf.loss_curve_) < 0)  # every epoch kept: the reference's steps
    coef, intercept = _reference(solver, X, y, clf)
    np.testing.assert_allclose(clf.coef_[0], coef, rtol=0, atol=1e-10)
    np.testing.assert_allclose(clf.intercept_, intercept, rtol=0, atol=1e-10)
