"""One device's epoch of minibatch steps as one launch: Triton for dense rows, numba for CSR.

The launch is :func:`.._accel.triton.epoch_steps` for dense rows and
:func:`.._accel.sparse_steps.epoch_steps` for sparse rows on the CPU.

On one device the s-step algebra buys nothing (with s an epoch, the row
recurrence is plain SGD); what pays on a GPU is keeping the weights on the
chip across the steps instead of launching a few kernels a step. The
epoch kernel takes the epoch's plain steps, exactly as
:func:`.recurrence.sgd_step` takes them one at a time (the s-step iterates
in exact arithmetic), gathering each step's rows of X itself. On sparse
rows what pays is touching only the batch's nonzero columns: the L2 decay
and SVRG's dense control variate cost O(1) a step there, not O(d).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._accel import sparse_steps
from .._accel.triton import available, epoch_steps, epoch_supports
from .._data.storage import CSRMatrix
from .state import LocalData, ModelState, StepContext


def covers(ctx: StepContext, X: torch.Tensor | CSRMatrix, batch_size: int, n_outputs: int) -> bool:
    """Whether the epoch kernel can run this fit's steps on X's device.

    One rank's dense rows, a covered family and a bounded tile, and triton
    there (CPU tensors: only in its interpreter); or one rank's CSR rows on
    the CPU, a covered family, and numba. With an L1 part's proximal
    step, only CSR rows read as stored (no preconditioner); no averaged SGD.
    """
    if ctx.averaged:  # the kernels do not sum the iterates
        return False
    if ctx.penalty.proximal and (not isinstance(X, CSRMatrix) or ctx.preconditioner is not None):
        return False
    if isinstance(X, CSRMatrix):
        return (
            ctx.comm.world_size == 1
            and not ctx.newton
            and sparse_steps.available()
            and sparse_steps.supports(ctx.family, X)
        )
    return (
        ctx.comm.world_size == 1
        and not ctx.newton
        and not isinstance(X, CSRMatrix)
        and X.shape[0] > 0
        and available(X.device.type)
        and epoch_supports(ctx.family, batch_size, n_outputs, X.shape[1])
    )


def run_epoch(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    order: torch.Tensor,
    etas: Sequence[float],
    batch_size: int,
    with_loss: bool,
) -> torch.Tensor | None:
    """The steps over the rows ``order`` (batches of ``batch_size``, a ragged last) at ``etas``.

    Updates ``state`` in place; returns the weighted loss sum of the steps
    (``with_loss``), else None. SVRG's steps take the snapshot in
    ``data.snapshot`` as their control variate.
    """
    snapshot = data.snapshot
    if isinstance(data.X, CSRMatrix):
        return sparse_steps.epoch_steps(
            ctx.family,
            data.X,
            order,
            data.target,
            data.sample_weight,
            state.coef,
            state.intercept,
            etas,
            batch_size,
            ctx.decay_alpha,
            ctx.fit_intercept,
            ctx.centering,
            snapshot_gradient=None if snapshot is None else snapshot.gradient,
            mean_gradient=None if snapshot is None else snapshot.mean_gradient,
            mean_gradient_intercept=None if snapshot is None else snapshot.mean_gradient_intercept,
            with_loss=with_loss,
            l1=ctx.penalty.l1,
        )
    policy = ctx.policy
    scaling = ctx.row_scaling
    coef = state.coef if state.coef.is_contiguous() else state.coef.contiguous()
    intercept = state.intercept if state.intercept.is_contiguous() else state.intercept.contiguous()
    loss = epoch_steps(
        ctx.family,
        data.X,
        order,
        data.target,
        data.sample_weight,
        coef,
        intercept,
        etas,
        batch_size,
        ctx.decay_alpha,
        ctx.fit_intercept,
        center=None if scaling is None else scaling.center,
        scale=None if scaling is None else scaling.scale,
        rows_dtype=policy.gram_input,
        margin_dtype=policy.margin_storage,
        snapshot_gradient=None if snapshot is None else snapshot.gradient,
        mean_gradient=None if snapshot is None else snapshot.mean_gradient,
        mean_gradient_intercept=None if snapshot is None else snapshot.mean_gradient_intercept,
        with_loss=with_loss,
    )
    if coef is not state.coef:
        state.coef.copy_(coef)
    if intercept is not state.intercept:
        state.intercept.copy_(intercept)
    return loss
