"""Entry point of a worker started by ``fit`` (see :mod:`._launch`).

Arguments: the fit's private run directory, this worker's rank and the
parent's pid. The
worker makes sure it dies with its parent, reads its spec from the run
directory, maps its column block and unlinks it at once (the mapping keeps
the pages; nothing outlives the processes that use them), joins the fit's
process group through the run directory's ``FileStore``, runs its block,
writes its weight slice into the shared output and its result into the run
directory, and reports ``result/<rank>`` or ``error/<rank>`` (a traceback,
as text) to the store.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ._comm import TorchCommunicator
from ._engine import fit_block
from ._launch import (
    STARTUP_SECONDS,
    WorkerSpec,
    block_path,
    load_rows,
    map_block,
    map_output,
    read_private,
    result_path,
    rows_paths,
    sparse_block_paths,
    spec_path,
    store_path,
    write_private,
)

_PR_SET_PDEATHSIG = 1
_PARENT_POLL_SECONDS = 0.5


def die_with_parent(parent_pid: int, run_dir: str) -> None:
    """End this process, and remove the run directory, when ``parent_pid`` ends.

    A parent killed outright (SIGKILL, a kernel restart) runs no cleanup, so
    its workers do it: Linux's parent-death signal (SIGTERM, handled here)
    acts at once when this thread is in Python, and a watch on the parent
    covers a main thread blocked in a collective and other systems.
    """

    def abandon(*_: object) -> None:
        shutil.rmtree(run_dir, ignore_errors=True)
        os._exit(1)

    signal.signal(signal.SIGTERM, abandon)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent is already gone
        abandon()

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_SECONDS)
        abandon()

    threading.Thread(target=watch, name="sklearn_casgd-parent-watch", daemon=True).start()


def _inject_fault(fault: str | None, rank: int) -> None:
    """The tests' failure hook (``_launch._FAULT``, passed in the spec)."""
    if not fault or int(fault.split(":")[0]) != rank:
        return
    kind = fault.split(":")[1]
    if kind == "raise":
        raise RuntimeError(f"fault injected on rank {rank}")
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        time.sleep(3600)


def run(run_dir: str, rank: int) -> None:
    spec: WorkerSpec = read_private(spec_path(run_dir))
    world_size = len(spec.blocks)
    store = dist.FileStore(str(store_path(run_dir)), -1)
    # The rendezvous waits for the slowest rank to start; collectives then
    # time out after spec.timeout (the process group's own timeout).
    store.set_timeout(timedelta(seconds=spec.timeout + STARTUP_SECONDS))
    try:
        torch.set_num_threads(spec.threads_per_worker)
        plan = spec.plan
        device = torch.device(plan.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        X_block = map_block(spec, rank, plan.policy.x_storage).to(device)
        # The mapping keeps the pages alive (an empty block has no file); a
        # sparse block was read into memory.
        for path in [block_path(run_dir, rank), *sparse_block_paths(run_dir, rank)]:
            path.unlink(missing_ok=True)
        target, sample_weight = load_rows(run_dir)
        if store.add("rows_loaded", 1) == world_size:  # the last to load removes them
            for path in rows_paths(run_dir):
                path.unlink()
        # Meet at a start line first, so the group forms with every rank present
        # and its timeout only ever measures waits inside collectives.
        store.set(f"started/{rank}", b"1")
        store.wait([f"started/{r}" for r in range(world_size)])
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=dist.PrefixStore("pg", store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=spec.timeout),
            device_id=device if device.type == "cuda" else None,
        )
        store.set(f"ready/{rank}", b"1")
        _inject_fault(spec.fault, rank)
        comm = TorchCommunicator(None, device)
        start, stop = spec.blocks[rank]
        result = fit_block(plan, X_block, target, sample_weight, (start, stop), comm)
        output = map_output(spec)
        output[start:stop] = result.coef
        output.flush()
        write_private(result_path(run_dir, rank), result)
        store.set(f"result/{rank}", b"1")
    except BaseException:
        store.set(f"error/{rank}", traceback.format_exc().encode())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str]) -> None:
    run_dir, rank, parent_pid = argv[0], int(argv[1]), int(argv[2])
    die_with_parent(parent_pid, run_dir)
    try:
        run(run_dir, rank)
    except BaseException:
        sys.exit(1)
