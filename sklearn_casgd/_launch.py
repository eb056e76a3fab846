"""Where the ranks of a fit live.

* :func:`fit_spawned` (``n_devices=k``): ``fit`` starts k fresh worker
  interpreters (``python -m sklearn_casgd._worker``, the spawn start method
  without re-importing ``__main__``, so it works from unguarded scripts,
  ``python -c``, notebooks and joblib/loky workers). The parent holds a
  ``TCPStore`` bound to port 0 on 127.0.0.1 and hands its port to the
  workers; each worker maps its own contiguous column block from a
  RAM-backed file (one copy of X in total, none pickled), writes its slice
  of the weights into a shared output file, and reports through the store.
  Any worker that raises, exits or stops answering ends the fit with a
  :class:`DistributedFitError` within ``timeout`` seconds; no worker is
  left behind.
* :func:`fit_world` (``n_devices="world"``): every rank of an existing job
  (torchrun, SLURM, user code) calls ``fit`` on the same X; the fit runs on
  a group of its own made from the default one, which it initializes from
  the environment when there is none.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ._comm import TorchCommunicator
from ._engine import BlockResult, FitPlan, column_blocks, fit_block
from ._estimators._validation import as_tensor, shared_tensor

# Rows converted to the storage dtype at a time when writing the blocks.
_CHUNK_ROWS = 1 << 14
_POLL_SECONDS = 0.1
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
    """What a spawned worker reads from the store: the plan and where its data lies."""

    plan: FitPlan
    run_dir: str
    n_samples: int
    n_features: int
    n_outputs: int
    blocks: list[tuple[int, int]]
    timeout: float
    threads_per_worker: int


# -- file layout shared by the parent and the workers ----------------------------------


def block_path(run_dir: str, rank: int) -> Path:
    return Path(run_dir) / f"X_block_{rank}.bin"


def output_path(run_dir: str) -> Path:
    return Path(run_dir) / "coef.bin"


def save_rows(run_dir: str, target: np.ndarray, sample_weight: np.ndarray) -> None:
    """Targets and weights, which every rank needs whole."""
    np.save(Path(run_dir) / "target.npy", target)
    np.save(Path(run_dir) / "sample_weight.npy", sample_weight)


def load_rows(run_dir: str) -> tuple[np.ndarray, np.ndarray]:
    return np.load(Path(run_dir) / "target.npy"), np.load(Path(run_dir) / "sample_weight.npy")


def map_block(spec: WorkerSpec, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A worker's column block as a tensor over the shared file (no copy)."""
    start, stop = spec.blocks[rank]
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


def _write_block(path: Path, X: np.ndarray, start: int, stop: int, dtype: torch.dtype) -> None:
    out = np.memmap(path, dtype=_FILE_DTYPES[dtype], mode="w+", shape=(X.shape[0], stop - start))
    for row in range(0, X.shape[0], _CHUNK_ROWS):
        chunk = torch.from_numpy(np.ascontiguousarray(X[row : row + _CHUNK_ROWS, start:stop]))
        out[row : row + _CHUNK_ROWS] = (
            chunk.to(dtype).view(torch.int16 if dtype == torch.bfloat16 else dtype).numpy()
        )
    out.flush()
    del out


def _shared_dir() -> str | None:
    """RAM-backed /dev/shm where it exists, so the blocks never touch a disk."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


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
    blocks = column_blocks(n_features, world_size)
    if any(stop == start for start, stop in blocks):
        raise ValueError(
            f"n_devices={world_size} is more than the number of features ({n_features}): "
            "every rank needs at least one column."
        )
    run_dir = tempfile.mkdtemp(prefix="sklearn_casgd_", dir=_shared_dir())
    processes: list[subprocess.Popen] = []
    store = None
    try:
        dtype = plan.policy.x_storage
        for rank, (start, stop) in enumerate(blocks):
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
        )
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
        )
        store.set("spec", pickle.dumps(spec))
        # The workers import this very copy of the package, installed or not.
        package_root = str(Path(__file__).resolve().parent.parent)
        python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        env = {
            **os.environ,
            "PYTHONPATH": python_path,
            "GLOO_SOCKET_IFNAME": _loopback_interface(),
            "OMP_NUM_THREADS": str(spec.threads_per_worker),
        }
        for rank in range(world_size):
            command = [sys.executable, "-m", "sklearn_casgd._worker"]
            command += [str(store.port), str(rank), str(world_size)]
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


def _wait_for_workers(
    store: dist.TCPStore, processes: list[subprocess.Popen], run_dir: str, timeout: float
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
                raise DistributedFitError(
                    rank, f"worker exited with code {code}.\n{tail}" + _states(store, processes)
                )
        if all(store.check([f"result/{rank}"]) for rank in range(world_size)):
            return [pickle.loads(store.get(f"result/{rank}")) for rank in range(world_size)]
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
    store: dist.TCPStore, processes: list[subprocess.Popen], timeout: float
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


def _silent_ranks(store: dist.TCPStore, processes: list[subprocess.Popen]) -> list[int]:
    """Ranks still running that reported neither an error nor a result."""
    return [
        rank
        for rank, process in enumerate(processes)
        if process.poll() is None
        and not store.check([f"error/{rank}"])
        and not store.check([f"result/{rank}"])
    ]


def _states(store: dist.TCPStore, processes: list[subprocess.Popen]) -> str:
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
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        device = torch.device("cuda", local_rank)
    # A group of the fit's own: the user's default group is never used or destroyed.
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout))
    try:
        comm = TorchCommunicator(group, device)
        blocks = column_blocks(X.shape[1], comm.world_size)
        start, stop = blocks[comm.rank]
        if stop == start:
            raise ValueError(
                f"The job has {comm.world_size} ranks but X has only {X.shape[1]} features: "
                "every rank needs at least one column."
            )
        X_block = as_tensor(np.ascontiguousarray(X[:, start:stop]), device, plan.policy.x_storage)
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
