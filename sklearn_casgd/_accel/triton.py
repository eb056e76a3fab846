"""The row steps' recurrence as one Triton kernel: the s steps of an outer iteration in one launch.

:func:`.._engine.recurrence.inner_steps` runs the row steps as ~8 torch operations a
step (two products, the family's gradient, the running ``v`` and ``a``):
on a GPU that is ~8 s kernel launches per outer iteration, each with a few
microseconds of work. Here one program walks the s steps with ``v`` and
``a`` in registers:

    raw_j = M_j - C_j Y_j v - a,   U_j = factor_j (dl/dz(raw_j) - snapshot_j),
    v += Y_j^T U_j,                a += C_{j+1} sum(U_j).

It covers one output column (every family but the multinomial), batches
of one size and a ``b x d`` tile of at most :data:`MAX_TILE` values; the
torch steps run the rest. triton is optional and imported only when the
kernel first runs (the kernel itself is in :mod:`.triton_kernel`). On
CUDA tensors it is compiled. On CPU tensors it runs only in Triton's
interpreter, which ``TRITON_INTERPRET=1`` turns on before triton is first
imported, far slower than the torch steps: that is how the tests hold it
to the torch steps in float64 without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._glm.families import _SOFTPLUS_THRESHOLD, KERNEL_MULTINOMIAL, Family

# Largest b x d tile (b x d x k for the epoch kernel; rounded up to powers of
# two) one program holds.
MAX_TILE = 1 << 16

# The kernels' codes for a narrower dtype that rows or margins are rounded to.
_ROUNDING = {torch.bfloat16: 1, torch.float16: 2}


def family_code(family: Family) -> tuple[int, float] | None:
    """The kernels' code for ``family`` and its Tweedie power; None if not covered.

    The multinomial is covered by the epoch kernel and the fused pass only.
    """
    if family.kernel_code is None:
        return None
    return family.kernel_code, float(family.kernel_power)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device_type: str) -> bool:
    """Whether the kernel can run on tensors of this device type (CPU: interpreted)."""
    if not _triton_installed():
        return False
    return device_type == "cuda" or (device_type == "cpu" and interpreted())


def supports(family: Family, sizes: Sequence[int], n_outputs: int, width: int) -> bool:
    """Whether an outer iteration of this shape and family fits the kernel."""
    code = family_code(family)
    if n_outputs != 1 or code is None or code[0] == KERNEL_MULTINOMIAL or len(set(sizes)) != 1:
        return False
    return _pow2(sizes[0]) * _pow2(width) <= MAX_TILE


def epoch_supports(family: Family, batch_size: int, n_outputs: int, width: int) -> bool:
    """Whether the epoch kernel runs steps of this batch size, width and family."""
    if family_code(family) is None:
        return False
    return _pow2(batch_size) * _pow2(width) * _pow2(n_outputs) <= MAX_TILE


def warps_for(batch_size: int, width: int) -> int:
    """Warps of the kernel's one program: about 32 values of the ``b x d`` tile per thread.

    One program walks the steps, so the more threads share each step's
    tile, the shorter the step (``docs/tuning.md``, "Compiling and
    fusing"; ``benchmarks/bench_gpu.py`` "kernel" times each warp count).
    """
    return min(32, max(4, _pow2(batch_size) * _pow2(width) // 1024))


def _pow2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def row_recurrence(
    family: Family,
    Y: torch.Tensor,
    M: torch.Tensor,
    target: torch.Tensor,
    factor: torch.Tensor,
    snapshot_gradient: torch.Tensor | None,
    coefficients: torch.Tensor,
    batch_size: int,
    fit_intercept: bool,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U, raw, v)`` of the s row steps, from one kernel launch.

    ``Y`` is ``(s b, d)`` and ``M``, ``target``, ``factor`` and
    ``snapshot_gradient`` are ``(s b, 1)``, all in the recurrence dtype;
    ``coefficients`` is :func:`.._engine.recurrence.step_coefficients`'s tensor (row 1
    holds ``C_{j+1}``, row 2 ``C_j``). ``num_warps`` overrides
    :func:`warps_for` (benchmarks).
    """
    code, power = family_code(family)
    rows, width = Y.shape
    n_steps = rows // batch_size
    dtype, device = Y.dtype, Y.device
    U = torch.empty(rows, dtype=dtype, device=device)
    raw = torch.empty(rows, dtype=dtype, device=device)
    v = torch.empty(width, dtype=dtype, device=device)
    # Without a snapshot the kernel reads none: any pointer will do.
    snapshot = M if snapshot_gradient is None else snapshot_gradient.reshape(rows)
    from .triton_kernel import row_steps  # imports triton, on the first launch only

    row_steps[(1,)](
        Y.contiguous(),
        M.reshape(rows).contiguous(),
        target.reshape(rows).contiguous(),
        factor.reshape(rows).contiguous(),
        snapshot.contiguous(),
        coefficients[1].contiguous(),
        coefficients[2].contiguous(),
        U,
        raw,
        v,
        n_steps,
        batch_size,
        width,
        FAMILY=code,
        POWER=power,
        HAS_SNAPSHOT=snapshot_gradient is not None,
        FIT_INTERCEPT=fit_intercept,
        BLOCK_B=_pow2(batch_size),
        BLOCK_D=_pow2(width),
        num_warps=warps_for(batch_size, width) if num_warps is None else num_warps,
    )
    return U[:, None], raw[:, None], v[:, None]


def epoch_steps(
    family: Family,
    X: torch.Tensor,
    order: torch.Tensor,
    target: torch.Tensor,
    sample_weight: torch.Tensor,
    coef: torch.Tensor,
    intercept: torch.Tensor,
    etas: Sequence[float],
    batch_size: int,
    decay_alpha: float,
    fit_intercept: bool,
    *,
    center: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    rows_dtype: torch.dtype | None = None,
    margin_dtype: torch.dtype | None = None,
    snapshot_gradient: torch.Tensor | None = None,
    mean_gradient: torch.Tensor | None = None,
    mean_gradient_intercept: torch.Tensor | None = None,
    with_loss: bool = False,
    num_warps: int | None = None,
) -> torch.Tensor | None:
    """Plain minibatch steps over the rows ``order`` from one kernel launch; ``coef`` in place.

    Step j takes rows ``order[j b : (j+1) b]`` (the last may be ragged) of
    X, ``(x - center) / scale`` where given (rounded to ``rows_dtype``,
    their raw predictions' products to ``margin_dtype``, where narrower),
    and the step size ``etas[j]``; as :func:`.._engine.recurrence.sgd_step`::

        u = (eta_j / b_j) omega (dl/dz(X_j w + beta) - snapshot_j),
        w <- (1 - eta_j decay_alpha) w - X_j^T u - eta_j mu,
        beta <- beta - sum(u) - eta_j mu_beta.

    ``coef`` is ``(d, k)`` and ``target`` and ``snapshot_gradient``
    ``(n, k)``, contiguous, in the recurrence dtype (the weights' dtype
    too); the per-step scalars are computed in float64 here and rounded to
    it, as the torch step rounds its Python scalars. Returns the weighted
    loss summed over the steps (with ``with_loss``, at each step's start),
    else None.
    """
    code, power = family_code(family)
    n_rows = order.shape[0]
    width = X.shape[1]
    n_outputs = coef.shape[1]
    dtype, device = coef.dtype, coef.device
    sizes = [min(batch_size, n_rows - lo) for lo in range(0, n_rows, batch_size)]
    assert len(etas) == len(sizes), "one step size a batch"
    per_step = torch.tensor(
        [
            [eta / size for eta, size in zip(etas, sizes, strict=True)],
            [1.0 - eta * decay_alpha for eta in etas],
            list(etas),
        ],
        dtype=torch.float64,
    ).to(dtype)
    if device.type == "cuda":
        per_step = per_step.pin_memory().to(device, non_blocking=True)
    else:
        per_step = per_step.to(device)
    losses = torch.zeros(max(len(sizes), 1), dtype=dtype, device=device)
    # Inputs the kernel does not read (no snapshot, no preconditioner): any pointer will do.
    unread = coef
    preconditioned = center is not None
    from .triton_kernel import epoch_steps as kernel  # imports triton on the first launch

    assert X.stride(1) == 1 and coef.is_contiguous() and target.is_contiguous()
    kernel[(1,)](
        X,
        X.stride(0),
        order.contiguous(),
        target,
        sample_weight.contiguous(),
        unread if snapshot_gradient is None else snapshot_gradient.contiguous(),
        unread if mean_gradient is None else mean_gradient.contiguous(),
        unread if mean_gradient_intercept is None else mean_gradient_intercept.contiguous(),
        center.contiguous() if preconditioned else unread,
        scale.contiguous() if preconditioned else unread,
        per_step[0],
        per_step[1],
        per_step[2],
        coef,
        intercept,
        losses,
        n_rows,
        len(sizes),
        batch_size,
        width,
        n_outputs,
        FAMILY=code,
        POWER=power,
        HAS_SNAPSHOT=snapshot_gradient is not None,
        FIT_INTERCEPT=fit_intercept,
        PRECONDITIONED=preconditioned,
        ROUND_ROWS=_narrower(rows_dtype, dtype),
        ROUND_MARGINS=_narrower(margin_dtype, dtype),
        WITH_LOSS=with_loss,
        SOFTPLUS_THRESHOLD=_SOFTPLUS_THRESHOLD,
        BLOCK_B=_pow2(batch_size),
        BLOCK_D=_pow2(width),
        BLOCK_K=_pow2(n_outputs),
        num_warps=warps_for(batch_size, width) if num_warps is None else num_warps,
    )
    return losses.sum() if with_loss else None


def _narrower(rounding: torch.dtype | None, dtype: torch.dtype) -> int:
    """The kernels' code for rounding to ``rounding``, where narrower than ``dtype``; else 0.

    The kernel rounds float32 values only (the presets' recurrence under bf16 and fp16).
    """
    if rounding is None or rounding.itemsize >= dtype.itemsize:
        return 0
    if dtype != torch.float32:
        raise ValueError(f"The epoch kernel rounds float32 to {rounding}, not {dtype}.")
    return _ROUNDING[rounding]


class PassSums(NamedTuple):
    """What :func:`pass_terms` sums over the rows (see :func:`.._engine.snapshot.full_pass`)."""

    transposed: torch.Tensor  # X^T (omega dl/dz), (d, k) in the rows' dtype
    weighted_sum: torch.Tensor  # sum of omega dl/dz per output, (k,) float64
    loss_sum: torch.Tensor  # sum of omega loss, 0-d float64
    rounding: torch.Tensor  # the loss's rounding terms in quadrature, 0-d float64
    raw_max: torch.Tensor  # the largest |raw prediction|, 0-d float64


def pass_supports(family: Family, n_outputs: int, width: int) -> bool:
    """Whether the fused pass covers this family and width (a block of at least 16 rows)."""
    if family_code(family) is None:
        return False
    return 16 * _pow2(width) * _pow2(n_outputs) <= MAX_TILE


def pass_terms(
    family: Family,
    X: torch.Tensor,
    target: torch.Tensor,
    sample_weight: torch.Tensor,
    coef: torch.Tensor,
    intercept: torch.Tensor,
    *,
    center: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    rows_dtype: torch.dtype | None = None,
    gradient_out: torch.Tensor | None = None,
    rows_per_block: int | None = None,
) -> PassSums:
    """The full pass's sums over X's rows from one kernel launch (one read of X).

    Each program takes a block of rows, ``(x - center) / scale`` where given
    (rounded to ``rows_dtype`` where narrower), their raw predictions
    ``X w + beta`` and derivatives, and writes its block's part of every
    sum; the blocks' parts are added here in a fixed order. ``gradient_out``
    ``(n, k)`` receives each row's ``dl/dz`` (SVRG's snapshot). ``coef`` is
    ``(d, k)`` in the rows' accumulate dtype, ``target`` ``(n, k)``.
    """
    code, power = family_code(family)
    n_rows, width = X.shape
    n_outputs = coef.shape[1]
    dtype, device = coef.dtype, coef.device
    if rows_per_block is None:
        rows_per_block = min(1024, MAX_TILE // (_pow2(width) * _pow2(n_outputs)))
    rows_per_block = _pow2(rows_per_block)  # the kernel's block of rows
    blocks = max(1, -(-n_rows // rows_per_block))
    partial_gradient = torch.empty((blocks, width, n_outputs), dtype=dtype, device=device)
    partial_sums = torch.empty((blocks, n_outputs + 4), dtype=torch.float64, device=device)
    preconditioned = center is not None
    from .triton_kernel import pass_blocks  # imports triton on the first launch

    assert X.stride(1) == 1 and coef.is_contiguous() and target.is_contiguous()
    pass_blocks[(blocks,)](
        X,
        X.stride(0),
        target,
        sample_weight.contiguous(),
        coef,
        intercept.contiguous(),
        center.contiguous() if preconditioned else coef,
        scale.contiguous() if preconditioned else coef,
        coef if gradient_out is None else gradient_out,
        partial_gradient,
        partial_sums,
        n_rows,
        width,
        n_outputs,
        FAMILY=code,
        POWER=power,
        PRECONDITIONED=preconditioned,
        ROUND_ROWS=_narrower(rows_dtype, dtype),
        STORE_GRADIENT=gradient_out is not None,
        SOFTPLUS_THRESHOLD=_SOFTPLUS_THRESHOLD,
        BLOCK_R=_pow2(rows_per_block),
        BLOCK_D=_pow2(width),
        BLOCK_K=_pow2(n_outputs),
        num_warps=4,
    )
    sums = partial_sums.sum(dim=0)
    return PassSums(
        partial_gradient.sum(dim=0),
        sums[:n_outputs],
        sums[n_outputs],
        sums[n_outputs + 1] + sums[n_outputs + 2],
        partial_sums[:, n_outputs + 3].max(),
    )
