"""Entry point of a worker started by ``fit`` (``python -m sklearn_casgd._worker``).

Arguments: the parent's store port, this worker's rank and the world size.
The worker reads its spec from the store, maps its column block, joins the
fit's process group through the same store, runs its block, writes its
weight slice into the shared output and reports ``result/<rank>`` or
``error/<rank>`` (a traceback) to the store.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ._comm import TorchCommunicator
from ._engine import fit_block
from ._launch import STARTUP_SECONDS, WorkerSpec, load_rows, map_block, map_output

# Testing hook: "<rank>:<raise|exit|hang>" makes that rank fail once it has
# joined the group, so the fault tests exercise the real failure paths.
FAULT_ENV = "SKLEARN_CASGD_INJECT_FAULT"


def _inject_fault(rank: int) -> None:
    fault = os.environ.get(FAULT_ENV, "")
    if not fault or int(fault.split(":")[0]) != rank:
        return
    kind = fault.split(":")[1]
    if kind == "raise":
        raise RuntimeError(f"fault injected on rank {rank}")
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        time.sleep(3600)


def run(port: int, rank: int, world_size: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    try:
        spec: WorkerSpec = pickle.loads(store.get("spec"))
        # The rendezvous waits for the slowest rank to start; collectives then
        # time out after spec.timeout (the process group's own timeout).
        store.set_timeout(timedelta(seconds=spec.timeout + STARTUP_SECONDS))
        torch.set_num_threads(spec.threads_per_worker)
        plan = spec.plan
        device = torch.device(plan.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        X_block = map_block(spec, rank, plan.policy.x_storage).to(device)
        target, sample_weight = load_rows(spec.run_dir)
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
        _inject_fault(rank)
        comm = TorchCommunicator(None, device)
        start, stop = spec.blocks[rank]
        result = fit_block(plan, X_block, target, sample_weight, (start, stop), comm)
        output = map_output(spec)
        output[start:stop] = result.coef
        output.flush()
        store.set(f"result/{rank}", pickle.dumps(result))
    except BaseException:
        store.set(f"error/{rank}", traceback.format_exc().encode())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    port, rank, world_size = (int(arg) for arg in sys.argv[1:4])
    try:
        run(port, rank, world_size)
    except BaseException:
        sys.exit(1)
