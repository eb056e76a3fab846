"""The curvature preconditioner: SVRG's full-batch epoch as a damped Newton step.

With batches of all ``n`` rows an SVRG epoch is one step along the full
gradient, which the snapshot's pass has already measured. Preconditioned by
the objective's curvature at the snapshot, that step is Newton's:

    [v; beta] <- [v; beta] - eta H~^{-1} [g_v; g_beta],

``H~`` the Hessian of the mean weighted loss in the steps' coordinates (the
Jacobi-scaled, centered columns of :class:`.state.Preconditioner`, plus a
column of ones for the intercept) and the L2 penalty's diagonal. SVRG's
epoch rules are the line search: an epoch that does not lower the exact
objective is undone and ``eta`` halved; ``eta`` grows back to 1 after
progress. The fit reaches the same optimum as the minibatch epochs (the
step's direction changes, not the objective or the stopping test), in a
handful of epochs on small or narrow data, where a minibatch epoch is
mostly fixed cost (``planner`` weighs both).

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
row) in one system of ``k (d+1)`` unknowns, whose formation costs ``m (k
(d+1))^2``: it is never formed. The step solves it by conjugate gradients
on its products (``4 m k (d+1)`` each, from the rows read again and each
row's ``p``), preconditioned by the classes' own ``(d+1) x (d+1)`` blocks
(``k`` of them, formed and factored as one output's curvature), to a
residual that shrinks with the gradient (inexact Newton). The coupled
Hessian is singular along a common shift of every class (the softmax does
not see it): the step along that shift is solved in closed form (the
penalty's alone, none for the intercepts) and the rest on the classes'
differences, so that rounding is not amplified along the shift.

On several ranks (dense rows) each rank holds a column block, and the
Hessian couples every column with every other: the curvature's rows (a
sample, or every row of a small X) are all-gathered whole once a
formation, their raw predictions are the snapshot's (summed by the pass),
and the full gradient (``d x k`` values) rides in the pass's statistics
all-reduce. Each rank sums its share of the gathered rows' curvature, one
all-reduce adds the shares, and every rank factors and solves the same
system and steps its own rows of the direction: one process's epochs,
with the pass and the formation split over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._data.storage import CSRMatrix, SparseRows, matmul, transpose_matmul
from .exchange import gather_blocks
from .snapshot import CHUNK_VALUES, raw_predictions, row_blocks
from .state import LocalData, ModelState, Snapshot, StepContext

# The factor is regularized by this fraction of its largest diagonal entry
# (and more, tenfold at a time, until Cholesky succeeds): a class or an
# intercept whose curvature vanishes (a separable class, alpha = 0) must not
# give an infinite step. SVRG's line search undoes a step that is too long.
_RIDGE = 1e-8
_RIDGE_TRIES = 8
# Most values of the weighted rows one product of the curvature reads (the
# blocks of several classes at once; more classes take several products).
_PRODUCT_VALUES = 1 << 22
# Rows of X per chunk of a curvature: each chunk's products are added to the
# float64 sums (d^2 values), so wide rows take chunks larger than the pass's;
# narrow ones keep the pass's values a chunk (the chunk and its weighted copy
# are the formation's temporaries).
_CURVATURE_CHUNK_ROWS = 4096
# Columns of a band of the curvature formed in one product: every block is
# symmetric, so band i is formed against the columns up to its own end only
# (about half the flops on wide rows) and mirrored once (:meth:`hessian`).
_BAND_COLUMNS = 128
# Most conjugate-gradient iterations of one Newton step of several classes.
_CG_MAX_ITERATIONS = 200
# Share of a sample drawn in proportion to the rows' curvature (the rest
# uniformly): the weights 1 / (n p_i) stay below 1 / (1 - share).
IMPORTANCE_SHARE = 0.5
# Offsets of successive formations' samples: multiples of the golden ratio's
# fraction, spread over [0, 1) whatever their number.
_GOLDEN_FRACTION = 0.6180339887498949

# A source of the curvature's rows: each call reads them again, in chunks
# ``(start, stop, rows)`` as the steps see them.
RowSource = Callable[[], Iterable[tuple[int, int, torch.Tensor]]]


@dataclass(frozen=True)
class NewtonSystem:
    """The curvature at a snapshot, as :func:`newton_step` solves it.

    Dense rows: ``factor`` holds the Cholesky factors of each class's own
    block, which is the system for one output and the conjugate gradients'
    preconditioner for several. Sparse rows: ``diagonal`` holds each
    class's diagonal (Jacobi), and conjugate gradients solve the system
    from its ``products`` (the curvature is never formed: ``d`` may be
    tens of thousands of columns).
    """

    # Cholesky factors of each class's own (d+1) block, (k, d+1, d+1) float64,
    # or None (sparse rows: the diagonal preconditions).
    factor: torch.Tensor | None
    # The L2 penalty's curvature per unknown of a class, (d+1,) float64 (0 for
    # the intercept).
    penalty: torch.Tensor
    # A common shift of every class is solved from the penalty alone, the
    # rest on the classes' differences (a class-shift-invariant loss).
    shift_apart: bool = False
    # The whole curvature's product with a (d+1, k) direction, which
    # conjugate gradients solve (:func:`_conjugate_gradients`); None: the
    # factor is the system.
    products: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Sparse rows: the curvature's diagonal with the penalty, (d+1, k) float64.
    diagonal: torch.Tensor | None = None

    def precondition(self, residual: torch.Tensor) -> torch.Tensor:
        """The preconditioner's solve for a ``(d+1, k)`` residual: the factor's, or Jacobi's."""
        if self.factor is None:
            return residual / self.diagonal
        return _solve_factored(self, residual)


class CurvatureProducts:
    """``V -> H~ V`` for ``V`` of ``(d+1, k)``: the coupled classes' curvature, never formed.

    Keeps each chunk's row Hessian products (``family.hessian_product``,
    ``(m, k)`` values a chunk) and weights, and reads the rows again from
    their source at every product: ``4 m k (d+1)`` multiply-adds, where
    forming the coupled system takes ``m (k (d+1))^2``.
    """

    def __init__(self, fit_intercept: bool) -> None:
        self.fit_intercept = fit_intercept
        self.row_products: list[tuple[Callable, torch.Tensor]] = []

    def add(self, row_product: Callable, weights: torch.Tensor) -> None:
        """Keep a chunk's ``z -> H_i z`` over its ``(m, k)`` raw directions, and its weights."""
        self.row_products.append((row_product, weights[:, None]))

    def multiply(self, rows_of: RowSource, n_samples: int, penalty: torch.Tensor) -> Callable:
        """``V -> (sum_i omega_i a_i (H_i V^T a_i)^T) / n + diag(penalty) V``, float64."""

        def multiply(direction: torch.Tensor) -> torch.Tensor:
            out = torch.zeros_like(direction)
            chunks = zip(rows_of(), self.row_products, strict=True)
            for (_, _, rows), (row_product, weights) in chunks:
                width = rows.shape[1]
                raw = matmul(rows, direction[:width].to(rows.dtype))
                if self.fit_intercept:
                    raw += direction[width].to(rows.dtype)
                weighted = row_product(raw) * weights
                out[:width] += transpose_matmul(rows, weighted).to(out.dtype)
                if self.fit_intercept:
                    out[width] += weighted.sum(dim=0).to(out.dtype)
            return out / max(n_samples, 1) + penalty[:, None] * direction

        return multiply


class CurvatureSums:
    """``sum_i omega_i h_ic a_i a_i^T`` per class c over chunks of rows, in float64.

    ``a_i`` is a row as the steps see it, with a 1 appended for the
    intercept, ``h_ic`` the second derivative of the loss in the row's raw
    prediction of class c (the diagonal of its ``k x k`` Hessian): one
    system of ``d + 1`` unknowns per class. With one output it is the
    curvature; with several, the classes' own blocks of it, which
    precondition the solve on its products (:class:`CurvatureProducts`).
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
        self.products = CurvatureProducts(fit_intercept) if n_outputs > 1 else None
        self.shift_apart = n_outputs > 1 and class_shift_invariant
        self.sums = torch.zeros(
            (n_outputs, self.size, self.size), dtype=torch.float64, device=device
        )

    def add(self, rows: torch.Tensor, curvature: torch.Tensor) -> None:
        """Add rows ``(m, d)`` with their weighted second derivatives ``(m, k)``.

        The chunk's products run in the rows' dtype, several classes' blocks
        in one; their sum is float64.
        """
        curvature = curvature.to(rows.dtype)
        blocks = self.sums.permute(1, 0, 2)  # (d+1, k, d+1)
        group = max(1, _PRODUCT_VALUES // max(1, rows.numel()))
        for lo in range(0, curvature.shape[1], group):
            hi = min(curvature.shape[1], lo + group)
            self._add_blocks(blocks[:, lo:hi], rows, curvature[:, lo:hi])

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
        """The mean curvature ``sums / n``, ``(k, d+1, d+1)`` float64, both triangles."""
        hessian = self.sums / max(n_samples, 1)
        width = self.size - int(self.fit_intercept)
        for lo in range(0, width, _BAND_COLUMNS):  # right of each band: the bands below, mirrored
            hi = min(width, lo + _BAND_COLUMNS)
            hessian[:, lo:hi, hi:width] = hessian[:, hi:width, lo:hi].transpose(1, 2)
        return hessian

    def factor(
        self, n_samples: int, penalty: torch.Tensor, rows_of: RowSource | None = None
    ) -> NewtonSystem:
        """Factor the mean plus the penalty's diagonal ``(d,)`` on every class.

        Several classes: ``rows_of`` reads the rows the sums were added from
        again, in the same chunks, for the curvature's products.
        """
        hessian = self.hessian(n_samples)
        penalty = penalty.to(torch.float64)
        if self.fit_intercept:
            penalty = torch.cat([penalty, penalty.new_zeros(1)])
        products = None
        if self.products is not None:
            assert rows_of is not None
            products = self.products.multiply(rows_of, n_samples, penalty)
        diagonal = hessian.diagonal(dim1=1, dim2=2)
        diagonal += penalty
        scale = diagonal.abs().amax(dim=1).clamp_(min=torch.finfo(torch.float64).tiny)
        own_diagonal = diagonal.clone()
        ridge, added = _RIDGE, 0.0
        for _ in range(_RIDGE_TRIES):
            diagonal += ((ridge - added) * scale)[:, None]
            added = ridge
            factor, info = torch.linalg.cholesky_ex(hessian)
            if not bool(info.any()):
                return NewtonSystem(factor, penalty, self.shift_apart, products)
            ridge *= 10.0
        # Rounding beyond repair (non-finite curvature): the diagonal alone.
        factor = torch.diag_embed((own_diagonal.clamp(min=0.0) + ridge * scale[:, None]).sqrt())
        return NewtonSystem(factor, penalty, self.shift_apart, products)


class CurvatureDiagonal:
    """The diagonal of each class's curvature, ``sum_i omega_i h_ic a_ij^2``, for sparse rows.

    ``a_i`` is a row as the steps see it (``(x - m) D^{-1}`` where
    preconditioned, which every unstored column of the row holds as
    ``-m / D``) with a 1 for the intercept. Each chunk adds the rows'
    weighted first and second moments of the stored values; the centered
    squares follow from them, in float64, with O(nnz) work. The products
    of the whole curvature (:class:`CurvatureProducts`) are kept beside it.
    """

    def __init__(self, width: int, n_outputs: int, fit_intercept: bool, device) -> None:
        self.fit_intercept = fit_intercept
        self.products = CurvatureProducts(fit_intercept)
        self.first = torch.zeros((width, n_outputs), dtype=torch.float64, device=device)
        self.second = torch.zeros_like(self.first)
        self.total = torch.zeros(n_outputs, dtype=torch.float64, device=device)
        self.centering = None

    def add(self, rows: SparseRows, curvature: torch.Tensor) -> None:
        """Add sparse rows with their weighted second derivatives ``(m, k)``."""
        plain = SparseRows(rows.crow, rows.row, rows.col, rows.values, rows.n_columns)
        weights = curvature.to(torch.float64)
        self.first += plain.transpose_matmul(weights)
        squares = SparseRows(
            rows.crow, rows.row, rows.col, rows.values.to(torch.float64).square(), rows.n_columns
        )
        self.second += squares.transpose_matmul(weights)
        self.total += weights.sum(dim=0)
        self.centering = rows.centering

    def factor(
        self, n_samples: int, penalty: torch.Tensor, rows_of: RowSource, shift_apart: bool
    ) -> NewtonSystem:
        """The system of conjugate gradients on the products, Jacobi-preconditioned."""
        penalty = penalty.to(torch.float64)
        first, second = self.first, self.second
        centering = self.centering
        if centering is not None:  # (x - m) / D: q = m / D, 1 / D
            inverse = centering.inverse_scale.to(torch.float64)[:, None]
            shift = centering.shift.to(torch.float64)[:, None]
            second = second * inverse.square() - 2.0 * shift * inverse * first
            second = second + shift.square() * self.total
        diagonal = second
        if self.fit_intercept:
            diagonal = torch.cat([diagonal, self.total[None, :]])
            penalty = torch.cat([penalty, penalty.new_zeros(1)])
        diagonal = diagonal.clamp(min=0.0) / max(n_samples, 1) + penalty[:, None]
        # A column no row stores and no penalty holds: any positive scale will do.
        diagonal = torch.where(diagonal > 0.0, diagonal, diagonal.new_ones(()))
        products = self.products.multiply(rows_of, n_samples, penalty)
        return NewtonSystem(None, penalty, shift_apart, products, diagonal)


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


def _curvature_rows(ctx: StepContext, X: torch.Tensor) -> RowSource:
    """X's rows as the steps see them, every column, read again at each call.

    One rank: X's chunks, scaled as they are read (nothing kept). Several:
    this rank's block of the rows, gathered whole once.
    """
    chunk_values = max(CHUNK_VALUES, _CURVATURE_CHUNK_ROWS * ctx.total_columns(X.shape[1]))
    if ctx.comm.world_size == 1:
        return lambda: row_blocks(ctx, X, chunk_values=chunk_values)
    block = torch.empty(X.shape, dtype=ctx.policy.update_accumulate, device=X.device)
    for lo, hi, rows in row_blocks(ctx, X, chunk_values=chunk_values):
        block[lo:hi] = rows
    gathered = [(0, X.shape[0], gather_blocks(ctx.comm, ctx.column_widths, block, 1))]
    return lambda: gathered


def newton_penalty(ctx: StepContext, width: int, device: torch.device) -> torch.Tensor:
    """The L2 penalty's curvature in the steps' coordinates, every rank's columns, ``(d,)``.

    ``alpha / D^2`` (alpha unscaled), float64; ``width`` is this rank's
    columns. Constant over a fit: on several ranks one all-gather, which
    the caller keeps.
    """
    penalty = torch.full((1, width), ctx.penalty.l2, dtype=torch.float64, device=device)
    if ctx.preconditioner is not None:
        penalty = penalty / ctx.preconditioner.scale.to(torch.float64).square()
    if ctx.comm.world_size > 1:
        penalty = gather_blocks(ctx.comm, ctx.column_widths, penalty, 1)
    return penalty[0]


def form_newton_system(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    sample: RowSample | None = None,
    penalty: torch.Tensor | None = None,
) -> NewtonSystem:
    """The curvature at the weights in ``state``, factored: the mean over X's rows ``sample``.

    ``sample`` None: every row. ``penalty`` is :func:`newton_penalty`
    (None: formed here). On several ranks the rows' raw predictions come
    from ``data.snapshot`` where it holds them (the state is at the
    snapshot), or from an all-reduce.
    """
    X, target, sample_weight = data.X, data.target, data.sample_weight
    summed = None  # several ranks: the raw predictions summed over the ranks' columns
    if ctx.comm.world_size > 1 and data.snapshot is not None:
        summed = data.snapshot.raw_predictions
    if sample is not None:  # copies of a few rows
        X, target, sample_weight = (
            a.index_select(0, sample.index) for a in (X, target, sample_weight)
        )
        if summed is not None:
            summed = summed.index_select(0, sample.index)
        if sample.scale is not None:
            sample_weight = sample_weight * sample.scale.to(sample_weight.dtype)
    if ctx.comm.world_size > 1 and summed is None:
        summed = raw_predictions(ctx, X, state)
    if penalty is None:
        penalty = newton_penalty(ctx, X.shape[1], X.device)
    n_samples = X.shape[0]
    if isinstance(X, CSRMatrix):
        return _sparse_newton_system(ctx, data, state, penalty)
    sums = CurvatureSums(
        ctx.total_columns(X.shape[1]),
        state.coef.shape[1],
        ctx.fit_intercept,
        X.device,
        ctx.family.class_shift_invariant,
    )
    rows_of = _curvature_rows(ctx, X)
    coef = state.coef.to(ctx.policy.update_accumulate)
    for lo, hi, rows in rows_of():
        if summed is None:
            raw = matmul(rows, coef).to(ctx.policy.recurrence).add_(state.intercept)
        else:
            raw = summed[lo:hi]
        weight = sample_weight[lo:hi]
        if sums.products is not None:
            sums.products.add(ctx.family.hessian_product(raw, target[lo:hi]), weight)
        # Several ranks hold the same gathered rows: each sums its share of them.
        share = slice(*_rank_share(ctx.comm.rank, ctx.comm.world_size, hi - lo))
        curvature = ctx.family.hessian_diagonal(raw[share], target[lo:hi][share])
        sums.add(rows[share], curvature * weight[share, None])
    if ctx.comm.world_size > 1:
        ctx.comm.all_reduce(sums.sums)
    return sums.factor(n_samples, penalty, rows_of)


def _sparse_newton_system(
    ctx: StepContext, data: LocalData, state: ModelState, penalty: torch.Tensor
) -> NewtonSystem:
    """The curvature of every sparse row at ``state``, as products and their diagonal.

    One rank: the chunks' raw predictions from their own products.
    """
    if ctx.comm.world_size > 1:
        raise ValueError("Newton epochs on sparse rows run on one rank.")
    X = data.X
    k = state.coef.shape[1]
    sums = CurvatureDiagonal(X.shape[1], k, ctx.fit_intercept, X.device)
    rows_of = _curvature_rows(ctx, X)
    coef = state.coef.to(ctx.policy.update_accumulate)
    for lo, hi, rows in rows_of():
        raw = matmul(rows, coef).to(ctx.policy.recurrence).add_(state.intercept)
        target, weight = data.target[lo:hi], data.sample_weight[lo:hi]
        sums.products.add(ctx.family.hessian_product(raw, target), weight)
        sums.add(rows, ctx.family.hessian_diagonal(raw, target) * weight[:, None])
    return sums.factor(X.shape[0], penalty, rows_of, ctx.family.class_shift_invariant and k > 1)


def _rank_share(rank: int, world_size: int, n_rows: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of ``n_rows`` that ``rank`` of ``world_size`` takes."""
    return rank * n_rows // world_size, (rank + 1) * n_rows // world_size


def newton_step(
    ctx: StepContext,
    state: ModelState,
    gradient: torch.Tensor,
    eta: float,
    system: NewtonSystem,
    gradient_unit: float = 1.0,
) -> torch.Tensor:
    """Step from the snapshot along ``-eta H~^{-1}`` times its full gradient, in place.

    The state is at the snapshot (an epoch starts there); ``gradient`` is
    its full gradient (:func:`full_gradient`: ``decay_alpha v + mu`` of
    every rank's columns, as the pass left it, ``mu`` carrying the rest of
    the penalty, see :func:`.snapshot.full_pass`, and ``mu_beta``);
    ``system`` is the curvature there (:func:`form_newton_system`). A rank
    steps its own rows.
    ``gradient_unit`` is the gradient's scale for the stopping test (the
    solve by conjugate gradients is as exact as the gradient is small in it).
    Returns the step subtracted, ``(d+1, k)`` float64 (every rank's columns).
    """
    width = ctx.total_columns(state.coef.shape[0])
    shift = None
    if system.shift_apart:
        # A common shift of the classes: its gradient is the penalty's (the
        # loss's is zero but for rounding), its curvature the penalty.
        shift = gradient.mean(dim=1, keepdim=True)
        gradient = gradient - shift
        penalty = system.penalty[:, None]
        shift = torch.where(penalty > 0, shift / penalty.clamp(min=1e-300), 0.0)
    if system.products is None:
        direction = system.precondition(gradient)
    else:
        direction = _conjugate_gradients(system, gradient, gradient_unit)
    if shift is not None:
        direction = direction - direction.mean(dim=1, keepdim=True) + shift
    step = eta * direction
    own = step[ctx.column_start : ctx.column_start + state.coef.shape[0]]
    state.coef.sub_(own.to(state.coef.dtype))
    if ctx.fit_intercept:
        state.intercept.sub_(step[width].to(state.intercept.dtype))
    return step


def full_gradient(ctx: StepContext, snapshot: Snapshot) -> torch.Tensor:
    """The snapshot's full gradient in the steps' coordinates, ``(d+1, k)`` float64.

    Every rank's columns (``Snapshot.newton_gradient``), then the
    intercepts' row where the fit has them.
    """
    gradient = snapshot.newton_gradient
    if ctx.fit_intercept:
        intercept = snapshot.mean_gradient_intercept.to(torch.float64)
        gradient = torch.cat([gradient, intercept[None, :]], dim=0)
    return gradient


def _solve_factored(system: NewtonSystem, gradient: torch.Tensor) -> torch.Tensor:
    """``factor^{-1} gradient`` for a ``(d+1, k)`` gradient: each class's own system."""
    factor = system.factor
    by_class = gradient.T.reshape(factor.shape[0], factor.shape[1], 1)
    return torch.cholesky_solve(by_class, factor).reshape(gradient.shape[1], -1).T


def _conjugate_gradients(
    system: NewtonSystem, gradient: torch.Tensor, gradient_unit: float = 1.0
) -> torch.Tensor:
    """The curvature's solve for ``gradient`` by conjugate gradients, inexactly.

    Preconditioned by the classes' own blocks (the factor); where the
    shift is solved apart, every vector stays on the classes' differences
    (the curvature maps them there). The relative residual stops at
    ``min(0.5, sqrt(max |gradient| / gradient_unit))``, as scikit-learn's
    newton-cg (whose unit is 1): loose far from the optimum, tight near it,
    where Newton's steps converge quadratically; SVRG's line search undoes
    a poor step. The unit keeps the iterations those of the same fit with
    every sample weight scaled.
    """
    multiply = system.products

    def precondition(residual: torch.Tensor) -> torch.Tensor:
        solved = system.precondition(residual)
        return solved - solved.mean(dim=1, keepdim=True) if system.shift_apart else solved

    forcing = min(0.5, (float(gradient.abs().max()) / gradient_unit) ** 0.5)
    bound = forcing * float(torch.linalg.vector_norm(gradient))
    direction = torch.zeros_like(gradient)
    residual = gradient.clone()
    search = precondition(residual)
    aligned = float((residual * search).sum())
    for _ in range(min(gradient.numel(), _CG_MAX_ITERATIONS)):
        product = multiply(search)
        curvature = float((search * product).sum())
        if not curvature > 0.0:  # rounding beyond the solve's reach
            break
        step = aligned / curvature
        direction.add_(search, alpha=step)
        residual.sub_(product, alpha=step)
        if float(torch.linalg.vector_norm(residual)) <= bound:
            break
        preconditioned = precondition(residual)
        aligned, previous = float((residual * preconditioned).sum()), aligned
        search = preconditioned.add_(search, alpha=aligned / previous)
    if not bool(direction.any()):  # no step taken: the preconditioner's own
        return precondition(gradient)
    return direction
