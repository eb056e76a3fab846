"""``n_devices="world"``: a fit across the ranks of an existing job.

Every rank of the job (torchrun, SLURM, user code) calls ``fit`` on the same
X, or on :class:`~sklearn_casgd.ColumnBlocks` of which each rank loads only
its own columns; the fit checks that the ranks hold the same data (the
blocks: that they fit together), then runs on a group of its own made from
the default one, which it initializes from the environment when there is
none.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

from .._data.blocks import PROBLEMS, ColumnBlockError, ColumnBlocks
from .._data.storage import as_storage
from .._engine.comm import TorchCommunicator
from .._engine.fit import BlockResult, FitPlan, column_blocks, fit_block
from .._engine.reduction import ColumnReduction, WholeX, block_of
from .threads import ranks_yield


def job_world_size() -> int:
    """Size of the job a ``n_devices="world"`` fit spans."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(_rendezvous_env()["WORLD_SIZE"])


def _rendezvous_env() -> dict[str, str]:
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from torchrun's names or SLURM's."""
    env = dict(os.environ)
    if "RANK" not in env and "SLURM_PROCID" in env:
        env["RANK"] = env["SLURM_PROCID"]
        env.setdefault("WORLD_SIZE", env.get("SLURM_NTASKS", ""))
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ValueError(
            "n_devices='world' needs an initialized default process group, or "
            "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (as torchrun "
            f"sets them; under SLURM set MASTER_ADDR and MASTER_PORT). Missing: {missing}."
        )
    return env


def _ensure_default_group(backend: str, timeout: float) -> None:
    if dist.is_initialized():
        return
    env = _rendezvous_env()
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun shares its agent's store with the ranks and keeps it when
        # --max-restarts restarts them: keys of one attempt only, or a
        # restarted rank reads the gloo addresses its killed peers published
        # and cannot connect (pytorch/pytorch#135712).
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(
            f"sklearn_casgd/attempt_{attempt}",
            dist.TCPStore(
                env["MASTER_ADDR"],
                int(env["MASTER_PORT"]),
                world_size,
                is_master=False,
                timeout=timedelta(seconds=timeout),
            ),
        )
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        return
    store = _job_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), rank, world_size, timeout)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


def _job_store(host: str, port: int, rank: int, world_size: int, timeout: float) -> dist.Store:
    """The job's TCPStore, whose server (rank 0) listens on ``host``'s address alone.

    ``TCPStore(host, port, is_master=True)`` listens on every interface: the
    host is only where clients connect. Rank 0 binds a socket to
    ``host``'s address itself and hands it to the store (``master_listen_fd``):
    with ``MASTER_ADDR=127.0.0.1`` nothing listens beyond loopback.
    """
    wait = timedelta(seconds=timeout)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=wait)
    family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, protocol)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen()
    except OSError as error:
        listener.close()
        raise ValueError(
            f"Rank 0 cannot listen on MASTER_ADDR={host}, MASTER_PORT={port} ({error}): "
            "MASTER_ADDR must name an address of rank 0's host, and the port be free."
        ) from None
    # The store owns the descriptor from here: the socket object must not close it.
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=wait,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


# Rows per chunk of the fingerprint's pass over X.
_FINGERPRINT_ROWS = 1 << 12
_FINGERPRINT_NAMES = (
    "n_samples",
    "n_features",
    "n_outputs",
    "a projection of X",
    "a projection of y",
    "sum(sample_weight)",
    "a projection of sample_weight",
)


def data_fingerprint(
    X: np.ndarray,
    target: np.ndarray,
    sample_weight: np.ndarray,
    reduction: ColumnReduction | None = None,
) -> np.ndarray:
    """Shape and fixed random projections of X (dense or sparse), y and the weights, in float64.

    Ranks that pass the same data get the same numbers (to rounding); ranks
    that pass different shapes, rows, targets or weights (permuted ones, or
    class weights) almost surely do not: every value enters its projection. With
    a ``reduction``, X is this rank's column block: the projection of the
    whole X is summed over the ranks.
    """
    reduction = reduction or WholeX(X.shape[1])
    rng = np.random.default_rng(20261203)
    direction = block_of(rng.standard_normal(reduction.n_features), reduction)
    row_mix = rng.standard_normal(X.shape[0])
    x_projection = 0.0
    for lo in range(0, X.shape[0], _FINGERPRINT_ROWS):
        chunk = X[lo : lo + _FINGERPRINT_ROWS]
        x_projection += float(row_mix[lo : lo + _FINGERPRINT_ROWS] @ (chunk @ direction))
    x_projection = float(reduction.sum(np.array([x_projection]))[0])
    y_projection = float(row_mix @ target.sum(axis=1))
    return np.array(
        [
            X.shape[0],
            reduction.n_features,
            target.shape[1],
            x_projection,
            y_projection,
            float(sample_weight.sum()),
            float(row_mix @ sample_weight),
        ]
    )


def check_same_data(
    X: np.ndarray,
    target: np.ndarray,
    sample_weight: np.ndarray,
    group: dist.ProcessGroup,
    columns: tuple[tuple[int, int], int] | None = None,
) -> np.ndarray:
    """Raise ``ValueError`` on every rank unless every rank passed the same data.

    One all-reduce (a maximum of the fingerprint and of its negation) before
    anything else, so that different shapes fail here and not inside gloo,
    and different rows or targets do not mix into one model. With
    ``columns`` (this rank's ``[start, stop)`` and the number of columns),
    X is this rank's column block: y and the weights must be the same.
    Returns the data's fingerprint (:func:`data_fingerprint`), equal on
    every rank.
    """
    reduction = None if columns is None else GroupReduction(group, *columns)
    fingerprint = torch.as_tensor(data_fingerprint(X, target, sample_weight, reduction))
    both = torch.cat([fingerprint, -fingerprint])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    largest, smallest = both[: len(fingerprint)], -both[len(fingerprint) :]
    spread = (largest - smallest).abs()
    differs = spread > 1e-9 * torch.maximum(largest.abs(), smallest.abs()) + 1e-12
    if bool(differs.any()):
        names = [
            name for name, bad in zip(_FINGERPRINT_NAMES, differs.tolist(), strict=True) if bad
        ]
        raise ValueError(
            "n_devices='world' needs every rank to call fit with the same X, y and "
            f"sample_weight, but the ranks differ in: {', '.join(names)} (this rank: "
            f"n_samples={X.shape[0]}, n_features={fingerprint[1]:.0f})."
        )
    return fingerprint.numpy()


def local_cuda_device(env: Mapping[str, str], rank: int, device_count: int) -> torch.device:
    """This rank's GPU in a ``"world"`` fit: its local rank on the node.

    ``LOCAL_RANK`` (torchrun) or ``SLURM_LOCALID``; with one visible device
    (a GPU per task) that device. Without either, the global rank, which is
    right on one node only, so it must name a visible device.
    """
    if device_count == 1:
        return torch.device("cuda", 0)
    local = env.get("LOCAL_RANK", env.get("SLURM_LOCALID"))
    where = "LOCAL_RANK" if "LOCAL_RANK" in env else "SLURM_LOCALID"
    if local is None:
        local, where = str(rank), "the global rank (neither LOCAL_RANK nor SLURM_LOCALID is set)"
    index = int(local)
    if not 0 <= index < device_count:
        raise ValueError(
            f"This rank would use CUDA device {index} ({where}), but {device_count} are "
            "visible: run one rank per GPU and set LOCAL_RANK (torchrun does), or make one "
            "GPU visible per rank (CUDA_VISIBLE_DEVICES)."
        )
    return torch.device("cuda", index)


def device_key(device: torch.device) -> int:
    """A 62-bit key of this host and device: equal keys on two ranks mean one shared device."""
    name = socket.gethostname()
    if device.type == "cuda":
        name += "/" + str(torch.cuda.get_device_properties(device).uuid)
    else:
        return 0  # CPU ranks may share the host's cores
    return _key62(name.encode())


def _key62(data: bytes) -> int:
    """A 62-bit digest of ``data``: a non-negative int64 that travels in an all-reduce."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def check_job(
    X: np.ndarray,
    target: np.ndarray,
    sample_weight: np.ndarray,
    group: dist.ProcessGroup,
    device: torch.device,
    timeout: float,
    columns: tuple[tuple[int, int], int] | None = None,
) -> None:
    """Raise ``ValueError`` on every rank unless the ranks hold the same data on distinct devices.

    The checks' few numbers travel on the CPU over gloo: the fit's own group
    on the CPU, and a gloo group made for them on CUDA. NCCL cannot carry
    them, because two ranks on one GPU fail inside NCCL's first collective
    ("invalid usage", seen on an H200 with NCCL 2.28) before the check could
    name the problem. ``columns``: X is this rank's column block, whose
    rows the estimator compared before planning (:func:`check_same_data`).
    """
    checks = group
    if device.type == "cuda":
        checks = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    try:
        check_distinct_devices(checks, device)
        if columns is None:
            check_same_data(X, target, sample_weight, checks)
    finally:
        if checks is not group:
            dist.destroy_process_group(checks)


def check_distinct_devices(group: dist.ProcessGroup, device: torch.device) -> None:
    """Raise ``ValueError`` on every rank when two ranks of a CUDA fit share one GPU.

    Two ranks on one GPU would each assume the whole device (and NCCL
    refuses); the keys travel as integers on the CPU, never pickled.
    """
    if device.type != "cuda":
        return
    world_size = dist.get_world_size(group)
    keys = torch.zeros(world_size, dtype=torch.int64)
    keys[dist.get_rank(group)] = device_key(device)
    dist.all_reduce(keys, group=group)
    shared = duplicate_ranks(keys.tolist())
    if shared:
        raise ValueError(
            f"Ranks {shared} of this job use the same GPU; a 'world' fit needs one GPU per "
            "rank: set LOCAL_RANK per rank (torchrun does) or CUDA_VISIBLE_DEVICES."
        )


def duplicate_ranks(keys: list[int]) -> list[int]:
    """Ranks whose key another rank has too (sorted)."""
    counts = Counter(keys)
    return [rank for rank, key in enumerate(keys) if counts[key] > 1]


def fit_world(
    plan: FitPlan,
    X: np.ndarray,
    target: np.ndarray,
    sample_weight: np.ndarray,
    timeout: float,
    columns: tuple[tuple[int, int], int] | None = None,
) -> BlockResult:
    """Fit across every rank of the job; each rank ends with the full weights.

    ``columns`` (this rank's ``[start, stop)`` and the number of columns):
    X is this rank's column block (:func:`open_column_blocks`), else all of X.
    """
    device = torch.device(plan.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    _ensure_default_group(backend, timeout)
    if device.type == "cuda":
        device = local_cuda_device(os.environ, dist.get_rank(), torch.cuda.device_count())
        torch.cuda.set_device(device)
    # A group of the fit's own: the user's default group is never used or destroyed.
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout))
    try:
        check_job(X, target, sample_weight, group, device, timeout, columns)
        # The job's ranks on this machine: torchrun says how many; else every rank counts.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or dist.get_world_size(group))
        yields = ranks_yield(local_ranks)
        comm = TorchCommunicator(group, device, timedelta(seconds=timeout), yields)
        if columns is None:
            n_features = X.shape[1]
            start, stop = column_blocks(n_features, comm.world_size)[comm.rank]
            X = X[:, start:stop] if sp.issparse(X) else np.ascontiguousarray(X[:, start:stop])
        else:
            (start, stop), n_features = columns
        preconditioning = plan.stored_preconditioning(start, stop)
        X_block = as_storage(X, device, plan.policy.x_storage, *preconditioning)
        del X
        result = fit_block(plan, X_block, target, sample_weight, (start, stop), comm)
        full = torch.zeros((n_features, result.coef.shape[1]), dtype=torch.float64, device=device)
        full[start:stop] = torch.from_numpy(result.coef).to(device)
        comm.all_reduce(full)
        result = replace(
            result,
            coef=full.cpu().numpy(),
            n_allreduce=comm.n_allreduce,
            allreduce_bytes=comm.allreduce_bytes,
            allreduce_seconds=comm.allreduce_seconds,
        )
    finally:
        dist.destroy_process_group(group)
    return result


class GroupReduction:
    """:class:`~sklearn_casgd._engine.reduction.ColumnReduction` over a gloo group.

    Every rank holds columns ``columns`` of ``n_features``; values travel
    as float64 on the CPU.
    """

    def __init__(self, group: dist.ProcessGroup, columns: tuple[int, int], n_features: int) -> None:
        self.group = group
        self.columns = columns
        self.n_features = n_features

    def sum(self, values: np.ndarray) -> np.ndarray:
        summed = torch.tensor(np.asarray(values, dtype=np.float64))
        dist.all_reduce(summed, group=self.group)
        return summed.numpy()

    def max(self, value: float) -> float:
        largest = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
        return float(largest[0])

    def gather_columns(self, local: np.ndarray) -> np.ndarray:
        whole = np.zeros((*local.shape[:-1], self.n_features))
        whole[..., self.columns[0] : self.columns[1]] = local
        return self.sum(whole)


@contextmanager
def column_reduction(
    columns: tuple[tuple[int, int], int], timeout: float
) -> Iterator[GroupReduction]:
    """A :class:`GroupReduction` over a gloo group of the job's ranks, for this block."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    try:
        yield GroupReduction(group, *columns)
    finally:
        dist.destroy_process_group(group)


@dataclass(frozen=True)
class OpenedBlock:
    """This rank's column block, loaded and checked against the other ranks'."""

    X: np.ndarray | sp.csr_matrix
    columns: tuple[int, int]  # its columns [start, stop) of X
    n_features: int  # X's columns, every rank's together


# A rank's block as the other ranks learn of it: its problem (0: none, else
# 1 + an index of PROBLEMS), its columns, its dtype (0 float32, 1 float64),
# whether it is sparse, and a digest of the y it was passed.
_BLOCK_FIELDS = 5


def open_column_blocks(
    blocks: ColumnBlocks, y: np.ndarray, device: torch.device, timeout: float
) -> OpenedBlock:
    """Load this rank's block of ``blocks`` and check, with every rank, that the blocks fit.

    Every rank raises the same ``ValueError`` (naming each rank whose block
    is wrong, and its source) when a block is missing, unreadable, not
    finite, of another number of rows than ``y``, of a dtype or format
    other than the rest, when the ranks pass different y, or when the
    blocks' widths are not the
    engine's partition of their columns (:func:`~.._engine.fit.column_blocks`:
    a block overlapping the next, or one short of columns).
    """
    _ensure_default_group("nccl" if device.type == "cuda" else "gloo", timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    n_samples = y.shape[0]
    block, error = None, None
    try:
        block = blocks.load(rank, world_size, n_rows=n_samples)
        if block.shape[0] != n_samples:
            raise ColumnBlockError(
                f"rank {rank}'s column block ({blocks.source(rank)}) has {block.shape[0]} rows "
                f"where y has {n_samples}.",
                3,
            )
    except ColumnBlockError as raised:
        block, error = None, raised
    except Exception as raised:  # whatever else: the other ranks must not wait for this one
        block = None
        error = ColumnBlockError(
            f"rank {rank}'s column block ({blocks.source(rank)}): {raised!r}", 0
        )
    table = torch.zeros((world_size, _BLOCK_FIELDS), dtype=torch.int64)
    if block is None:
        table[rank] = torch.tensor([error.problem + 1, 0, 0, 0, _digest(y)])
    else:
        table[rank] = torch.tensor(
            [0, block.shape[1], int(block.dtype == np.float64), int(sp.issparse(block)), _digest(y)]
        )
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    try:
        dist.all_reduce(table, group=group)
    finally:
        dist.destroy_process_group(group)
    problems, widths, doubles, sparse, digests = (table[:, f].tolist() for f in range(5))
    failed = [r for r in range(world_size) if problems[r]]
    if failed:
        named = [f"rank {r} ({blocks.source(r)}): it {PROBLEMS[problems[r] - 1]}" for r in failed]
        detail = "" if error is None else f" This rank: {error}"
        raise ValueError("Wrong column blocks: " + "; ".join(named) + "." + detail)
    if len(set(digests)) > 1:
        raise ValueError(
            "ColumnBlocks need every rank to pass the same y, but ranks "
            f"{[r for r in range(world_size) if digests[r] != digests[rank]]} passed another y "
            f"than rank {rank}."
        )
    n_features = sum(widths)
    expected = [stop - start for start, stop in column_blocks(n_features, world_size)]
    wrong = [r for r in range(world_size) if widths[r] != expected[r]]
    if wrong:
        raise ValueError(
            f"The column blocks do not tile X's {n_features} columns as the engine splits them "
            f"over {world_size} ranks (rank r holds {n_features // world_size} columns, the "
            f"first {n_features % world_size} ranks one more): "
            + "; ".join(
                f"rank {r} ({blocks.source(r)}) has {widths[r]} columns where "
                f"{expected[r]} are expected"
                for r in wrong
            )
            + ". A block overlapping its neighbour or missing columns shows this way."
        )
    for name, values in (("dtype (float32 or float64)", doubles), ("format", sparse)):
        if len(set(values)) > 1:
            raise ValueError(
                f"The column blocks differ in {name}: "
                + ", ".join(
                    f"rank {r} {_describe(doubles[r], sparse[r])}" for r in range(world_size)
                )
                + ". Give every rank a block of one dtype and format."
            )
    return OpenedBlock(block, column_blocks(n_features, world_size)[rank], n_features)


def _digest(y: np.ndarray) -> int:
    """A 62-bit digest of y's values (labels of any type, or numbers)."""
    y = np.asarray(y)
    data = y.tobytes() if y.dtype.kind in "biufcUS" else repr(y.tolist()).encode()
    return _key62(data + str(y.shape).encode())


def _describe(double: int, sparse: int) -> str:
    return ("float64" if double else "float32") + (" sparse" if sparse else " dense")
