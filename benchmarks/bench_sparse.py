"""A sparse, rcv1-shaped problem in one process: CA-SGD against SGDClassifier, and memory.

The data is synthetic with rcv1's shape (804,414 x 47,236 in the original;
by default 200,000 rows here) and density (0.16 % nonzeros, ~75 per row):
each row's columns drawn from a Zipf-like column popularity (a few words
are in most documents), positive log-normal values, rows scaled to unit
L2 norm as TF-IDF rows are, and labels from a sparse logistic model.

Interleaved, ``--repeats`` times, with torch and BLAS on ``--threads``
threads: one epoch of CA-SGD's plain SGD (``solver="sgd", max_iter=1,
tol=None``; ``fit_stats_["train_seconds"]``) at the ``--configs`` given
(``s:precision``), and one epoch of scikit-learn's
``SGDClassifier(loss="log_loss", max_iter=1, tol=None)`` (wall time of
``fit``), on the same CSR matrix; then the training objective each
reached. ``--memory`` also measures, in a fresh process per configuration,
the peak resident memory ``fit`` adds (default ``svrg`` fit for one epoch:
the full pass and the snapshot included) as a multiple of the CSR input's
bytes (data, indices and row pointers), beside the size a dense copy would
have. ``--ranks 2`` fits CA-SGD on a pool of 2 workers (the columns split
between them), where a config may name its exchange
(``s:precision:all-reduce``: the sparse rows' Gram; ``:all-gather``: the
rows gathered, every rank stepping all columns). ``--device cuda`` fits
CA-SGD on the GPU (SGDClassifier stays on the CPU). ``--steps N`` first
times one plain SGD step of 32 rows by mechanism (torch eager, torch.compile,
the numba epoch kernel): why the sparse steps run in numba.

    python benchmarks/bench_sparse.py                 # n=200000, d=47236
    python benchmarks/bench_sparse.py --memory --csv out.csv
    python benchmarks/bench_sparse.py --ranks 2 --configs 1:fp32,8:bf16:all-reduce,8:bf16:all-gather
    python benchmarks/bench_sparse.py --steps 2000 --configs 1:fp32 --repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import scipy.sparse as sp
import torch
from _exchange import EXCHANGES, forced_exchange
from _table import write_csv
from sklearn.linear_model import SGDClassifier
from threadpoolctl import threadpool_limits

from sklearn_casgd import CASGDLogisticRegression, WorkerPool
from sklearn_casgd.metrics import glm_objective

MEMORY_PROBE = """
import sys
import numpy as np
import scipy.sparse as sp
from sklearn_casgd import CASGDLogisticRegression


def status_bytes(field):
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


path, precision, s = sys.argv[1], sys.argv[2], int(sys.argv[3])
X = sp.load_npz(path)
y = np.load(path + ".labels.npy")
params = dict(precision=precision, s=s, max_iter=1, tol=None, device="cpu")
CASGDLogisticRegression(**params).fit(X[:512], y[:512])  # torch pages its kernels in
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # reset the peak (VmHWM) to the current resident set
before = status_bytes("VmRSS")
CASGDLogisticRegression(**params).fit(X, y)
print(status_bytes("VmHWM") - before)
"""


def rcv1_like(n_samples: int, n_features: int, density: float, seed: int = 0):
    """A CSR matrix and binary labels with rcv1's sparsity pattern (see the module docstring)."""
    rng = np.random.default_rng(seed)
    per_row = np.maximum(1, rng.poisson(density * n_features, size=n_samples))
    popularity = 1.0 / (np.arange(n_features) + 10.0) ** 1.1
    popularity /= popularity.sum()
    columns = rng.choice(n_features, size=int(per_row.sum()), p=popularity)
    indptr = np.concatenate([[0], np.cumsum(per_row)])
    values = rng.lognormal(0.0, 1.0, size=columns.shape[0]).astype(np.float32)
    X = sp.csr_matrix((values, columns, indptr), shape=(n_samples, n_features))
    X.sum_duplicates()
    norms = np.sqrt(np.asarray(X.multiply(X).sum(axis=1)).ravel())
    X = sp.diags(1.0 / norms).astype(np.float32) @ X
    truth = np.where(rng.random(n_features) < 0.1, rng.normal(0, 8.0, n_features), 0.0)
    logits = X @ truth - np.median(X @ truth)
    y = (rng.random(n_samples) < 1.0 / (1.0 + np.exp(-logits))).astype(int)
    return X.tocsr(), y


def time_casgd(
    X, y, s: int, precision: str, alpha: float, ranks: int = 1, exchange="auto", device="cpu"
):
    estimator = CASGDLogisticRegression(
        alpha=alpha, solver="sgd", s=s, precision=precision, max_iter=1, tol=None,
        device=device, random_state=0, n_devices=ranks,
    )  # fmt: skip
    with forced_exchange(exchange):
        estimator.fit(X, y)
    return estimator.fit_stats_["train_seconds"], estimator


def time_sklearn(X, y, alpha: float):
    estimator = SGDClassifier(loss="log_loss", alpha=alpha, max_iter=1, tol=None, random_state=0)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # max_iter=1 reached: a ConvergenceWarning
        estimator.fit(X, y)
    return time.perf_counter() - start, estimator


def step_mechanisms(X, y, steps: int, batch_size: int = 32) -> dict[str, float]:
    """Microseconds a plain SGD step on ``batch_size`` sparse rows takes, by mechanism.

    The same step (gather the CSR rows, margins, log-loss derivative, the
    decayed weights' scatter update) as torch operations run eagerly and
    through ``torch.compile(dynamic=True)`` (the batch's stored values vary
    in number: the gather's length is data-dependent), timed over
    ``steps`` steps after 5 untimed; and the numba epoch kernel's epoch
    over the same rows, per step.
    """
    crow = torch.from_numpy(X.indptr.astype(np.int64))
    col = torch.from_numpy(X.indices.astype(np.int64))
    values = torch.from_numpy(X.data)
    target = torch.from_numpy(y.astype(np.float32))

    def step(weights, intercept, rows, eta: float, decay: float):
        starts, lengths = crow[rows], crow[rows + 1] - crow[rows]
        total = int(lengths.sum())
        row = torch.repeat_interleave(torch.arange(rows.numel()), lengths, output_size=total)
        first = torch.cumsum(lengths, 0) - lengths
        position = torch.arange(total) + torch.repeat_interleave(
            starts - first, lengths, output_size=total
        )
        columns, stored = col[position], values[position]
        margins = torch.zeros(rows.numel()).index_add_(0, row, stored * weights[columns])
        residual = (torch.sigmoid(margins + intercept) - target[rows]) * (eta / rows.numel())
        weights.mul_(decay).index_add_(0, columns, -(stored * residual[row]))
        intercept.sub_(residual.sum())

    order = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(0))
    batches = [order[i : i + batch_size] for i in range(0, (steps + 5) * batch_size, batch_size)]
    micros = {}
    torch._logging.set_logs(dynamo=logging.ERROR)  # the gather's graph break, expected
    compiled = torch.compile(step, dynamic=True)
    for name, function in (("torch eager", step), ("torch.compile", compiled)):
        weights, intercept = torch.zeros(X.shape[1]), torch.zeros(())
        for rows in batches[:5]:
            function(weights, intercept, rows, 0.1, 1.0 - 1e-6)
        started = time.perf_counter()
        for rows in batches[5:]:
            function(weights, intercept, rows, 0.1, 1.0 - 1e-6)
        micros[name] = (time.perf_counter() - started) / (len(batches) - 5) * 1e6
    n_rows = min(X.shape[0], steps * batch_size)
    seconds, _ = time_casgd(X[:n_rows], y[:n_rows], 1, "fp32", 1e-6)
    micros["numba epoch kernel"] = seconds / (n_rows / batch_size) * 1e6
    return micros


def peak_memory(X, y, precision: str, s: int) -> int:
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/X.npz"
        sp.save_npz(path, X, compressed=False)
        np.save(path + ".labels.npy", y)
        output = subprocess.run(
            [sys.executable, "-c", MEMORY_PROBE, path, precision, str(s)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    return int(output.split()[-1])


def parse_config(text: str) -> tuple[int | str, str, str]:
    """``s:precision[:all-reduce|:all-gather]``: naming an exchange forces it (several ranks).

    ``s`` may be ``auto`` (the row then names the s taken).
    """
    s, precision, *rest = text.split(":")
    if any(option not in EXCHANGES for option in rest):
        raise SystemExit(f"unknown option(s) {rest} in config {text!r}")
    return (s if s == "auto" else int(s)), precision, rest[0] if rest else "auto"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=200_000)
    parser.add_argument("--n-features", type=int, default=47_236)
    parser.add_argument("--density", type=float, default=0.0016)
    parser.add_argument("--alpha", type=float, default=1e-5)
    parser.add_argument("--configs", default="1:fp32,8:fp32,1:bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--ranks", type=int, default=1, help="pool workers CA-SGD fits on")
    parser.add_argument("--device", default="cpu", help="where CA-SGD fits: cpu, cuda")
    parser.add_argument(
        "--steps", type=int, default=0, help="also time a step by mechanism over this many steps"
    )
    parser.add_argument("--csv")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    X, y = rcv1_like(args.n_samples, args.n_features, args.density)
    if args.steps:
        for name, micros in step_mechanisms(X, y, args.steps).items():
            print(f"a step of 32 rows, {name}: {micros:.1f} us")
    input_bytes = X.data.nbytes + X.indices.nbytes + X.indptr.nbytes
    dense_gib = X.shape[0] * X.shape[1] * 4 / 2**30
    print(
        f"X: {X.shape[0]} x {X.shape[1]}, {X.nnz} nonzeros ({X.nnz / np.prod(X.shape):.4%}), "
        f"CSR {input_bytes / 2**20:.0f} MiB (dense float32: {dense_gib:.1f} GiB); "
        f"{args.threads} thread(s), {args.repeats} interleaved repeats"
    )
    configs = [parse_config(text) for text in args.configs.split(",")]
    seconds = {key: [] for key in [*configs, "sklearn"]}
    fitted = {}
    pool = WorkerPool(args.ranks) if args.ranks > 1 else contextlib.nullcontext()
    with threadpool_limits(args.threads), pool:
        time_casgd(X[:2048], y[:2048], 1, "fp32", args.alpha, args.ranks, device=args.device)
        for _ in range(args.repeats):
            for key in configs:
                s, precision, exchange = key
                elapsed, fitted[key] = time_casgd(
                    X, y, s, precision, args.alpha, args.ranks, exchange, args.device
                )
                seconds[key].append(elapsed)
            elapsed, fitted["sklearn"] = time_sklearn(X, y, args.alpha)
            seconds["sklearn"].append(elapsed)
    baseline = statistics.median(seconds["sklearn"])
    header = ["solver", "epoch_seconds", "vs_SGDClassifier", "objective", "peak_extra_x_input"]
    rows = []
    for key in [*configs, "sklearn"]:
        label = "SGDClassifier" if key == "sklearn" else f"CA-SGD sgd s={key[0]} {key[1]}"
        if key != "sklearn" and key[0] == "auto":
            label += f" (took s={fitted[key].fit_stats_['s']})"
        if key != "sklearn" and args.ranks > 1:
            label += f", {args.ranks} ranks, {fitted[key].fit_stats_['exchange']}"
        estimator = fitted[key]
        objective = glm_objective(
            "logistic", X, y, estimator.coef_, estimator.intercept_, args.alpha
        )
        median = statistics.median(seconds[key])
        memory = ""
        if args.memory and key != "sklearn" and args.ranks == 1:
            memory = f"{peak_memory(X, y, key[1], key[0]) / input_bytes:.2f}"
        rows.append(
            [label, f"{median:.3f}", f"{median / baseline:.2f}", f"{objective:.6f}", memory]
        )
        print("  ".join(rows[-1]), flush=True)
    print(json.dumps({"seconds": {str(k): v for k, v in seconds.items()}}))
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
