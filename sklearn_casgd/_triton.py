"""The row steps' recurrence as one Triton kernel: the s steps of an outer iteration in one launch.

:func:`._kernel.inner_steps` runs the row steps as ~8 torch operations a
step (two products, the family's gradient, the running ``v`` and ``a``):
on a GPU that is ~8 s kernel launches per outer iteration, each with a few
microseconds of work. Here one program walks the s steps with ``v`` and
``a`` in registers:

    raw_j = M_j - C_j Y_j v - a,   U_j = factor_j (dl/dz(raw_j) - snapshot_j),
    v += Y_j^T U_j,                a += C_{j+1} sum(U_j).

It covers one output column (every family but the multinomial), batches
of one size and a ``b x d`` tile of at most :data:`MAX_TILE` values; the
torch steps run the rest. triton is optional and imported only when the
kernel first runs (the kernel itself is in :mod:`._triton_kernel`). On
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

import torch

from ._families import BinomialFamily, Family, SquaredErrorFamily, TweedieFamily

# Largest b x d tile (rounded up to powers of two) one program holds.
MAX_TILE = 1 << 16

_BINOMIAL, _SQUARED, _TWEEDIE = 0, 1, 2


def family_code(family: Family) -> tuple[int, float] | None:
    """The kernel's code for ``family`` and its Tweedie power; None if not covered."""
    if isinstance(family, BinomialFamily):
        return _BINOMIAL, 0.0
    if isinstance(family, SquaredErrorFamily):
        return _SQUARED, 0.0
    if isinstance(family, TweedieFamily):
        return _TWEEDIE, float(family.power)
    return None


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
    if n_outputs != 1 or family_code(family) is None or len(set(sizes)) != 1:
        return False
    return _pow2(sizes[0]) * _pow2(width) <= MAX_TILE


def warps_for(batch_size: int, width: int) -> int:
    """Warps of the kernel's one program: about 32 values of the ``b x d`` tile per thread.

    One program walks the steps, so the more threads share each step's
    tile, the shorter the step. On an H200 the kernel alone (triton's
    do_bench, a scratch timing) took 8.4 µs a step of a b=1024, d=28 tile
    at 32 warps, 11.5 at 16 and 12.3 at 8; ``benchmarks/bench_gpu.py``
    ("kernel") times it at each.
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
    ``coefficients`` is :func:`._kernel.step_coefficients`'s tensor (row 1
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
    from ._triton_kernel import row_steps  # imports triton, on the first launch only

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
