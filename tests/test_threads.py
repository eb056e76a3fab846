"""numpy's BLAS runs on the calling thread during a fit, and as the user set it after."""

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_info, threadpool_limits

import sklearn_casgd._engine.fit_plan as fit_plan
from sklearn_casgd import CASGDLinearRegression
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
