import contextlib
import dataclasses
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sklearn_casgd._estimators._base as estimator_base
from sklearn_casgd.metrics import glm_objective


@pytest.fixture(autouse=True)
def torch_threads_as_set(monkeypatch):
    """Fits keep torch's thread count instead of sizing it to the free cores.

    The last bits of a float64 fit depend on the thread count (the order of
    its sums); the suite's exact identities (a resumed fit equals the
    uninterrupted one) compare fits made at different moments of a machine
    whose load changes. The sizing itself is tested in tests/test_threads.py.
    """
    from sklearn_casgd._distributed import threads

    monkeypatch.setattr(threads, "SIZE_TO_FREE_CORES", False)


@pytest.fixture(params=[0, 1], ids=lambda seed: f"seed{seed}")
def global_random_seed(request):
    """Seeds a test runs with; tests must pass for each of them."""
    return request.param


@pytest.fixture
def force_plan(monkeypatch):
    """``force_plan(**fields)``: the next fits plan as usual, then with ``fields`` set.

    The fit plan travels to the workers, which honour its fields (as
    ``benchmarks/bench_distributed.py`` sets ``exchange``).
    """
    original = estimator_base.plan_fit

    def force(**fields):
        def plan(*args, **kwargs):
            fit_plan, *rest = original(*args, **kwargs)
            return (dataclasses.replace(fit_plan, **fields), *rest)

        monkeypatch.setattr(estimator_base, "plan_fit", plan)

    return force


@pytest.fixture
def precondition_sparse(monkeypatch):
    """SVRG preconditions a sparse X as a dense one (off by default): the
    sparse rows' implicit centering is then held to the dense rows' products."""
    from sklearn_casgd._engine import fit_plan

    monkeypatch.setattr(fit_plan, "PRECONDITION_SPARSE", True)


@pytest.fixture
def force_exchange(force_plan):
    """``force_exchange("all-reduce" | "all-gather" | "auto")``: the next fits' exchange.

    On the CPU the fits gather the rows of nearly every small problem; the
    tests cover the Gram all-reduce too.
    """
    return lambda exchange: force_plan(exchange=exchange)


def objective(family, X, y, coef, intercept, alpha, sample_weight=None):
    """The exact float64 objective (numpy, independent of the torch engine)."""
    return glm_objective(family, X, y, coef, intercept, alpha, sample_weight)


def worker_pids(parent_pid=None):
    """PIDs of live CA-SGD workers started by ``parent_pid`` (this process by default).

    Only children count: other test runs on the machine may have workers too.
    """
    parent_pid = os.getpid() if parent_pid is None else parent_pid
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if (
            b"sklearn_casgd._distributed.worker" in cmdline
            and fields[0] != "Z"
            and int(fields[1]) == parent_pid
        ):
            pids.append(int(entry))
    return pids


def alive(pid):
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def wait_for(condition, seconds):
    """Poll ``condition`` until it holds (True) or ``seconds`` pass (False)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


# A job's ranks on this machine: gloo on loopback, one thread each (2 cores).
JOB_ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def run_torchrun(script, *args, timeout, nproc=2, max_restarts=0):
    """``script args`` on ``nproc`` ranks of a torchrun job (standalone rendezvous on 127.0.0.1).

    ``max_restarts``: how many times torchrun restarts every rank after one fails.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--local-addr=127.0.0.1",
        str(script),
        *map(str, args),
    ]
    completed = subprocess.run(
        command, env=JOB_ENV, capture_output=True, text=True, timeout=timeout
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def _spin(stop):
    count = 0
    while not stop.is_set():
        count += 1


@contextlib.contextmanager
def busy_process():
    """Within the block another process holds a core: a Python loop that never sleeps."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    spinner = context.Process(target=_spin, args=(stop,))
    spinner.start()
    try:
        yield
    finally:
        stop.set()
        spinner.join()
