"""Worker pools: workers kept across fits, the default pool, and the backend seam.

Real worker processes and gloo on 127.0.0.1.
"""

import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
from conftest import alive, wait_for, worker_pids
from joblib import Parallel, cpu_count, delayed
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV

from sklearn_casgd import (
    CASGDLinearRegression,
    CASGDLogisticRegression,
    DistributedFitError,
    WorkerPool,
    close_worker_pools,
)
from sklearn_casgd._distributed import backends, launch, threads
from sklearn_casgd.datasets import make_glm_data

pytestmark = pytest.mark.distributed

FLOAT64 = dict(precision="fp64", max_iter=3, tol=None, device="cpu", random_state=0, s=4)


def test_a_grid_search_runs_on_one_start_of_the_pool_and_matches_one_rank():
    X, y, _ = make_glm_data("logistic", 300, 6, random_state=0)
    grid = {"alpha": [1e-4, 1e-3, 1e-2]}
    close_worker_pools()  # only this pool's workers run
    local = GridSearchCV(CASGDLogisticRegression(n_devices=1, **FLOAT64), grid, cv=2).fit(X, y)
    with WorkerPool(2) as pool:
        search = GridSearchCV(CASGDLogisticRegression(n_devices=2, **FLOAT64), grid, cv=2)
        search.fit(X, y)
        assert pool.n_starts == 1 and sorted(pool.pids) == sorted(worker_pids())
    assert pool.pids == [] and worker_pids() == []  # closed with the block
    np.testing.assert_allclose(
        search.cv_results_["mean_test_score"], local.cv_results_["mean_test_score"], atol=1e-12
    )
    np.testing.assert_allclose(
        search.best_estimator_.coef_, local.best_estimator_.coef_, rtol=0, atol=1e-10
    )
    assert search.best_estimator_.fit_stats_["world_size"] == 2


def test_fits_outside_a_pool_share_the_default_pool_until_it_is_closed():
    X, y, _ = make_glm_data("linear", 200, 4, random_state=0)
    estimator = CASGDLinearRegression(n_devices=2, **FLOAT64)
    estimator.fit(X, y)
    workers = sorted(worker_pids())
    assert len(workers) == 2
    clone(estimator).fit(X, y)
    assert sorted(worker_pids()) == workers  # the same processes served the second fit
    close_worker_pools()
    assert worker_pids() == []
    assert estimator.fit(X, y).fit_stats_["world_size"] == 2  # a new default pool
    assert len(worker_pids()) == 2 and sorted(worker_pids()) != workers


def test_the_active_pool_must_have_n_devices_workers():
    X, y, _ = make_glm_data("linear", 50, 4, random_state=0)
    with WorkerPool(2), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "n_devices=3 runs", UserWarning)  # on <= 2 cores
        with pytest.raises(ValueError, match="n_devices=3, but the active WorkerPool has 2"):
            CASGDLinearRegression(n_devices=3, device="cpu").fit(X, y)
        # one rank still fits in this process
        assert CASGDLinearRegression(n_devices=1, **FLOAT64).fit(X, y).fit_stats_["world_size"] == 1


@pytest.mark.parametrize(
    "n_workers, error, match",
    [(1, ValueError, "at least 2"), (2.0, TypeError, "must be an int"), (True, TypeError, "int")],
)
def test_bad_pool_sizes_are_clear_errors(n_workers, error, match):
    with pytest.raises(error, match=match):
        WorkerPool(n_workers)


def test_a_pool_cannot_be_pickled_and_an_estimator_does_not_hold_one():
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(WorkerPool(2))
    X, y, _ = make_glm_data("linear", 50, 4, random_state=0)
    fitted = CASGDLinearRegression(n_devices=2, **FLOAT64).fit(X, y)
    restored = pickle.loads(pickle.dumps(fitted))
    np.testing.assert_array_equal(restored.predict(X), fitted.predict(X))


def test_the_backend_follows_n_devices():
    import torch

    cpu = torch.device("cpu")
    assert isinstance(backends.backend_for(1, cpu, 10.0), backends.InProcess)
    pooled = backends.backend_for(2, cpu, 10.0)
    assert isinstance(pooled, backends.OnWorkerPool) and pooled.world_size == 2
    assert not pooled.shares_seed and backends.JobWorld.shares_seed


def test_a_forked_child_neither_uses_nor_stops_the_parents_workers():
    X, y, _ = make_glm_data("linear", 100, 4, random_state=0)
    estimator = CASGDLinearRegression(n_devices=2, **FLOAT64).fit(X, y)
    pool = launch.pool_for(2)
    workers = sorted(pool.pids)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        verdict = b"ok"
        try:
            pool._run_fit(None, X, None, None, 10.0)
            verdict = b"used the parent's pool"
        except RuntimeError as error:
            if "a forked process cannot use it" not in str(error):
                verdict = str(error).encode()
        if launch.pool_for(2) is pool:
            verdict = b"inherited the default pool"
        pool.close()  # must leave the parent's workers alone
        os.write(write_end, verdict)
        os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    assert os.read(read_end, 1000) == b"ok"
    os.close(read_end)
    assert sorted(pool.pids) == workers == sorted(worker_pids())
    assert estimator.fit(X, y).fit_stats_["world_size"] == 2 and pool.n_starts == 1


def caught_warnings(n_workers):
    threads._SHOWN.clear()  # each verdict from a fresh process's memory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads.warn_if_oversubscribed(n_workers)
    return [str(w.message) for w in caught]


def oversubscription_in_a_joblib_worker():
    """The thread budget a loky worker sees, and the check's verdicts around it."""
    _, budget = threads.thread_budget()
    return (
        budget,
        caught_warnings(budget),
        caught_warnings(budget + 1),
        threads.threads_per_worker(budget),
        threads.threads_per_worker(budget + 1),
    )


def test_more_worker_processes_than_cores_warn_in_this_process_and_in_joblib_workers(
    monkeypatch,
):
    monkeypatch.setattr(threads, "_SHOWN", set())
    cores = len(os.sched_getaffinity(0))
    with pytest.warns(UserWarning, match=f"runs {cores + 1} worker processes on {cores} CPU"):
        threads.warn_if_oversubscribed(cores + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        threads.warn_if_oversubscribed(cores)
    # Inside GridSearchCV(n_jobs=2)'s workers, joblib gives each job cpu_count // 2
    # threads through OMP_NUM_THREADS (unless this process set that variable).
    [(budget, quiet, loud, threads_quiet, threads_loud)] = Parallel(n_jobs=2)(
        [delayed(oversubscription_in_a_joblib_worker)()]
    )
    if "OMP_NUM_THREADS" not in os.environ:
        assert budget == max(cpu_count() // 2, 1)
    assert quiet == [] and threads_quiet == 1 and threads_loud == 1
    assert len(loud) == 1 and f"runs {budget + 1} worker processes" in loud[0]
    if budget < cores:
        assert "GridSearchCV(n_jobs=" in loud[0]


IDLE_SCRIPT = """
from sklearn_casgd import CASGDLinearRegression
from sklearn_casgd._distributed import launch
from sklearn_casgd.datasets import make_glm_data
X, y, _ = make_glm_data("linear", 100, 4, random_state=0)
CASGDLinearRegression(n_devices=2, device="cpu", max_iter=1, tol=None).fit(X, y)
print(*launch.pool_for(2).pids, flush=True)
import time; time.sleep(600)
"""


@pytest.mark.parametrize("ending", ["SIGKILL while idle", "normal exit"])
def test_no_worker_outlives_the_process_that_owns_the_pool(ending):
    script = IDLE_SCRIPT if ending != "normal exit" else IDLE_SCRIPT.replace("time.sleep(600)", "")
    owner = subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        workers = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(workers) == 2
        if ending != "normal exit":
            owner.kill()
        owner.wait(timeout=60)
        gone = wait_for(lambda: not any(alive(pid) for pid in workers), 10)
        assert gone, [pid for pid in workers if alive(pid)]
    finally:
        owner.kill()
        owner.wait()


def test_a_pool_started_by_a_thread_outlives_the_thread():
    """Linux's parent-death signal follows the starting thread; the workers must not."""
    import threading

    close_worker_pools()
    X, y, _ = make_glm_data("linear", 100, 4, random_state=0)
    estimator = CASGDLinearRegression(n_devices=2, **FLOAT64)
    thread = threading.Thread(target=estimator.fit, args=(X, y))
    thread.start()
    thread.join()
    workers = sorted(worker_pids())
    assert len(workers) == 2
    assert not wait_for(lambda: not all(alive(pid) for pid in workers), 2)
    estimator.fit(X, y)
    assert sorted(worker_pids()) == workers and launch.pool_for(2).n_starts == 1


def test_a_worker_killed_between_fits_is_replaced_by_the_next_fit():
    import signal

    X, y, _ = make_glm_data("linear", 100, 4, random_state=0)
    estimator = CASGDLinearRegression(n_devices=2, **FLOAT64)
    with WorkerPool(2) as pool:
        first = estimator.fit(X, y).coef_.copy()
        os.kill(pool.pids[1], signal.SIGKILL)
        # Its main thread shows as a zombie before its other threads are gone; wait
        # until the whole process has exited (waitable; WNOWAIT leaves it to the pool).
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        assert wait_for(lambda: os.waitid(os.P_PID, pool.pids[1], flags) is not None, 10)
        np.testing.assert_array_equal(estimator.fit(X, y).coef_, first)
        assert pool.n_starts == 2 and set(pool.pids) <= set(worker_pids())


# Without _set_pg_timeout (older torch) a fit with a shorter timeout starts new workers;
# this torch has it, so that fallback runs with the slow tests.
@pytest.mark.parametrize("can_set_timeout", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_each_fit_waits_for_a_hung_rank_only_its_own_timeout(can_set_timeout, monkeypatch):
    """A pool started by a fit with timeout=60 serves a fit with timeout=3 (where torch
    cannot change a group's timeout, by new workers)."""
    import time

    monkeypatch.setattr(launch, "CAN_SET_GROUP_TIMEOUT", can_set_timeout)
    X, y, _ = make_glm_data("linear", 100, 4, random_state=0)
    with WorkerPool(2) as pool:
        CASGDLinearRegression(n_devices=2, **dict(FLOAT64, timeout=60)).fit(X, y)
        monkeypatch.setattr(launch, "_FAULT", "1:hang")
        started = time.monotonic()
        with pytest.raises(DistributedFitError, match="stopped answering"):
            CASGDLinearRegression(n_devices=2, **dict(FLOAT64, timeout=3)).fit(X, y)
        assert time.monotonic() - started < (20 if can_set_timeout else 30)
        assert pool.n_starts == (1 if can_set_timeout else 2)


def test_threads_fitting_at_once_take_turns_on_the_pool():
    import threading

    X, y, _ = make_glm_data("logistic", 600, 9, random_state=0)
    params = dict(FLOAT64, n_devices=2)
    reference = CASGDLogisticRegression(**params).fit(X, y).coef_
    starts = launch.pool_for(2).n_starts
    coefs = {}

    def fit(i):
        coefs[i] = CASGDLogisticRegression(**params).fit(X, y).coef_

    threads = [threading.Thread(target=fit, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(3):
        np.testing.assert_array_equal(coefs[i], reference)
    assert launch.pool_for(2).n_starts == starts


INTERRUPT_SCRIPT = """
import faulthandler, os, signal, threading
faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where, before the timeout
import numpy as np
from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._distributed import launch
from sklearn_casgd.datasets import make_glm_data
X, y, _ = make_glm_data("logistic", 3000, 9, random_state=0)
# timeout=20: a start-up that hangs ends in DistributedFitError (after 20 + 60 s), with the
# state of every rank, before the test's 120 s.
params = dict(precision="fp64", tol=None, device="cpu", random_state=0, s=4, n_devices=2,
              timeout=20)
reference = CASGDLogisticRegression(max_iter=2, **params).fit(X, y).coef_
workers = launch.pool_for(2).pids
threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    CASGDLogisticRegression(max_iter=100000, solver="sgd", **params).fit(X, y)
except KeyboardInterrupt:
    print("interrupted", launch.pool_for(2).pids, *workers)
again = CASGDLogisticRegression(max_iter=2, **params).fit(X, y).coef_
print("next", np.array_equal(again, reference), launch.pool_for(2).n_starts)
"""


def test_an_interrupted_fit_stops_the_workers_and_the_next_fit_starts_new_ones():
    completed = subprocess.run(
        [sys.executable, "-c", INTERRUPT_SCRIPT],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    interrupted, following = completed.stdout.splitlines()
    assert interrupted.startswith("interrupted [] ")  # no worker left after Ctrl-C
    old_workers = [int(pid) for pid in interrupted.split()[2:]]
    assert wait_for(lambda: not any(alive(pid) for pid in old_workers), 10)
    assert following == "next True 2"


def test_a_worker_imports_the_engine_without_scikit_learn(tmp_path):
    """The workers' bootstrap skips the package's __init__ (estimators, scikit-learn)."""
    imports = (
        f"import sys; sys.path.insert(0, {launch._PACKAGE_ROOT!r}); {{stub}}"
        "import sklearn_casgd._distributed.worker; "
        "print('sklearn' in sys.modules, 'sklearn_casgd._estimators' in sys.modules)"
    )
    outputs = []
    for stub in (launch._PACKAGE_STUB, ""):  # the bootstrap's, and a plain import
        completed = subprocess.run(
            [sys.executable, "-c", imports.format(stub=stub)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert completed.returncode == 0, completed.stderr[-3000:]
        outputs.append(completed.stdout.strip())
    assert outputs == ["False False", "True True"]


def test_the_oversubscription_warning_is_shown_once_per_process(monkeypatch):
    """GridSearchCV's fits reset Python's once-per-location memory (they change the
    filters): the warning itself remembers, under any filter."""
    monkeypatch.setattr(threads, "_SHOWN", set())
    cores = len(os.sched_getaffinity(0))
    shown = []
    for _ in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            threads.warn_if_oversubscribed(cores + 1)
        shown += caught
    assert len(shown) == 1
    with warnings.catch_warnings(record=True) as caught:  # another message is news
        warnings.simplefilter("always")
        threads.warn_if_oversubscribed(cores + 2)
    assert len(caught) == 1
