"""X as column blocks, one per rank of a job: each rank reads only its own.

A ``n_devices="world"`` fit of an ordinary X needs every rank to hold all
of it. :class:`ColumnBlocks` instead names, for each rank, where its
columns are: a file (``.npy``, memory-mapped; scipy's ``.npz`` CSR; Parquet
through pyarrow) or a user's function ``load(rank, world_size)``. A rank
loads and checks its own block only (:meth:`ColumnBlocks.load`); how the
blocks must fit together (the engine's partition of the columns, the same
rows on every rank) is checked by the job's ranks together
(:func:`sklearn_casgd._distributed.world.open_column_blocks`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import scipy.sparse as sp

SUFFIXES = (".npy", ".npz", ".parquet")

# What can be wrong with one rank's block: the other ranks are told which by
# its index (a number crosses the job; a message would have to be pickled).
PROBLEMS = (
    "cannot be read",
    "is not a 2-D array of numbers",
    "holds NaN or infinity",
    "has another number of rows than y",
    "was given for a job of another size",
)


class ColumnBlockError(ValueError):
    """A rank's column block is missing or wrong; ``problem`` indexes :data:`PROBLEMS`."""

    def __init__(self, message: str, problem: int) -> None:
        super().__init__(message)
        self.problem = problem


# Rows per chunk of the finiteness scan of a dense block: a memory-mapped
# block is read once and never copied whole.
_SCAN_VALUES = 1 << 20


class ColumnBlocks:
    """X split by columns over the ranks of a job; each rank loads only its own block.

    Pass it as ``X`` to ``fit`` of any estimator with ``n_devices="world"``:
    rank ``r`` of ``P`` loads block ``r``, which must hold the columns the
    engine gives rank ``r`` (contiguous, in order; the first ``d % P``
    ranks one more than the others: ``d // P`` or ``d // P + 1`` each),
    with every row of X. ``y`` and ``sample_weight`` are passed whole on
    every rank, as for an ordinary X. The fitted model predicts on
    ordinary X.

    Parameters
    ----------
    load : callable
        ``load(rank, world_size)`` returns this rank's block: a 2-D array
        or a scipy sparse matrix (converted to CSR) of floats.
    sources : sequence of str, default=None
        What each rank's block is (a file name), for error messages; the
        job must then have ``len(sources)`` ranks.

    See Also
    --------
    ColumnBlocks.from_files : One file per rank.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_casgd import ColumnBlocks
    >>> X = np.arange(12.0).reshape(3, 4)
    >>> blocks = ColumnBlocks(lambda rank, world_size: X[:, 2 * rank : 2 * rank + 2])
    >>> blocks.load(1, 2)
    array([[ 2.,  3.],
           [ 6.,  7.],
           [10., 11.]])
    """

    def __init__(
        self, load: Callable[[int, int], object], *, sources: Sequence[str] | None = None
    ) -> None:
        if not callable(load):
            raise TypeError(f"load must be a callable (rank, world_size) -> block, got {load!r}.")
        self._load = load
        self.sources = None if sources is None else list(sources)
        # One source per rank: a job of another size is refused.
        self.n_blocks = None if self.sources is None else len(self.sources)

    @classmethod
    def from_files(cls, paths: Sequence[str | os.PathLike]) -> ColumnBlocks:
        """Blocks read from one file per rank, ``paths[rank]``, in rank order.

        Parameters
        ----------
        paths : sequence of str or path-like
            One file per rank: ``.npy`` (memory-mapped: its pages are read
            as the fit needs them), ``.npz`` (a scipy sparse matrix saved by
            ``scipy.sparse.save_npz``) or ``.parquet`` (every column a
            number, read a column at a time; needs pyarrow:
            ``pip install sklearn-casgd[parquet]``). The job must have
            ``len(paths)`` ranks.

        Returns
        -------
        blocks : ColumnBlocks
            Blocks that each rank reads from its own file only.
        """
        if isinstance(paths, (str, os.PathLike)):
            raise TypeError("paths must be a sequence of paths, one per rank, not one path.")
        paths = [Path(path) for path in paths]
        if not paths:
            raise ValueError("paths is empty: give one file per rank.")
        for path in paths:
            if path.suffix not in SUFFIXES:
                raise ValueError(
                    f"Cannot read column block {str(path)!r}: the suffix must be one of {SUFFIXES}."
                )
        return cls(lambda rank, world_size: _read_file(paths[rank]), sources=map(str, paths))

    def source(self, rank: int) -> str:
        """Where rank ``rank``'s block comes from, in words (for error messages).

        Parameters
        ----------
        rank : int
            A rank of the job.

        Returns
        -------
        source : str
            ``"file '<path>'"``, or ``"load(<rank>, world_size)"``.
        """
        if self.sources is not None and rank < len(self.sources):
            return f"file {self.sources[rank]!r}"
        return f"load({rank}, world_size)"

    def load(self, rank: int, world_size: int) -> np.ndarray | sp.csr_matrix:
        """Rank ``rank``'s block, checked: 2-D floats (float32 kept), finite, CSR if sparse.

        Parameters
        ----------
        rank : int
            The rank whose block to load, in ``[0, world_size)``.
        world_size : int
            The number of ranks of the job.

        Returns
        -------
        block : ndarray or scipy.sparse.csr_matrix of shape (n_samples, n_columns)
            The block; a ``.npy`` file's is memory-mapped.

        Raises
        ------
        ValueError
            Naming the rank and the source, when the block is missing,
            unreadable, not a 2-D array of numbers or not finite.
        """
        where = f"rank {rank}'s column block ({self.source(rank)})"
        if self.n_blocks is not None and self.n_blocks != world_size:
            raise ColumnBlockError(
                f"{self.n_blocks} column blocks were given for a job of {world_size} ranks: "
                "give one block per rank.",
                4,
            )
        try:
            block = self._load(rank, world_size)
        except FileNotFoundError as error:
            raise ColumnBlockError(f"Cannot read {where}: no such file ({error}).", 0) from None
        except (OSError, ValueError, ImportError) as error:
            message = f"Cannot read {where}: {type(error).__name__}: {error}"
            raise ColumnBlockError(message, 0) from None
        return checked_block(block, where)


def checked_block(block: object, where: str) -> np.ndarray | sp.csr_matrix:
    """``block`` as a 2-D float array or CSR matrix, finite; a :class:`ColumnBlockError` else."""
    if sp.issparse(block):
        block = sp.csr_matrix(block)
        values = block.data
    else:
        if not isinstance(block, np.ndarray):
            block = np.asarray(block)
        values = block
    if block.ndim != 2:
        raise ColumnBlockError(f"{where} must be 2-D, got an array of shape {block.shape}.", 1)
    if values.dtype not in (np.float32, np.float64):
        if not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
            raise ColumnBlockError(f"{where} must hold numbers, got dtype {values.dtype}.", 1)
        block = block.astype(np.float64)
        values = block.data if sp.issparse(block) else block
    rows = max(1, _SCAN_VALUES // max(1, values.shape[-1])) if values.ndim == 2 else _SCAN_VALUES
    for start in range(0, values.shape[0], rows):
        if not np.isfinite(values[start : start + rows]).all():
            raise ColumnBlockError(f"{where} holds NaN or infinity.", 2)
    return block


def _read_file(path: Path) -> np.ndarray | sp.spmatrix:
    """A block file's array: ``.npy`` memory-mapped, ``.npz`` sparse, ``.parquet`` dense."""
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r")
    if path.suffix == ".npz":
        return sp.load_npz(path)
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ImportError(
            "Reading Parquet column blocks needs pyarrow: pip install sklearn-casgd[parquet]."
        ) from None
    # Column by column: the file's decoded table never sits beside the block.
    source = parquet.ParquetFile(path)
    schema = source.schema_arrow
    block = np.empty((source.metadata.num_rows, len(schema)), dtype=_parquet_dtype(schema, path))
    for index, name in enumerate(schema.names):
        block[:, index] = source.read(columns=[name]).column(0).to_numpy()
    return block


def _parquet_dtype(schema, path: Path) -> np.dtype:
    """float32 if every column is float32, else float64; a ``ValueError`` for non-numbers."""
    import pyarrow.types as types

    for field in schema:
        if not (types.is_floating(field.type) or types.is_integer(field.type)):
            raise ValueError(f"column {field.name!r} of {path} is {field.type}, not a number")
    if all(types.is_float32(field.type) for field in schema):
        return np.dtype(np.float32)
    return np.dtype(np.float64)
