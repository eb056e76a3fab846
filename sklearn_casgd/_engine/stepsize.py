"""The default step size, from the expected smoothness of a minibatch.

Row i's loss has smoothness ``L_i = h_i (||x_i||^2 + fit_intercept)``, with
``h_i`` its sample weight times the family's curvature bound. A step of
``1 / L_max`` (the largest ``L_i``, as scikit-learn's SAG takes) is safe
but, on real data whose largest rows have 14-38x the mean squared norm,
tiny. For ``b`` rows drawn without replacement the minibatch loss has the
expected smoothness (Gower et al., "SGD: general analysis and improved
rates", ICML 2019, Proposition 3.8)

    L(b) = n (b - 1) / (b (n - 1)) L + (n - b) / (b (n - 1)) L_max,

between the full-data constant ``L`` (the largest eigenvalue of ``X~^T
diag(h) X~ / n``, ``X~`` with a column of ones for the intercept) and
``L_max``; the step is ``1 / L(b)`` (SVRG then lengthens it while epochs
make clear progress, see :mod:`.solver`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp
import torch
from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

from .._accel import sparse_steps
from .._data.storage import shared_tensor, squared_entries
from .reduction import ColumnReduction, WholeX, block_of

# Rows the Lanczos iteration reads at most: a subsample this large estimates L
# within the factor the step size leaves (from above: a sample's largest
# eigenvalue exceeds the whole data's; docs/tuning.md).
_MAX_EIGEN_ROWS = 1 << 14
# Lanczos (ARPACK) to this relative accuracy, in at least this many products;
# operators of at most that many unknowns are formed and solved directly.
_EIGEN_RTOL = 1e-2
_LANCZOS_VECTORS = 12
# The floor under D^2 of the preconditioner (see jacobi_preconditioner) is
# the lesser of two: the larger of these fractions of its largest and its
# median entry, ...
_SCALE_FLOOR = 1e-4
_MEDIAN_FLOOR = 1e-2
# ... and the D^2 that holds the steps' scalar decay alpha / min D^2 to this
# fraction of the intercept's curvature.
_DECAY_FRACTION = 1e-3
# Values per chunk of a pass over X: temporaries stay around 1 MiB; the
# column statistics' products take twice that (fewer, larger GEMMs).
_CHUNK_VALUES = 1 << 17
_MOMENT_CHUNK_VALUES = 1 << 18
# The column statistics are sums about the mean of this many first rows.
_SHIFT_ROWS = 1024


def eigen_rows(n_samples: int) -> slice:
    """The rows :func:`largest_eigenvalue` reads: at most ``_MAX_EIGEN_ROWS``, evenly spaced."""
    return slice(None, None, max(1, -(-n_samples // _MAX_EIGEN_ROWS)))


def largest_eigenvalue(
    X: np.ndarray,
    row_weight: np.ndarray,
    fit_intercept: bool,
    column_center: np.ndarray | None = None,
    column_scale: np.ndarray | None = None,
    reduction: ColumnReduction | None = None,
) -> float:
    """Largest eigenvalue of ``X~^T diag(row_weight) X~ / n`` (Lanczos, ARPACK).

    ``X~`` is X with a column of ones for the intercept; with
    ``column_center`` m and ``column_scale`` D, of the preconditioned
    ``(X - m) D^{-1}``, never formed: X is read as it is (a float32 X in
    float32 products, never upcast whole), at most ``2**14`` evenly spaced
    rows of it (a dense X through a strided view, which BLAS reads in place:
    a copy would add up to half of X to the fit's peak memory). With a
    ``reduction``, X is this rank's column block and every product is
    combined over the ranks (which all run the same iteration); the
    center and scale are of every column.
    """
    reduction = reduction or WholeX(X.shape[1])
    n_features = reduction.n_features
    inverse_scale = np.ones(n_features) if column_scale is None else 1.0 / column_scale
    center = block_of(np.zeros(n_features) if column_center is None else column_center, reduction)
    sample = eigen_rows(X.shape[0])
    X, row_weight = X[sample], np.asarray(row_weight[sample], dtype=np.float64)
    n_samples = X.shape[0]
    if sp.issparse(X):

        def forward(coef: np.ndarray) -> np.ndarray:
            return X @ coef.astype(X.dtype)

        def backward(projected: np.ndarray) -> np.ndarray:
            return X.T @ projected.astype(X.dtype)
    else:
        rows = shared_tensor(X)

        def forward(coef: np.ndarray) -> np.ndarray:
            return (rows @ torch.from_numpy(coef).to(rows.dtype)).to(torch.float64).numpy()

        def backward(projected: np.ndarray) -> np.ndarray:
            product = rows.T @ torch.from_numpy(projected).to(rows.dtype)
            return product.to(torch.float64).numpy()

    def curvature_times(vector: np.ndarray) -> np.ndarray:
        vector = np.asarray(vector, dtype=np.float64).ravel()
        coef_all = vector[:-1] * inverse_scale
        coef = block_of(coef_all, reduction)
        intercept = vector[-1] if fit_intercept else 0.0
        partial = forward(coef) - float(np.dot(center, coef))
        projected = (reduction.sum(partial) + intercept) * row_weight
        product = np.zeros(n_features + 1)
        local = backward(projected) - center * projected.sum()
        product[:-1] = reduction.gather_columns(local) * inverse_scale
        product[-1] = projected.sum() if fit_intercept else 0.0
        return product / max(n_samples, 1)

    size = n_features + 1
    if size <= _LANCZOS_VECTORS:  # as many products as Lanczos' first ones: solve it whole
        matrix = np.column_stack([curvature_times(column) for column in np.eye(size)])
        return max(float(np.linalg.eigvalsh((matrix + matrix.T) / 2)[-1]), 0.0)
    operator = LinearOperator((size, size), matvec=curvature_times, dtype=np.float64)
    start = np.random.default_rng(0).standard_normal(size)
    try:
        eigenvalue = eigsh(
            operator,
            k=1,
            which="LA",
            tol=_EIGEN_RTOL,
            ncv=_LANCZOS_VECTORS,
            v0=start,
            return_eigenvectors=False,
        )[0]
    except ArpackNoConvergence:
        # The trace bounds the largest eigenvalue of a PSD matrix from above:
        # a shorter step than the estimate's, never a longer one.
        squared = squared_row_norms(X, fit_intercept, column_center, column_scale, reduction)
        eigenvalue = float((row_weight * squared).sum()) / max(n_samples, 1)
    return max(float(eigenvalue), 0.0)


def expected_smoothness(
    full: float, largest_row: float, n_samples: float, batch_size: int
) -> float:
    """``L(b)`` of b-nice sampling from the full-data and the largest row smoothness.

    ``n_samples=inf`` is sampling from a stream whose rows these are a
    sample of: ``L(b) = (b-1)/b L + L_max / b``.
    """
    b, n = batch_size, n_samples
    if math.isinf(n):
        return (b - 1) / b * full + largest_row / b
    if n <= 1:
        return largest_row
    return n * (b - 1) / (b * (n - 1)) * full + (n - b) / (b * (n - 1)) * largest_row


class ColumnScaling(NamedTuple):
    """The Jacobi preconditioner's columns (:func:`jacobi_preconditioner`)."""

    center: np.ndarray  # (d,) m
    scale: np.ndarray  # (d,) D
    spread: np.ndarray  # (d,) each column's RMS about m (1 where it is 0)
    centered_squares: float  # ||X - m||_F^2 over every row and column


def jacobi_preconditioner(
    X: np.ndarray,
    row_curvature: np.ndarray,
    alpha: float,
    fit_intercept: bool,
    curvature_scale: float = 1.0,
    reduction: ColumnReduction | None = None,
) -> ColumnScaling:
    """Column center m and scale D of the preconditioned rows ``(x - m) D^{-1}``, and spread.

    The rows' curvature ``h`` is ``curvature_scale * row_curvature`` (a
    family's scalar times the sample weights, kept apart: their product
    would be one more n-sized array).

    The spread is each column's root mean square about m (1 where it is 0):
    the stopping test measures the gradient in those units, as on columns
    that StandardScaler had scaled.

    With an intercept, m is the curvature-weighted column mean: moving it
    into the intercept is an exact change of variables that removes the
    columns' common mode. ``D^2 = (sum_i h_i (x_i - m)^2 / n + alpha) / h``,
    with ``h`` the mean row curvature (the intercept's), is the objective's
    curvature bound per column relative to the intercept's, so the
    preconditioned columns have the intercept's curvature (data and penalty
    together) whatever their units. A constant column takes the median scale.

    The steps decay at ``alpha / min D^2`` (one scalar, see
    :class:`.state.Preconditioner`): a column whose curvature is mostly
    the penalty would set that rate near the intercept's curvature, and
    anchor every other column to the last snapshot. ``D^2`` is therefore
    floored at ``1000 alpha / h``, which holds the rate to ``h / 1000``,
    or if that is lower at the larger of ``1e-4`` of its largest value and
    ``1e-2`` of its median: the floor then costs the floored columns at most
    a factor ``1e4`` of curvature against the widest column, or ``100``
    against the median one (a few rare pixels of raw digits no longer set
    the rate for the rest).

    With a ``reduction``, X is this rank's column block: each rank forms
    its columns' moments and every rank gets all of them.
    """
    reduction = reduction or WholeX(X.shape[1])
    n_features = reduction.n_features
    if sp.issparse(X):  # O(nnz): the squares keep X's sparsity
        squared = squared_entries(entries_once(X))
        first, second = X.T @ row_curvature, squared.T @ row_curvature
        plain_first = np.asarray(X.sum(axis=0), dtype=np.float64).ravel()
        plain_second = np.asarray(squared.sum(axis=0), dtype=np.float64).ravel()
        del squared
        moments = np.stack([first, plain_first, second, plain_second])
    else:
        moments = _column_moments(X, row_curvature, _chunk_dtype(X))
        if not np.isfinite(moments).all():  # squares beyond float32's range
            moments = _column_moments(X, row_curvature, torch.float64)
    first, plain_first, second, plain_second = reduction.gather_columns(moments)
    first, second = curvature_scale * first, curvature_scale * second
    if not (np.isfinite(second).all() and np.isfinite(plain_second).all()):
        largest = reduction.max(float(np.abs(X.data if sp.issparse(X) else X).max(initial=0.0)))
        raise ValueError(
            f"X has values up to {largest:.3g} in absolute value, whose squares (times "
            "sample_weight) overflow float64 in the column statistics that SVRG scales "
            "the columns by. Scale the data (e.g. StandardScaler)."
        )
    total = curvature_scale * float(row_curvature.sum())
    center = first / total if fit_intercept and total > 0 else np.zeros(n_features)
    # sum_i h_i (x_ij - m_j)^2 = second_j - 2 m_j first_j + m_j^2 total
    diagonal = np.maximum(second - 2 * center * first + center**2 * total, 0.0)
    # Relative to the intercept's curvature (the mean row curvature), which is
    # not scaled: all of the problem then has one curvature scale, and
    # standardized columns keep D = 1 in every family.
    intercept_curvature = max(total / X.shape[0], np.finfo(float).tiny)
    squared = (diagonal / X.shape[0] + alpha) / intercept_curvature
    # The steps decay at the largest penalty curvature alpha / min D^2 (see
    # state.Preconditioner); a floor keeps one tiny column from setting a
    # rate that anchors all the others (unscaled breast_cancer: 2.4e-2 above
    # the optimum after 1000 epochs without it). In units of the intercept's
    # curvature, not of the widest column: 1e-4 of the largest D^2 alone
    # scaled every column of a table with one 1e4-wide one as if 100x wider
    # (docs/history.md, "SVRG's scale floor").
    varying = diagonal > 0.0
    largest = float(squared.max())
    typical = float(np.median(squared[varying])) if varying.any() else largest
    decay_floor = alpha / (_DECAY_FRACTION * intercept_curvature)
    relative_floor = max(_SCALE_FLOOR * largest, _MEDIAN_FLOOR * typical)
    squared = np.maximum(squared, min(relative_floor, decay_floor))
    # A column without data here (all equal to m) does not move in this fit,
    # but does in partial_fit's later chunks: it is scaled like the median
    # column, which neither sets the decay rate nor, as the widest column's
    # scale once did, keeps it from learning beside one wide column.
    squared[~varying] = np.median(squared[varying]) if varying.any() else 1.0
    scale = np.sqrt(squared)
    scale[scale == 0.0] = 1.0
    n = X.shape[0]
    spread_squared = np.maximum((plain_second - 2 * center * plain_first) / n + center**2, 0.0)
    spread = np.sqrt(spread_squared)
    spread[spread == 0.0] = 1.0
    return ColumnScaling(center, scale, spread, float(n * spread_squared.sum()))


def _column_moments(X: np.ndarray, row_curvature: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``sum h x``, ``sum x``, ``sum h x^2``, ``sum x^2`` per column of a dense X, ``(4, d)``.

    Each chunk's products run in ``dtype`` on x less a shift near each
    column's mean (the first rows' mean), so that float32 keeps the
    spread's digits; their sums are float64, as is the way back to x.
    """
    shift = np.asarray(X[:_SHIFT_ROWS].mean(axis=0), dtype=np.float64)
    firsts = torch.zeros((X.shape[1], 2), dtype=torch.float64)
    seconds = torch.zeros((X.shape[1], 2), dtype=torch.float64)
    weights = None
    for lo, chunk in _chunks(X, dtype, shift, _MOMENT_CHUNK_VALUES):
        if weights is None:  # (h, 1) per row, for one chunk at a time
            weights = torch.ones((chunk.shape[0], 2), dtype=dtype)
        weight = weights[: chunk.shape[0]]
        # Cast a chunk at a time (the weights may be the caller's read-only array).
        weight.numpy()[:, 0] = row_curvature[lo : lo + chunk.shape[0]]
        firsts += chunk.T @ weight
        seconds += chunk.square_().T @ weight
    totals = np.array([float(np.sum(row_curvature)), X.shape[0]])
    shift = shift[:, None]
    # sum w x = sum w (x - s) + s sum w; sum w x^2 = sum w (x - s)^2 + 2 s sum w x - s^2 sum w.
    # Beyond float64's range they are not finite, which the caller reports.
    with np.errstate(over="ignore", invalid="ignore"):
        firsts = firsts.numpy() + shift * totals
        seconds = seconds.numpy() + 2 * shift * firsts - shift**2 * totals
    return np.concatenate([firsts.T, seconds.T])


def largest_row_smoothness(
    X: np.ndarray,
    row_curvature: np.ndarray,
    fit_intercept: bool,
    column_center: np.ndarray | None = None,
    column_scale: np.ndarray | None = None,
    reduction: ColumnReduction | None = None,
) -> float:
    """``L_max = max_i h_i (||(x_i - m) / D||^2 + fit_intercept)``, in float64.

    Without ``column_center`` m and ``column_scale`` D, of the rows as they are.
    One process's dense X takes the maximum chunk by chunk: no n-sized array.
    """
    if not sp.issparse(X) and (reduction is None or isinstance(reduction, WholeX)):
        largest = [0.0]

        def take(lo: int, chunk_norms: torch.Tensor) -> None:
            if lo == 0:  # a float64 rerun starts over
                largest[0] = 0.0
            chunk_norms += float(fit_intercept)
            # A copy of the chunk's weights: they may be a read-only view (no weights).
            weights = np.array(row_curvature[lo : lo + chunk_norms.shape[0]], dtype=np.float64)
            chunk_norms *= torch.from_numpy(weights)
            largest[0] = max(largest[0], float(chunk_norms.max()) if chunk_norms.numel() else 0.0)

        _dense_row_norms(X, column_center, column_scale, take)
        return largest[0]
    squared = squared_row_norms(X, fit_intercept, column_center, column_scale, reduction)
    squared *= np.asarray(row_curvature, dtype=np.float64)  # in place: no n-sized temporary
    return float(squared.max(initial=0.0))


def entries_once(X: sp.spmatrix) -> sp.csr_matrix:
    """A sparse X as CSR with each entry stored once, for sums of squares.

    X itself where no row stores a column twice (numba's check, O(nnz)
    with no copy; unsorted indices are fine), else a canonical copy
    (without numba: wherever scipy cannot vouch that X is canonical,
    which takes a sort, as TF-IDF's unsorted indices do).
    """
    X = X.tocsr()
    if sparse_steps.has_duplicates(X) is False or X.has_canonical_format:
        return X
    X = X.copy()
    X.sum_duplicates()
    return X


# Stored values per row block when squaring a sparse X (a few MiB of float64).
_SPARSE_CHUNK_VALUES = 1 << 18


def squared_row_norms(
    X: np.ndarray,
    fit_intercept: bool,
    column_center: np.ndarray | None = None,
    column_scale: np.ndarray | None = None,
    reduction: ColumnReduction | None = None,
) -> np.ndarray:
    """``||(x_i - m) / D||^2 + fit_intercept`` of every row, ``(n,)`` float64, by chunks.

    With a ``reduction``, X is this rank's column block (m and D are of
    every column): the blocks' sums are added over the ranks.
    """
    reduction = reduction or WholeX(X.shape[1])
    column_center, column_scale = (block_of(v, reduction) for v in (column_center, column_scale))
    if sp.issparse(X):
        # ||(x - m) / D||^2 = sum x^2 / D^2 - 2 sum x m / D^2 + sum m^2 / D^2, in O(nnz).
        inverse = np.ones(X.shape[1]) if column_scale is None else 1.0 / column_scale**2
        X = entries_once(X)
        # By row blocks: the float64 squares of all of X at once cost more in
        # fresh pages than in arithmetic.
        norms = np.empty(X.shape[0])
        step = max(1, int(_SPARSE_CHUNK_VALUES * X.shape[0] / max(X.nnz, 1)))
        for lo in range(0, X.shape[0], step):
            norms[lo : lo + step] = squared_entries(X[lo : lo + step]) @ inverse
        if column_center is not None:
            center = column_center
            norms += center**2 @ inverse - 2.0 * (X @ (center * inverse))
        norms = reduction.sum(np.asarray(norms, dtype=np.float64))
        return np.maximum(norms, 0.0) + float(fit_intercept)
    norms = torch.empty(X.shape[0], dtype=torch.float64)

    def keep(lo: int, chunk_norms: torch.Tensor) -> None:
        norms[lo : lo + chunk_norms.shape[0]] = chunk_norms

    _dense_row_norms(X, column_center, column_scale, keep)
    summed = reduction.sum(norms.numpy())
    summed += float(fit_intercept)
    return summed


def _dense_row_norms(X: np.ndarray, center, scale, take) -> None:
    """``take(start, ||(x - m) / D||^2 of the chunk's rows)`` over a dense X, by chunks.

    In X's precision (float32 or float64); all again in float64 where
    float32's squares overflow (``take`` then sees every chunk twice).
    """
    for dtype in dict.fromkeys([_chunk_dtype(X), torch.float64]):
        if scale is not None:
            center_t, scale_t = (torch.from_numpy(v).to(dtype) for v in (center, scale))
        finite = True
        for lo, chunk in _chunks(X, dtype):
            if scale is not None:
                chunk.sub_(center_t).div_(scale_t)
            chunk_norms = torch.sum(chunk.square_(), dim=1, dtype=torch.float64)
            finite = finite and bool(torch.isfinite(chunk_norms).all())
            take(lo, chunk_norms)
        if finite:
            return


def squared_frobenius(
    X: np.ndarray | sp.spmatrix, reduction: ColumnReduction | None = None
) -> float:
    """``||X||_F^2`` (every rank's columns with a ``reduction``), in float64 by chunks."""
    reduction = reduction or WholeX(X.shape[1])
    if sp.issparse(X):
        # From the stored values alone: a scipy reduction over a matrix that
        # shares X's indices may sort them in place, which would reorder X's.
        total = float(np.square(entries_once(X).data, dtype=np.float64).sum())
    else:
        total = 0.0
        for dtype in dict.fromkeys([_chunk_dtype(X), torch.float64]):
            total = sum(
                float(torch.linalg.vector_norm(chunk, dtype=torch.float64).square())
                for _, chunk in _chunks(X, dtype)
            )
            if math.isfinite(total):
                break
    return float(reduction.sum(np.array([total]))[0])


def _chunk_dtype(X: np.ndarray) -> torch.dtype:
    """The dtype a dense X's chunks are read in: float32 for float32 X, else float64."""
    return torch.float32 if X.dtype == np.float32 else torch.float64


def _chunks(
    X: np.ndarray,
    dtype: torch.dtype,
    shift: np.ndarray | None = None,
    values: int = _CHUNK_VALUES,
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, rows)`` over a dense X in chunks, each a copy in ``dtype`` the caller may change.

    Less ``shift`` (per column) where given. Every chunk is written into
    one buffer (the caller's X is never changed, and a fresh chunk-sized
    temporary per chunk costs more than the chunk's arithmetic).
    """
    n_samples, n_features = X.shape
    rows = max(1, values // max(1, n_features))
    buffer = torch.empty((min(rows, n_samples), n_features), dtype=dtype)
    shift = None if shift is None else torch.from_numpy(shift).to(dtype)
    for lo in range(0, n_samples, rows):
        out, rows_read = buffer[: min(rows, n_samples - lo)], shared_tensor(X[lo : lo + rows])
        yield lo, out.copy_(rows_read) if shift is None else torch.sub(rows_read, shift, out=out)


@dataclass(frozen=True)
class Smoothness:
    """The loss's smoothness over all rows (``full``, L) and its largest row's (L_max).

    ``at(b)`` is the expected smoothness of a minibatch of b rows,
    :func:`expected_smoothness`; ``n_samples`` is inf for a stream
    (``partial_fit``'s first chunk stands for rows to come).
    """

    full: float
    largest_row: float
    n_samples: float
    # largest_row is of a sample of the rows: a lower bound of L_max, which
    # can tell a planner where minibatch steps lose but sets no step.
    sampled: bool = False

    def at(self, batch_size: int) -> float:
        if self.sampled:
            raise ValueError("A sampled L_max is a lower bound: no step is taken from it.")
        return expected_smoothness(self.full, self.largest_row, self.n_samples, batch_size)

    @property
    def ratio(self) -> float:
        """``L_max / L``: how much a small batch's steps are shortened by sampling."""
        return self.largest_row / self.full if self.full > 0.0 else 1.0


def loss_smoothness(
    X: np.ndarray,
    row_curvature: np.ndarray,
    *,
    fit_intercept: bool,
    column_center: np.ndarray | None = None,
    column_scale: np.ndarray | None = None,
    stream: bool = False,
    every_row: bool = True,
    full: float | None = None,
    curvature_scale: float = 1.0,
    reduction: ColumnReduction | None = None,
) -> Smoothness:
    """L and L_max of the loss alone: :func:`step_size` adds the L2 term.

    ``curvature_scale * row_curvature`` is each row's sample weight times
    the loss curvature (both are linear in it: the scalar is kept apart);
    the rows are ``(X - m) D^{-1}`` when ``column_center`` m and
    ``column_scale`` D precondition the steps. ``stream``: X is the first
    chunk of ``partial_fit``, a sample of rows to come, not all of them.
    ``every_row`` False: L_max of the rows L is measured on only
    (:func:`eigen_rows`), a lower bound of every row's (``sampled``). ``full``:
    L where it was measured already. ``reduction``: X is this rank's
    column block (:mod:`.reduction`).
    """
    sample = slice(None) if every_row else eigen_rows(X.shape[0])
    largest_row = curvature_scale * largest_row_smoothness(
        X[sample], row_curvature[sample], fit_intercept, column_center, column_scale, reduction
    )
    if not math.isfinite(largest_row):  # the step would be 0: nothing would move
        raise ValueError(
            "The rows' squared norms (times sample_weight) overflow float64, so no step "
            "size can be taken from them. Scale the data (e.g. StandardScaler)."
        )
    if full is None:
        full = curvature_scale * largest_eigenvalue(
            X, row_curvature, fit_intercept, column_center, column_scale, reduction
        )
    return Smoothness(full, largest_row, math.inf if stream else X.shape[0], not every_row)


def largest_step(alpha: float) -> float:
    """The longest step whose L2 decay factor ``1 - eta * alpha`` is still 1/2.

    A factor near 0 would make the s-step recurrence divide by products of
    s of them (``C_j``), which underflow float32 (alpha=1000, s=32: NaN).
    The auto step and the step's growth (:mod:`.fit`) both stop here.
    """
    return 0.5 / alpha if alpha > 0.0 else math.inf


def step_size(smoothness: float, alpha: float) -> float:
    """``1 / L(b)`` with the L2 term ``alpha`` added to ``smoothness`` (``Smoothness.at(b)``).

    At most :func:`largest_step`: where the penalty outweighs the loss (tiny
    sample weights, say) ``1 / (L + alpha)`` nears ``1 / alpha``.
    """
    total = smoothness + alpha
    if total <= 0.0:  # a loss that does not depend on the weights: any step is exact
        return 1.0
    return min(1.0 / total, largest_step(alpha))
