"""Per-epoch time of ``n_devices="world"`` fits: the ranks of a job you started.

Run it under torchrun; every rank holds the same data and fits its column
block in the job's own process group, as a user's training script would.
The configurations run interleaved, ``--repeats`` times; rank 0 prints the
median of ``fit_stats_["train_seconds"]`` per configuration (``s`` may be
"auto"; the exchange is the fit's own choice).

    torchrun --standalone --nproc-per-node=2 --local-addr=127.0.0.1 \\
        benchmarks/bench_world.py --configs 1:fp32,8:bf16,32:bf16
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from _table import print_table, write_csv

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd.datasets import make_glm_data


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=65536)
    parser.add_argument("--n-features", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--configs", default="1:fp32,8:bf16,32:bf16", help="s:precision,...")
    parser.add_argument("--csv", help="rank 0 writes the rows to this CSV file")
    return parser.parse_args()


def main():
    args = parse_args()
    # One thread per rank: more threads than cores slowed ranks 4-17x (FIELD_NOTES).
    torch.set_num_threads(1)
    X, y, _ = make_glm_data(
        "logistic", args.n_samples, args.n_features, dtype="float32", random_state=0
    )
    configs = [tuple(config.split(":")) for config in args.configs.split(",")]
    seconds = {config: [] for config in configs}
    chosen = {}
    for _ in range(args.repeats):
        for config in configs:  # interleaved: drift hits every config alike
            s, precision = config
            est = CASGDLogisticRegression(
                s=s if s == "auto" else int(s),
                solver="sgd",
                precision=precision,
                batch_size=args.batch_size,
                n_devices="world",
                device="cpu",
                max_iter=1,
                tol=None,
                random_state=0,
            ).fit(X, y)
            seconds[config].append(est.fit_stats_["train_seconds"])
            chosen[config] = (est.fit_stats_["s"], est.fit_stats_["exchange"])
    if dist.get_rank() != 0:
        return
    base = statistics.median(seconds[configs[0]])
    header = ["s", "precision", "epoch_seconds", "speedup", "exchange"]
    rows = []
    for config in configs:
        median = statistics.median(seconds[config])
        s, exchange = chosen[config]
        label = f"auto={s}" if config[0] == "auto" else s
        rows.append([label, config[1], round(median, 4), round(base / median, 2), exchange])
    print(
        f"# logistic n={args.n_samples} d={args.n_features} b={args.batch_size} "
        f"ranks={dist.get_world_size()} repeats={args.repeats}; torch {torch.__version__}"
    )
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
