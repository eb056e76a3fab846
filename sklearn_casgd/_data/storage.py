"""A rank's rows of X as the engine touches them: dense tensors or CSR.

The engine does five things with X: it gathers an outer iteration's rows,
forms their Gram blocks, multiplies rows by the weights (margins), multiplies
residuals by the rows' transpose (the update ``Y^T U``), and passes over
every row in chunks (the full pass, early stopping's score). A dense X is a
torch tensor and those are plain tensor operations (the compiled path
needs them so). A sparse X is a :class:`CSRMatrix`; its gathered rows are
:class:`SparseRows`, whose operations cost O(nnz) and never form a dense
row.

Preconditioned steps see the rows ``(x - m) D^{-1}``. A dense X that the
engine copies into a narrower dtype anyway is stored that way
(:func:`stores_preconditioned`, :func:`storage_chunks`); one shared with
the caller is scaled as it is read (:meth:`.._engine.state.StepContext.rows`).
Sparse rows stay sparse and the centering is applied implicitly: with
``Z = Y D^{-1}`` (the values scaled) and ``q = m D^{-1}``,

    Y~ W = Z W - 1 (q . W),    Y~^T U = Z^T U - q (1^T U),
    Y~ Y~^T = Z Z^T - a 1^T - 1 a^T + (q . q) 1 1^T,   a = Z q.

:func:`matmul`, :func:`transpose_matmul` and :func:`row_chunks` take
either kind, so the kernel has one code path per operation.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

# Stored values per chunk of a pass over a sparse X (the dense pass chunks by
# rows in _snapshot): temporaries of a chunk stay around a few MiB.
_CHUNK_NNZ = 1 << 18
# Stored values from which a block's products go through scipy (SparseRows).
_SCIPY_VALUES = 1 << 14
# Values per chunk when a dense X is converted to its storage: the float64
# temporary of a chunk stays at 1 MiB whatever the width, so that it does not
# show in a bf16 fit's peak memory (docs/tuning.md).
_STORE_CHUNK_VALUES = 1 << 17


def shared_tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``array``'s memory, also when the array is read-only.

    For X only: the engine never writes into X, so a read-only array (a
    memmap, a pandas column) is shared as it is; torch's warning about
    writing to it does not apply.
    """
    if any(stride < 0 for stride in array.strides):
        array = np.ascontiguousarray(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writ")
        return torch.from_numpy(array)


def stores_preconditioned(X: np.ndarray | sp.spmatrix, storage: torch.dtype) -> bool:
    """Whether a preconditioned fit stores X's rows as ``(x - m) D^{-1}``, not as they are.

    Where the engine copies a dense X into a narrower dtype anyway, it rounds
    the preconditioned rows instead of the raw ones: bfloat16 keeps 8
    significant bits of a value, so a column 1000 + N(0, 1) rounded raw
    (spacing 8) loses most of its spread, and rounded after the centering
    none of it. The steps and the full pass then read the rows as stored.
    A dense X in the storage dtype is shared with the caller (no copy) and
    a sparse one stays sparse (centering would fill it in): their rows are
    preconditioned as they are read.
    """
    return not sp.issparse(X) and storage.itemsize < X.dtype.itemsize


def storage_chunks(
    X: np.ndarray,
    dtype: torch.dtype,
    center: np.ndarray | None = None,
    scale: np.ndarray | None = None,
    device: torch.device | None = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, stop, rows)`` of a dense X as the engine stores them, a few MiB at a time.

    With the center m and scale D of a preconditioner the rows are
    ``(x - m) D^{-1}``, computed in float64 from the caller's values and
    rounded once to ``dtype``, on ``device`` (the CPU by default: a GPU
    receives the caller's values and converts them itself). ``X`` may be a
    strided view (a column block); it is never written to.
    """
    device = torch.device("cpu") if device is None else device
    step = max(1, _STORE_CHUNK_VALUES // max(1, X.shape[1]))
    if scale is not None:
        center64 = torch.from_numpy(center).to(device)
        scale64 = torch.from_numpy(scale).to(device)
    for start in range(0, X.shape[0], step):
        rows = shared_tensor(X[start : start + step]).to(device)
        if scale is not None:  # one float64 temporary, scaled in place
            rows = rows.to(torch.float64, copy=True).sub_(center64).div_(scale64)
        yield start, start + rows.shape[0], rows.to(dtype)


def squared_entries(X: sp.csr_matrix) -> sp.csr_matrix:
    """A CSR ``X`` with every stored value squared, in float64; shares X's indices.

    float64: no square overflows, and products with float64 vectors run
    without scipy upcasting the whole matrix first. Only for products and
    sums along an axis: scipy's operations that canonicalize a matrix
    (``sum()`` of every value, ``sort_indices``, ``sum_duplicates``) would
    sort the shared indices in place, and with them the indices of X.
    """
    squares = np.square(X.data, dtype=np.float64)
    return sp.csr_matrix((squares, X.indices, X.indptr), shape=X.shape)


@dataclass(frozen=True)
class Centering:
    """The preconditioner as sparse rows need it: ``1 / D`` and ``q = m / D``."""

    inverse_scale: torch.Tensor  # (d_local,)
    shift: torch.Tensor  # (d_local,) q = m / D

    @classmethod
    def of(cls, center: torch.Tensor, scale: torch.Tensor) -> Centering:
        inverse = 1.0 / scale
        return cls(inverse, center * inverse)


@dataclass(frozen=True)
class CSRMatrix:
    """One rank's column block of a sparse X in compressed sparse row form.

    ``crow`` (n + 1,) is int64, ``col`` (nnz,) int32 where the columns fit
    (half the bytes a value of index takes, and the epoch kernel reads one
    per stored value twice a step), ``values`` (nnz,) in the storage dtype;
    memory is O(nnz + n).
    """

    crow: torch.Tensor
    col: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_scipy(cls, X: sp.spmatrix, device: torch.device, dtype: torch.dtype) -> CSRMatrix:
        """``X`` (any scipy sparse format) as CSR tensors on ``device`` in ``dtype``.

        Shares X's indices (int32 ones) and values (of ``dtype``) with the
        caller, never written to. Unsorted or duplicate entries are kept as
        they are: every product is linear in the stored values, so a
        duplicate acts as their sum, as in scipy's arithmetic.
        """
        X = sp.csr_matrix(X)
        index = np.int32 if X.shape[1] <= np.iinfo(np.int32).max else np.int64
        return cls(
            torch.from_numpy(X.indptr.astype(np.int64)).to(device),
            # Shared with X where it has that dtype already (never written to).
            shared_tensor(X.indices.astype(index, copy=False)).to(device),
            shared_tensor(X.data).to(device=device, dtype=dtype),
            (int(X.shape[0]), int(X.shape[1])),
        )

    @property
    def device(self) -> torch.device:
        return self.values.device

    def to(self, device: torch.device) -> CSRMatrix:
        """The same matrix on ``device`` (as ``torch.Tensor.to``)."""
        return CSRMatrix(
            self.crow.to(device), self.col.to(device), self.values.to(device), self.shape
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def is_cuda(self) -> bool:
        return self.values.is_cuda

    def row_slice(self, start: int, stop: int) -> CSRMatrix:
        """Rows ``[start, stop)``; shares the column indices and values (no copy)."""
        lo, hi = int(self.crow[start]), int(self.crow[stop])
        return CSRMatrix(
            self.crow[start : stop + 1] - lo,
            self.col[lo:hi],
            self.values[lo:hi],
            (stop - start, self.shape[1]),
        )

    def gather(
        self, rows: torch.Tensor, dtype: torch.dtype, centering: Centering | None
    ) -> SparseRows:
        """The rows ``rows`` (in that order) with values in ``dtype``."""
        rows = rows.to(torch.int64)
        starts = self.crow.index_select(0, rows)
        lengths = self.crow.index_select(0, rows + 1) - starts
        ends = torch.cumsum(lengths, 0)
        total = int(ends[-1]) if rows.numel() else 0
        row = torch.repeat_interleave(
            torch.arange(rows.numel(), device=self.device), lengths, output_size=total
        )
        position = torch.arange(total, device=self.device) + torch.repeat_interleave(
            starts - (ends - lengths), lengths, output_size=total
        )
        crow = torch.cat([ends.new_zeros(1), ends])
        # index_select, not advanced indexing: 2x faster on these small index vectors.
        values = self.values.index_select(0, position).to(dtype)
        return SparseRows(
            crow, row, self.col.index_select(0, position), values, self.shape[1], centering
        )

    def chunks(self, dtype: torch.dtype, centering: Centering | None) -> Iterator[SparseRows]:
        """Consecutive row blocks of about ``_CHUNK_NNZ`` stored values, in ``dtype``."""
        n_rows = self.shape[0]
        per_row = max(1.0, self.values.numel() / max(1, n_rows))
        step = max(1, int(_CHUNK_NNZ / per_row))
        for lo in range(0, n_rows, step):
            block = self.row_slice(lo, min(n_rows, lo + step))
            yield SparseRows(
                block.crow, None, block.col, block.values.to(dtype), self.shape[1], centering
            )


@dataclass(frozen=True)
class SparseRows:
    """A few rows of a :class:`CSRMatrix`, preconditioned implicitly when ``centering`` is set.

    ``crow`` is the block's row pointer; ``row`` names each stored value's
    row (0-based within the block), or is None to be formed from ``crow``
    where needed (:attr:`value_rows`: the CPU's products do not need it);
    ``values`` are in the dtype the products run in.
    """

    crow: torch.Tensor
    row: torch.Tensor | None
    col: torch.Tensor
    values: torch.Tensor
    n_columns: int
    centering: Centering | None = None

    @property
    def n_rows(self) -> int:
        return self.crow.numel() - 1

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_rows, self.n_columns

    @functools.cached_property
    def value_rows(self) -> torch.Tensor:
        """Each stored value's row: ``row``, else formed from ``crow``."""
        if self.row is not None:
            return self.row
        lengths = self.crow[1:] - self.crow[:-1]
        return torch.repeat_interleave(
            torch.arange(self.n_rows, device=self.crow.device),
            lengths,
            output_size=self.values.numel(),
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def _scaled_values(self) -> torch.Tensor:
        """The values of ``Z = Y D^{-1}``."""
        if self.centering is None:
            return self.values
        return self.values * self.centering.inverse_scale.to(self.dtype).index_select(0, self.col)

    @property
    def _through_scipy(self) -> bool:
        """Whether the products go through scipy: CPU blocks of many values (a pass's chunks).

        scipy's loops beat torch's CPU ``index_add_`` several times over
        (with int32 indices most), but a scipy matrix costs tens of
        microseconds to make: a step's few rows take torch's, on int64 indices.
        """
        return self.values.device.type == "cpu" and self.values.numel() >= _SCIPY_VALUES

    def _scipy(self, values: torch.Tensor) -> sp.csr_matrix:
        """These rows with ``values`` as a scipy CSR matrix over the same memory (CPU)."""
        crow = self.crow.to(self.col.dtype)  # scipy takes one index dtype; n_rows + 1 values
        return sp.csr_matrix(
            (values.numpy(), self.col.numpy(), crow.numpy()), shape=(self.n_rows, self.n_columns)
        )

    def matmul(self, weights: torch.Tensor) -> torch.Tensor:
        """``Y~ W``, ``(n_rows, k)`` in ``weights``' dtype."""
        values = self._scaled_values().to(weights.dtype)
        if self._through_scipy:
            out = torch.from_numpy(self._scipy(values) @ weights.numpy())
        else:
            col = self.col.to(torch.int64)
            out = weights.new_zeros((self.n_rows, weights.shape[1]))
            out.index_add_(0, self.value_rows, values[:, None] * weights.index_select(0, col))
        if self.centering is not None:
            out -= self.centering.shift.to(weights.dtype) @ weights
        return out

    def transpose_matmul(self, residuals: torch.Tensor) -> torch.Tensor:
        """``Y~^T U``, ``(n_columns, k)`` in ``residuals``' dtype."""
        values = self._scaled_values().to(residuals.dtype)
        if self._through_scipy:
            out = torch.from_numpy(self._scipy(values).T @ residuals.numpy())
        else:
            col = self.col.to(torch.int64)
            out = residuals.new_zeros((self.n_columns, residuals.shape[1]))
            out.index_add_(0, col, values[:, None] * residuals.index_select(0, self.value_rows))
        if self.centering is not None:
            out -= self.centering.shift.to(residuals.dtype)[:, None] * residuals.sum(dim=0)
        return out

    def gram(self, rounding: torch.dtype, accumulate: torch.dtype) -> torch.Tensor:
        """``Y~ Y~^T``, dense ``(n_rows, n_rows)`` in ``accumulate``.

        The scaled values are rounded to ``rounding`` first (the Gram input
        dtype of the precision policy), as dense rows are.
        """
        values = self._scaled_values().to(rounding).to(accumulate)
        gram = _sparse_gram(self.crow, self.col, values, (self.n_rows, self.n_columns))
        if self.centering is not None:
            shift = self.centering.shift.to(rounding).to(accumulate)
            products = values * shift.index_select(0, self.col)
            projected = values.new_zeros(self.n_rows).index_add_(0, self.value_rows, products)
            gram -= projected[:, None] + projected[None, :]
            gram += shift.square().sum()
        return gram


def _sparse_gram(
    crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """``Z Z^T`` of the CSR rows ``(crow, col, values)``, dense, in ``values``' dtype.

    On the CPU through scipy: torch's CSR x CSR product (MKL) leaked about
    0.6 MB per call (torch 2.13: 290 MB over 500 Grams of 256 rows), and
    scipy's took a quarter of its time. Elsewhere torch's (cuSPARSE).
    """
    if values.device.type == "cpu":
        Z = sp.csr_matrix((values.numpy(), col.numpy(), crow.numpy()), shape=shape)
        return torch.from_numpy((Z @ Z.T).toarray())
    with warnings.catch_warnings():  # torch calls its sparse CSR support "beta"
        warnings.simplefilter("ignore", UserWarning)
        Z = torch.sparse_csr_tensor(crow, col.to(crow.dtype), values, shape, check_invariants=False)
        return (Z @ Z.t()).to_dense()


@dataclass(frozen=True)
class CenteredRows:
    """Dense rows ``Y`` whose products are those of ``Y~ = (Y - m) D^{-1}``, never formed.

    ``Y~ W = Y (D^{-1} W) - q W`` and ``Y~^T U = D^{-1} Y^T U - q 1^T U``
    (``q = m / D``): a pass reads the rows as stored, where scaling them
    first would read, write and read them again. Exact in exact
    arithmetic; in floating point the products of uncentered rows carry
    the rounding of ``|m|`` as well as of ``Y - m`` (see
    :attr:`.._engine.state.StepContext.product_centering`).
    """

    rows: torch.Tensor
    centering: Centering

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    def matmul(self, weights: torch.Tensor) -> torch.Tensor:
        """``Y~ W``, ``(n_rows, k)`` in the rows' dtype."""
        inverse, shift = (
            t.to(self.dtype) for t in (self.centering.inverse_scale, self.centering.shift)
        )
        return torch.mm(self.rows, weights * inverse[:, None]).sub_(shift @ weights)

    def transpose_matmul(self, residuals: torch.Tensor) -> torch.Tensor:
        """``Y~^T U``, ``(n_columns, k)`` in the rows' dtype."""
        inverse, shift = (
            t.to(self.dtype) for t in (self.centering.inverse_scale, self.centering.shift)
        )
        out = torch.mm(self.rows.T, residuals).mul_(inverse[:, None])
        return out.sub_(shift[:, None] * residuals.sum(dim=0))


def matmul(rows: torch.Tensor | SparseRows | CenteredRows, weights: torch.Tensor) -> torch.Tensor:
    """``rows @ weights`` for dense, centered or sparse rows (in the rows' dtype)."""
    if isinstance(rows, SparseRows | CenteredRows):
        return rows.matmul(weights.to(rows.dtype))
    return torch.mm(rows, weights.to(rows.dtype))


def transpose_matmul(
    rows: torch.Tensor | SparseRows | CenteredRows, residuals: torch.Tensor
) -> torch.Tensor:
    """``rows.T @ residuals`` for dense, centered or sparse rows (in the rows' dtype)."""
    if isinstance(rows, SparseRows | CenteredRows):
        return rows.transpose_matmul(residuals.to(rows.dtype))
    return torch.mm(rows.T, residuals.to(rows.dtype))


def split_rows(X: torch.Tensor | CSRMatrix, stop: int) -> tuple:
    """``X[:stop]`` and ``X[stop:]``, without copying either."""
    if isinstance(X, CSRMatrix):
        return X.row_slice(0, stop), X.row_slice(stop, X.shape[0])
    return X[:stop], X[stop:]


def as_tensor(array: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``array`` on ``device`` in ``dtype``, copying only when either differs."""
    return shared_tensor(array).to(device=device, dtype=dtype)


def as_storage(
    X,
    device: torch.device,
    dtype: torch.dtype,
    center: np.ndarray | None = None,
    scale: np.ndarray | None = None,
) -> torch.Tensor | CSRMatrix:
    """X as the engine stores it: a dense tensor, or CSR tensors for a scipy sparse X.

    With the ``center`` and ``scale`` of the preconditioner (dense X only,
    see :func:`.storage.stores_preconditioned`), the rows ``(x - m) / D``.
    """
    if sp.issparse(X):
        return CSRMatrix.from_scipy(X, device, dtype)
    if scale is None:
        return as_tensor(X, device, dtype)
    stored = torch.empty(X.shape, dtype=dtype, device=device)
    for start, stop, rows in storage_chunks(X, dtype, center, scale, device):
        stored[start:stop] = rows
    return stored


# Values per chunk when scanning X: the float64 temporaries of a chunk stay
# around 1 MiB whatever the width, and the scan never copies the whole array.
_SCAN_VALUES = 1 << 17


def largest_abs(X, center: np.ndarray | None = None, scale: np.ndarray | None = None) -> float:
    """Largest absolute value of X, by chunks (no ``|X|`` copy); of the stored values if sparse.

    With ``center`` m and ``scale`` D (dense X), of ``(x - m) / D``.
    """
    if sp.issparse(X):
        return float(np.abs(X.data).max(initial=0.0))
    largest = 0.0
    rows = max(1, _SCAN_VALUES // max(1, X.shape[1]))
    for start in range(0, X.shape[0], rows):
        chunk = X[start : start + rows]
        if scale is not None:
            chunk = (chunk - center) / scale
        largest = max(largest, float(chunk.max()), -float(chunk.min()))
    return largest
