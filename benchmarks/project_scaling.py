"""Projected epoch time and speedup over FP32 SGD of CA-SGD on 1 to 1024 GPUs: a model, not a run.

The library's cost model (``sklearn_casgd/_engine/cost.py``) prices an epoch
from a device's local costs and its collectives'. This script gives it:

* local costs per GPU: ``PROFILES["cuda"]`` (coarse: from the H200 run of
  ``bench_gpu.py``, ``docs/tuning.md``), and for the Gram products a GEMM
  rate of ``--gemm-tflops`` (default 100 TFLOP/s: an eighth of the
  790 TFLOP/s a bf16 8192^3 GEMM reached on the H200, since a Gram of a
  few hundred rows runs far below peak);
* collectives: NCCL's own latency and bandwidth model (the base and
  per-hop latencies of ring and tree under the LL, LL128 and Simple
  protocols in ``src/graph/tuning.cc`` of NVIDIA/nccl, and its conversion
  of bus to algorithm bandwidth), on nodes of 8 GPUs joined by NVLink 4
  (450 GB/s a direction a GPU: 900 GB/s total, NVIDIA H100 datasheet)
  and, between nodes, one NDR InfiniBand port a GPU (400 Gb/s = 50 GB/s,
  NVIDIA ConnectX-7); per message the fastest algorithm and protocol,
  as NCCL picks them.

The same model is first run on this machine (``PROFILES["cpu"]``, a gloo
all-reduce of ``--gloo-latency-ms`` and ``--gloo-gb-per-s``) against the
measured 2-rank epochs of the README's per-epoch table: how far to trust it.

CA-SGD runs bf16 with s chosen per p from 1..32 (the model's choice, as
``s="auto"`` does), under each exchange: the Gram all-reduce (s b^2 ... values
an outer iteration, the products overlapping it) and the row all-gather
(each rank gathers the s b rows of every column and steps all of them; the
gather of the next outer iteration overlaps this one's steps). FP32 SGD is
s=1 in float32: one all-reduce of b partial margins a step.

Usage: ``python benchmarks/project_scaling.py [--batch-size 256] [--csv out.csv] [--plot out.png]``
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from _table import print_table, write_csv

from sklearn_casgd._engine.cost import (
    CANDIDATES,
    PROFILES,
    CommCosts,
    FitShape,
    LocalCosts,
    predict_epoch_seconds,
)

# The CA-SGD paper's datasets: (rows, columns).
SHAPES = {"HIGGS": (11_000_000, 28), "SUSY": (5_000_000, 18), "epsilon": (400_000, 2000)}
GPUS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
GPUS_PER_NODE = 8

# NCCL's tuning model (NVIDIA/nccl, src/graph/tuning.cc): latencies in us.
BASE_LATENCY = {
    "tree": {"LL": 4.4, "LL128": 4.4, "Simple": 0.0},
    "ring": {"LL": 3.6, "LL128": 10.0, "Simple": 8.4},
}
HOP_LATENCY = {
    "nvlink": {
        "tree": {"LL": 0.52, "LL128": 1.2, "Simple": 28.0},
        "ring": {"LL": 0.47, "LL128": 1.9, "Simple": 3.4},
    },
    "net": {
        "tree": {"LL": 5.0, "LL128": 8.5, "Simple": 50.0},
        "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 9.6},
    },
}
NVLINK_GB_PER_S = 450.0  # a direction, a GPU: NVLink 4, 900 GB/s total (H100 datasheet)
NETWORK_GB_PER_S = 50.0  # one NDR InfiniBand port a GPU: 400 Gb/s (ConnectX-7)


@dataclass(frozen=True)
class Nccl:
    """NCCL's model of a collective's time on ``ranks`` GPUs, 8 a node."""

    ranks: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / GPUS_PER_NODE)

    def _bus_bandwidth(self, algorithm: str, protocol: str) -> float:
        bus = NVLINK_GB_PER_S if self.nodes == 1 else NETWORK_GB_PER_S
        if algorithm == "ring":
            if protocol == "LL":
                return bus / 4.0
            return bus * 0.92 if protocol == "LL128" else bus
        tree = min(bus * 0.9, 80.0 if self.nodes > 2 else 110.0)
        if protocol == "LL":
            return tree / 3.8
        return tree * (7.0 / 9.0 if self.nodes == 1 else 0.915) if protocol == "LL128" else tree

    def _latency(self, algorithm: str, protocol: str, steps: int, inter_steps: int) -> float:
        intra = HOP_LATENCY["nvlink"][algorithm][protocol]
        inter = HOP_LATENCY["net"][algorithm][protocol]
        if self.nodes > 1 and protocol == "LL":
            intra *= 1.8
        latency = BASE_LATENCY[algorithm][protocol]
        if algorithm == "ring":
            return latency + (steps - inter_steps) * intra + inter_steps * inter
        per_node = min(self.ranks, GPUS_PER_NODE)
        return latency + 2 * ((per_node - 1) * intra + math.log2(self.nodes) * inter)

    def all_reduce_seconds(self, message_bytes: float) -> float:
        if self.ranks == 1:
            return 0.0
        steps, inter_steps = 2 * (self.ranks - 1), 2 * (self.nodes - 1)
        best = math.inf
        for algorithm in ("ring", "tree"):
            ratio = self.ranks / steps if algorithm == "ring" else 0.5
            for protocol in ("LL", "LL128", "Simple"):
                latency = self._latency(algorithm, protocol, steps, inter_steps)
                bandwidth = self._bus_bandwidth(algorithm, protocol) * ratio
                best = min(best, latency + message_bytes / (1e3 * bandwidth))
        return best * 1e-6

    def all_gather_seconds(self, output_bytes: float) -> float:
        """Ring all-gather (NCCL's only algorithm for it) of ``output_bytes`` in all."""
        if self.ranks == 1:
            return 0.0
        steps, inter_steps = self.ranks - 1, self.nodes - 1
        best = math.inf
        for protocol in ("LL", "LL128", "Simple"):
            latency = self._latency("ring", protocol, steps, inter_steps)
            bandwidth = self._bus_bandwidth("ring", protocol) * self.ranks / steps
            best = min(best, latency + output_bytes / (1e3 * bandwidth))
        return best * 1e-6


def fixed_comm(seconds: float) -> CommCosts:
    """A collective of known time, as the cost model's latency-plus-bytes form takes it."""
    return CommCosts(latency=seconds, seconds_per_byte=0.0)


def epoch_gram(n, width, b, s, local: LocalCosts, nccl: Nccl, element_bytes: int) -> float:
    """CA-SGD with the Gram all-reduce (s >= 2), or one all-reduce a step (s = 1)."""
    values = b if s == 1 else b**2 * s * (s - 1) / 2 + s * b
    comm = None if nccl.ranks == 1 else fixed_comm(nccl.all_reduce_seconds(values * element_bytes))
    shape = FitShape(n, b, width, 1, element_bytes)
    return predict_epoch_seconds(s, shape, local, comm)


def epoch_gather(n, d, b, s, rows: LocalCosts, nccl: Nccl, element_bytes: int) -> float:
    """CA-SGD where every rank gathers the s b rows of every column and steps them all."""
    outer_compute = rows.outer_fixed + s * rows.inner_step
    gather = nccl.all_gather_seconds(s * b * d * element_bytes)
    return math.ceil(math.ceil(n / b) / s) * max(outer_compute, gather)


def project(batch_size: int = 256, gemm_tflops: float = 100.0) -> list[dict]:
    """The table: per data set, GPU count and exchange, the best s and its epoch."""
    profile = PROFILES["cuda"]
    gemm_rate = gemm_tflops * 1e12 / 2  # multiply-adds a second
    rows = []
    for name, (n, d) in SHAPES.items():
        b = batch_size
        one_gpu = None
        for p in GPUS:
            nccl = Nccl(p)
            width = max(1, math.ceil(d / p))
            block = profile.local_costs(b, width, 1)
            local = LocalCosts(block.sgd_step, block.outer_fixed, block.inner_step, gemm_rate)
            whole = profile.local_costs(b, d, 1)  # the row steps of every column
            fp32 = epoch_gram(n, width, b, 1, local if p > 1 else whole, nccl, 4)
            gram = {
                s: epoch_gram(n, width, b, s, local, nccl, 2) if p > 1 else math.inf
                for s in CANDIDATES
            }
            gather = {s: epoch_gather(n, d, b, s, whole, nccl, 2) for s in CANDIDATES}
            one_gpu = one_gpu or min(gather.values())
            for exchange, epochs in (("all-reduce", gram), ("all-gather", gather)):
                s = min(epochs, key=epochs.get)
                if math.isinf(epochs[s]):
                    continue
                rows.append(
                    {
                        "data": name,
                        "GPUs": p,
                        "nodes": nccl.nodes,
                        "columns a GPU": width if p <= d else f"{width} ({p - d} idle)",
                        "exchange": exchange,
                        "s": s,
                        "epoch s": round(epochs[s], 4),
                        "FP32 SGD epoch s": round(fp32, 4),
                        "speedup": round(fp32 / epochs[s], 1),
                        "vs 1 GPU": round(one_gpu / epochs[s], 2),
                    }
                )
    return rows


def calibrate(gloo_latency_ms: float = 0.4, gloo_gb_per_s: float = 0.8) -> list[dict]:
    """The model on this machine against the README's measured 2-rank epochs."""
    n, d, b = 65536, 256, 32
    profile = PROFILES["cpu"]
    comm = CommCosts(gloo_latency_ms * 1e-3, 1.0 / (gloo_gb_per_s * 1e9))
    block = profile.local_costs(b, d // 2, 1)
    whole = profile.local_costs(b, d, 1)
    fp32 = predict_epoch_seconds(1, FitShape(n, b, d // 2, 1, 4), block, comm)
    gathered = FitShape(n, b, d // 2, 1, 2, frozenset({8}), 2 / 2 * (d // 2) * 2)
    ca = predict_epoch_seconds(8, gathered, block, comm, whole)
    return [
        {"config": "s=1 fp32", "predicted s": round(fp32, 3), "measured s": 0.792},
        {"config": "s=8 bf16 (rows gathered)", "predicted s": round(ca, 3), "measured s": 0.134},
        {
            "config": "speedup",
            "predicted s": round(fp32 / ca, 2),
            "measured s": round(0.792 / 0.134, 2),
        },
    ]


def _print(rows: list[dict]) -> None:
    print_table(list(rows[0]), [list(row.values()) for row in rows])


def plot(rows: list[dict], path: str | None = None):
    """Epoch seconds against GPUs per data set: FP32 SGD and CA-SGD under each exchange."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(SHAPES), figsize=(4.2 * len(SHAPES), 3.4))
    for axis, name in zip(axes, SHAPES, strict=True):
        gathered = [r for r in rows if r["data"] == name and r["exchange"] == "all-gather"]
        axis.plot(
            [r["GPUs"] for r in gathered],
            [r["FP32 SGD epoch s"] for r in gathered],
            "s-",
            color="grey",
            label="FP32 SGD (s=1)",
        )
        for exchange in ("all-reduce", "all-gather"):
            points = [r for r in rows if r["data"] == name and r["exchange"] == exchange]
            axis.plot(
                [r["GPUs"] for r in points],
                [r["epoch s"] for r in points],
                "o-",
                label=f"bf16 CA-SGD, {exchange}",
            )
        if SHAPES[name][1] <= GPUS[-1]:
            axis.axvline(SHAPES[name][1], color="grey", linestyle=":", linewidth=1)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_title(f"{name} (n={SHAPES[name][0]:,}, d={SHAPES[name][1]})", fontsize=10)
        axis.set_xlabel("GPUs (8 a node; dotted: as many as columns)")
    axes[0].set_ylabel("projected seconds an epoch")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, dpi=120)
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--gemm-tflops", type=float, default=100.0)
    parser.add_argument(
        "--gloo-latency-ms",
        type=float,
        default=0.4,
        help="a 2-rank gloo all-reduce here (FIELD_NOTES: 0.33-0.5 ms up to 65k floats)",
    )
    parser.add_argument(
        "--gloo-gb-per-s",
        type=float,
        default=0.8,
        help="its bandwidth (FIELD_NOTES: 4-6 ms for 1M floats)",
    )
    parser.add_argument("--csv", help="write the projection's table here")
    parser.add_argument("--plot", help="write the speedups' plot here (PNG)")
    args = parser.parse_args()
    print("The model on this machine (2 gloo ranks, n=65536, d=256, b=32, one epoch):")
    _print(calibrate(args.gloo_latency_ms, args.gloo_gb_per_s))
    rows = project(args.batch_size, args.gemm_tflops)
    print(f"\nProjected, batch_size={args.batch_size}, bf16 CA-SGD against FP32 SGD:")
    _print(rows)
    if args.csv:
        write_csv(args.csv, list(rows[0]), [list(row.values()) for row in rows])
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
