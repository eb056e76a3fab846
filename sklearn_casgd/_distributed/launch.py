"""``n_devices=k``: a pool of k worker processes that serves fit after fit.

A :class:`WorkerPool` starts k worker interpreters (``python -c`` with the
package's own root first on ``sys.path``, so neither the current directory
nor ``__main__`` is imported: it works from unguarded scripts, ``python -c``,
notebooks and joblib/loky workers). They meet once, through a ``FileStore``
in the pool's private directory, in a process group (gloo on the loopback
interface, NCCL on CUDA), and then serve fits: the parent writes a fit's
inputs into a run directory (see :mod:`.rundir`) and sends its path down
every worker's stdin; each worker answers on a pipe of its own with one JSON
message per line (``ready``, ``out`` for the progress text of rank 0,
``done``, or ``error`` with its traceback). Nothing listens on a network
socket but gloo's own connections between the workers, on the loopback
interface (on Linux CPU workers, of a network namespace of their own: see
:mod:`.netns`), and nothing read from a pipe or a socket is unpickled.

Workers die with the process that owns the pool (``PR_SET_PDEATHSIG``, a
watch on the parent, end of file on stdin). Any worker that raises, exits or
stops answering ends the fit with a :class:`DistributedFitError` within
``timeout`` seconds (a rank that stops altogether, within ``timeout`` plus a
margin: the parent hears every worker beat while it fits), and the pool
stops every worker: the next fit starts a fresh group. Fits without an
active pool (``with WorkerPool(k):``) use the process's default pool for
their ``k``, started by the first such fit and closed at exit or by
:func:`close_worker_pools`.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
import weakref
from contextvars import ContextVar, Token
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .._engine.fit import BlockResult, FitPlan, column_blocks
from . import netns, rundir
from .failures import DistributedFitError, Reports, exit_cause
from .rundir import WorkerSpec, map_output, read_private, result_path, stderr_path
from .threads import threads_per_worker

# Testing hook, set by the tests only (never from the environment):
# "<rank>:<raise|exit|hang>" makes that rank fail at the start of its next fit.
_FAULT: str | None = None
# Start-up (interpreter, import torch, rendezvous) gets this on top of
# `timeout`, which bounds the wait inside collectives: a loaded machine
# starts workers slowly (docs/tuning.md).
STARTUP_SECONDS = 60.0
# Each fit sets its own collective timeout on the pool's group where torch
# can (a private function of torch >= 2.4); elsewhere a fit with another
# timeout restarts the workers.
CAN_SET_GROUP_TIMEOUT = hasattr(dist.distributed_c10d, "_set_pg_timeout")
# A worker says "beat" this often during a fit; one silent for the fit's timeout
# plus SILENCE_MARGIN (stopped, frozen) is given up on and the pool killed.
BEAT_SECONDS = 1.0
SILENCE_MARGIN = 5.0
# A closed pool's workers get this long to leave the group and exit before they are killed.
_EXIT_SECONDS = 5.0


# -- one start of a pool's processes ----------------------------------------------------

# The workers import this very copy of the package, installed or not, and
# never the current directory: `python -c` puts "" (the cwd) on sys.path,
# and the bootstrap drops it and puts the package's root first.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# The network namespace is entered before anything starts a thread: _netns is
# loaded by path, without the package (which imports torch).
_NETNS_PATH = str(Path(__file__).resolve().parent / "netns.py")
# The workers run the engine only: an empty package module stands in for the
# package, whose __init__ (the estimators, and scikit-learn with them) would add
# about 1 s to every worker's start; its submodules import as usual.
_PACKAGE_STUB = (
    "import importlib.machinery as im, importlib.util as iu; "
    "p = im.ModuleSpec('sklearn_casgd', None, is_package=True); "
    f"p.submodule_search_locations = [{str(Path(_PACKAGE_ROOT) / 'sklearn_casgd')!r}]; "
    "sys.modules['sklearn_casgd'] = iu.module_from_spec(p); "
)
_WORKER_BOOTSTRAP = (
    f"import sys; sys.path[:] = [{_PACKAGE_ROOT!r}, *(p for p in sys.path if p)]; "
    "import importlib.util as u; "
    f"s = u.spec_from_file_location('sklearn_casgd_netns', {_NETNS_PATH!r}); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); "
    "m.enter(sys.argv[9], int(sys.argv[5])); "
    f"{_PACKAGE_STUB}from sklearn_casgd._distributed.worker import main; main(sys.argv[1:])"
)
# CPU workers get a network namespace of their own where Linux allows it.
PRIVATE_NETWORK = sys.platform.startswith("linux")


def _loopback_interface() -> str:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


def rank_device(device: str, rank: int, world_size: int, device_count: int) -> torch.device:
    """The device pool rank ``rank`` of ``world_size`` fits on, for the estimator's ``device``.

    The CPU for every rank; on CUDA the ranks take consecutive devices from
    the estimator's (``cuda`` is ``cuda:0``): ``cuda:1`` with one worker is
    ``cuda:1``, not rank 0's ``cuda:0``. NCCL takes one rank a device, so the
    devices must be visible (``device_count``): ``ValueError`` otherwise.
    """
    base = torch.device(device)
    if base.type != "cuda":
        return base
    first = base.index or 0
    if first + world_size > device_count:
        raise ValueError(
            f"n_devices={world_size} from {base} needs CUDA devices {first} to "
            f"{first + world_size - 1}, but {device_count} are visible."
        )
    return torch.device("cuda", first + rank)


class _Workers:
    """k worker processes joined in one process group, with their pipes and directory."""

    def __init__(self, n_workers: int, device: str, timeout: float, threads: int) -> None:
        self.owner = os.getpid()
        self.device = device  # the estimator's: each rank's follows it (rank_device)
        self.timeout = timeout
        self.pool_dir = rundir.make_pool_dir()
        self.processes: list[subprocess.Popen] = []
        self.status: dict[int, int] = {}  # rank -> read end of its message pipe
        self._pending: dict[int, bytes] = {}
        self.private_network = False  # whether the workers have a network namespace of their own
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": _loopback_interface(),
            # NCCL's bootstrap and socket transport stay on loopback too.
            "NCCL_SOCKET_IFNAME": _loopback_interface(),
            "OMP_NUM_THREADS": str(threads),
        }
        deadline = time.monotonic() + timeout + STARTUP_SECONDS
        try:
            if torch.device(device).type == "cpu" and PRIVATE_NETWORK:
                self._start(0, n_workers, env, timeout, "create")
                self.private_network = self._network_of_rank_0(deadline) == "private"
            else:
                self._start(0, n_workers, env, timeout, "host")
            network = f"join:{self.processes[0].pid}" if self.private_network else "host"
            if self.private_network:
                env["GLOO_SOCKET_IFNAME"] = netns.LOOPBACK
            for rank in range(1, n_workers):
                self._start(rank, n_workers, env, timeout, network)
            self.collect("ready", timeout, deadline=deadline)
        except BaseException:
            self.stop(kill=True)
            raise

    def _network_of_rank_0(self, deadline: float) -> str:
        """Wait for rank 0 to say where the workers' network is (``private`` or ``host``)."""
        fd = self.status[0]
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._pending[0]:
                if time.monotonic() > deadline or not selector.select(deadline - time.monotonic()):
                    raise DistributedFitError(0, "did not start (no network namespace reported).")
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    code = self.processes[0].wait()
                    raise DistributedFitError(0, f"worker {exit_cause(code)}.\n{self._tail(0)}")
                self._pending[0] += chunk
        line, self._pending[0] = self._pending[0].split(b"\n", 1)
        kind, where = json.loads(line)
        return where if kind == "network" else "host"

    def _start(
        self, rank: int, n_workers: int, env: dict[str, str], timeout: float, network: str
    ) -> None:
        read_end, write_end = os.pipe()
        self.status[rank] = read_end
        self._pending[rank] = b""
        command = [
            sys.executable, "-c", _WORKER_BOOTSTRAP, self.pool_dir, str(rank), str(n_workers),
            str(self.owner), str(write_end), self.device, repr(float(timeout)),
            # Linux sends the parent-death signal when the *thread* that started
            # a child ends: armed only for workers started by the main thread.
            str(int(threading.current_thread() is threading.main_thread())),
            network,  # create, join:<pid> or host: see netns.enter
        ]  # fmt: skip
        try:
            # Appending, so that truncating it before each fit keeps one fit's output.
            with open(stderr_path(self.pool_dir, rank), "a") as stderr:
                process = subprocess.Popen(
                    command, env=env, stdin=subprocess.PIPE, stderr=stderr, pass_fds=(write_end,)
                )
            self.processes.append(process)
        finally:
            os.close(write_end)  # the worker holds it: end of file means it exited

    def alive(self) -> bool:
        return os.getpid() == self.owner and all(p.poll() is None for p in self.processes)

    def serves(self, device: str, timeout: float) -> bool:
        """Whether a fit on ``device`` with collective ``timeout`` can run on these workers."""
        same_timeout = CAN_SET_GROUP_TIMEOUT or timeout == self.timeout
        return self.alive() and device == self.device and same_timeout

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def send(self, run_dir: str) -> None:
        """Give every worker a fit: the path of its run directory, one line on its stdin."""
        line = (run_dir + "\n").encode()
        for process in self.processes:
            try:
                process.stdin.write(line)
                process.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass  # it exited: collect() reports how

    def collect(self, answer: str, timeout: float, deadline: float | None = None) -> None:
        """Wait until every rank has sent ``answer``; raise for the first failure.

        ``deadline`` bounds the wait for a start-up. During a fit every rank
        beats each ``BEAT_SECONDS``: a rank silent for ``timeout +
        SILENCE_MARGIN`` (stopped or frozen; a rank waiting in a collective
        still beats, and its collective times out after ``timeout``) ends
        the wait. Rank 0's progress text is written to this process's
        stdout as it comes.
        """
        reports = Reports(len(self.processes))
        heard = dict.fromkeys(range(len(self.processes)), time.monotonic())
        settle_until = None
        with selectors.DefaultSelector() as selector:
            for rank, fd in self.status.items():
                selector.register(fd, selectors.EVENT_READ, rank)
            while not reports.all_answered():
                now = time.monotonic()
                if reports.failed() and settle_until is None:
                    # Peers fail a moment after the failing rank: hear them out briefly.
                    settle_until = now + min(2.0, timeout)
                if settle_until is not None and (now >= settle_until or reports.all_reported()):
                    raise reports.root_cause(timeout)
                if deadline is not None and now > deadline:
                    late = reports.silent()
                    raise DistributedFitError(
                        late[0] if late else 0,
                        f"did not start within timeout + {STARTUP_SECONDS:.0f} s = "
                        f"{timeout + STARTUP_SECONDS:.0f} s." + reports.states(),
                    )
                if deadline is None:
                    _raise_if_silent(reports, heard, now, timeout)
                limits = [1.0] + [t - now for t in (settle_until, deadline) if t is not None]
                for key, _ in selector.select(max(0.0, min(limits))):
                    heard[key.data] = time.monotonic()
                    self._read(key.data, answer, reports, selector)

    def _tail(self, rank: int) -> str:
        """The end of a worker's stderr, for the error that reports its exit."""
        try:
            return stderr_path(self.pool_dir, rank).read_text(errors="replace")[-4000:]
        except OSError as error:  # the directory was removed under the pool
            return f"(its stderr could not be read: {error})"

    def _read(self, rank: int, answer: str, reports: Reports, selector) -> None:
        chunk = os.read(self.status[rank], 1 << 16)
        if not chunk:  # the worker exited
            selector.unregister(self.status[rank])
            try:
                code = self.processes[rank].wait(timeout=_EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                code = None
            reports.exits[rank] = (code, self._tail(rank))
            return
        *lines, self._pending[rank] = (self._pending[rank] + chunk).split(b"\n")
        for line in lines:
            kind, payload = json.loads(line)
            if kind == "beat":
                continue
            if kind == "out":
                sys.stdout.write(payload)
                sys.stdout.flush()
            elif kind == "error":
                reports.errors[rank] = payload
            elif kind == answer:
                reports.answered.add(rank)

    def run(self, spec: WorkerSpec, timeout: float) -> BlockResult:
        """One fit on these workers; they write their slices of the weights into one output."""
        for rank in range(len(self.processes)):  # an error shows this fit's stderr only
            os.truncate(stderr_path(self.pool_dir, rank), 0)
        self.send(spec.run_dir)
        self.collect("done", timeout)
        first = read_private(result_path(spec.run_dir, 0))
        return replace(first, coef=np.array(map_output(spec)))

    def stop(self, kill: bool = False) -> None:
        """End the workers (an empty line on stdin; killed if they linger), remove the directory.

        A forked copy of the owner never touches the owner's workers.
        """
        if os.getpid() != self.owner:
            return
        for process in self.processes:
            try:
                # The empty line closes an idle worker even when a forked child
                # holds a copy of the pipe (its end of file would never come).
                process.stdin.write(b"\n")
                process.stdin.close()
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (0.0 if kill else _EXIT_SECONDS)
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for fd in self.status.values():
            os.close(fd)
        self.processes, self.status = [], {}
        rundir.remove_held(self.pool_dir)


def _raise_if_silent(reports: Reports, heard: dict[int, float], now: float, timeout: float) -> None:
    """Raise when running ranks sent nothing, not even a beat, for ``timeout + SILENCE_MARGIN``."""
    limit = timeout + SILENCE_MARGIN
    silent = [rank for rank in reports.silent() if now - heard[rank] > limit]
    if silent:
        names = ", ".join(str(rank) for rank in silent)
        raise DistributedFitError(
            silent[0],
            f"rank(s) {names} sent nothing for {limit:.0f} s (the fit's timeout {timeout:g} s "
            f"+ {SILENCE_MARGIN:g} s), not even the heartbeat a worker sends every "
            f"{BEAT_SECONDS:g} s while it fits: stopped (SIGSTOP), frozen or starved of "
            "CPU. The pool's workers were killed." + reports.states(),
        )


# -- the pool --------------------------------------------------------------------------


def _stop_workers(slot: list[_Workers | None], kill: bool = False) -> None:
    workers, slot[0] = slot[0], None
    if workers is not None:
        workers.stop(kill=kill)


class WorkerPool:
    """Worker processes that stay alive across distributed fits (``n_devices=k``).

    Every fit with ``n_devices=k > 1`` runs on k worker processes. Starting
    them (an interpreter and ``import torch`` each, then a process group)
    takes seconds; a pool starts them on its first fit and keeps them, and
    their group, for the fits after it, which pay only for writing their
    column blocks to shared memory. Inside ``with WorkerPool(k):`` the fits
    of this thread with ``n_devices=k`` run on the pool, and leaving the
    block closes it. Fits outside any such block use a default pool of the
    process, closed at exit or by :func:`close_worker_pools`.

    A fit that fails in any way (a rank raises, exits or stops answering,
    or the fit is interrupted) stops the pool's workers; the next fit starts
    new ones. The workers end when the pool is closed or garbage collected,
    and when the process that owns the pool ends, however it ends.

    Parameters
    ----------
    n_workers : int
        Number of worker processes, one per rank; at least 2 (``n_devices=1``
        fits in the calling process).

    Attributes
    ----------
    n_workers : int
        Number of worker processes.
    n_starts : int
        How many times the workers were started (once, unless a fit failed
        or the device type changed).

    Examples
    --------
    >>> from sklearn.model_selection import GridSearchCV
    >>> from sklearn_casgd import CASGDLogisticRegression, WorkerPool
    >>> from sklearn_casgd.datasets import make_glm_data
    >>> X, y, _ = make_glm_data("logistic", 200, 6, random_state=0)
    >>> estimator = CASGDLogisticRegression(n_devices=2, device="cpu", max_iter=3, tol=None)
    >>> with WorkerPool(2) as pool:
    ...     search = GridSearchCV(estimator, {"alpha": [1e-4, 1e-2]}, cv=3).fit(X, y)
    ...     print(pool.n_starts, len(pool.pids))
    1 2
    >>> pool.pids  # closed with the block
    []
    """

    def __init__(self, n_workers: int) -> None:
        if isinstance(n_workers, bool) or not isinstance(n_workers, (int, np.integer)):
            raise TypeError(f"n_workers must be an int, got {type(n_workers).__name__}.")
        if n_workers < 2:
            raise ValueError(
                f"n_workers must be at least 2, got {n_workers} (n_devices=1 fits in the "
                "calling process)."
            )
        self.n_workers = int(n_workers)
        self.n_starts = 0
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._slot: list[_Workers | None] = [None]
        self._tokens: list[Token] = []
        # Stops the workers when the pool is garbage collected, and at exit.
        self._finalizer = weakref.finalize(self, _stop_workers, self._slot)

    def __repr__(self) -> str:
        state = "running" if self._slot[0] is not None else "idle"
        return f"WorkerPool(n_workers={self.n_workers}) [{state}]"

    def __reduce__(self):
        raise TypeError("A WorkerPool holds processes and cannot be pickled or copied.")

    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers (empty before the first fit and after close)."""
        workers = self._slot[0]
        return [] if workers is None else workers.pids()

    def _run_fit(
        self,
        plan: FitPlan,
        X: np.ndarray,
        target: np.ndarray,
        sample_weight: np.ndarray,
        timeout: float,
    ) -> BlockResult:
        """Fit ``plan`` on the pool's workers, starting them if needed."""
        if os.getpid() != self._owner:
            raise RuntimeError(
                f"This WorkerPool belongs to process {self._owner}; a forked process cannot "
                "use it. Create a pool in this process."
            )
        device = torch.device(plan.device)
        if device.type == "cuda":  # every rank's device visible, before any worker starts
            rank_device(plan.device, 0, self.n_workers, torch.cuda.device_count())
        threads = threads_per_worker(self.n_workers)
        blocks = column_blocks(X.shape[1], self.n_workers)
        with self._lock:
            workers = self._slot[0]
            if workers is None or not workers.serves(str(device), timeout):
                _stop_workers(self._slot, kill=True)
                self._slot[0] = _Workers(self.n_workers, str(device), timeout, threads)
                self.n_starts += 1
            rundir.remove_dead_runs()
            # Without room for the inputs the workers never hear of the fit and stay.
            spec = rundir.write_fit_inputs(
                plan, X, target, sample_weight, blocks, timeout, threads, _FAULT
            )
            try:
                return self._slot[0].run(spec, timeout)
            except BaseException:
                _stop_workers(self._slot, kill=True)  # a group that failed is not reused
                raise
            finally:
                rundir.remove_held(spec.run_dir)

    def close(self) -> None:
        """Stop the workers; a later fit on this pool starts new ones."""
        with self._lock:
            _stop_workers(self._slot)

    def __enter__(self) -> WorkerPool:
        self._tokens.append(_ACTIVE_POOL.set(self))
        return self

    def __exit__(self, *exc_info: object) -> None:
        _ACTIVE_POOL.reset(self._tokens.pop())
        self.close()


_ACTIVE_POOL: ContextVar[WorkerPool | None] = ContextVar("sklearn_casgd_pool", default=None)
# One default pool per size asked for: threads fitting with different n_devices
# would otherwise restart a shared one on every fit.
_DEFAULT_POOLS: dict[int, WorkerPool] = {}
_DEFAULT_LOCK = threading.Lock()


def pool_for(n_devices: int) -> WorkerPool:
    """The pool a fit with ``n_devices`` workers runs on: the active one, or the default."""
    active = _ACTIVE_POOL.get()
    if active is not None:
        if active.n_workers != n_devices:
            raise ValueError(
                f"n_devices={n_devices}, but the active WorkerPool has {active.n_workers} "
                f"workers: set n_devices={active.n_workers} or fit outside the pool's "
                "'with' block."
            )
        return active
    with _DEFAULT_LOCK:
        if n_devices not in _DEFAULT_POOLS:
            _DEFAULT_POOLS[n_devices] = WorkerPool(n_devices)
        return _DEFAULT_POOLS[n_devices]


def close_worker_pools() -> None:
    """Stop the worker processes of the default pools, which fits start and keep.

    Fits with ``n_devices=k > 1`` outside a ``with WorkerPool(k):`` block keep
    their workers alive for the next fit with the same ``k`` (one default
    pool per ``k``); this ends them all (so does the end of the process). A
    later such fit starts new workers.
    """
    with _DEFAULT_LOCK:
        pools = list(_DEFAULT_POOLS.values())
        _DEFAULT_POOLS.clear()
    for pool in pools:
        pool.close()


def _forget_inherited_pools() -> None:
    """In a forked child: the parent's pools are the parent's; start afresh."""
    global _DEFAULT_LOCK
    _DEFAULT_LOCK = threading.Lock()
    _DEFAULT_POOLS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_pools)
