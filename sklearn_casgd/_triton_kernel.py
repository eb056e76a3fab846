"""The Triton kernel of :mod:`._triton` (imported only when it first runs: triton is optional).

One program walks the s row steps of an outer iteration with ``v`` and the
intercept's ``a`` in registers; :func:`._triton.row_recurrence` launches it.
"""

import triton
import triton.language as tl


@triton.jit
def row_steps(
    Y,
    M,
    target,
    factor,
    snapshot,
    next_decay,
    decay,
    U_out,
    raw_out,
    v_out,
    n_steps,
    batch_size,
    width,
    FAMILY: tl.constexpr,
    POWER: tl.constexpr,
    HAS_SNAPSHOT: tl.constexpr,
    FIT_INTERCEPT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_B)
    columns = tl.arange(0, BLOCK_D)
    row_mask = rows < batch_size
    column_mask = columns < width
    tile_mask = row_mask[:, None] & column_mask[None, :]
    v = tl.zeros([BLOCK_D], dtype=Y.dtype.element_ty)
    a = tl.sum(tl.zeros([BLOCK_B], dtype=Y.dtype.element_ty), axis=0)
    for j in range(n_steps):
        at = j * batch_size + rows
        Y_j = tl.load(Y + at[:, None] * width + columns[None, :], mask=tile_mask, other=0.0)
        C_j = tl.load(decay + j)
        raw = tl.load(M + at, mask=row_mask, other=0.0) - C_j * tl.sum(Y_j * v[None, :], 1)
        if FIT_INTERCEPT:
            raw = raw - a
        y = tl.load(target + at, mask=row_mask, other=0.0)
        if FAMILY == 0:  # binomial: sigmoid(z) - y
            gradient = 1.0 / (1.0 + tl.exp(-raw)) - y
        elif FAMILY == 1:  # squared error: z - y
            gradient = raw - y
        else:  # Tweedie, log link: exp((2 - p) z) - y exp((1 - p) z)
            gradient = tl.exp((2.0 - POWER) * raw) - y * tl.exp((1.0 - POWER) * raw)
        if HAS_SNAPSHOT:
            gradient = gradient - tl.load(snapshot + at, mask=row_mask, other=0.0)
        U_j = tl.where(row_mask, gradient * tl.load(factor + at, mask=row_mask, other=0.0), 0.0)
        tl.store(U_out + at, U_j, mask=row_mask)
        tl.store(raw_out + at, raw, mask=row_mask)
        v = v + tl.sum(Y_j * U_j[:, None], 0)
        if FIT_INTERCEPT:
            a = a + tl.load(next_decay + j) * tl.sum(U_j, 0)
    tl.store(v_out + columns, v, mask=column_mask)
