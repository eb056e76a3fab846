"""One step of the engine on a local column block.

:func:`sgd_step` is plain minibatch SGD; :func:`ca_outer_iteration` does s
of those steps with a single reduction (`docs/design.md`, section 2). In exact
arithmetic both give the same iterates; the tests hold them to that in
float64. The Gram blocks need no weights, so :func:`gather_outer_batch`
forms the next outer iteration's while this one's all-reduce is in flight.

Notation: for the steps t = 0..s-1 of an outer iteration, ``decay_t =
1 - eta_t * alpha`` and ``C_j = prod_{t<j} decay_t``. With ``U_k = (eta_k /
b_k) r_k / C_{k+1}`` the plain recurrence unrolls to

    z_j = C_j (m_j - G_{j,<j} U_{<j}) + beta_j,      w_s = C_s (w_0 - Y^T U),

so the inner steps only rescale one vector instead of the whole history.

With a variance-reduction snapshot (SVRG, `docs/design.md`, section 3) every step
also subtracts ``eta_t mu`` and the residuals are ``omega (dl/dz(z) -
dl/dz(z~))``. The constant ``mu`` unrolls like the decay: with ``D_0 = 0``,
``D_{j+1} = decay_j D_j + eta_j`` and ``E_j = sum_{t<j} eta_t``,

    z_j = C_j (m_j - G_{j,<j} U_{<j}) - D_j (Y mu)_j + beta_j - E_j mu_beta,
    w_s = C_s (w_0 - Y^T U) - D_s mu,

so ``Y mu`` rides in the same margins GEMM and the same all-reduce.

The Gram is there to be reduced: with one collective each rank learns
``G_{j,<j}`` without the other ranks' columns. Where every column of the
rows is at hand (one rank, or every rank after a :class:`RowExchange`),
``G_{j,<j} U_{<j} = Y_j v_j`` with ``v_j = Y_{<j}^T U_{<j}`` (and
``w_s = C_s (w_0 - v_s) - D_s mu``): the row steps keep that one vector
of ``d`` values, ``4 s b d`` flops per outer iteration where the Gram takes
``s^2 b^2 d``, and ``s b`` values of memory where it takes ``s^2 b^2 / 2``.

SVRG may also run preconditioned (:class:`Preconditioner`): on ``v = D w``
and the rows ``Y D^{-1}``, whose Gram is the preconditioned Gram, with the
scalar decay of the largest penalty curvature ``alpha / min D^2`` and the
rest of the per-column penalty in the snapshot's constant (`docs/design.md`, section 3).

An outer iteration is two functions of tensors around its one collective:
:func:`gather_rows` (rows, Gram blocks; before the all-reduce) and
:func:`inner_steps` (after it). Both have static shapes for a given
:class:`GatherSpec` / :class:`InnerSpec`, and every scalar that changes
between calls (``C_j``, ``D_j``, ``E_j``, the step factors) reaches them as
one small tensor from :func:`step_coefficients`: nothing reads a value
back to the host, and ``torch.compile(fullgraph=True)`` takes either whole.
With ``StepContext.compiled`` the inner steps run compiled.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .._accel.compile import StaticCompiled
from .._accel.triton import available as triton_available
from .._accel.triton import row_recurrence as fused_row_recurrence
from .._accel.triton import supports as triton_supports
from .._data.storage import Centering, CSRMatrix, SparseRows, matmul, transpose_matmul
from .._glm.families import Family
from .comm import DONE, Communicator, PendingReduce
from .precision import PrecisionPolicy, gram_block, gram_operand_dtype

# The full pass applies the preconditioner to its products rather than to the
# rows (._data.CenteredRows) where every column's center is within this many
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
    :func:`replicate_weights`) and updates them all, so it forms the
    margins from the full rows itself: the all-gather carries rows only,
    which need no weights. It carries those of several outer iterations
    where one's are few (:func:`outer_per_exchange`), and the steps of
    one such group run while the next group's rows are on their way
    (:func:`start_row_exchange`).
    ``widths`` are the ranks' block widths (a rank may have none).
    """

    widths: tuple[int, ...]

    @property
    def padded_width(self) -> int:
        return max(self.widths)


# Gram flops that take as long as one byte exchanged, by device type: the
# price of the Gram a rank forms for the all-reduce, while the previous
# collective is in flight (docs/tuning.md: where it was measured).
GRAM_FLOPS_PER_BYTE = {"cpu": 64.0, "cuda": 4096.0}

# What waiting for an all-reduce costs an outer iteration, in bytes
# exchanged, by device type: the all-reduce waits every outer iteration (for
# its latency and for the other ranks), the rows' all-gather (started ahead)
# does not. 0 lets bytes decide (docs/tuning.md).
LATENCY_BYTES = {"cpu": 200_000.0, "cuda": 0.0}

# The bytes one all-gather of rows carries at least, where an outer
# iteration's rows are fewer: the rows of several outer iterations travel
# together, so that an exchange's fixed cost stays a small part of it
# (docs/tuning.md); the pending rows (two such all-gathers, and their
# float32 copies) stay a few MiB.
GATHER_BYTES = 1 << 20


def outer_per_exchange(exchange: RowExchange, rows: int, dtype: torch.dtype) -> int:
    """Outer iterations of ``rows`` rows whose rows one all-gather carries (at least 1)."""
    gathered = len(exchange.widths) * rows * exchange.padded_width * dtype.itemsize
    return max(1, GATHER_BYTES // max(gathered, 1))


def prefer_row_exchange(
    sizes: Sequence[int],
    widths: Sequence[int],
    margin_columns: int,
    policy: PrecisionPolicy,
    device_type: str,
) -> bool:
    """Whether gathering the rows costs clearly less than reducing the Gram.

    Bytes each rank receives: a ring all-reduce of the Gram and margins
    (``margin_columns`` of them per row) moves ``2 (P - 1) / P`` times their
    size, an all-gather ``P - 1`` times one rank's rows. The all-reduce also
    has each rank form its Gram blocks (``s^2 b^2 d_local`` flops) while the
    previous collective is in flight, and then waits for its collective: it
    costs the larger of its bytes and that Gram, priced at
    :data:`GRAM_FLOPS_PER_BYTE` of the device, plus the latency
    (:data:`LATENCY_BYTES`). The all-gather needs no weights and is in
    flight while the previous outer iteration's steps run: it costs its
    bytes, twice (the rows assembled and stepped on, every rank the same).
    The rows are gathered where that is no more than the all-reduce: small
    column blocks, large ``s * b``, and on the CPU every shape up to some
    thousand columns. On the CPU, 2 gloo ranks, b=32, s=2-32: d=256 and
    d=1024 gathered 1.3-7.2x faster, d=4096 reduced up to 1.1x faster
    (``docs/distributed.md``).
    """
    world_size = len(widths)
    if world_size == 1:
        return False
    rows = sum(sizes)
    gram_values = gram_numel(sizes)
    reduce_bytes = (
        2
        * (world_size - 1)
        / world_size
        * policy.comm_dtype.itemsize
        * (gram_values + rows * margin_columns)
    )
    gram_flops = 2.0 * gram_values * max(widths)
    reduce_cost = LATENCY_BYTES.get(device_type, LATENCY_BYTES["cpu"]) + max(
        reduce_bytes,
        gram_flops / GRAM_FLOPS_PER_BYTE.get(device_type, GRAM_FLOPS_PER_BYTE["cpu"]),
    )
    gather_bytes = (world_size - 1) * rows * max(widths) * policy.gram_input.itemsize
    return 2 * gather_bytes <= reduce_cost


# Compiled inner steps of this process, per spec and way of compiling (and
# within it per input signature).
_COMPILED: dict[tuple[InnerSpec, bool], StaticCompiled] = {}

# Whether the compiled steps are compiled ahead of time, by device type: on
# the CPU that takes dynamo's guards off every call, for more compile time a
# shape; on CUDA the launches, not the guards, set the pace (docs/tuning.md).
# A StepContext's ahead_of_time overrides it (the benchmarks time both).
AHEAD_OF_TIME = {"cpu": True, "cuda": False}


@dataclass(frozen=True)
class StepContext:
    """What every step needs besides the data and the state."""

    family: Family
    policy: PrecisionPolicy
    alpha: float
    fit_intercept: bool
    comm: Communicator
    preconditioner: Preconditioner | None = None
    compiled: bool = False  # run the inner steps through torch.compile
    exchange: RowExchange | None = None  # all-gather the rows instead of reducing the Gram
    # Batch-size groups whose steps stay eager when compiled (an epoch's tail).
    eager_sizes: frozenset[tuple[int, ...]] = frozenset()
    ahead_of_time: bool | None = None  # None: AHEAD_OF_TIME of the device
    # Run the steps from the rows instead of their Gram (:func:`inner_steps`):
    # where every column's rows are here, on one rank or after a RowExchange.
    row_steps: bool = False
    # Run the row steps' recurrence as one Triton kernel where it covers the
    # outer iteration (._triton.supports); the torch steps elsewhere.
    fused: bool = False
    # One device: each epoch's plain steps as one Triton launch with the
    # weights on the chip (._epoch_kernel); no outer iterations then.
    epoch_kernel: bool = False
    # One device: the full pass as one Triton launch (._triton.pass_terms).
    fused_pass: bool = False
    # Each epoch's order a Feistel permutation computed on the rows' device.
    device_order: bool = False
    # SVRG's epochs are full-batch steps preconditioned by the curvature at
    # the snapshot (._curvature): dense rows, no RowExchange.
    newton: bool = False
    # ... whose curvature is formed from this many of the rows (spread evenly
    # over X, ._curvature.sampled_rows); None: every row.
    curvature_rows: int | None = None
    # Every rank's column block width, where Newton epochs run on several
    # ranks: each gathers the curvature's rows and the gradient whole.
    column_widths: tuple[int, ...] = ()

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
        if self.newton and self.comm.world_size > 1:
            if len(self.column_widths) != self.comm.world_size:
                raise ValueError("Newton epochs on several ranks need every rank's column_widths.")

    def inner_steps(self, spec: InnerSpec) -> Callable[..., torch.Tensor]:
        """:func:`inner_steps` for ``spec``: eager, or compiled once per spec and process.

        With the fused kernel the steps are one launch already: they run
        as they are, not through torch.compile.
        """
        if not self.compiled or spec.fused or spec.sizes in self.eager_sizes:
            return functools.partial(inner_steps, spec)
        ahead_of_time = self.ahead_of_time
        if ahead_of_time is None:
            ahead_of_time = AHEAD_OF_TIME.get(spec.device_type, False)
        compiled = _COMPILED.get((spec, ahead_of_time))
        if compiled is None:
            # On the CPU, cpp_wrapper (the graph's calls, GEMMs included, made
            # from C++ instead of a Python wrapper) is most of the gain. CUDA
            # keeps inductor's default until bench_gpu.py has compared them.
            compiled = StaticCompiled(
                functools.partial(inner_steps, spec),
                {"cpp_wrapper": True} if spec.device_type == "cpu" else {},
                ahead_of_time,
            )
            _COMPILED[spec, ahead_of_time] = compiled
        return compiled

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
        """The L2 rate of the steps' scalar decay (``alpha`` unless preconditioned)."""
        return self.alpha if self.preconditioner is None else self.preconditioner.decay_alpha

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
    # columns, (d, k) float64 (._curvature.newton_step).
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
    update all of them, every rank alike, and :func:`replicate_weights`
    copies every rank's own rows into the replicas once an epoch.
    """

    coef: torch.Tensor
    intercept: torch.Tensor
    replica: torch.Tensor | None = None

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


def _offsets(sizes: Sequence[int]) -> list[int]:
    """Start of every batch in the stacked rows, and the total at the end."""
    return list(itertools.accumulate(sizes, initial=0))


def _weighted_loss(
    ctx: StepContext, raw: torch.Tensor, target: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Sum over the rows of ``weight * loss(raw, target)``."""
    return ctx.family.loss(raw, target) @ weight


def take_rows(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``values[rows]`` along the first dimension.

    A one-column tensor is gathered through its 1-D view: on the CPU
    ``index_select`` copies each row of an ``(n, 1)`` tensor as a row
    (several times slower than the same values of an ``(n,)`` tensor).
    """
    if values.dim() == 2 and values.shape[1] == 1 and values.is_contiguous():
        return values.view(-1).index_select(0, rows).view(-1, 1)
    return values.index_select(0, rows)


def sgd_step(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    rows: torch.Tensor,
    eta: float,
    with_loss: bool = True,
) -> torch.Tensor | None:
    """One plain minibatch SGD step on batch ``rows``; returns the weighted loss sum.

    The reference the s-step kernel is tested against, and the s=1 path.
    ``with_loss=False`` skips the loss (SVRG measures its objective in the
    full pass) and returns None.
    """
    policy = ctx.policy
    Y = ctx.gather(data.X, rows)
    margins = matmul(Y, state.coef).to(policy.margin_storage).to(policy.comm_dtype)
    ctx.comm.all_reduce(margins)
    raw = margins.to(policy.margin_storage).to(policy.recurrence) + state.intercept
    target = take_rows(data.target, rows)
    weight = data.sample_weight.index_select(0, rows)
    loss = _weighted_loss(ctx, raw, target, weight) if with_loss else None
    gradient = ctx.family.gradient(raw, target)
    snapshot = data.snapshot
    if snapshot is not None:
        gradient = gradient - take_rows(snapshot.gradient, rows)
    scaled = gradient.mul_((eta / rows.shape[0]) * weight[:, None])
    if ctx.decay_alpha:
        state.coef.mul_(1.0 - eta * ctx.decay_alpha)
    state.coef.sub_(transpose_matmul(Y, scaled).to(state.coef.dtype))
    if snapshot is not None:
        state.coef.sub_(snapshot.mean_gradient, alpha=eta)
    if ctx.fit_intercept:
        state.intercept.sub_(scaled.sum(dim=0))
        if snapshot is not None:
            state.intercept.sub_(snapshot.mean_gradient_intercept, alpha=eta)
    return loss


@dataclass
class OuterBatch:
    """The rows of one outer iteration with the part that needs no weights done.

    ``packed`` is the outer iteration's one all-reduce buffer: the strictly
    lower Gram blocks ``G_{j,<j}`` row-block by row-block, already formed,
    then room for the margins from ``margin_start`` on (with row steps there
    is no Gram: ``margin_start`` is 0). ``Y`` holds the rows in the update
    dtype (the Gram's operand when the dtypes agree, so Y is upcast once);
    with a :class:`RowExchange`, this rank's as sent (Gram input dtype).
    With a snapshot the margins have ``2k`` columns (``Y w`` then ``Y mu``)
    and ``snapshot_gradient`` holds the rows' ``dl/dz(z~)``. With a
    :class:`RowExchange`, ``rows_full`` holds every rank's columns of the
    rows once they are gathered (recurrence dtype), and the rank forms the
    margins in ``packed`` from them and its replica of the weights: nothing
    of ``packed`` is exchanged.
    """

    sizes: list[int]
    Y: torch.Tensor | SparseRows
    target: torch.Tensor
    sample_weight: torch.Tensor
    packed: torch.Tensor
    margin_start: int
    snapshot_gradient: torch.Tensor | None = None
    send: torch.Tensor | None = None  # with a RowExchange: this rank's columns to all-gather
    rows_full: torch.Tensor | None = None  # with a RowExchange: every rank's columns

    def step_rows(self) -> torch.Tensor | SparseRows:
        """The rows :func:`inner_steps` reads: every column's after a gather, else ``Y``."""
        return self.Y if self.send is None else self.rows_full


@dataclass(frozen=True)
class GatherSpec:
    """What is fixed about gathering an outer iteration's rows (see :func:`gather_rows`)."""

    sizes: tuple[int, ...]
    margin_columns: int  # k, or 2k with a snapshot (``Y w`` and ``Y mu``)
    comm_dtype: torch.dtype
    gram_input: torch.dtype  # the Gram's rounding of the rows
    gram_operand: torch.dtype  # the dtype the GEMM reads them in (see gram_operand_dtype)
    gram_accumulate: torch.dtype
    update_accumulate: torch.dtype
    row_steps: bool = False  # the steps run from the rows: no Gram is formed
    # The rows are all-gathered (RowExchange): the steps read every rank's,
    # so this rank's are only sent, in the Gram input dtype.
    exchanged: bool = False

    @property
    def margin_start(self) -> int:
        """Where the margins start in ``packed``: after the Gram blocks, if any."""
        return 0 if self.row_steps else gram_numel(self.sizes)


def gather_outer_batch(
    ctx: StepContext, data: LocalData, rows: torch.Tensor, sizes: Sequence[int]
) -> OuterBatch:
    """Gather ``rows`` (``sizes[j]`` of them form batch j) and form their Gram blocks.

    Nothing here reads the weights, so it can run while the previous outer
    iteration's all-reduce is in flight.
    """
    policy = ctx.policy
    k = data.target.shape[1]
    spec = GatherSpec(
        tuple(sizes),
        k * (1 if data.snapshot is None else 2),
        policy.comm_dtype,
        policy.gram_input,
        gram_operand_dtype(policy, data.X.device),
        policy.gram_accumulate,
        policy.update_accumulate,
        row_steps=ctx.row_steps,
        exchanged=ctx.exchange is not None,
    )
    if isinstance(data.X, CSRMatrix):
        return _gather_sparse(ctx, data, rows, spec)
    scaling = ctx.row_scaling
    packed, Y, target, weight, snapshot_gradient, Y_input = gather_rows(
        spec,
        data.X,
        rows,
        data.target,
        data.sample_weight,
        None if data.snapshot is None else data.snapshot.gradient,
        None if scaling is None else scaling.center,
        None if scaling is None else scaling.scale,
    )
    return OuterBatch(
        sizes=list(sizes),
        Y=Y,
        target=target,
        sample_weight=weight,
        packed=packed,
        margin_start=spec.margin_start,
        snapshot_gradient=snapshot_gradient,
        send=None if ctx.exchange is None else _send_buffer(ctx, Y_input),
    )


def _gather_sparse(
    ctx: StepContext, data: LocalData, rows: torch.Tensor, spec: GatherSpec
) -> OuterBatch:
    """:func:`gather_outer_batch` for a sparse X: the rows stay sparse, the Gram is dense.

    Eager only (torch.compile does not take sparse tensors), and always
    with the Gram all-reduce (rows are not all-gathered) and the Gram steps.
    """
    if spec.row_steps:
        raise ValueError("Sparse rows run the steps from their Gram: row_steps=False.")
    Y = data.X.gather(rows, spec.update_accumulate, ctx.centering)
    margin_start = spec.margin_start
    packed = torch.empty(
        margin_start + Y.n_rows * spec.margin_columns, dtype=spec.comm_dtype, device=data.X.device
    )
    gram = Y.gram(spec.gram_input, spec.gram_accumulate)
    for lo, hi, block in _gram_slots(spec.sizes, packed):
        block.copy_(gram[lo:hi, :lo])
    snapshot = data.snapshot
    return OuterBatch(
        sizes=list(spec.sizes),
        Y=Y,
        target=take_rows(data.target, rows),
        sample_weight=data.sample_weight.index_select(0, rows),
        packed=packed,
        margin_start=margin_start,
        snapshot_gradient=None if snapshot is None else take_rows(snapshot.gradient, rows),
    )


def _send_buffer(ctx: StepContext, Y_input: torch.Tensor) -> torch.Tensor:
    """This rank's all-gather part: its columns of the rows, padded to the widest block."""
    padded = ctx.exchange.padded_width
    if Y_input.shape[1] == padded and Y_input.is_contiguous():
        return Y_input
    send = Y_input.new_empty((Y_input.shape[0], padded))
    send[:, : Y_input.shape[1]] = Y_input
    send[:, Y_input.shape[1] :] = 0
    return send


def _gram_slots(sizes: Sequence[int], packed: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """Where ``packed`` holds each strictly lower Gram block ``G_{j,<j}``, row-block by row-block.

    ``(lo, hi, block)`` per batch j >= 1: rows ``lo:hi`` against rows ``:lo``,
    ``block`` the ``(hi - lo, lo)`` view of ``packed`` to write them to.
    """
    offsets = _offsets(sizes)
    slots, start = [], 0
    for j in range(1, len(sizes)):
        lo, hi = offsets[j], offsets[j + 1]
        slots.append((lo, hi, packed[start : start + (hi - lo) * lo].view(hi - lo, lo)))
        start += (hi - lo) * lo
    return slots


def _write_gram_blocks(
    Y_gram: torch.Tensor, sizes: Sequence[int], accumulate: torch.dtype, packed: torch.Tensor
) -> None:
    """The strictly lower Gram blocks of ``Y_gram``, row-block by row-block, into ``packed``."""
    for lo, hi, block in _gram_slots(sizes, packed):
        gram_block(Y_gram[lo:hi], Y_gram[:lo], accumulate, block)


def _join_blocks(
    gathered: torch.Tensor, widths: Sequence[int], dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """The ranks' column blocks of an all-gather, unpadded and joined along ``dim``, in ``dtype``.

    ``gathered[r]`` is rank r's block, padded along ``dim`` to the widest.
    """
    shape = list(gathered.shape[1:])
    shape[dim] = sum(widths)
    joined = gathered.new_empty(shape, dtype=dtype)
    start = 0
    for part, width in zip(gathered, widths, strict=True):
        joined.narrow(dim, start, width).copy_(part.narrow(dim, 0, width))
        start += width
    return joined


def gather_blocks(
    comm: Communicator, widths: Sequence[int], local: torch.Tensor, dim: int
) -> torch.Tensor:
    """Every rank's block of ``local`` (``widths[r]`` along ``dim``) joined along ``dim``.

    One all-gather; the blocks travel padded to the widest.
    """
    shape = list(local.shape)
    shape[dim] = max(widths)
    send = local.new_zeros(shape)
    send.narrow(dim, 0, local.shape[dim]).copy_(local)
    gathered = send.new_empty((len(widths), *shape))
    comm.start_all_gather(gathered.view(-1), send.view(-1)).wait()
    return _join_blocks(gathered, widths, dim, gathered.dtype)


class _PendingRows:
    """Batches' rows on their way from every rank; ``wait()`` puts them in their ``rows_full``."""

    def __init__(self, ctx: StepContext, batches: Sequence[OuterBatch]) -> None:
        self._ctx, self._batches = ctx, batches
        send = batches[0].send if len(batches) == 1 else torch.cat([b.send for b in batches])
        self._gathered = send.new_empty((ctx.comm.world_size, *send.shape))
        self._pending = ctx.comm.start_all_gather(self._gathered.view(-1), send.view(-1))

    def wait(self) -> None:
        self._pending.wait()
        ctx = self._ctx
        rows_full = _join_blocks(self._gathered, ctx.exchange.widths, 1, ctx.policy.recurrence)
        start = 0
        for batch in self._batches:
            rows = sum(batch.sizes)
            batch.rows_full = rows_full[start : start + rows]
            start += rows


def start_row_exchange(ctx: StepContext, batches: Sequence[OuterBatch]) -> PendingReduce:
    """Start all-gathering the rows of ``batches`` (a :class:`RowExchange`) in one collective.

    ``wait()`` assembles every batch's ``rows_full``. The rows need no
    weights: the engine starts the next batches' exchange before these
    batches' steps, which then run while it is in flight.
    """
    return _PendingRows(ctx, batches)


def replicate_weights(
    ctx: StepContext, state: ModelState, snapshot: Snapshot | None
) -> Snapshot | None:
    """Copy every rank's weights (and SVRG's ``mu``) into the replicas; the snapshot back.

    One all-gather of the ranks' own rows of ``coef`` (and ``mean_gradient``)
    at the start of an epoch: whatever changed a rank's own weights since
    (an epoch undone, a warm start, a resumed fit) reaches every replica.
    The snapshot comes back with ``replica_mean_gradient`` set.
    """
    k = state.coef.shape[1]
    parts = [state.coef] if snapshot is None else [state.coef, snapshot.mean_gradient]
    every = gather_blocks(ctx.comm, ctx.exchange.widths, torch.cat(parts, dim=1), 0)
    state.replica.copy_(every[:, :k])
    if snapshot is None:
        return None
    return replace(snapshot, replica_mean_gradient=every[:, k:].contiguous())


def gather_rows(
    spec: GatherSpec,
    X: torch.Tensor,
    rows: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor,
    snapshot_gradient: torch.Tensor | None,
    center: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """The tensors of one outer iteration: ``packed`` with its Gram blocks, Y and the row data.

    The last is the rows rounded to the Gram input dtype (what a
    :class:`RowExchange` sends).

    ``packed`` holds the strictly lower Gram blocks ``G_{j,<j}`` row-block by
    row-block, written in place (none with ``spec.row_steps``), then room
    for the margins. With ``center``
    and ``scale`` the rows are preconditioned (:meth:`StepContext.rows`).
    Static shapes and no host synchronization, like :func:`inner_steps`,
    but it runs eager even when the steps are compiled: its time is the
    Gram GEMMs, and inductor writes them to temporaries that it then copies
    into ``packed`` (1.6x slower than eager on the CPU at s=16, b=32, d=128).
    """
    sizes = spec.sizes
    offsets = _offsets(sizes)
    margin_start = spec.margin_start
    packed = torch.empty(
        margin_start + offsets[-1] * spec.margin_columns, dtype=spec.comm_dtype, device=X.device
    )
    Y = X.index_select(0, rows)
    if scale is not None:  # the gathered rows are a copy: scaled in place where dtypes allow
        Y = precondition_rows(Y, center, scale, spec.gram_input, out=Y)
    Y_input = Y.to(spec.gram_input)
    if spec.exchanged:  # no Gram, and the margins and steps read every rank's rows
        Y_update = Y_input
    else:
        Y_gram = Y_input.to(spec.gram_operand)
        if not spec.row_steps:
            _write_gram_blocks(Y_gram, sizes, spec.gram_accumulate, packed)
        acc = spec.update_accumulate
        # The margins and the update read the rows the Gram was formed from.
        Y_update = Y_gram if Y_gram.dtype == acc else Y_input.to(acc)
    return (
        packed,
        Y_update,
        take_rows(target, rows),
        weight.index_select(0, rows),
        None if snapshot_gradient is None else take_rows(snapshot_gradient, rows),
        Y_input,
    )


# The smallest product ``C_s`` of one outer iteration's decay factors that
# the recurrence holds, by its dtype: ``U_k`` divides by ``C_{k+1}``, and a
# ``C_s`` near the dtype's smallest normal (float32: 1.2e-38) makes ``U``
# overflow and the weights NaN (s=32 at eta0 * alpha = 0.99: ``C_s`` = 1e-64).
# 2^-48 leaves float32 2^80 of range for ``|r| eta / b`` above it.
SMALLEST_DECAY_PRODUCT = {torch.float32: 2.0**-48, torch.float64: 2.0**-400}


def longest_recurrence(eta: float, decay_alpha: float, dtype: torch.dtype) -> int:
    """The most steps of size ``eta`` one outer iteration can take in a recurrence of ``dtype``.

    Their product of decay factors ``(1 - eta * decay_alpha)^s`` stays at
    least :data:`SMALLEST_DECAY_PRODUCT`. In exact arithmetic s does not
    change the iterates, so the engine takes fewer steps per outer
    iteration than asked rather than NaN. At least 1: a factor is at least
    2^-53 (``eta * decay_alpha < 1`` is checked before), and one step of
    plain SGD divides by nothing.
    """
    decay = 1.0 - eta * decay_alpha
    if decay >= 1.0:
        return sys.maxsize
    return max(1, int(math.log(SMALLEST_DECAY_PRODUCT[dtype]) / math.log(decay)))


def recurrence_step(s: int, decay_alpha: float, dtype: torch.dtype) -> float:
    """The longest step whose decay over ``s`` steps a recurrence of ``dtype`` holds.

    The inverse of :func:`longest_recurrence`: SVRG lengthens its step up
    to here, so that the step's growth never breaks the outer iteration.
    """
    if decay_alpha <= 0.0:
        return math.inf
    return (1.0 - SMALLEST_DECAY_PRODUCT[dtype] ** (1.0 / s)) / decay_alpha


def step_coefficients(
    etas: Sequence[float],
    sizes: Sequence[int],
    decay_alpha: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The scalars of one outer iteration's steps as one ``(5, s + 1)`` device tensor.

    Column ``j < s`` holds ``eta_j / (b_j C_{j+1})`` (the factor of ``U_j``),
    ``C_{j+1}``, ``C_j``, ``D_j`` and ``E_j``; column ``s`` holds ``C_s``,
    ``D_s`` and ``E_s`` in rows 2-4 (rows 0-1 are zero). They are computed on
    the host in float64 and copied without a host synchronization (from
    pinned memory on CUDA), so the steps themselves read them as tensors:
    the outer iteration then has no Python scalar that changes between
    calls and can be compiled or captured once. The tensor is shared by
    every call with the same arguments (a constant step gives the same one
    for a whole epoch) and must not be written to.
    """
    return _step_coefficients(tuple(etas), tuple(sizes), decay_alpha, dtype, device)


@functools.lru_cache(maxsize=8)
def _step_coefficients(
    etas: tuple[float, ...],
    sizes: tuple[int, ...],
    decay_alpha: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    s = len(etas)
    values = [[0.0] * (s + 1) for _ in range(5)]
    decay, drift, elapsed = 1.0, 0.0, 0.0  # C_j, D_j (the weight of mu in w_j), E_j
    for j, eta in enumerate(etas):
        values[2][j], values[3][j], values[4][j] = decay, drift, elapsed
        step_decay = 1.0 - eta * decay_alpha
        drift = drift * step_decay + eta
        decay *= step_decay
        elapsed += eta
        values[0][j], values[1][j] = eta / (sizes[j] * decay), decay
    values[2][s], values[3][s], values[4][s] = decay, drift, elapsed
    coefficients = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return coefficients.pin_memory().to(device, non_blocking=True)
    return coefficients.to(device)


def _per_row(per_step: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``(m, s)`` per-step values repeated over the rows of each batch, ``(m, sum(sizes))``."""
    if all(size == sizes[0] for size in sizes):  # the common case: no ragged tail
        return per_step[:, :, None].expand(-1, -1, sizes[0]).reshape(per_step.shape[0], -1)
    return torch.cat(
        [per_step[:, j : j + 1].expand(-1, size) for j, size in enumerate(sizes)], dim=1
    )


@dataclass(frozen=True)
class InnerSpec:
    """What is fixed about the inner steps of an outer iteration: the shapes and the family.

    Equal specs share one compiled function (:meth:`StepContext.inner_steps`).
    """

    family: Family
    fit_intercept: bool
    sizes: tuple[int, ...]
    margin_start: int
    margin_storage: torch.dtype
    recurrence: torch.dtype
    device_type: str = "cpu"
    row_steps: bool = False  # from the rows (StepContext.row_steps), not the Gram
    fused: bool = False  # the row steps' recurrence as one Triton kernel (._triton)


def inner_steps(
    spec: InnerSpec,
    packed: torch.Tensor,
    Y: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor,
    coef: torch.Tensor,
    intercept: torch.Tensor,
    coefficients: torch.Tensor,
    snapshot_gradient: torch.Tensor | None,
    mean_gradient: torch.Tensor | None,
    mean_gradient_intercept: torch.Tensor | None,
) -> torch.Tensor:
    """The s steps of one outer iteration from its reduced ``packed`` buffer.

    ``Y`` is the rows the steps read: this rank's columns, or after a
    :class:`RowExchange` every rank's (``coef`` is then the replica of every
    rank's weights). Updates ``coef`` and ``intercept`` in place and returns the weighted
    loss sum over the s batches. Every shape is fixed by ``spec`` and every
    scalar that changes between calls is in the tensor ``coefficients``
    (:func:`step_coefficients`): no host synchronization and no graph break,
    so that ``torch.compile(fullgraph=True)`` takes it whole.

    With ``M_j = C_j m_j - D_j (Y mu)_j + beta_0 - E_j mu_beta`` (one
    expression over all rows) and ``c`` holding ``C_{k+1}`` on the rows of
    batch k, step j's raw prediction is

        raw_j = M_j - (C_j G_{j,<j} + 1 c_{<j}^T) U_{<j},

    one fused multiply-add and one ``addmm``. Row steps (``spec.row_steps``)
    form ``G_{j,<j} U_{<j} = Y_j v`` from the running ``v = Y_{<j}^T U_{<j}``
    and the intercept's part ``a = c_{<j}^T U_{<j}`` likewise:

        raw_j = M_j - C_j Y_j v - a,    v += Y_j^T U_j,    a += c_j^T U_j,

    and the weight update is the last ``v``.
    """
    sizes = spec.sizes
    rec = spec.recurrence
    s = len(sizes)
    k = coef.shape[1]
    offsets = _offsets(sizes)
    packed = packed.to(rec)
    margins = packed[spec.margin_start :].view(offsets[-1], -1)
    if spec.margin_storage != packed.dtype:
        margins = margins.to(spec.margin_storage).to(rec)
    per_row = _per_row(coefficients[:, :s], sizes)
    factor, c, C, D, E = per_row.unbind(0)
    M = margins[:, :k] * C[:, None]
    if mean_gradient is not None:
        M = torch.addcmul(M, D[:, None], margins[:, k:], value=-1.0)
    if spec.fit_intercept:
        M = M + intercept
        if mean_gradient_intercept is not None:
            M = torch.addcmul(M, E[:, None], mean_gradient_intercept[None, :], value=-1.0)
    factor = (factor * weight)[:, None]
    step_decay = coefficients[2].unbind()  # C_j as 0-d tensors, j = 0..s
    steps = (M, target, factor, snapshot_gradient, step_decay, c)
    if spec.fused:
        U, raw, v = fused_row_recurrence(
            spec.family, Y.to(rec), *steps[:4], coefficients, sizes[0], spec.fit_intercept
        )
        raws = [raw]
    elif spec.row_steps:
        U, raws, v = _row_recurrence(spec, Y.to(rec), *steps)
    else:
        U, raws = _gram_recurrence(spec, packed[: spec.margin_start], *steps)

    if spec.fit_intercept:
        intercept.sub_(c @ U)
    if spec.row_steps:
        update = v
    else:
        update = transpose_matmul(Y, U)
    coef.sub_(update.to(coef.dtype)).mul_(step_decay[s])
    if mean_gradient is not None:
        coef.addcmul_(mean_gradient, coefficients[3, s], value=-1.0)
        if spec.fit_intercept:
            intercept.addcmul_(mean_gradient_intercept, coefficients[4, s], value=-1.0)
    return spec.family.loss(torch.cat(raws), target) @ weight


def _residual(
    family: Family,
    raw: torch.Tensor,
    target: torch.Tensor,
    snapshot_gradient: torch.Tensor | None,
    factor: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One step's ``U_j = factor_j (dl/dz(raw_j) - dl/dz(z~_j))`` into ``out`` (no snapshot: 0)."""
    gradient = family.gradient(raw, target)
    if snapshot_gradient is not None:
        gradient = gradient - snapshot_gradient
    torch.mul(gradient, factor, out=out)


def _row_recurrence(
    spec: InnerSpec,
    Y: torch.Tensor,
    M: torch.Tensor,
    target: torch.Tensor,
    factor: torch.Tensor,
    snapshot_gradient: torch.Tensor | None,
    step_decay: Sequence[torch.Tensor],
    c: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """``U``, the raw predictions of every step and the last ``v``, from the rows."""
    sizes = spec.sizes
    k = M.shape[1]
    U = torch.empty_like(M)
    U_blocks, factors = U.split(sizes), factor.split(sizes)
    M_blocks, targets, Y_blocks, c_blocks = (
        M.split(sizes),
        target.split(sizes),
        Y.split(sizes),
        c.split(sizes),
    )
    snapshot_gradients = None if snapshot_gradient is None else snapshot_gradient.split(sizes)
    v = torch.zeros((Y.shape[1], k), dtype=M.dtype, device=M.device)
    a = torch.zeros(k, dtype=M.dtype, device=M.device)
    raws = [M_blocks[0]]  # C_0 = 1 and nothing before batch 0
    for j in range(len(sizes)):
        if j:
            raw = torch.addcmul(M_blocks[j], Y_blocks[j] @ v, step_decay[j], value=-1.0)
            raws.append(raw - a if spec.fit_intercept else raw)
        snapshot = None if snapshot_gradients is None else snapshot_gradients[j]
        _residual(spec.family, raws[j], targets[j], snapshot, factors[j], U_blocks[j])
        v = torch.addmm(v, Y_blocks[j].T, U_blocks[j])
        if spec.fit_intercept and j < len(sizes) - 1:
            a = a + c_blocks[j] @ U_blocks[j]
    return U, raws, v


def _gram_recurrence(
    spec: InnerSpec,
    grams: torch.Tensor,
    M: torch.Tensor,
    target: torch.Tensor,
    factor: torch.Tensor,
    snapshot_gradient: torch.Tensor | None,
    step_decay: Sequence[torch.Tensor],
    c: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``U`` and the raw predictions of every step, from the packed Gram blocks."""
    sizes = spec.sizes
    offsets = _offsets(sizes)
    U = torch.empty_like(M)
    U_blocks, factors = U.split(sizes), factor.split(sizes)
    M_blocks, targets = M.split(sizes), target.split(sizes)
    snapshot_gradients = None if snapshot_gradient is None else snapshot_gradient.split(sizes)
    block_sizes = [(offsets[j + 1] - offsets[j]) * offsets[j] for j in range(1, len(sizes))]
    blocks = grams.split(block_sizes)
    c_row = c[None, :]
    raws = [M_blocks[0]]  # C_0 = 1 and nothing before batch 0
    for j in range(len(sizes)):
        if j:
            lo = offsets[j]
            G = blocks[j - 1].view(sizes[j], lo)
            if spec.fit_intercept:
                G = torch.addcmul(c_row[:, :lo], G, step_decay[j])
            else:
                G = G * step_decay[j]
            raws.append(torch.addmm(M_blocks[j], G, U[:lo], alpha=-1.0))
        snapshot = None if snapshot_gradients is None else snapshot_gradients[j]
        _residual(spec.family, raws[j], targets[j], snapshot, factors[j], U_blocks[j])
    return U, raws


def gram_numel(sizes: Sequence[int]) -> int:
    """Values of the strictly lower Gram blocks of an outer iteration with these batch sizes."""
    offsets = _offsets(sizes)
    return sum((offsets[j + 1] - offsets[j]) * offsets[j] for j in range(1, len(sizes)))


def warm_up(
    ctx: StepContext, data: LocalData, state: ModelState, rows: torch.Tensor, sizes: Sequence[int]
) -> None:
    """Run the gather and the inner steps of one outer iteration on ``rows``, changing nothing.

    With ``ctx.compiled`` this compiles both for these shapes: the real
    calls then meet the same guards (shapes, dtypes, devices, layouts).
    """
    batch = gather_outer_batch(ctx, data, rows, sizes)
    if ctx.exchange is not None:  # the full rows, as the all-gather would bring them
        batch.rows_full = torch.zeros(
            (sum(sizes), sum(ctx.exchange.widths)),
            dtype=ctx.policy.recurrence,
            device=data.X.device,
        )
    snapshot = data.snapshot
    weights = state.step_weights()
    ctx.inner_steps(_inner_spec(ctx, batch))(
        batch.packed.zero_(),
        batch.step_rows(),
        batch.target,
        batch.sample_weight,
        weights.clone(),
        state.intercept.clone(),
        torch.zeros((5, len(sizes) + 1), dtype=ctx.policy.recurrence, device=data.X.device),
        batch.snapshot_gradient,
        None if snapshot is None else torch.zeros_like(weights),
        None if snapshot is None else snapshot.mean_gradient_intercept,
    )


def _inner_spec(ctx: StepContext, batch: OuterBatch) -> InnerSpec:
    policy = ctx.policy
    device_type = batch.packed.device.type
    fused = (
        ctx.fused
        and triton_available(device_type)
        and triton_supports(
            ctx.family, batch.sizes, batch.target.shape[1], batch.step_rows().shape[1]
        )
    )
    return InnerSpec(
        ctx.family,
        ctx.fit_intercept,
        tuple(batch.sizes),
        batch.margin_start,
        policy.margin_storage,
        policy.recurrence,
        device_type,
        ctx.row_steps,
        fused,
    )


def ca_outer_iteration(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    batch: OuterBatch,
    etas: Sequence[float] | torch.Tensor,
    upcoming: tuple[torch.Tensor, Sequence[int]] | None = None,
) -> tuple[torch.Tensor, OuterBatch | None]:
    """s SGD steps on the consecutive batches of ``batch`` with one collective.

    Batch j takes step size ``etas[j]``; ``etas`` may instead be the
    steps' :func:`step_coefficients` tensor itself (a CUDA graph reads
    them from a buffer of its own). Returns the weighted loss sum over
    the s batches and, when ``upcoming`` names the ``(rows, sizes)`` of the
    next outer iteration, that iteration gathered while this one's
    collective was in flight (the same arithmetic, in a different order).
    The collective is this iteration's all-reduce of the Gram and margins;
    with a :class:`RowExchange` the rows came before (``batch.rows_full``,
    :func:`start_row_exchange`) and this iteration exchanges nothing
    (``upcoming`` must be None). The steps themselves are
    :func:`inner_steps`, compiled when ``ctx.compiled``.
    """
    policy = ctx.policy
    snapshot = data.snapshot
    packed, margin_start = batch.packed, batch.margin_start
    if ctx.exchange is None:
        rows, weights = batch.Y, state.coef
        mean_gradient = None if snapshot is None else snapshot.mean_gradient
    else:
        if upcoming is not None:
            raise ValueError("With a RowExchange the engine gathers the rows ahead: no upcoming.")
        rows, weights = batch.rows_full, state.replica
        mean_gradient = None if snapshot is None else snapshot.replica_mean_gradient
    if mean_gradient is not None:
        weights = torch.cat([weights, mean_gradient], 1)
    margins = matmul(rows, weights)
    packed[margin_start:].view_as(margins).copy_(margins.to(policy.margin_storage))
    pending = ctx.comm.start_all_reduce(packed) if ctx.exchange is None else DONE
    following = None if upcoming is None else gather_outer_batch(ctx, data, *upcoming)
    # Host work for the steps overlaps the collective too.
    coefficients = (
        etas
        if isinstance(etas, torch.Tensor)
        else step_coefficients(etas, batch.sizes, ctx.decay_alpha, policy.recurrence, packed.device)
    )
    pending.wait()
    loss = ctx.inner_steps(_inner_spec(ctx, batch))(
        packed,
        batch.step_rows(),
        batch.target,
        batch.sample_weight,
        state.step_weights(),
        state.intercept,
        coefficients,
        batch.snapshot_gradient,
        mean_gradient,
        None if snapshot is None else snapshot.mean_gradient_intercept,
    )
    return loss, following
