"""One process against scikit-learn: time per epoch and the memory fit holds.

Interleaves, ``--repeats`` times: CA-SGD (s=1 fp32, s=1 bf16, s=8 fp32) with
``max_iter=1, tol=None`` (``fit_stats_["train_seconds"]``) and scikit-learn's
``SGDClassifier(max_iter=1, tol=None)`` (wall time of ``fit``) on the same
float32 data, with torch and BLAS limited to ``--threads`` threads. Then, in
a fresh process per configuration and repeat (Linux), the peak resident
memory while ``fit`` runs, X included, as a multiple of the input array's
size (median over ``--memory-repeats`` processes: allocator reuse moves it
by ~0.01x). ``--solver svrg`` times the CA-SGD fits with SVRG (one epoch:
its full passes included) and ``--dtype float64`` gives them float64 data.

    python benchmarks/bench_single.py                     # n=200000, d=100, b=256
    python benchmarks/bench_single.py --csv out.csv
    python benchmarks/bench_single.py --solver svrg --dtype float64 --threads 2
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from sklearn.linear_model import SGDClassifier
from threadpoolctl import threadpool_limits

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd.datasets import make_glm_data

MEMORY_CASES = [  # solver, precision, dtype of X
    ("sgd", "bf16", "float32"),
    ("sgd", "fp32", "float32"),
    ("sgd", "bf16", "float64"),
    ("svrg", "fp32", "float32"),
    ("svrg", "bf16", "float32"),
    ("svrg", "bf16", "float64"),
]
MEMORY_PROBE = """
import json, sys
import numpy as np
from sklearn_casgd import CASGDLogisticRegression


def status_kib(field):
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


path, precision, solver = sys.argv[1], sys.argv[2], sys.argv[3]
X = np.load(path)
y = (X[:, 0] > 0).astype(int)
# Warm up on tiny data: torch pages its kernels' code in on first use.
warm_up = CASGDLogisticRegression(precision=precision, solver=solver, max_iter=1, tol=None)
warm_up.fit(X[:512], y[:512])
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # reset the peak (VmHWM) to the current resident set
before = status_kib("VmRSS")
CASGDLogisticRegression(
    precision=precision, solver=solver, max_iter=1, tol=None, batch_size=256
).fit(X, y)
peak = status_kib("VmHWM")
print(json.dumps({"input_bytes": X.nbytes, "fit_extra_bytes": peak - before}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=200_000)
    parser.add_argument("--n-features", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-repeats", type=int, default=3)
    parser.add_argument("--solver", choices=["sgd", "svrg"], default="sgd")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--csv")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    X, y, _ = make_glm_data(
        "logistic", args.n_samples, args.n_features, dtype=args.dtype, random_state=0
    )
    configs = {
        "casgd s=1 fp32": dict(s=1, precision="fp32"),
        "casgd s=1 bf16": dict(s=1, precision="bf16"),
        "casgd s=8 fp32": dict(s=8, precision="fp32"),
    }
    seconds = {name: [] for name in [*configs, "SGDClassifier"]}
    losses = {}
    warnings.simplefilter("ignore")
    with threadpool_limits(args.threads):
        for _ in range(args.repeats):
            for name, params in configs.items():
                est = CASGDLogisticRegression(
                    batch_size=args.batch_size,
                    solver=args.solver,
                    max_iter=1,
                    tol=None,
                    random_state=0,
                    **params,
                ).fit(X, y)
                seconds[name].append(est.fit_stats_["train_seconds"])
                losses[name] = est.loss_curve_[-1]
            start = time.perf_counter()
            SGDClassifier(loss="log_loss", max_iter=1, tol=None, random_state=0).fit(X, y)
            seconds["SGDClassifier"].append(time.perf_counter() - start)

    sklearn_median = statistics.median(seconds["SGDClassifier"])
    rows = [["solver", "epoch_seconds", "vs_SGDClassifier", "final_loss"]]
    for name, values in seconds.items():
        median = statistics.median(values)
        rows.append(
            [
                name,
                f"{median:.4f}",
                f"{sklearn_median / median:.2f}",
                f"{losses[name]:.5f}" if name in losses else "",
            ]
        )
    print(
        f"# n={args.n_samples} d={args.n_features} b={args.batch_size} "
        f"threads={args.threads} repeats={args.repeats} solver={args.solver} "
        f"dtype={args.dtype}; torch {torch.__version__}"
    )
    for row in rows:
        print("  ".join(str(v).rjust(16) for v in row))

    memory_rows = []
    # --memory-repeats 0: no memory table (each probe is a fresh interpreter).
    probes = MEMORY_CASES if args.memory_repeats > 0 else []
    if probes:
        print("# memory: peak resident set during fit (X included) / X bytes, fresh process")
        memory_rows.append(
            ["solver", "precision", "input", "input_MB", "held_by_engine_x_fp32", "peak_x_input"]
        )
    with tempfile.TemporaryDirectory() as folder:
        for solver, precision, dtype in probes:
            path = f"{folder}/X_{dtype}.npy"
            np.save(path, X.astype(dtype))
            peaks = []
            for _ in range(args.memory_repeats):
                out = subprocess.run(
                    [sys.executable, "-c", MEMORY_PROBE, path, precision, solver],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                probe = json.loads(out.stdout)
                peaks.append(1 + probe["fit_extra_bytes"] / probe["input_bytes"])
            fp32_bytes = X.size * 4
            stored = (
                0
                if (precision, dtype) == ("fp32", "float32")
                else X.size * (2 if precision == "bf16" else 4)
            )
            memory_rows.append(
                [
                    solver,
                    precision,
                    dtype,
                    f"{probe['input_bytes'] / 2**20:.1f}",
                    f"{stored / fp32_bytes:.2f}",
                    f"{statistics.median(peaks):.2f}",
                ]
            )
    for row in memory_rows:
        print("  ".join(str(v).rjust(12) for v in row))
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            csv.writer(handle).writerows(rows + memory_rows)


if __name__ == "__main__":
    main()
