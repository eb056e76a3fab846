"""A fit's plan: from the validated arrays and the estimator's settings to the engine's FitPlan.

Every choice that depends on the whole data is made here, once, before any
rank runs: SVRG's preconditioner, the loss's smoothness and the initial
step (:class:`StepPlan`), how the epochs run (:func:`.planner.plan_execution`:
minibatch or Newton epochs, the batch size, s), the checks that the data
and parameters fit the precision, and where a warm start or
``partial_fit`` continues from. The estimators validate their input and
call :func:`plan_fit`; the engine (:mod:`.fit`, :mod:`.._distributed.backends`)
runs the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.utils import check_random_state

from .._data.storage import largest_abs, stores_preconditioned
from .._glm.families import Family
from .._glm.penalties import Penalty
from .cost import CHOICES
from .execution import sparse_kernel_planned
from .fit import BlockResult, FitPlan
from .planner import ExecutionPlan, plan_execution
from .precision import (
    PrecisionPolicy,
    check_alpha_representable,
    check_representable,
    check_targets_representable,
)
from .reduction import ColumnReduction, WholeX, block_of
from .solver_state import SolverConfig
from .step_plan import StepPlan
from .stepsize import Smoothness, jacobi_preconditioner, loss_smoothness, squared_frobenius


@dataclass(frozen=True)
class FitSettings:
    """The estimator's parameters that planning reads (validated by the estimator)."""

    alpha: float
    l1_ratio: float  # the L1 part's share of alpha (Penalty)
    fit_intercept: bool
    s: int | str
    batch_size: int | str
    solver: str
    learning_rate: str
    eta0: float | str
    power_t: float
    max_iter: int
    tol: float | None
    n_iter_no_change: int
    shuffle: bool
    random_state: Any
    verbose: int
    compile: bool | str
    warm_start: bool
    average: int = 0  # averaged SGD from this many rows stepped on; 0: none

    @property
    def penalty(self) -> Penalty:
        """The penalty these parameters state."""
        return Penalty(self.alpha, self.l1_ratio)


@dataclass(frozen=True)
class PreviousFit:
    """What a warm start or ``partial_fit`` continues from: the last fit's results.

    ``coef`` ``(k, d)`` and ``intercept`` as the user sees them;
    ``step_plan`` and ``solver_state`` (validated) where ``partial_fit``
    continues the last fit's steps (None for a warm start).
    """

    coef: np.ndarray | None
    intercept: np.ndarray | None
    step_plan: StepPlan | None = None
    solver_state: dict | None = None
    # Averaged SGD: the average's coef (k, d) and intercept as the user sees
    # them (coef above is then the last iterate), or None.
    average: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class WorldShape:
    """Of the ranks a fit runs on, what planning needs."""

    world_size: int
    shares_seed: bool  # a job's ranks take rank 0's seed where random_state is None
    one_machine: bool = False  # a worker pool's ranks: collectives priced, not timed


# Whether SVRG preconditions a sparse X as it does a dense one (Jacobi:
# state.Preconditioner): None decides by the columns' density
# (RARE_COLUMN_DENSITY); True or False (tests, benchmarks) forces it.
PRECONDITION_SPARSE: bool | None = None
# A sparse X whose median stored column is in fewer than this share of the
# rows keeps its rows as they are: Jacobi's scale, a column's RMS over every
# row, measures a rare column's rarity, not its units, and lifts its few
# values by up to sqrt(h / alpha), so the largest row's smoothness sets far
# shorter steps (text). Columns stored in most rows (a table in a sparse
# container) need the scale as dense ones do (docs/tuning.md, "Sparse rows").
RARE_COLUMN_DENSITY = 0.01


def plan_fit(
    settings: FitSettings,
    X: np.ndarray | sp.csr_matrix,
    target: np.ndarray,
    sample_weight: np.ndarray,
    family: Family,
    device: torch.device,
    policy: PrecisionPolicy,
    world: WorldShape,
    n_train: int,
    incremental: bool,
    previous: PreviousFit | None = None,
    reduction: ColumnReduction | None = None,
) -> tuple[FitPlan, StepPlan, ExecutionPlan]:
    """Every choice that depends on the whole data, made once before any rank runs.

    Made from the first ``n_train`` rows (the rest are held out). X, the
    encoded ``target`` ``(n, k)`` and ``sample_weight`` are validated;
    ``policy`` is the precision the fit runs in on ``device``, ``world``
    the ranks it runs on. ``incremental`` (``partial_fit``): one epoch, no
    stopping test, continuing from ``previous``'s coefficients, step plan
    and solver state; otherwise ``previous`` is only read for a warm start.
    Returns the plan the ranks run, the step plan a later ``partial_fit``
    continues, and how the epochs were chosen (``fit_stats_["plan"]``).
    With a ``reduction``, X is this rank's column block and every statistic
    of X is combined over the ranks (:mod:`.reduction`): every rank makes
    the same plan.
    """
    reduction = reduction or WholeX(X.shape[1])
    n_features = reduction.n_features
    n_outputs = target.shape[1]
    n_held_out = X.shape[0] - n_train
    X_all = X  # the held-out rows are stored too
    if n_held_out:  # slicing a sparse X copies it
        X, target, sample_weight = X[:n_train], target[:n_train], sample_weight[:n_train]
    world_size = world.world_size
    continuing = incremental and previous is not None and previous.solver_state is not None
    resume = previous.solver_state if continuing else None
    if continuing:
        before = previous.step_plan
        batch_size = (
            before.batch_size if settings.batch_size == "auto" else int(settings.batch_size)
        )
        batch_size = min(batch_size, n_train)
        steps = before.with_params(settings.penalty.l2, settings.eta0)
        if steps is None:  # eta0="auto" not measured yet: the step comes from these rows
            smoothness = _loss_smoothness(
                settings, X, target, sample_weight, family, True, before.preconditioning, reduction
            )
            steps = StepPlan.made(
                settings.penalty.l2,
                settings.eta0,
                smoothness.at(batch_size),
                before.batch_size,
                before.column_center,
                before.column_scale,
                before.column_spread,
            )
        if steps.eta0 != before.eta0 and resume["eta"] is not None:
            # The step grew, halved or decayed from eta0: it keeps that ratio.
            resume = {**resume, "eta": resume["eta"] * steps.eta0 / before.eta0}
        execution = _plan_execution(
            settings,
            X,
            reduction,
            n_outputs,
            batch_size,
            None,
            world_size,
            device,
            preconditioned=before.column_scale is not None,
        )
    else:
        preconditioning, centered_squares = _preconditioning(
            settings, X, target, sample_weight, family, reduction
        )
        smoothness = execution = None
        newton_allowed = _newton_allowed(settings, incremental)
        if newton_allowed:
            # Minibatch steps' predicted time grows with L_max / L: Newton
            # epochs faster than them at a lower bound of it need no L_max
            # of every row. First each row as smooth as the whole loss
            # (nothing measured), then L and the largest of the rows it
            # is measured on.
            preconditioned = preconditioning[1] is not None
            execution = _plan_execution(
                settings,
                X,
                reduction,
                n_outputs,
                "auto",
                None,
                world_size,
                device,
                True,
                family,
                preconditioned=preconditioned,
            )
            if not execution.newton:
                smoothness = _loss_smoothness(
                    settings,
                    X,
                    target,
                    sample_weight,
                    family,
                    False,
                    preconditioning,
                    reduction,
                    every_row=False,
                )
                execution = _plan_execution(
                    settings,
                    X,
                    reduction,
                    n_outputs,
                    "auto",
                    smoothness.ratio,
                    world_size,
                    device,
                    True,
                    family,
                    preconditioned=preconditioned,
                )
        if execution is None or not execution.newton:
            if settings.eta0 == "auto" or (
                settings.batch_size == "auto" and settings.solver == "svrg"
            ):
                smoothness = _loss_smoothness(
                    settings,
                    X,
                    target,
                    sample_weight,
                    family,
                    incremental,
                    preconditioning,
                    reduction,
                    full=None if smoothness is None else smoothness.full,
                )
            execution = _plan_execution(
                settings,
                X,
                reduction,
                n_outputs,
                settings.batch_size,
                None if smoothness is None else smoothness.ratio,
                world_size,
                device,
                newton_allowed,
                family,
                preconditioned=preconditioning[1] is not None,
            )
        batch_size = execution.batch_size
        steps = StepPlan.made(
            settings.penalty.l2,
            settings.eta0,
            smoothness.at(batch_size)
            if smoothness is not None and not smoothness.sampled and settings.eta0 == "auto"
            else None,
            batch_size,
            *preconditioning,
        )
    if execution.s is not None:
        s, auto_s = execution.s, False
    else:  # s="auto" on several ranks: they time it, once per shape and process
        choice_key = s_choice_key(
            (X.shape[0], n_features), n_outputs, batch_size, world_size, device, policy
        )
        auto_s = choice_key not in CHOICES
        s = CHOICES.get(choice_key, 1)  # 1 until the ranks have timed the kernels
    rows_preconditioned = steps.column_scale is not None and stores_preconditioned(
        X, policy.x_storage
    )
    if rows_preconditioned:
        center, scale = (block_of(v, reduction) for v in (steps.column_center, steps.column_scale))
        stored = reduction.max(largest_abs(X_all, center, scale))
        check_representable(
            stored, policy, "X centered and scaled by the preconditioner, (x - m) / D,"
        )
    elif torch.finfo(policy.x_storage).max < float(np.finfo(X_all.dtype).max):
        # Only a storage dtype of narrower range than X's can overflow.
        check_representable(reduction.max(largest_abs(X_all)), policy, "X")

    coef_init = np.zeros((n_features, n_outputs))
    cold_intercept = (
        family.intercept_start(target, sample_weight)
        if settings.fit_intercept
        else np.zeros(n_outputs)
    )
    # y less the intercept's start: float32 keeps y's variation around
    # it (y = 1e8 + x rounded to multiples of 8 and fitted coef 0).
    target_shift = None
    if settings.fit_intercept and family.shift_invariant:
        target_shift = np.array(cold_intercept, dtype=np.float64)
        cold_intercept = cold_intercept - target_shift
        check_targets_representable(target, sample_weight, policy, target_shift)
    else:
        check_targets_representable(target, sample_weight, policy)
    check_alpha_representable(settings.alpha, policy)
    intercept_init = cold_intercept
    warm = False
    if (settings.warm_start or continuing) and previous is not None and previous.coef is not None:
        coef_before = np.atleast_2d(previous.coef)
        if coef_before.shape == (n_outputs, n_features):
            warm = True
            coef_init = coef_before.T.astype(np.float64)
            intercept_init = np.atleast_1d(previous.intercept).astype(np.float64)
            if target_shift is not None:
                intercept_init = intercept_init - target_shift
    if steps.column_center is not None:  # the engine's intercept is beta + m . w
        intercept_init = intercept_init + steps.column_center @ coef_init
    average_init = None
    if settings.average and continuing and previous.average is not None:
        average_coef = np.atleast_2d(previous.average[0])
        average_intercept = previous.average[1]
        if average_coef.shape == (n_outputs, n_features):  # plain SGD: no preconditioner
            average_intercept = np.atleast_1d(average_intercept).astype(np.float64)
            if target_shift is not None:
                average_intercept = average_intercept - target_shift
            average_init = (np.asarray(average_coef, dtype=np.float64).T, average_intercept)

    tol = None if settings.tol is None else float(settings.tol)
    frobenius = None
    if tol is not None and not incremental and _certified(settings, family):
        frobenius = centered_squares
        if frobenius is None:  # the rows as they are: X itself is what the intercept moves
            frobenius = squared_frobenius(X, reduction) if settings.fit_intercept else 0.0
    if execution.newton:  # every row in one step of Newton's length
        s, batch_size, eta0 = 1, n_train, 1.0
    else:
        eta0 = steps.eta0
    config = SolverConfig(
        s=s,
        batch_size=batch_size,
        max_iter=1 if incremental else int(settings.max_iter),
        tol=None if incremental else tol,
        n_iter_no_change=int(settings.n_iter_no_change),
        shuffle=bool(settings.shuffle),
        seed=int(check_random_state(settings.random_state).randint(np.iinfo(np.int32).max)),
        verbose=int(settings.verbose),
        solver=settings.solver,
        grow_step=not incremental,
        # The stopping test's scale is the cold start's, wherever the fit starts.
        cold_intercept=tuple(map(float, cold_intercept)) if warm and tol is not None else None,
    )
    plan = FitPlan(
        family=family,
        precision=policy.name,
        device=str(device),
        penalty=settings.penalty,
        fit_intercept=settings.fit_intercept,
        config=config,
        learning_rate=settings.learning_rate,
        eta0=eta0,
        power_t=settings.power_t,
        coef_init=coef_init,
        intercept_init=np.asarray(intercept_init, dtype=np.float64),
        loss_offset=family.loss_offset(target, sample_weight),
        target_shift=target_shift,
        seed_from_rank0=world.shares_seed and settings.random_state is None,
        one_machine=world.one_machine,
        auto_s=auto_s,
        column_center=steps.column_center,
        column_scale=steps.column_scale,
        column_spread=steps.column_spread,
        rows_preconditioned=rows_preconditioned,
        decay_alpha=steps.decay_alpha,
        compile=settings.compile,
        resume=resume,
        n_held_out=n_held_out,
        newton=execution.newton,
        curvature_rows=execution.curvature_rows if execution.newton else None,
        average=settings.average,
        average_init=average_init,
        frobenius_squared=frobenius,
    )
    return plan, steps, execution


def _certified(settings: FitSettings, family: Family) -> bool:
    """Whether the fit's objective has the gap certificate (:mod:`.certificate`)."""
    return settings.penalty.l2 > 0.0 and family.self_concordance is not None


def _preconditions(settings: FitSettings, X, reduction: ColumnReduction) -> bool:
    """Whether the fit runs preconditioned: SVRG, on dense X or common sparse columns.

    Not where the optimum is a set: unpenalized, without an intercept, at
    least as many columns as rows. Steps from zero on the rows as they are
    stay in their span and end at the minimum-norm optimum (scikit-learn's
    answer); on the rescaled rows ``x D^{-1}`` they end at another one.
    """
    if settings.solver != "svrg":
        return False
    if settings.alpha == 0.0 and not settings.fit_intercept and reduction.n_features >= X.shape[0]:
        return False
    if not sp.issparse(X):
        return True
    if PRECONDITION_SPARSE is not None:
        return PRECONDITION_SPARSE
    return median_column_density(X, reduction) >= RARE_COLUMN_DENSITY


def _preconditioning(
    settings: FitSettings, X, target, sample_weight, family, reduction
) -> tuple[tuple, float | None]:
    """SVRG's column center, scale and spread from the training rows, and ``||X - m||_F^2``.

    Three Nones and None for SGD, and for a sparse X of rare columns
    (:data:`RARE_COLUMN_DENSITY`).
    """
    if not _preconditions(settings, X, reduction):
        return (None, None, None), None
    # SVRG runs Jacobi-preconditioned (see state.Preconditioner).
    scaling = jacobi_preconditioner(
        X,
        sample_weight,
        settings.penalty.l2,
        settings.fit_intercept,
        family.step_curvature(target, sample_weight),
        reduction,
    )
    return (scaling.center, scaling.scale, scaling.spread), scaling.centered_squares


def median_column_density(X: sp.spmatrix, reduction: ColumnReduction) -> float:
    """The median share of the rows a stored column of a sparse X is in (empty columns aside)."""
    X = X.tocsr()
    local = np.bincount(X.indices, minlength=X.shape[1]).astype(np.float64)
    counts = reduction.gather_columns(local[None, :])[0]
    stored = counts[counts > 0]
    return float(np.median(stored)) / max(X.shape[0], 1) if stored.size else 0.0


def _loss_smoothness(
    settings: FitSettings,
    X,
    target,
    sample_weight,
    family,
    stream,
    preconditioning,
    reduction,
    every_row=True,
    full=None,
) -> Smoothness:
    """The loss's smoothness on the rows as the steps see them (``preconditioning``).

    ``stream``: the rows are ``partial_fit``'s chunk, a sample of the data.
    ``every_row`` and ``full``: as :func:`.stepsize.loss_smoothness`'s.
    """
    return loss_smoothness(
        X,
        sample_weight,
        curvature_scale=family.step_curvature(target, sample_weight),
        fit_intercept=settings.fit_intercept,
        column_center=preconditioning[0],
        column_scale=preconditioning[1],
        stream=stream,
        every_row=every_row,
        full=full,
        reduction=reduction,
    )


def _newton_allowed(settings: FitSettings, incremental: bool) -> bool:
    """Whether the planner may run this fit as Newton epochs (:mod:`.curvature`).

    Only where every setting of the steps is the default's: a user who
    sets the batch size, s, the step or its schedule, or compiled steps
    gets minibatch SVRG as asked; nor on a stream of chunks
    (``partial_fit``), whose epochs are one chunk's; nor with an L1 part,
    whose proximal step follows each minibatch step.
    """
    return (
        not incremental
        and not settings.penalty.proximal
        and settings.solver == "svrg"
        and settings.batch_size == "auto"
        and settings.s == "auto"
        and settings.eta0 == "auto"
        and settings.learning_rate == "adaptive"
        and settings.compile != True  # noqa: E712 (compile is True, False or "auto")
    )


def _plan_execution(
    settings: FitSettings,
    X,
    reduction: ColumnReduction,
    n_outputs,
    batch_size,
    smoothness_ratio,
    world_size,
    device,
    newton_allowed=False,
    family=None,
    preconditioned=False,
) -> ExecutionPlan:
    """The batch size and s of this fit (:func:`~sklearn_casgd._engine.planner.plan_execution`).

    ``preconditioned``: the fit's steps run preconditioned (its step plan's
    column scale), which the proximal sparse kernel does not take.
    """
    n_samples, n_features = X.shape[0], reduction.n_features
    sparse = sp.issparse(X)
    proximal = settings.penalty.proximal
    # The proximal kernel reads the rows as stored (epoch_kernel.covers).
    kernel = (
        sparse
        and sparse_kernel_planned(device.type, world_size, family)
        and not (proximal and preconditioned)
    )
    # The widest rank's block: its columns, or its stored values per row.
    if sparse:
        width = float(reduction.sum(np.array([float(X.nnz)]))[0]) / max(n_samples, 1)
    else:
        width = n_features
    return plan_execution(
        n_samples=n_samples,
        width=math.ceil(width / world_size) if not sparse else width / world_size,
        n_outputs=n_outputs,
        smoothness_ratio=smoothness_ratio,
        batch_size=batch_size,
        s=settings.s,
        solver=settings.solver,
        device_type=device.type,
        world_size=world_size,
        sparse=sparse,
        epoch_kernel=kernel,
        newton_allowed=newton_allowed,
        family=family,
        n_features=None if sparse else n_features,
        proximal=proximal,
        rare_columns=sparse and not preconditioned,
    )


def s_choice_key(
    shape: tuple[int, int],
    n_outputs: int,
    batch_size: int,
    world_size: int,
    device: torch.device,
    policy: PrecisionPolicy,
) -> tuple:
    """What s="auto" depends on; one choice per key and process, so refits match."""
    return (*shape, n_outputs, batch_size, world_size, str(device), policy.name)


def record_s_choice(
    plan: FitPlan,
    result: BlockResult,
    shape: tuple[int, int],
    world_size: int,
    device: torch.device,
    policy: PrecisionPolicy,
) -> None:
    """Keep the s the ranks chose by timing (``s="auto"`` on several ranks) for later fits."""
    if plan.auto_s:
        n_outputs = plan.coef_init.shape[1]
        key = s_choice_key(shape, n_outputs, plan.config.batch_size, world_size, device, policy)
        CHOICES[key] = result.chosen_s
