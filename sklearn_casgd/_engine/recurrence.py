"""The s-step recurrence: s minibatch SGD steps on a local column block with one reduction.

:func:`sgd_step` is plain minibatch SGD; :func:`ca_outer_iteration` does s
of those steps with a single reduction (`docs/design.md`, section 2). In exact
arithmetic both give the same iterates; the tests hold them to that in
float64. The Gram blocks need no weights, so :func:`.batch.gather_outer_batch`
forms the next outer iteration's while this one's all-reduce is in flight.

Notation: for the steps t = 0..s-1 of an outer iteration, ``decay_t =
1 - eta_t * alpha`` and ``C_j = prod_{t<j} decay_t``. With ``U_k = (eta_k /
b_k) r_k / C_{k+1}`` the plain recurrence unrolls to

    z_j = C_j (m_j - G_{j,<j} U_{<j}) + beta_j,      w_s = C_s (w_0 - Y^T U),

so the inner steps only rescale one vector instead of the whole history.

With a variance-reduction snapshot (SVRG, `docs/design.md`, section 3) every step
also subtracts ``eta_t mu`` and the residuals are ``omega (dl/dz(z) -
dl/dz(z~))``. The constant ``mu`` unrolls like the decay: with ``D_0 = 0``,
``D_{j+1} = decay_j D_j + eta_j`` and ``E_j = sum_{t<j} eta_t``,

    z_j = C_j (m_j - G_{j,<j} U_{<j}) - D_j (Y mu)_j + beta_j - E_j mu_beta,
    w_s = C_s (w_0 - Y^T U) - D_s mu,

so ``Y mu`` rides in the same margins GEMM and the same all-reduce.

The Gram is there to be reduced: with one collective each rank learns
``G_{j,<j}`` without the other ranks' columns. Where every column of the
rows is at hand (one rank, or every rank after a :class:`.state.RowExchange`),
``G_{j,<j} U_{<j} = Y_j v_j`` with ``v_j = Y_{<j}^T U_{<j}`` (and
``w_s = C_s (w_0 - v_s) - D_s mu``): the row steps keep that one vector
of ``d`` values, ``4 s b d`` flops per outer iteration where the Gram takes
``s^2 b^2 d``, and ``s b`` values of memory where it takes ``s^2 b^2 / 2``.

SVRG may also run preconditioned (:class:`.state.Preconditioner`): on ``v = D w``
and the rows ``Y D^{-1}``, whose Gram is the preconditioned Gram, with the
scalar decay of the largest penalty curvature ``alpha / min D^2`` and the
rest of the per-column penalty in the snapshot's constant (`docs/design.md`, section 3).

An outer iteration is two functions of tensors around its one collective:
:func:`.batch.gather_rows` (rows, Gram blocks; before the all-reduce) and
:func:`inner_steps` (after it). Both have static shapes for a given
:class:`.batch.GatherSpec` / :class:`InnerSpec`, and every scalar that changes
between calls (``C_j``, ``D_j``, ``E_j``, the step factors) reaches them as
one small tensor from :func:`step_coefficients`: nothing reads a value
back to the host, and ``torch.compile(fullgraph=True)`` takes either whole.
With ``StepContext.compiled`` the inner steps run compiled.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._accel.compile import StaticCompiled
from .._accel.triton import available as triton_available
from .._accel.triton import row_recurrence as fused_row_recurrence
from .._accel.triton import supports as triton_supports
from .._data.storage import matmul, transpose_matmul
from .._glm.families import Family
from .batch import OuterBatch, batch_offsets, gather_outer_batch
from .comm import DONE
from .state import LocalData, ModelState, StepContext, take_rows

# Compiled inner steps of this process, per spec and way of compiling (and
# within it per input signature).
_COMPILED: dict[tuple[InnerSpec, bool], StaticCompiled] = {}

# Whether the compiled steps are compiled ahead of time, by device type: on
# the CPU that takes dynamo's guards off every call, for more compile time a
# shape; on CUDA the launches, not the guards, set the pace (docs/tuning.md).
# A StepContext's ahead_of_time overrides it (the benchmarks time both).
AHEAD_OF_TIME = {"cpu": True, "cuda": False}


def _weighted_loss(
    ctx: StepContext, raw: torch.Tensor, target: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Sum over the rows of ``weight * loss(raw, target)``."""
    return ctx.family.loss(raw, target) @ weight


def sgd_step(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    rows: torch.Tensor,
    eta: float,
    with_loss: bool = True,
) -> torch.Tensor | None:
    """One plain minibatch SGD step on batch ``rows``; returns the weighted loss sum.

    The reference the s-step kernel is tested against, and the s=1 path.
    ``with_loss=False`` skips the loss (SVRG measures its objective in the
    full pass) and returns None.
    """
    policy = ctx.policy
    Y = ctx.gather(data.X, rows)
    margins = matmul(Y, state.coef).to(policy.margin_storage).to(policy.comm_dtype)
    ctx.comm.all_reduce(margins)
    raw = margins.to(policy.margin_storage).to(policy.recurrence) + state.intercept
    target = take_rows(data.target, rows)
    weight = data.sample_weight.index_select(0, rows)
    loss = _weighted_loss(ctx, raw, target, weight) if with_loss else None
    gradient = ctx.family.gradient(raw, target)
    snapshot = data.snapshot
    if snapshot is not None:
        gradient = gradient - take_rows(snapshot.gradient, rows)
    scaled = gradient.mul_((eta / rows.shape[0]) * weight[:, None])
    if ctx.decay_alpha:
        state.coef.mul_(1.0 - eta * ctx.decay_alpha)
    state.coef.sub_(transpose_matmul(Y, scaled).to(state.coef.dtype))
    if snapshot is not None:
        state.coef.sub_(snapshot.mean_gradient, alpha=eta)
    if ctx.fit_intercept:
        state.intercept.sub_(scaled.sum(dim=0))
        if snapshot is not None:
            state.intercept.sub_(snapshot.mean_gradient_intercept, alpha=eta)
    proximal_step(ctx, state.coef, eta)
    if state.average is not None and state.average.counted([rows.shape[0]])[0]:
        state.average.add(state.coef, state.intercept)
    return loss


def proximal_step(ctx: StepContext, weights: torch.Tensor, eta: float) -> None:
    """The L1 part's proximal step after a step of size ``eta`` on ``weights`` (in place).

    Soft-thresholding is separable by coefficient, so each rank thresholds
    its own columns; it is not linear, so it cannot unroll into the s-step
    recurrence and follows every step (s=1, :data:`.planner.PROXIMAL_S_REASON`).
    """
    if ctx.penalty.proximal:
        ctx.penalty.soft_threshold_(weights, eta * ctx.l1_strength)


# The smallest product ``C_s`` of one outer iteration's decay factors that
# the recurrence holds, by its dtype: ``U_k`` divides by ``C_{k+1}``, and a
# ``C_s`` near the dtype's smallest normal (float32: 1.2e-38) makes ``U``
# overflow and the weights NaN (s=32 at eta0 * alpha = 0.99: ``C_s`` = 1e-64).
# 2^-48 leaves float32 2^80 of range for ``|r| eta / b`` above it.
SMALLEST_DECAY_PRODUCT = {torch.float32: 2.0**-48, torch.float64: 2.0**-400}


def longest_recurrence(eta: float, decay_alpha: float, dtype: torch.dtype) -> int:
    """The most steps of size ``eta`` one outer iteration can take in a recurrence of ``dtype``.

    Their product of decay factors ``(1 - eta * decay_alpha)^s`` stays at
    least :data:`SMALLEST_DECAY_PRODUCT`. In exact arithmetic s does not
    change the iterates, so the engine takes fewer steps per outer
    iteration than asked rather than NaN. At least 1: a factor is at least
    2^-53 (``eta * decay_alpha < 1`` is checked before), and one step of
    plain SGD divides by nothing.
    """
    decay = 1.0 - eta * decay_alpha
    if decay >= 1.0:
        return sys.maxsize
    return max(1, int(math.log(SMALLEST_DECAY_PRODUCT[dtype]) / math.log(decay)))


def recurrence_step(s: int, decay_alpha: float, dtype: torch.dtype) -> float:
    """The longest step whose decay over ``s`` steps a recurrence of ``dtype`` holds.

    The inverse of :func:`longest_recurrence`: SVRG lengthens its step up
    to here, so that the step's growth never breaks the outer iteration.
    """
    if decay_alpha <= 0.0:
        return math.inf
    return (1.0 - SMALLEST_DECAY_PRODUCT[dtype] ** (1.0 / s)) / decay_alpha


def step_coefficients(
    etas: Sequence[float],
    sizes: Sequence[int],
    decay_alpha: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The scalars of one outer iteration's steps as one ``(5, s + 1)`` device tensor.

    Column ``j < s`` holds ``eta_j / (b_j C_{j+1})`` (the factor of ``U_j``),
    ``C_{j+1}``, ``C_j``, ``D_j`` and ``E_j``; column ``s`` holds ``C_s``,
    ``D_s`` and ``E_s`` in rows 2-4 (rows 0-1 are zero). They are computed on
    the host in float64 and copied without a host synchronization (from
    pinned memory on CUDA), so the steps themselves read them as tensors:
    the outer iteration then has no Python scalar that changes between
    calls and can be compiled or captured once. The tensor is shared by
    every call with the same arguments (a constant step gives the same one
    for a whole epoch) and must not be written to.
    """
    return _step_coefficients(tuple(etas), tuple(sizes), decay_alpha, dtype, device)


@functools.lru_cache(maxsize=8)
def _step_coefficients(
    etas: tuple[float, ...],
    sizes: tuple[int, ...],
    decay_alpha: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    s = len(etas)
    values = [[0.0] * (s + 1) for _ in range(5)]
    decay, drift, elapsed = 1.0, 0.0, 0.0  # C_j, D_j (the weight of mu in w_j), E_j
    for j, eta in enumerate(etas):
        values[2][j], values[3][j], values[4][j] = decay, drift, elapsed
        step_decay = 1.0 - eta * decay_alpha
        drift = drift * step_decay + eta
        decay *= step_decay
        elapsed += eta
        values[0][j], values[1][j] = eta / (sizes[j] * decay), decay
    values[2][s], values[3][s], values[4][s] = decay, drift, elapsed
    coefficients = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return coefficients.pin_memory().to(device, non_blocking=True)
    return coefficients.to(device)


def _per_row(per_step: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``(m, s)`` per-step values repeated over the rows of each batch, ``(m, sum(sizes))``."""
    if all(size == sizes[0] for size in sizes):  # the common case: no ragged tail
        return per_step[:, :, None].expand(-1, -1, sizes[0]).reshape(per_step.shape[0], -1)
    return torch.cat(
        [per_step[:, j : j + 1].expand(-1, size) for j, size in enumerate(sizes)], dim=1
    )


@dataclass(frozen=True)
class InnerSpec:
    """What is fixed about the inner steps of an outer iteration: the shapes and the family.

    Equal specs share one compiled function (:func:`steps_for`).
    """

    family: Family
    fit_intercept: bool
    sizes: tuple[int, ...]
    margin_start: int
    margin_storage: torch.dtype
    recurrence: torch.dtype
    device_type: str = "cpu"
    row_steps: bool = False  # from the rows (StepContext.row_steps), not the Gram
    fused: bool = False  # the row steps' recurrence as one Triton kernel (_accel.triton)
    returns_residuals: bool = False  # also hand back U (averaged SGD sums the iterates)


def steps_for(ctx: StepContext, spec: InnerSpec) -> Callable[..., torch.Tensor]:
    """:func:`inner_steps` for ``spec``: eager, or compiled once per spec and process.

    With the fused kernel the steps are one launch already: they run
    as they are, not through torch.compile.
    """
    if not ctx.compiled or spec.fused or spec.sizes in ctx.eager_sizes:
        return functools.partial(inner_steps, spec)
    ahead_of_time = ctx.ahead_of_time
    if ahead_of_time is None:
        ahead_of_time = AHEAD_OF_TIME.get(spec.device_type, False)
    compiled = _COMPILED.get((spec, ahead_of_time))
    if compiled is None:
        # On the CPU, cpp_wrapper (the graph's calls, GEMMs included, made
        # from C++ instead of a Python wrapper) is most of the gain. CUDA
        # keeps inductor's default until bench_gpu.py has compared them.
        compiled = StaticCompiled(
            functools.partial(inner_steps, spec),
            {"cpp_wrapper": True} if spec.device_type == "cpu" else {},
            ahead_of_time,
        )
        _COMPILED[spec, ahead_of_time] = compiled
    return compiled


def inner_steps(
    spec: InnerSpec,
    packed: torch.Tensor,
    Y: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor,
    coef: torch.Tensor,
    intercept: torch.Tensor,
    coefficients: torch.Tensor,
    snapshot_gradient: torch.Tensor | None,
    mean_gradient: torch.Tensor | None,
    mean_gradient_intercept: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The s steps of one outer iteration from its reduced ``packed`` buffer.

    ``Y`` is the rows the steps read: this rank's columns, or after a
    :class:`.state.RowExchange` every rank's (``coef`` is then the replica of every
    rank's weights). Updates ``coef`` and ``intercept`` in place and returns the weighted
    loss sum over the s batches. Every shape is fixed by ``spec`` and every
    scalar that changes between calls is in the tensor ``coefficients``
    (:func:`step_coefficients`): no host synchronization and no graph break,
    so that ``torch.compile(fullgraph=True)`` takes it whole.

    With ``M_j = C_j m_j - D_j (Y mu)_j + beta_0 - E_j mu_beta`` (one
    expression over all rows) and ``c`` holding ``C_{k+1}`` on the rows of
    batch k, step j's raw prediction is

        raw_j = M_j - (C_j G_{j,<j} + 1 c_{<j}^T) U_{<j},

    one fused multiply-add and one ``addmm``. Row steps (``spec.row_steps``)
    form ``G_{j,<j} U_{<j} = Y_j v`` from the running ``v = Y_{<j}^T U_{<j}``
    and the intercept's part ``a = c_{<j}^T U_{<j}`` likewise:

        raw_j = M_j - C_j Y_j v - a,    v += Y_j^T U_j,    a += c_j^T U_j,

    and the weight update is the last ``v``. With ``spec.returns_residuals``
    it returns ``(loss, U)``.
    """
    sizes = spec.sizes
    rec = spec.recurrence
    s = len(sizes)
    k = coef.shape[1]
    offsets = batch_offsets(sizes)
    packed = packed.to(rec)
    margins = packed[spec.margin_start :].view(offsets[-1], -1)
    if spec.margin_storage != packed.dtype:
        margins = margins.to(spec.margin_storage).to(rec)
    per_row = _per_row(coefficients[:, :s], sizes)
    factor, c, C, D, E = per_row.unbind(0)
    M = margins[:, :k] * C[:, None]
    if mean_gradient is not None:
        M = torch.addcmul(M, D[:, None], margins[:, k:], value=-1.0)
    if spec.fit_intercept:
        M = M + intercept
        if mean_gradient_intercept is not None:
            M = torch.addcmul(M, E[:, None], mean_gradient_intercept[None, :], value=-1.0)
    factor = (factor * weight)[:, None]
    step_decay = coefficients[2].unbind()  # C_j as 0-d tensors, j = 0..s
    steps = (M, target, factor, snapshot_gradient, step_decay, c)
    if spec.fused:
        U, raw, v = fused_row_recurrence(
            spec.family, Y.to(rec), *steps[:4], coefficients, sizes[0], spec.fit_intercept
        )
        raws = [raw]
    elif spec.row_steps:
        U, raws, v = _row_recurrence(spec, Y.to(rec), *steps)
    else:
        U, raws = _gram_recurrence(spec, packed[: spec.margin_start], *steps)

    if spec.fit_intercept:
        intercept.sub_(c @ U)
    if spec.row_steps:
        update = v
    else:
        update = transpose_matmul(Y, U)
    coef.sub_(update.to(coef.dtype)).mul_(step_decay[s])
    if mean_gradient is not None:
        coef.addcmul_(mean_gradient, coefficients[3, s], value=-1.0)
        if spec.fit_intercept:
            intercept.addcmul_(mean_gradient_intercept, coefficients[4, s], value=-1.0)
    loss = spec.family.loss(torch.cat(raws), target) @ weight
    return (loss, U) if spec.returns_residuals else loss


def _residual(
    family: Family,
    raw: torch.Tensor,
    target: torch.Tensor,
    snapshot_gradient: torch.Tensor | None,
    factor: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One step's ``U_j = factor_j (dl/dz(raw_j) - dl/dz(z~_j))`` into ``out`` (no snapshot: 0)."""
    gradient = family.gradient(raw, target)
    if snapshot_gradient is not None:
        gradient = gradient - snapshot_gradient
    torch.mul(gradient, factor, out=out)


def _row_recurrence(
    spec: InnerSpec,
    Y: torch.Tensor,
    M: torch.Tensor,
    target: torch.Tensor,
    factor: torch.Tensor,
    snapshot_gradient: torch.Tensor | None,
    step_decay: Sequence[torch.Tensor],
    c: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """``U``, the raw predictions of every step and the last ``v``, from the rows."""
    sizes = spec.sizes
    k = M.shape[1]
    U = torch.empty_like(M)
    U_blocks, factors = U.split(sizes), factor.split(sizes)
    M_blocks, targets, Y_blocks, c_blocks = (
        M.split(sizes),
        target.split(sizes),
        Y.split(sizes),
        c.split(sizes),
    )
    snapshot_gradients = None if snapshot_gradient is None else snapshot_gradient.split(sizes)
    v = torch.zeros((Y.shape[1], k), dtype=M.dtype, device=M.device)
    a = torch.zeros(k, dtype=M.dtype, device=M.device)
    raws = [M_blocks[0]]  # C_0 = 1 and nothing before batch 0
    for j in range(len(sizes)):
        if j:
            raw = torch.addcmul(M_blocks[j], Y_blocks[j] @ v, step_decay[j], value=-1.0)
            raws.append(raw - a if spec.fit_intercept else raw)
        snapshot = None if snapshot_gradients is None else snapshot_gradients[j]
        _residual(spec.family, raws[j], targets[j], snapshot, factors[j], U_blocks[j])
        v = torch.addmm(v, Y_blocks[j].T, U_blocks[j])
        if spec.fit_intercept and j < len(sizes) - 1:
            a = a + c_blocks[j] @ U_blocks[j]
    return U, raws, v


def _gram_recurrence(
    spec: InnerSpec,
    grams: torch.Tensor,
    M: torch.Tensor,
    target: torch.Tensor,
    factor: torch.Tensor,
    snapshot_gradient: torch.Tensor | None,
    step_decay: Sequence[torch.Tensor],
    c: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``U`` and the raw predictions of every step, from the packed Gram blocks."""
    sizes = spec.sizes
    offsets = batch_offsets(sizes)
    U = torch.empty_like(M)
    U_blocks, factors = U.split(sizes), factor.split(sizes)
    M_blocks, targets = M.split(sizes), target.split(sizes)
    snapshot_gradients = None if snapshot_gradient is None else snapshot_gradient.split(sizes)
    block_sizes = [(offsets[j + 1] - offsets[j]) * offsets[j] for j in range(1, len(sizes))]
    blocks = grams.split(block_sizes)
    c_row = c[None, :]
    raws = [M_blocks[0]]  # C_0 = 1 and nothing before batch 0
    for j in range(len(sizes)):
        if j:
            lo = offsets[j]
            G = blocks[j - 1].view(sizes[j], lo)
            if spec.fit_intercept:
                G = torch.addcmul(c_row[:, :lo], G, step_decay[j])
            else:
                G = G * step_decay[j]
            raws.append(torch.addmm(M_blocks[j], G, U[:lo], alpha=-1.0))
        snapshot = None if snapshot_gradients is None else snapshot_gradients[j]
        _residual(spec.family, raws[j], targets[j], snapshot, factors[j], U_blocks[j])
    return U, raws


def warm_up(
    ctx: StepContext, data: LocalData, state: ModelState, rows: torch.Tensor, sizes: Sequence[int]
) -> None:
    """Run the gather and the inner steps of one outer iteration on ``rows``, changing nothing.

    With ``ctx.compiled`` this compiles both for these shapes: the real
    calls then meet the same guards (shapes, dtypes, devices, layouts).
    """
    batch = gather_outer_batch(ctx, data, rows, sizes)
    if ctx.exchange is not None:  # the full rows, as the all-gather would bring them
        batch.rows_full = torch.zeros(
            (sum(sizes), sum(ctx.exchange.widths)),
            dtype=ctx.policy.recurrence,
            device=data.X.device,
        )
    snapshot = data.snapshot
    weights = state.step_weights()
    steps_for(ctx, _inner_spec(ctx, batch))(
        batch.packed.zero_(),
        batch.step_rows(),
        batch.target,
        batch.sample_weight,
        weights.clone(),
        state.intercept.clone(),
        torch.zeros((5, len(sizes) + 1), dtype=ctx.policy.recurrence, device=data.X.device),
        batch.snapshot_gradient,
        None if snapshot is None else torch.zeros_like(weights),
        None if snapshot is None else snapshot.mean_gradient_intercept,
    )


def _inner_spec(ctx: StepContext, batch: OuterBatch) -> InnerSpec:
    policy = ctx.policy
    device_type = batch.packed.device.type
    fused = (
        ctx.fused
        and triton_available(device_type)
        and triton_supports(
            ctx.family, batch.sizes, batch.target.shape[1], batch.step_rows().shape[1]
        )
    )
    return InnerSpec(
        ctx.family,
        ctx.fit_intercept,
        tuple(batch.sizes),
        batch.margin_start,
        policy.margin_storage,
        policy.recurrence,
        device_type,
        ctx.row_steps,
        fused,
        ctx.averaged,
    )


def ca_outer_iteration(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    batch: OuterBatch,
    etas: Sequence[float] | torch.Tensor,
    upcoming: tuple[torch.Tensor, Sequence[int]] | None = None,
) -> tuple[torch.Tensor, OuterBatch | None]:
    """s SGD steps on the consecutive batches of ``batch`` with one collective.

    Batch j takes step size ``etas[j]``; ``etas`` may instead be the
    steps' :func:`step_coefficients` tensor itself (a CUDA graph reads
    them from a buffer of its own). Returns the weighted loss sum over
    the s batches and, when ``upcoming`` names the ``(rows, sizes)`` of the
    next outer iteration, that iteration gathered while this one's
    collective was in flight (the same arithmetic, in a different order).
    The collective is this iteration's all-reduce of the Gram and margins;
    with a :class:`.state.RowExchange` the rows came before (``batch.rows_full``,
    :func:`.exchange.start_row_exchange`) and this iteration exchanges nothing
    (``upcoming`` must be None). The steps themselves are
    :func:`inner_steps`, compiled when ``ctx.compiled``.
    """
    policy = ctx.policy
    snapshot = data.snapshot
    packed, margin_start = batch.packed, batch.margin_start
    if ctx.exchange is None:
        rows, weights = batch.Y, state.coef
        mean_gradient = None if snapshot is None else snapshot.mean_gradient
    else:
        if upcoming is not None:
            raise ValueError("With a RowExchange the engine gathers the rows ahead: no upcoming.")
        rows, weights = batch.rows_full, state.replica
        mean_gradient = None if snapshot is None else snapshot.replica_mean_gradient
    if mean_gradient is not None:
        weights = torch.cat([weights, mean_gradient], 1)
    margins = matmul(rows, weights)
    packed[margin_start:].view_as(margins).copy_(margins.to(policy.margin_storage))
    pending = ctx.comm.start_all_reduce(packed) if ctx.exchange is None else DONE
    following = None if upcoming is None else gather_outer_batch(ctx, data, *upcoming)
    # Host work for the steps overlaps the collective too.
    coefficients = (
        etas
        if isinstance(etas, torch.Tensor)
        else step_coefficients(etas, batch.sizes, ctx.decay_alpha, policy.recurrence, packed.device)
    )
    if ctx.penalty.proximal and (len(batch.sizes) != 1 or isinstance(etas, torch.Tensor)):
        raise ValueError("An L1 penalty's proximal step follows every step: s=1, etas given.")
    average = state.average
    if average is not None:
        if isinstance(etas, torch.Tensor):
            raise ValueError("Averaged SGD sums its iterates from the step sizes: etas given.")
        counted = average.counted(batch.sizes)
        before = (state.step_weights().clone(), state.intercept.clone())
    pending.wait()
    result = steps_for(ctx, _inner_spec(ctx, batch))(
        packed,
        batch.step_rows(),
        batch.target,
        batch.sample_weight,
        state.step_weights(),
        state.intercept,
        coefficients,
        batch.snapshot_gradient,
        mean_gradient,
        None if snapshot is None else snapshot.mean_gradient_intercept,
    )
    loss, residuals = result if ctx.averaged else (result, None)
    if ctx.penalty.proximal:
        proximal_step(ctx, state.step_weights(), etas[0])
    if average is not None and any(counted):
        if ctx.penalty.proximal:  # s = 1: the iterate is the thresholded weights
            average.add(state.step_weights(), state.intercept)
        else:
            average.add_outer(
                *before,
                batch.step_rows(),
                residuals,
                decay_products(etas, ctx.decay_alpha),
                batch.sizes,
                counted,
                ctx.fit_intercept,
            )
    return loss, following


def decay_products(etas: Sequence[float], decay_alpha: float) -> list[float]:
    """``C_{j+1}``, the product of the decay factors of steps ``0..j``, in float64."""
    return list(itertools.accumulate((1.0 - eta * decay_alpha for eta in etas), operator.mul))
