"""Outer iterations replayed from CUDA graphs (``graphs``): the plain loop's arithmetic.

There are no CUDA graphs on the CPU: with ``CUDA_GRAPHS`` on for it, the
graphs' own buffers (rows, step coefficients, snapshot, loss) feed the same
function called eagerly. So these tests hold everything but the capture to
the plain loop, bit for bit; ``benchmarks/bench_gpu.py`` holds the capture
itself to the eager fit on a GPU.
"""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_breast_cancer, load_diabetes
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import CASGDLogisticRegression, CASGDPoissonRegressor
from sklearn_casgd._engine import execution, graphs
from sklearn_casgd._engine.comm import LocalCommunicator
from sklearn_casgd._engine.epochs import outer_iterations
from sklearn_casgd._engine.precision import PRESETS
from sklearn_casgd._engine.state import LocalData, ModelState, StepContext
from sklearn_casgd._glm.families import BinomialFamily
from sklearn_casgd._glm.penalties import Penalty


@pytest.fixture
def replays(monkeypatch):
    """Turn the graphs on for the CPU and count the outer iterations they run."""
    monkeypatch.setitem(execution.CUDA_GRAPHS, "cpu", True)
    counted = []
    run = graphs.OuterGraphs.run

    def counting(self, rows, sizes, etas):
        ran = run(self, rows, sizes, etas)
        counted.append(ran)
        return ran

    monkeypatch.setattr(graphs.OuterGraphs, "run", counting)
    return counted


CASES = {
    # SVRG with its preconditioner and snapshot, a constant step an epoch.
    "svrg fp64": (CASGDLogisticRegression, "breast_cancer", dict(precision="fp64")),
    "svrg fp32": (CASGDLogisticRegression, "breast_cancer", dict(precision="fp32")),
    "svrg bf16": (CASGDPoissonRegressor, "diabetes", dict(precision="bf16")),
    # Plain SGD whose step changes every batch: new step coefficients each outer iteration.
    "sgd invscaling": (
        CASGDLogisticRegression,
        "breast_cancer",
        dict(solver="sgd", learning_rate="invscaling", eta0=0.05, precision="fp64"),
    ),
}


def dataset(name):
    if name == "breast_cancer":
        X, y = load_breast_cancer(return_X_y=True)
    else:
        X, y = load_diabetes(return_X_y=True)
        y = y / 50.0
    return StandardScaler().fit_transform(X), y


@pytest.mark.parametrize("case", list(CASES))
def test_graphed_fits_equal_plain_fits_bit_for_bit(case, request):
    """569 and 442 rows in batches of 16, s=4: full outer iterations and a ragged tail."""
    Estimator, name, params = CASES[case]
    X, y = dataset(name)
    params = dict(params, s=4, batch_size=16, max_iter=15, tol=None, random_state=0)
    plain = Estimator(**params).fit(X, y)
    counted = request.getfixturevalue("replays")
    graphed = Estimator(**params).fit(X, y)
    # 569 rows: 8 outer iterations of 4 full batches from the graph, then 4
    # batches (the last one ragged) eagerly; 442 rows: 6, then the tail.
    plan = outer_iterations(len(y), 16, 4)
    graphed_per_epoch = sum(sizes == plan[0][1] for _, sizes in plan)
    assert graphed_per_epoch == len(plan) - 1
    assert counted.count(True) == graphed_per_epoch * graphed.n_iter_
    assert counted.count(False) == graphed.n_iter_
    np.testing.assert_array_equal(graphed.coef_, plain.coef_)
    np.testing.assert_array_equal(graphed.intercept_, plain.intercept_)
    np.testing.assert_array_equal(graphed.loss_curve_, plain.loss_curve_)


def test_graphs_refuse_other_rows():
    """Graphs read the rows they were captured on: another epoch's data is an error."""
    zeros = torch.zeros((8, 2), dtype=torch.float64)
    data = LocalData(zeros, zeros[:, :1], zeros[:, 0] + 1.0)
    ctx = StepContext(BinomialFamily(), PRESETS["fp64"], Penalty(1e-3), True, LocalCommunicator())
    state = ModelState(zeros[:2, :1].clone(), zeros[0, :1].clone())
    outer = graphs.OuterGraphs(ctx, data, state)
    outer.begin_epoch(data)
    with pytest.raises(RuntimeError, match="other rows"):
        outer.begin_epoch(LocalData(zeros.clone(), data.target, data.sample_weight))
