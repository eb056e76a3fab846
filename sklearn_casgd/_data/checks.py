"""Structural checks of sparse input, before any product or kernel reads it.

scipy builds a CSR matrix from user arrays without checking that its column
indices lie in ``[0, d)`` or that its row pointers are monotone (its
``check_format`` does so only when asked, and may rewrite the arrays), and
a product, scipy's or a compiled kernel's, then reads outside its arrays:
a crash of the process, or silently wrong numbers. These checks read the
arrays once (O(nnz)), change nothing, and raise a ``ValueError`` naming
what is wrong.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

# Index dtypes a CSR matrix may carry (scipy's).
_INDEX_KINDS = "iu"


def check_csr(X: sp.spmatrix, name: str = "X") -> None:
    """Raise ``ValueError`` unless ``X`` (CSR) is structurally valid: pointers and indices."""
    n_rows, n_columns = X.shape
    indptr, indices, data = X.indptr, X.indices, X.data
    for label, array in (("indptr", indptr), ("indices", indices)):
        if array.ndim != 1 or array.dtype.kind not in _INDEX_KINDS:
            raise ValueError(
                f"{name} is a sparse matrix whose {label} is not a 1-d integer array "
                f"(dtype {array.dtype}, shape {array.shape})."
            )
    if data.ndim != 1 or data.shape[0] != indices.shape[0]:
        raise ValueError(
            f"{name} is a sparse matrix with {data.shape[0]} stored values for "
            f"{indices.shape[0]} column indices."
        )
    if indptr.shape[0] != n_rows + 1:
        raise ValueError(
            f"{name} is a sparse matrix of {n_rows} rows whose row pointers (indptr) have "
            f"{indptr.shape[0]} entries, not {n_rows + 1}."
        )
    if n_rows and (indptr[0] != 0 or indptr[-1] > indices.shape[0]):
        raise ValueError(
            f"{name}'s row pointers (indptr) run from {indptr[0]} to {indptr[-1]}, where "
            f"they must run from 0 to at most the {indices.shape[0]} stored values."
        )
    if n_rows and bool(np.any(np.diff(indptr) < 0)):
        row = int(np.flatnonzero(np.diff(indptr) < 0)[0])
        raise ValueError(f"{name}'s row pointers (indptr) decrease at row {row}.")
    stored = indices[: indptr[-1]] if n_rows else indices[:0]
    if stored.size and (int(stored.min()) < 0 or int(stored.max()) >= n_columns):
        bad = int(stored.min()) if int(stored.min()) < 0 else int(stored.max())
        raise ValueError(
            f"{name} stores a value in column {bad}, outside its {n_columns} columns "
            f"[0, {n_columns})."
        )
