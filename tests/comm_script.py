"""Run by tests/test_comm.py on every rank: the communicator's collectives against gloo's.

Usage: ``python comm_script.py OUT_DIR RANK WORLD_SIZE``. The ranks meet
through a FileStore in OUT_DIR; each rank writes what it computed to
``OUT_DIR/rank{RANK}.pt``.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from sklearn_casgd._engine.comm import TorchCommunicator, _all_gather_single

torch.set_num_threads(1)
# Count where the communicator gives its core to gloo's transport thread.
yields = []
_sched_yield = os.sched_yield
os.sched_yield = lambda: (yields.append(1), _sched_yield())[1]
out_dir, rank, world_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = dist.FileStore(f"{out_dir}/store", world_size)
dist.init_process_group(
    "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30)
)
comm = TorchCommunicator(None, torch.device("cpu"), timedelta(seconds=30))
generator = torch.Generator().manual_seed(rank)
results = {"peer": comm.peer}
for dtype in (torch.float64, torch.float32, torch.bfloat16):
    name = str(dtype).removeprefix("torch.")
    # Values of many magnitudes, so that any other order of the additions would show.
    mine = (torch.randn(3001, generator=generator) * 10.0 ** torch.randint(-8, 8, (3001,))).to(
        dtype
    )
    summed = mine.clone()
    pending = comm.start_all_reduce(summed)
    work_in_flight = torch.ones(64, 64) @ torch.ones(64, 64)  # what the engine overlaps
    pending.wait()
    by_gloo = mine.clone()
    dist.all_reduce(by_gloo)
    gathered = torch.full((world_size * mine.numel(),), float("nan"), dtype=dtype)
    sent = mine.clone()
    comm.start_all_gather(gathered, sent).wait()
    gathered_by_gloo = torch.empty_like(gathered)
    _all_gather_single(gathered_by_gloo, mine)
    results[name] = {
        "mine": mine,
        "summed": summed,
        "by_gloo": by_gloo,
        "gathered": gathered,
        "gathered_by_gloo": gathered_by_gloo,
        "sent_unchanged": bool(torch.equal(sent, mine)),
    }
comm.barrier()
results["yields"] = len(yields)
results["n_allreduce"] = comm.n_allreduce
results["allreduce_bytes"] = comm.allreduce_bytes
# Timing the transport, and a rank beside busy processes: no yield.
with comm.keeping_the_core():
    comm.all_reduce(torch.ones(8))
results["yields_keeping_the_core"] = len(yields) - results["yields"]
quiet_rank = TorchCommunicator(None, torch.device("cpu"), timedelta(seconds=30), yields=False)
quiet_rank.all_reduce(torch.ones(8))
results["yields_switched_off"] = len(yields) - results["yields"]
comm.all_reduce(torch.ones(8))
results["yields_after"] = len(yields) - results["yields"]
torch.save(results, f"{out_dir}/rank{rank}.pt")
dist.destroy_process_group()
