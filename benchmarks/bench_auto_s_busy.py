"""``s="auto"`` on several ranks, quiet and beside busy processes: the s chosen, and each s's epoch.

On several ranks ``s="auto"`` times the kernels and the collectives when a
process first fits a shape. For 0 and ``--busy`` busy processes (one per
core by default), ``--choices`` fresh processes each fit once with
``s="auto"`` and report the s they chose; then one process times an epoch
of every fixed s (medians of ``--repeats``). A row per load: the s the fresh
processes chose, each s's epoch seconds, and the fastest s measured. A
stable choice is the same s in every row.

    python benchmarks/bench_auto_s_busy.py [--samples 32768] [--features 4096] [--batch-size 32]
        [--ranks 2] [--choices 3] [--repeats 3] [--csv FILE]

The default shape, plain SGD on wide rows, is one where the Gram's cost
grows with s against the collectives' latency: the best s lies inside the
candidates, not at the largest one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import warnings

from _busy import busy_processes
from _table import print_table, write_csv

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._engine.cost import CANDIDATES, MAX_OUTER_SHARE
from sklearn_casgd.datasets import make_glm_data


def fit(X, y, args, s) -> CASGDLogisticRegression:
    return CASGDLogisticRegression(
        n_devices=args.ranks,
        solver="sgd",
        s=s,
        batch_size=args.batch_size,
        max_iter=1,
        tol=None,
        random_state=0,
    ).fit(X, y)


def data(args):
    shape = (args.samples, args.features)
    X, y, _ = make_glm_data("logistic", *shape, dtype="float32", random_state=0)
    return X, y


def child(args) -> None:
    """One fresh process's s="auto" fit: print the s it chose (JSON)."""
    warnings.simplefilter("ignore")
    print(json.dumps({"s": fit(*data(args), args, "auto").fit_stats_["s"]}))


def chosen_in_fresh_process(args) -> int:
    command = [sys.executable, __file__, "--child", *sys.argv[1:]]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32768)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--choices", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--csv")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    warnings.simplefilter("ignore")
    X, y = data(args)
    largest = args.samples * MAX_OUTER_SHARE
    candidates = [s for s in CANDIDATES if s == 1 or s * args.batch_size <= largest]
    fit(X[:2000], y[:2000], args, 1)  # the worker pool started: start-up, not an epoch
    rows = []
    for busy in sorted({0, args.busy}):
        with busy_processes(busy):
            chosen = [chosen_in_fresh_process(args) for _ in range(args.choices)]
            seconds = {s: [] for s in candidates}
            for _ in range(args.repeats):
                for s in candidates:
                    seconds[s].append(fit(X, y, args, s).fit_stats_["train_seconds"])
        medians = {s: statistics.median(v) for s, v in seconds.items()}
        fastest = min(medians, key=medians.get)
        rows.append(
            [busy, " ".join(map(str, chosen)), *[f"{medians[s]:.3f}" for s in candidates], fastest]
        )
    header = ["busy", "auto chose", *[f"s={s}" for s in candidates], "fastest"]
    print(
        f"logistic {args.samples} x {args.features}, plain SGD, batch {args.batch_size}, "
        f"{args.ranks} ranks on {len(os.sched_getaffinity(0))} cores; 'auto chose': one fresh "
        f"process each; epoch seconds: medians of {args.repeats}"
    )
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
