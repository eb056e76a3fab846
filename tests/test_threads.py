"""numpy's BLAS runs on the calling thread during a fit, and as the user set it after."""

import sys
import time

import numpy as np
import pytest
import torch
from conftest import busy_process
from threadpoolctl import threadpool_info, threadpool_limits

import sklearn_casgd._engine.fit_plan as fit_plan
from sklearn_casgd import CASGDLinearRegression
from sklearn_casgd._distributed import threads
from sklearn_casgd._distributed.threads import numpy_blas_single_threaded


def numpy_blas_threads() -> list[int]:
    """Thread counts of the BLAS libraries loaded outside torch's package."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    return [
        info["num_threads"]
        for info in threadpool_info()
        if info["user_api"] == "blas" and not info["filepath"].startswith(torch_dir)
    ]


@pytest.fixture
def two_blas_threads():
    if not numpy_blas_threads():
        pytest.skip("numpy has no BLAS library that threadpoolctl can see")
    with threadpool_limits(2, user_api="blas"):
        if set(numpy_blas_threads()) != {2}:
            pytest.skip("this BLAS cannot run 2 threads here")
        yield


def test_numpy_blas_runs_on_one_thread_within_and_as_before_after(two_blas_threads):
    torch_threads = torch.get_num_threads()
    with numpy_blas_single_threaded():
        assert set(numpy_blas_threads()) == {1}
        assert torch.get_num_threads() == torch_threads
    assert set(numpy_blas_threads()) == {2}


def test_a_fit_plans_and_runs_with_numpy_blas_on_one_thread(two_blas_threads, monkeypatch):
    seen = []
    plan_execution = fit_plan.plan_execution

    def recording(*args, **kwargs):
        seen.append(numpy_blas_threads())
        return plan_execution(*args, **kwargs)

    monkeypatch.setattr(fit_plan, "plan_execution", recording)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((200, 3))
    CASGDLinearRegression().fit(X, X @ [1.0, 2.0, 3.0])
    assert seen and all(set(threads) == {1} for threads in seen)
    assert set(numpy_blas_threads()) == {2}


@pytest.mark.parametrize(
    ("others", "expected"),
    [(None, "torch"), (0, "torch"), (1, "cores - 1"), (10_000, 1)],
    ids=["unknown", "quiet", "one busy", "crowded"],
)
def test_a_fit_runs_on_the_cores_other_processes_leave_free(monkeypatch, others, expected):
    before = torch.get_num_threads()
    cores = threads.thread_budget()[0]
    monkeypatch.setattr(threads, "SIZE_TO_FREE_CORES", True)
    monkeypatch.setattr(threads, "others_running", lambda: others)
    allowed = {"torch": min(before, threads.thread_budget()[1]), 1: 1}
    allowed["cores - 1"] = max(1, min(allowed["torch"], cores - 1))
    with threads.threads_for_free_cores() as chosen:
        assert chosen == allowed[expected] == torch.get_num_threads()
    assert torch.get_num_threads() == before  # restored


@pytest.mark.parametrize(
    ("others", "yields"),
    [(None, True), (0, True), (1, True), (2, False)],
    ids=["unknown", "quiet", "the other rank", "another process"],
)
def test_pool_ranks_yield_their_cores_unless_other_processes_run(monkeypatch, others, yields):
    """Two ranks: the other rank may be running; a task more is another process."""
    monkeypatch.setattr(threads, "others_running", lambda: others)
    assert threads.ranks_yield(2) is yields


def test_switched_off_the_fit_keeps_torch_threads(monkeypatch):
    monkeypatch.setattr(threads, "SIZE_TO_FREE_CORES", False)
    monkeypatch.setattr(threads, "others_running", lambda: 10_000)
    with threads.threads_for_free_cores() as chosen:
        assert chosen == min(torch.get_num_threads(), threads.thread_budget()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_spinning_process_is_seen_and_this_process_threads_are_not():
    """Real processes: a spinning one counts (beside torch's own threads, busy a moment ago)."""
    torch.ones(2000, 2000) @ torch.ones(2000, 2000)  # wakes torch's threads
    quiet = threads.others_running()
    if quiet is None:
        pytest.skip("this process may not run on every CPU")
    with busy_process():
        deadline = time.monotonic() + 10
        busy = threads.others_running()
        while busy < quiet + 1 and time.monotonic() < deadline:  # the spinner starting
            time.sleep(0.1)
            busy = threads.others_running()
    assert busy >= quiet + 1
