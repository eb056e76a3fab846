"""Run by the distributed tests on every rank of a job; writes what each rank fitted.

Usage: ``python world_fit_script.py OUT_DIR [STORE_PORT]``. With a store port
the ranks form the default process group themselves (user code); without,
the fit initializes it from torchrun's environment.
"""

import os
import sys
from datetime import timedelta

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd.datasets import make_glm_data

torch.set_num_threads(1)
out_dir = sys.argv[1]
rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
if len(sys.argv) > 2:
    store = dist.TCPStore(
        "127.0.0.1", int(sys.argv[2]), is_master=False, timeout=timedelta(seconds=30)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)

X, y, _ = make_glm_data("multinomial", 400, 7, random_state=0)
params = dict(s=4, precision="fp64", max_iter=3, tol=None, device="cpu", timeout=30)
seeded = CASGDLogisticRegression(n_devices="world", random_state=0, **params).fit(X, y)
unseeded = CASGDLogisticRegression(n_devices="world", random_state=None, **params).fit(X, y)
local = CASGDLogisticRegression(n_devices=1, random_state=0, **params).fit(X, y)
# A sparse X: every rank takes its CSR column block.
X_sparse = sp.csr_matrix(np.where(np.abs(X) < 0.5, 0.0, X))
# An explicit batch: one process's sparse fit (the epoch kernel) plans a batch of its own.
sparse = CASGDLogisticRegression(n_devices="world", random_state=0, batch_size=32, **params).fit(
    X_sparse, y
)
# bf16 storage of columns far from zero: each rank stores its block preconditioned.
shifted = dict(params, precision="bf16", random_state=0)
world_bf16 = CASGDLogisticRegression(n_devices="world", **shifted).fit(X + 1000.0, y)
local_bf16 = CASGDLogisticRegression(n_devices=1, **shifted).fit(X + 1000.0, y)

# The user's default group survives the fit and still works.
probe = torch.ones(1)
dist.all_reduce(probe)
np.savez(
    os.path.join(out_dir, f"rank{rank}.npz"),
    seeded_coef=seeded.coef_,
    seeded_intercept=seeded.intercept_,
    unseeded_coef=unseeded.coef_,
    local_coef=local.coef_,
    sparse_coef=sparse.coef_,
    world_bf16_coef=world_bf16.coef_,
    local_bf16_coef=local_bf16.coef_,
    world_size=seeded.fit_stats_["world_size"],
    local_world_size=local.fit_stats_["world_size"],
    n_allreduce=seeded.fit_stats_["n_allreduce"],
    n_outer=seeded.fit_stats_["n_outer"],
    n_iter=seeded.n_iter_,
    exchange=seeded.fit_stats_["exchange"],
    s=seeded.fit_stats_["s"],
    batch_size=seeded.fit_stats_["batch_size"],
    probe=probe.numpy(),
)
dist.destroy_process_group()
