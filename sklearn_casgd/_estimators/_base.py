"""The estimator base: parameters, validation and the call into the engine."""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import warnings
from contextlib import nullcontext
from numbers import Integral, Real

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.base import BaseEstimator
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import ShuffleSplit, StratifiedShuffleSplit
from sklearn.utils.extmath import safe_sparse_dot
from sklearn.utils.validation import check_is_fitted, validate_data

from .._data.blocks import ColumnBlocks
from .._data.checks import check_csr
from .._distributed.backends import backend_for
from .._distributed.threads import numpy_blas_single_threaded, threads_for_free_cores
from .._distributed.world import (
    check_same_data,
    column_reduction,
    data_fingerprint,
    open_column_blocks,
)
from .._engine import certificate
from .._engine.checkpoint import CheckpointSpec, resumable
from .._engine.fit import BlockResult, FitPlan
from .._engine.fit_plan import (
    FitSettings,
    PreviousFit,
    WorldShape,
    plan_fit,
    record_s_choice,
)
from .._engine.planner import ExecutionPlan
from .._engine.precision import (
    PRESETS,
    resolve_policy,
)
from .._engine.solver_state import LEARNING_RATES, SOLVERS, SolverState
from .._engine.step_plan import StepPlan
from .._glm.families import Family
from .._glm.penalties import PENALTIES, l1_share
from .._sklearn_compat import Interval, StrOptions
from .._version import PickleVersionWarning, __version__
from ._sparse_coef import SparseCoefMixin, dense_coef
from ._validation import resolve_device

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
        "plan": execution.report() if execution.chosen_by_planner else None,
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
        "gap_bound": solver.gap_bound,
        "gap_target": solver.gap_target,
        "gap_bound_method": certificate.method(
            plan.config.tol, plan.penalty.l2, plan.family.self_concordance
        ),
        "converged": solver.converged,
        "polished_epochs": solver.polished,
        "epochs_run": solver.n_iter - solver.resumed_epochs,
        "exchange": result.exchange,
        "compiled": result.compiled,
        "compile_seconds": result.compile_seconds,
        "execution": result.execution,
        "stopped_early": solver.stopped_early,
    }


def _not_converged_message(estimator, solver, precision: str) -> str:
    """What the ConvergenceWarning of an unconverged fit says, and what to change."""
    if solver.separated:
        return (
            f"The classes are linearly separable and alpha=0: the loss falls toward 0 as "
            f"the coefficients grow, so no finite optimum exists (stopped after "
            f"{solver.n_iter} epochs, the full gradient's largest entry "
            f"{solver.gradient_max:.3g}). Set alpha > 0 for a finite model."
        )
    failed = []
    if solver.gradient_bound is not None and not solver.gradient_max <= solver.gradient_bound:
        failed.append(
            f"the full gradient's largest entry is {solver.gradient_max:.3g}, above its bound "
            f"{solver.gradient_bound:.3g} (tol={estimator.tol:g}, scaled as the tol parameter "
            "says)"
        )
    target = solver.gap_target
    if target is not None and not (solver.gap_bound is not None and solver.gap_bound <= target):
        if solver.gap_bound is None or not math.isfinite(solver.gap_bound):
            bound = "is not bounded yet (the intercepts' gradient outweighs their curvature)"
        else:
            bound = f"is at most {solver.gap_bound:.3g} (relative)"
        failed.append(
            f"the certified gap to the optimum's objective {bound}, above the {target:.3g} "
            f"that tol={estimator.tol:g} names"
        )
    measured = " and ".join(failed) + f", after {solver.n_iter} epochs"
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
    if solver.n_iter >= estimator.max_iter:
        return (
            f"SVRG did not converge: {measured}, all of max_iter={estimator.max_iter}. "
            "Increase max_iter, or standardize X (StandardScaler) if its columns' scales differ."
        )
    return f"SVRG did not converge: {measured}."


# Parameters that do not change a fit's steps: a checkpoint resumes whatever they are.
_NOT_IN_CHECKPOINT_IDENTITY = frozenset(
    {"verbose", "timeout", "n_devices", "max_iter", "checkpoint_dir", "checkpoint_every"}
)

# Pickles written before the step plan was pickled as a dict name its class here.
_StepPlan = StepPlan


class _BaseCASGD(SparseCoefMixin, BaseEstimator):
    """Parameters and fitting logic shared by every CA-SGD estimator."""

    _parameter_constraints: dict = {
        "alpha": [Interval(Real, 0, None, closed="left")],
        "penalty": [StrOptions(set(PENALTIES))],
        "l1_ratio": [Interval(Real, 0, 1, closed="both")],
        "fit_intercept": ["boolean"],
        "s": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "batch_size": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "solver": [StrOptions(set(SOLVERS))],
        "average": ["boolean", Interval(Integral, 0, None, closed="left")],
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
        "checkpoint_dir": [str, os.PathLike, None],
        "checkpoint_every": [Interval(Integral, 1, None, closed="left")],
    }

    def __init__(
        self,
        *,
        alpha=1e-4,
        penalty="l2",
        l1_ratio=0.15,
        fit_intercept=True,
        s="auto",
        batch_size="auto",
        solver="svrg",
        average=False,
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
        checkpoint_dir=None,
        checkpoint_every=1,
    ):
        self.alpha = alpha
        self.penalty = penalty
        self.l1_ratio = l1_ratio
        self.fit_intercept = fit_intercept
        self.s = s
        self.batch_size = batch_size
        self.solver = solver
        self.average = average
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
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every

    # -- pickling ----------------------------------------------------------------

    def __getstate__(self):
        state = {**super().__getstate__(), "_sklearn_casgd_version": __version__}
        # The step plan travels as a dict: a pickle names no module of the engine, so
        # moving one never breaks it.
        if isinstance(state.get("_step_plan"), StepPlan):
            state["_step_plan"] = dataclasses.asdict(state["_step_plan"])
        return state

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
        if isinstance(state.get("_step_plan"), dict):
            try:
                state["_step_plan"] = StepPlan(**state["_step_plan"])
            except TypeError:  # another version's fields: partial_fit then says so
                del state["_step_plan"]
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
        self._column_block = None
        if isinstance(X, ColumnBlocks):
            return self._open_column_blocks(X, y, **kwargs)
        X, y = validate_data(self, X, y, dtype=_FLOAT_DTYPES, accept_sparse="csr", **kwargs)
        if sp.issparse(X):
            check_csr(X)
            self._check_sparse_supported()
        return X, y

    def _open_column_blocks(self, blocks: ColumnBlocks, y, y_numeric=False, reset=True):
        """This rank's column block, checked with the job's other ranks, and y validated.

        Sets ``n_features_in_`` to every block's columns together, and
        ``_column_block`` (this rank's columns and that number) for
        :meth:`_fit_engine`.
        """
        if self.n_devices != "world":
            raise ValueError(
                "ColumnBlocks are fitted by the ranks of a job, each loading its own block: "
                f"use n_devices='world' (got n_devices={self.n_devices!r}), or pass X whole."
            )
        y = validate_data(self, X="no_validation", y=y, y_numeric=y_numeric, reset=reset)
        opened = open_column_blocks(blocks, y, resolve_device(self.device), float(self.timeout))
        if sp.issparse(opened.X):
            self._check_sparse_supported()
        self.n_features_in_ = opened.n_features
        self.__dict__.pop("feature_names_in_", None)
        self._column_block = (opened.columns, opened.n_features)
        return opened.X, y

    def _check_sparse_supported(self) -> None:
        """Refuse the settings a sparse X does not run with, naming them."""
        if self.compile is True:
            raise ValueError(
                "compile=True does not apply to a sparse X (torch.compile does not take "
                "sparse tensors); use compile='auto' or False."
            )

    def _linear_predictor(self, X) -> np.ndarray:
        """``X @ coef_.T + intercept_`` as numpy, shape ``(n, n_outputs)``.

        In float32 where X and the model both are (a fit on float32 X keeps
        float32 ``coef_``), as scikit-learn's linear models preserve it;
        float64 otherwise.
        """
        check_is_fitted(self)
        X = validate_data(self, X, reset=False, dtype=_FLOAT_DTYPES, accept_sparse="csr")
        if sp.issparse(X):
            check_csr(X)
        coef = self.coef_ if sp.issparse(self.coef_) else np.atleast_2d(self.coef_)
        intercept = np.atleast_1d(self.intercept_)
        dtype = np.result_type(X.dtype, coef.dtype, intercept.dtype)
        raw = safe_sparse_dot(X, coef.T.astype(dtype, copy=False), dense_output=True)
        return (raw + intercept).astype(dtype, copy=False)

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
        if self._average_start() and self.solver != "sgd":
            raise ValueError(
                f"average={self.average!r} averages plain SGD's iterates: use solver='sgd' "
                f"(solver={self.solver!r} reaches the optimum itself; averaging it "
                "would only slow it down)."
            )
        device = resolve_device(self.device)
        policy = resolve_policy(self.precision, device)
        # This rank's column block of X, set by _validate_X_y for ColumnBlocks.
        columns = self.__dict__.pop("_column_block", None)
        if columns is not None and incremental:
            raise ValueError("partial_fit takes X whole, not ColumnBlocks: use fit.")
        backend = backend_for(self.n_devices, device, self.timeout, columns)
        world_size = backend.world_size
        n_held_out = 0
        if self.early_stopping and not incremental:
            X, target, sample_weight, n_held_out = self._hold_out(
                X, target, sample_weight, stratify, score_weight
            )
        n_train = X.shape[0] - n_held_out
        world = WorldShape(world_size, backend.shares_seed, backend.one_machine)
        # Statistics of X combine over the ranks' blocks while planning.
        statistics = nullcontext() if columns is None else column_reduction(columns, self.timeout)
        # One process on the CPU: its planning and its steps on the cores free now.
        cores = threads_for_free_cores() if backend.world_size == 1 else nullcontext()
        with numpy_blas_single_threaded(), statistics as reduction, cores:
            fingerprint = None  # of the whole X: every rank's block, when one is given
            if reduction is not None:  # the ranks' statistics must be of the same rows
                fingerprint = check_same_data(X, target, sample_weight, reduction.group, columns)
            checkpoint = None
            if self.checkpoint_dir is not None and not incremental:
                checkpoint = self._checkpoint_spec(
                    X, target, sample_weight, world_size, device, policy, fingerprint
                )
            plan, steps, execution = plan_fit(
                self._fit_settings(),
                X,
                target,
                sample_weight,
                family,
                device,
                policy,
                world,
                n_train,
                incremental,
                self._previous_fit(incremental),
                reduction,
            )
            if checkpoint is not None:
                plan = dataclasses.replace(plan, checkpoint=checkpoint)
            result = backend.fit(plan, X, target, sample_weight)
        record_s_choice(plan, result, (n_train, self.n_features_in_), world_size, device, policy)
        self.__dict__.pop("_average_iterate", None)
        if plan.average:  # the last iterate's columns, then the average's (fit.BlockResult)
            k = result.coef.shape[1] // 2
            coef, intercept = plan.user_coefficients(result.coef[:, k:], result.intercept[k:])
            # What the next steps continue from (partial_fit, a warm start).
            self._average_iterate = plan.user_coefficients(result.coef[:, :k], result.intercept[:k])
        else:
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

    def _fit_settings(self) -> FitSettings:
        """The parameters that planning reads, as the engine takes them."""
        return FitSettings(
            alpha=float(self.alpha),
            l1_ratio=l1_share(self.penalty, self.l1_ratio),
            fit_intercept=bool(self.fit_intercept),
            s=self.s,
            batch_size=self.batch_size,
            solver=self.solver,
            average=self._average_start(),
            learning_rate=self.learning_rate,
            eta0=self.eta0,
            power_t=float(self.power_t),
            max_iter=int(self.max_iter),
            tol=None if self.tol is None else float(self.tol),
            n_iter_no_change=int(self.n_iter_no_change),
            shuffle=bool(self.shuffle),
            random_state=self.random_state,
            verbose=int(self.verbose),
            compile=self.compile,
            warm_start=bool(self.warm_start),
        )

    def _checkpoint_spec(self, X, target, sample_weight, world_size, device, policy, fingerprint):
        """Where ``fit`` checkpoints, and the checkpoint there it resumes (None: starts afresh).

        The identity a checkpoint must match: the estimator, the data (its
        fingerprint, after early stopping's split; ``fingerprint`` where it
        was taken already, for ColumnBlocks), the ranks, the device and
        precision, and every parameter that changes the steps (``max_iter``
        does not: a resumed fit may run longer).
        """
        if fingerprint is None:
            fingerprint = data_fingerprint(X, target, sample_weight)
        directory = os.fspath(self.checkpoint_dir)
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"checkpoint_dir={directory!r} exists and is not a directory.")
        if self.early_stopping and not isinstance(self.random_state, Integral):
            raise ValueError(
                "early_stopping with checkpoint_dir needs an int random_state: the held-out "
                "rows are drawn with it, and a resumed fit must hold out the same rows."
            )
        # Parameters that are not plain values (a RandomState, class_weight's
        # dict) by their type: the batch order is resumed from the checkpoint's
        # generator, and class weights are in the weights' fingerprint.
        parameters = {
            name: (
                repr(value) if isinstance(value, (Real, str, type(None))) else type(value).__name__
            )
            for name, value in self.get_params(deep=False).items()
            if name not in _NOT_IN_CHECKPOINT_IDENTITY
        }
        identity = {
            "estimator": type(self).__name__,
            "data": fingerprint.tolist(),
            "world_size": world_size,
            # The type: the ranks of a CUDA job each name their own GPU.
            "device": device.type,
            "precision": policy.name,
            **parameters,
        }
        return CheckpointSpec(
            directory, int(self.checkpoint_every), identity, resumable(directory, identity)
        )

    def _previous_fit(self, incremental: bool) -> PreviousFit | None:
        """The last fit's results that a warm start or ``partial_fit`` continues from."""
        if not hasattr(self, "coef_"):
            return None
        # Averaged, coef_ is the average: the steps go on from the last iterate.
        iterate = getattr(self, "_average_iterate", None)
        average = None if iterate is None else (dense_coef(self), self.intercept_)
        coef, intercept = (dense_coef(self), self.intercept_) if iterate is None else iterate
        if not (incremental and hasattr(self, "solver_state_")):
            return PreviousFit(coef, intercept)
        solver_state = self._validated_solver_state()  # names a state it cannot continue
        return PreviousFit(coef, intercept, self._step_plan, solver_state, average)

    def _average_start(self) -> int:
        """The rows after which averaged SGD's iterates count (``average``); 0: none."""
        return int(self.average)

    def _hold_out(self, X, target, sample_weight, stratify, score_weight):
        """The rows reordered: training rows first, then the held-out ones; and their count.

        As scikit-learn's SGD: a (stratified) shuffle split drawn with
        ``random_state``, each side in the rows' original order (with
        ``shuffle=False`` the epochs visit the training rows as given);
        held-out rows carry ``score_weight`` when given.
        """
        n_samples = X.shape[0]
        splitter_class = ShuffleSplit if stratify is None else StratifiedShuffleSplit
        splitter = splitter_class(
            test_size=self.validation_fraction, random_state=self.random_state
        )
        # The splitters raise a ValueError themselves when a side would be empty.
        train, held_out = (
            np.sort(rows) for rows in next(splitter.split(np.zeros((n_samples, 1)), stratify))
        )
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
