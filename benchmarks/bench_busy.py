"""A fit beside busy processes: its time against the quiet machine's, side by side.

A busy process is a Python loop that never sleeps. For 0, 1, ... (one per
core) of them, each configuration fits ``--repeats`` times (the median
wall time counts), interleaved:

* ``CASGDLogisticRegression`` at its defaults and with ``batch_size=256``
  (minibatch SVRG), as the library runs it: torch's threads sized to the
  cores free when the fit starts (``_distributed.threads.threads_for_free_cores``);
* the same with torch's own thread count (``--before``; one per core), what
  the library did before;
* ``LogisticRegression`` (lbfgs) with the same objective.

Each row: seconds quiet, then beside k busy processes, and the worst ratio
to quiet. The issue's bound: within 2x of the quiet time.

    python benchmarks/bench_busy.py [--samples 160000] [--features 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

from _busy import busy_processes
from _table import print_table, write_csv
from sklearn.linear_model import LogisticRegression

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._distributed import threads
from sklearn_casgd.datasets import make_glm_data


def configurations(alpha: float, n: int) -> dict:
    return {
        "CASGD defaults": (lambda: CASGDLogisticRegression(alpha=alpha, random_state=0), True),
        "CASGD defaults, torch's threads": (
            lambda: CASGDLogisticRegression(alpha=alpha, random_state=0),
            False,
        ),
        "CASGD batch_size=256": (
            lambda: CASGDLogisticRegression(alpha=alpha, batch_size=256, random_state=0),
            True,
        ),
        "CASGD batch_size=256, torch's threads": (
            lambda: CASGDLogisticRegression(alpha=alpha, batch_size=256, random_state=0),
            False,
        ),
        "LogisticRegression lbfgs": (lambda: LogisticRegression(C=1.0 / (n * alpha)), None),
    }


def timed_fit(make, size_to_free_cores: bool | None, X, y) -> float:
    if size_to_free_cores is not None:
        threads.SIZE_TO_FREE_CORES = size_to_free_cores
    try:
        time.sleep(0.2)  # the previous fit's idle BLAS and OpenMP threads stop spinning
        started = time.perf_counter()
        make().fit(X, y)
        return time.perf_counter() - started
    finally:
        threads.SIZE_TO_FREE_CORES = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=160_000)
    parser.add_argument("--features", type=int, default=100)
    parser.add_argument("--alpha", type=float, default=1e-4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--csv")
    args = parser.parse_args()
    X, y, _ = make_glm_data("logistic", args.samples, args.features, random_state=0)
    configs = configurations(args.alpha, args.samples)
    for make, size in configs.values():  # loading, compiling: start-up, not the fit
        timed_fit(make, size, X[:2000], y[:2000])
    seconds = {(name, busy): [] for name in configs for busy in range(args.busy + 1)}
    warnings.simplefilter("ignore")
    for busy in range(args.busy + 1):
        with busy_processes(busy):
            for _ in range(args.repeats):
                for name, (make, size) in configs.items():
                    seconds[name, busy].append(timed_fit(make, size, X, y))
    header = ["model", *[f"{busy} busy" for busy in range(args.busy + 1)], "worst / quiet"]
    rows = []
    for name in configs:
        medians = [statistics.median(seconds[name, busy]) for busy in range(args.busy + 1)]
        rows.append([name, *[f"{m:.2f}" for m in medians], f"{max(medians) / medians[0]:.2f}x"])
    print(
        f"logistic {args.samples} x {args.features}, alpha={args.alpha}; "
        f"{len(os.sched_getaffinity(0))} cores; medians of {args.repeats} wall seconds"
    )
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
