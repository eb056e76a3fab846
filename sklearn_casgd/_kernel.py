"""One step of the engine on a local column block.

:func:`sgd_step` is plain minibatch SGD; :func:`ca_outer_iteration` does s
of those steps with a single reduction (DESIGN.md section 2). In exact
arithmetic both give the same iterates; the tests hold them to that in
float64. The Gram blocks need no weights, so :func:`gather_outer_batch`
forms the next outer iteration's while this one's all-reduce is in flight.

Notation: for the steps t = 0..s-1 of an outer iteration, ``decay_t =
1 - eta_t * alpha`` and ``C_j = prod_{t<j} decay_t``. With ``U_k = (eta_k /
b_k) r_k / C_{k+1}`` the plain recurrence unrolls to

    z_j = C_j (m_j - G_{j,<j} U_{<j}) + beta_j,      w_s = C_s (w_0 - Y^T U),

so the inner steps only rescale one vector instead of the whole history.

With a variance-reduction snapshot (SVRG, DESIGN.md section 2b) every step
also subtracts ``eta_t mu`` and the residuals are ``omega (dl/dz(z) -
dl/dz(z~))``. The constant ``mu`` unrolls like the decay: with ``D_0 = 0``,
``D_{j+1} = decay_j D_j + eta_j`` and ``E_j = sum_{t<j} eta_t``,

    z_j = C_j (m_j - G_{j,<j} U_{<j}) - D_j (Y mu)_j + beta_j - E_j mu_beta,
    w_s = C_s (w_0 - Y^T U) - D_s mu,

so ``Y mu`` rides in the same margins GEMM and the same all-reduce.

SVRG may also run preconditioned (:class:`Preconditioner`): on ``v = D w``
and the rows ``Y D^{-1}``, whose Gram is the preconditioned Gram, with the
scalar decay of the largest penalty curvature ``alpha / min D^2`` and the
rest of the per-column penalty in the snapshot's constant (DESIGN.md 2b).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._comm import Communicator
from ._families import Family
from ._precision import PrecisionPolicy, gram, gram_operand


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


@dataclass(frozen=True)
class StepContext:
    """What every step needs besides the data and the state."""

    family: Family
    policy: PrecisionPolicy
    alpha: float
    fit_intercept: bool
    comm: Communicator
    preconditioner: Preconditioner | None = None

    @property
    def decay_alpha(self) -> float:
        """The L2 rate of the steps' scalar decay (``alpha`` unless preconditioned)."""
        return self.alpha if self.preconditioner is None else self.preconditioner.decay_alpha

    def rows(self, X_rows: torch.Tensor) -> torch.Tensor:
        """Rows of X as the steps see them: ``(x - m) D^{-1}`` when preconditioned.

        Unscaled rows come back as they are (storage dtype); scaled ones in
        the update dtype.
        """
        if self.preconditioner is None:
            return X_rows
        preconditioner = self.preconditioner
        return (X_rows.to(preconditioner.scale.dtype) - preconditioner.center) / (
            preconditioner.scale
        )


@dataclass(frozen=True)
class Snapshot:
    """The SVRG control variate of one epoch, taken at the snapshot ``w~, beta~``.

    ``gradient`` is ``dl/dz`` of every row at the snapshot (unweighted),
    ``mean_gradient`` this rank's slice of ``mu = X^T (omega * gradient) / n``
    and ``mean_gradient_intercept`` its intercept part (zero without an
    intercept).
    """

    gradient: torch.Tensor  # (n, k), policy.recurrence
    mean_gradient: torch.Tensor  # (d_local, k), policy.weight_storage
    mean_gradient_intercept: torch.Tensor  # (k,), policy.recurrence


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
    """Local weight slice ``(d_local, k)`` and the (replicated) intercept ``(k,)``."""

    coef: torch.Tensor
    intercept: torch.Tensor


def _offsets(sizes: Sequence[int]) -> list[int]:
    """Start of every batch in the stacked rows, and the total at the end."""
    return list(itertools.accumulate(sizes, initial=0))


def _weighted_loss(
    ctx: StepContext, raw: torch.Tensor, target: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Sum over the rows of ``weight * loss(raw, target)``."""
    return ctx.family.loss(raw, target) @ weight


def sgd_step(
    ctx: StepContext, data: LocalData, state: ModelState, rows: torch.Tensor, eta: float
) -> torch.Tensor:
    """One plain minibatch SGD step on batch ``rows``; returns the weighted loss sum.

    The reference the s-step kernel is tested against, and the s=1 path.
    """
    policy = ctx.policy
    Y = ctx.rows(data.X.index_select(0, rows)).to(policy.update_accumulate)
    margins = (Y @ state.coef.to(Y.dtype)).to(policy.margin_storage).to(policy.comm_dtype)
    ctx.comm.all_reduce(margins)
    raw = margins.to(policy.margin_storage).to(policy.recurrence) + state.intercept
    target = data.target.index_select(0, rows)
    weight = data.sample_weight.index_select(0, rows)
    loss = _weighted_loss(ctx, raw, target, weight)
    gradient = ctx.family.gradient(raw, target)
    snapshot = data.snapshot
    if snapshot is not None:
        gradient = gradient - snapshot.gradient.index_select(0, rows)
    scaled = gradient.mul_((eta / rows.shape[0]) * weight[:, None])
    if ctx.decay_alpha:
        state.coef.mul_(1.0 - eta * ctx.decay_alpha)
    state.coef.sub_((Y.T @ scaled.to(Y.dtype)).to(state.coef.dtype))
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
    then room for the margins from ``margin_start`` on. ``Y`` holds the rows
    in the update dtype (the Gram's operand when the dtypes agree, so Y is
    upcast once). With a snapshot the margins have ``2k`` columns (``Y w``
    then ``Y mu``) and ``snapshot_gradient`` holds the rows' ``dl/dz(z~)``.
    """

    sizes: list[int]
    Y: torch.Tensor
    target: torch.Tensor
    sample_weight: torch.Tensor
    packed: torch.Tensor
    margin_start: int
    snapshot_gradient: torch.Tensor | None = None


def gather_outer_batch(
    ctx: StepContext, data: LocalData, rows: torch.Tensor, sizes: Sequence[int]
) -> OuterBatch:
    """Gather ``rows`` (``sizes[j]`` of them form batch j) and form their Gram blocks.

    Nothing here reads the weights, so it can run while the previous outer
    iteration's all-reduce is in flight.
    """
    policy = ctx.policy
    offsets = _offsets(sizes)
    s = len(sizes)
    margin_columns = data.target.shape[1] * (1 if data.snapshot is None else 2)
    gram_numel = sum((offsets[j + 1] - offsets[j]) * offsets[j] for j in range(1, s))
    packed = torch.empty(
        gram_numel + offsets[-1] * margin_columns, dtype=policy.comm_dtype, device=data.X.device
    )
    Y = ctx.rows(data.X.index_select(0, rows))
    Y_gram = gram_operand(Y, policy)
    start = 0
    for j in range(1, s):
        lo, hi = offsets[j], offsets[j + 1]
        block = packed[start : start + (hi - lo) * lo].view(hi - lo, lo)
        gram(Y_gram[lo:hi], Y_gram[:lo], policy, out=block)
        start += (hi - lo) * lo
    acc = policy.update_accumulate
    Y_update = Y_gram if Y_gram.dtype == acc else Y.to(acc)
    return OuterBatch(
        sizes=list(sizes),
        Y=Y_update,
        target=data.target.index_select(0, rows),
        sample_weight=data.sample_weight.index_select(0, rows),
        packed=packed,
        margin_start=start,
        snapshot_gradient=None
        if data.snapshot is None
        else data.snapshot.gradient.index_select(0, rows),
    )


def _per_row(values: list[list[float]], sizes: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Per-step ``values`` repeated over the rows of each batch, ``(len(values), sum(sizes))``."""
    per_step = torch.tensor(values, dtype=like.dtype, device=like.device)
    if all(size == sizes[0] for size in sizes):  # the common case: no ragged tail
        return per_step[:, :, None].expand(-1, -1, sizes[0]).reshape(len(values), -1)
    return per_step.repeat_interleave(torch.tensor(sizes, device=like.device), dim=1)


def ca_outer_iteration(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    batch: OuterBatch,
    etas: Sequence[float],
    upcoming: tuple[torch.Tensor, Sequence[int]] | None = None,
) -> tuple[torch.Tensor, OuterBatch | None]:
    """s SGD steps on the consecutive batches of ``batch`` with one reduction.

    Batch j takes step size ``etas[j]``. Returns the weighted loss sum over
    the s batches and, when ``upcoming`` names the ``(rows, sizes)`` of the
    next outer iteration, that iteration gathered while this one's
    all-reduce was in flight (the same arithmetic, in a different order).

    The intercept rides along in the recurrence: with ``c`` holding
    ``C_{k+1}`` on the rows of batch k, ``beta_j = beta_0 - c_{<j}^T U_{<j}``,
    so ``raw_j = C_j (m_j + beta_0 / C_j) - C_j (G_j + 1 c_{<j}^T / C_j) U_{<j}``
    is one ``addmm`` per step.
    """
    policy = ctx.policy
    rec = policy.recurrence
    sizes = batch.sizes
    offsets = _offsets(sizes)
    s = len(sizes)
    k = state.coef.shape[1]
    device = data.X.device
    snapshot = data.snapshot

    Y_update, packed, margin_start = batch.Y, batch.packed, batch.margin_start
    weights = state.coef if snapshot is None else torch.cat([state.coef, snapshot.mean_gradient], 1)
    margins = torch.mm(Y_update, weights.to(Y_update.dtype))
    packed[margin_start:].view_as(margins).copy_(margins.to(policy.margin_storage))
    pending = ctx.comm.start_all_reduce(packed)
    following = None if upcoming is None else gather_outer_batch(ctx, data, *upcoming)
    pending.wait()
    packed = packed.to(rec)
    margins = packed[margin_start:].view(offsets[-1], weights.shape[1])
    if policy.margin_storage != policy.comm_dtype:
        margins = margins.to(policy.margin_storage).to(rec)

    decay = [1.0]  # decay[j] = C_j
    drift = [0.0]  # drift[j] = D_j, the weight of mu in w_j
    for eta in etas:
        drift.append(drift[-1] * (1.0 - eta * ctx.decay_alpha) + eta)
        decay.append(decay[-1] * (1.0 - eta * ctx.decay_alpha))
    elapsed = list(itertools.accumulate(etas, initial=0.0))  # E_j
    per_row = _per_row(
        [
            [etas[j] / (sizes[j] * decay[j + 1]) for j in range(s)],  # U_j = gradient * this
            decay[1:],  # c
            [1.0 / c for c in decay[:-1]],  # 1 / C_j
            [d / c for d, c in zip(drift[:-1], decay[:-1], strict=True)],  # D_j / C_j
            [e / c for e, c in zip(elapsed[:-1], decay[:-1], strict=True)],  # E_j / C_j
        ],
        sizes,
        margins,
    )
    target, weight = batch.target, batch.sample_weight
    factor = (per_row[0] * weight)[:, None]
    c = per_row[1]
    if snapshot is not None:  # m_j - (D_j / C_j) (Y mu)_j
        margins = torch.addcmul(margins[:, :k], per_row[3][:, None], margins[:, k:], value=-1.0)
    if ctx.fit_intercept:  # + beta_0 / C_j, and - (E_j / C_j) mu_beta with a snapshot
        margins = torch.addcmul(margins, per_row[2][:, None], state.intercept[None, :])
        if snapshot is not None:
            margins.addcmul_(
                per_row[4][:, None], snapshot.mean_gradient_intercept[None, :], value=-1.0
            )

    U = torch.empty((offsets[-1], k), dtype=rec, device=device)
    block_sizes = [(offsets[j + 1] - offsets[j]) * offsets[j] for j in range(1, s)]
    grams = packed[:margin_start].split(block_sizes)
    margin_blocks = margins.split(sizes)
    targets, factors, U_blocks = target.split(sizes), factor.split(sizes), U.split(sizes)
    snapshot_gradients = (
        None if batch.snapshot_gradient is None else batch.snapshot_gradient.split(sizes)
    )
    raws = [margin_blocks[0]]  # C_0 = 1
    for j in range(s):
        if j:
            lo = offsets[j]
            G = grams[j - 1].view(sizes[j], lo)
            if ctx.fit_intercept:
                G.add_(c[:lo], alpha=1.0 / decay[j])
            raws.append(torch.addmm(margin_blocks[j], G, U[:lo], beta=decay[j], alpha=-decay[j]))
        gradient = ctx.family.gradient(raws[j], targets[j])
        if snapshot_gradients is not None:
            gradient.sub_(snapshot_gradients[j])
        torch.mul(gradient, factors[j], out=U_blocks[j])

    if ctx.fit_intercept:
        state.intercept.sub_(c @ U)
    update = torch.mm(Y_update.T, U.to(Y_update.dtype))
    state.coef.sub_(update.to(state.coef.dtype)).mul_(decay[s])
    if snapshot is not None:
        state.coef.sub_(snapshot.mean_gradient, alpha=drift[s])
        if ctx.fit_intercept:
            state.intercept.sub_(snapshot.mean_gradient_intercept, alpha=elapsed[s])
    return _weighted_loss(ctx, torch.cat(raws), target, weight), following
