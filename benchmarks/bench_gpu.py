"""One GPU: FP32 SGD against bf16 CA-SGD, and the Gram GEMM against the device's peak.

Meant to run in a few minutes whenever a GPU is available:

    python benchmarks/bench_gpu.py                      # cuda, n=1048576, d=512
    python benchmarks/bench_gpu.py --csv gpu.csv
    python benchmarks/bench_gpu.py --device cpu --n-samples 8192 --n-features 32  # smoke run

Three parts, each printed as a table:

1. the device's measured bf16 peak: the best rate of square bf16 GEMMs
   (float32 accumulation) of a few sizes;
2. the Gram GEMMs of one outer iteration as the engine forms them (the
   strictly lower blocks of ``Y Y^T`` for batch size b and s steps), in
   multiply-adds per second and as a share of that peak;
3. logistic regression fits on the device (``n_devices=1``), interleaved
   ``--repeats`` times: FP32 SGD (s=1) against CA-SGD bf16 for each s of
   ``--s``: median time per epoch (``fit_stats_["train_seconds"]``), final
   loss and its gap to FP32 SGD.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._comm import LocalCommunicator
from sklearn_casgd._families import BinomialFamily
from sklearn_casgd._kernel import LocalData, StepContext, gather_outer_batch
from sklearn_casgd._precision import PRESETS
from sklearn_casgd.datasets import make_glm_data


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n-samples", type=int, default=1 << 20)
    parser.add_argument("--n-features", type=int, default=512)
    parser.add_argument("--batch-sizes", default="256,1024")
    parser.add_argument("--s", default="4,8,16,auto")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-sizes", default="4096,8192,16384")
    parser.add_argument("--csv", help="write all three tables to this CSV file")
    return parser.parse_args()


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_of(run, device, repeats=10):
    """Median wall seconds of ``run()``, the device synchronized around each call."""
    run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bf16_peak(device, sizes):
    """Rows ``[size, multiply-adds per second]`` of square bf16 GEMMs, fp32 accumulation."""
    rows = []
    for size in sizes:
        a = torch.randn(size, size, device=device).bfloat16()
        b = torch.randn(size, size, device=device).bfloat16()
        rows.append([size, size**3 / seconds_of(lambda a=a, b=b: a @ b, device)])
        del a, b
    return rows


def gram_rates(device, n_features, batch_sizes, steps):
    """Rows ``[b, s, multiply-adds per second]`` of one outer iteration's Gram blocks."""
    policy = PRESETS["bf16"]
    ctx = StepContext(BinomialFamily(), policy, 0.0, True, LocalCommunicator())
    rows = []
    for b in batch_sizes:
        for s in steps:
            n = b * s
            X = torch.randn(n, n_features, device=device).to(policy.x_storage)
            data = LocalData(
                X,
                torch.zeros((n, 1), device=device),
                torch.ones(n, device=device),
            )
            index = torch.arange(n, device=device)
            seconds = seconds_of(
                lambda d=data, i=index, s=s, b=b: gather_outer_batch(ctx, d, i, [b] * s), device
            )
            multiply_adds = b * b * s * (s - 1) / 2 * n_features
            rows.append([b, s, multiply_adds / seconds])
    return rows


def fits(args, device):
    X, y, _ = make_glm_data(
        "logistic", args.n_samples, args.n_features, dtype="float32", random_state=0
    )
    configs = [(1, "fp32", b) for b in args.batch_sizes]
    configs += [(s, "bf16", b) for b in args.batch_sizes for s in args.s]
    runs = {config: [] for config in configs}
    for _ in range(args.repeats):
        for s, precision, b in configs:
            est = CASGDLogisticRegression(
                s=s,
                solver="sgd",
                precision=precision,
                batch_size=b,
                device=str(device),
                max_iter=args.epochs,
                tol=None,
                random_state=0,
            ).fit(X, y)
            runs[(s, precision, b)].append(est)
    rows = []
    for (s, precision, b), ests in runs.items():
        base = runs[(1, "fp32", b)]
        base_epoch = statistics.median(e.fit_stats_["train_seconds"] for e in base)
        epoch = statistics.median(e.fit_stats_["train_seconds"] for e in ests)
        loss, base_loss = ests[0].loss_curve_[-1], base[0].loss_curve_[-1]
        rows.append(
            [
                b,
                f"auto={ests[0].fit_stats_['s']}" if s == "auto" else s,
                precision,
                round(epoch / args.epochs, 4),
                round(base_epoch / epoch, 2),
                round(loss, 6),
                round(100 * (loss - base_loss) / base_loss, 4),
            ]
        )
    return rows


def show(title, header, rows):
    print(f"# {title}")
    widths = [max(len(str(v)) for v in col) for col in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True)))


def main():
    args = parse_args()
    device = torch.device(args.device)
    args.batch_sizes = [int(v) for v in args.batch_sizes.split(",")]
    args.s = [v if v == "auto" else int(v) for v in args.s.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}")
    peak_rows = bf16_peak(device, [int(v) for v in args.peak_sizes.split(",")])
    peak = max(rate for _, rate in peak_rows)
    steps = [s for s in args.s if s != "auto"]
    gram_rows = gram_rates(device, args.n_features, args.batch_sizes, steps)
    tables = [
        (
            "bf16 GEMM peak (n x n x n)",
            ["n", "TMAC_per_s"],
            [[n, round(rate / 1e12, 3)] for n, rate in peak_rows],
        ),
        (
            f"Gram of one outer iteration, d={args.n_features}, bf16 in, fp32 out",
            ["batch_size", "s", "TMAC_per_s", "share_of_peak"],
            [[b, s, round(rate / 1e12, 3), round(rate / peak, 3)] for b, s, rate in gram_rows],
        ),
        (
            f"logistic n={args.n_samples} d={args.n_features}, {args.epochs} epochs, "
            f"medians of {args.repeats}",
            ["batch_size", "s", "precision", "epoch_seconds", "speedup", "final_loss", "gap_pct"],
            fits(args, device),
        ),
    ]
    for table in tables:
        show(*table)
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.writer(handle)
            for title, header, rows in tables:
                writer.writerows([[title], header, *rows])


if __name__ == "__main__":
    main()
