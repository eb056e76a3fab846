"""What checkpoints cost a fit: wall time with ``checkpoint_dir`` against without.

A HIGGS-shaped logistic fit (``--n-samples`` x 28, plain SGD for a fixed
``--epochs``, so that every mode runs the same epochs) on one process, and
on ``--ranks`` pool workers: without checkpoints, with one every 10 epochs,
and with one every epoch (each a file per rank, fsynced, then the
manifest). Modes interleaved, ``--repeats`` times; medians. A resumed
fit's cost (reading the checkpoint, one full pass) is the ``resume`` row:
the same fit run again on the directory of a fit that stopped after half
its epochs.

    python benchmarks/bench_checkpoint.py [--repeats 5] [--csv checkpoint.csv]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import torch
from _table import print_table, write_csv

from sklearn_casgd import CASGDLogisticRegression, WorkerPool
from sklearn_casgd.datasets import make_glm_data


def fit_seconds(X, y, n_devices: int, epochs: int, **checkpointing) -> float:
    estimator = CASGDLogisticRegression(
        solver="sgd",
        max_iter=epochs,
        tol=None,
        batch_size=256,
        s=8,
        device="cpu",
        random_state=0,
        n_devices=n_devices,
        **checkpointing,
    )
    started = time.perf_counter()
    estimator.fit(X, y)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--csv")
    args = parser.parse_args()
    torch.set_num_threads(1)
    X, y, _ = make_glm_data("logistic", args.n_samples, 28, random_state=0)
    modes = {
        "none": {},
        "every 10": {"checkpoint_every": 10},
        "every 1": {"checkpoint_every": 1},
    }
    rows = []
    with WorkerPool(args.ranks):
        for n_devices in (1, args.ranks):
            times = {mode: [] for mode in [*modes, "resume"]}
            for _ in range(args.repeats):
                for mode, settings in modes.items():
                    with tempfile.TemporaryDirectory() as directory:
                        if settings:
                            settings = {**settings, "checkpoint_dir": directory}
                        times[mode].append(fit_seconds(X, y, n_devices, args.epochs, **settings))
                with tempfile.TemporaryDirectory() as directory:
                    fit_seconds(X, y, n_devices, args.epochs // 2, checkpoint_dir=directory)
                    times["resume"].append(
                        fit_seconds(X, y, n_devices, args.epochs, checkpoint_dir=directory)
                    )
            base = statistics.median(times["none"])
            for mode, seconds in times.items():
                median = statistics.median(seconds)
                rows.append([n_devices, mode, f"{median:.3f}", f"{median / base:.3f}"])
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"n={args.n_samples}, d=28, {args.epochs} epochs, medians of {args.repeats}"
    )
    header = ["ranks", "checkpoints", "fit seconds", "vs none"]
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
