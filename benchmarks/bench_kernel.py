"""One outer iteration in one process: the eager steps against the compiled ones.

    python benchmarks/bench_kernel.py                   # d=128 (a 2-rank block of d=256), b=32
    python benchmarks/bench_kernel.py --s 1,8,16 --precisions fp32,bf16 --csv kernel.csv
    python benchmarks/bench_kernel.py --steps gram,rows  # the Gram steps against the row steps

"outer" is what the epoch loop runs per group of s batches on one rank:
gather the rows and form the Gram blocks, the margins GEMM, the s inner
steps and the weight update (no communication: one process). "steps" is
the part after the all-reduce, on rows gathered beforehand (margins GEMM,
step coefficients, the s steps and the update). "gather" is the rest of
"outer" (the rows and their Gram blocks), which runs eager in both paths,
so it sets how far compiling can speed a whole outer iteration.
``--steps`` picks the steps: from the Gram blocks ("gram", what a rank of
the Gram all-reduce runs) or from the rows ("rows", what one process and
the row all-gather run: no Gram is formed, so "gather" is the rows only).
"steps_dynamo" is the compiled steps called through dynamo (its guards
on every call) instead of compiled ahead of time, the library's CPU path
(``sklearn_casgd/_accel/compile.py``). Eager and compiled calls alternate,
``--repeats`` times each; the table gives the medians and their ratio,
the time each compile took (the first row's ahead-of-time one includes
starting inductor in the process; ``TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)``
times a cold cache) and the largest difference of the coefficients.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time

import torch
from _table import print_table, write_csv

from sklearn_casgd._engine.batch import gather_outer_batch
from sklearn_casgd._engine.comm import LocalCommunicator
from sklearn_casgd._engine.precision import PRESETS
from sklearn_casgd._engine.recurrence import ca_outer_iteration, warm_up
from sklearn_casgd._engine.state import LocalData, ModelState, StepContext
from sklearn_casgd._glm.families import BinomialFamily
from sklearn_casgd._glm.penalties import Penalty


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-features", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--s", default="1,8,16")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--steps", default="gram", help="gram, rows or both: gram,rows")
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rank's share)")
    parser.add_argument("--csv", help="write the rows to this CSV file")
    return parser.parse_args()


def outer_iteration(ctx, data, state, s, b):
    """One outer iteration as the solver runs it: gather, then the steps."""
    rows = torch.arange(s * b)
    batch = gather_outer_batch(ctx, data, rows, [b] * s)
    return ca_outer_iteration(ctx, data, state, batch, [1e-3] * s)[0]


def measure(args, s, precision, steps):
    policy = PRESETS[precision]
    b, d = args.batch_size, args.n_features
    generator = torch.Generator().manual_seed(0)
    n = 4 * s * b
    X = torch.randn(n, d, generator=generator).to(policy.x_storage)
    target = (torch.rand(n, 1, generator=generator) > 0.5).to(policy.recurrence)
    data = LocalData(X, target, torch.ones(n, dtype=policy.recurrence))
    contexts, states = {}, {}
    compile_seconds = 0.0
    for compiled in (False, True):
        ctx = StepContext(
            BinomialFamily(), policy, Penalty(1e-4), True, LocalCommunicator(), None, compiled,
            row_steps=steps == "rows",
        )  # fmt: skip
        states[compiled] = ModelState(
            torch.zeros((d, 1), dtype=policy.weight_storage),
            torch.zeros(1, dtype=policy.recurrence),
        )
        if compiled:
            started = time.perf_counter()
            warm_up(ctx, data, states[compiled], torch.arange(s * b), [b] * s)
            compile_seconds = time.perf_counter() - started
        contexts[compiled] = ctx
        outer_iteration(ctx, data, states[compiled], s, b)
    dynamo = dataclasses.replace(contexts[True], ahead_of_time=False)
    dynamo_state = ModelState(states[True].coef.clone(), states[True].intercept.clone())
    started = time.perf_counter()
    outer_iteration(dynamo, data, dynamo_state, s, b)  # compiles through dynamo
    dynamo_compile_seconds = time.perf_counter() - started
    batch = gather_outer_batch(contexts[False], data, torch.arange(s * b), [b] * s)
    times = {(part, compiled): [] for part in ("outer", "steps") for compiled in (False, True)}
    times["gather"], times["steps_dynamo"] = [], []
    rows = torch.arange(s * b)
    for _ in range(args.repeats):
        for compiled in (False, True):
            ctx, state = contexts[compiled], states[compiled]
            started = time.perf_counter()
            outer_iteration(ctx, data, state, s, b)
            times[("outer", compiled)].append(time.perf_counter() - started)
            started = time.perf_counter()
            ca_outer_iteration(ctx, data, state, batch, [1e-3] * s)
            times[("steps", compiled)].append(time.perf_counter() - started)
        started = time.perf_counter()
        ca_outer_iteration(dynamo, data, dynamo_state, batch, [1e-3] * s)
        times["steps_dynamo"].append(time.perf_counter() - started)
        started = time.perf_counter()
        gather_outer_batch(contexts[False], data, rows, [b] * s)  # eager in both paths
        times["gather"].append(time.perf_counter() - started)
    medians = {key: 1e6 * statistics.median(values) for key, values in times.items()}
    gap = (states[True].coef - states[False].coef).abs().max().item()
    row = [s, precision, steps]
    for part in ("outer", "steps"):
        eager, compiled = medians[(part, False)], medians[(part, True)]
        row += [round(eager, 1), round(compiled, 1), round(eager / compiled, 2)]
    row += [round(medians["steps_dynamo"], 1), round(medians["gather"], 1)]
    row += [round(compile_seconds, 1), round(dynamo_compile_seconds, 1)]
    return [*row, f"{gap:.1e}"]


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    header = ["s", "precision", "steps", "outer_eager_us", "outer_compiled_us", "outer_speedup"]
    header += ["steps_eager_us", "steps_compiled_us", "steps_speedup", "steps_dynamo_us"]
    header += ["gather_us"]
    header += ["compile_s", "dynamo_compile_s", "coef_gap"]
    rows = [
        measure(args, int(s), precision, steps)
        for precision in args.precisions.split(",")
        for s in args.s.split(",")
        for steps in args.steps.split(",")
    ]
    print(
        f"# one outer iteration, logistic, d={args.n_features} b={args.batch_size}, "
        f"{args.threads} thread(s), medians of {args.repeats} alternating calls; "
        f"{platform.machine()}, torch {torch.__version__}"
    )
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
