"""``s="auto"`` against every fixed s, one process.

For each problem shape, fits one epoch with ``s="auto"`` and with each
candidate s, interleaved, ``--repeats`` times, and prints the medians of
``fit_stats_["train_seconds"]``, the s that auto chose, and auto's time over
the best fixed s's.

    python benchmarks/bench_auto_s.py [--threads 1] [--repeats 5]

For the same comparison across ranks use
``benchmarks/bench_distributed.py --configs 1:fp32,8:bf16,16:bf16,32:bf16,auto:bf16``.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._engine.cost import CANDIDATES
from sklearn_casgd.datasets import make_glm_data

# (n, d, batch_size): HIGGS-like, epsilon-like (scaled down), SUSY-like
SHAPES = [(20000, 28, 32), (65536, 256, 32), (50000, 18, 64)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    print(
        f"# one process, {args.threads} thread(s), logistic, one epoch, medians of "
        f"{args.repeats}; torch {torch.__version__}"
    )
    print(
        "n  d  b  auto_chose  auto_seconds  best_s  best_seconds  auto/best  "
        + "  ".join(f"s={s}" for s in CANDIDATES)
    )
    for n, d, b in SHAPES:
        X, y, _ = make_glm_data("logistic", n, d, dtype="float32", random_state=0)
        times = {s: [] for s in ["auto", *CANDIDATES]}
        for _ in range(args.repeats):
            for s in times:
                est = CASGDLogisticRegression(
                    s=s, solver="sgd", max_iter=1, tol=None, batch_size=b, random_state=0
                ).fit(X, y)
                times[s].append(est.fit_stats_["train_seconds"])
                if s == "auto":
                    chosen = est.fit_stats_["s"]
        median = {s: statistics.median(v) for s, v in times.items()}
        best_s = min(CANDIDATES, key=median.get)
        print(
            f"{n}  {d}  {b}  {chosen}  {median['auto']:.3f}  {best_s}  {median[best_s]:.3f}  "
            f"{median['auto'] / median[best_s]:.2f}  "
            + "  ".join(f"{median[s]:.3f}" for s in CANDIDATES)
        )


if __name__ == "__main__":
    main()
