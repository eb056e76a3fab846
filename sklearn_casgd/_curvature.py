"""The curvature preconditioner: SVRG's full-batch epoch as a damped Newton step.

With batches of all ``n`` rows an SVRG epoch is one step along the full
gradient, which the snapshot's pass has already measured. Preconditioned by
the objective's curvature at the snapshot, that step is Newton's:

    [v; beta] <- [v; beta] - eta H~^{-1} [g_v; g_beta],

``H~`` the Hessian of the mean weighted loss in the steps' coordinates (the
Jacobi-scaled, centered columns of :class:`._kernel.Preconditioner`, plus a
column of ones for the intercept) and the L2 penalty's diagonal. SVRG's
epoch rules are the line search: an epoch that does not lower the exact
objective is undone and ``eta`` halved; ``eta`` grows back to 1 after
progress. The fit reaches the same optimum as the minibatch epochs (the
step's direction changes, not the objective or the stopping test), in a
handful of epochs on small or narrow data, where a minibatch epoch is
mostly fixed cost (``_planner`` weighs both).

The curvature is formed at the start of an epoch, from one more read of X
(the snapshot's pass only measures, so the pass that ends the fit forms
nothing), summed in the policy's accumulate dtype chunk by chunk into
float64 (it only preconditions: the gradient stays exact), and reused by
the epochs undone from the same snapshot; a constant Hessian (least
squares) is formed once a fit. On many rows it may be formed from a
sample of them drawn over X (:func:`sampled_rows`, the planner's choice):
the mean curvature of a few dozen rows per unknown steers nearly as well
as every row's, at a fraction of the ``n d^2`` work, and the exact gradient
keeps the optimum the same; each formation takes other rows.

The multinomial's Hessian couples the classes (``diag(p) - p p^T`` per
row): up to :data:`MAX_COUPLED_SIZE` unknowns the preconditioner is that
whole ``k (d+1)`` system; wider, it keeps the diagonal blocks, one ``(d+1)
x (d+1)`` system per class, whose cost grows with ``k`` and not ``k^2``
but whose steps converge linearly (:func:`couples_classes`). The coupled
Hessian is singular along a common shift of every class (the softmax does
not see it): the step along that shift is solved in closed form (the
penalty's alone, none for the intercepts) and the rest on the classes'
differences, so that rounding is not amplified along the shift.

On several ranks (dense rows) each rank holds a column block, and the
Hessian couples every column with every other: the curvature's rows (a
sample, or every row of a small X) are all-gathered whole once a
formation, and the full gradient (``d x k`` values) rides in the pass's
statistics all-reduce. Every rank then forms, factors and solves the same
system and steps its own rows of the direction: one process's epochs,
with the pass split over the ranks and a gather more a formation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._data import matmul
from ._kernel import LocalData, ModelState, StepContext, gather_blocks
from ._snapshot import raw_predictions, row_blocks

# The factor is regularized by this fraction of its largest diagonal entry
# (and more, tenfold at a time, until Cholesky succeeds): a class or an
# intercept whose curvature vanishes (a separable class, alpha = 0) must not
# give an infinite step. SVRG's line search undoes a step that is too long.
_RIDGE = 1e-8
_RIDGE_TRIES = 8
# Most unknowns k (d + 1) of a multinomial preconditioner that keeps the
# classes' coupling; wider ones are block-diagonal over the classes.
MAX_COUPLED_SIZE = 1024
# Most values of the weighted rows one product of the curvature reads (the
# blocks of several classes at once; more classes take several products).
_PRODUCT_VALUES = 1 << 22
# Values of X's rows per chunk of a curvature: each chunk's products are
# added to the float64 sums (d^2 values), so chunks are larger than the pass's.
_CURVATURE_CHUNK_VALUES = 1 << 21
# Columns of a band of the curvature formed in one product: every block is
# symmetric, so band i is formed against the columns up to its own end only
# (about half the flops on wide rows) and mirrored once (:meth:`hessian`).
_BAND_COLUMNS = 128
# Share of a sample drawn in proportion to the rows' curvature (the rest
# uniformly): the weights 1 / (n p_i) stay below 1 / (1 - share).
IMPORTANCE_SHARE = 0.5
# Offsets of successive formations' samples: multiples of the golden ratio's
# fraction, spread over [0, 1) whatever their number.
_GOLDEN_FRACTION = 0.6180339887498949


def couples_classes(n_outputs: int, width: float) -> bool:
    """Whether the preconditioner of ``n_outputs > 1`` classes keeps their coupling."""
    return n_outputs > 1 and n_outputs * (width + 1) <= MAX_COUPLED_SIZE


@dataclass(frozen=True)
class NewtonSystem:
    """The factored curvature at a snapshot, as :func:`newton_step` solves it."""

    # Cholesky factors, (blocks, m, m) float64: one system of k (d+1) unknowns
    # (class-major) where the classes are coupled, else one of d+1 per class.
    factor: torch.Tensor
    # The L2 penalty's curvature per unknown of a class, (d+1,) float64 (0 for
    # the intercept).
    penalty: torch.Tensor
    # The factor is of the classes' differences, and a common shift of every
    # class is solved from the penalty alone (a class-shift-invariant loss).
    shift_apart: bool = False


class CurvatureSums:
    """``sum_i omega_i H_i (x) a_i a_i^T`` over chunks of rows, in float64.

    ``a_i`` is a row as the steps see it, with a 1 appended for the
    intercept, ``H_i`` the ``k x k`` Hessian of the loss in the row's raw
    prediction. Coupled (:func:`couples_classes`), one system of ``k
    (d+1)`` unknowns, class-major; otherwise one of ``d + 1`` per class
    (``H_i``'s diagonal).
    """

    def __init__(
        self,
        width: int,
        n_outputs: int,
        fit_intercept: bool,
        device: torch.device,
        class_shift_invariant: bool = False,
    ) -> None:
        self.fit_intercept = fit_intercept
        self.size = width + int(fit_intercept)
        self.n_outputs = n_outputs
        self.coupled = couples_classes(n_outputs, width)
        self.shift_apart = self.coupled and class_shift_invariant
        blocks, size = (1, n_outputs * self.size) if self.coupled else (n_outputs, self.size)
        self.sums = torch.zeros((blocks, size, size), dtype=torch.float64, device=device)

    def add(self, rows: torch.Tensor, row_hessian: torch.Tensor) -> None:
        """Add rows ``(m, d)`` with their weighted Hessians ``(m, k, k)``.

        The chunk's products run in the rows' dtype; their sum is float64.
        Blocks come from one product per group of them: every class's own
        block, or coupled, a class's blocks against itself and the classes
        before it (the others are their transposes: :meth:`hessian`).
        """
        row_hessian = row_hessian.to(rows.dtype)
        k, size = row_hessian.shape[1], self.size
        if self.coupled:  # class c's blocks (c, 0..c): (d+1, c+1, d+1) and their weights
            blocks = self.sums[0].view(k, size, k, size)
            rows_of_blocks = [(blocks[c], row_hessian[:, c, : c + 1]) for c in range(k)]
        else:  # every class's own block, weighted by H_i's diagonal
            rows_of_blocks = [(self.sums.permute(1, 0, 2), row_hessian.diagonal(dim1=1, dim2=2))]
        group = max(1, _PRODUCT_VALUES // max(1, rows.numel()))
        for blocks, weights in rows_of_blocks:
            for lo in range(0, weights.shape[1], group):
                hi = min(weights.shape[1], lo + group)
                self._add_blocks(blocks[:, lo:hi], rows, weights[:, lo:hi])

    def _add_blocks(self, blocks: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> None:
        """``blocks[:, j] += [X 1]^T diag(weights[:, j]) [X 1]`` for each j, lower bands only.

        ``blocks`` is ``(d+1, g, d+1)`` (``d`` without an intercept),
        ``weights`` ``(m, g)``; X is never copied into ``[X 1]``. Band i
        of X's columns is formed against the columns before its end, in one
        product for the g blocks; :meth:`hessian` mirrors the rest.
        """
        n_rows, width = rows.shape
        groups = weights.shape[1]
        weighted = rows[:, None, :] * weights[:, :, None]
        for lo in range(0, width, _BAND_COLUMNS):
            hi = min(width, lo + _BAND_COLUMNS)
            # A view of the weighted rows for one block or the last band.
            columns = weighted[:, :, :hi].reshape(n_rows, groups * hi)
            products = rows[:, lo:hi].T @ columns
            blocks[lo:hi, :, :hi] += products.view(hi - lo, groups, hi)
        if self.fit_intercept:
            columns = weights.T @ rows  # the weighted rows' column sums, (g, d)
            blocks[:width, :, width] += columns.T
            blocks[width, :, :width] += columns
            blocks[width, :, width] += weights.sum(dim=0)

    def hessian(self, n_samples: int) -> torch.Tensor:
        """The mean curvature ``sums / n``, ``(blocks, m, m)`` float64, both triangles."""
        hessian = self.sums / max(n_samples, 1)
        width, size, k = self.size - int(self.fit_intercept), self.size, self.n_outputs
        # Every (d+1) block is symmetric: (system or class, row, class, column).
        pairs = hessian.view(k, size, k, size) if self.coupled else hessian.view(-1, size, 1, size)
        for lo in range(0, width, _BAND_COLUMNS):  # right of each band: the bands below, mirrored
            hi = min(width, lo + _BAND_COLUMNS)
            pairs[:, lo:hi, :, hi:width] = pairs[:, hi:width, :, lo:hi].permute(0, 3, 2, 1)
        if self.coupled:
            for c in range(1, k):  # block (o, c) of o < c is block (c, o) transposed
                pairs[:c, :, c, :] = pairs[c, :, :c, :].permute(1, 2, 0)
        return hessian

    def factor(self, n_samples: int, penalty: torch.Tensor) -> NewtonSystem:
        """Factor the mean plus the penalty's diagonal ``(d,)`` on every class."""
        hessian = self.hessian(n_samples)
        penalty = penalty.to(torch.float64)
        if self.fit_intercept:
            penalty = torch.cat([penalty, penalty.new_zeros(1)])
        diagonal = hessian.diagonal(dim1=1, dim2=2)
        diagonal += penalty.repeat(hessian.shape[1] // self.size)
        scale = diagonal.abs().amax(dim=1).clamp_(min=torch.finfo(torch.float64).tiny)
        own_diagonal = diagonal.clone()
        if self.shift_apart:
            # Curvature along each common shift (every block's diagonal): the
            # solve then sees the classes' differences only (a shift is solved
            # apart, newton_step).
            k = self.n_outputs
            blocks = hessian[0].view(k, self.size, k, self.size)
            blocks.diagonal(dim1=1, dim2=3).add_(float(scale[0]) / k)
        ridge, added = _RIDGE, 0.0
        for _ in range(_RIDGE_TRIES):
            diagonal += ((ridge - added) * scale)[:, None]
            added = ridge
            factor, info = torch.linalg.cholesky_ex(hessian)
            if not bool(info.any()):
                return NewtonSystem(factor, penalty, self.shift_apart)
            ridge *= 10.0
        # Rounding beyond repair (non-finite curvature): the diagonal alone.
        factor = torch.diag_embed((own_diagonal.clamp(min=0.0) + ridge * scale[:, None]).sqrt())
        return NewtonSystem(factor, penalty, self.shift_apart)


class RowSample(NamedTuple):
    """The rows a curvature is formed from, and the factor on each row's weight."""

    index: torch.Tensor  # (m,) rows of X, ascending (a row may repeat)
    # (m,) 1 / (n p_i) for rows drawn with probabilities p (None: uniformly):
    # the weighted mean over the sample estimates the mean over X.
    scale: torch.Tensor | None = None


def sampled_rows(
    n_samples: int,
    rows: int | None,
    formation: int,
    device: torch.device,
    curvature: torch.Tensor | None = None,
) -> RowSample | None:
    """The rows that curvature number ``formation`` of a fit is formed from (None: all).

    Every row where ``rows`` is None or more than half of them. Otherwise
    ``rows`` rows spread evenly over X from an offset that moves with
    ``formation``, so that a fit's successive curvatures see other rows.
    Given each row's ``curvature`` (its weighted Hessian's trace),
    :data:`IMPORTANCE_SHARE` of them are drawn in proportion to it instead
    (evenly spaced through its cumulative sum), and every row is weighted
    by ``1 / (n p_i)``, ``p_i`` the mixture of both draws' probabilities:
    an unbounded curvature (the log link's ``exp(z)``) sits in few rows,
    which an even spread mostly misses.
    """
    if rows is None or 2 * rows > n_samples:
        return None
    if curvature is not None:
        cumulative = torch.cumsum(curvature, dim=0, dtype=torch.float64)
        total = cumulative[-1]
        if bool(torch.isfinite(total)) and float(total) > 0.0:
            by_curvature = round(IMPORTANCE_SHARE * rows)
            offset = (formation * _GOLDEN_FRACTION) % 1.0
            steps = torch.arange(by_curvature, dtype=torch.float64, device=cumulative.device)
            points = (steps + offset) * (total / by_curvature)
            drawn = torch.searchsorted(cumulative, points, right=True).clamp_(max=n_samples - 1)
            spread = _spread_rows(n_samples, rows - by_curvature, formation, device)
            index = torch.cat([drawn.to(device), spread]).sort().values
            share = curvature[index].to(torch.float64) / total
            probability = IMPORTANCE_SHARE * share + (1.0 - IMPORTANCE_SHARE) / n_samples
            return RowSample(index, 1.0 / (n_samples * probability))
    return RowSample(_spread_rows(n_samples, rows, formation, device))


def _spread_rows(n_samples: int, rows: int, formation: int, device: torch.device) -> torch.Tensor:
    """``rows`` rows evenly spaced over ``n_samples``, from the offset of ``formation``."""
    offset = formation % (n_samples // rows)
    return torch.arange(rows, device=device) * n_samples // rows + offset


def _rows_with_raw(ctx: StepContext, X: torch.Tensor, state: ModelState):
    """``(start, stop, rows, raw)`` over X: rows as the steps see them, every column.

    One rank: X's chunks as they are read. Several: this rank's block of
    the rows, gathered whole, and the raw predictions summed over the ranks.
    """
    acc, rec = ctx.policy.update_accumulate, ctx.policy.recurrence
    if ctx.comm.world_size == 1:
        coef = state.coef.to(acc)
        for lo, hi, rows in row_blocks(ctx, X, chunk_values=_CURVATURE_CHUNK_VALUES):
            yield lo, hi, rows, matmul(rows, coef).to(rec).add_(state.intercept)
        return
    block = torch.empty(X.shape, dtype=acc, device=X.device)
    for lo, hi, rows in row_blocks(ctx, X, chunk_values=_CURVATURE_CHUNK_VALUES):
        block[lo:hi] = rows
    raw = raw_predictions(ctx, X, state)
    yield 0, X.shape[0], gather_blocks(ctx.comm, ctx.column_widths, block, 1), raw


def form_newton_system(
    ctx: StepContext, data: LocalData, state: ModelState, sample: RowSample | None = None
) -> NewtonSystem:
    """The curvature at the weights in ``state``, factored: the mean over X's rows ``sample``.

    ``sample`` None: every row.
    """
    X, target, sample_weight = data.X, data.target, data.sample_weight
    if sample is not None:  # copies of a few rows
        X, target, sample_weight = (
            a.index_select(0, sample.index) for a in (X, target, sample_weight)
        )
        if sample.scale is not None:
            sample_weight = sample_weight * sample.scale.to(sample_weight.dtype)
    n_samples = X.shape[0]
    sums = CurvatureSums(
        ctx.total_columns(X.shape[1]),
        state.coef.shape[1],
        ctx.fit_intercept,
        X.device,
        ctx.family.class_shift_invariant,
    )
    for lo, hi, rows, raw in _rows_with_raw(ctx, X, state):
        hessian = ctx.family.row_hessian(raw, target[lo:hi])
        sums.add(rows, hessian * sample_weight[lo:hi, None, None])
    # The penalty's curvature in the steps' coordinates: alpha / D^2 (alpha unscaled).
    penalty = torch.full((1, X.shape[1]), ctx.alpha, dtype=torch.float64, device=X.device)
    if ctx.preconditioner is not None:
        penalty = penalty / ctx.preconditioner.scale.to(torch.float64).square()
    if ctx.comm.world_size > 1:
        penalty = gather_blocks(ctx.comm, ctx.column_widths, penalty, 1)
    return sums.factor(n_samples, penalty[0])


def newton_step(
    ctx: StepContext, data: LocalData, state: ModelState, eta: float, system: NewtonSystem
) -> None:
    """Step from the snapshot along ``-eta H~^{-1}`` times its full gradient, in place.

    The state is at the snapshot (an epoch starts there): its gradient in
    the steps' coordinates is ``decay_alpha v + mu`` of every rank's
    columns, as the pass left it (``mu`` carries the rest of the penalty,
    see :func:`._snapshot.full_pass`), and ``mu_beta``; ``system`` is the
    curvature there (:func:`form_newton_system`). A rank steps its own rows.
    """
    snapshot = data.snapshot
    gradient = snapshot.newton_gradient  # every rank's columns
    width = gradient.shape[0]
    if ctx.fit_intercept:
        intercept = snapshot.mean_gradient_intercept.to(torch.float64)
        gradient = torch.cat([gradient, intercept[None, :]], dim=0)
    shift = None
    if system.shift_apart:
        # A common shift of the classes: its gradient is the penalty's (the
        # loss's is zero but for rounding), its curvature the penalty.
        shift = gradient.mean(dim=1, keepdim=True)
        gradient = gradient - shift
        penalty = system.penalty[:, None]
        shift = torch.where(penalty > 0, shift / penalty.clamp(min=1e-300), 0.0)
    # Class-major: one (d1,) system per class, or one (k d1,) for coupled classes.
    factor = system.factor
    by_class = gradient.T.reshape(factor.shape[0], factor.shape[1], 1)
    direction = torch.cholesky_solve(by_class, factor).reshape(gradient.shape[1], -1).T
    if shift is not None:
        direction = direction - direction.mean(dim=1, keepdim=True) + shift
    own = direction[ctx.column_start : ctx.column_start + state.coef.shape[0]]
    state.coef.sub_((eta * own).to(state.coef.dtype))
    if ctx.fit_intercept:
        state.intercept.sub_((eta * direction[width]).to(state.intercept.dtype))
