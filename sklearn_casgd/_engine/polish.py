"""Finishing in float64: Newton epochs where a fit's own precision cannot certify its gap.

A float32 (or bf16-storage) fit measures its gradient through float32
products and residuals: on a log link with large raw predictions, or
columns in large units, that measurement carries rounding of about 1e-6,
the fit's fixed point sits that far from the optimum, and the gap bound
(:mod:`.certificate`), ``||g||^2 / (2 alpha)`` at a small ``alpha``, cannot
reach the gap ``tol`` names even where the true gap is far below it. Such a
fit, once its gradient test is met, continues from where it stopped with
Newton epochs in float64 arithmetic (X as stored, read in float64 chunks;
weights, targets and every sum in float64): from near the optimum they
converge quadratically, in one to three epochs, and the certificate is
measured in float64. The fit's coefficients are then those of float64.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from .._data.storage import CSRMatrix
from . import execution
from .comm import Communicator
from .planner import MAX_NEWTON_WIDTH, curvature_sample
from .precision import PrecisionPolicy
from .solver import run_epochs
from .solver_state import SolverResult, StepSchedule
from .state import LocalData, ModelState, Preconditioner, StepContext

if TYPE_CHECKING:
    from .fit import FitPlan

# The most Newton epochs a polish takes (within the fit's max_iter).
POLISH_EPOCHS = 4


def can_polish(plan: FitPlan, ctx: StepContext, X: torch.Tensor | CSRMatrix) -> bool:
    """Whether a fit may finish with float64 Newton epochs, should its gap stay uncertified.

    Below float64, with a gap certificate and a stopping test, for SVRG
    without an L1 part (no proximal Newton) and where Newton epochs run:
    dense rows of up to :data:`.planner.MAX_NEWTON_WIDTH` columns, or
    sparse rows on one rank.
    """
    sparse = isinstance(X, CSRMatrix)
    return (
        ctx.certificate is not None
        and plan.config.tol is not None
        and ctx.policy.recurrence != torch.float64
        and plan.config.solver == "svrg"
        and not plan.penalty.proximal
        and ctx.exchange is None
        and (
            ctx.comm.world_size == 1 if sparse else ctx.total_columns(X.shape[1]) < MAX_NEWTON_WIDTH
        )
    )


def polishes(plan: FitPlan, solver: SolverResult) -> bool:
    """Whether a fit that may polish and ended as ``solver`` says does: the certificate unmet.

    Its gradient test met (the coefficients near the optimum), its epochs
    not all spent, and no reason to have stopped other than the bound.
    """
    return (
        not solver.converged
        and solver.gap_target is not None
        and solver.failure is None
        and not solver.stopped_early
        and not solver.separated
        and solver.gradient_bound is not None
        and solver.gradient_max <= solver.gradient_bound
        and solver.n_iter < plan.config.max_iter
    )


def polish(
    plan: FitPlan,
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    solver: SolverResult,
    comm: Communicator,
    widths: tuple[int, ...],
) -> tuple[SolverResult, ModelState]:
    """Newton epochs in float64 from ``state``; the whole fit's result and the float64 state.

    ``plan.config`` is this rank's (a rank other than 0 reports no progress).
    """
    policy = _float64(ctx.policy)
    n_samples, n_outputs = data.X.shape[0], state.coef.shape[1]
    rows = plan.curvature_rows
    if not plan.newton and not isinstance(data.X, CSRMatrix):
        width = ctx.total_columns(data.X.shape[1])
        rows = curvature_sample(n_samples, n_outputs, width, ctx.family)
    newton = replace(plan, newton=True, curvature_rows=rows)
    preconditioner = ctx.preconditioner
    if preconditioner is not None:
        spread = preconditioner.spread
        preconditioner = Preconditioner(
            center=preconditioner.center.to(torch.float64),
            scale=preconditioner.scale.to(torch.float64),
            decay_alpha=preconditioner.decay_alpha,
            spread=None if spread is None else spread.to(torch.float64),
            in_storage=preconditioner.in_storage,
        )
    polish_ctx = execution.step_context(newton, policy, comm, preconditioner, data.X, widths, None)
    polish_data = LocalData(
        data.X, data.target.to(torch.float64), data.sample_weight.to(torch.float64)
    )
    polish_state = ModelState(state.coef.to(torch.float64), state.intercept.to(torch.float64))
    config = replace(
        plan.config,
        s=1,
        batch_size=n_samples,
        max_iter=min(POLISH_EPOCHS, plan.config.max_iter - solver.n_iter),
        gradient_unit=solver.gradient_unit,
        cold_intercept=None,
        hands_over=False,
        epochs_before=solver.n_iter,
    )
    schedule = StepSchedule(plan.learning_rate, 1.0, plan.power_t, 1.0)
    polished = run_epochs(polish_ctx, polish_data, polish_state, config, schedule, plan.loss_offset)
    return _merged(solver, polished), polish_state


def _float64(policy: PrecisionPolicy) -> PrecisionPolicy:
    """``policy`` with every choice but X's storage in float64."""
    wide = torch.float64
    return replace(
        policy,
        margin_storage=wide,
        gram_input=wide,
        gram_accumulate=wide,
        gram_comm=wide,
        margin_comm=wide,
        recurrence=wide,
        update_accumulate=wide,
        weight_storage=wide,
    )


def _merged(first: SolverResult, polished: SolverResult) -> SolverResult:
    """One fit's result: ``first``'s epochs, then the polish's."""
    return replace(
        polished,
        n_iter=first.n_iter + polished.n_iter,
        n_steps=first.n_steps + polished.n_steps,
        n_outer=first.n_outer + polished.n_outer,
        loss_curve=first.loss_curve + polished.loss_curve,
        train_seconds=first.train_seconds + polished.train_seconds,
        epoch_seconds=first.epoch_seconds
        + [first.train_seconds + seconds for seconds in polished.epoch_seconds],
        final_eta=first.final_eta,
        # partial_fit continues the minibatch steps where they stood
        state=replace(first.state, epochs=first.state.epochs + polished.n_iter),
        validation_scores=first.validation_scores,
        stopped_early=first.stopped_early,
        polished=polished.n_iter,
        resumed_epochs=first.resumed_epochs,
        stalled=polished.stalled and not polished.converged,
    )
