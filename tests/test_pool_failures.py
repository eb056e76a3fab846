"""How a pool fails, tried as an unlucky operator would: each case a real second process.

Real worker processes and gloo on 127.0.0.1; a real tmpfs where the machine
lets this process mount one.
"""

import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import alive, wait_for, worker_pids

from sklearn_casgd import (
    CASGDLinearRegression,
    CASGDLogisticRegression,
    DistributedFitError,
    WorkerPool,
    close_worker_pools,
)
from sklearn_casgd._distributed import failures, launch, rundir
from sklearn_casgd.datasets import make_glm_data

pytestmark = pytest.mark.distributed

FLOAT64 = dict(precision="fp64", device="cpu", random_state=0, batch_size=16, max_iter=3, tol=None)
JOB_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# A fit that runs until it is stopped (tens of seconds at least).
ENDLESS = dict(precision="fp64", device="cpu", random_state=0, s=4, solver="sgd", tol=None)


@pytest.mark.parametrize("family", ["linear", "logistic"])
@pytest.mark.parametrize("sparse", [False, True])
def test_more_ranks_than_features_fit_with_the_default_s(family, sparse):
    """A rank without columns times its steps too (it divided by zero in the cost model)."""
    X, y, _ = make_glm_data(family, 300, 1, random_state=0)
    X = sp.csr_matrix(X) if sparse else X
    Estimator = CASGDLinearRegression if family == "linear" else CASGDLogisticRegression
    one = Estimator(n_devices=1, **FLOAT64).fit(X, y)
    two = Estimator(n_devices=2, **FLOAT64).fit(X, y)
    assert two.fit_stats_["world_size"] == 2 and two.fit_stats_["s"] >= 1
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(two.intercept_, one.intercept_, rtol=0, atol=1e-10)


def _sleeping_rank_fit(monkeypatch, act, timeout):
    """Fit on a pool whose rank 1 sleeps in its fit; ``act(pids)`` runs a second in."""
    X, y, _ = make_glm_data("linear", 200, 4, random_state=0)
    estimator = CASGDLinearRegression(n_devices=2, **dict(FLOAT64, timeout=timeout))
    with WorkerPool(2) as pool:
        estimator.fit(X, y)  # the workers are up
        pids = pool.pids
        monkeypatch.setattr(launch, "_FAULT", "1:hang")
        timer = threading.Timer(1.0, act, args=(pids,))
        timer.start()
        started = time.monotonic()
        try:
            with pytest.raises(DistributedFitError) as error:
                estimator.fit(X, y)
        finally:
            timer.cancel()
        elapsed = time.monotonic() - started
        monkeypatch.setattr(launch, "_FAULT", None)
        again = estimator.fit(X, y)  # new workers, a working group
        assert again.fit_stats_["world_size"] == 2 and pool.n_starts == 2
    return error.value, elapsed, pids


def test_a_worker_terminated_mid_fit_is_named_and_removes_nothing_shared(monkeypatch):
    """SIGTERM (a process manager) to one worker: the fit names it; nothing shared is gone."""
    error, elapsed, pids = _sleeping_rank_fit(
        monkeypatch, lambda pids: os.kill(pids[1], signal.SIGTERM), timeout=30
    )
    assert error.rank == 1
    assert "was killed by SIGTERM" in str(error) and "FileNotFoundError" not in str(error)
    assert elapsed < 15  # the exit is heard at once, not after the collective timeout
    assert wait_for(lambda: not any(alive(pid) for pid in pids), 10)


def _stop(pids):
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def test_a_fit_whose_workers_are_all_stopped_ends_after_its_timeout_and_a_margin():
    """Both ranks SIGSTOPped: no collective can time out; the parent's heartbeat watch does."""
    X, y, _ = make_glm_data("logistic", 3000, 9, random_state=0)
    timeout = 5.0
    estimator = CASGDLogisticRegression(n_devices=2, max_iter=100000, timeout=timeout, **ENDLESS)
    finished, released = threading.Event(), threading.Event()
    with WorkerPool(2) as pool:
        CASGDLogisticRegression(n_devices=2, max_iter=1, timeout=timeout, **ENDLESS).fit(X, y)
        pids = pool.pids

        def stop_then_release():
            time.sleep(1.5)
            _stop(pids)
            if not finished.wait(timeout + launch.SILENCE_MARGIN + 20):
                released.set()  # the bug: kill the workers so that the fit, and the test, end
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)

        # The fit runs in this thread: the active pool is this thread's.
        threading.Thread(target=stop_then_release, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(DistributedFitError) as error:
            estimator.fit(X, y)
        seconds = time.monotonic() - started
        finished.set()
    assert not released.is_set(), "the fit outlived its timeout with every worker stopped"
    assert seconds < 1.5 + timeout + launch.SILENCE_MARGIN + 10
    assert "rank(s) 0, 1 sent nothing" in str(error.value)
    assert wait_for(lambda: not any(alive(pid) for pid in pids), 10)


def test_the_exit_of_a_worker_names_the_likely_cause_of_its_signal():
    culprit, details = failures.exit_error(1, -signal.SIGBUS, "", [0])
    assert culprit == 1
    assert "SIGBUS" in details and rundir.SHARED_MEMORY_DIR in details and "full" in details
    assert "exited with code 3" in failures.exit_error(0, 3, "", [])[1]


def _fill(directory):
    """Take every free byte of ``directory``'s file system."""
    with open(Path(directory) / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"x" * (1 << 16))
                handle.flush()
        except OSError:
            pass


def test_shared_memory_filling_up_mid_fit_is_named_not_a_sigbus(tmp_path, monkeypatch):
    """/dev/shm fills after the inputs are written: the workers' writes fail with ENOSPC."""
    from test_launch_safety import tmpfs

    X, y, _ = make_glm_data("linear", 2000, 500, random_state=0)
    write_inputs = rundir.write_fit_inputs

    def then_fill(*args):
        spec = write_inputs(*args)
        _fill(rundir.SHARED_MEMORY_DIR)
        return spec

    with tmpfs(tmp_path / "shm", 20) as shm:
        monkeypatch.setattr(rundir, "SHARED_MEMORY_DIR", str(shm))
        monkeypatch.setattr(rundir, "write_fit_inputs", then_fill)
        with WorkerPool(2), pytest.raises(DistributedFitError) as error:
            CASGDLinearRegression(n_devices=2, **FLOAT64).fit(X, y)
        assert "No space left on device" in str(error.value)
        assert "SIGBUS" not in str(error.value)
        (shm / "filler").unlink()
        assert not list(shm.iterdir())


HOLD_SCRIPT = """
import sys, time
from sklearn_casgd._distributed import rundir
print(rundir.make_run_dir(0), rundir.make_pool_dir(), flush=True)
sys.stdin.readline()
"""


def test_a_live_run_whose_pid_looks_dead_is_not_removed():
    """A run of another PID namespace carries a pid that is dead here; its lock says it lives.

    A real second process makes and holds a run and a pool directory; they
    are renamed to carry a pid that no process here has (as a namespace's
    pids look from outside it).
    """
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_SCRIPT],
        env=JOB_ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    renamed = []
    try:
        for path in map(Path, holder.stdout.readline().split()):
            owner = path.name[len("sklearn_casgd_") :].split("_", 1)[0]
            foreign = path.with_name(path.name.replace(f"_{owner}_", f"_{dead.pid}_", 1))
            path.rename(foreign)
            old = time.time() - 3600  # and old: nothing protects it but the lock
            os.utime(foreign, (old, old))
            renamed.append(foreign)
        rundir.remove_dead_runs()
        assert all(path.is_dir() for path in renamed)  # the owner lives: both stay
        holder.stdin.close()
        holder.wait(timeout=30)
        rundir.remove_dead_runs()
        assert not any(path.exists() for path in renamed)  # its owner is gone: removed
    finally:
        holder.kill()
        holder.wait()
        for path in renamed:
            if path.exists():
                path.rmdir()


def test_closing_a_pool_is_prompt_while_a_forked_child_lives():
    """A forked child holds a copy of the workers' stdin: end of file never reaches them."""
    X, y, _ = make_glm_data("linear", 100, 4, random_state=0)
    pool = WorkerPool(2)
    with pool:
        CASGDLinearRegression(n_devices=2, **FLOAT64).fit(X, y)
        child = os.fork()
        if child == 0:  # pragma: no cover - the child only sleeps
            time.sleep(15)
            os._exit(0)
        try:
            pids = pool.pids
            started = time.monotonic()
            pool.close()
            assert time.monotonic() - started < 2.5
            assert wait_for(lambda: not any(alive(pid) for pid in pids), 5)
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)


def test_threads_fitting_with_different_sizes_keep_their_default_pools():
    X, y, _ = make_glm_data("linear", 200, 6, random_state=0)
    close_worker_pools()
    errors = []

    def fits(n_devices):
        try:
            for _ in range(2):
                CASGDLinearRegression(n_devices=n_devices, **FLOAT64).fit(X, y)
        except Exception as error:  # reported below
            errors.append(error)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 3 workers on 2 cores
        threads = [threading.Thread(target=fits, args=(k,)) for k in (2, 3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors
    assert launch.pool_for(2).n_starts == 1 and launch.pool_for(3).n_starts == 1
    assert len(worker_pids()) == 5
    close_worker_pools()
    assert wait_for(lambda: worker_pids() == [], 10)


KILLED_WHILE_WRITING = """
import time
from sklearn_casgd import CASGDLinearRegression
from sklearn_casgd._distributed import rundir
from sklearn_casgd.datasets import make_glm_data
write_block = rundir._write_block
def write_then_stall(path, *args):
    write_block(path, *args)
    print("written", path.parent, flush=True)
    time.sleep(600)
rundir._write_block = write_then_stall
X, y, _ = make_glm_data("linear", 20000, 16, random_state=0)
CASGDLinearRegression(n_devices=2, device="cpu", max_iter=1, tol=None).fit(X, y)
"""

# The parent-death signal comes when the main thread ends, which in a parent
# with other threads (pyarrow starts a dozen) can be before the process has.
KILLED_WITH_THREADS = (
    "import threading, time\n"
    "for _ in range(16): threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    + KILLED_WHILE_WRITING
)

IDLE_THREAD_POOL = """
import threading, time
from sklearn_casgd import CASGDLinearRegression
from sklearn_casgd._distributed import launch
from sklearn_casgd.datasets import make_glm_data
X, y, _ = make_glm_data("linear", 200, 4, random_state=0)
fit = lambda: CASGDLinearRegression(n_devices=2, device="cpu", max_iter=1, tol=None).fit(X, y)
thread = threading.Thread(target=fit)
thread.start()
thread.join()
print("pool", launch.pool_for(2)._slot[0].pool_dir, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(
    "script, leaves",
    [
        (KILLED_WHILE_WRITING, "written"),
        (KILLED_WITH_THREADS, "written"),
        (IDLE_THREAD_POOL, "pool"),
    ],
    ids=["while-writing-the-blocks", "with-threads-while-writing", "idle-pool-of-a-thread"],
)
def test_a_parent_killed_leaves_no_directory(script, leaves):
    """SIGKILL while the parent writes a fit's blocks (the workers have not heard of the
    run), or while a pool that a thread started is idle (no parent-death signal)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", script], env=JOB_ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        said, directory = parent.stdout.readline().split()
        assert said == leaves and Path(directory).is_dir()
        workers = worker_pids(parent.pid)
        assert len(workers) == 2
        parent.kill()
        parent.wait(timeout=10)
        assert wait_for(lambda: not any(alive(pid) for pid in workers), 10)
        assert wait_for(lambda: not Path(directory).exists(), 10), directory
    finally:
        parent.kill()
        parent.wait()
