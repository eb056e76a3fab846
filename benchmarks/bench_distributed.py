"""Per-epoch time of FP32 SGD (s=1) against bf16 CA-SGD (s=8) on gloo ranks.

Runs every configuration interleaved, ``--repeats`` times, and reports the
median of ``fit_stats_["train_seconds"]`` (all work of the epochs, between
barriers, without process start-up), the final training loss and its gap to
FP32 SGD, the share of the epoch rank 0 spent blocked in all-reduces
(waiting for its peer included), and the all-reduce counts. With
``--plain`` it also times a straightforward minibatch SGD loop
(``benchmarks/_plain_sgd.py``, one all-reduce per step) in the same
rounds, so the s=1 baseline can be checked against it.

    python benchmarks/bench_distributed.py                 # the issue's shape
    python benchmarks/bench_distributed.py --csv out.csv   # also write a CSV
    python benchmarks/bench_distributed.py --plain         # and the plain SGD loop
    python benchmarks/bench_distributed.py --configs 16:bf16:all-reduce,16:bf16:all-gather
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch
from _exchange import EXCHANGES, forced_exchange
from _plain_sgd import plain_sgd_epoch
from _table import print_table, write_csv

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=65536)
    parser.add_argument("--n-features", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--configs",
        default="1:fp32,8:bf16,8:bf16:compiled",
        help="s:precision[:compiled][:all-reduce|:all-gather],... (s may be 'auto'; "
        "':compiled' sets compile=True; naming an exchange forces it)",
    )
    parser.add_argument("--csv", help="write the rows to this CSV file")
    parser.add_argument(
        "--plain", action="store_true", help="also time a plain minibatch SGD loop (one epoch)"
    )
    return parser.parse_args()


def parse_config(text):
    """``s:precision[:compiled][:all-reduce|:all-gather]`` (s may be "auto").

    Naming an exchange forces it instead of the fit's own choice.
    """
    s, precision, *rest = text.split(":")
    unknown = set(rest) - {"compiled", *EXCHANGES}
    if unknown:
        raise SystemExit(f"unknown option(s) {sorted(unknown)} in config {text!r}")
    exchange = next((option for option in rest if option in EXCHANGES), "auto")
    return (s if s == "auto" else int(s), precision, "compiled" in rest, exchange)


def main():
    args = parse_args()
    X, y, _ = make_glm_data(
        "logistic", args.n_samples, args.n_features, dtype="float32", random_state=0
    )
    configs = [parse_config(c) for c in args.configs.split(",")]
    runs = {config: [] for config in configs}
    plain_runs = []
    for _ in range(args.repeats):
        for config in configs:  # interleaved: drift hits every config alike
            s, precision, compiled, exchange = config
            with forced_exchange(exchange):
                est = CASGDLogisticRegression(
                    compile=compiled,
                    s=s,
                    solver="sgd",
                    precision=precision,
                    batch_size=args.batch_size,
                    n_devices=args.world_size,
                    device="cpu",
                    max_iter=args.epochs,
                    tol=None,
                    random_state=0,
                ).fit(X, y)
            runs[config].append(est)
        if args.plain:
            reference = runs[configs[0]][-1]
            plain_runs.append(
                plain_sgd_epoch(
                    args.n_samples,
                    args.n_features,
                    world_size=args.world_size,
                    eta=reference.fit_stats_["eta0"],
                    alpha=reference.alpha,
                    batch_size=args.batch_size,
                )
            )

    baseline = runs[configs[0]]
    base_seconds = statistics.median(e.fit_stats_["train_seconds"] for e in baseline)
    base_loss = baseline[0].loss_curve_[-1]
    print(
        f"# logistic n={args.n_samples} d={args.n_features} b={args.batch_size} "
        f"ranks={args.world_size} epochs={args.epochs} repeats={args.repeats}; "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    header = [
        "s",
        "precision",
        "compiled",
        "epoch_seconds",
        "speedup",
        "final_loss",
        "loss_gap_pct",
        "allreduce_share",
        "outer_ms",
        "blocked_ms",
        "n_allreduce",
        "allreduce_MB",
        "exchange",
    ]
    rows = []
    for (s, precision, compiled, _), ests in runs.items():
        seconds = statistics.median(e.fit_stats_["train_seconds"] for e in ests) / args.epochs
        loss = ests[0].loss_curve_[-1]
        stats = ests[0].fit_stats_
        rows.append(
            [
                f"auto={ests[0].fit_stats_['s']}" if s == "auto" else s,
                precision,
                f"yes ({statistics.median(e.fit_stats_['compile_seconds'] for e in ests):.1f} s)"
                if compiled
                else "no",
                round(seconds, 4),
                round(base_seconds / args.epochs / seconds, 2),
                round(loss, 6),
                round(100 * (loss - base_loss) / base_loss, 4),
                round(
                    statistics.median(
                        e.fit_stats_["allreduce_seconds"] / e.fit_stats_["train_seconds"]
                        for e in ests
                    ),
                    2,
                ),
                round(1e3 * seconds * args.epochs / stats["n_outer"], 3),
                round(
                    1e3
                    * statistics.median(e.fit_stats_["allreduce_seconds"] for e in ests)
                    / stats["n_outer"],
                    3,
                ),
                stats["n_allreduce"],
                round(stats["allreduce_bytes"] / 1e6, 2),
                stats["exchange"],
            ]
        )
    print_table(header, rows)
    if plain_runs:
        plain_seconds = statistics.median(run[0] for run in plain_runs)
        _, coef, intercept = plain_runs[0]
        engine = baseline[0]
        plain_objective = glm_objective("logistic", X, y, coef, intercept, engine.alpha)
        engine_objective = glm_objective(
            "logistic", X, y, engine.coef_, engine.intercept_, engine.alpha
        )
        print(
            f"# plain minibatch SGD loop, 1 epoch: {plain_seconds:.4f} s "
            f"(first config / plain = {base_seconds / args.epochs / plain_seconds:.2f}); "
            f"objective after the epoch: plain {plain_objective:.6f}, "
            f"first config {engine_objective:.6f}"
        )
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
