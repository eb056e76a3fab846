"""Run by the checkpoint tests on every rank of a torchrun job with ``--max-restarts=1``.

Usage: ``python checkpoint_world_script.py OUT_DIR CHECKPOINT_DIR``. Every
attempt fits once without checkpoints (the uninterrupted fit) and once with
them; in the first attempt rank 1 SIGKILLs itself once the checkpoint of
epoch 2 is complete, so torchrun restarts every rank and the second attempt
resumes it. Rank 0 writes both fits' coefficients and what it resumed.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd.datasets import make_glm_data

torch.set_num_threads(1)
out_dir, checkpoint_dir = Path(sys.argv[1]), Path(sys.argv[2])
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
manifest = checkpoint_dir / "manifest.json"


def epoch_written():
    try:
        return json.loads(manifest.read_text())["epoch"]
    except (OSError, ValueError):
        return 0


def kill_self_after_epoch_2():
    while epoch_written() < 2:
        time.sleep(0.002)
    os.kill(os.getpid(), signal.SIGKILL)


X, y, _ = make_glm_data("logistic", 3000, 12, random_state=0)
params = dict(
    solver="sgd",
    s=4,
    batch_size=16,
    precision="fp64",
    max_iter=12,
    tol=None,
    device="cpu",
    random_state=0,
    timeout=60,
    n_devices="world",
)
uninterrupted = CASGDLogisticRegression(**params).fit(X, y)
resumed_from = epoch_written()
if attempt == 0 and rank == 1:
    threading.Thread(target=kill_self_after_epoch_2, daemon=True).start()
fitted = CASGDLogisticRegression(checkpoint_dir=checkpoint_dir, **params).fit(X, y)
if rank == 0:
    np.savez(
        out_dir / "rank0.npz",
        uninterrupted=uninterrupted.coef_,
        fitted=fitted.coef_,
        attempt=attempt,
        resumed_from=resumed_from,
        n_iter=fitted.n_iter_,
        epochs_run=fitted.fit_stats_["epochs_run"],
    )
