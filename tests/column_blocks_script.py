"""Run by tests/test_column_blocks.py on every rank of a 4-rank torchrun job.

Usage: ``python column_blocks_script.py DATA_DIR OUT_DIR MODE``. DATA_DIR holds
what the test wrote: each case's block files (``<case>/block<r>.<suffix>``)
and its targets (``<case>/y.npy``). MODE ``fit``: every rank fits each case
from its own block files only and writes its coefficients, and the peak
memory the fit added, to ``OUT_DIR/rank<r>.npz``. MODE ``bad``: each case
of wrong blocks is fitted in turn and every rank records the error it got.
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sklearn_casgd import CASGDLogisticRegression, CASGDPoissonRegressor, ColumnBlocks

torch.set_num_threads(1)
data_dir, out_dir, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])
COMMON = dict(precision="fp64", device="cpu", random_state=0, timeout=60, n_devices="world")
ESTIMATORS = {"logistic": CASGDLogisticRegression, "poisson": CASGDPoissonRegressor}


def blocks(case, suffix):
    return ColumnBlocks.from_files([data_dir / case / f"block{r}.{suffix}" for r in range(4)])


def memory_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


if mode == "fit":
    # BLAS allocates its work buffers at a process's first product (7 MB
    # here): once per process, not the fit's memory.
    torch.ones(512, 512) @ torch.ones(512, 512)
    np.ones((512, 512)) @ np.ones((512, 512))
    cases = json.loads((data_dir / "cases.json").read_text())
    results = {}
    for name, case in cases.items():
        y = np.load(data_dir / name / "y.npy")
        estimator = ESTIMATORS[case["estimator"]](**COMMON, **case["params"])
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again here
        before = memory_kib("VmRSS")
        estimator.fit(blocks(name, case["suffix"]), y)
        results[f"{name}_peak_kib"] = memory_kib("VmHWM") - before
        results[f"{name}_coef"] = estimator.coef_
        results[f"{name}_intercept"] = estimator.intercept_
        results[f"{name}_n_features_in"] = estimator.n_features_in_
        results[f"{name}_eta0"] = estimator.fit_stats_["eta0"]
        results[f"{name}_steps"] = estimator.fit_stats_["execution"]["steps"]
        whole = data_dir / name / "X.npy"
        if whole.exists():  # the fitted model predicts on ordinary X
            results[f"{name}_score"] = estimator.score(np.load(whole), y)
    # Checkpoints of a block fit: each rank writes its own block's weights and
    # the identity holds the whole X's fingerprint; the refit resumes the
    # finished fit without running an epoch.
    name = "logistic_minibatch_npy"
    case, y = cases[name], np.load(data_dir / name / "y.npy")
    for attempt in ("written", "resumed"):
        estimator = ESTIMATORS[case["estimator"]](
            checkpoint_dir=out_dir / "checkpoints", **COMMON, **case["params"]
        )
        results[f"checkpoint_{attempt}_coef"] = estimator.fit(blocks(name, "npy"), y).coef_
    np.savez(out_dir / f"rank{rank}.npz", **results)
else:
    cases = json.loads((data_dir / "bad.json").read_text())
    y = np.load(data_dir / "good" / "y.npy")
    outcomes = {}
    for name, case in cases.items():
        paths = [data_dir / path for path in case["paths"]]
        target = y.copy()
        if case.get("flip_y_on_rank") == rank:
            target[0] = 1 - target[0]
        weight = None
        if case.get("weight_on_rank") == rank:
            weight = np.full(y.shape[0], 2.0)
        started = time.monotonic()
        try:
            CASGDLogisticRegression(max_iter=2, tol=None, **COMMON).fit(
                ColumnBlocks.from_files(paths), target, sample_weight=weight
            )
            outcomes[name] = ["no error", time.monotonic() - started]
        except Exception as error:  # the test reads what each rank raised
            outcomes[name] = [f"{type(error).__name__}: {error}", time.monotonic() - started]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcomes))
