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

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from .._glm.families import Family
from .checkpoint import RankCheckpoints, solver_state_to_json
from .curvature import (
    NewtonSystem,
    form_newton_system,
    full_gradient,
    newton_penalty,
    newton_step,
    sampled_rows,
)
from .epochs import (
    OuterGroups,
    batch_sizes,
    draw_epoch_order,
    epoch_objective,
    kernel_epoch,
    one_epoch,
    outer_iterations,
)
from .graphs import OuterGraphs
from .progress import EpochProgress
from .snapshot import HeldOut, Measurement, full_pass, held_out_score
from .solver_state import (
    SOLVERS,
    SolverConfig,
    SolverResult,
    SolverState,
    StepSchedule,
)
from .state import LocalData, ModelState, Snapshot, StepContext

# SVRG undoes an epoch that raises the objective and halves the step; this
# many epochs in a row that were undone, or kept (within rounding) without
# lowering the objective, end the fit (an error if no epoch was ever kept).
MAX_NO_PROGRESS = 10

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

# Plain SGD has diverged when an epoch's loss exceeds this many times the
# starting objective (plus one, for a start at a perfect fit).
_DIVERGENCE_FACTOR = 100.0

# A loop that hands its fit over to a float64 polish stops once an epoch
# after its gradient test lowered the gap bound less than this many times.
HAND_OVER_FACTOR = 10.0

# The relative gap to the optimum's objective that ``tol`` names, where the
# certificate bounds it (.certificate): the default tol=1e-5 converges
# within 1e-6 of the optimum.
GAP_PER_TOL = 0.1


@dataclass(frozen=True)
class StoppingTest:
    """When a fit has converged: the gradient test and, where it exists, the gap bound.

    ``gradient_bound`` is the gradient test's bound (:func:`stopping_tolerance`),
    ``gap_target`` the relative gap the certificate must bound
    (``tol * GAP_PER_TOL``); None: ``tol=None`` (no test), or no
    certificate for the objective (no L2 part, a loss not convex in the raw
    prediction), where the gradient test decides alone. The gradient test
    keeps the coefficients as close to the optimum as it always did; the
    bound keeps a fit whose gradient is small along directions of tiny
    curvature (rare columns at a small alpha) from passing for converged.
    Separated classes (no penalty) never converge: no finite optimum exists.
    """

    gradient_bound: float | None
    gap_target: float | None

    def met(self, measured: Measurement) -> bool:
        """Whether the fit has converged at ``measured``."""
        if not self.gradient_met(measured) or measured.separated:
            return False
        return self.gap_target is None or (
            measured.gap_bound is not None and measured.gap_bound <= self.gap_target
        )

    def gradient_met(self, measured: Measurement) -> bool:
        return self.gradient_bound is not None and measured.gradient_max <= self.gradient_bound

    def ends(self, measured: Measurement) -> bool:
        """Whether the fit stops at ``measured``: converged, or separated classes at the test.

        Separated classes (no penalty) have their infimum at infinity: the
        gradient only shrinks as the coefficients grow, and the fit stops
        there unconverged (the estimator says why).
        """
        return self.met(measured) or (measured.separated and self.gradient_met(measured))


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
    checkpoints: RankCheckpoints | None = None,
) -> SolverResult:
    """Run epochs of ``config.solver`` on ``state`` in place until stopping or ``max_iter``.

    ``loss_offset`` is the weighted sum of the family's per-sample loss
    constants, so that measured objectives are the true ones. The loss
    curve holds, per epoch, the exact objective at the epoch's end point
    (SVRG; the point kept) or the training loss measured along the epoch
    plus the penalty at its end (SGD). ``resume`` is the state an earlier
    run ended in (``schedule`` then starts from its step size); ``held_out``
    the rows whose score ends the fit early. With ``graphs`` (one device) the
    outer iterations replay from CUDA graphs (:mod:`.graphs`). With
    ``checkpoints`` the loop writes its state every ``every`` epochs and,
    where their spec names a checkpoint to resume, starts from it (the
    weights in ``state`` and the loop where the interrupted fit left them;
    ``resume`` is then that checkpoint's solver state).
    """
    if config.solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {config.solver!r}.")
    if ctx.newton and config.solver != "svrg":
        raise ValueError("Newton epochs are SVRG's full-batch epochs: solver='svrg'.")
    loop = _svrg_epochs if config.solver == "svrg" else _sgd_epochs
    run = _Run(
        ctx,
        data,
        state,
        config,
        schedule,
        loss_offset,
        resume or SolverState(),
        held_out,
        graphs,
        checkpoints,
    )
    # Start-up of the ranks (and waiting for the slowest) is neither
    # training time nor time in collectives.
    ctx.comm.barrier()
    ctx.comm.reset_time()
    # A resumed fit's epoch times go on from the interrupted fit's.
    run.start = time.perf_counter() - (run.epoch_seconds[-1] if run.epoch_seconds else 0.0)
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
        gap_bound=run.gap_bound,
        gap_target=run.stopping_test().gap_target,
        separated=run.separated,
        gradient_unit=run.gradient_unit,
        resumed_epochs=run.first_epoch,
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
    checkpoints: RankCheckpoints | None = None
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
    # The certificate's bound at the end (relative), and whether the classes separate.
    gap_bound: float | None = None
    separated: bool = False
    # The lowest gap bound since the gradient test was met (hands_over).
    certified_bound: float = math.inf
    # SVRG: the lowest objective and gradient of the points kept so far.
    lowest: float = math.inf
    lowest_gradient: float = math.inf
    # Plain SGD: the measurement at the start (the divergence test's and tol's scale).
    start_measurement: Measurement | None = None
    # The epochs run so far (a resumed fit starts after the checkpoint's), and
    # whether the loop had stopped there.
    first_epoch: int = 0
    finished: bool = False
    # Checkpointing Newton epochs: the weights the curvature was formed at.
    newton_formed_at: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        n_samples = self.data.X.shape[0]
        self.solver_state = replace(self.solver_state)  # the caller's state stays as it was
        self.generator = torch.Generator().manual_seed(self.config.seed)
        if self.solver_state.generator is not None:
            saved = np.frombuffer(self.solver_state.generator, dtype=np.uint8)
            self.generator.set_state(torch.from_numpy(saved.copy()))
        self.batch_sizes = batch_sizes(n_samples, self.config.batch_size)
        # The epoch kernel takes the order whole: no outer iterations to slice it into.
        self.plan = (
            None
            if self.ctx.epoch_kernel
            else outer_iterations(n_samples, self.config.batch_size, self.config.s)
        )
        self.resumed = None if self.checkpoints is None else self.checkpoints.spec.loop
        self.resumed_tensors: dict[str, torch.Tensor] = {}
        if self.resumed is not None:
            self.resume_checkpoint()
        self.progress = EpochProgress(
            self.config.verbose, self.first_epoch + self.config.epochs_before
        )

    def end_state(self) -> SolverState:
        """The solver state after the last epoch (the generator included)."""
        generator = self.generator.get_state().numpy().tobytes()
        state = replace(self.solver_state, eta=self.schedule.current, generator=generator)
        average = self.state.average
        if average is not None:
            state = replace(state, average_count=average.count, average_samples=average.samples)
        return state

    def epoch(self, data: LocalData) -> float:
        """One epoch over ``data`` (which may carry a snapshot); the weighted loss sum."""
        if self.ctx.newton:  # one full-batch step: no rows to order or gather
            formed = self.newton_system is not None
            if not formed or (
                data.snapshot is not self.newton_snapshot
                and not self.ctx.family.constant_hessian
                and not self.newton_reuse
            ):
                self.form_newton_system(data, self.newton_formations)
                self.newton_formations += 1
                if self.checkpoints is not None:
                    self.newton_formed_at = self.weights()
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
        first_step = self.solver_state.steps
        if self.ctx.epoch_kernel:  # one launch over the order: no outer iterations to slice
            loss_sum = kernel_epoch(
                self.ctx,
                data,
                self.state,
                order,
                self.batch_sizes,
                self.schedule,
                first_step,
                self.config,
            )
        else:
            groups = OuterGroups(order, self.plan)
            if self.use_graphs and self.graphs is None:
                self.graphs = OuterGraphs(self.ctx, data, self.state)
            loss_sum = one_epoch(
                self.ctx,
                data,
                self.state,
                groups,
                self.schedule,
                first_step,
                self.config,
                self.graphs,
            )
        self.solver_state.steps += len(self.batch_sizes)
        self.solver_state.epochs += 1
        self.n_outer += len(self.batch_sizes if self.plan is None else self.plan)
        return loss_sum

    def form_newton_system(self, data: LocalData, formation: int) -> None:
        """Form and factor curvature number ``formation`` at ``data.snapshot`` (the weights')."""
        sample = sampled_rows(
            data.X.shape[0],
            self.ctx.curvature_rows,
            formation,
            data.X.device,
            data.snapshot.row_curvature,
        )
        if self.newton_penalty is None:
            self.newton_penalty = newton_penalty(self.ctx, data.X.shape[1], data.X.device)
        self.newton_system = form_newton_system(
            self.ctx, data, self.state, sample, self.newton_penalty
        )
        self.newton_snapshot = data.snapshot

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

    @contextlib.contextmanager
    def averaged_weights(self) -> Iterator[None]:
        """Within: the model state holds the average of the iterates (the fit's result).

        The iterate comes back after; without averaging (or before the first
        counted iterate) the state is left as it is.
        """
        mean = None if self.state.average is None else self.state.average.mean()
        if mean is None:
            yield
            return
        kept = (self.state.coef.clone(), self.state.intercept.clone())
        self.state.coef.copy_(mean[0])
        self.state.intercept.copy_(mean[1])
        try:
            yield
        finally:
            self.state.coef.copy_(kept[0])
            self.state.intercept.copy_(kept[1])

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
        if self.config.gradient_unit is not None:
            self.gradient_unit = self.config.gradient_unit
            return None if self.config.tol is None else self.config.tol * self.gradient_unit
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

    def stopping_test(self) -> StoppingTest:
        """The test at :attr:`gradient_bound` and the gap ``tol`` names."""
        tol = self.config.tol
        gap = None if tol is None or self.ctx.certificate is None else tol * GAP_PER_TOL
        return StoppingTest(self.gradient_bound, gap)

    def hands_over(self, measured: Measurement, test: StoppingTest) -> bool:
        """Whether the loop stops for a float64 polish to certify its gap (:mod:`.polish`).

        Once the gradient test is met, an epoch that lowers the gap bound less
        than :data:`HAND_OVER_FACTOR`-fold ends a loop that hands over
        (``config.hands_over``): Newton's quadratic phase lowers it by far
        more, and at the precision's rounding floor it no longer moves.
        """
        if not self.config.hands_over or not test.gradient_met(measured) or test.met(measured):
            return False
        bound = measured.gap_bound
        if bound is None:
            return False
        previous, self.certified_bound = self.certified_bound, min(self.certified_bound, bound)
        return bound * HAND_OVER_FACTOR > previous

    def finish(self, measured: Measurement, test: StoppingTest) -> None:
        """The loop ended at ``measured``: what the result reports of it."""
        self.gradient_max = measured.gradient_max
        self.gap_bound = measured.gap_bound
        self.separated = measured.separated
        self.converged = test.met(measured)

    # -- checkpoints ----------------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        """Copies of the model state's tensors, by name."""
        weights = {"coef": self.state.coef.clone(), "intercept": self.state.intercept.clone()}
        if self.state.replica is not None:
            weights["replica"] = self.state.replica.clone()
        if self.state.average is not None:
            weights["average_coef_sum"] = self.state.average.coef_sum.clone()
            weights["average_intercept_sum"] = self.state.average.intercept_sum.clone()
        return weights

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy ``weights`` (from :meth:`weights` or a checkpoint) into the model state."""
        targets = {"coef": self.state.coef, "intercept": self.state.intercept}
        if self.state.replica is not None:
            targets["replica"] = self.state.replica
        average = self.state.average
        if average is not None:
            targets["average_coef_sum"] = average.coef_sum
            targets["average_intercept_sum"] = average.intercept_sum
        for name, target in targets.items():
            value = weights.get(name)
            if value is None or value.shape != target.shape or value.dtype != target.dtype:
                found = "nothing" if value is None else f"{tuple(value.shape)} {value.dtype}"
                raise ValueError(
                    f"The checkpoint's {name} is {found} where this fit holds "
                    f"{tuple(target.shape)} {target.dtype}: it was written by another fit."
                )
        # coef is a view of the replica where there is one: the replica last.
        for name in ("coef", "intercept", "replica", "average_coef_sum", "average_intercept_sum"):
            if name in targets:
                targets[name].copy_(weights[name])

    def epoch_done(self, epoch: int, stop: bool, snapshot: Snapshot | None = None) -> None:
        """After epoch ``epoch`` (0-based) and the decisions it led to: checkpoint when due.

        Due every ``every`` epochs and at the loop's last epoch, so that a
        job restarted after the fit ended ends at once with its result.
        ``snapshot`` is SVRG's snapshot of the weights kept.
        """
        if self.checkpoints is None:
            return
        epochs = epoch + 1
        last = stop or epochs == self.config.max_iter
        if epochs % self.checkpoints.spec.every and not last:
            return
        loop, tensors = self.loop_state(epochs, stop, snapshot)
        self.checkpoints.save(epochs, loop, tensors)

    def loop_state(
        self, epochs: int, stop: bool, snapshot: Snapshot | None
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a resumed loop needs, as JSON values and this rank's tensors."""
        solver_state = solver_state_to_json(self.end_state().state_dict())
        tensors = self.weights()
        newton = None
        if self.newton_system is not None:
            formed_here = self.newton_snapshot is snapshot
            if not formed_here:
                tensors.update({f"newton_{k}": v for k, v in self.newton_formed_at.items()})
            newton = {
                "formations": self.newton_formations,
                "formed_here": formed_here,
                "reuse": self.newton_reuse,
                "lengthened": self.newton_lengthened,
                "last_here": None,
            }
            if self.newton_last is not None:
                newton["last_here"] = self.newton_last[0] is snapshot
                tensors["newton_gradient"] = self.newton_last[1]
                tensors["newton_step"] = self.newton_last[2]
        start = self.start_measurement
        loop = {
            "epochs": epochs,
            "finished": stop,
            "s": self.config.s,
            "solver_state": solver_state,
            "loss_curve": self.loss_curve,
            "epoch_seconds": self.epoch_seconds,
            "validation_scores": self.validation_scores,
            "n_outer": self.n_outer,
            "lowest": self.lowest,
            "lowest_gradient": self.lowest_gradient,
            "gradient_bound": self.gradient_bound,
            "gradient_unit": self.gradient_unit,
            "start_measurement": None if start is None else asdict(start),
            "stalled": self.stalled,
            "stopped_early": self.stopped_early,
            "newton": newton,
        }
        return loop, tensors

    def resume_checkpoint(self) -> None:
        """Take the weights and the loop's state from the checkpoint resumed."""
        loop = self.resumed
        tensors = self.checkpoints.load()
        self.set_weights(tensors)
        self.resumed_tensors = tensors
        self.first_epoch = loop["epochs"]
        self.finished = loop["finished"]
        self.loss_curve = list(loop["loss_curve"])
        self.epoch_seconds = list(loop["epoch_seconds"])
        self.validation_scores = list(loop["validation_scores"])
        self.n_outer = loop["n_outer"]
        self.lowest, self.lowest_gradient = loop["lowest"], loop["lowest_gradient"]
        self.gradient_bound, self.gradient_unit = loop["gradient_bound"], loop["gradient_unit"]
        start = loop["start_measurement"]
        self.start_measurement = None if start is None else Measurement(**start)
        self.stalled, self.stopped_early = loop["stalled"], loop["stopped_early"]

    def resume_newton(self, snapshot: Snapshot) -> None:
        """Newton's curvature and last step as the interrupted fit had them at ``snapshot``.

        The curvature is formed again where it was (the same weights, rows
        and formation number give the same factor); at weights other than
        the ones kept, it needs their snapshot, measured here.
        """
        newton = None if self.resumed is None else self.resumed["newton"]
        if newton is None:
            return
        self.newton_formations = newton["formations"]
        self.newton_reuse, self.newton_lengthened = newton["reuse"], newton["lengthened"]
        tensors = self.resumed_tensors
        formation = self.newton_formations - 1
        if newton["formed_here"]:
            self.form_newton_system(replace(self.data, snapshot=snapshot), formation)
            self.newton_formed_at = self.weights()
        else:
            kept = self.weights()
            self.newton_formed_at = {
                name[len("newton_") :]: value
                for name, value in tensors.items()
                if name in ("newton_coef", "newton_intercept", "newton_replica")
            }
            self.set_weights(self.newton_formed_at)
            formed_at, _ = self.measure()
            self.form_newton_system(replace(self.data, snapshot=formed_at), formation)
            self.set_weights(kept)
        if newton["last_here"] is not None:
            # A step taken elsewhere only needs to be told apart from ``snapshot``.
            where = snapshot if newton["last_here"] else None
            self.newton_last = (where, tensors["newton_gradient"], tensors["newton_step"])

    def epochs(self) -> range:
        """The epochs left to run: none where the checkpoint resumed had stopped."""
        last = self.config.max_iter
        return range(last if self.finished else self.first_epoch, last)

    def record(self, epoch: int, objective: float, gradient: float | None = None) -> None:
        """Epoch ``epoch`` ended at ``objective`` (and, SVRG, the kept point's ``gradient``)."""
        self.loss_curve.append(objective)
        self.epoch_seconds.append(time.perf_counter() - self.start)
        bound = self.gradient_bound if self.config.tol is not None else None
        self.progress.update(epoch, objective, self.schedule.current, gradient, bound)

    def held_out_plateau(self) -> bool:
        """Score the held-out rows; True once they went ``n_iter_no_change`` epochs unimproved.

        As scikit-learn's SGD: an epoch improves when its score exceeds the
        best so far by ``tol``; ``tol=None`` never reaches a plateau.
        """
        if self.held_out is None:
            return False
        with self.averaged_weights():  # the model a user would get now
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
    if run.resumed is None:
        if not measured.finite:
            run.failure = _overflow_message(run, measured, "at the starting point")
            return
        run.gradient_bound = run.tolerance(measured)
        run.lowest, run.lowest_gradient = measured.objective, measured.gradient_max
    else:
        run.resume_newton(snapshot)
    test = run.stopping_test()
    kept = (state.coef.clone(), state.intercept.clone())
    for epoch in run.epochs():
        if test.ends(measured):
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
        met = test.met(new)
        if new.finite and (new.objective <= run.lowest + slack or met):
            # Progress is a new lowest objective or gradient. Where both only
            # scatter, the steps' rounding noise (which scales with the step)
            # or the measurement's own rounding is the floor: halfway to the
            # stall a shorter step lowers the first; against the second, new
            # lows of a scatter grow rare and the fit stops.
            lowered = new.objective < run.lowest or new.gradient_max < run.lowest_gradient
            run.lowest = min(run.lowest, new.objective)
            run.lowest_gradient = min(run.lowest_gradient, new.gradient_max)
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
        run.record(epoch, measured.objective, measured.gradient_max)
        stop = False
        if progress.no_progress >= MAX_NO_PROGRESS:
            # The steps are down to rounding noise: stop here. Newton's step is
            # a descent direction of the engine's own length: where 2^-10 of
            # it lowers nothing, the start's gradient is at the rounding floor.
            if not (progress.any_kept or run.ctx.newton):
                run.failure = _svrg_failure(run, measured, new)
                break
            run.stalled = stop = True
        elif run.held_out_plateau():
            run.stopped_early = stop = True
        # Converged: the test at the top of the loop would end it.
        stop = stop or test.ends(measured) or run.hands_over(measured, test)
        run.epoch_done(epoch, stop, snapshot)
        if stop:
            break
    run.finish(measured, test)


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
    config, ctx = run.config, run.ctx
    n_samples = run.data.X.shape[0]
    # The start's objective and gradient scale the divergence test and tol;
    # measuring them is bookkeeping, not SGD's work, so the clock restarts.
    if run.start_measurement is None:
        _, run.start_measurement = run.measure()
        run.start = time.perf_counter()
    start = run.start_measurement
    limit = _DIVERGENCE_FACTOR * start.objective + 1.0
    for epoch in run.epochs():
        loss_sum = run.epoch(run.data)
        loss = epoch_objective(ctx, run.state, loss_sum, run.loss_offset, n_samples)
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
        stop = _sgd_plateau_ends_fit(run, loss)
        run.epoch_done(epoch, stop)
        if stop:
            break
    if config.tol is not None:
        with run.averaged_weights():  # the weights the fit returns
            _, end = run.measure()
        run.gradient_bound = run.tolerance(start)
        run.finish(end, run.stopping_test())


def _sgd_plateau_ends_fit(run: _Run, loss: float) -> bool:
    """After an SGD epoch of training loss ``loss``: react to a plateau; True ends the fit."""
    config, progress = run.config, run.solver_state
    if config.tol is None:
        return False
    if run.held_out is not None:
        if not run.held_out_plateau():
            return False
        progress.no_score_improvement = 0
    else:
        improved = loss <= progress.best_loss - config.tol
        progress.no_improvement = 0 if improved else progress.no_improvement + 1
        progress.best_loss = min(progress.best_loss, loss)
        if progress.no_improvement < config.n_iter_no_change:
            return False
        progress.no_improvement = 0
    if run.schedule.on_plateau():
        run.stopped_early = run.held_out is not None
        return True
    return False


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
