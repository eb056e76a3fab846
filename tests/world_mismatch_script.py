"""Run by the distributed tests on two ranks whose data differ; writes what fit raised.

Usage: ``python world_mismatch_script.py OUT_DIR STORE_PORT {shape,targets,gpu}``; with
``gpu`` both ranks fit on CUDA over NCCL, on the one GPU they see.
"""

import os
import sys
from datetime import timedelta

import torch.distributed as dist

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd.datasets import make_glm_data

out_dir, port, mismatch = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
dist.init_process_group(
    "nccl" if mismatch == "gpu" else "gloo", store=store, rank=rank, world_size=2
)

n_samples = 300 + (rank if mismatch == "shape" else 0)
X, y, _ = make_glm_data("logistic", n_samples, 6, random_state=0)
if mismatch == "targets" and rank == 1:
    y = 1 - y
try:
    device = "cuda" if mismatch == "gpu" else "cpu"
    params = dict(device=device, max_iter=2, tol=None, timeout=30)
    CASGDLogisticRegression(n_devices="world", **params).fit(X, y)
    outcome = "fitted"
except ValueError as error:
    outcome = f"ValueError: {error}"
with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as handle:
    handle.write(outcome)
dist.destroy_process_group()
