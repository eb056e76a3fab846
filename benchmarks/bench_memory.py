"""How much a default fit grows the process, as a multiple of the float32 input.

Each configuration runs in a fresh interpreter (Linux): it builds a float32
X of ``--n-samples`` x ``--n-features`` (least squares, Gaussian rows),
warms the estimator up on 512 rows, resets the peak resident set, fits at
the defaults (SVRG, ``batch_size="auto"``) with ``--max-iter`` epochs and
prints the peak resident set less the one before the fit, over the size of
X. The median of ``--repeats`` interpreters per precision is reported
(allocator reuse moves it by a few hundredths).

    python benchmarks/bench_memory.py                      # 1e6 x 64, bf16 and fp32
    python benchmarks/bench_memory.py --precisions bf16 --repeats 5
    python benchmarks/bench_memory.py --precisions bf16 --batch-size 256  # minibatch SVRG
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = """
import json, sys
import numpy as np
from sklearn_casgd import CASGDLinearRegression


def status_bytes(field):
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


n, d, precision, max_iter = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
batch_size = sys.argv[5] if sys.argv[5] == "auto" else int(sys.argv[5])
rng = np.random.default_rng(0)
X = rng.standard_normal((n, d), dtype=np.float32)
y = X[:, : min(d, 8)].sum(axis=1, dtype=np.float64) + rng.standard_normal(n)
# Warm up on tiny data: torch pages its kernels' code in on first use.
CASGDLinearRegression(precision=precision, max_iter=1, tol=None).fit(X[:512], y[:512])
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # reset the peak (VmHWM) to the current resident set
before = status_bytes("VmRSS")
fitted = CASGDLinearRegression(
    precision=precision, max_iter=max_iter, batch_size=batch_size, random_state=0
).fit(X, y)
growth = (status_bytes("VmHWM") - before) / X.nbytes
print(json.dumps({"growth": growth, "batch_size": fitted.fit_stats_["batch_size"]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=1_000_000)
    parser.add_argument("--n-features", type=int, default=64)
    parser.add_argument("--precisions", default="bf16,fp32")
    parser.add_argument("--max-iter", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--batch-size", default="auto", help="'auto' (Newton epochs here) or a minibatch size"
    )
    args = parser.parse_args()
    print(
        f"# float32 X {args.n_samples} x {args.n_features}, least squares, SVRG, batch_size="
        f"{args.batch_size}, {args.max_iter} epochs; peak growth over X's size, median of "
        f"{args.repeats}"
    )
    print("precision  batch_size  growth_x_input  runs")
    for precision in args.precisions.split(","):
        runs = []
        for _ in range(args.repeats):
            command = [sys.executable, "-c", PROBE, str(args.n_samples), str(args.n_features),
                       precision, str(args.max_iter), args.batch_size]  # fmt: skip
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        growth = statistics.median(run["growth"] for run in runs)
        shown = " ".join(f"{run['growth']:.3f}" for run in runs)
        print(f"{precision}  {runs[0]['batch_size']}  {growth:.3f}  {shown}")


if __name__ == "__main__":
    main()
