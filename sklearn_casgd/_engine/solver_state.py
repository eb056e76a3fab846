"""What the epoch loop is given and gives back: settings, step schedule, state, result.

A :class:`SolverState` is where the loop stands between epochs; a fit
started from it continues exactly (``partial_fit``, a resumed checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

SOLVERS = ("svrg", "sgd")

LEARNING_RATES = ("adaptive", "constant", "invscaling")

# "adaptive" divides the step by this factor on every plateau ...
_ADAPTIVE_FACTOR = 5.0

# ... and stops once it has fallen below this fraction of eta0.
_ADAPTIVE_MIN_RATIO = 1e-4

# SVRG lengthens its step by this factor after an epoch that lowered the
# objective beyond rounding and shrank the gradient: the curvature bound
# behind eta0 is loose once the fit nears the optimum (on scikit-learn's real
# datasets 1.5 reached the optimum in 5-10x fewer epochs than a fixed step).
SVRG_GROWTH = 1.5


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
    # The stopping test's bound at tol = 1 where an earlier run of the same fit
    # measured it (a polish, .polish); None: measured at the start.
    gradient_unit: float | None = None
    # A float64 polish certifies the gap where this loop's precision stops
    # short of it (.polish): the loop hands over once its bound stalls.
    hands_over: bool = False
    # Epochs of the same fit before this loop (a polish's): the progress bar counts on.
    epochs_before: int = 0


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
    # average: iterates summed into the running average, and rows stepped on
    # (average.RunningAverage; the sum itself travels with the weights).
    average_count: int = 0
    average_samples: int = 0

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
        # States from before averaging have no average counts: none were kept.
        state = {"average_count": 0, "average_samples": 0, **state}
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
_STATE_COUNTS = (
    "steps",
    "epochs",
    "no_improvement",
    "no_progress",
    "no_score_improvement",
    "average_count",
    "average_samples",
)

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
    gradient_bound: float | None = None  # the gradient test: gradient_max <= this (scaled tol)
    # The certificate's bound on the relative gap at the end, and the gap tol
    # names (.solver.GAP_PER_TOL); None: no certificate (the gradient test decides).
    gap_bound: float | None = None
    gap_target: float | None = None
    separated: bool = False  # labels without a penalty, all strictly separated: no optimum
    gradient_unit: float = 1.0  # the gradient test's bound at tol = 1
    polished: int = 0  # of n_iter, the float64 Newton epochs that finished the fit (.polish)
    resumed_epochs: int = 0  # of n_iter, the epochs a resumed checkpoint had run
    final_eta: float | None = None
    failure: str | None = None
    stalled: bool = False  # SVRG stopped: no step lowered the objective beyond rounding
    state: SolverState = field(default_factory=SolverState)  # where the loop ended
    validation_scores: list[float] | None = None  # the held-out score after each epoch
    stopped_early: bool = False  # the held-out score stopped improving
