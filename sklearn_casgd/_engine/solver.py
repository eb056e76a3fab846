"""Epochs, step-size schedules, stopping and history.

The solver is a fixed sequence: draw one permutation per epoch from a
seeded generator, cut it into batches of ``batch_size`` (the last one
ragged), group ``s`` consecutive batches into an outer iteration, run the
kernel on it, and decide after the epoch whether to go on. ``s`` never
changes which batches are drawn, so every ``s`` walks the same path.

Two solvers share that sequence:

* ``"svrg"`` takes a snapshot before every epoch (:func:`.snapshot.full_pass`:
  the exact objective, the full gradient and the control variate). An epoch
  whose end point does not lower the exact objective is undone and the
  step halved, so the iterate never gets worse; the fit has converged when
  the largest entry of the full gradient is at most ``tol``.
* ``"sgd"`` is plain minibatch SGD (what the paper benchmarks): the
  ``"adaptive"`` schedule divides the step on plateaus of the training loss
  measured along the epoch; at the end one full pass measures the gradient,
  and the fit has converged only when it is at most ``tol``.

Where the loop stands between epochs (steps taken, the step size, the
generator, the plateau and no-progress counts) is a :class:`SolverState`:
a fit that starts from the state another one ended in continues it
exactly, which is what ``partial_fit`` and resuming a checkpoint do.
With a held-out set (``early_stopping``), both solvers also stop once its
score has not improved by ``tol`` for ``n_iter_no_change`` epochs (plain
SGD first divides an ``"adaptive"`` step, as scikit-learn's SGD does).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from .._glm.families import Family
from . import epoch_kernel
from .batch import OuterBatch, gather_outer_batch
from .comm import PendingReduce
from .curvature import (
    NewtonSystem,
    form_newton_system,
    full_gradient,
    newton_penalty,
    newton_step,
    sampled_rows,
)
from .exchange import outer_per_exchange, replicate_weights, start_row_exchange
from .graphs import OuterGraphs
from .permutation import draw_keys, feistel_order
from .progress import EpochProgress
from .recurrence import ca_outer_iteration, sgd_step, warm_up
from .snapshot import HeldOut, Measurement, full_pass, held_out_score
from .state import LocalData, ModelState, Snapshot, StepContext

SOLVERS = ("svrg", "sgd")
LEARNING_RATES = ("adaptive", "constant", "invscaling")
# "adaptive" divides the step by this factor on every plateau ...
_ADAPTIVE_FACTOR = 5.0
# ... and stops once it has fallen below this fraction of eta0.
_ADAPTIVE_MIN_RATIO = 1e-4
# SVRG undoes an epoch that raises the objective and halves the step; this
# many epochs in a row that were undone, or kept (within rounding) without
# lowering the objective, end the fit (an error if no epoch was ever kept).
MAX_NO_PROGRESS = 10
# ... and lengthens it by this factor after an epoch that lowered the objective
# beyond rounding and shrank the gradient: the curvature bound behind eta0 is
# loose once the fit nears the optimum (on scikit-learn's real datasets 1.5
# reached the optimum in 5-10x fewer epochs than a fixed step).
SVRG_GROWTH = 1.5
# Newton epochs keep the curvature of an earlier snapshot while it works: an
# epoch kept at full length that shrank the gradient this many times over is
# in Newton's quadratic phase, where the next step from the same factor still
# shrinks it superlinearly (Shamanskii); slower progress forms it anew.
NEWTON_REUSE_FACTOR = 100.0
# A Newton step kept at full length after which the objective still falls
# along its line is lengthened, the next epoch, to where the secant of the
# line's slope at both ends reaches zero, by at most this factor: far from
# a labels' optimum (nearly separable classes) each step only halves the
# loss, and a longer one gets further (undone, it is retried at full length).
# Lengthening by less than NEWTON_EXTRAPOLATION_MIN is not worth leaving
# Newton's own step: near the optimum it converges quadratically, and its
# curvature is reused (NEWTON_REUSE_FACTOR).
NEWTON_EXTRAPOLATION = 4.0
NEWTON_EXTRAPOLATION_MIN = 1.1
_CPU = torch.device("cpu")
# Plain SGD has diverged when an epoch's loss exceeds this many times the
# starting objective (plus one, for a start at a perfect fit).
_DIVERGENCE_FACTOR = 100.0


@dataclass
class StepSchedule:
    """Step size of global step ``t`` (counted from 0 over the whole fit).

    ``constant``: ``eta``. ``invscaling``: ``eta / (t + 1) ** power_t``.
    ``adaptive``: ``eta``, divided by 5 on each plateau of plain SGD's
    training loss; the fit stops once it falls below ``1e-4 * eta0``.
    ``eta`` starts at ``eta0`` and SVRG halves it on every undone epoch.
    """

    kind: str
    eta0: float
    power_t: float = 0.5
    max_eta: float = math.inf  # growth stops here (keeps the L2 decay factor positive)
    eta: float | None = None  # the step to start from (a resumed fit); None: eta0
    _eta: float = field(init=False)

    def __post_init__(self) -> None:
        if self.kind not in LEARNING_RATES:
            raise ValueError(f"learning_rate must be one of {LEARNING_RATES}, got {self.kind!r}.")
        self._eta = self.eta0 if self.eta is None else self.eta

    def step_sizes(self, t_start: int, sizes: list[int], batch_size: int) -> list[float]:
        """Steps of the batches of ``sizes`` rows, from global step ``t_start`` on.

        A ragged batch of r < ``batch_size`` rows takes ``r / batch_size`` of
        the step: every row then moves the weights by the same amount per
        epoch, and a tail of one row cannot take a full step on its own
        curvature (with chunks of ``partial_fit`` that are not a multiple of
        ``batch_size`` the tails recur, and full steps on them diverged on
        diabetes).
        """
        if self.kind == "invscaling":
            etas = [
                self._eta / (t + 1) ** self.power_t for t in range(t_start, t_start + len(sizes))
            ]
        else:
            etas = [self._eta] * len(sizes)
        return [eta * min(1.0, size / batch_size) for eta, size in zip(etas, sizes, strict=True)]

    def on_plateau(self) -> bool:
        """React to a plateau of the training loss; return True to stop."""
        if self.kind != "adaptive":
            return True
        self._eta /= _ADAPTIVE_FACTOR
        return self._eta < _ADAPTIVE_MIN_RATIO * self.eta0

    def halve(self) -> None:
        """Halve every step from now on (an SVRG epoch raised the objective)."""
        self._eta /= 2.0

    def grow(self) -> None:
        """Lengthen every step from now on, up to ``max_eta`` (SVRG made clear progress)."""
        self._eta = min(self._eta * SVRG_GROWTH, max(self.max_eta, self._eta))

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
    solver: str = "svrg"
    # SVRG lengthens its step after clear progress; not on a stream of chunks
    # (partial_fit), where each epoch's progress is on its own chunk's objective.
    grow_step: bool = True
    # A fit that starts elsewhere (warm_start): the intercept of the cold start
    # (coefficients 0), where the stopping test's scale is measured. None: the
    # fit starts there.
    cold_intercept: tuple[float, ...] | None = None


@dataclass
class SolverState:
    """Where the epoch loop stands after an epoch: enough to continue it exactly.

    A fit started from the state another ended in takes the same steps as
    one fit running all the epochs (``partial_fit`` on the same rows, a
    checkpoint resumed). ``state_dict()`` holds only Python scalars and
    bytes, so it pickles and compares as plain data.
    """

    steps: int = 0  # SGD steps taken (the step count of "invscaling")
    epochs: int = 0
    eta: float | None = None  # the step size; None: the schedule's eta0
    generator: bytes | None = None  # the batch-order generator; None: seeded from the config
    best_loss: float = math.inf  # plain SGD: best training loss, and epochs since
    no_improvement: int = 0
    no_progress: int = 0  # SVRG: epochs in a row that did not lower the objective
    any_kept: bool = False  # SVRG: some epoch was kept
    best_score: float = -math.inf  # early stopping: best held-out score, and epochs since
    no_score_improvement: int = 0

    def state_dict(self) -> dict:
        """The state as a dict of plain values (``SolverState(**state_dict())`` restores it).

        Its fields are scalars and bytes: a shallow dict (``asdict`` copies deeply, slowly).
        """
        return {field.name: getattr(self, field.name) for field in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict) -> SolverState:
        """The state ``state_dict()`` returned, validated; anything else is a ``ValueError``.

        A state comes back from a pickle or a user's hands: counts must be
        non-negative ints (a float count would make ``t_`` a float), the
        step a positive finite float or None, the generator bytes or None.
        """
        if not isinstance(state, dict):
            raise ValueError(f"Not a solver state: expected a dict, got {type(state).__name__}.")
        names = {name for name in cls.__dataclass_fields__}
        if set(state) != names:
            raise ValueError(
                f"Not a solver state: expected the keys {sorted(names)}, got {sorted(state)}."
            )
        problems = [
            f"{name}={state[name]!r} (expected an int in [0, 2**62])"
            for name in _STATE_COUNTS
            if not _is_count(state[name])
        ]
        eta = state["eta"]
        if eta is not None and not (_is_real(eta) and math.isfinite(eta) and eta > 0):
            problems.append(f"eta={eta!r} (expected a positive finite float or None)")
        if state["generator"] is not None and not isinstance(state["generator"], bytes):
            problems.append(f"generator of type {type(state['generator']).__name__} (bytes)")
        for name in ("best_loss", "best_score"):
            if not (_is_real(state[name]) and not math.isnan(state[name])):
                problems.append(f"{name}={state[name]!r} (expected a float, not NaN)")
        if not isinstance(state["any_kept"], bool):
            problems.append(f"any_kept={state['any_kept']!r} (expected a bool)")
        if problems:
            raise ValueError("Not a valid solver state: " + "; ".join(problems) + ".")
        return cls(**state)


# The counts of a SolverState; 2**62 keeps a step count inside torch's int64.
_STATE_COUNTS = ("steps", "epochs", "no_improvement", "no_progress", "no_score_improvement")
_MAX_COUNT = 2**62


def _is_count(value: object) -> bool:
    return (
        isinstance(value, (int, np.integer))
        and not isinstance(value, bool)
        and 0 <= value <= _MAX_COUNT
    )


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass
class SolverResult:
    """What a fit produced besides the final state.

    ``failure`` names why the fit could not go on (a step that diverges,
    values that overflow); the estimator raises it as a ``ValueError``, so
    every ``n_devices`` reports it the same way.
    """

    n_iter: int
    n_steps: int
    n_outer: int
    loss_curve: list[float]
    converged: bool
    train_seconds: float
    epoch_seconds: list[float]  # training time at the end of each epoch
    gradient_max: float | None = None  # the full gradient's largest entry at the end
    gradient_bound: float | None = None  # converged is gradient_max <= this (scaled tol)
    final_eta: float | None = None
    failure: str | None = None
    stalled: bool = False  # SVRG stopped: no step lowered the objective beyond rounding
    state: SolverState = field(default_factory=SolverState)  # where the loop ended
    validation_scores: list[float] | None = None  # the held-out score after each epoch
    stopped_early: bool = False  # the held-out score stopped improving


def order_dtype(n_samples: int) -> torch.dtype:
    """The dtype of an epoch's row indices: int32 where they fit."""
    return torch.int32 if n_samples <= torch.iinfo(torch.int32).max else torch.int64


def draw_epoch_order(
    n_samples: int,
    shuffle: bool,
    generator: torch.Generator,
    device: torch.device = _CPU,
    on_device: bool = False,
) -> torch.Tensor:
    """Row order of one epoch, on ``device``, from the fit's (CPU) ``generator``.

    int32 indices where they fit: half the memory, and the same permutation.
    ``on_device`` (``StepContext.device_order``): a Feistel permutation
    computed there (:mod:`.permutation`); else ``torch.randperm`` draws it
    on the CPU (copied from pinned memory to a CUDA device, so that the copy
    does not stop the host).
    """
    dtype = order_dtype(n_samples)
    if not shuffle:
        return torch.arange(n_samples, dtype=dtype, device=device)
    if on_device:
        return feistel_order(n_samples, draw_keys(generator), device, dtype)
    order = torch.randperm(n_samples, generator=generator, dtype=dtype)
    if device.type == "cuda":
        return order.pin_memory().to(device, non_blocking=True)
    return order.to(device)


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


def with_zero_snapshot(data: LocalData, state: ModelState, config: SolverConfig) -> LocalData:
    """``data`` with a snapshot of zeros under SVRG: a warm-up launch's control variate."""
    if config.solver != "svrg":
        return data
    zeros = Snapshot(
        torch.zeros_like(data.target),
        torch.zeros_like(state.coef),
        torch.zeros_like(state.intercept),
    )
    return replace(data, snapshot=zeros)


def compile_kernels(
    ctx: StepContext, data: LocalData, state: ModelState, config: SolverConfig
) -> StepContext:
    """Compile the kernels of the fit's outer-iteration shape; ``ctx`` back.

    The torch steps with ``ctx.compiled``; the fused kernel (``ctx.fused``),
    which Triton compiles at its first launch, otherwise.

    Runs the shape once on index zero (nothing changes), with a snapshot of
    zeros for SVRG: compiling is start-up, like starting the ranks, so it
    happens before the epochs' clock starts. An epoch whose rows do not
    fill its last s batches ends with an outer iteration of its own shape:
    that one runs once per epoch, so it stays eager (the returned context's
    ``eager_sizes``) instead of costing seconds of compiling, and the folds
    of a cross-validation, whose tails differ, compile nothing new.
    """
    n_samples = data.X.shape[0]
    data = with_zero_snapshot(data, state, config)
    plan = outer_iterations(n_samples, config.batch_size, config.s)
    first, tail = tuple(plan[0][1]), tuple(plan[-1][1])
    ctx = replace(ctx, eager_sizes=frozenset({tail} if tail != first else ()))
    rows = torch.zeros(sum(first), dtype=order_dtype(n_samples), device=data.X.device)
    warm_up(ctx, data, state, rows, list(first))
    return ctx


def run_epochs(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    config: SolverConfig,
    schedule: StepSchedule,
    loss_offset: float,
    resume: SolverState | None = None,
    held_out: HeldOut | None = None,
    graphs: bool = False,
) -> SolverResult:
    """Run epochs of ``config.solver`` on ``state`` in place until stopping or ``max_iter``.

    ``loss_offset`` is the weighted sum of the family's per-sample loss
    constants, so that measured objectives are the true ones. The loss
    curve holds, per epoch, the exact objective at the epoch's end point
    (SVRG; the point kept) or the training loss measured along the epoch
    plus the penalty at its end (SGD). ``resume`` is the state an earlier
    run ended in (``schedule`` then starts from its step size); ``held_out``
    the rows whose score ends the fit early. With ``graphs`` (one device) the
    outer iterations replay from CUDA graphs (:mod:`.graphs`).
    """
    if config.solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {config.solver!r}.")
    if ctx.newton and config.solver != "svrg":
        raise ValueError("Newton epochs are SVRG's full-batch epochs: solver='svrg'.")
    loop = _svrg_epochs if config.solver == "svrg" else _sgd_epochs
    run = _Run(
        ctx, data, state, config, schedule, loss_offset, resume or SolverState(), held_out, graphs
    )
    # Start-up of the ranks (and waiting for the slowest) is neither
    # training time nor time in collectives.
    ctx.comm.barrier()
    ctx.comm.reset_time()
    run.start = time.perf_counter()
    try:
        loop(run)
    finally:
        run.progress.close()
    ctx.comm.barrier()
    return SolverResult(
        n_iter=len(run.loss_curve),
        n_steps=run.solver_state.steps,
        n_outer=run.n_outer,
        loss_curve=run.loss_curve,
        converged=run.converged,
        train_seconds=time.perf_counter() - run.start,
        epoch_seconds=run.epoch_seconds,
        gradient_max=run.gradient_max,
        gradient_bound=run.gradient_bound,
        final_eta=schedule.current,
        failure=run.failure,
        stalled=run.stalled,
        state=run.end_state(),
        validation_scores=None if held_out is None else run.validation_scores,
        stopped_early=run.stopped_early,
    )


@dataclass
class _Run:
    """The state of the epoch loop that both solvers share."""

    ctx: StepContext
    data: LocalData
    state: ModelState
    config: SolverConfig
    schedule: StepSchedule
    loss_offset: float
    solver_state: SolverState
    held_out: HeldOut | None = None
    use_graphs: bool = False
    loss_curve: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    validation_scores: list[float] = field(default_factory=list)
    n_outer: int = 0
    converged: bool = False
    gradient_max: float | None = None
    gradient_bound: float | None = None
    failure: str | None = None
    stalled: bool = False
    stopped_early: bool = False
    start: float = 0.0
    graphs: OuterGraphs | None = None  # made at the first epoch (it needs SVRG's snapshot)
    # Newton epochs: the curvature formed at a snapshot, which the epochs
    # undone from that snapshot reuse (and every epoch, for a constant Hessian).
    newton_system: NewtonSystem | None = None
    newton_snapshot: Snapshot | None = None
    newton_reuse: bool = False  # the last epoch kept says the factor still works
    newton_formations: int = 0
    newton_penalty: torch.Tensor | None = None  # constant over the fit (_curvature)
    # The last Newton step: its snapshot, the full gradient there and the
    # step taken ((d+1, k) float64, every rank's columns), and its length
    # over the schedule's (more than 1: lengthened along the last line).
    newton_last: tuple[Snapshot, torch.Tensor, torch.Tensor] | None = None
    newton_lengthened: float = 1.0
    # The stopping test's bound at tol = 1 (stopping_tolerance): Newton's
    # inexact solves measure the gradient in it.
    gradient_unit: float = 1.0

    def __post_init__(self) -> None:
        n_samples = self.data.X.shape[0]
        self.solver_state = replace(self.solver_state)  # the caller's state stays as it was
        self.generator = torch.Generator().manual_seed(self.config.seed)
        if self.solver_state.generator is not None:
            saved = np.frombuffer(self.solver_state.generator, dtype=np.uint8)
            self.generator.set_state(torch.from_numpy(saved.copy()))
        self.plan = outer_iterations(n_samples, self.config.batch_size, self.config.s)
        self.progress = EpochProgress(self.config.max_iter, self.config.verbose)

    def end_state(self) -> SolverState:
        """The solver state after the last epoch (the generator included)."""
        generator = self.generator.get_state().numpy().tobytes()
        return replace(self.solver_state, eta=self.schedule.current, generator=generator)

    def epoch(self, data: LocalData) -> float:
        """One epoch over ``data`` (which may carry a snapshot); the weighted loss sum."""
        if self.ctx.newton:  # one full-batch step: no rows to order or gather
            formed = self.newton_system is not None
            if not formed or (
                data.snapshot is not self.newton_snapshot
                and not self.ctx.family.constant_hessian
                and not self.newton_reuse
            ):
                sample = sampled_rows(
                    data.X.shape[0],
                    self.ctx.curvature_rows,
                    self.newton_formations,
                    data.X.device,
                    data.snapshot.row_curvature,
                )
                if self.newton_penalty is None:
                    self.newton_penalty = newton_penalty(self.ctx, data.X.shape[1], data.X.device)
                self.newton_system = form_newton_system(
                    self.ctx, data, self.state, sample, self.newton_penalty
                )
                self.newton_snapshot = data.snapshot
                self.newton_formations += 1
            gradient = full_gradient(self.ctx, data.snapshot)
            self.newton_lengthened = self.newton_extrapolation(data.snapshot, gradient)
            step = newton_step(
                self.ctx,
                self.state,
                gradient,
                self.schedule.current * self.newton_lengthened,
                self.newton_system,
                self.gradient_unit,
            )
            self.newton_last = (data.snapshot, gradient, step)
            self.solver_state.steps += 1
            self.solver_state.epochs += 1
            self.n_outer += 1
            return torch.zeros((), dtype=self.ctx.policy.recurrence)
        n_samples = data.X.shape[0]
        order = draw_epoch_order(
            n_samples, self.config.shuffle, self.generator, data.X.device, self.ctx.device_order
        )
        groups = [(order[lo : lo + sum(sizes)], sizes) for lo, sizes in self.plan]
        first_step = self.solver_state.steps
        if self.use_graphs and self.graphs is None and not self.ctx.epoch_kernel:
            self.graphs = OuterGraphs(self.ctx, data, self.state)
        loss_sum = _one_epoch(
            self.ctx, data, self.state, groups, self.schedule, first_step, self.config, self.graphs
        )
        self.solver_state.steps += sum(len(sizes) for _, sizes in self.plan)
        self.solver_state.epochs += 1
        self.n_outer += len(groups)
        return loss_sum

    def newton_extrapolation(self, snapshot: Snapshot, gradient: torch.Tensor) -> float:
        """The next Newton step's length over Newton's own (NEWTON_EXTRAPOLATION).

        After a step kept at full length, the slope of the objective along
        it was ``-g0 . step`` at its start and is ``-g1 . step`` at
        ``snapshot``, its end: where both are negative the line's minimum
        lies beyond, and the secant places it at ``1 / (1 - r)`` steps, ``r``
        their ratio. 1 otherwise (a step undone, shortened, the minimum
        passed or nearly reached).
        """
        last = self.newton_last
        if last is None or last[0] is snapshot or self.schedule.current != 1.0:
            return 1.0
        _, start_gradient, step = last
        before = float((start_gradient * step).sum())
        after = float((gradient * step).sum())
        if not (before > 0.0 and 0.0 < after < before):
            return 1.0
        length = before / (before - after)
        return min(NEWTON_EXTRAPOLATION, length) if length >= NEWTON_EXTRAPOLATION_MIN else 1.0

    def measure(self) -> tuple[Snapshot, Measurement]:
        return full_pass(self.ctx, self.data, self.state, self.loss_offset)

    def tolerance(self, start: Measurement) -> float | None:
        """The stopping test's gradient bound, scaled at the cold start (stopping_tolerance).

        ``start`` is the measurement where the fit starts. A warm start far
        from the data's optimum (y moved) has a large gradient and made the
        test loose (converged=True at a gradient of 7 on y ~ 1e6); one near
        it a small gradient, which made the test stricter than the same
        fit's cold start. A warm start measures the cold start for it. Sets
        :attr:`gradient_unit` (the bound at tol = 1) on the way, which
        Newton epochs need whatever ``tol``.
        """
        if self.config.tol is None and not self.ctx.newton:
            return None
        if self.config.cold_intercept is not None:
            kept = (self.state.coef.clone(), self.state.intercept.clone())
            self.state.coef.zero_()
            self.state.intercept.copy_(torch.tensor(self.config.cold_intercept))
            _, start = self.measure()
            self.state.coef.copy_(kept[0])
            self.state.intercept.copy_(kept[1])
        # In the weights' dtype: a float64 mean casts all n of them first.
        mean_weight = float(self.data.sample_weight.mean())
        self.gradient_unit = stopping_tolerance(1.0, start, self.ctx.family, mean_weight)
        return None if self.config.tol is None else self.config.tol * self.gradient_unit

    def record(self, epoch: int, objective: float) -> None:
        self.loss_curve.append(objective)
        self.epoch_seconds.append(time.perf_counter() - self.start)
        self.progress.update(epoch, objective, self.schedule.current)

    def held_out_plateau(self) -> bool:
        """Score the held-out rows; True once they went ``n_iter_no_change`` epochs unimproved.

        As scikit-learn's SGD: an epoch improves when its score exceeds the
        best so far by ``tol``; ``tol=None`` never reaches a plateau.
        """
        if self.held_out is None:
            return False
        score = held_out_score(self.ctx, self.held_out, self.state)
        self.validation_scores.append(score)
        progress = self.solver_state
        if self.config.tol is not None and score < progress.best_score + self.config.tol:
            progress.no_score_improvement += 1
        else:
            progress.no_score_improvement = 0
        progress.best_score = max(progress.best_score, score)
        return progress.no_score_improvement >= self.config.n_iter_no_change


def _svrg_epochs(run: _Run) -> None:
    """SVRG epochs from snapshots; an epoch that raises the objective is undone."""
    state, progress = run.state, run.solver_state
    snapshot, measured = run.measure()
    if not measured.finite:
        run.failure = _overflow_message(run, measured, "at the starting point")
        return
    tol = run.gradient_bound = run.tolerance(measured)
    kept = (state.coef.clone(), state.intercept.clone())
    lowest = measured.objective
    lowest_gradient = measured.gradient_max
    for epoch in range(run.config.max_iter):
        if tol is not None and measured.gradient_max <= tol:
            break
        full_step = run.schedule.current == 1.0  # a Newton epoch at Newton's own length
        run.epoch(replace(run.data, snapshot=snapshot))
        new_snapshot, new = run.measure()
        slack = _slack(measured, new)
        # NaN compares False: a non-finite end point is undone too. Against
        # the lowest objective kept, not the last: rises within the slack
        # must not add up. An end point that meets the stopping test is kept
        # whatever its objective reads: near the optimum the objective moves
        # with the gradient squared, within its rounding, and for a convex
        # objective a point with gradient g is at most |g| |dw| above any
        # other (wine at 1/n in float32 undid a gradient of half the bound).
        met = tol is not None and new.gradient_max <= tol
        if new.finite and (new.objective <= lowest + slack or met):
            # Progress is a new lowest objective or gradient. Where both only
            # scatter, the steps' rounding noise (which scales with the step)
            # or the measurement's own rounding is the floor: halfway to the
            # stall a shorter step lowers the first; against the second, new
            # lows of a scatter grow rare and the fit stops.
            lowered = new.objective < lowest or new.gradient_max < lowest_gradient
            lowest = min(lowest, new.objective)
            lowest_gradient = min(lowest_gradient, new.gradient_max)
            # Lengthen the step only on progress beyond rounding noise.
            if (
                run.config.grow_step
                and new.objective < measured.objective - slack
                and new.gradient_max < measured.gradient_max
            ):
                run.schedule.grow()
            progress.no_progress = 0 if lowered else progress.no_progress + 1
            if progress.no_progress == MAX_NO_PROGRESS // 2:
                run.schedule.halve()
            run.newton_reuse = (
                full_step and new.gradient_max * NEWTON_REUSE_FACTOR <= measured.gradient_max
            )
            snapshot, measured, progress.any_kept = new_snapshot, new, True
            kept[0].copy_(state.coef)
            kept[1].copy_(state.intercept)
        else:
            state.coef.copy_(kept[0])
            state.intercept.copy_(kept[1])
            progress.no_progress += 1
            if run.newton_lengthened == 1.0:  # a lengthened step is retried at full length
                run.schedule.halve()
        run.record(epoch, measured.objective)
        if progress.no_progress >= MAX_NO_PROGRESS:
            # The steps are down to rounding noise: stop here. Newton's step is
            # a descent direction of the engine's own length: where 2^-10 of
            # it lowers nothing, the start's gradient is at the rounding floor.
            if progress.any_kept or run.ctx.newton:
                run.stalled = True
            else:
                run.failure = _svrg_failure(run, measured, new)
            break
        if run.held_out_plateau():
            run.stopped_early = True
            break
    run.gradient_max = measured.gradient_max
    run.converged = tol is not None and measured.gradient_max <= tol


def stopping_tolerance(
    tol: float | None, start: Measurement, family: Family, mean_weight: float
) -> float | None:
    """The stopping test's gradient bound: ``tol`` relative to a cold start's gradient.

    Where the loss carries y's units (``Family.target_has_units``) the bound
    follows the cold start's gradient at any size: y * c scales every
    gradient by a power of c, and a bound absolute below 1 stopped y in
    units 1e4 smaller after 33 epochs, 5e-4 above the optimum (1e6: after 1
    epoch, 3.7 % above), both "converged". Labels and the gamma deviance have no
    units; with unit weights their bound is ``tol`` itself below a
    cold-start gradient of 1, as lbfgs's test. Their gradients scale with
    the weights, so weights below 1 lower that floor with their mean: with
    weights summing to 1 digits stopped after 4 epochs 223 % above the
    optimum's objective. Larger weights keep the floor at 1: class weights
    of 50 on a class already fitted do not make the rare one's gradient 50
    times larger, and a floor of 50 stopped such a fit 5 % above.
    """
    if tol is None:
        return None
    scale = start.gradient_max
    if family.target_has_units:
        return tol * scale
    return tol * max(min(1.0, mean_weight), scale)


def _slack(kept: Measurement, new: Measurement) -> float:
    """How far above the kept objective an end point may measure and still count.

    Both objectives are summed from per-row losses rounded in the recurrence
    dtype: an end point within their rounding is no evidence of a rise.
    """
    return 4.0 * (kept.resolution + new.resolution)


def _sgd_epochs(run: _Run) -> None:
    """Plain SGD epochs; the schedule reacts to plateaus of the training loss.

    With a held-out set, to plateaus of its score instead (as scikit-learn's SGD).
    """
    config, ctx, progress = run.config, run.ctx, run.solver_state
    n_samples = run.data.X.shape[0]
    # The start's objective and gradient scale the divergence test and tol;
    # measuring them is bookkeeping, not SGD's work, so the clock restarts.
    _, start = run.measure()
    run.start = time.perf_counter()
    limit = _DIVERGENCE_FACTOR * start.objective + 1.0
    for epoch in range(config.max_iter):
        loss_sum = run.epoch(run.data)
        loss = _epoch_objective(ctx, run.state, loss_sum, run.loss_offset, n_samples)
        if not math.isfinite(loss) or loss > limit:
            run.failure = (
                f"SGD diverged in epoch {epoch + 1}: the training loss rose from "
                f"{start.objective:.4g} at the start to {loss:.4g}. The step size "
                f"{run.schedule.current:.4g} is too large for this data (heavy-tailed y or "
                "outlying rows can make even eta0='auto' too large for plain SGD): use "
                "solver='svrg' (which halves a step that raises the objective), a smaller "
                "eta0, or standardize X."
            )
            return
        run.record(epoch, loss)
        if config.tol is None:
            continue
        if run.held_out is not None:
            if not run.held_out_plateau():
                continue
            progress.no_score_improvement = 0
        else:
            improved = loss <= progress.best_loss - config.tol
            progress.no_improvement = 0 if improved else progress.no_improvement + 1
            progress.best_loss = min(progress.best_loss, loss)
            if progress.no_improvement < config.n_iter_no_change:
                continue
            progress.no_improvement = 0
        if run.schedule.on_plateau():
            run.stopped_early = run.held_out is not None
            break
    if config.tol is not None:
        _, end = run.measure()
        run.gradient_max = end.gradient_max
        run.gradient_bound = run.tolerance(start)
        run.converged = end.gradient_max <= run.gradient_bound


def _svrg_failure(run: _Run, kept: Measurement, last: Measurement) -> str:
    """Why SVRG gave up when ``MAX_NO_PROGRESS`` epochs from the start were all undone."""
    if not last.finite:
        return _overflow_message(run, last, f"even with the step halved {MAX_NO_PROGRESS} times")
    return (
        f"SVRG could not lower the objective {kept.objective:.6g} of the starting point "
        f"even with the step halved {MAX_NO_PROGRESS} times (to {run.schedule.current:.3g}, "
        f"from eta0={run.schedule.eta0:.4g}): the step size is far too large for this "
        "data. Use a smaller eta0 or eta0='auto', or standardize X."
    )


def _overflow_message(run: _Run, measured: Measurement, where: str) -> str:
    policy = run.ctx.policy
    return (
        f"The fit overflowed {where}: the objective is {measured.objective} and the linear "
        f"predictor reaches |X @ coef + intercept| = {measured.raw_max:.4g} in "
        f"{policy.recurrence} (precision={policy.name!r}). The step size "
        f"{run.schedule.current:.4g} is too large, or X, y or sample_weight is too large "
        "in scale: standardize X, rescale y or the weights, raise alpha, or use "
        "precision='fp64'."
    )


def _one_epoch(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    groups: list[tuple[torch.Tensor, list[int]]],
    schedule: StepSchedule,
    first_step: int,
    config: SolverConfig,
    graphs: OuterGraphs | None = None,
) -> torch.Tensor:
    """Run the outer iterations ``(rows, batch sizes)`` of one epoch; the weighted loss sum.

    SVRG, which measures its objective in the full pass, does not use the
    sum: its plain steps (s=1) skip the loss and leave it 0. With
    ``ctx.epoch_kernel`` the epoch's steps are one launch
    (:mod:`.epoch_kernel`). With
    ``graphs`` the outer iterations of the captured shape replay from it,
    and the others (a ragged tail) run as without; plain SGD's eager steps
    (s=1, not compiled) do not use them. With a row exchange see
    :func:`_gathered_epoch`.
    """
    epoch_loss = torch.zeros((), dtype=ctx.policy.recurrence, device=data.X.device)
    step = first_step
    if ctx.epoch_kernel:  # every step of the epoch in one launch
        sizes = [size for _, group in groups for size in group]
        order = torch.cat([rows for rows, _ in groups])
        etas = schedule.step_sizes(step, sizes, config.batch_size)
        with_loss = config.solver != "svrg"
        loss = epoch_kernel.run_epoch(ctx, data, state, order, etas, config.batch_size, with_loss)
        return epoch_loss if loss is None else epoch_loss + loss
    if config.s == 1 and not ctx.compiled:
        # SVRG's objective comes from its full pass: its steps skip the loss.
        with_loss = config.solver != "svrg"
        for rows, sizes in groups:
            eta = schedule.step_sizes(step, sizes, config.batch_size)[0]
            loss = sgd_step(ctx, data, state, rows, eta, with_loss)
            if with_loss:
                epoch_loss += loss
            step += 1
        return epoch_loss
    if graphs is not None:
        graphs.begin_epoch(data)
        for rows, sizes in groups:
            etas = schedule.step_sizes(step, sizes, config.batch_size)
            step += len(sizes)
            if not graphs.run(rows, sizes, etas):
                batch = gather_outer_batch(ctx, data, rows, sizes)
                epoch_loss += ca_outer_iteration(ctx, data, state, batch, etas)[0]
        return epoch_loss + graphs.loss
    if ctx.exchange is not None:
        return _gathered_epoch(ctx, data, state, groups, schedule, first_step, config)
    batch = gather_outer_batch(ctx, data, *groups[0])
    for i, (_, sizes) in enumerate(groups):
        upcoming = groups[i + 1] if i + 1 < len(groups) else None
        etas = schedule.step_sizes(step, sizes, config.batch_size)
        loss_sum, batch = ca_outer_iteration(ctx, data, state, batch, etas, upcoming)
        epoch_loss += loss_sum
        step += len(sizes)
    return epoch_loss


def _gathered_epoch(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    groups: list[tuple[torch.Tensor, list[int]]],
    schedule: StepSchedule,
    first_step: int,
    config: SolverConfig,
) -> torch.Tensor:
    """:func:`_one_epoch` with a :class:`.state.RowExchange`: the rows travel ahead.

    The epoch starts from every rank's weights (:func:`replicate_weights`).
    The outer iterations go in runs of :func:`outer_per_exchange`, whose
    rows one all-gather carries; a run's steps run while the next run's
    rows are in flight.
    """
    data = replace(data, snapshot=replicate_weights(ctx, state, data.snapshot))
    per_exchange = outer_per_exchange(ctx.exchange, sum(groups[0][1]), ctx.policy.gram_input)
    runs = [groups[i : i + per_exchange] for i in range(0, len(groups), per_exchange)]

    def start(run: list[tuple[torch.Tensor, list[int]]]) -> tuple[list[OuterBatch], PendingReduce]:
        batches = [gather_outer_batch(ctx, data, rows, sizes) for rows, sizes in run]
        return batches, start_row_exchange(ctx, batches)

    epoch_loss = torch.zeros((), dtype=ctx.policy.recurrence, device=data.X.device)
    step = first_step
    batches, pending = start(runs[0])
    for i in range(len(runs)):
        pending.wait()
        following = start(runs[i + 1]) if i + 1 < len(runs) else None
        for batch in batches:
            etas = schedule.step_sizes(step, batch.sizes, config.batch_size)
            epoch_loss += ca_outer_iteration(ctx, data, state, batch, etas)[0]
            step += len(batch.sizes)
        if following is not None:
            batches, pending = following
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
    mean_loss, squared_norm = stats.tolist()
    return float((mean_loss + loss_offset) / n_samples + 0.5 * ctx.alpha * squared_norm)
