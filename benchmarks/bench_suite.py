"""The paper's comparison on this machine: FP32 SGD, CA-SGD fp32/bf16, and scikit-learn.

For each problem, runs every solver of the matrix interleaved ``--repeats``
times for ``--epochs`` epochs, and reports medians: time per epoch, time to
reach FP32 SGD's final loss plus 0.5 % (from the per-epoch history), final
training objective (exact, float64) and its gap to FP32 SGD, all-reduce
count and bytes. scikit-learn's SGD estimators run the same number of
epochs with their defaults; its exact solvers (lbfgs, Ridge) solve the same
objective to convergence: their final loss is the optimum, and their
"seconds to target" is simply their fit time.

    python benchmarks/bench_suite.py                                 # small, quick
    python benchmarks/bench_suite.py --problems synth,poisson-synth --world-sizes 1,2 \\
        --s 1,8,16 --batch-sizes 32 --n-samples 65536 --csv out.csv --plots out_dir
    python benchmarks/bench_suite.py --libsvm /data/HIGGS --problems higgs-file

Problems: ``synth`` (logistic), ``multinomial``, ``linear``, ``poisson-synth``
(known coefficients, ``make_glm_data``), ``higgs-like`` (n x 28), ``susy-like``
(n x 18), ``epsilon-like`` (n x 2000, n scaled down), and ``libsvm`` for a
real file given with ``--libsvm PATH`` (epsilon, SUSY, HIGGS; read with
``sklearn.datasets.load_svmlight_file``, labels mapped to 0/1; nothing is
downloaded).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from _memory import PeakMemory
from sklearn.linear_model import (
    LogisticRegression,
    PoissonRegressor,
    Ridge,
    SGDClassifier,
    SGDRegressor,
)

from sklearn_casgd._registry import FAMILIES
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective

# problem -> (family, n_features or None for --n-features)
PROBLEMS = {
    "synth": ("logistic", None),
    "multinomial": ("multinomial", None),
    "linear": ("linear", None),
    "poisson-synth": ("poisson", None),
    "higgs-like": ("logistic", 28),
    "susy-like": ("logistic", 18),
    "epsilon-like": ("logistic", 2000),
    "libsvm": ("logistic", None),
}
TARGET_SLACK = 1.005  # "time to target": FP32 SGD's final loss + 0.5 %


def load_problem(name, args):
    family, width = PROBLEMS[name]
    if name == "libsvm":
        from sklearn.datasets import load_svmlight_file

        X, y = load_svmlight_file(args.libsvm)
        X = X.toarray().astype(np.float32)
        y = (
            (y > np.median(y)).astype(np.float64)
            if len(np.unique(y)) > 2
            else (y == y.max()).astype(np.float64)
        )
        return family, X[: args.n_samples], y[: args.n_samples]
    n = args.n_samples
    if name == "epsilon-like":
        n = max(1000, n // 8)  # 2000 features: keep the data a few hundred MB at most
    X, y, _ = make_glm_data(family, n, width or args.n_features, dtype=np.float32, random_state=0)
    return family, X, y


def sklearn_solvers(family, alpha, epochs, n):
    """What users run today: SGD with its defaults for the same epochs, and the
    exact solver of the same objective (its loss is the optimum)."""
    if family in ("logistic", "multinomial"):
        return {
            "sklearn SGDClassifier": SGDClassifier(
                loss="log_loss", alpha=alpha, max_iter=epochs, tol=None, random_state=0
            ),
            "sklearn LogisticRegression(lbfgs)": LogisticRegression(C=1.0 / (n * alpha)),
        }
    if family == "linear":
        return {
            "sklearn SGDRegressor": SGDRegressor(
                alpha=alpha, max_iter=epochs, tol=None, random_state=0
            ),
            "sklearn Ridge": Ridge(alpha=alpha * n),
        }
    return {"sklearn PoissonRegressor(lbfgs)": PoissonRegressor(alpha=alpha)}


def matrix(args):
    configs = []
    for world in args.world_sizes:
        for b in args.batch_sizes:
            configs.append(("FP32 SGD", 1, "fp32", world, b))
            for s in args.s:
                if s == 1:
                    continue
                for precision in args.precisions:
                    configs.append((f"CA-SGD {precision}", s, precision, world, b))
    return configs


def make_solver(family, key, args, n):
    """A CA-SGD estimator for a matrix config ``(label, s, precision, world, b)``,
    or the scikit-learn solver of that label."""
    if isinstance(key, str):
        return sklearn_solvers(family, args.alpha, args.epochs, n)[key]
    _, s, precision, world, b = key
    return FAMILIES[family].estimator(
        alpha=args.alpha,
        s=s,
        solver="sgd",  # the paper's algorithm, timed against FP32 SGD
        precision=precision,
        n_devices=world,
        device="cpu",
        batch_size=b,
        max_iter=args.epochs,
        tol=None,
        random_state=0,
    )


def fresh_process_peak_bytes(name, key, args):
    """Peak memory one fit adds, measured in a fresh interpreter (see ``--memory-of``):
    in this process the allocator would reuse what earlier fits left behind."""
    command = [sys.executable, __file__, "--memory-of", json.dumps(key), "--problems", name]
    for option in ("n_samples", "n_features", "alpha", "epochs", "libsvm"):
        value = getattr(args, option)
        if value is not None:
            command += ["--" + option.replace("_", "-"), str(value)]
    completed = subprocess.run(command, capture_output=True, text=True, check=True)
    return int(completed.stdout.split()[-1])


def peak_bytes_here(name, key, args):
    """Load the problem, warm the solver up on 512 rows, and measure one full fit."""
    family, X, y = load_problem(name, args)
    make_solver(family, key, args, X.shape[0]).fit(X[:512], y[:512])  # page the code in
    solver = make_solver(family, key, args, X.shape[0])
    with PeakMemory() as memory:
        solver.fit(X, y)
    return memory.extra_bytes


def run_problem(name, args, rows, histories):
    family, X, y = load_problem(name, args)
    n = X.shape[0]
    alpha = args.alpha
    ours = {config: [] for config in matrix(args)}
    theirs = {label: [] for label in sklearn_solvers(family, alpha, args.epochs, n)}

    for _ in range(args.repeats):
        for config in ours:
            ours[config].append(make_solver(family, config, args, n).fit(X, y))
        for label, solver in sklearn_solvers(family, alpha, args.epochs, n).items():
            start = time.perf_counter()
            solver.fit(X, y)
            theirs[label].append((time.perf_counter() - start, solver))
    problem_columns = {
        "problem": name,
        "n": n,
        "d": X.shape[1],
        "X_MB": round(X.nbytes / 2**20, 1),
    }
    peak_mb = {
        key: round(fresh_process_peak_bytes(name, key, args) / 2**20, 1) if args.memory else ""
        for key in [*ours, *theirs]
    }

    baseline = {}  # (world, b) -> FP32 SGD's final objective, epoch seconds, last curve value
    for config, ests in ours.items():
        label, s, precision, world, b = config
        if label == "FP32 SGD":
            est = ests[0]
            baseline[(world, b)] = (
                glm_objective(family, X, y, est.coef_, est.intercept_, alpha),
                statistics.median(e.fit_stats_["train_seconds"] for e in ests) / args.epochs,
                est.loss_curve_[-1],
            )
    for config, ests in ours.items():
        label, s, precision, world, b = config
        est = ests[0]
        loss = glm_objective(family, X, y, est.coef_, est.intercept_, alpha)
        base_loss, base_epoch, base_curve = baseline[(world, b)]
        epoch = statistics.median(e.fit_stats_["train_seconds"] for e in ests) / args.epochs
        # Compared on the training-loss curve, the measurement every fit records.
        target = base_curve * TARGET_SLACK
        reached = statistics.median(
            next(
                (
                    seconds
                    for seconds, value in zip(
                        e.fit_stats_["epoch_seconds"], e.loss_curve_, strict=True
                    )
                    if value <= target
                ),
                math.nan,
            )
            for e in ests
        )
        rows.append(
            {
                **problem_columns,
                "solver": label,
                "s": s,
                "precision": precision,
                "world_size": world,
                "batch_size": b,
                "epoch_seconds": round(epoch, 4),
                "speedup_vs_fp32_sgd": round(base_epoch / epoch, 2),
                "seconds_to_target": round(reached, 4),
                "final_loss": round(loss, 6),
                "gap_to_fp32_sgd_pct": round(100 * (loss - base_loss) / base_loss, 4),
                "n_allreduce": est.fit_stats_["n_allreduce"],
                "allreduce_MB": round(est.fit_stats_["allreduce_bytes"] / 1e6, 2),
                "peak_MB": peak_mb[config],
            }
        )
        histories.append(
            (
                name,
                f"{label} s={s} P={world} b={b}",
                est.fit_stats_["epoch_seconds"],
                est.loss_curve_,
            )
        )
    for label, runs in theirs.items():
        seconds = statistics.median(t for t, _ in runs)
        solver = runs[0][1]
        exact = "SGD" not in label
        loss = glm_objective(family, X, y, solver.coef_, solver.intercept_, alpha)
        base_loss, base_epoch, _ = baseline[(1, args.batch_sizes[0])]
        rows.append(
            {
                **problem_columns,
                "solver": label,
                "s": "",
                "precision": "fp64",
                "world_size": 1,
                "batch_size": n if exact else 1,
                "epoch_seconds": "" if exact else round(seconds / args.epochs, 4),
                "speedup_vs_fp32_sgd": ""
                if exact
                else round(base_epoch / (seconds / args.epochs), 2),
                "seconds_to_target": round(seconds, 4) if exact else "",
                "final_loss": round(loss, 6),
                "gap_to_fp32_sgd_pct": round(100 * (loss - base_loss) / base_loss, 4),
                "n_allreduce": "",
                "allreduce_MB": "",
                "peak_MB": peak_mb[label],
            }
        )


def plot(rows, histories, folder):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for problem in dict.fromkeys(name for name, *_ in histories):
        fig, (by_time, by_s) = plt.subplots(1, 2, figsize=(11, 4))
        for name, label, seconds, loss in histories:
            if name == problem:
                by_time.plot(seconds, loss, marker=".", label=label)
        by_time.set_xlabel("training time (s)")
        by_time.set_ylabel("training objective")
        by_time.legend(fontsize=7)
        for key in dict.fromkeys(
            (r["precision"], r["world_size"])
            for r in rows
            if r["problem"] == problem and r["s"] != ""
        ):
            points = sorted(
                {(1, 1.0)}  # FP32 SGD, the reference of every line
                | {
                    (r["s"], r["speedup_vs_fp32_sgd"])
                    for r in rows
                    if r["problem"] == problem
                    and r["s"] not in ("", 1)
                    and (r["precision"], r["world_size"]) == key
                }
            )
            by_s.plot(*zip(*points, strict=True), marker="o", label=f"{key[0]}, P={key[1]}")
        by_s.set_xscale("log", base=2)
        by_s.set_xlabel("s")
        by_s.set_ylabel("speedup over FP32 SGD (time per epoch)")
        by_s.legend(fontsize=7)
        fig.suptitle(problem)
        fig.tight_layout()
        fig.savefig(folder / f"{problem}.png", dpi=120)
        plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="synth,poisson-synth")
    parser.add_argument("--n-samples", type=int, default=16384)
    parser.add_argument("--n-features", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=1e-4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--s", default="1,8")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--batch-sizes", default="32")
    parser.add_argument("--world-sizes", default="1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--libsvm", help="path of a LIBSVM file for the 'libsvm' problem")
    parser.add_argument("--csv", help="write the table to this CSV file")
    parser.add_argument("--plots", help="write loss-vs-time and speedup-vs-s plots here")
    parser.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="skip the peak-memory probes (one fresh interpreter per solver, ~3 s each)",
    )
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)  # internal: one fresh-process probe
    args = parser.parse_args()
    args.s = [int(v) for v in args.s.split(",")]
    args.precisions = args.precisions.split(",")
    args.batch_sizes = [int(v) for v in args.batch_sizes.split(",")]
    args.world_sizes = [int(v) for v in args.world_sizes.split(",")]
    warnings.simplefilter("ignore")
    if args.memory_of:
        print(peak_bytes_here(args.problems, json.loads(args.memory_of), args))
        return

    rows, histories = [], []
    for name in args.problems.split(","):
        if name == "libsvm" and not args.libsvm:
            raise SystemExit("the 'libsvm' problem needs --libsvm PATH")
        run_problem(name, args, rows, histories)
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads; medians of "
        f"{args.repeats} interleaved repeats; {args.epochs} epochs"
    )
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).rjust(widths[c]) for c in columns))
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
    if args.plots:
        plot(rows, histories, args.plots)


if __name__ == "__main__":
    main()
