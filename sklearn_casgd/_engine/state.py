"""What the steps work on: the step context, the preconditioner, a rank's rows and weights.

:class:`StepContext` holds what every step needs besides the data
(family, precision, penalty, communicator, preconditioner, and how the
steps run); :class:`LocalData` a rank's column block with its targets,
weights and SVRG's :class:`Snapshot`; :class:`ModelState` its weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._data.storage import Centering, CSRMatrix, SparseRows
from .._glm.families import Family
from .._glm.penalties import Penalty
from .average import RunningAverage
from .certificate import GapCertificate
from .comm import Communicator
from .precision import PrecisionPolicy

# The full pass applies the preconditioner to its products rather than to the
# rows (_data.storage.CenteredRows) where every column's center is within this many
# of its spreads of zero: the products of the rows as stored then round
# about as those of the centered rows (a few times more at most), and X is
# read once a pass instead of being scaled into a buffer first.
CENTERED_PRODUCTS_SPREADS = 4.0


@dataclass(frozen=True)
class Preconditioner:
    """Jacobi preconditioning: the steps run on ``v = D w`` and the rows ``(x - m) D^{-1}``.

    ``center`` is this rank's slice of m (zero without an intercept; with
    one, the engine's intercept is ``beta + m . w``, which the estimator
    converts back). ``scale`` is this rank's slice of ``D``, the square root of the diagonal
    of the objective's curvature bound, so every column of the scaled
    problem has unit curvature and the step no longer depends on the units
    of the columns. ``decay_alpha`` is ``alpha / min D^2`` over every column:
    the steps decay ``v`` at that scalar rate (the s-step recurrence needs a
    scalar), and the snapshot's constant adds back the difference, ``(alpha /
    D^2 - decay_alpha) v~``, which vanishes at the optimum.
    """

    center: torch.Tensor  # (d_local,), policy.update_accumulate
    scale: torch.Tensor  # (d_local,), policy.update_accumulate
    decay_alpha: float
    spread: torch.Tensor | None = None  # (d_local,) columns' RMS about m: units of the test
    # The stored rows are (x - m) D^{-1} already (dense only; _data.storage.stores_preconditioned).
    in_storage: bool = False

    @functools.cached_property
    def centering(self) -> Centering:
        """The same, as sparse rows apply it implicitly (see :mod:`.._data.storage`)."""
        return Centering.of(self.center, self.scale)

    @functools.cached_property
    def centers_near_zero(self) -> bool:
        """Every column's center within :data:`CENTERED_PRODUCTS_SPREADS` spreads of zero."""
        if self.spread is None:
            return False
        return bool((self.center.abs() <= CENTERED_PRODUCTS_SPREADS * self.spread).all())


@dataclass(frozen=True)
class RowExchange:
    """The all-gather exchange of an outer iteration (instead of the Gram all-reduce).

    Every rank sends its columns of the rows (in the Gram input dtype,
    padded to the widest block) in an all-gather and runs the s steps
    from the full rows, replicated (:attr:`StepContext.row_steps`: no Gram
    is formed). Every rank also keeps every rank's weights
    (:attr:`ModelState.replica`, refreshed once an epoch by
    :func:`.exchange.replicate_weights`) and updates them all, so it forms the
    margins from the full rows itself: the all-gather carries rows only,
    which need no weights. It carries those of several outer iterations
    where one's are few (:func:`.exchange.outer_per_exchange`), and the steps of
    one such group run while the next group's rows are on their way
    (:func:`.exchange.start_row_exchange`).
    ``widths`` are the ranks' block widths (a rank may have none).
    """

    widths: tuple[int, ...]

    @property
    def padded_width(self) -> int:
        return max(self.widths)


@dataclass(frozen=True)
class StepContext:
    """What every step needs besides the data and the state."""

    family: Family
    policy: PrecisionPolicy
    penalty: Penalty
    fit_intercept: bool
    comm: Communicator
    preconditioner: Preconditioner | None = None
    compiled: bool = False  # run the inner steps through torch.compile
    exchange: RowExchange | None = None  # all-gather the rows instead of reducing the Gram
    # Batch-size groups whose steps stay eager when compiled (an epoch's tail).
    eager_sizes: frozenset[tuple[int, ...]] = frozenset()
    ahead_of_time: bool | None = None  # None: recurrence.AHEAD_OF_TIME of the device
    # Run the steps from the rows instead of their Gram (:func:`.recurrence.inner_steps`):
    # where every column's rows are here, on one rank or after a RowExchange.
    row_steps: bool = False
    # Run the row steps' recurrence as one Triton kernel where it covers the
    # outer iteration (_accel.triton.supports); the torch steps elsewhere.
    fused: bool = False
    # One device: each epoch's plain steps as one Triton launch with the
    # weights on the chip (epoch_kernel); no outer iterations then.
    epoch_kernel: bool = False
    # One device: the full pass as one Triton launch (_accel.triton.pass_terms).
    fused_pass: bool = False
    # Each epoch's order a Feistel permutation computed on the rows' device.
    device_order: bool = False
    # SVRG's epochs are full-batch steps preconditioned by the curvature at
    # the snapshot (curvature): dense rows, no RowExchange.
    newton: bool = False
    # ... whose curvature is formed from this many of the rows (spread evenly
    # over X, ._curvature.sampled_rows); None: every row.
    curvature_rows: int | None = None
    # Every rank's column block width, where Newton epochs run on several
    # ranks: each gathers the curvature's rows and the gradient whole.
    column_widths: tuple[int, ...] = ()
    # Averaged SGD: the outer iterations also sum their iterates
    # (ModelState.average), so their steps hand back their residuals.
    averaged: bool = False
    # With a RowExchange and a preconditioner: every rank's column scales D,
    # (d,), which an L1 part's threshold on the replica divides by.
    replica_scale: torch.Tensor | None = None
    # The full pass's bound on the gap to the optimum (None: the fit has none).
    certificate: GapCertificate | None = None

    def __post_init__(self) -> None:
        if self.exchange is not None and not self.row_steps:
            raise ValueError("A RowExchange runs the steps from the gathered rows: row_steps=True.")
        if self.fused and not self.row_steps:
            raise ValueError("The fused kernel runs the row steps: row_steps=True.")
        if self.epoch_kernel and (self.comm.world_size > 1 or self.newton):
            raise ValueError("The epoch kernel runs one device's minibatch steps.")
        if self.fused_pass and (self.comm.world_size > 1 or self.samples_by_curvature):
            raise ValueError("The fused pass runs one device's pass, without rows' curvature.")
        if self.newton and self.exchange is not None:
            raise ValueError("Newton epochs gather their own rows: no RowExchange.")
        if (
            self.penalty.proximal
            and self.exchange is not None
            and self.preconditioner is not None
            and self.replica_scale is None
        ):
            raise ValueError("An L1 threshold on the replica needs every rank's replica_scale.")
        if self.newton and self.comm.world_size > 1:
            if len(self.column_widths) != self.comm.world_size:
                raise ValueError("Newton epochs on several ranks need every rank's column_widths.")

    def total_columns(self, local_width: int) -> int:
        """Columns of every rank: :attr:`column_widths`' sum, else ``local_width`` (one rank)."""
        return sum(self.column_widths) if self.comm.world_size > 1 else local_width

    @property
    def column_start(self) -> int:
        """The first of this rank's columns among :attr:`column_widths` (0 on one rank)."""
        return sum(self.column_widths[: self.comm.rank])

    @property
    def samples_by_curvature(self) -> bool:
        """Whether Newton's sampled rows are drawn by their curvature (an unbounded one)."""
        family = self.family
        return (
            self.newton
            and self.curvature_rows is not None
            and family.curvature is None
            and not family.constant_hessian
        )

    @property
    def decay_alpha(self) -> float:
        """The L2 rate of the steps' scalar decay (the penalty's unless preconditioned)."""
        return self.penalty.l2 if self.preconditioner is None else self.preconditioner.decay_alpha

    @functools.cached_property
    def l1_strength(self) -> torch.Tensor | float:
        """The L1 part's strength in the steps' coordinates: per unit step, its threshold.

        Preconditioned, ``l1 |w| = l1 |v| / D`` column by column: ``(d_local, 1)``,
        or ``(d, 1)`` for the replica of every rank's weights (a RowExchange).
        """
        if self.preconditioner is None:
            return self.penalty.l1
        scale = self.preconditioner.scale if self.exchange is None else self.replica_scale
        return self.penalty.l1 / scale[:, None]

    @property
    def centering(self) -> Centering | None:
        """The preconditioner for sparse rows, or None."""
        return None if self.preconditioner is None else self.preconditioner.centering

    @property
    def row_scaling(self) -> Preconditioner | None:
        """The preconditioner that dense rows still need as they are read, or None.

        None also when the rows were stored preconditioned (``in_storage``).
        """
        preconditioner = self.preconditioner
        return None if preconditioner is None or preconditioner.in_storage else preconditioner

    @property
    def product_centering(self) -> Centering | None:
        """The preconditioner as a pass over dense rows applies it to its products, or None.

        None where the rows are read as they are (unpreconditioned, or stored
        preconditioned), where a center is far from zero (the products of
        the raw rows would lose its digits), or where the steps' rows are
        rounded to a narrower Gram input than the pass computes in (the pass
        must see the rows the steps see: :func:`precondition_rows`).
        """
        scaling = self.row_scaling
        policy = self.policy
        if (
            scaling is None
            or not scaling.centers_near_zero
            or policy.gram_input.itemsize < policy.update_accumulate.itemsize
        ):
            return None
        return scaling.centering

    def gather(self, X: torch.Tensor | CSRMatrix, rows: torch.Tensor) -> torch.Tensor | SparseRows:
        """Rows ``rows`` of X as the steps see them, in the update dtype (dense or sparse)."""
        acc = self.policy.update_accumulate
        if isinstance(X, CSRMatrix):
            return X.gather(rows, acc, self.centering)
        Y = X.index_select(0, rows)
        if self.row_scaling is not None and Y.dtype == acc:
            return self.rows_into(Y, Y)  # the gathered rows are a copy: scaled in place
        return self.rows(Y).to(acc)

    def rows(self, X_rows: torch.Tensor) -> torch.Tensor:
        """Rows of X as the steps see them: ``(x - m) D^{-1}`` when preconditioned.

        Rows stored as the steps see them come back as they are (storage
        dtype); the others are scaled and rounded to the Gram input dtype
        (:func:`precondition_rows`).
        """
        scaling = self.row_scaling
        if scaling is None:
            return X_rows
        return precondition_rows(X_rows, scaling.center, scaling.scale, self.policy.gram_input)

    def rows_into(self, X_rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`rows` in ``out``'s dtype, written into ``out`` (no allocation); ``out`` back.

        The same values as ``rows(X_rows).to(out.dtype)``.
        """
        scaling = self.row_scaling
        if scaling is None:
            return out.copy_(X_rows)
        rows = precondition_rows(
            X_rows, scaling.center, scaling.scale, self.policy.gram_input, out=out
        )
        return rows if rows is out else out.copy_(rows)


def precondition_rows(
    X_rows: torch.Tensor,
    center: torch.Tensor,
    scale: torch.Tensor,
    gram_input: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(x - m) D^{-1}``, computed in the dtype of ``scale``, rounded to ``gram_input``.

    Returned in ``gram_input`` where that is the narrower dtype (callers
    upcast for the margins and the update), else in the dtype of ``scale``.
    ``out`` (which may be ``X_rows`` itself, when that is a copy) receives
    them where it has ``scale``'s dtype and no narrower rounding is due;
    otherwise they are returned in a new tensor.

    The Gram is formed from the rows rounded to its input dtype; the margins,
    the weight update and the full pass must see those same rows. Otherwise
    every outer iteration, and SVRG's control variate, is off by that
    rounding (~1e-3 in bfloat16): a floor under SVRG's gradient
    (``docs/history.md``, "The bf16 recipe under SVRG").
    """
    if out is not None and out.dtype == scale.dtype and gram_input.itemsize >= out.dtype.itemsize:
        return torch.sub(X_rows, center, out=out).div_(scale)
    rows = (X_rows.to(scale.dtype) - center) / scale
    return rows.to(gram_input) if gram_input.itemsize < rows.dtype.itemsize else rows


@dataclass(frozen=True)
class Snapshot:
    """The SVRG control variate of one epoch, taken at the snapshot ``w~, beta~``.

    ``gradient`` is ``dl/dz`` of every row at the snapshot (unweighted;
    None for Newton epochs, whose step takes no rows),
    ``mean_gradient`` this rank's slice of ``mu = X^T (omega * gradient) / n``
    and ``mean_gradient_intercept`` its intercept part (zero without an
    intercept).
    """

    gradient: torch.Tensor | None  # (n, k), policy.recurrence
    mean_gradient: torch.Tensor  # (d_local, k), policy.weight_storage
    mean_gradient_intercept: torch.Tensor  # (k,), policy.recurrence
    # With a RowExchange: every rank's mean_gradient, (d, k) (replicate_weights).
    replica_mean_gradient: torch.Tensor | None = None
    # Newton epochs: the full gradient in the steps' coordinates, every rank's
    # columns, (d, k) float64 (curvature.newton_step).
    newton_gradient: torch.Tensor | None = None
    # ... and each row's weighted curvature (its Hessian's trace), (n,), where
    # the curvature's rows are drawn by it (StepContext.samples_by_curvature).
    row_curvature: torch.Tensor | None = None
    # ... and on several ranks every row's raw prediction summed over the
    # ranks' columns, (n, k), policy.recurrence: the curvature at the
    # snapshot reads its rows' from here, not from another all-reduce.
    raw_predictions: torch.Tensor | None = None


@dataclass(frozen=True)
class LocalData:
    """The rows of one rank: its column block of X, targets and weights.

    ``snapshot`` is the epoch's SVRG control variate, ``None`` for plain SGD.
    """

    X: torch.Tensor  # (n, d_local), policy.x_storage
    target: torch.Tensor  # (n, k), policy.recurrence
    sample_weight: torch.Tensor  # (n,), policy.recurrence
    snapshot: Snapshot | None = None


@dataclass
class ModelState:
    """Local weight slice ``(d_local, k)`` and the (replicated) intercept ``(k,)``.

    With a :class:`RowExchange` ``replica`` holds every rank's weights
    ``(d, k)`` and ``coef`` is this rank's rows of it (a view): the steps
    update all of them, every rank alike, and :func:`.exchange.replicate_weights`
    copies every rank's own rows into the replicas once an epoch.
    """

    coef: torch.Tensor
    intercept: torch.Tensor
    replica: torch.Tensor | None = None
    # average: the running sum of the iterates (one rank's columns), or None.
    average: RunningAverage | None = None

    @classmethod
    def with_replica(
        cls, coef: torch.Tensor, intercept: torch.Tensor, columns: tuple[int, int], n_features: int
    ) -> ModelState:
        """A state whose ``coef`` (columns ``[start, stop)``) is a view of a replica of ``d``."""
        replica = coef.new_zeros((n_features, coef.shape[1]))
        replica[columns[0] : columns[1]] = coef
        return cls(replica[columns[0] : columns[1]], intercept, replica)

    def step_weights(self) -> torch.Tensor:
        """The weights the steps read and update: the replica, else ``coef``."""
        return self.coef if self.replica is None else self.replica


def take_rows(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``values[rows]`` along the first dimension.

    A one-column tensor is gathered through its 1-D view: on the CPU
    ``index_select`` copies each row of an ``(n, 1)`` tensor as a row
    (several times slower than the same values of an ``(n,)`` tensor).
    """
    if values.dim() == 2 and values.shape[1] == 1 and values.is_contiguous():
        return values.view(-1).index_select(0, rows).view(-1, 1)
    return values.index_select(0, rows)
