"""A straightforward minibatch SGD loop on gloo ranks: the honesty check for s=1.

Each rank holds a column block of X in float32; every step gathers the
batch, forms its partial margins, all-reduces them (one all-reduce per
step, as FP32 SGD must), and updates its weights -- nothing else. The
engine's s=1 path should be no slower than this loop.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sklearn_casgd._engine.fit import column_blocks
from sklearn_casgd.datasets import make_glm_data


def _rank_loop(rank, world_size, port, problem, eta, alpha, batch_size, seed, queue):
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    n_samples, n_features = problem
    X, y, _ = make_glm_data("logistic", n_samples, n_features, dtype="float32", random_state=0)
    first_column, end_column = column_blocks(n_features, world_size)[rank]
    X_block = torch.from_numpy(np.ascontiguousarray(X[:, first_column:end_column]))
    target = torch.from_numpy(y.astype(np.float32))
    coef = torch.zeros(X_block.shape[1])
    intercept = torch.zeros(())
    order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed))
    dist.barrier()
    start = time.perf_counter()
    for lo in range(0, n_samples, batch_size):
        rows = order[lo : lo + batch_size]
        Y = X_block.index_select(0, rows)
        margins = Y @ coef
        dist.all_reduce(margins)
        residual = torch.sigmoid(margins + intercept) - target.index_select(0, rows)
        residual.mul_(eta / rows.shape[0])
        coef.mul_(1.0 - eta * alpha).sub_(Y.T @ residual)
        intercept -= residual.sum()
    dist.barrier()
    seconds = time.perf_counter() - start
    queue.put((rank, seconds, coef.numpy(), float(intercept)))
    dist.destroy_process_group()


def plain_sgd_epoch(n_samples, n_features, *, world_size, eta, alpha, batch_size, seed=0):
    """One epoch of the plain loop on ``world_size`` gloo ranks.

    Returns rank 0's epoch seconds, the full coefficient vector and the intercept.
    """
    context = mp.get_context("spawn")
    queue = context.Queue()
    # The parent holds the store on a port the OS picks: no port guessing.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    args = ((n_samples, n_features), eta, alpha, batch_size, seed, queue)
    workers = [
        context.Process(target=_rank_loop, args=(rank, world_size, store.port, *args))
        for rank in range(world_size)
    ]
    for worker in workers:
        worker.start()
    results = sorted(queue.get(timeout=600) for _ in workers)
    for worker in workers:
        worker.join()
    coef = np.concatenate([result[2] for result in results])
    return results[0][1], coef, results[0][3]
