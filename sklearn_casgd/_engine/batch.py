"""An outer iteration's rows gathered, with the part that needs no weights done.

:func:`gather_outer_batch` gathers the rows of s batches and forms their
strictly lower Gram blocks into the outer iteration's one all-reduce
buffer (none where the steps run from the rows): nothing here reads the
weights, so it runs while the previous outer iteration's collective is in
flight.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._data.storage import CSRMatrix, SparseRows
from .precision import gram_block, gram_operand_dtype
from .state import LocalData, StepContext, precondition_rows, take_rows


def batch_offsets(sizes: Sequence[int]) -> list[int]:
    """Start of every batch in the stacked rows, and the total at the end."""
    return list(itertools.accumulate(sizes, initial=0))


@dataclass
class OuterBatch:
    """The rows of one outer iteration with the part that needs no weights done.

    ``packed`` is the outer iteration's one all-reduce buffer: the strictly
    lower Gram blocks ``G_{j,<j}`` row-block by row-block, already formed,
    then room for the margins from ``margin_start`` on (with row steps there
    is no Gram: ``margin_start`` is 0). ``Y`` holds the rows in the update
    dtype (the Gram's operand when the dtypes agree, so Y is upcast once);
    with a :class:`.state.RowExchange`, this rank's as sent (Gram input dtype).
    With a snapshot the margins have ``2k`` columns (``Y w`` then ``Y mu``)
    and ``snapshot_gradient`` holds the rows' ``dl/dz(z~)``. With a
    :class:`.state.RowExchange`, ``rows_full`` holds every rank's columns of the
    rows once they are gathered (recurrence dtype), and the rank forms the
    margins in ``packed`` from them and its replica of the weights: nothing
    of ``packed`` is exchanged.
    """

    sizes: list[int]
    Y: torch.Tensor | SparseRows
    target: torch.Tensor
    sample_weight: torch.Tensor
    packed: torch.Tensor
    margin_start: int
    snapshot_gradient: torch.Tensor | None = None
    send: torch.Tensor | None = None  # with a RowExchange: this rank's columns to all-gather
    rows_full: torch.Tensor | None = None  # with a RowExchange: every rank's columns

    def step_rows(self) -> torch.Tensor | SparseRows:
        """The rows the inner steps read: every column's after a gather, else ``Y``."""
        return self.Y if self.send is None else self.rows_full


@dataclass(frozen=True)
class GatherSpec:
    """What is fixed about gathering an outer iteration's rows (see :func:`gather_rows`)."""

    sizes: tuple[int, ...]
    margin_columns: int  # k, or 2k with a snapshot (``Y w`` and ``Y mu``)
    comm_dtype: torch.dtype
    gram_input: torch.dtype  # the Gram's rounding of the rows
    gram_operand: torch.dtype  # the dtype the GEMM reads them in (see gram_operand_dtype)
    gram_accumulate: torch.dtype
    update_accumulate: torch.dtype
    row_steps: bool = False  # the steps run from the rows: no Gram is formed
    # The rows are all-gathered (RowExchange): the steps read every rank's,
    # so this rank's are only sent, in the Gram input dtype.
    exchanged: bool = False

    @property
    def margin_start(self) -> int:
        """Where the margins start in ``packed``: after the Gram blocks, if any."""
        return 0 if self.row_steps else gram_numel(self.sizes)


def gather_outer_batch(
    ctx: StepContext, data: LocalData, rows: torch.Tensor, sizes: Sequence[int]
) -> OuterBatch:
    """Gather ``rows`` (``sizes[j]`` of them form batch j) and form their Gram blocks.

    Nothing here reads the weights, so it can run while the previous outer
    iteration's all-reduce is in flight.
    """
    policy = ctx.policy
    k = data.target.shape[1]
    spec = GatherSpec(
        tuple(sizes),
        k * (1 if data.snapshot is None else 2),
        policy.comm_dtype,
        policy.gram_input,
        gram_operand_dtype(policy, data.X.device),
        policy.gram_accumulate,
        policy.update_accumulate,
        row_steps=ctx.row_steps,
        exchanged=ctx.exchange is not None,
    )
    if isinstance(data.X, CSRMatrix):
        return _gather_sparse(ctx, data, rows, spec)
    scaling = ctx.row_scaling
    packed, Y, target, weight, snapshot_gradient, Y_input = gather_rows(
        spec,
        data.X,
        rows,
        data.target,
        data.sample_weight,
        None if data.snapshot is None else data.snapshot.gradient,
        None if scaling is None else scaling.center,
        None if scaling is None else scaling.scale,
    )
    return OuterBatch(
        sizes=list(sizes),
        Y=Y,
        target=target,
        sample_weight=weight,
        packed=packed,
        margin_start=spec.margin_start,
        snapshot_gradient=snapshot_gradient,
        send=None if ctx.exchange is None else _send_buffer(ctx, Y_input),
    )


def _gather_sparse(
    ctx: StepContext, data: LocalData, rows: torch.Tensor, spec: GatherSpec
) -> OuterBatch:
    """:func:`gather_outer_batch` for a sparse X: the rows stay sparse, the Gram is dense.

    Eager only (torch.compile does not take sparse tensors), and always
    with the Gram all-reduce (rows are not all-gathered) and the Gram steps.
    """
    if spec.row_steps:
        raise ValueError("Sparse rows run the steps from their Gram: row_steps=False.")
    Y = data.X.gather(rows, spec.update_accumulate, ctx.centering)
    margin_start = spec.margin_start
    packed = torch.empty(
        margin_start + Y.n_rows * spec.margin_columns, dtype=spec.comm_dtype, device=data.X.device
    )
    gram = Y.gram(spec.gram_input, spec.gram_accumulate)
    for lo, hi, block in _gram_slots(spec.sizes, packed):
        block.copy_(gram[lo:hi, :lo])
    snapshot = data.snapshot
    return OuterBatch(
        sizes=list(spec.sizes),
        Y=Y,
        target=take_rows(data.target, rows),
        sample_weight=data.sample_weight.index_select(0, rows),
        packed=packed,
        margin_start=margin_start,
        snapshot_gradient=None if snapshot is None else take_rows(snapshot.gradient, rows),
    )


def _send_buffer(ctx: StepContext, Y_input: torch.Tensor) -> torch.Tensor:
    """This rank's all-gather part: its columns of the rows, padded to the widest block."""
    padded = ctx.exchange.padded_width
    if Y_input.shape[1] == padded and Y_input.is_contiguous():
        return Y_input
    send = Y_input.new_empty((Y_input.shape[0], padded))
    send[:, : Y_input.shape[1]] = Y_input
    send[:, Y_input.shape[1] :] = 0
    return send


def _gram_slots(sizes: Sequence[int], packed: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """Where ``packed`` holds each strictly lower Gram block ``G_{j,<j}``, row-block by row-block.

    ``(lo, hi, block)`` per batch j >= 1: rows ``lo:hi`` against rows ``:lo``,
    ``block`` the ``(hi - lo, lo)`` view of ``packed`` to write them to.
    """
    offsets = batch_offsets(sizes)
    slots, start = [], 0
    for j in range(1, len(sizes)):
        lo, hi = offsets[j], offsets[j + 1]
        slots.append((lo, hi, packed[start : start + (hi - lo) * lo].view(hi - lo, lo)))
        start += (hi - lo) * lo
    return slots


def _write_gram_blocks(
    Y_gram: torch.Tensor, sizes: Sequence[int], accumulate: torch.dtype, packed: torch.Tensor
) -> None:
    """The strictly lower Gram blocks of ``Y_gram``, row-block by row-block, into ``packed``."""
    for lo, hi, block in _gram_slots(sizes, packed):
        gram_block(Y_gram[lo:hi], Y_gram[:lo], accumulate, block)


def gather_rows(
    spec: GatherSpec,
    X: torch.Tensor,
    rows: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor,
    snapshot_gradient: torch.Tensor | None,
    center: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """The tensors of one outer iteration: ``packed`` with its Gram blocks, Y and the row data.

    The last is the rows rounded to the Gram input dtype (what a
    :class:`.state.RowExchange` sends).

    ``packed`` holds the strictly lower Gram blocks ``G_{j,<j}`` row-block by
    row-block, written in place (none with ``spec.row_steps``), then room
    for the margins. With ``center``
    and ``scale`` the rows are preconditioned (:meth:`.state.StepContext.rows`).
    Static shapes and no host synchronization, like :func:`.recurrence.inner_steps`,
    but it runs eager even when the steps are compiled: its time is the
    Gram GEMMs, and inductor writes them to temporaries that it then copies
    into ``packed`` (1.6x slower than eager on the CPU at s=16, b=32, d=128).
    """
    sizes = spec.sizes
    offsets = batch_offsets(sizes)
    margin_start = spec.margin_start
    packed = torch.empty(
        margin_start + offsets[-1] * spec.margin_columns, dtype=spec.comm_dtype, device=X.device
    )
    Y = X.index_select(0, rows)
    if scale is not None:  # the gathered rows are a copy: scaled in place where dtypes allow
        Y = precondition_rows(Y, center, scale, spec.gram_input, out=Y)
    Y_input = Y.to(spec.gram_input)
    if spec.exchanged:  # no Gram, and the margins and steps read every rank's rows
        Y_update = Y_input
    else:
        Y_gram = Y_input.to(spec.gram_operand)
        if not spec.row_steps:
            _write_gram_blocks(Y_gram, sizes, spec.gram_accumulate, packed)
        acc = spec.update_accumulate
        # The margins and the update read the rows the Gram was formed from.
        Y_update = Y_gram if Y_gram.dtype == acc else Y_input.to(acc)
    return (
        packed,
        Y_update,
        take_rows(target, rows),
        weight.index_select(0, rows),
        None if snapshot_gradient is None else take_rows(snapshot_gradient, rows),
        Y_input,
    )


def gram_numel(sizes: Sequence[int]) -> int:
    """Values of the strictly lower Gram blocks of an outer iteration with these batch sizes."""
    offsets = batch_offsets(sizes)
    return sum((offsets[j + 1] - offsets[j]) * offsets[j] for j in range(1, len(sizes)))
