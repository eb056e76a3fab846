"""Where the ranks of a fit live.

* :func:`fit_spawned` (``n_devices=k``): ``fit`` starts k fresh worker
  interpreters (``python -c`` with the package's own root first on
  ``sys.path``, so neither the current directory nor ``__main__`` is
  imported: it works from unguarded scripts, ``python -c``, notebooks and
  joblib/loky workers). Everything a fit shares lives in a private run
  directory (``mkdtemp``, mode 0700) on RAM-backed ``/dev/shm`` when it has
  room, else on the temporary directory: each worker's column block (one
  copy of X in total, none pickled), the targets, the plan, the shared
  output of the weights, the results, and a ``FileStore`` through which the
  ranks meet and report. Nothing listens on a network socket but gloo's own
  connections between the workers, on the loopback interface. Workers die
  with the parent (``PR_SET_PDEATHSIG`` and a watch on the parent), unlink
  their block as soon as they have mapped it, and a fit removes the run
  directories of dead parents. Any worker that raises, exits or stops
  answering ends the fit with a :class:`DistributedFitError` within
  ``timeout`` seconds; no worker is left behind.
* :func:`fit_world` (``n_devices="world"``): every rank of an existing job
  (torchrun, SLURM, user code) calls ``fit`` on the same X; the fit checks
  that the ranks hold the same data, then runs on a group of its own made
  from the default one, which it initializes from the environment when there
  is none.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

from ._comm import TorchCommunicator
from ._data import CSRMatrix
from ._engine import BlockResult, FitPlan, column_blocks, fit_block
from ._estimators._validation import as_storage, shared_tensor

# Rows converted to the storage dtype at a time when writing the blocks.
_CHUNK_ROWS = 1 << 14
_POLL_SECONDS = 0.1
# RAM-backed directory for the run directories, where it exists.
SHARED_MEMORY_DIR = "/dev/shm"
_RUN_PREFIX = "sklearn_casgd_"
# Testing hook, set by the tests only (never from the environment):
# "<rank>:<raise|exit|hang>" makes that rank fail once it has joined the group.
_FAULT: str | None = None
# Start-up (interpreter, import torch, rendezvous) gets this on top of
# `timeout`, which bounds the wait inside collectives: on a loaded 2-core
# machine two workers took over 5 s to start.
STARTUP_SECONDS = 60.0
# How the storage dtypes are laid out in the shared files (bf16 as its bits).
_FILE_DTYPES = {
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: np.int16,
}


class DistributedFitError(RuntimeError):
    """A rank of a distributed fit failed, stopped answering or did not start.

    Parameters
    ----------
    rank : int
        The rank that failed (the silent one when a peer timed out waiting).
    details : str
        Its traceback or exit status, followed by the state of every rank.
    """

    def __init__(self, rank: int, details: str) -> None:
        super().__init__(f"rank {rank} of the distributed fit failed:\n{details}")
        self.rank = rank
        self.details = details


@dataclass(frozen=True)
class WorkerSpec:
    """What a spawned worker reads from the run directory: the plan and where its data lies."""

    plan: FitPlan
    run_dir: str
    n_samples: int
    n_features: int
    n_outputs: int
    blocks: list[tuple[int, int]]
    timeout: float
    threads_per_worker: int
    fault: str | None = None
    sparse: bool = False  # the blocks are CSR arrays (see sparse_block_paths)


# -- file layout shared by the parent and the workers ----------------------------------


def block_path(run_dir: str, rank: int) -> Path:
    return Path(run_dir) / f"X_block_{rank}.bin"


def sparse_block_paths(run_dir: str, rank: int) -> list[Path]:
    """A sparse column block's CSR arrays: row pointers, column indices, values (.npy)."""
    return [Path(run_dir) / f"X_block_{rank}.{part}.npy" for part in ("indptr", "indices", "data")]


def output_path(run_dir: str) -> Path:
    return Path(run_dir) / "coef.bin"


def spec_path(run_dir: str) -> Path:
    return Path(run_dir) / "spec.pkl"


def store_path(run_dir: str) -> Path:
    return Path(run_dir) / "store"


def result_path(run_dir: str, rank: int) -> Path:
    return Path(run_dir) / f"result_{rank}.pkl"


def rows_paths(run_dir: str) -> tuple[Path, Path]:
    return Path(run_dir) / "target.npy", Path(run_dir) / "sample_weight.npy"


def write_private(path: Path, payload: object) -> None:
    """Pickle ``payload`` into the run directory, atomically (a reader never sees half)."""
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as handle:
        pickle.dump(payload, handle)
    os.replace(partial, path)


def read_private(path: Path) -> object:
    """Unpickle a file of the run directory: mode 0700, written by this user's fit only."""
    with open(path, "rb") as handle:
        return pickle.load(handle)


def save_rows(run_dir: str, target: np.ndarray, sample_weight: np.ndarray) -> None:
    """Targets and weights, which every rank needs whole."""
    target_path, weight_path = rows_paths(run_dir)
    np.save(target_path, target)
    np.save(weight_path, sample_weight)


def load_rows(run_dir: str) -> tuple[np.ndarray, np.ndarray]:
    target_path, weight_path = rows_paths(run_dir)
    return np.load(target_path), np.load(weight_path)


def map_block(spec: WorkerSpec, rank: int, dtype: torch.dtype) -> torch.Tensor | CSRMatrix:
    """A worker's column block as a tensor over the shared file (no copy).

    A sparse block is read into CSR tensors (its indices widened to int64);
    ``np.load`` never unpickles (``allow_pickle=False``).
    """
    start, stop = spec.blocks[rank]
    if spec.sparse:
        indptr, indices, data = (
            np.load(path, allow_pickle=False) for path in sparse_block_paths(spec.run_dir, rank)
        )
        block = sp.csr_matrix((data, indices, indptr), shape=(spec.n_samples, stop - start))
        return CSRMatrix.from_scipy(block, torch.device("cpu"), dtype)
    if stop == start:  # an empty block has no file (an empty file cannot be mapped)
        return torch.empty((spec.n_samples, 0), dtype=dtype)
    array = np.memmap(
        block_path(spec.run_dir, rank),
        dtype=_FILE_DTYPES[dtype],
        mode="r",
        shape=(spec.n_samples, stop - start),
    )
    return shared_tensor(array).view(dtype)


def map_output(spec: WorkerSpec) -> np.ndarray:
    return np.memmap(
        output_path(spec.run_dir),
        dtype=np.float64,
        mode="r+",
        shape=(spec.n_features, spec.n_outputs),
    )


def _write_sparse_block(run_dir: str, rank: int, X: sp.csr_matrix, start: int, stop: int) -> None:
    """Columns ``[start, stop)`` of a sparse X as three .npy files (values in X's dtype)."""
    block = X[:, start:stop].tocsr()
    block.sum_duplicates()
    for path, array in zip(
        sparse_block_paths(run_dir, rank), (block.indptr, block.indices, block.data), strict=True
    ):
        np.save(path, array, allow_pickle=False)


def _sparse_bytes(X: sp.csr_matrix, world_size: int) -> int:
    """What the sparse column blocks of X take in the run directory, all ranks together.

    Every block has all the rows (its own row pointers); the values and
    column indices are split.
    """
    return X.data.nbytes + X.indices.nbytes + world_size * X.indptr.nbytes


def _write_block(path: Path, X: np.ndarray, start: int, stop: int, dtype: torch.dtype) -> None:
    if stop == start:
        return
    file_dtype = np.dtype(_FILE_DTYPES[dtype])
    _reserve(path, X.shape[0] * (stop - start) * file_dtype.itemsize)
    out = np.memmap(path, dtype=file_dtype, mode="r+", shape=(X.shape[0], stop - start))
    for row in range(0, X.shape[0], _CHUNK_ROWS):
        chunk = torch.from_numpy(np.ascontiguousarray(X[row : row + _CHUNK_ROWS, start:stop]))
        out[row : row + _CHUNK_ROWS] = (
            chunk.to(dtype).view(torch.int16 if dtype == torch.bfloat16 else dtype).numpy()
        )
    out.flush()
    del out


def _reserve(path: Path, size: int) -> None:
    """Create ``path`` with ``size`` bytes allocated, or raise a clear ``OSError``.

    Writing through a memory map into a full tmpfs kills the process with
    SIGBUS; allocating first turns a lack of space into ENOSPC here.
    """
    with open(path, "wb") as handle:
        if size == 0:
            return
        try:
            os.posix_fallocate(handle.fileno(), 0, size)
        except OSError as error:
            raise OSError(
                error.errno,
                f"No room for the distributed fit's column blocks in {path.parent.parent} "
                f"({size / 2**20:.1f} MiB needed for {path.name}): {error.strerror}. Free "
                "space there, set TMPDIR to a larger directory, or use n_devices=1.",
            ) from None


def _free_bytes(directory: str) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _make_run_dir(needed: int) -> str:
    """A private (0700) run directory on RAM-backed shared memory, or on disk when that is small.

    The name carries this process's pid, so that a later fit can remove the
    directory if this process dies without cleaning up.
    """
    shared = SHARED_MEMORY_DIR
    prefix = f"{_RUN_PREFIX}{os.getpid()}_"
    if os.path.isdir(shared) and os.access(shared, os.W_OK):
        free = _free_bytes(shared)
        if free >= needed + (8 << 20):  # and room to spare for the small files
            return tempfile.mkdtemp(prefix=prefix, dir=shared)
        warnings.warn(
            f"{shared} has {free / 2**20:.0f} MiB free but the distributed fit needs "
            f"{needed / 2**20:.0f} MiB for its column blocks: writing them to "
            f"{tempfile.gettempdir()} (on disk) instead.",
            UserWarning,
            stacklevel=4,
        )
    return tempfile.mkdtemp(prefix=prefix)


def remove_dead_runs() -> None:
    """Remove run directories of this user's fits whose parent process is gone."""
    for parent in {SHARED_MEMORY_DIR, tempfile.gettempdir()}:
        for path in Path(parent).glob(f"{_RUN_PREFIX}*_*"):
            try:
                pid = int(path.name[len(_RUN_PREFIX) :].split("_", 1)[0])
                if path.stat().st_uid != os.getuid() or not path.is_dir():
                    continue
            except (ValueError, OSError):
                continue
            if not _process_alive(pid):
                shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _loopback_interface() -> str:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


def _threads_per_worker(world_size: int) -> int:
    """Ranks x threads <= cores: more threads than cores slowed ranks 4-17x."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


# -- n_devices = k: workers started by fit -------------------------------------------


def fit_spawned(
    plan: FitPlan,
    X: np.ndarray,
    target: np.ndarray,
    sample_weight: np.ndarray,
    world_size: int,
    timeout: float,
) -> BlockResult:
    """Fit on ``world_size`` worker processes started (and always stopped) here."""
    device = torch.device(plan.device)
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(
            f"n_devices={world_size} but only {torch.cuda.device_count()} CUDA device(s) "
            "are visible."
        )
    n_samples, n_features = X.shape
    n_outputs = target.shape[1]
    # With fewer features than ranks some blocks are empty: those ranks still
    # take part (the rows are all-gathered, see _kernel.RowExchange).
    blocks = column_blocks(n_features, world_size)
    dtype = plan.policy.x_storage
    element = np.dtype(_FILE_DTYPES[dtype]).itemsize
    sparse = sp.issparse(X)
    remove_dead_runs()
    needed = _sparse_bytes(X, world_size) if sparse else n_samples * n_features * element
    run_dir = _make_run_dir(needed)
    processes: list[subprocess.Popen] = []
    store = None
    try:
        for rank, (start, stop) in enumerate(blocks):
            if sparse:
                _write_sparse_block(run_dir, rank, X, start, stop)
            else:
                _write_block(block_path(run_dir, rank), X, start, stop, dtype)
        save_rows(run_dir, target, sample_weight)
        np.memmap(output_path(run_dir), np.float64, "w+", shape=(n_features, n_outputs)).flush()
        spec = WorkerSpec(
            plan=plan,
            run_dir=run_dir,
            n_samples=n_samples,
            n_features=n_features,
            n_outputs=n_outputs,
            blocks=blocks,
            timeout=timeout,
            threads_per_worker=_threads_per_worker(world_size),
            fault=_FAULT,
            sparse=sparse,
        )
        write_private(spec_path(run_dir), spec)
        store = dist.FileStore(str(store_path(run_dir)), -1)
        store.set_timeout(timedelta(seconds=timeout))
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": _loopback_interface(),
            # NCCL's bootstrap and socket transport stay on loopback too.
            "NCCL_SOCKET_IFNAME": _loopback_interface(),
            "OMP_NUM_THREADS": str(spec.threads_per_worker),
        }
        for rank in range(world_size):
            command = [sys.executable, "-c", _WORKER_BOOTSTRAP, run_dir, str(rank)]
            command.append(str(os.getpid()))
            with open(Path(run_dir) / f"stderr_{rank}.txt", "w") as stderr:
                processes.append(
                    subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stderr=stderr)
                )
        results = _wait_for_workers(store, processes, run_dir, timeout)
        coef = np.array(map_output(spec))
    finally:
        _stop(processes)
        del store
        shutil.rmtree(run_dir, ignore_errors=True)
    first = results[0]
    return replace(first, coef=coef)


# The workers import this very copy of the package, installed or not, and
# never the current directory: `python -c` puts "" (the cwd) on sys.path,
# and the bootstrap drops it and puts the package's root first.
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
_WORKER_BOOTSTRAP = (
    f"import sys; sys.path[:] = [{_PACKAGE_ROOT!r}, *(p for p in sys.path if p)]; "
    "from sklearn_casgd._worker import main; main(sys.argv[1:])"
)


def _wait_for_workers(
    store: dist.Store, processes: list[subprocess.Popen], run_dir: str, timeout: float
) -> list[BlockResult]:
    """Results of every rank, or a :class:`DistributedFitError` for the first failure."""
    start_deadline = time.monotonic() + timeout + STARTUP_SECONDS
    world_size = len(processes)
    while True:
        if any(store.check([f"error/{rank}"]) for rank in range(world_size)):
            raise _root_cause(store, processes, timeout)
        for rank, process in enumerate(processes):
            code = process.poll()
            if code not in (None, 0) or (code == 0 and not store.check([f"result/{rank}"])):
                tail = (Path(run_dir) / f"stderr_{rank}.txt").read_text()[-4000:]
                culprit, details = exit_error(rank, code, tail, _silent_ranks(store, processes))
                raise DistributedFitError(culprit, details + _states(store, processes))
        if all(store.check([f"result/{rank}"]) for rank in range(world_size)):
            return [read_private(result_path(run_dir, rank)) for rank in range(world_size)]
        ready = all(store.check([f"ready/{rank}"]) for rank in range(world_size))
        if not ready and time.monotonic() > start_deadline:
            late = [r for r in range(world_size) if not store.check([f"ready/{r}"])]
            raise DistributedFitError(
                late[0],
                f"did not start within timeout + {STARTUP_SECONDS:.0f} s = "
                f"{timeout + STARTUP_SECONDS:.0f} s." + _states(store, processes),
            )
        time.sleep(_POLL_SECONDS)


# Errors with these words are a rank's peers noticing a failure, not the failure.
_PEER_ERROR_MARKERS = ("gloo", "Timed out", "Connection closed", "NCCL")


def _root_cause(
    store: dist.Store, processes: list[subprocess.Popen], timeout: float
) -> DistributedFitError:
    """The error that names the failing rank, once one rank has reported an error.

    When one rank fails, its peers fail too, inside a collective, a moment
    later or earlier; wait briefly for every report and prefer a rank whose
    own code raised. A collective timeout with a silent rank names that rank.
    """
    settle = time.monotonic() + min(2.0, timeout)
    while time.monotonic() < settle:
        if all(
            store.check([f"error/{r}"]) or store.check([f"result/{r}"]) or p.poll() is not None
            for r, p in enumerate(processes)
        ):
            break
        time.sleep(_POLL_SECONDS)
    errors = {
        rank: store.get(f"error/{rank}").decode()
        for rank in range(len(processes))
        if store.check([f"error/{rank}"])
    }
    states = _states(store, processes)
    for rank, details in errors.items():
        if not any(marker in details for marker in _PEER_ERROR_MARKERS):
            return DistributedFitError(rank, details + states)
    rank, details = next(iter(errors.items()))
    stuck = _silent_ranks(store, processes)
    if "Timed out" in details and stuck:
        details = (
            f"it stopped answering: rank {rank} timed out after {timeout} s waiting for it "
            f"in a collective.\nRank {rank}'s error:\n{details}"
        )
        rank = stuck[0]
    return DistributedFitError(rank, details + states)


# NCCL's watchdog aborts a rank whose collective timed out (it raises nothing).
_WATCHDOG_MARKERS = ("Watchdog caught collective operation timeout", "Timed out", "timed out")


def exit_error(rank: int, code: int | None, tail: str, silent: list[int]) -> tuple[int, str]:
    """The rank to blame and the message when worker ``rank`` exited without a result.

    An abort by NCCL's watchdog names the peer that never answered (a rank
    still running that reported nothing), like a gloo timeout does.
    """
    details = f"worker exited with code {code}.\n{tail}"
    silent = [r for r in silent if r != rank]
    if code is not None and code < 0 and silent and any(m in tail for m in _WATCHDOG_MARKERS):
        return silent[0], (
            f"it stopped answering: rank {rank} was aborted by the collective watchdog "
            f"after waiting for it.\nRank {rank}'s {details}"
        )
    return rank, details


def _silent_ranks(store: dist.Store, processes: list[subprocess.Popen]) -> list[int]:
    """Ranks still running that reported neither an error nor a result."""
    return [
        rank
        for rank, process in enumerate(processes)
        if process.poll() is None
        and not store.check([f"error/{rank}"])
        and not store.check([f"result/{rank}"])
    ]


def _states(store: dist.Store, processes: list[subprocess.Popen]) -> str:
    lines = []
    for rank, process in enumerate(processes):
        code = process.poll()
        if store.check([f"error/{rank}"]):
            state = "raised"
        elif store.check([f"result/{rank}"]):
            state = "finished"
        elif code is not None:
            state = f"exited with code {code}"
        else:
            state = "still running (no error reported: stuck or waiting for a peer)"
        lines.append(f"  rank {rank}: {state}")
    return "\nState of every rank:\n" + "\n".join(lines)


def _stop(processes: list[subprocess.Popen]) -> None:
    """Kill whatever still runs and reap everything, so nothing outlives the fit."""
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait()


# -- n_devices = "world": the ranks of an existing job -------------------------------


def job_world_size() -> int:
    """Size of the job a ``n_devices="world"`` fit spans."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(_rendezvous_env()["WORLD_SIZE"])


def _rendezvous_env() -> dict[str, str]:
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from torchrun's names or SLURM's."""
    env = dict(os.environ)
    if "RANK" not in env and "SLURM_PROCID" in env:
        env["RANK"] = env["SLURM_PROCID"]
        env.setdefault("WORLD_SIZE", env.get("SLURM_NTASKS", ""))
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ValueError(
            "n_devices='world' needs an initialized default process group, or "
            "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (as torchrun "
            f"sets them; under SLURM set MASTER_ADDR and MASTER_PORT). Missing: {missing}."
        )
    return env


def _ensure_default_group(backend: str, timeout: float) -> None:
    if dist.is_initialized():
        return
    env = _rendezvous_env()
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout),
    )


# Rows per chunk of the fingerprint's pass over X.
_FINGERPRINT_ROWS = 1 << 12
_FINGERPRINT_NAMES = (
    "n_samples",
    "n_features",
    "n_outputs",
    "a projection of X",
    "a projection of y",
    "sum(sample_weight)",
)


def data_fingerprint(X: np.ndarray, target: np.ndarray, sample_weight: np.ndarray) -> np.ndarray:
    """Shape and fixed random projections of X (dense or sparse), y and the weights, in float64.

    Ranks that pass the same data get the same numbers (to rounding); ranks
    that pass different shapes, rows or targets almost surely do not.
    """
    rng = np.random.default_rng(20261203)
    direction = rng.standard_normal(X.shape[1])
    row_mix = rng.standard_normal(X.shape[0])
    x_projection = 0.0
    for lo in range(0, X.shape[0], _FINGERPRINT_ROWS):
        chunk = X[lo : lo + _FINGERPRINT_ROWS]
        x_projection += float(row_mix[lo : lo + _FINGERPRINT_ROWS] @ (chunk @ direction))
    y_projection = float(row_mix @ target.sum(axis=1))
    return np.array(
        [*X.shape, target.shape[1], x_projection, y_projection, float(sample_weight.sum())]
    )


def check_same_data(
    X: np.ndarray,
    target: np.ndarray,
    sample_weight: np.ndarray,
    group: dist.ProcessGroup,
    device: torch.device,
) -> None:
    """Raise ``ValueError`` on every rank unless every rank passed the same data.

    One all-reduce (a maximum of the fingerprint and of its negation) before
    anything else, so that different shapes fail here and not inside gloo,
    and different rows or targets do not mix into one model.
    """
    fingerprint = torch.as_tensor(data_fingerprint(X, target, sample_weight), device=device)
    both = torch.cat([fingerprint, -fingerprint])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    largest, smallest = both[: len(fingerprint)], -both[len(fingerprint) :]
    spread = (largest - smallest).abs()
    differs = spread > 1e-9 * torch.maximum(largest.abs(), smallest.abs()) + 1e-12
    if bool(differs.any()):
        names = [
            name for name, bad in zip(_FINGERPRINT_NAMES, differs.tolist(), strict=True) if bad
        ]
        raise ValueError(
            "n_devices='world' needs every rank to call fit with the same X, y and "
            f"sample_weight, but the ranks differ in: {', '.join(names)} (this rank: "
            f"n_samples={X.shape[0]}, n_features={X.shape[1]})."
        )


def local_cuda_device(env: Mapping[str, str], rank: int, device_count: int) -> torch.device:
    """This rank's GPU in a ``"world"`` fit: its local rank on the node.

    ``LOCAL_RANK`` (torchrun) or ``SLURM_LOCALID``; with one visible device
    (a GPU per task) that device. Without either, the global rank, which is
    right on one node only, so it must name a visible device.
    """
    if device_count == 1:
        return torch.device("cuda", 0)
    local = env.get("LOCAL_RANK", env.get("SLURM_LOCALID"))
    where = "LOCAL_RANK" if "LOCAL_RANK" in env else "SLURM_LOCALID"
    if local is None:
        local, where = str(rank), "the global rank (neither LOCAL_RANK nor SLURM_LOCALID is set)"
    index = int(local)
    if not 0 <= index < device_count:
        raise ValueError(
            f"This rank would use CUDA device {index} ({where}), but {device_count} are "
            "visible: run one rank per GPU and set LOCAL_RANK (torchrun does), or make one "
            "GPU visible per rank (CUDA_VISIBLE_DEVICES)."
        )
    return torch.device("cuda", index)


def device_key(device: torch.device) -> int:
    """A 62-bit key of this host and device: equal keys on two ranks mean one shared device."""
    name = socket.gethostname()
    if device.type == "cuda":
        name += "/" + str(torch.cuda.get_device_properties(device).uuid)
    else:
        return 0  # CPU ranks may share the host's cores
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def check_distinct_devices(group: dist.ProcessGroup, device: torch.device) -> None:
    """Raise ``ValueError`` on every rank when two ranks of a CUDA fit share one GPU.

    Two ranks on one GPU would each assume the whole device (and NCCL
    refuses or hangs); the keys travel as integers, never pickled.
    """
    if device.type != "cuda":
        return
    world_size = dist.get_world_size(group)
    keys = torch.zeros(world_size, dtype=torch.int64, device=device)
    keys[dist.get_rank(group)] = device_key(device)
    dist.all_reduce(keys, group=group)
    shared = duplicate_ranks(keys.tolist())
    if shared:
        raise ValueError(
            f"Ranks {shared} of this job use the same GPU; a 'world' fit needs one GPU per "
            "rank: set LOCAL_RANK per rank (torchrun does) or CUDA_VISIBLE_DEVICES."
        )


def duplicate_ranks(keys: list[int]) -> list[int]:
    """Ranks whose key another rank has too (sorted)."""
    counts = Counter(keys)
    return [rank for rank, key in enumerate(keys) if counts[key] > 1]


def fit_world(
    plan: FitPlan,
    X: np.ndarray,
    target: np.ndarray,
    sample_weight: np.ndarray,
    timeout: float,
) -> tuple[BlockResult, int]:
    """Fit across every rank of the job; each rank ends with the full weights."""
    device = torch.device(plan.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    _ensure_default_group(backend, timeout)
    if device.type == "cuda":
        device = local_cuda_device(os.environ, dist.get_rank(), torch.cuda.device_count())
        torch.cuda.set_device(device)
    # A group of the fit's own: the user's default group is never used or destroyed.
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout))
    try:
        check_distinct_devices(group, device)
        check_same_data(X, target, sample_weight, group, device)
        comm = TorchCommunicator(group, device)
        blocks = column_blocks(X.shape[1], comm.world_size)
        start, stop = blocks[comm.rank]
        columns = X[:, start:stop] if sp.issparse(X) else np.ascontiguousarray(X[:, start:stop])
        X_block = as_storage(columns, device, plan.policy.x_storage)
        result = fit_block(plan, X_block, target, sample_weight, (start, stop), comm)
        full = torch.zeros((X.shape[1], result.coef.shape[1]), dtype=torch.float64, device=device)
        full[start:stop] = torch.from_numpy(result.coef).to(device)
        comm.all_reduce(full)
        result = replace(
            result,
            coef=full.cpu().numpy(),
            n_allreduce=comm.n_allreduce,
            allreduce_bytes=comm.allreduce_bytes,
            allreduce_seconds=comm.allreduce_seconds,
        )
    finally:
        dist.destroy_process_group(group)
    return result, comm.world_size
