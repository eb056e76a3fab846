"""How statistics of X combine when each rank holds a block of its columns.

Planning reads X for column statistics (the preconditioner's moments),
row statistics (squared row norms, the products of the smoothness
estimate) and extremes (the largest stored value). Where one process holds
every column these are computed whole; where each rank of a job holds only
its column block (:class:`~sklearn_casgd.ColumnBlocks`), each computes its
block's part and a :class:`ColumnReduction` combines the parts: row sums
add over the ranks, column statistics are placed side by side, extremes
take the largest. The statistics code is written once, against this
interface.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class ColumnReduction(Protocol):
    """The ranks holding X's column blocks, as planning's statistics see them."""

    #: Columns of the whole X.
    n_features: int
    #: This rank's columns ``[start, stop)``.
    columns: tuple[int, int]

    def sum(self, values: np.ndarray) -> np.ndarray:
        """The elementwise sum over the ranks of float64 ``values`` (equal shapes on every rank)."""

    def max(self, value: float) -> float:
        """The largest ``value`` of any rank."""

    def gather_columns(self, local: np.ndarray) -> np.ndarray:
        """``(..., d_local)`` per rank to ``(..., n_features)``, each block in its columns."""


class WholeX:
    """One process holding every column: each statistic is already the whole one."""

    def __init__(self, n_features: int) -> None:
        self.n_features = n_features
        self.columns = (0, n_features)

    def sum(self, values: np.ndarray) -> np.ndarray:
        return values

    def max(self, value: float) -> float:
        return value

    def gather_columns(self, local: np.ndarray) -> np.ndarray:
        return local


def block_of(vector: np.ndarray | None, reduction: ColumnReduction) -> np.ndarray | None:
    """This rank's entries of a per-column ``vector`` of the whole X (None stays None)."""
    if vector is None:
        return None
    start, stop = reduction.columns
    return vector[..., start:stop]
