"""The Triton kernels of :mod:`.triton` (imported only when one first runs: triton is optional).

``row_steps``: one program walks the s row steps of an outer iteration
with ``v`` and the intercept's ``a`` in registers
(:func:`.triton.row_recurrence`). ``epoch_steps``: one program walks many
plain steps (an epoch) with the weights in registers, gathering each
step's rows of X itself (:func:`.triton.epoch_steps`).
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


@triton.jit
def _round_to_bfloat16(x):
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), kept in float32.

    As ``torch``'s ``.to(torch.bfloat16)``; by the bits, because Triton's
    interpreter truncates in ``.to(tl.bfloat16)`` (NaN is not handled).
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rounded(x, ROUNDING: tl.constexpr):
    """float32 ``x`` rounded to bfloat16 (1) or float16 (2), kept in float32; 0: as it is."""
    if ROUNDING == 1:
        x = _round_to_bfloat16(x)
    elif ROUNDING == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _loss_terms(
    raw,
    y,
    outputs,
    output_mask,
    FAMILY: tl.constexpr,
    POWER: tl.constexpr,
    SOFTPLUS_THRESHOLD: tl.constexpr,
):
    """The family's ``dl/dz`` and loss at raw predictions ``(rows, outputs)``.

    A row of several outputs (the multinomial) has its loss in its first column.
    """
    if FAMILY == 0:  # binomial
        gradient = 1.0 / (1.0 + tl.exp(-raw)) - y
        loss = tl.where(raw > SOFTPLUS_THRESHOLD, raw, tl.log(1.0 + tl.exp(raw))) - y * raw
    elif FAMILY == 1:  # squared error
        gradient = raw - y
        loss = 0.5 * (raw - y) * (raw - y)
    elif FAMILY == 2:  # Tweedie, log link
        if POWER == 1.0:
            gradient = tl.exp(raw) - y
            loss = tl.exp(raw) - y * raw
        elif POWER == 2.0:
            gradient = 1.0 - y * tl.exp(-raw)
            loss = raw + y * tl.exp(-raw)
        else:
            gradient = tl.exp((2.0 - POWER) * raw) - y * tl.exp((1.0 - POWER) * raw)
            loss = tl.exp((2.0 - POWER) * raw) / (2.0 - POWER) - y * tl.exp((1.0 - POWER) * raw) / (
                1.0 - POWER
            )
    else:  # multinomial: softmax over the outputs
        shifted = tl.where(output_mask[None, :], raw, -float("inf"))
        top = tl.max(shifted, axis=1)
        exponentials = tl.exp(shifted - top[:, None])
        total = tl.sum(exponentials, axis=1)
        gradient = exponentials / total[:, None] - y
        own = tl.sum(tl.where(output_mask[None, :], raw * y, 0.0), axis=1)
        loss = tl.where(outputs[None, :] == 0, (top + tl.log(total) - own)[:, None], 0.0)
    return gradient, loss


@triton.jit
def epoch_steps(
    X,
    stride_x,
    order,
    target,
    weight,
    snapshot,
    mean_gradient,
    mean_gradient_intercept,
    center,
    scale,
    step_factor,
    step_decay,
    step_eta,
    coef,
    intercept,
    loss_out,
    n_rows,
    n_steps,
    batch_size,
    width,
    n_outputs,
    FAMILY: tl.constexpr,
    POWER: tl.constexpr,
    HAS_SNAPSHOT: tl.constexpr,
    FIT_INTERCEPT: tl.constexpr,
    PRECONDITIONED: tl.constexpr,
    ROUND_ROWS: tl.constexpr,
    ROUND_MARGINS: tl.constexpr,
    WITH_LOSS: tl.constexpr,
    SOFTPLUS_THRESHOLD: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program walks every step of the launch: the weights (BLOCK_D x
    # BLOCK_K) and the intercept stay in registers from the first step to the
    # last, and each step gathers its rows of X through ``order``.
    rows = tl.arange(0, BLOCK_B)
    columns = tl.arange(0, BLOCK_D)
    outputs = tl.arange(0, BLOCK_K)
    column_mask = columns < width
    output_mask = outputs < n_outputs
    weight_mask = column_mask[:, None] & output_mask[None, :]
    weight_at = columns[:, None] * n_outputs + outputs[None, :]
    w = tl.load(coef + weight_at, mask=weight_mask, other=0.0)
    beta = tl.load(intercept + outputs, mask=output_mask, other=0.0)
    if PRECONDITIONED:
        m = tl.load(center + columns, mask=column_mask, other=0.0)
        D = tl.load(scale + columns, mask=column_mask, other=1.0)
    if HAS_SNAPSHOT:
        mu = tl.load(mean_gradient + weight_at, mask=weight_mask, other=0.0)
        mu_beta = tl.load(mean_gradient_intercept + outputs, mask=output_mask, other=0.0)
    # Step 0's rows; each step then loads the next step's rows before its own
    # arithmetic, so that the gather's latency overlaps the step.
    next_mask = (rows < batch_size) & (rows < n_rows)
    next_index = tl.load(order + rows, mask=next_mask, other=0).to(tl.int64)  # n d > 2^31
    next_x = tl.load(
        X + next_index[:, None] * stride_x + columns[None, :],
        mask=next_mask[:, None] & column_mask[None, :],
        other=0.0,
    )
    for j in range(n_steps):
        row_mask, index, x = next_mask, next_index, next_x
        at = (j + 1) * batch_size + rows
        next_mask = (rows < batch_size) & (at < n_rows)
        next_index = tl.load(order + at, mask=next_mask, other=0).to(tl.int64)
        next_x = tl.load(
            X + next_index[:, None] * stride_x + columns[None, :],
            mask=next_mask[:, None] & column_mask[None, :],
            other=0.0,
        )
        tile_mask = row_mask[:, None] & column_mask[None, :]
        x = x.to(w.dtype)
        if PRECONDITIONED:  # the rows as the steps see them, (x - m) / D
            x = tl.where(tile_mask, (x - m[None, :]) / D[None, :], 0.0)
            x = _rounded(x, ROUND_ROWS)
        raw = _rounded(tl.sum(x[:, :, None] * w[None, :, :], axis=1), ROUND_MARGINS)
        raw = raw + beta[None, :]
        out_mask = row_mask[:, None] & output_mask[None, :]
        out_at = index[:, None] * n_outputs + outputs[None, :]
        y = tl.load(target + out_at, mask=out_mask, other=0.0)
        gradient, loss = _loss_terms(
            raw, y, outputs, output_mask, FAMILY, POWER, SOFTPLUS_THRESHOLD
        )
        omega = tl.load(weight + index, mask=row_mask, other=0.0)
        if WITH_LOSS:
            row_loss = tl.sum(tl.where(out_mask, loss, 0.0), axis=1)
            tl.store(loss_out + j, tl.sum(tl.where(row_mask, row_loss * omega, 0.0), axis=0))
        if HAS_SNAPSHOT:
            gradient = gradient - tl.load(snapshot + out_at, mask=out_mask, other=0.0)
        factor = tl.load(step_factor + j) * omega
        u = tl.where(out_mask, gradient * factor[:, None], 0.0)
        w = w * tl.load(step_decay + j) - tl.sum(x[:, :, None] * u[:, None, :], axis=0)
        eta = tl.load(step_eta + j)
        if HAS_SNAPSHOT:
            w = w - eta * mu
        if FIT_INTERCEPT:
            beta = beta - tl.sum(u, axis=0)
            if HAS_SNAPSHOT:
                beta = beta - eta * mu_beta
    tl.store(coef + weight_at, w, mask=weight_mask)
    tl.store(intercept + outputs, beta, mask=output_mask)


@triton.jit
def pass_blocks(
    X,
    stride_x,
    target,
    weight,
    coef,
    intercept,
    center,
    scale,
    gradient_out,
    partial_gradient,
    partial_sums,
    n_rows,
    width,
    n_outputs,
    FAMILY: tl.constexpr,
    POWER: tl.constexpr,
    PRECONDITIONED: tl.constexpr,
    ROUND_ROWS: tl.constexpr,
    STORE_GRADIENT: tl.constexpr,
    SOFTPLUS_THRESHOLD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program p reads rows [p BLOCK_R, (p+1) BLOCK_R) of X once and writes
    # its block's part of X^T (omega dl/dz) and of the pass's sums; the
    # caller adds the blocks' parts in a fixed order.
    block = tl.program_id(0)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    columns = tl.arange(0, BLOCK_D)
    outputs = tl.arange(0, BLOCK_K)
    row_mask = rows < n_rows
    column_mask = columns < width
    output_mask = outputs < n_outputs
    weight_mask = column_mask[:, None] & output_mask[None, :]
    weight_at = columns[:, None] * n_outputs + outputs[None, :]
    w = tl.load(coef + weight_at, mask=weight_mask, other=0.0)
    beta = tl.load(intercept + outputs, mask=output_mask, other=0.0)
    tile_mask = row_mask[:, None] & column_mask[None, :]
    at = rows.to(tl.int64)
    x = tl.load(X + at[:, None] * stride_x + columns[None, :], mask=tile_mask, other=0.0)
    x = x.to(w.dtype)
    if PRECONDITIONED:
        m = tl.load(center + columns, mask=column_mask, other=0.0)
        D = tl.load(scale + columns, mask=column_mask, other=1.0)
        x = tl.where(tile_mask, (x - m[None, :]) / D[None, :], 0.0)
        x = _rounded(x, ROUND_ROWS)
    raw = tl.sum(x[:, :, None] * w[None, :, :], axis=1) + beta[None, :]
    out_mask = row_mask[:, None] & output_mask[None, :]
    out_at = at[:, None] * n_outputs + outputs[None, :]
    y = tl.load(target + out_at, mask=out_mask, other=0.0)
    gradient, loss = _loss_terms(raw, y, outputs, output_mask, FAMILY, POWER, SOFTPLUS_THRESHOLD)
    if STORE_GRADIENT:
        tl.store(gradient_out + out_at, gradient, mask=out_mask)
    omega = tl.load(weight + at, mask=row_mask, other=0.0)
    weighted = tl.where(out_mask, gradient * omega[:, None], 0.0)
    part = tl.sum(x[:, :, None] * weighted[:, None, :], axis=0)
    tl.store(partial_gradient + block * width * n_outputs + weight_at, part, mask=weight_mask)
    # The block's sums: weighted gradient per output (k), the weighted loss,
    # the loss's rounding in quadrature (two terms, float64, as the torch
    # pass sums them) and the largest |raw prediction|.
    sums_at = partial_sums + block * (n_outputs + 4)
    tl.store(sums_at + outputs, tl.sum(weighted, axis=0).to(tl.float64), mask=output_mask)
    row_loss = tl.sum(tl.where(out_mask, loss, 0.0), axis=1)
    weighted_loss = tl.where(row_mask, row_loss * omega, 0.0)
    tl.store(sums_at + n_outputs, tl.sum(weighted_loss.to(tl.float64), axis=0))
    squared_loss = weighted_loss.to(tl.float64) * weighted_loss.to(tl.float64)
    tl.store(sums_at + n_outputs + 1, tl.sum(squared_loss, axis=0))
    through_raw = (weighted * raw).to(tl.float64)
    tl.store(sums_at + n_outputs + 2, tl.sum(tl.sum(through_raw * through_raw, axis=1), axis=0))
    largest = tl.max(tl.max(tl.where(out_mask, tl.abs(raw), 0.0), axis=1), axis=0)
    tl.store(sums_at + n_outputs + 3, largest.to(tl.float64))
