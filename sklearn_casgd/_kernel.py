"""One step of the engine on a local column block.

:func:`sgd_step` is plain minibatch SGD; :func:`ca_outer_iteration` does s
of those steps with a single reduction (DESIGN.md section 2). In exact
arithmetic both give the same iterates; the tests hold them to that in
float64.

Notation: for the steps t = 0..s-1 of an outer iteration, ``decay_t =
1 - eta_t * alpha`` and ``C_j = prod_{t<j} decay_t``. With ``U_k = (eta_k /
b_k) r_k / C_{k+1}`` the plain recurrence unrolls to

    z_j = C_j (m_j - G_{j,<j} U_{<j}) + beta_j,      w_s = C_s (w_0 - Y^T U),

so the inner steps only rescale one vector instead of the whole history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._comm import Communicator
from ._families import Family
from ._precision import PrecisionPolicy, gram


@dataclass(frozen=True)
class StepContext:
    """What every step needs besides the data and the state."""

    family: Family
    policy: PrecisionPolicy
    alpha: float
    fit_intercept: bool
    comm: Communicator


@dataclass(frozen=True)
class LocalData:
    """The rows of one rank: its column block of X, targets and weights."""

    X: torch.Tensor  # (n, d_local), policy.x_storage
    target: torch.Tensor  # (n, k), policy.recurrence
    sample_weight: torch.Tensor  # (n,), policy.recurrence


@dataclass
class ModelState:
    """Local weight slice ``(d_local, k)`` and the (replicated) intercept ``(k,)``."""

    coef: torch.Tensor
    intercept: torch.Tensor


def _margins(Y: torch.Tensor, state: ModelState, policy: PrecisionPolicy) -> torch.Tensor:
    """``Y @ w`` accumulated in ``update_accumulate``, rounded to ``margin_storage``."""
    acc = policy.update_accumulate
    m = Y.to(acc) @ state.coef.to(acc)
    return m.to(policy.margin_storage)


def _residual(
    ctx: StepContext, raw: torch.Tensor, target: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted dl/dz ``(b, k)`` and the weighted loss sum of one batch."""
    loss, grad = ctx.family.loss_gradient(raw, target)
    return grad * weight[:, None], loss @ weight


def sgd_step(
    ctx: StepContext, data: LocalData, state: ModelState, rows: torch.Tensor, eta: float
) -> torch.Tensor:
    """One plain minibatch SGD step on batch ``rows``; returns the weighted loss sum."""
    policy = ctx.policy
    Y = data.X.index_select(0, rows)
    margins = _margins(Y, state, policy).to(policy.comm_dtype)
    ctx.comm.all_reduce(margins)
    raw = margins.to(policy.margin_storage).to(policy.recurrence) + state.intercept
    residual, loss = _residual(
        ctx, raw, data.target.index_select(0, rows), data.sample_weight.index_select(0, rows)
    )
    scale = eta / rows.shape[0]
    if ctx.alpha:
        state.coef.mul_(1.0 - eta * ctx.alpha)
    acc = policy.update_accumulate
    state.coef.sub_((Y.to(acc).T @ (scale * residual).to(acc)).to(state.coef.dtype))
    if ctx.fit_intercept:
        state.intercept.sub_(scale * residual.sum(dim=0))
    return loss


def ca_outer_iteration(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    rows: torch.Tensor,
    sizes: Sequence[int],
    etas: Sequence[float],
) -> torch.Tensor:
    """s SGD steps on the consecutive batches of ``rows`` with one reduction.

    ``sizes[j]`` rows of ``rows`` form batch j, taken with step size
    ``etas[j]``. Returns the weighted loss sum over the s batches.
    """
    policy = ctx.policy
    rec = policy.recurrence
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    s = len(sizes)

    Y = data.X.index_select(0, rows)
    # Strictly lower block triangle: row block j against all earlier rows.
    blocks = [gram(Y[offsets[j] : offsets[j + 1]], Y[: offsets[j]], policy) for j in range(1, s)]
    packed = torch.cat(
        [b.reshape(-1).to(policy.gram_comm) for b in blocks]
        + [_margins(Y, state, policy).reshape(-1).to(policy.margin_comm)]
    ).to(policy.comm_dtype)
    ctx.comm.all_reduce(packed)

    k = state.coef.shape[1]
    block_ends = [0]
    for j in range(1, s):
        block_ends.append(block_ends[-1] + sizes[j] * offsets[j])
    margins = packed[block_ends[-1] :].view(offsets[-1], k).to(policy.margin_storage).to(rec)

    target = data.target.index_select(0, rows)
    weight = data.sample_weight.index_select(0, rows)
    U = torch.empty((offsets[-1], k), dtype=rec, device=Y.device)
    decay_product = 1.0  # C_j
    loss = torch.zeros((), dtype=rec, device=Y.device)
    for j in range(s):
        lo, hi = offsets[j], offsets[j + 1]
        raw = margins[lo:hi]
        if j:
            G = packed[block_ends[j - 1] : block_ends[j]].view(hi - lo, lo).to(rec)
            raw = raw - G @ U[:lo]
        raw = decay_product * raw + state.intercept
        residual, batch_loss = _residual(ctx, raw, target[lo:hi], weight[lo:hi])
        loss = loss + batch_loss
        eta = etas[j]
        scale = eta / (hi - lo)
        decay_product *= 1.0 - eta * ctx.alpha
        torch.mul(residual, scale / decay_product, out=U[lo:hi])
        if ctx.fit_intercept:
            state.intercept.sub_(scale * residual.sum(dim=0))

    acc = policy.update_accumulate
    state.coef.sub_((Y.to(acc).T @ U.to(acc)).to(state.coef.dtype))
    state.coef.mul_(decay_product)
    return loss
