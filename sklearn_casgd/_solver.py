"""Epochs, step-size schedules, stopping and history.

The solver is a fixed sequence: draw one permutation per epoch from a
seeded generator, cut it into batches of ``batch_size`` (the last one
ragged), group ``s`` consecutive batches into an outer iteration, run the
kernel on it, and decide after the epoch whether to go on. ``s`` never
changes which batches are drawn, so every ``s`` walks the same path.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ._kernel import (
    LocalData,
    ModelState,
    StepContext,
    ca_outer_iteration,
    gather_outer_batch,
    sgd_step,
)
from ._progress import EpochProgress

LEARNING_RATES = ("adaptive", "constant", "invscaling")
# "adaptive" divides the step by this factor on every plateau ...
_ADAPTIVE_FACTOR = 5.0
# ... and stops once it has fallen below this fraction of eta0.
_ADAPTIVE_MIN_RATIO = 1e-4


@dataclass
class StepSchedule:
    """Step size of global step ``t`` (counted from 0 over the whole fit).

    ``constant``: ``eta0``. ``invscaling``: ``eta0 / (t + 1) ** power_t``.
    ``adaptive``: ``eta0`` until the training loss stops improving, then
    divided by 5 on each plateau; the fit has converged when it falls
    below ``1e-4 * eta0``.
    """

    kind: str
    eta0: float
    power_t: float = 0.5
    _eta: float = field(init=False)

    def __post_init__(self) -> None:
        if self.kind not in LEARNING_RATES:
            raise ValueError(f"learning_rate must be one of {LEARNING_RATES}, got {self.kind!r}.")
        self._eta = self.eta0

    def step_sizes(self, t_start: int, count: int) -> list[float]:
        if self.kind == "invscaling":
            return [self.eta0 / (t + 1) ** self.power_t for t in range(t_start, t_start + count)]
        return [self._eta] * count

    def on_plateau(self) -> bool:
        """React to a plateau of the training loss; return True to stop."""
        if self.kind != "adaptive":
            return True
        self._eta /= _ADAPTIVE_FACTOR
        return self._eta < _ADAPTIVE_MIN_RATIO * self.eta0

    @property
    def current(self) -> float:
        return self._eta


@dataclass(frozen=True)
class SolverConfig:
    """Loop settings of one fit."""

    s: int
    batch_size: int
    max_iter: int
    tol: float | None
    n_iter_no_change: int
    shuffle: bool
    seed: int
    verbose: int = 0


@dataclass
class SolverResult:
    """What a fit produced besides the final state."""

    n_iter: int
    n_steps: int
    n_outer: int
    loss_curve: list[float]
    converged: bool
    train_seconds: float
    epoch_seconds: list[float]  # training time at the end of each epoch


def draw_epoch_order(n_samples: int, shuffle: bool, generator: torch.Generator) -> torch.Tensor:
    """Row order of one epoch; drawn on the CPU so every device sees the same batches.

    int32 indices where they fit: half the memory, and the same permutation.
    """
    dtype = torch.int32 if n_samples <= torch.iinfo(torch.int32).max else torch.int64
    if shuffle:
        return torch.randperm(n_samples, generator=generator, dtype=dtype)
    return torch.arange(n_samples, dtype=dtype)


def outer_iterations(n_samples: int, batch_size: int, s: int) -> list[tuple[int, list[int]]]:
    """``(start row, batch sizes)`` of each outer iteration of an epoch, tail included."""
    sizes = [min(batch_size, n_samples - lo) for lo in range(0, n_samples, batch_size)]
    plan = []
    start = 0
    for i in range(0, len(sizes), s):
        group = sizes[i : i + s]
        plan.append((start, group))
        start += sum(group)
    return plan


def run_epochs(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    config: SolverConfig,
    schedule: StepSchedule,
    loss_offset: float,
) -> SolverResult:
    """Run SGD epochs on ``state`` in place until stopping or ``max_iter``.

    ``loss_offset`` is the weighted sum of the family's per-sample loss
    constants; the loss curve is ``(sum of weighted losses + offset) / n +
    alpha/2 ||w||^2``, measured along the epoch at the iterates the inner
    steps see anyway.
    """
    n_samples = data.X.shape[0]
    generator = torch.Generator().manual_seed(config.seed)
    plan = outer_iterations(n_samples, config.batch_size, config.s)
    n_batches = sum(len(sizes) for _, sizes in plan)
    device = data.X.device
    loss_curve: list[float] = []
    epoch_seconds: list[float] = []
    best_loss = math.inf
    no_improvement = 0
    converged = False
    n_steps = 0
    n_outer = 0

    progress = EpochProgress(config.max_iter, config.verbose)
    ctx.comm.barrier()  # start-up of the ranks is not training time
    start = time.perf_counter()
    try:
        for epoch in range(config.max_iter):
            order = draw_epoch_order(n_samples, config.shuffle, generator).to(device)
            groups = [(order[lo : lo + sum(sizes)], sizes) for lo, sizes in plan]
            epoch_loss = _one_epoch(ctx, data, state, groups, schedule, n_steps, config.s)
            n_steps += n_batches
            n_outer += len(groups)
            loss = _epoch_objective(ctx, state, epoch_loss, loss_offset, n_samples)
            if not math.isfinite(loss):
                raise ValueError(
                    f"SGD diverged in epoch {epoch + 1} (training loss {loss}): the learning "
                    f"rate eta0={schedule.eta0:.4g} is too large for this data. Use a smaller "
                    "eta0, eta0='auto', or standardize X."
                )
            loss_curve.append(loss)
            epoch_seconds.append(time.perf_counter() - start)
            progress.update(epoch, loss, schedule.current)
            if config.tol is None:
                continue
            no_improvement = no_improvement + 1 if loss > best_loss - config.tol else 0
            best_loss = min(best_loss, loss)
            if no_improvement >= config.n_iter_no_change:
                no_improvement = 0
                if schedule.on_plateau():
                    converged = True
                    break
    finally:
        progress.close()
    ctx.comm.barrier()
    return SolverResult(
        n_iter=len(loss_curve),
        n_steps=n_steps,
        n_outer=n_outer,
        loss_curve=loss_curve,
        converged=converged,
        train_seconds=time.perf_counter() - start,
        epoch_seconds=epoch_seconds,
    )


def _one_epoch(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    groups: list[tuple[torch.Tensor, list[int]]],
    schedule: StepSchedule,
    first_step: int,
    s: int,
) -> torch.Tensor:
    """Run the outer iterations ``(rows, batch sizes)`` of one epoch; the weighted loss sum."""
    epoch_loss = torch.zeros((), dtype=ctx.policy.recurrence, device=data.X.device)
    step = first_step
    if s == 1:
        for rows, _ in groups:
            epoch_loss += sgd_step(ctx, data, state, rows, schedule.step_sizes(step, 1)[0])
            step += 1
        return epoch_loss
    batch = gather_outer_batch(ctx, data, *groups[0])
    for i, (_, sizes) in enumerate(groups):
        upcoming = groups[i + 1] if i + 1 < len(groups) else None
        etas = schedule.step_sizes(step, len(sizes))
        loss_sum, batch = ca_outer_iteration(ctx, data, state, batch, etas, upcoming)
        epoch_loss += loss_sum
        step += len(sizes)
    return epoch_loss


def _epoch_objective(
    ctx: StepContext,
    state: ModelState,
    epoch_loss: torch.Tensor,
    loss_offset: float,
    n_samples: int,
) -> float:
    """Mean training loss of the epoch plus the L2 penalty at its end."""
    stats = torch.stack([epoch_loss.to(torch.float64), state.coef.to(torch.float64).square().sum()])
    # Only the penalty differs between ranks; the loss is replicated.
    stats[0] /= ctx.comm.world_size
    ctx.comm.all_reduce(stats)
    mean_loss, squared_norm = np.asarray(stats.cpu())
    return float((mean_loss + loss_offset) / n_samples + 0.5 * ctx.alpha * squared_norm)
