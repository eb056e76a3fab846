"""Two gloo ranks: the communicator's exchange against gloo's all-reduce, side by side.

A 2-rank :class:`~sklearn_casgd._engine.comm.TorchCommunicator` sums a buffer by
sending it to the peer and adding what comes back (one message each way);
this times that against ``dist.all_reduce`` on the same group, interleaved,
for several buffer sizes. With ``--overlap-us`` each collective is started,
a matrix product of about that many microseconds runs, and then the
collective is waited for: what the engine does with the next outer
iteration's Gram while an all-reduce is in flight. Medians over
``--repeats`` calls of each (after ``--warmup``); rank 0 prints the table.

    python benchmarks/bench_collectives.py                    # 4 B .. 1 MiB
    python benchmarks/bench_collectives.py --overlap-us 300   # with work in flight
    python benchmarks/bench_collectives.py --csv coll.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sklearn_casgd._distributed.launch import _loopback_interface
from sklearn_casgd._engine.comm import TorchCommunicator

# 115,200 bytes: the Gram blocks and margins of one outer iteration at s=8, b=32, fp32.
DEFAULT_BYTES = "4,16384,115200,1048576"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", default=DEFAULT_BYTES, help="buffer sizes in bytes (fp32)")
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--overlap-us", type=float, default=0.0, help="work while in flight")
    parser.add_argument("--csv", help="write the rows to this CSV file")
    return parser.parse_args()


def overlap_work(microseconds: float):
    """A matrix product sized to take about ``microseconds`` here, or None."""
    if not microseconds:
        return None
    n = 16
    a = torch.randn(n, n)
    while True:
        started = time.perf_counter()
        for _ in range(5):
            a @ a
        if (time.perf_counter() - started) / 5 * 1e6 >= microseconds or n >= 2048:
            return lambda: a @ a
        n = int(n * 1.25) + 1
        a = torch.randn(n, n)


def run_rank(rank: int, args, store_dir: str, queue) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    comm = TorchCommunicator(None, torch.device("cpu"), timedelta(seconds=60))
    assert comm.peer == 1 - rank, "the 2-rank exchange is not in use"
    work = overlap_work(args.overlap_us)  # each rank sizes its own

    def gloo(buffer):
        handle = dist.all_reduce(buffer, async_op=True)
        if work is not None:
            work()
        handle.wait()

    def exchange(buffer):
        pending = comm.start_all_reduce(buffer)
        if work is not None:
            work()
        pending.wait()

    rows = []
    for size in (int(b) for b in args.bytes.split(",")):
        buffer = torch.ones(max(1, size // 4))
        times = {"gloo": [], "exchange": []}
        for i in range(args.warmup + args.repeats):
            for name, call in (("gloo", gloo), ("exchange", exchange)):
                started = time.perf_counter()
                call(buffer)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - started)
        gloo_us = statistics.median(times["gloo"]) * 1e6
        exchange_us = statistics.median(times["exchange"]) * 1e6
        rows.append(
            {
                "bytes": buffer.numel() * 4,
                "overlap_us": args.overlap_us,
                "gloo_all_reduce_us": round(gloo_us, 1),
                "exchange_us": round(exchange_us, 1),
                "speedup": round(gloo_us / exchange_us, 2),
            }
        )
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def main():
    args = parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="bench_collectives_") as store_dir:
        mp.start_processes(run_rank, args=(args, store_dir, queue), nprocs=2, start_method="spawn")
        rows = queue.get()
    print(
        f"# 2 gloo ranks, 1 thread each, medians of {args.repeats} interleaved calls; "
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    header = list(rows[0])
    print("  ".join(f"{name:>18}" for name in header))
    for row in rows:
        print("  ".join(f"{row[name]:>18}" for name in header))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
