"""Distributed fits on real torch.distributed (gloo, 127.0.0.1 only)."""

import itertools
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.distributed as dist
from conftest import JOB_ENV, objective, run_torchrun, worker_pids
from sklearn.datasets import load_breast_cancer, load_diabetes, load_wine
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import (
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
    WorkerPool,
    close_worker_pools,
)
from sklearn_casgd._distributed import launch
from sklearn_casgd._distributed.failures import DistributedFitError
from sklearn_casgd._engine.cost import S_TIE_MARGIN
from sklearn_casgd._engine.exchange import outer_per_exchange
from sklearn_casgd._engine.fit import column_blocks
from sklearn_casgd._engine.precision import PRESETS
from sklearn_casgd._engine.state import RowExchange
from sklearn_casgd.datasets import make_glm_data

pytestmark = pytest.mark.distributed

ESTIMATORS = {
    "logistic": CASGDLogisticRegression,
    "multinomial": CASGDLogisticRegression,
    "linear": CASGDLinearRegression,
    "poisson": CASGDPoissonRegressor,
}
HERE = Path(__file__).parent
FLOAT64 = dict(precision="fp64", max_iter=3, tol=None, device="cpu", random_state=0, timeout=60)


def outer_collectives(stats, n_samples, n_features, n_iter, precision="fp64"):
    """The collectives of a fit's outer iterations: one each with the Gram all-reduce.

    Gathering the rows: one all-gather per run of ``outer_per_exchange``
    outer iterations, and one of the weights per epoch.
    """
    if stats["exchange"] != "all-gather":
        return stats["n_outer"]
    widths = tuple(stop - start for start, stop in column_blocks(n_features, stats["world_size"]))
    rows = min(stats["s"] * stats["batch_size"], n_samples)
    per_exchange = outer_per_exchange(RowExchange(widths), rows, PRESETS[precision].gram_input)
    return n_iter * (math.ceil(stats["n_outer"] // n_iter / per_exchange) + 1)


@pytest.mark.parametrize("solver", ["svrg", "sgd"])
@pytest.mark.parametrize(
    "family, batch_size, exchange",
    # 9 columns on 2 ranks; the exchange is forced (on the CPU the fit would
    # gather the rows of both shapes: a small all-reduce is all latency).
    [(family, 4, "all-reduce") for family in ESTIMATORS]
    + [(family, 32, "all-gather") for family in ESTIMATORS],
)
def test_two_ranks_equal_one_rank_in_float64(family, solver, batch_size, exchange, force_exchange):
    force_exchange(exchange)
    X, y, _ = make_glm_data(family, 300, 9, random_state=0)
    weight = np.random.default_rng(0).uniform(0.5, 2.0, 300)
    params = dict(s=4, solver=solver, batch_size=batch_size, **FLOAT64)
    one = ESTIMATORS[family](n_devices=1, **params).fit(X, y, sample_weight=weight)
    two = ESTIMATORS[family](n_devices=2, **params).fit(X, y, sample_weight=weight)
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.intercept_, one.intercept_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.loss_curve_, one.loss_curve_, rtol=1e-12)
    stats = two.fit_stats_
    assert stats["world_size"] == 2 and stats["n_outer"] == one.fit_stats_["n_outer"]
    assert stats["exchange"] == exchange and one.fit_stats_["exchange"] == "none"
    # The outer iterations' collectives and two barriers per fit. A full pass
    # (raw predictions, then objective and gradient terms) costs two: SVRG
    # runs one before every epoch and one after the last; SGD one at the
    # start (tol=None: none at the end) and one per epoch for its training loss.
    per_fit = 2 * (two.n_iter_ + 1) if solver == "svrg" else 2 + two.n_iter_
    outer = outer_collectives(stats, 300, 9, two.n_iter_)
    assert outer == (stats["n_outer"] if exchange == "all-reduce" else 2 * two.n_iter_)
    assert stats["n_allreduce"] == outer + per_fit + 2
    assert stats["allreduce_bytes"] > 0 and stats["train_seconds"] > 0


@pytest.mark.parametrize(
    "load, estimator",
    [(load_breast_cancer, CASGDLogisticRegression), (load_diabetes, CASGDLinearRegression)],
    ids=["breast_cancer", "diabetes"],
)
def test_two_ranks_equal_one_rank_on_real_data(load, estimator):
    """Outlier rows and near-separable classes: the same model on 2 ranks, fit after fit."""
    X, y = load(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    params = dict(FLOAT64, s=4, max_iter=20)
    one = estimator(n_devices=1, **params).fit(X, y)
    two = estimator(n_devices=2, **params).fit(X, y)
    again = estimator(n_devices=2, **params).fit(X, y)
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.intercept_, one.intercept_, rtol=0, atol=1e-10)
    np.testing.assert_array_equal(again.coef_, two.coef_)


NEWTON_CASES = {
    "breast_cancer logistic": (load_breast_cancer, CASGDLogisticRegression),
    "wine multinomial": (load_wine, CASGDLogisticRegression),
    "diabetes linear": (load_diabetes, CASGDLinearRegression),
    "diabetes poisson": (load_diabetes, CASGDPoissonRegressor),
}


@pytest.mark.parametrize("case", NEWTON_CASES)
def test_newton_epochs_on_two_ranks_equal_one_rank(case):
    """Each rank steps its column block along the full system's Newton direction."""
    load, estimator = NEWTON_CASES[case]
    X, y = load(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    params = dict(precision="fp64", tol=1e-8, alpha=1e-3, device="cpu", timeout=60)
    one = estimator(n_devices=1, **params).fit(X, y)
    two = estimator(n_devices=2, **params).fit(X, y)
    for model in (one, two):
        assert model.fit_stats_["plan"]["newton"] and model.fit_stats_["converged"]
    assert two.fit_stats_["world_size"] == 2 and two.n_iter_ == one.n_iter_
    assert two.fit_stats_["execution"]["steps"] == "newton"
    assert two.fit_stats_["execution"]["exchange"] == "all-reduce"
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.intercept_, one.intercept_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.loss_curve_, one.loss_curve_, rtol=1e-12)


@pytest.mark.parametrize("n_devices", [2, 3])
def test_sampled_curvature_on_several_ranks_equals_one_rank(n_devices):
    """The sampled rows' blocks, gathered (3 ranks of 2 columns: one rank has none)."""
    X, y, _ = make_glm_data("poisson", 20_000, 9 if n_devices == 2 else 2, random_state=0)
    params = dict(precision="fp64", tol=1e-8, device="cpu", timeout=60)
    one = CASGDPoissonRegressor(n_devices=1, **params).fit(X, y)
    with WorkerPool(n_devices), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "n_devices=3 runs 3 worker processes", UserWarning)
        many = CASGDPoissonRegressor(n_devices=n_devices, **params).fit(X, y)
    for model in (one, many):
        plan = model.fit_stats_["plan"]
        assert plan["newton"] and plan["curvature_rows"] is not None
    assert many.n_iter_ == one.n_iter_
    np.testing.assert_allclose(many.coef_, one.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(many.intercept_, one.intercept_, rtol=0, atol=1e-10)


@pytest.mark.parametrize("solver", ["svrg", "sgd"])
def test_rows_gathered_in_runs_equal_one_rank(solver, force_exchange):
    """Rows of several outer iterations per all-gather, the next run in flight, a ragged tail.

    200 columns on 2 ranks, s=4, b=32: one outer iteration's rows are 200 KB
    in float64, so an all-gather carries 5 of the 16 in an epoch of 2000 rows
    (the last with a ragged batch): runs of 5, 5, 5 and 1.
    """
    force_exchange("all-gather")
    X, y, _ = make_glm_data("logistic", 2000, 200, random_state=0)
    params = dict(FLOAT64, s=4, batch_size=32, solver=solver)
    one = CASGDLogisticRegression(n_devices=1, **params).fit(X, y)
    two = CASGDLogisticRegression(n_devices=2, **params).fit(X, y)
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.intercept_, one.intercept_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.loss_curve_, one.loss_curve_, rtol=1e-12)
    stats = two.fit_stats_
    assert stats["n_outer"] == 16 * two.n_iter_
    assert outer_collectives(stats, 2000, 200, two.n_iter_) == (4 + 1) * two.n_iter_
    per_fit = 2 * (two.n_iter_ + 1) if solver == "svrg" else 2 + two.n_iter_
    assert stats["n_allreduce"] == (4 + 1) * two.n_iter_ + per_fit + 2


def test_gathered_rows_follow_undone_epochs_on_every_rank():
    """SVRG undoes epochs at a long step: every rank's replica of the weights is undone too.

    Gathering the rows, each rank steps every rank's weights and undoes only
    its own; the next epoch must start from every rank's undone weights.
    """
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    params = dict(FLOAT64, s=4, batch_size=32, max_iter=6, eta0=5.0, learning_rate="constant")
    one = CASGDLogisticRegression(n_devices=1, **params).fit(X, y)
    two = CASGDLogisticRegression(n_devices=2, **params).fit(X, y)
    assert two.fit_stats_["exchange"] == "all-gather"
    curve = one.loss_curve_
    assert any(later == earlier for earlier, later in itertools.pairwise(curve))  # one undone
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.loss_curve_, one.loss_curve_, rtol=1e-12)


@pytest.mark.parametrize(
    "batch_size, exchange",
    # The Gram steps after an all-reduce; the row steps on the gathered rows.
    [(4, "all-reduce"), (32, "all-gather")],
)
def test_compiled_steps_on_two_ranks_fit_the_eager_model(batch_size, exchange, force_exchange):
    """Each worker compiles its own steps (ahead of time on the CPU), the same arithmetic."""
    force_exchange(exchange)
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    params = dict(FLOAT64, s=4, batch_size=batch_size, max_iter=2)
    eager = CASGDLogisticRegression(n_devices=1, compile=False, **params).fit(X, y)
    compiled = CASGDLogisticRegression(n_devices=2, compile=True, **params).fit(X, y)
    assert compiled.fit_stats_["exchange"] == exchange
    assert compiled.fit_stats_["compiled"] and compiled.fit_stats_["compile_seconds"] > 0
    np.testing.assert_allclose(compiled.coef_, eager.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(compiled.intercept_, eager.intercept_, rtol=0, atol=1e-10)


def test_column_blocks_split_evenly():
    assert column_blocks(9, 2) == [(0, 5), (5, 9)]
    assert column_blocks(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert column_blocks(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert column_blocks(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_bf16_recipe_on_two_ranks_close_to_fp32_sgd():
    X, y, _ = make_glm_data("logistic", 2000, 16, random_state=1)
    params = dict(max_iter=5, tol=None, device="cpu", random_state=0)
    fp32 = CASGDLogisticRegression(s=1, precision="fp32", **params).fit(X, y)
    bf16 = CASGDLogisticRegression(s=8, precision="bf16", n_devices=2, **params).fit(X, y)
    assert bf16.fit_stats_["precision"] == "bf16"
    assert abs(bf16.loss_curve_[-1] - fp32.loss_curve_[-1]) < 0.005 * fp32.loss_curve_[-1]


def test_bf16_blocks_on_two_ranks_keep_columns_far_from_zero():
    """Each worker's block is stored as ``(x - m) / D`` rounded once, as one process stores X.

    Columns 1000 + N(0, 1) rounded as they are to bfloat16 (spacing 8)
    lose most of their spread; the blocks the run directory hands the
    workers must hold the preconditioned rows, so that 2 ranks reach the
    optimum of the caller's float64 data as 1 rank does.
    """
    X, y, _ = make_glm_data("logistic", 2000, 6, random_state=0)
    alpha = 1e-3
    params = dict(alpha=alpha, precision="bf16", s=4, device="cpu", random_state=0)
    one = CASGDLogisticRegression(n_devices=1, **params).fit(X + 1000.0, y)
    two = CASGDLogisticRegression(n_devices=2, **params).fit(X + 1000.0, y)
    reference = LogisticRegression(C=1 / (alpha * len(y)), tol=1e-10, max_iter=10_000).fit(X, y)
    best = objective("logistic", X, y, reference.coef_, reference.intercept_, alpha)
    for fitted in (one, two):
        intercept = fitted.intercept_ + 1000.0 * fitted.coef_.sum()
        reached = objective("logistic", X, y, fitted.coef_, intercept, alpha)
        assert (reached - best) / best < 1e-4
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-3)


def check_job_outputs(out_dir, world_size):
    ranks = [np.load(out_dir / f"rank{r}.npz") for r in range(world_size)]
    X, y, _ = make_glm_data("multinomial", 400, 7, random_state=0)
    reference = CASGDLogisticRegression(s=4, n_devices=1, **FLOAT64).fit(X, y)
    sparse_reference = CASGDLogisticRegression(s=4, n_devices=1, batch_size=32, **FLOAT64).fit(
        sp.csr_matrix(np.where(np.abs(X) < 0.5, 0.0, X)), y
    )
    for out in ranks:
        assert int(out["world_size"]) == world_size
        assert int(out["local_world_size"]) == 1  # n_devices=1 stays local in a job
        assert out["probe"][0] == world_size  # the user's group still works
        np.testing.assert_allclose(out["seeded_coef"], reference.coef_, rtol=0, atol=1e-10)
        np.testing.assert_allclose(out["local_coef"], reference.coef_, rtol=0, atol=1e-12)
        np.testing.assert_allclose(out["sparse_coef"], sparse_reference.coef_, rtol=0, atol=1e-10)
        # Stored preconditioned on each rank as in one process (rounded raw they
        # differed by 0.28: bf16 keeps little of a column 1000 + N(0, 1)).
        np.testing.assert_allclose(
            out["world_bf16_coef"], out["local_bf16_coef"], rtol=0, atol=1e-3
        )
        # random_state=None: rank 0's seed is broadcast, every rank fits the same.
        np.testing.assert_array_equal(out["unseeded_coef"], ranks[0]["unseeded_coef"])
        np.testing.assert_array_equal(out["seeded_coef"], ranks[0]["seeded_coef"])
        # SVRG's full passes (see below) + 1 all-reduce that gathers the weights
        full_passes = int(out["n_iter"]) + 1
        stats = {key: out[key].item() for key in ("exchange", "s", "batch_size", "n_outer")}
        stats["world_size"] = world_size
        outer = outer_collectives(stats, 400, 7, int(out["n_iter"]))
        assert int(out["n_allreduce"]) == outer + 2 * full_passes + 2 + 1


def test_external_group_both_ranks_call_fit(tmp_path):
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    script = str(HERE / "world_fit_script.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(tmp_path), str(store.port)],
            env={**JOB_ENV, "RANK": str(rank), "WORLD_SIZE": "2"},
        )
        for rank in range(2)
    ]
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 0]
    check_job_outputs(tmp_path, 2)


@pytest.mark.parametrize("mismatch", ["shape", "targets"])
def test_world_ranks_with_different_data_get_a_clear_error(mismatch, tmp_path):
    """Different shapes used to crash inside gloo; different y silently mixed models."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    script = str(HERE / "world_mismatch_script.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(tmp_path), str(store.port), mismatch],
            env={**JOB_ENV, "RANK": str(rank), "WORLD_SIZE": "2"},
        )
        for rank in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    expected = "n_samples" if mismatch == "shape" else "a projection of y"
    for rank in range(2):
        outcome = (tmp_path / f"rank{rank}.txt").read_text()
        assert outcome.startswith("ValueError: n_devices='world' needs every rank"), outcome
        assert expected in outcome


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_world_ranks_on_one_gpu_get_a_clear_error(tmp_path):  # pragma: no cover - GPU
    """NCCL itself fails such a job with "invalid usage"; the fit names the problem first."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    script = str(HERE / "world_mismatch_script.py")
    env = {**JOB_ENV, "WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0"}
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(tmp_path), str(store.port), "gpu"],
            env={**env, "RANK": str(rank)},
        )
        for rank in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for rank in range(2):
        outcome = (tmp_path / f"rank{rank}.txt").read_text()
        assert outcome.startswith("ValueError: Ranks [0, 1] of this job use the same GPU"), outcome


def test_torchrun_standalone_smoke(tmp_path):
    run_torchrun(HERE / "world_fit_script.py", tmp_path, timeout=180)
    check_job_outputs(tmp_path, 2)


def test_world_without_a_job_is_a_clear_error(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    X, y, _ = make_glm_data("linear", 50, 3, random_state=0)
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR"):
        CASGDLinearRegression(n_devices="world").fit(X, y)


@pytest.mark.parametrize("fault", ["raise", "exit", "hang"])
def test_failing_rank_raises_in_bounded_time_and_leaves_nothing(fault, monkeypatch):
    X, y, _ = make_glm_data("logistic", 300, 6, random_state=0)
    monkeypatch.setattr(launch, "_FAULT", f"1:{fault}")
    estimator = CASGDLogisticRegression(n_devices=2, device="cpu", timeout=5, max_iter=2, s=4)
    start = time.monotonic()
    with pytest.raises(DistributedFitError) as info:
        estimator.fit(X, y)
    elapsed = time.monotonic() - start
    assert elapsed < 30
    message = str(info.value)
    if fault == "raise":
        assert info.value.rank == 1 and "fault injected on rank 1" in message
    elif fault == "exit":
        assert "code 3" in message
    else:  # the hung rank is named, not the peer that timed out waiting for it
        assert info.value.rank == 1 and "stopped answering" in message
    assert worker_pids() == []
    monkeypatch.setattr(launch, "_FAULT", None)
    assert estimator.fit(X, y).fit_stats_["world_size"] == 2  # the next fit works


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def mapped_run_files(pid):
    """Files of run directories that process ``pid`` still maps."""
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if RUN in line]


RUN = "sklearn_casgd_"


def test_repeated_fits_reuse_one_pool_and_leak_nothing():
    close_worker_pools()
    X, y, _ = make_glm_data("linear", 200, 4, random_state=0)
    estimator = CASGDLinearRegression(n_devices=2, device="cpu", max_iter=2, tol=None)
    with WorkerPool(2) as pool:
        estimator.fit(X, y)  # starts the workers (and lazily created resources)
        workers = sorted(worker_pids())
        assert workers == sorted(pool.pids) and len(workers) == 2
        fds_before = {pid: open_fds(pid) for pid in [os.getpid(), *workers]}
        for _ in range(10):
            estimator.fit(X, y)
        assert sorted(worker_pids()) == workers and pool.n_starts == 1
        for pid, before in fds_before.items():
            assert open_fds(pid) <= before, pid
        assert not [p for p in Path("/dev/shm").glob(f"{RUN}*")]
        for pid in workers:  # no finished fit's pages stay mapped
            assert mapped_run_files(pid) == [], pid
        pool_dirs = list(Path(tempfile.gettempdir()).glob(f"{RUN}{os.getpid()}_pool_*"))
        assert len(pool_dirs) == 1
    assert worker_pids() == []
    assert not pool_dirs[0].exists()


def test_grid_search_with_two_jobs_over_two_ranks():
    X, y, _ = make_glm_data("logistic", 300, 6, random_state=0)
    search = GridSearchCV(
        # A batch size of its own: minibatch steps, whose s the ranks choose.
        CASGDLogisticRegression(
            n_devices=2, batch_size=32, device="cpu", max_iter=3, tol=None, random_state=0
        ),
        {"alpha": [1e-4, 1e-2]},
        cv=2,
        n_jobs=2,
    ).fit(X, y)
    assert search.best_estimator_.fit_stats_["world_size"] == 2
    stats = search.best_estimator_.fit_stats_
    # s="auto" across ranks: the cost model's choice, decided on rank 0.
    assert stats["s"] == the_models_choice(stats["s_predictions"])
    assert search.best_score_ > 0.6


def the_models_choice(predictions):
    """The largest s predicted within S_TIE_MARGIN of the fastest (cost.choose_s)."""
    near = min(predictions.values()) * (1 + S_TIE_MARGIN)
    return max(s for s, seconds in predictions.items() if seconds <= near)


def test_auto_s_on_two_ranks_prices_the_gathered_rows():
    """d=4 on 2 ranks: every s > 1 all-gathers its rows, and the model priced that."""
    X, y, _ = make_glm_data("logistic", 8192, 4, random_state=0)
    fit = CASGDLogisticRegression(n_devices=2, solver="sgd", **dict(FLOAT64, max_iter=1)).fit(X, y)
    stats = fit.fit_stats_
    assert set(stats["s_predictions"]) == {1, 2, 4}  # s b <= 8192 / 64 rows
    assert stats["s"] == the_models_choice(stats["s_predictions"])
    assert stats["exchange"] == ("all-reduce" if stats["s"] == 1 else "all-gather")


def test_a_worker_pool_prices_its_collectives_instead_of_timing_them():
    """The pool's ranks share this machine: s="auto" adds only the broadcast of its choice.

    A timing of the collectives would move with other processes' load
    (docs/tuning.md, "A busy machine"); a job's ranks, perhaps on other
    hosts, still time theirs.
    """
    X, y, _ = make_glm_data("logistic", 32768, 64, random_state=1)
    params = dict(FLOAT64, n_devices=2, solver="sgd", batch_size=64 + 1, max_iter=1)
    auto = CASGDLogisticRegression(s="auto", **params).fit(X, y).fit_stats_
    fixed = CASGDLogisticRegression(s=auto["s"], **params).fit(X, y).fit_stats_
    assert auto["s"] == the_models_choice(auto["s_predictions"])
    assert auto["n_allreduce"] == fixed["n_allreduce"] + 1, (auto, fixed)


@pytest.mark.parametrize("how", ["python -c", "unguarded script", "stdin"])
def test_distributed_fit_from_unguarded_code(how, tmp_path):
    code = (
        "from sklearn_casgd import CASGDLinearRegression\n"
        "from sklearn_casgd.datasets import make_glm_data\n"
        "X, y, _ = make_glm_data('linear', 100, 4, random_state=0)\n"
        "reg = CASGDLinearRegression(n_devices=2, device='cpu', max_iter=2, tol=None).fit(X, y)\n"
        "print('world', reg.fit_stats_['world_size'])\n"
    )
    if how == "python -c":
        run = dict(args=[sys.executable, "-c", code])
    elif how == "stdin":
        run = dict(args=[sys.executable, "-"], input=code)
    else:
        script = tmp_path / "script.py"
        script.write_text(code)
        run = dict(args=[sys.executable, str(script)])
    completed = subprocess.run(**run, env=JOB_ENV, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "world 2" in completed.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_equal_one_gpu():  # pragma: no cover - runs on GPU machines
    X, y, _ = make_glm_data("logistic", 2000, 16, random_state=0)
    params = dict(precision="fp64", max_iter=3, tol=None, device="cuda", random_state=0)
    one = CASGDLogisticRegression(s=4, **params).fit(X, y)
    two = CASGDLogisticRegression(s=4, n_devices=2, **params).fit(X, y)
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_recipe_close_to_fp32():  # pragma: no cover - runs on GPU machines
    X, y, _ = make_glm_data("logistic", 4000, 32, random_state=0)
    params = dict(max_iter=10, tol=None, device="cuda", random_state=0)
    fp32 = CASGDLogisticRegression(s=1, precision="fp32", **params).fit(X, y)
    bf16 = CASGDLogisticRegression(s=8, precision="bf16", **params).fit(X, y)
    assert bf16.fit_stats_["device"].startswith("cuda")
    assert abs(bf16.loss_curve_[-1] - fp32.loss_curve_[-1]) < 0.005 * fp32.loss_curve_[-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["logistic", "linear", "poisson"])
def test_cuda_fits_equal_cpu_fits_in_float64(name):  # pragma: no cover - runs on GPU machines
    """The default steps on CUDA (the fused kernel where triton is installed) are the CPU's."""
    X, y, _ = make_glm_data(name, 600, 12, random_state=0)
    Estimator = {
        "logistic": CASGDLogisticRegression,
        "linear": CASGDLinearRegression,
        "poisson": CASGDPoissonRegressor,
    }[name]
    params = dict(precision="fp64", s=8, max_iter=20, tol=None, random_state=0)
    on_cpu = Estimator(device="cpu", **params).fit(X, y)
    on_gpu = Estimator(device="cuda", **params).fit(X, y)
    assert on_gpu.fit_stats_["device"].startswith("cuda")
    np.testing.assert_allclose(on_gpu.coef_, on_cpu.coef_, rtol=0, atol=1e-9)
    np.testing.assert_allclose(on_gpu.intercept_, on_cpu.intercept_, rtol=0, atol=1e-9)


def test_more_ranks_than_features_fit_the_same_model():
    """A rank without columns still takes part: the rows are all-gathered."""
    X, y, _ = make_glm_data("logistic", 120, 2, random_state=0)
    params = dict(s=3, batch_size=8, **FLOAT64)
    one = CASGDLogisticRegression(n_devices=1, **params).fit(X, y)
    with WorkerPool(3), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "n_devices=3 runs 3 worker processes", UserWarning)
        three = CASGDLogisticRegression(n_devices=3, **params).fit(X, y)
    assert three.fit_stats_["exchange"] == "all-gather"
    np.testing.assert_allclose(three.coef_, one.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(three.intercept_, one.intercept_, rtol=0, atol=1e-10)


def test_only_rank_zero_reports_progress(capfd):
    X, y, _ = make_glm_data("linear", 200, 4, random_state=0)
    CASGDLinearRegression(n_devices=2, device="cpu", max_iter=2, tol=None, verbose=1).fit(X, y)
    out = capfd.readouterr().out
    assert "loss=" in out
    # One bar, not one per rank: the final "2/2" state is drawn by a single bar.
    assert out.count("2/2") == 1, out


@pytest.mark.parametrize("solver", ["svrg", "sgd"])
def test_divergence_is_the_same_value_error_on_two_ranks(solver):
    """A step too large is a ValueError naming it, not a DistributedFitError."""
    X, y, _ = make_glm_data("logistic", 300, 6, random_state=0)
    params = dict(solver=solver, alpha=0.0, eta0=1e8, learning_rate="constant", tol=None)
    params.update(max_iter=20, device="cpu", random_state=0, timeout=60)
    with pytest.raises(ValueError, match="too large"):
        CASGDLogisticRegression(n_devices=1, **params).fit(X, y)
    with pytest.raises(ValueError, match="too large") as raised:
        CASGDLogisticRegression(n_devices=2, **params).fit(X, y)
    assert not isinstance(raised.value, DistributedFitError)
