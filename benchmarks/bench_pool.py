"""Time a distributed fit spends beyond training inside GridSearchCV, with and without a pool.

GridSearchCV(n_jobs=1, refit=False) over ``--candidates`` values of alpha x
``--folds`` folds of an ``n_devices=2`` CASGDLogisticRegression on a small
problem. A fit's overhead is its wall time (GridSearchCV's ``fit_time``)
minus its training time (``fit_stats_["train_seconds"]``, read by the
scorer), averaged over the search's fits. Modes, interleaved, ``--repeats``
times (medians reported):

* ``pool``: every fit on one ``WorkerPool`` started before the search (its
  start-up is reported apart);
* ``default``: the default pool, closed before the search, so that the
  first fit pays the start-up;
* ``fresh``: a new pool per fit, what every fit paid before pools existed;
* ``local``: ``n_devices=1``, no worker process, for scale.

``worker_rss_MiB`` is the largest resident memory of the pool's workers
after the search: what an idle pool holds until it is closed.

    python benchmarks/bench_pool.py                 # 10 candidates x 3 folds
    python benchmarks/bench_pool.py --csv pool.csv  # also write a CSV
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import time

import numpy as np
import torch
from sklearn.model_selection import GridSearchCV

from sklearn_casgd import CASGDLogisticRegression, WorkerPool, close_worker_pools
from sklearn_casgd.datasets import make_glm_data

TRAIN_SECONDS: list[float] = []


class FreshWorkers(CASGDLogisticRegression):
    """Starts and stops its own workers on every fit (the behaviour before pools)."""

    def fit(self, X, y, sample_weight=None):
        with WorkerPool(self.n_devices):
            return super().fit(X, y, sample_weight=sample_weight)


def scorer(estimator, X, y):
    TRAIN_SECONDS.append(estimator.fit_stats_["train_seconds"])
    return estimator.score(X, y)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=3000)
    parser.add_argument("--n-features", type=int, default=20)
    parser.add_argument("--candidates", type=int, default=10)
    parser.add_argument("--folds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--n-devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="pool,default,fresh,local")
    parser.add_argument("--csv", help="write the rows to this CSV file")
    return parser.parse_args()


def search(estimator, X, y, args):
    """One grid search; (mean fit seconds, mean train seconds, wall seconds)."""
    TRAIN_SECONDS.clear()
    grid = {"alpha": np.logspace(-5, -1, args.candidates)}
    started = time.perf_counter()
    result = GridSearchCV(estimator, grid, cv=args.folds, scoring=scorer, refit=False, n_jobs=1)
    result.fit(X, y)
    wall = time.perf_counter() - started
    n_fits = args.candidates * args.folds
    assert len(TRAIN_SECONDS) == n_fits
    fit_seconds = float(np.sum(result.cv_results_["mean_fit_time"]) * args.folds / n_fits)
    return fit_seconds, float(np.mean(TRAIN_SECONDS)), wall


def resident_mib(pid):
    """Resident memory of process ``pid`` (Linux ``VmRSS``), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_mode(mode, X, y, args):
    params = dict(
        device="cpu", max_iter=args.epochs, tol=None, s=4, random_state=0, precision="fp32"
    )
    startup = rss = float("nan")
    if mode == "local":
        return (*search(CASGDLogisticRegression(n_devices=1, **params), X, y, args), startup, rss)
    estimator_class = FreshWorkers if mode == "fresh" else CASGDLogisticRegression
    estimator = estimator_class(n_devices=args.n_devices, **params)
    if mode == "pool":
        with WorkerPool(args.n_devices) as pool:
            started = time.perf_counter()
            estimator.fit(X[:100], y[:100])  # starts the workers
            startup = time.perf_counter() - started
            measured = search(estimator, X, y, args)
            assert pool.n_starts == 1
            rss = max(resident_mib(pid) for pid in pool.pids)  # what an idle pool holds
        return (*measured, startup, rss)
    close_worker_pools()
    measured = search(estimator, X, y, args)
    close_worker_pools()
    return (*measured, startup, rss)


def main():
    args = parse_args()
    X, y, _ = make_glm_data("logistic", args.n_samples, args.n_features, random_state=0)
    modes = args.modes.split(",")
    runs = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode in modes:
            runs[mode].append(run_mode(mode, X, y, args))
    cores = len(os.sched_getaffinity(0))
    print(
        f"# {platform.processor() or platform.machine()}, {cores} cores, torch "
        f"{torch.__version__}; GridSearchCV(n_jobs=1) {args.candidates} candidates x "
        f"{args.folds} folds, {args.n_samples} x {args.n_features} logistic, "
        f"{args.epochs} epochs, n_devices={args.n_devices}; medians of {args.repeats}"
    )
    header = [
        "mode", "fit_s", "train_s", "overhead_per_fit_s", "search_wall_s", "pool_start_s",
        "worker_rss_MiB",
    ]  # fmt: skip
    print(" | ".join(header))
    rows = []
    for mode in modes:
        fit_s, train_s, wall_s, start_s, rss = (
            statistics.median(values) for values in zip(*runs[mode], strict=True)
        )
        row = [mode, fit_s, train_s, fit_s - train_s, wall_s, start_s, rss]
        rows.append(row)
        print(f"{mode} | " + " | ".join(f"{value:.3f}" for value in row[1:]))
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows(rows)


if __name__ == "__main__":
    main()
