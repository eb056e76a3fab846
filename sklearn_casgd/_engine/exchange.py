"""The row exchange: all-gather an outer iteration's rows instead of reducing its Gram.

:func:`prefer_row_exchange` decides by the bytes each way (the cost
model's constants below); :func:`start_row_exchange` sends the rows of
the next outer iterations while this one's steps run, and
:func:`replicate_weights` keeps every rank's replica of the weights
current once an epoch (see :class:`.state.RowExchange`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from .batch import OuterBatch, gram_numel
from .comm import Communicator, PendingReduce
from .precision import PrecisionPolicy
from .state import ModelState, RowExchange, Snapshot, StepContext

# Gram flops that take as long as one byte exchanged, by device type: the
# price of the Gram a rank forms for the all-reduce, while the previous
# collective is in flight (docs/tuning.md: where it was measured).
GRAM_FLOPS_PER_BYTE = {"cpu": 64.0, "cuda": 4096.0}

# What waiting for an all-reduce costs an outer iteration, in bytes
# exchanged, by device type: the all-reduce waits every outer iteration (for
# its latency and for the other ranks), the rows' all-gather (started ahead)
# does not. 0 lets bytes decide (docs/tuning.md).
LATENCY_BYTES = {"cpu": 200_000.0, "cuda": 0.0}

# The bytes one all-gather of rows carries at least, where an outer
# iteration's rows are fewer: the rows of several outer iterations travel
# together, so that an exchange's fixed cost stays a small part of it
# (docs/tuning.md); the pending rows (two such all-gathers, and their
# float32 copies) stay a few MiB.
GATHER_BYTES = 1 << 20


def outer_per_exchange(exchange: RowExchange, rows: int, dtype: torch.dtype) -> int:
    """Outer iterations of ``rows`` rows whose rows one all-gather carries (at least 1)."""
    gathered = len(exchange.widths) * rows * exchange.padded_width * dtype.itemsize
    return max(1, GATHER_BYTES // max(gathered, 1))


def prefer_row_exchange(
    sizes: Sequence[int],
    widths: Sequence[int],
    margin_columns: int,
    policy: PrecisionPolicy,
    device_type: str,
) -> bool:
    """Whether gathering the rows costs clearly less than reducing the Gram.

    Bytes each rank receives: a ring all-reduce of the Gram and margins
    (``margin_columns`` of them per row) moves ``2 (P - 1) / P`` times their
    size, an all-gather ``P - 1`` times one rank's rows. The all-reduce also
    has each rank form its Gram blocks (``s^2 b^2 d_local`` flops) while the
    previous collective is in flight, and then waits for its collective: it
    costs the larger of its bytes and that Gram, priced at
    :data:`GRAM_FLOPS_PER_BYTE` of the device, plus the latency
    (:data:`LATENCY_BYTES`). The all-gather needs no weights and is in
    flight while the previous outer iteration's steps run: it costs its
    bytes, twice (the rows assembled and stepped on, every rank the same).
    The rows are gathered where that is no more than the all-reduce: small
    column blocks, large ``s * b``, and on the CPU every shape up to some
    thousand columns. On the CPU, 2 gloo ranks, b=32, s=2-32: d=256 and
    d=1024 gathered 1.3-7.2x faster, d=4096 reduced up to 1.1x faster
    (``docs/distributed.md``).
    """
    world_size = len(widths)
    if world_size == 1:
        return False
    rows = sum(sizes)
    gram_values = gram_numel(sizes)
    reduce_bytes = (
        2
        * (world_size - 1)
        / world_size
        * policy.comm_dtype.itemsize
        * (gram_values + rows * margin_columns)
    )
    gram_flops = 2.0 * gram_values * max(widths)
    reduce_cost = LATENCY_BYTES.get(device_type, LATENCY_BYTES["cpu"]) + max(
        reduce_bytes,
        gram_flops / GRAM_FLOPS_PER_BYTE.get(device_type, GRAM_FLOPS_PER_BYTE["cpu"]),
    )
    gather_bytes = (world_size - 1) * rows * max(widths) * policy.gram_input.itemsize
    return 2 * gather_bytes <= reduce_cost


def _join_blocks(
    gathered: torch.Tensor, widths: Sequence[int], dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """The ranks' column blocks of an all-gather, unpadded and joined along ``dim``, in ``dtype``.

    ``gathered[r]`` is rank r's block, padded along ``dim`` to the widest.
    """
    shape = list(gathered.shape[1:])
    shape[dim] = sum(widths)
    joined = gathered.new_empty(shape, dtype=dtype)
    start = 0
    for part, width in zip(gathered, widths, strict=True):
        joined.narrow(dim, start, width).copy_(part.narrow(dim, 0, width))
        start += width
    return joined


def gather_blocks(
    comm: Communicator, widths: Sequence[int], local: torch.Tensor, dim: int
) -> torch.Tensor:
    """Every rank's block of ``local`` (``widths[r]`` along ``dim``) joined along ``dim``.

    One all-gather; the blocks travel padded to the widest.
    """
    shape = list(local.shape)
    shape[dim] = max(widths)
    send = local.new_zeros(shape)
    send.narrow(dim, 0, local.shape[dim]).copy_(local)
    gathered = send.new_empty((len(widths), *shape))
    comm.start_all_gather(gathered.view(-1), send.view(-1)).wait()
    return _join_blocks(gathered, widths, dim, gathered.dtype)


class _PendingRows:
    """Batches' rows on their way from every rank; ``wait()`` puts them in their ``rows_full``."""

    def __init__(self, ctx: StepContext, batches: Sequence[OuterBatch]) -> None:
        self._ctx, self._batches = ctx, batches
        send = batches[0].send if len(batches) == 1 else torch.cat([b.send for b in batches])
        self._gathered = send.new_empty((ctx.comm.world_size, *send.shape))
        self._pending = ctx.comm.start_all_gather(self._gathered.view(-1), send.view(-1))

    def wait(self) -> None:
        self._pending.wait()
        ctx = self._ctx
        rows_full = _join_blocks(self._gathered, ctx.exchange.widths, 1, ctx.policy.recurrence)
        start = 0
        for batch in self._batches:
            rows = sum(batch.sizes)
            batch.rows_full = rows_full[start : start + rows]
            start += rows


def start_row_exchange(ctx: StepContext, batches: Sequence[OuterBatch]) -> PendingReduce:
    """Start all-gathering the rows of ``batches`` (a row exchange) in one collective.

    ``wait()`` assembles every batch's ``rows_full``. The rows need no
    weights: the engine starts the next batches' exchange before these
    batches' steps, which then run while it is in flight.
    """
    return _PendingRows(ctx, batches)


def replicate_weights(
    ctx: StepContext, state: ModelState, snapshot: Snapshot | None
) -> Snapshot | None:
    """Copy every rank's weights (and SVRG's ``mu``) into the replicas; the snapshot back.

    One all-gather of the ranks' own rows of ``coef`` (and ``mean_gradient``)
    at the start of an epoch: whatever changed a rank's own weights since
    (an epoch undone, a warm start, a resumed fit) reaches every replica.
    The snapshot comes back with ``replica_mean_gradient`` set.
    """
    k = state.coef.shape[1]
    parts = [state.coef] if snapshot is None else [state.coef, snapshot.mean_gradient]
    every = gather_blocks(ctx.comm, ctx.exchange.widths, torch.cat(parts, dim=1), 0)
    state.replica.copy_(every[:, :k])
    if snapshot is None:
        return None
    return replace(snapshot, replica_mean_gradient=every[:, k:].contiguous())
