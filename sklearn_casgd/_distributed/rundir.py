"""The private run directory of a spawned fit: what the parent and the workers share.

A fit on a :class:`~sklearn_casgd.WorkerPool` writes everything its workers
need into a fresh run directory (``mkdtemp``, mode 0700) on RAM-backed
``/dev/shm`` when it has room, else on the temporary directory: each
worker's column block (one copy of X in total, none pickled), the targets,
the plan, the shared output of the weights and the results. The workers
unlink their block as soon as they have mapped it, the parent removes the
directory when the fit ends, and a fit removes the directories of dead
parents. The process that makes a directory holds an exclusive ``flock``
on it until it removes it: the kernel drops the lock when that process
dies, and no other process, in this PID namespace or another that shares
the directory, can take it while the owner lives (a pid in the name would
look dead from another namespace).
"""

from __future__ import annotations

import errno
import fcntl
import os
import pickle
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from .._data.storage import CSRMatrix, shared_tensor, storage_chunks
from .._engine.fit import FitPlan

# RAM-backed directory for the run directories, where it exists.
SHARED_MEMORY_DIR = "/dev/shm"
_RUN_PREFIX = "sklearn_casgd_"
# An unlocked directory younger than this may be between mkdtemp and its lock.
_UNLOCKED_GRACE_SECONDS = 10.0
# How long a worker retries a dead owner's run directory whose lock is held.
_HELD_RUN_SECONDS = 5.0
# path -> descriptor holding its lock, for the directories this process made.
_HELD: dict[str, int] = {}
# How the storage dtypes are laid out in the shared files (bf16 as its bits).
_FILE_DTYPES = {
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: np.int16,
}


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker reads from the run directory: the plan and where its data lies."""

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


def _write_block(
    path: Path,
    X: np.ndarray,
    start: int,
    stop: int,
    dtype: torch.dtype,
    center: np.ndarray | None = None,
    scale: np.ndarray | None = None,
) -> None:
    """Columns ``[start, stop)`` of a dense X as stored (preconditioned: ``center``, ``scale``)."""
    if stop == start:
        return
    file_dtype = np.dtype(_FILE_DTYPES[dtype])
    _reserve(path, X.shape[0] * (stop - start) * file_dtype.itemsize)
    out = np.memmap(path, dtype=file_dtype, mode="r+", shape=(X.shape[0], stop - start))
    bits = torch.int16 if dtype == torch.bfloat16 else dtype
    for lo, hi, rows in storage_chunks(X[:, start:stop], dtype, center, scale):
        out[lo:hi] = rows.view(bits).numpy()
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
                f"No room for the distributed fit's files in {path.parent.parent} "
                f"({size / 2**20:.1f} MiB needed for {path.name}): {error.strerror}. Free "
                "space there, set TMPDIR to a larger directory, or use n_devices=1.",
            ) from None


def _free_bytes(directory: str) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _made_and_held(path: str) -> str:
    """Lock the new directory ``path`` for this process (see the module's docstring)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    _HELD[path] = fd
    return path


def remove_held(path: str) -> None:
    """Remove a directory this process made, then release its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _HELD.pop(path, None)
    if fd is not None:
        os.close(fd)


def make_run_dir(needed: int) -> str:
    """A private (0700) run directory on RAM-backed shared memory, or on disk when that is small.

    The name carries this process's pid, so that a later fit can remove the
    directory if this process dies without cleaning up.
    """
    shared = SHARED_MEMORY_DIR
    prefix = f"{_RUN_PREFIX}{os.getpid()}_"
    if os.path.isdir(shared) and os.access(shared, os.W_OK):
        free = _free_bytes(shared)
        if free >= needed + (8 << 20):  # and room to spare for the small files
            return _made_and_held(tempfile.mkdtemp(prefix=prefix, dir=shared))
        warnings.warn(
            f"{shared} has {free / 2**20:.0f} MiB free but the distributed fit needs "
            f"{needed / 2**20:.0f} MiB for its column blocks: writing them to "
            f"{tempfile.gettempdir()} (on disk) instead.",
            UserWarning,
            stacklevel=8,  # the estimator's fit
        )
    return _made_and_held(tempfile.mkdtemp(prefix=prefix))


def make_pool_dir() -> str:
    """A private (0700) directory for a worker pool's rendezvous file and logs, on disk.

    It holds no data (the run directories do), so it stays off ``/dev/shm``.
    """
    return _made_and_held(tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}_pool_"))


def stderr_path(pool_dir: str, rank: int) -> Path:
    return Path(pool_dir) / f"stderr_{rank}.txt"


def write_fit_inputs(
    plan: FitPlan,
    X: np.ndarray | sp.csr_matrix,
    target: np.ndarray,
    sample_weight: np.ndarray,
    blocks: list[tuple[int, int]],
    timeout: float,
    threads_per_worker: int,
    fault: str | None,
) -> WorkerSpec:
    """A new run directory holding everything the workers of one fit read; its spec.

    On any failure (no room, an interrupt) the directory is removed again.
    """
    dtype = plan.policy.x_storage
    sparse = sp.issparse(X)
    n_samples, n_features = X.shape
    if sparse:
        needed = _sparse_bytes(X, len(blocks))
    else:
        needed = n_samples * n_features * np.dtype(_FILE_DTYPES[dtype]).itemsize
    run_dir = make_run_dir(needed)
    try:
        for rank, (start, stop) in enumerate(blocks):
            if sparse:
                _write_sparse_block(run_dir, rank, X, start, stop)
            else:
                preconditioning = plan.stored_preconditioning(start, stop)
                _write_block(block_path(run_dir, rank), X, start, stop, dtype, *preconditioning)
        save_rows(run_dir, target, sample_weight)
        # The coefficients' columns (fit.BlockResult: the average's after the iterate's).
        n_outputs = target.shape[1] * (2 if plan.average else 1)
        # Reserved, so that a full directory fails here and not as a worker's SIGBUS.
        _reserve(output_path(run_dir), n_features * n_outputs * 8)
        spec = WorkerSpec(
            plan=plan,
            run_dir=run_dir,
            n_samples=n_samples,
            n_features=n_features,
            n_outputs=n_outputs,
            blocks=blocks,
            timeout=timeout,
            threads_per_worker=threads_per_worker,
            fault=fault,
            sparse=sparse,
        )
        write_private(spec_path(run_dir), spec)
    except BaseException:
        remove_held(run_dir)
        raise
    return spec


def remove_dead_runs() -> None:
    """Remove run and pool directories of this user's fits whose owner is gone.

    A directory is dead when nobody holds its lock and, for one made before
    locks or in the moment between ``mkdtemp`` and the lock, the pid in its
    name is not alive here and it is older than a few seconds. Only real
    directories count: ``/dev/shm`` and the temporary directory are writable
    by every user, and a link named like a dead run could point at any
    directory of this user's, so nothing here follows a link.
    """
    for path in _named_runs("*"):
        if str(path) not in _HELD:
            _remove_if_unlocked(path, check_pid=True)


def remove_runs_of(owner: int, seconds: float = _HELD_RUN_SECONDS) -> None:
    """Remove the directories of ``owner``, a process known to be dead, once nobody holds them.

    Its workers call this when it dies: a run directory it was still
    writing had not yet been sent to them. A lock still held is the dead
    owner's last thread closing its files, or another worker removing the
    directory: retried for up to ``seconds``.
    """
    deadline = time.monotonic() + seconds
    while True:
        held = [
            path for path in _named_runs(f"{owner}_*") if _remove_if_unlocked(path, False) is None
        ]
        if not held or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _named_runs(pattern: str) -> list[Path]:
    return [
        path
        for parent in {SHARED_MEMORY_DIR, tempfile.gettempdir()}
        for path in Path(parent).glob(f"{_RUN_PREFIX}{pattern}")
    ]


def _remove_if_unlocked(path: Path, check_pid: bool) -> bool | None:
    """Remove ``path``, a real directory of this user's, if no process holds its lock.

    ``check_pid``: and only if the pid in its name is not alive here and it
    is not a few seconds old (a directory made before locks, or being made).
    Returns None where its lock is held, else whether it was removed.
    """
    try:
        pid = int(path.name[len(_RUN_PREFIX) :].split("_", 1)[0])
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except (ValueError, OSError):
        return False
    try:
        status = os.fstat(fd)
        if status.st_uid != os.getuid():
            return False
        if not _lock_is_free(fd):
            return None
        if check_pid:
            young = time.time() - status.st_mtime < _UNLOCKED_GRACE_SECONDS
            if young or _process_alive(pid):
                return False
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def _lock_is_free(fd: int) -> bool:
    """Take the directory's lock if nobody holds it (it is released with ``fd``)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _forget_inherited_locks() -> None:
    """In a forked child: the parent's directories stay locked by the parent alone."""
    for fd in _HELD.values():
        os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_locks)
