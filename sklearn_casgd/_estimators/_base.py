"""The estimator base: parameters, validation and the call into the engine."""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.base import BaseEstimator
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import ShuffleSplit, StratifiedShuffleSplit
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted, validate_data

from .._backends import Backend, backend_for
from .._cost import CHOICES
from .._data import stores_preconditioned
from .._engine import BlockResult, FitPlan
from .._families import Family
from .._planner import ExecutionPlan, plan_execution
from .._precision import (
    PRESETS,
    check_alpha_representable,
    check_representable,
    check_targets_representable,
    resolve_policy,
)
from .._sklearn_compat import Interval, StrOptions
from .._solver import LEARNING_RATES, SOLVERS, SolverConfig, SolverState
from .._stepsize import (
    Smoothness,
    jacobi_preconditioner,
    loss_smoothness,
    step_size,
)
from .._threads import numpy_blas_single_threaded
from .._version import PickleVersionWarning, __version__
from ._validation import largest_abs, resolve_device

_FLOAT_DTYPES = [np.float64, np.float32]
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0


def _fit_stats(
    plan: FitPlan,
    execution: ExecutionPlan,
    result: BlockResult,
    precision: str,
    device: torch.device,
    world_size: int,
) -> dict:
    """``fit_stats_``: how the fit ran (plan, exchange, compile) and what it measured."""
    solver = result.solver
    return {
        "s": result.s,
        "s_predictions": result.s_predictions
        if plan.auto_s or execution.s_predictions is None
        else execution.s_predictions,
        "batch_size": plan.config.batch_size,
        "plan": execution.report() if execution.chosen is not None else None,
        "precision": precision,
        "device": str(device),
        "world_size": world_size,
        "n_outer": solver.n_outer,
        "n_allreduce": result.n_allreduce,
        "allreduce_bytes": result.allreduce_bytes,
        "allreduce_seconds": result.allreduce_seconds,
        "train_seconds": solver.train_seconds,
        "epoch_seconds": solver.epoch_seconds,
        "solver": plan.config.solver,
        "eta0": plan.eta0,
        "eta": solver.final_eta,
        "gradient_max": solver.gradient_max,
        "gradient_bound": solver.gradient_bound,
        "converged": solver.converged,
        "exchange": result.exchange,
        "compiled": result.compiled,
        "compile_seconds": result.compile_seconds,
        "stopped_early": solver.stopped_early,
    }


def _not_converged_message(estimator, solver, precision: str) -> str:
    """What the ConvergenceWarning of an unconverged fit says, and what to change."""
    measured = (
        f"the full gradient's largest entry is {solver.gradient_max:.3g}, above its bound "
        f"{solver.gradient_bound:.3g} (tol={estimator.tol:g}, scaled as the tol parameter "
        f"says), after {solver.n_iter} epochs"
    )
    if estimator.solver == "sgd":
        return (
            f"Plain SGD stopped where {measured}: it settles near the optimum, not on it. "
            "Use solver='svrg' to reach the optimum, or increase max_iter."
        )
    if solver.stalled:
        finer = "" if precision == "fp64" else ", or precision='fp64'"
        return (
            f"SVRG stopped where {measured}: no step lowered the objective beyond the "
            f"rounding of precision={precision!r}. Use a larger tol{finer}."
        )
    return (
        f"SVRG did not converge: {measured}. Increase max_iter, or standardize X "
        "(StandardScaler) so that its columns have comparable scales."
    )


@dataclass(frozen=True)
class _StepPlan:
    """What a fit derives from its training rows before the epochs, kept for ``partial_fit``.

    The initial step and, for SVRG, the preconditioner: the coordinates the
    solver state's step size belongs to. ``alpha`` and ``eta0_param`` are the
    parameters it was made with; ``smoothness`` is the loss's ``L(b)``
    (without the L2 term) when the step was chosen from it (``eta0="auto"``).
    ``eta0`` is None where a fit of Newton epochs did not measure the
    smoothness: a later ``partial_fit`` takes its step from its own rows.
    """

    eta0: float | None
    column_center: np.ndarray | None
    column_scale: np.ndarray | None
    column_spread: np.ndarray | None
    decay_alpha: float
    alpha: float
    eta0_param: float | str
    smoothness: float | None
    batch_size: int

    @classmethod
    def made(
        cls,
        alpha: float,
        eta0_param: float | str,
        smoothness: float | None,
        batch_size: int,
        column_center: np.ndarray | None = None,
        column_scale: np.ndarray | None = None,
        column_spread: np.ndarray | None = None,
    ) -> _StepPlan:
        """The plan for these parameters: the steps' scalar decay and the initial step.

        Preconditioned (SVRG), the steps decay at ``alpha / min D^2``, the
        largest of the columns' rates (see :class:`~sklearn_casgd._kernel.Preconditioner`).
        """
        decay_alpha = alpha if column_scale is None else alpha / float(np.min(column_scale**2))
        if smoothness is not None:
            eta0 = step_size(smoothness, decay_alpha)
        else:
            eta0 = None if eta0_param == "auto" else float(eta0_param)
        if eta0 is not None and eta0 * decay_alpha >= 1.0:
            preconditioned = (
                "" if column_scale is None else " (alpha relative to SVRG's preconditioned columns)"
            )
            raise ValueError(
                f"eta0 * alpha = {eta0 * decay_alpha:.3g} >= 1{preconditioned}: the L2 decay "
                "factor 1 - eta0 * alpha of a step would not be positive. Use a smaller eta0 "
                "or alpha, or eta0='auto'."
            )
        return cls(
            eta0,
            column_center,
            column_scale,
            column_spread,
            decay_alpha,
            alpha,
            eta0_param,
            smoothness,
            batch_size,
        )

    @property
    def preconditioning(self) -> tuple:
        """``(column_center, column_scale, column_spread)``."""
        return self.column_center, self.column_scale, self.column_spread

    def with_params(self, alpha: float, eta0_param: float | str) -> _StepPlan | None:
        """This plan after ``set_params`` changed ``alpha`` or ``eta0`` between partial fits.

        The preconditioner stays (it only fixes the coordinates); the decay and
        the initial step follow the new values, as the first call would have
        chosen them from its rows. Unchanged parameters give this plan; None
        means the step must come from rows (``eta0="auto"`` after the user's).
        """
        if eta0_param == "auto" and self.smoothness is None:
            return None
        if alpha == self.alpha and eta0_param == self.eta0_param:
            return self
        return _StepPlan.made(
            alpha,
            eta0_param,
            self.smoothness if eta0_param == "auto" else None,
            self.batch_size,
            self.column_center,
            self.column_scale,
            self.column_spread,
        )


class _BaseCASGD(BaseEstimator):
    """Parameters and fitting logic shared by every CA-SGD estimator."""

    _parameter_constraints: dict = {
        "alpha": [Interval(Real, 0, None, closed="left")],
        "fit_intercept": ["boolean"],
        "s": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "batch_size": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "solver": [StrOptions(set(SOLVERS))],
        "learning_rate": [StrOptions(set(LEARNING_RATES))],
        "eta0": [Interval(Real, 0, None, closed="neither"), StrOptions({"auto"})],
        "power_t": [Interval(Real, None, None, closed="neither")],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "tol": [Interval(Real, 0, None, closed="left"), None],
        "n_iter_no_change": [Interval(Integral, 1, None, closed="left")],
        "shuffle": ["boolean"],
        "random_state": ["random_state"],
        "precision": [StrOptions({"auto", *PRESETS})],
        "device": [str],
        "n_devices": [Interval(Integral, 1, None, closed="left"), StrOptions({"world"})],
        "verbose": ["verbose"],
        "warm_start": ["boolean"],
        # Above a week a timeout is a mistake (and 1e15 s overflows the store's clock).
        "timeout": [Interval(Real, 0, MAX_TIMEOUT_SECONDS, closed="right")],
        "compile": ["boolean", StrOptions({"auto"})],
        "early_stopping": ["boolean"],
        "validation_fraction": [Interval(Real, 0, 1, closed="neither")],
    }

    def __init__(
        self,
        *,
        alpha=1e-4,
        fit_intercept=True,
        s="auto",
        batch_size="auto",
        solver="svrg",
        learning_rate="adaptive",
        eta0="auto",
        power_t=0.5,
        max_iter=1000,
        tol=1e-5,
        n_iter_no_change=5,
        shuffle=True,
        random_state=None,
        precision="auto",
        device="auto",
        n_devices=1,
        verbose=0,
        warm_start=False,
        timeout=300.0,
        compile="auto",
        early_stopping=False,
        validation_fraction=0.1,
    ):
        self.alpha = alpha
        self.fit_intercept = fit_intercept
        self.s = s
        self.batch_size = batch_size
        self.solver = solver
        self.learning_rate = learning_rate
        self.eta0 = eta0
        self.power_t = power_t
        self.max_iter = max_iter
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.shuffle = shuffle
        self.random_state = random_state
        self.precision = precision
        self.device = device
        self.n_devices = n_devices
        self.verbose = verbose
        self.warm_start = warm_start
        self.timeout = timeout
        self.compile = compile
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction

    # -- pickling ----------------------------------------------------------------

    def __getstate__(self):
        return {**super().__getstate__(), "_sklearn_casgd_version": __version__}

    def __setstate__(self, state):
        """Restore a pickle; one from another version predicts, with a warning.

        Parameters the other version did not have take their defaults, so
        ``repr``, ``get_params`` and ``fit`` work.
        """
        state = dict(state)
        version = state.pop("_sklearn_casgd_version", "before 0.1.0")
        defaults = inspect.signature(type(self).__init__).parameters
        missing = [name for name in self._get_param_names() if name not in state]
        for name in missing:
            state[name] = defaults[name].default
        if version != __version__:
            filled = f" Parameters it lacked take their defaults: {missing}." if missing else ""
            warnings.warn(
                f"{type(self).__name__} was pickled by sklearn_casgd {version} and is loaded by "
                f"{__version__}: it predicts as it did; partial_fit may need a new fit.{filled}",
                PickleVersionWarning,
                stacklevel=2,
            )
        super().__setstate__(state)

    # -- helpers for subclasses -------------------------------------------------

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True
        return tags

    def _validate_X_y(self, X, y, **kwargs):
        X, y = validate_data(self, X, y, dtype=_FLOAT_DTYPES, accept_sparse="csr", **kwargs)
        if sp.issparse(X):
            self._check_sparse_supported()
        return X, y

    def _check_sparse_supported(self) -> None:
        """Refuse the settings a sparse X does not run with, naming them."""
        if self.compile is True:
            raise ValueError(
                "compile=True does not apply to a sparse X (torch.compile does not take "
                "sparse tensors); use compile='auto' or False."
            )

    def _linear_predictor(self, X) -> np.ndarray:
        """``X @ coef_.T + intercept_`` in float64 numpy, shape ``(n, n_outputs)``."""
        check_is_fitted(self)
        X = validate_data(self, X, reset=False, dtype=np.float64, accept_sparse="csr")
        coef = np.atleast_2d(self.coef_)
        return X @ coef.T + np.atleast_1d(self.intercept_)

    def _fit_engine(
        self,
        X: np.ndarray,
        target: np.ndarray,
        sample_weight: np.ndarray,
        family: Family,
        *,
        incremental: bool = False,
        stratify: np.ndarray | None = None,
        score_weight: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Plan the fit, run it where ``n_devices`` says; return ``coef`` ``(k, d)``, ``intercept``.

        ``incremental`` (``partial_fit``): one epoch on these rows, continuing
        the coefficients, step plan and solver state of the previous fit.
        Otherwise, with ``early_stopping``, rows are held out (stratified by
        ``stratify``) and scored with ``score_weight`` (the user's weights,
        when ``sample_weight`` carries class weights too).

        Both come in X's dtype (float32 X gives float32 coefficients, as
        scikit-learn's linear models do). Sets ``n_iter_``, ``t_``,
        ``loss_curve_``, ``solver_state_``, the validation scores and
        ``fit_stats_``.
        """
        device = resolve_device(self.device)
        policy = resolve_policy(self.precision, device)
        backend = backend_for(self.n_devices, device, self.timeout)
        world_size = backend.world_size
        n_held_out = 0
        if self.early_stopping and not incremental:
            X, target, sample_weight, n_held_out = self._hold_out(
                X, target, sample_weight, stratify, score_weight
            )
        n_train = X.shape[0] - n_held_out
        with numpy_blas_single_threaded():
            plan, steps, execution = self._plan(
                X, target, sample_weight, family, device, policy, backend, n_train, incremental
            )
            result = backend.fit(plan, X, target, sample_weight)

        if plan.auto_s:
            key = self._s_choice_key(
                X[:n_train], target.shape[1], plan.config.batch_size, world_size, device, policy
            )
            CHOICES[key] = result.chosen_s
        coef, intercept = plan.user_coefficients(result.coef, result.intercept)
        solver = result.solver
        if solver.failure is not None:
            raise ValueError(solver.failure)
        if not (np.all(np.isfinite(coef)) and np.all(np.isfinite(intercept))):
            raise ValueError(
                f"SGD produced non-finite coefficients: the step size eta0={plan.eta0:.4g} "
                "is too large for this data."
            )
        if plan.config.tol is not None and not (solver.converged or solver.stopped_early):
            message = _not_converged_message(self, solver, policy.name)
            warnings.warn(message, ConvergenceWarning, stacklevel=4)
        self.n_iter_ = solver.n_iter
        self.t_ = solver.n_steps
        self.loss_curve_ = np.asarray(solver.loss_curve)
        self.solver_state_ = solver.state.state_dict()
        if plan.newton:  # a later partial_fit's minibatch steps start from the step plan's eta0
            self.solver_state_["eta"] = None
        self._step_plan = steps
        self.validation_scores_ = solver.validation_scores
        self.best_validation_score_ = (
            max(solver.validation_scores) if solver.validation_scores else None
        )
        self.fit_stats_ = _fit_stats(plan, execution, result, policy.name, device, world_size)
        return coef.astype(X.dtype, copy=False), intercept.astype(X.dtype, copy=False)

    def _hold_out(self, X, target, sample_weight, stratify, score_weight):
        """The rows reordered: training rows first, then the held-out ones; and their count.

        As scikit-learn's SGD: a (stratified) shuffle split drawn with
        ``random_state``; held-out rows carry ``score_weight`` when given.
        """
        n_samples = X.shape[0]
        splitter_class = ShuffleSplit if stratify is None else StratifiedShuffleSplit
        splitter = splitter_class(
            test_size=self.validation_fraction, random_state=self.random_state
        )
        # The splitters raise a ValueError themselves when a side would be empty.
        train, held_out = next(splitter.split(np.zeros((n_samples, 1)), stratify))
        train_weight = sample_weight[train]
        held_out_weight = (sample_weight if score_weight is None else score_weight)[held_out]
        self._check_split_weights(held_out_weight, "held-out", "nothing to score")
        self._check_split_weights(train_weight, "training", "nothing to fit")
        order = np.concatenate([train, held_out])
        weight = np.concatenate([train_weight, held_out_weight])
        return X[order], target[order], weight, held_out.shape[0]

    def _check_split_weights(self, weights, which: str, consequence: str) -> None:
        """Raise ``ValueError`` when one side of early stopping's split weighs nothing.

        As scikit-learn's SGD does for the held-out side: its score (r2,
        accuracy) with weights all 0 is undefined, or 1 whatever the fit.
        """
        if not np.any(weights):
            raise ValueError(
                f"early_stopping: every sample weight of the {weights.shape[0]} {which} "
                f"rows (validation_fraction={self.validation_fraction}) is zero, so there "
                f"is {consequence}. Use another random_state or validation_fraction, or "
                "early_stopping=False."
            )

    def _validated_solver_state(self) -> dict:
        """``solver_state_`` checked before any work (it may come from a pickle or a user)."""
        if not hasattr(self, "_step_plan"):
            raise ValueError(
                "This estimator's solver state cannot be continued by partial_fit: it was "
                "pickled by another version of sklearn_casgd without its step plan. Call fit "
                "to start afresh."
            )
        try:
            return SolverState.from_state_dict(self.solver_state_).state_dict()
        except ValueError as error:
            raise ValueError(
                f"solver_state_ cannot be continued by partial_fit: {error} Call fit to start "
                "afresh."
            ) from None

    def _plan(
        self,
        X,
        target,
        sample_weight,
        family,
        device,
        policy,
        backend: Backend,
        n_train,
        incremental,
    ) -> tuple[FitPlan, _StepPlan, ExecutionPlan]:
        """Every choice that depends on the whole data, made once before any rank runs.

        Made from the first ``n_train`` rows (the rest are held out).
        ``incremental``: one epoch, no stopping test, continuing from the
        previous fit's coefficients, step plan and solver state.
        """
        n_features = X.shape[1]
        n_outputs = target.shape[1]
        n_held_out = X.shape[0] - n_train
        X_all = X  # the held-out rows are stored too
        if n_held_out:  # slicing a sparse X copies it
            X, target, sample_weight = X[:n_train], target[:n_train], sample_weight[:n_train]
        world_size = backend.world_size
        continuing = incremental and hasattr(self, "solver_state_")
        resume = self._validated_solver_state() if continuing else None
        if continuing:
            previous = self._step_plan
            batch_size = previous.batch_size if self.batch_size == "auto" else int(self.batch_size)
            batch_size = min(batch_size, n_train)
            steps = previous.with_params(float(self.alpha), self.eta0)
            if steps is None:  # eta0="auto" not measured yet: the step comes from these rows
                smoothness = self._loss_smoothness(
                    X, target, sample_weight, family, True, previous.preconditioning
                )
                steps = _StepPlan.made(
                    float(self.alpha),
                    self.eta0,
                    smoothness.at(batch_size),
                    previous.batch_size,
                    previous.column_center,
                    previous.column_scale,
                    previous.column_spread,
                )
            if steps.eta0 != previous.eta0 and resume["eta"] is not None:
                # The step grew, halved or decayed from eta0: it keeps that ratio.
                resume = {**resume, "eta": resume["eta"] * steps.eta0 / previous.eta0}
            execution = self._plan_execution(X, n_outputs, batch_size, None, world_size, device)
        else:
            preconditioning = self._preconditioning(X, target, sample_weight, family)
            smoothness = execution = None
            newton_allowed = self._newton_allowed(incremental)
            if newton_allowed:
                # Minibatch steps' predicted time grows with L_max / L: Newton
                # epochs faster than them at a lower bound of it need no L_max
                # of every row. First each row as smooth as the whole loss
                # (nothing measured), then L and the largest of the rows it
                # is measured on.
                execution = self._plan_execution(
                    X, n_outputs, "auto", None, world_size, device, True, family
                )
                if not execution.newton:
                    smoothness = self._loss_smoothness(
                        X, target, sample_weight, family, False, preconditioning, every_row=False
                    )
                    execution = self._plan_execution(
                        X, n_outputs, "auto", smoothness.ratio, world_size, device, True, family
                    )
            if execution is None or not execution.newton:
                if self.eta0 == "auto" or (self.batch_size == "auto" and self.solver == "svrg"):
                    smoothness = self._loss_smoothness(
                        X,
                        target,
                        sample_weight,
                        family,
                        incremental,
                        preconditioning,
                        full=None if smoothness is None else smoothness.full,
                    )
                execution = self._plan_execution(
                    X,
                    n_outputs,
                    self.batch_size,
                    None if smoothness is None else smoothness.ratio,
                    world_size,
                    device,
                    newton_allowed,
                    family,
                )
            batch_size = execution.batch_size
            steps = _StepPlan.made(
                float(self.alpha),
                self.eta0,
                smoothness.at(batch_size)
                if smoothness is not None and not smoothness.sampled and self.eta0 == "auto"
                else None,
                batch_size,
                *preconditioning,
            )
        if execution.s is not None:
            s, auto_s = execution.s, False
        else:  # s="auto" on several ranks: they time it, once per shape and process
            choice_key = self._s_choice_key(X, n_outputs, batch_size, world_size, device, policy)
            auto_s = choice_key not in CHOICES
            s = CHOICES.get(choice_key, 1)  # 1 until the ranks have timed the kernels
        rows_preconditioned = steps.column_scale is not None and stores_preconditioned(
            X, policy.x_storage
        )
        if rows_preconditioned:
            stored = largest_abs(X_all, steps.column_center, steps.column_scale)
            check_representable(
                stored, policy, "X centered and scaled by the preconditioner, (x - m) / D,"
            )
        elif torch.finfo(policy.x_storage).max < float(np.finfo(X_all.dtype).max):
            # Only a storage dtype of narrower range than X's can overflow.
            check_representable(largest_abs(X_all), policy, "X")

        coef_init = np.zeros((n_features, n_outputs))
        cold_intercept = (
            family.intercept_start(target, sample_weight)
            if self.fit_intercept
            else np.zeros(n_outputs)
        )
        # y less the intercept's start: float32 keeps y's variation around
        # it (y = 1e8 + x rounded to multiples of 8 and fitted coef 0).
        target_shift = None
        if self.fit_intercept and family.shift_invariant:
            target_shift = np.array(cold_intercept, dtype=np.float64)
            cold_intercept = cold_intercept - target_shift
            check_targets_representable(target, sample_weight, policy, target_shift)
        else:
            check_targets_representable(target, sample_weight, policy)
        check_alpha_representable(float(self.alpha), policy)
        intercept_init = cold_intercept
        warm = False
        if (self.warm_start or continuing) and hasattr(self, "coef_"):
            previous = np.atleast_2d(self.coef_)
            if previous.shape == (n_outputs, n_features):
                warm = True
                coef_init = previous.T.astype(np.float64)
                intercept_init = np.atleast_1d(self.intercept_).astype(np.float64)
                if target_shift is not None:
                    intercept_init = intercept_init - target_shift
        if steps.column_center is not None:  # the engine's intercept is beta + m . w
            intercept_init = intercept_init + steps.column_center @ coef_init

        tol = None if self.tol is None else float(self.tol)
        if execution.newton:  # every row in one step of Newton's length
            s, batch_size, eta0 = 1, n_train, 1.0
        else:
            eta0 = steps.eta0
        config = SolverConfig(
            s=s,
            batch_size=batch_size,
            max_iter=1 if incremental else int(self.max_iter),
            tol=None if incremental else tol,
            n_iter_no_change=int(self.n_iter_no_change),
            shuffle=bool(self.shuffle),
            seed=int(check_random_state(self.random_state).randint(np.iinfo(np.int32).max)),
            verbose=int(self.verbose),
            solver=self.solver,
            grow_step=not incremental,
            # The stopping test's scale is the cold start's, wherever the fit starts.
            cold_intercept=tuple(map(float, cold_intercept)) if warm and tol is not None else None,
        )
        plan = FitPlan(
            family=family,
            precision=policy.name,
            device=str(device),
            alpha=float(self.alpha),
            fit_intercept=bool(self.fit_intercept),
            config=config,
            learning_rate=self.learning_rate,
            eta0=eta0,
            power_t=float(self.power_t),
            coef_init=coef_init,
            intercept_init=np.asarray(intercept_init, dtype=np.float64),
            loss_offset=family.loss_offset(target, sample_weight),
            target_shift=target_shift,
            seed_from_rank0=backend.shares_seed and self.random_state is None,
            auto_s=auto_s,
            column_center=steps.column_center,
            column_scale=steps.column_scale,
            column_spread=steps.column_spread,
            rows_preconditioned=rows_preconditioned,
            decay_alpha=steps.decay_alpha,
            compile=self.compile,
            resume=resume,
            n_held_out=n_held_out,
            newton=execution.newton,
            curvature_rows=execution.curvature_rows if execution.newton else None,
        )
        return plan, steps, execution

    def _preconditioning(self, X, target, sample_weight, family) -> tuple:
        """SVRG's column center, scale and spread from the training rows; three Nones for SGD."""
        if self.solver != "svrg":
            return (None, None, None)
        # SVRG runs Jacobi-preconditioned (see _kernel.Preconditioner).
        return jacobi_preconditioner(
            X,
            sample_weight,
            float(self.alpha),
            bool(self.fit_intercept),
            family.step_curvature(target, sample_weight),
        )

    def _loss_smoothness(
        self,
        X,
        target,
        sample_weight,
        family,
        stream,
        preconditioning,
        every_row=True,
        full=None,
    ) -> Smoothness:
        """The loss's smoothness on the rows as the steps see them (``preconditioning``).

        ``stream``: the rows are ``partial_fit``'s chunk, a sample of the data.
        ``every_row`` and ``full``: as :func:`.._stepsize.loss_smoothness`'s.
        """
        return loss_smoothness(
            X,
            sample_weight,
            curvature_scale=family.step_curvature(target, sample_weight),
            fit_intercept=bool(self.fit_intercept),
            column_center=preconditioning[0],
            column_scale=preconditioning[1],
            stream=stream,
            every_row=every_row,
            full=full,
        )

    def _newton_allowed(self, incremental: bool) -> bool:
        """Whether the planner may run this fit as Newton epochs (:mod:`.._curvature`).

        Only where every setting of the steps is the default's: a user who
        sets the batch size, s, the step or its schedule, or compiled steps
        gets minibatch SVRG as asked; nor on a stream of chunks
        (``partial_fit``), whose epochs are one chunk's.
        """
        return (
            not incremental
            and self.solver == "svrg"
            and self.batch_size == "auto"
            and self.s == "auto"
            and self.eta0 == "auto"
            and self.learning_rate == "adaptive"
            and self.compile != True  # noqa: E712 (compile is True, False or "auto")
        )

    def _plan_execution(
        self,
        X,
        n_outputs,
        batch_size,
        smoothness_ratio,
        world_size,
        device,
        newton_allowed=False,
        family=None,
    ) -> ExecutionPlan:
        """The batch size and s of this fit (:func:`~sklearn_casgd._planner.plan_execution`)."""
        n_samples, n_features = X.shape
        sparse = sp.issparse(X)
        # The widest rank's block: its columns, or its stored values per row.
        width = X.nnz / max(n_samples, 1) if sparse else n_features
        return plan_execution(
            n_samples=n_samples,
            width=math.ceil(width / world_size) if not sparse else width / world_size,
            n_outputs=n_outputs,
            smoothness_ratio=smoothness_ratio,
            batch_size=batch_size,
            s=self.s,
            solver=self.solver,
            device_type=device.type,
            world_size=world_size,
            sparse=sparse,
            newton_allowed=newton_allowed,
            family=family,
            n_features=None if sparse else n_features,
        )

    def _s_choice_key(self, X, n_outputs, batch_size, world_size, device, policy) -> tuple:
        """What s="auto" depends on; one choice per key and process, so refits match."""
        return (*X.shape, n_outputs, batch_size, world_size, str(device), policy.name)
