"""The full pass: every row's raw prediction, the exact objective and the full gradient.

One pass over a rank's rows gives the raw predictions ``z~ = X w + beta``
at the current weights (one all-reduce of the n x k partial sums). From
them follow, with no further communication of size n, the exact training
objective, the full gradient ``mu + alpha w`` (``mu = X^T (omega
dl/dz(z~)) / n``, local per column block; divided by each column's spread
when the steps are preconditioned) and its largest entry,
which is the gradient test (as lbfgs's projected-gradient test), the
certificate's bound on the gap to the optimum (:mod:`.certificate`), and
SVRG's control variate for the next epoch.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .._accel.triton import pass_terms
from .._data.storage import CenteredRows, CSRMatrix, matmul, transpose_matmul
from .state import LocalData, ModelState, Snapshot, StepContext

# Values of X per chunk of the pass: chunks of the accumulation dtype stay
# around 2 MiB whatever the width, and X is never upcast whole.
CHUNK_VALUES = 1 << 18
# Chunks that are views of X (nothing copied) for products only may be larger,
# to fewer chunks' fixed costs (the rows' own terms, a few (rows, k) values,
# stay small beside them).
_VIEW_CHUNK_VALUES = 1 << 22
_VIEW_CHUNK_ROWS = 1 << 16


@dataclass(frozen=True)
class HeldOut:
    """Rows set aside for early stopping: this rank's column block of them, and their targets."""

    X: torch.Tensor | CSRMatrix  # (m, d_local), policy.x_storage
    target: np.ndarray  # (m, k) float64
    sample_weight: np.ndarray  # (m,) float64


@dataclass(frozen=True)
class Measurement:
    """What the full pass measured at the current weights (equal on every rank)."""

    objective: float  # mean weighted loss + alpha/2 ||w||^2, exact up to rounding
    gradient_max: float  # largest |entry| of the full gradient, intercept included
    raw_max: float  # largest |raw prediction|, to name an overflow
    resolution: float  # the objective's rounding error in the recurrence dtype (its scale)
    # The certificate's bound on (F - F*) / F*, and on F - F* (None: no certificate).
    gap_bound: float | None = None
    gap_absolute: float | None = None
    # Labels without a penalty: every weighted row strictly on its side (no finite optimum).
    separated: bool = False

    @property
    def finite(self) -> bool:
        return math.isfinite(self.objective) and math.isfinite(self.gradient_max)


def full_pass(
    ctx: StepContext, data: LocalData, state: ModelState, loss_offset: float
) -> tuple[Snapshot, Measurement]:
    """Measure the weights in ``state`` and take the SVRG snapshot at them.

    One rank reads X once: each chunk's raw predictions, derivatives and
    its part of ``X^T (omega dl/dz)`` follow from the chunk at hand.
    Several ranks need every row's raw prediction summed over the ranks
    before any derivative: they read their block twice, around that
    all-reduce, and Newton epochs keep the sums in the snapshot.
    """
    policy = ctx.policy
    X = data.X
    n_samples, width = X.shape
    acc = policy.update_accumulate
    rec = policy.recurrence
    k = state.coef.shape[1]
    raw = None

    terms = _RowTerms(ctx, data, n_samples, k)
    mean_gradient = torch.zeros((width, k), dtype=acc, device=X.device)
    if ctx.fused_pass:  # one launch: the same sums, each block's added in a fixed order
        mean_gradient += terms.add_all(ctx, X, state)
    elif ctx.comm.world_size == 1:
        coef = state.coef.to(acc)
        for lo, hi, rows in row_blocks(ctx, X, products_only=True):
            chunk_raw = matmul(rows, coef).to(rec).add_(state.intercept)
            mean_gradient += transpose_matmul(rows, terms.add(lo, hi, chunk_raw))
    else:
        raw = raw_predictions(ctx, X, state)
        for lo, hi, rows in row_blocks(ctx, X, products_only=True):
            mean_gradient += transpose_matmul(rows, terms.add(lo, hi, raw[lo:hi]))
    mean_gradient /= n_samples
    mean_gradient_intercept = terms.weighted_sum / n_samples
    if not ctx.fit_intercept:
        mean_gradient_intercept.zero_()

    # The objective and its gradient in the user's coordinates w = v / D;
    # preconditioned, each column's gradient is divided by the column's
    # spread: the gradient for the coefficient of (x - m) / spread, as on
    # StandardScaler's columns, so the stopping test does not depend on the
    # units of the columns (x * c has c times the gradient and the spread).
    # With an L1 part the test reads the smallest subgradient instead
    # (Penalty.optimality_residual), in the same units.
    coef64 = state.coef.to(torch.float64)
    gradient64 = mean_gradient.to(torch.float64) + ctx.penalty.l2 * coef64
    preconditioner = ctx.preconditioner
    if preconditioner is None:
        gradient64 = ctx.penalty.optimality_residual(gradient64, coef64)
        user_gradient = gradient64
    else:
        scale = preconditioner.scale.to(torch.float64)[:, None]
        coef64 = coef64 / scale
        penalty = ctx.penalty.l2 / scale.square()
        gradient64 = mean_gradient.to(torch.float64) + penalty * state.coef.to(torch.float64)
        gradient64 = gradient64 * scale  # d/dw = D d/dv
        gradient64 = ctx.penalty.optimality_residual(gradient64, coef64)
        user_gradient = gradient64  # the certificate's: in the user's units
        if preconditioner.spread is not None:
            gradient64 = gradient64 / preconditioner.spread.to(torch.float64)[:, None]
        # The steps decay v at decay_alpha; the rest of alpha / D^2 rides here.
        mean_gradient += ((penalty - preconditioner.decay_alpha) * state.coef.to(torch.float64)).to(
            acc
        )
    mean_gradient = mean_gradient.to(policy.weight_storage)

    # Replicated sums are divided by the world size so that one sum-reduction
    # carries them beside the per-rank parts; each rank's largest gradient
    # entry goes in a slot of its own, so that the sum leaves every maximum,
    # and so do its rows of Newton's full gradient.
    world = ctx.comm.world_size
    n_features = ctx.total_columns(width)
    norms = ctx.penalty.norms(coef64)
    sums = [terms.loss_sum / world, norms, user_gradient.square().sum()[None]]
    sums += terms.replicated_sums(world)
    layout = list(itertools.accumulate((part.numel() for part in sums), initial=0))
    maxima = layout[-1]  # where each rank's largest gradient entry goes
    newton_values = n_features * k if ctx.newton else 0
    stats = torch.zeros(maxima + world + newton_values, dtype=torch.float64, device=X.device)
    stats[:maxima] = torch.cat([part.reshape(-1).to(stats) for part in sums])
    if width:
        stats[maxima + ctx.comm.rank] = gradient64.abs().max()
    newton_gradient = None
    if newton_values:  # in the steps' coordinates: v's decay and mu
        newton_gradient = stats[maxima + world :].view(n_features, k)
        own = state.coef.to(torch.float64) * ctx.decay_alpha + mean_gradient.to(torch.float64)
        newton_gradient[ctx.column_start : ctx.column_start + width] = own
    ctx.comm.all_reduce(stats)
    loss_sum, norms, gradient_squared = (stats[layout[i] : layout[i + 1]] for i in range(3))
    rank_maxima = stats[maxima : maxima + world]  # not Newton's signed gradient after them
    gradient_max = max(rank_maxima.max().item(), mean_gradient_intercept.abs().max().item())
    objective = (loss_sum.item() + loss_offset) / n_samples + ctx.penalty.value(norms)
    gap_absolute = gap_bound = None
    separated = False
    row_sums = terms.read_replicated(stats[layout[3] : maxima])
    if row_sums.unseparated is not None:
        separated = row_sums.unseparated == 0.0
    if row_sums.intercept_hessian is not None:
        gap_absolute, gap_bound = ctx.certificate.bound(
            objective,
            gradient_squared.item(),
            mean_gradient_intercept,
            row_sums.intercept_hessian,
            row_sums.squared_traces,
            n_samples,
        )
    measurement = Measurement(
        objective=objective,
        gradient_max=gradient_max,
        raw_max=terms.raw_max.item(),
        resolution=torch.finfo(rec).eps * terms.rounding.sqrt().item() / n_samples,
        gap_bound=gap_bound,
        gap_absolute=gap_absolute,
        separated=separated,
    )
    snapshot = Snapshot(
        terms.gradient,
        mean_gradient,
        mean_gradient_intercept,
        newton_gradient=newton_gradient,
        row_curvature=terms.row_curvature,
        raw_predictions=raw if ctx.newton else None,
    )
    return snapshot, measurement


class RowSums(NamedTuple):
    """The certificate's and the separation's sums over every row (None: not formed)."""

    intercept_hessian: torch.Tensor | None  # (k, k): sum_i omega_i H_i
    squared_traces: float | None  # sum_i (omega_i trace H_i)^2
    unseparated: float | None  # weighted rows not strictly on their label's side


class _RowTerms:
    """What the full pass sums over the rows from their raw predictions, a block at a time.

    Each block's derivatives go into ``gradient`` (the snapshot's, ``(n,
    k)``; not kept for Newton epochs), and where Newton epochs draw rows
    by it, each row's curvature into ``row_curvature`` (``(n,)``); the sums
    stay on the device in float64 until the pass ends, so the blocks add no
    host synchronization.
    No other n-sized temporaries are formed: the pass must not raise the
    fit's peak memory.
    """

    def __init__(self, ctx: StepContext, data: LocalData, n_samples: int, k: int) -> None:
        self.family = ctx.family
        self.target, self.sample_weight = data.target, data.sample_weight
        device = data.X.device
        # Newton epochs step from the full gradient alone: no row's derivative is kept.
        self.gradient = None
        if not ctx.newton:
            self.gradient = torch.empty((n_samples, k), dtype=ctx.policy.recurrence, device=device)
        self.row_curvature = None
        if ctx.samples_by_curvature:
            self.row_curvature = torch.empty(n_samples, dtype=ctx.policy.recurrence, device=device)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.weighted_sum = torch.zeros(k, dtype=ctx.policy.recurrence, device=device)
        self.loss_sum, self.rounding, self.raw_max = zero.clone(), zero.clone(), zero.clone()
        # The certificate's sums (the fused pass forms none: no certificate there).
        self.intercept_hessian = self.squared_traces = self.unseparated = None
        if ctx.certificate is not None and not ctx.fused_pass:
            self.intercept_hessian = torch.zeros((k, k), dtype=torch.float64, device=device)
            self.squared_traces = zero.clone()
        if ctx.penalty.alpha == 0.0 and ctx.family.labels and not ctx.fused_pass:
            self.unseparated = zero.clone()

    def replicated_sums(self, world: int) -> list[torch.Tensor]:
        """The certificate's and the separation's sums, each over ``world`` (to all-reduce)."""
        parts = [self.intercept_hessian, self.squared_traces, self.unseparated]
        return [part / world for part in parts if part is not None]

    def read_replicated(self, summed: torch.Tensor) -> RowSums:
        """:meth:`replicated_sums` back from the all-reduced values, as floats and tensors."""
        values = iter(summed.split([1] * summed.numel()))
        hessian = traces = unseparated = None
        if self.intercept_hessian is not None:
            k = self.intercept_hessian.shape[0]
            hessian = torch.cat([next(values) for _ in range(k * k)]).view(k, k)
            traces = next(values).item()
        if self.unseparated is not None:
            unseparated = next(values).item()
        return RowSums(hessian, traces, unseparated)

    def add_all(self, ctx: StepContext, X: torch.Tensor, state: ModelState) -> torch.Tensor:
        """Take every row at once from the fused pass (one launch); ``X^T (omega dl/dz)`` back."""
        scaling = ctx.row_scaling
        sums = pass_terms(
            self.family,
            X,
            self.target,
            self.sample_weight,
            state.coef.to(ctx.policy.update_accumulate).contiguous(),
            state.intercept,
            center=None if scaling is None else scaling.center,
            scale=None if scaling is None else scaling.scale,
            rows_dtype=ctx.policy.gram_input,
            gradient_out=self.gradient,
        )
        self.weighted_sum += sums.weighted_sum.to(self.weighted_sum.dtype)
        self.loss_sum += sums.loss_sum
        self.rounding += sums.rounding
        self.raw_max = torch.maximum(self.raw_max, sums.raw_max)
        return sums.transposed

    def add(self, lo: int, hi: int, raw: torch.Tensor) -> torch.Tensor:
        """Take the raw predictions of rows ``[lo, hi)``; their weighted derivatives back."""
        target, weight = self.target[lo:hi], self.sample_weight[lo:hi]
        gradient = self.family.gradient(raw, target)
        if self.gradient is not None:
            self.gradient[lo:hi] = gradient
        weighted = gradient * weight[:, None]
        traces = None
        if self.intercept_hessian is not None:
            hessian, traces = self.family.hessian_sums(raw, target, weight, gradient)
            self.intercept_hessian += hessian
            self.squared_traces += torch.linalg.vector_norm(traces, dtype=torch.float64).square()
        if self.row_curvature is not None:
            if traces is None:
                traces = self.family.hessian_diagonal(raw, target).sum(dim=1).mul_(weight)
            self.row_curvature[lo:hi] = traces
        if self.unseparated is not None:
            separated = self.family.separated(raw, target)
            self.unseparated += ((~separated) & (weight > 0)).sum()
        self.weighted_sum += weighted.sum(dim=0)
        weighted_losses = self.family.loss(raw, target).mul_(weight)
        self.loss_sum += weighted_losses.sum(dtype=torch.float64)
        # Each loss is rounded in its own value and through its raw prediction;
        # the rows' roundings are independent, so they add up in quadrature.
        self.rounding += torch.linalg.vector_norm(weighted_losses, dtype=torch.float64).square()
        self.rounding += torch.linalg.vector_norm(weighted * raw, dtype=torch.float64).square()
        if raw.numel():
            self.raw_max = torch.maximum(self.raw_max, raw.abs().max().to(torch.float64))
        return weighted


def row_blocks(
    ctx: StepContext,
    X: torch.Tensor | CSRMatrix,
    products_only: bool = False,
    chunk_values: int = CHUNK_VALUES,
):
    """``(start, stop, rows)`` over X in chunks, as the steps see the rows (update dtype).

    Dense rows that must be scaled or converted are written into one buffer
    that every chunk reuses (a fresh chunk-sized allocation per chunk cost
    more than the chunk's products on the CPU). A caller that only takes
    products of the rows (``products_only``: :func:`.._data.storage.matmul` and
    :func:`.._data.storage.transpose_matmul`) may get them as
    :class:`.._data.storage.CenteredRows`, scaled through the products. Chunks that
    are copies hold about ``chunk_values`` values.
    """
    acc = ctx.policy.update_accumulate
    if isinstance(X, CSRMatrix):
        start = 0
        for block in X.chunks(acc, ctx.centering):
            yield start, start + block.n_rows, block
            start += block.n_rows
        return
    centering = ctx.product_centering if products_only else None
    scaled = centering is None and ctx.row_scaling is not None
    views = X.dtype == acc and not scaled
    if views and products_only:
        step = min(_VIEW_CHUNK_VALUES // max(1, X.shape[1]), _VIEW_CHUNK_ROWS)
    else:
        step = chunk_values // max(1, X.shape[1])
    step = max(1, step)
    buffer = None
    for lo in range(0, X.shape[0], step):
        rows = X[lo : lo + step]
        if not views:
            if buffer is None:
                shape = (min(step, X.shape[0]), X.shape[1])
                buffer = torch.empty(shape, dtype=acc, device=X.device)
            out = buffer[: rows.shape[0]]
            rows = ctx.rows_into(rows, out) if scaled else out.copy_(rows)
        yield lo, lo + rows.shape[0], rows if centering is None else CenteredRows(rows, centering)


def raw_predictions(
    ctx: StepContext, X: torch.Tensor | CSRMatrix, state: ModelState
) -> torch.Tensor:
    """``X w + beta`` of every row, ``(n, k)`` in the recurrence dtype (one all-reduce)."""
    policy = ctx.policy
    coef = state.coef.to(policy.update_accumulate)
    raw = torch.empty((X.shape[0], coef.shape[1]), dtype=policy.recurrence, device=X.device)
    for lo, hi, rows in row_blocks(ctx, X, products_only=True):
        raw[lo:hi] = matmul(rows, coef)
    ctx.comm.all_reduce(raw)
    raw += state.intercept
    return raw


def held_out_score(ctx: StepContext, held_out: HeldOut, state: ModelState) -> float:
    """The estimator's score on the held-out rows at the current weights (equal on every rank)."""
    raw = raw_predictions(ctx, held_out.X, state).to(torch.float64).cpu().numpy()
    return ctx.family.score(raw, held_out.target, held_out.sample_weight)
