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

from .checks import check_csr

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
        # from_files' loader also takes the rows y has, checked before any allocation.
        self._reads_headers = False
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
        blocks = cls(
            lambda rank, world_size, n_rows=None: _read_file(paths[rank], n_rows),
            sources=map(str, paths),
        )
        blocks._reads_headers = True
        return blocks

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

    def load(
        self, rank: int, world_size: int, n_rows: int | None = None
    ) -> np.ndarray | sp.csr_matrix:
        """Rank ``rank``'s block, checked: 2-D floats (float32 kept), finite, CSR if sparse.

        Parameters
        ----------
        rank : int
            The rank whose block to load, in ``[0, world_size)``.
        world_size : int
            The number of ranks of the job.
        n_rows : int, default=None
            The rows the block must have (y's): a file's header is checked
            against them, and against its size and the memory available,
            before anything is allocated.

        Returns
        -------
        block : ndarray or scipy.sparse.csr_matrix of shape (n_samples, n_columns)
            The block; a ``.npy`` file's is memory-mapped.

        Raises
        ------
        ValueError
            Naming the rank and the source, when the block is missing,
            unreadable (whatever the loader raised), not a 2-D array of real
            numbers, not finite, or larger than the memory available.
        """
        where = f"rank {rank}'s column block ({self.source(rank)})"
        if self.n_blocks is not None and self.n_blocks != world_size:
            raise ColumnBlockError(
                f"{self.n_blocks} column blocks were given for a job of {world_size} ranks: "
                "give one block per rank.",
                4,
            )
        try:
            if self._reads_headers:
                block = self._load(rank, world_size, n_rows)
            else:
                block = self._load(rank, world_size)
        except FileNotFoundError as error:
            raise ColumnBlockError(f"Cannot read {where}: no such file ({error}).", 0) from None
        except _BadHeader as error:
            raise ColumnBlockError(f"{where} {error}", error.problem) from None
        except Exception as error:  # a loader's or a file format's: the ranks must all hear of it
            message = f"Cannot read {where}: {type(error).__name__}: {error}"
            raise ColumnBlockError(message, 0) from None
        return checked_block(block, where)


def checked_block(block: object, where: str) -> np.ndarray | sp.csr_matrix:
    """``block`` as a 2-D float array or CSR matrix, finite; a :class:`ColumnBlockError` else."""
    if sp.issparse(block):
        block = sp.csr_matrix(block)
        try:
            check_csr(block, where)
        except ValueError as error:
            raise ColumnBlockError(str(error), 1) from None
        values = block.data
    else:
        if not isinstance(block, np.ndarray):
            block = np.asarray(block)
        values = block
    if block.ndim != 2:
        raise ColumnBlockError(f"{where} must be 2-D, got an array of shape {block.shape}.", 1)
    if values.dtype not in (np.float32, np.float64):
        if values.dtype.kind == "c":  # astype would drop the imaginary part without a word
            raise ColumnBlockError(f"{where} holds complex numbers (dtype {values.dtype}).", 1)
        if not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
            raise ColumnBlockError(f"{where} must hold numbers, got dtype {values.dtype}.", 1)
        block = block.astype(np.float64)
        values = block.data if sp.issparse(block) else block
    rows = max(1, _SCAN_VALUES // max(1, values.shape[-1])) if values.ndim == 2 else _SCAN_VALUES
    for start in range(0, values.shape[0], rows):
        if not np.isfinite(values[start : start + rows]).all():
            raise ColumnBlockError(f"{where} holds NaN or infinity.", 2)
    return block


class _BadHeader(ValueError):
    """A block file whose header declares what no block may be (or what y rules out).

    ``problem`` indexes :data:`PROBLEMS`.
    """

    def __init__(self, message: str, problem: int = 1) -> None:
        super().__init__(message)
        self.problem = problem


# The dtype kinds a dense block may hold: booleans, integers and reals.
_REAL_KINDS = "biuf"
# Bytes a fit holds for each column of X, whatever its rows (about ten float64 values).
_COLUMN_STATE_BYTES = 80


def _read_file(path: Path, n_rows: int | None = None) -> np.ndarray | sp.spmatrix:
    """A block file's array: ``.npy`` memory-mapped, ``.npz`` sparse, ``.parquet`` dense.

    Each file's declared shape and dtype are checked first (:func:`_check_declared`).
    """
    if path.suffix == ".npy":
        _check_npy_header(path, n_rows)
        return np.load(path, mmap_mode="r", allow_pickle=False)
    if path.suffix == ".npz":
        _check_npz_members(path, n_rows)
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
    dtype = _parquet_dtype(schema, path)
    shape = (source.metadata.num_rows, len(schema))
    _check_declared(shape, dtype, n_rows, allocates=True)
    block = np.empty(shape, dtype=dtype)
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


def _check_declared(
    shape: tuple[int, ...], dtype: np.dtype, n_rows: int | None, allocates: bool
) -> None:
    """Refuse a declared shape and dtype before anything is allocated for them.

    2-D, real numbers, ``n_rows`` rows where given, and no larger than the
    memory the system has available: the block itself where reading
    allocates it, and the fit's state of its columns (about ten float64
    values a column: weights, statistics, the fingerprint's direction), which
    a file of a few KB can declare by the hundred million.
    """
    if len(shape) != 2:
        raise _BadHeader(f"declares an array of shape {shape}: a block is 2-D.")
    if dtype.kind not in _REAL_KINDS:
        raise _BadHeader(f"declares dtype {dtype}: a block holds real numbers.")
    if n_rows is not None and shape[0] != n_rows:
        raise _BadHeader(f"declares {shape[0]} rows where y has {n_rows}.", 3)
    needed = _COLUMN_STATE_BYTES * shape[1]
    if allocates:
        needed += int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    available = _available_memory()
    if available is not None and needed > available:
        raise _BadHeader(
            f"declares {shape[0]} x {shape[1]} values of {dtype}: a fit of them needs "
            f"{needed / 2**30:.3g} GiB, more than the {available / 2**30:.3g} GiB of memory "
            "available."
        )


def _check_npy_header(path: Path, n_rows: int | None) -> None:
    """A ``.npy`` file's header against :func:`_check_declared` and the file's own size."""
    with open(path, "rb") as file:
        version = np.lib.format.read_magic(file)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(file)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(file)
        offset = file.tell()
    _check_declared(shape, dtype, n_rows, allocates=False)
    needed = offset + int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    size = path.stat().st_size
    if size < needed:
        raise _BadHeader(f"is truncated: its header declares {needed} bytes, the file has {size}.")


def _check_npz_members(path: Path, n_rows: int | None) -> None:
    """A scipy ``.npz``'s declared shape, and its members' inflated sizes against the memory."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        if "shape.npy" not in names:
            raise _BadHeader("is not a scipy sparse matrix (save_npz): it has no shape.")
        with archive.open("shape.npy") as member:
            shape = tuple(int(v) for v in np.load(member, allow_pickle=False))
        inflated = sum(info.file_size for info in archive.infolist())
    _check_declared(shape, np.dtype(np.float64), n_rows, allocates=False)
    available = _available_memory()
    if available is not None and inflated > available:
        raise _BadHeader(
            f"inflates to {inflated / 2**30:.3g} GiB, more than the "
            f"{available / 2**30:.3g} GiB of memory available."
        )


def _available_memory() -> int | None:
    """Bytes of memory the system has available (Linux's MemAvailable), or None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
