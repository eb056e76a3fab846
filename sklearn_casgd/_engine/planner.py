"""How a fit runs: the batch size and s, chosen together by predicted time to the optimum.

A fit's time is its epochs times the time of an epoch. The epoch time of
batch size b and s steps per outer iteration comes from the cost model of
:mod:`.cost` priced by the device type's :class:`.cost.DeviceProfile`
(a fixed profile: the same data gets the same plan in every process). The
epochs SVRG needs to reach ``tol`` come from :func:`predict_epochs`:

    epochs(b) = floor + variance * R / (R + b) + steps * b / n,

with ``R = L_max / L`` the ratio of the largest row's smoothness to the
whole loss's (:mod:`.stepsize`). The middle term is the share of the
minibatch's expected smoothness ``L(b) = L + (L_max - L) (n - b) / (b (n -
1))`` that comes from sampling (``R / (R + b)`` for ``n >> b``): a small
batch's steps are short and noisy and SVRG's epochs make less progress.
The last term counts steps: an epoch of ``n / b`` large steps is a few
steps of gradient descent, and ill-conditioned data needs many of them.
The constants were fitted to SVRG fits of scikit-learn's and statsmodels'
datasets and of Gaussian problems over a range of batch sizes
(``docs/benchmarks.md``, "Choosing the batch size").

With dense rows the planner also weighs Newton epochs
(:mod:`.curvature`): full-batch steps preconditioned by the curvature at
the snapshot, each a full pass plus forming and factoring ``k`` systems of
``d + 1`` unknowns (and, for several classes, the conjugate gradients that
solve their coupling), on many rows from a sample of them
(:func:`curvature_sample`). They take a few epochs whatever the
conditioning (:data:`NEWTON_EPOCHS`), and win where an epoch is cheap and
minibatch SVRG needs many: small or narrow data, and many rows of up to a
few hundred columns. On several ranks the pass is split over their column
blocks and the curvature's sums over the ranks (each factors the whole).

The plan is made where the data is whole, before the ranks start: the step
size depends on b. On several ranks b is chosen for the ranks' column
blocks without the collectives' costs, and s is left to the ranks, which
time their collectives (:func:`.fit._choose_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._glm.families import Family
from .cost import (
    CANDIDATES,
    MAX_OUTER_SHARE,
    PROFILES,
    DeviceProfile,
    FitShape,
    predict_epoch_seconds,
)

# epochs(b) = FLOOR + VARIANCE * R / (R + b) + STEPS * b / n (see the module docstring).
EPOCHS_FLOOR = 0.8
EPOCHS_VARIANCE = 69.0
EPOCHS_STEPS = 146.0
# Sparse rows of rare columns, which SVRG keeps unpreconditioned (text): the
# words' tiny curvatures take about this many steps whatever the batch, so
# large batches take many epochs (100,000 x 30,000 TF-IDF, alpha 1e-5: 170
# epochs at b = 1024, where the dense constant predicted 2.4; docs/tuning.md).
EPOCHS_STEPS_RARE_COLUMNS = 16_000.0
# The log-link regressors (Poisson, gamma, Tweedie) take more minibatch epochs
# than the model, fitted mostly to labels, predicts: SVRG's step overshoots on
# the exponential link and epochs are undone (docs/tuning.md).
EPOCHS_LOG_LINK = 1.8
# Batch sizes batch_size="auto" weighs: powers of two that leave an epoch at
# least this many steps. The step term of predict_epochs varies 100-fold
# between datasets (on ill-conditioned data an epoch of a few large steps
# gets little done) and the model takes a typical one: with too few steps
# an epoch, an ill-conditioned fit can run out of max_iter.
MIN_STEPS_PER_EPOCH = 16
# ... and at least this many rows (all of them below): single rows' steps
# are noisy enough in float32 that SVRG stalled at the rounding floor on
# 20 rows of Poisson counts (linnerud), short of tol, at 1, 2 and 4 rows.
SMALLEST_BATCH = 8
LARGEST_BATCH = 1 << 16
# SVRG on sparse rows in the epoch kernel (one CPU process, numba) takes the
# smallest batch: SVRG's epochs to the optimum grow with the minibatch's
# expected smoothness, L_max + (b - 1) L over n, and the kernel's fixed cost
# of a step is below its rows' from a few rows on (docs/tuning.md, "Sparse
# rows").
SPARSE_KERNEL_REASON = "sparse rows in the epoch kernel: the smallest batch"
# An L1 part's proximal step is not linear: it cannot unroll into the
# s-step recurrence, so it follows every step and s is 1.
PROXIMAL_S_REASON = "; s=1: the L1 penalty's proximal step follows every step"
# Plain SGD (solver="sgd") settles at a noise floor that the batch moves; no
# model of its epochs is fitted: "auto" keeps the batch of the CA-SGD paper.
SGD_BATCH = 32
# Newton epochs to tol from the intercept-only start (docs/tuning.md). A loss
# of bounded curvature (labels) grows linearly far from the optimum, where
# Newton's steps are damped, so it takes more than a log link; least squares
# (a constant Hessian) takes one. The widest block weighed has
# MAX_NEWTON_WIDTH columns.
NEWTON_EPOCHS = 5.0
NEWTON_EPOCHS_BOUNDED_CURVATURE = 6.0
MAX_NEWTON_WIDTH = 1024
# Newton epochs on many rows are also weighed with the curvature formed from
# a sample of them spread evenly over X (curvature.sampled_rows): at least
# CURVATURE_MIN_ROWS rows and CURVATURE_ROWS_PER_UNKNOWN per unknown of a
# system, where that is at most half of the rows. The sample's curvature
# steers less well: the epochs grow by a factor 1 + c sqrt(unknowns / rows),
# c = SAMPLED_CURVATURE_EPOCHS, or SAMPLED_CURVATURE_EPOCHS_LOG_LINK for the
# log link's heavier-tailed curvature (docs/tuning.md).
CURVATURE_MIN_ROWS = 8192
CURVATURE_ROWS_PER_UNKNOWN = 32
SAMPLED_CURVATURE_EPOCHS = 1.0
SAMPLED_CURVATURE_EPOCHS_LOG_LINK = 6.0
# Newton epochs on sparse rows (one rank) solve each step by conjugate
# gradients on the curvature's products, never formed; an epoch takes
# this many products on average over a fit, each reading the rows twice
# (docs/tuning.md, "Sparse rows").
SPARSE_NEWTON_PRODUCTS = 2.5
# Whether a fit that may run Newton epochs takes them: None weighs them
# against the minibatch steps by predicted time; True or False (tests,
# benchmarks) forces the choice.
NEWTON: bool | None = None


@dataclass(frozen=True)
class Candidate:
    """One batch size weighed: its best s and the predicted epochs and seconds."""

    batch_size: int
    s: int
    epochs: float
    epoch_seconds: float

    @property
    def seconds(self) -> float:
        return self.epochs * self.epoch_seconds


@dataclass(frozen=True)
class ExecutionPlan:
    """The batch size and s of a fit, and why (``fit_stats_["plan"]``).

    ``s`` is None where the ranks choose it (``s="auto"`` on several ranks).
    ``chosen`` is the candidate taken, ``candidates`` every one weighed
    (empty where nothing was chosen: the user's batch size and s).
    """

    batch_size: int
    s: int | None
    reason: str
    chosen: Candidate | None = None
    candidates: tuple[Candidate, ...] = ()
    s_predictions: dict[int, float] | None = None  # epoch seconds per s at the chosen b
    smoothness_ratio: float | None = None  # L_max / L, where it was measured
    # Newton epochs (curvature) chosen: the fit's batch is every row, and
    # batch_size is the minibatch that a later partial_fit continues with.
    newton: bool = False
    newton_candidate: Candidate | None = None  # Newton epochs as weighed, where they were
    # The rows the Newton candidate forms its curvature from, where a sample of
    # them was weighed faster than every row (None: every row, or not weighed).
    curvature_rows: int | None = None

    @property
    def chosen_by_planner(self) -> bool:
        """Whether the planner chose the batch size: :meth:`report` then says how."""
        return self.chosen is not None or self.reason == SPARSE_KERNEL_REASON

    def report(self) -> dict:
        """The plan as plain values, for ``fit_stats_``."""
        chosen = self.chosen
        newton = self.newton_candidate
        return {
            "reason": self.reason,
            "newton": self.newton,
            "smoothness_ratio": self.smoothness_ratio,
            "predicted_epochs": None if chosen is None else round(chosen.epochs, 2),
            "predicted_epoch_seconds": None if chosen is None else chosen.epoch_seconds,
            "predicted_seconds": None if chosen is None else chosen.seconds,
            "candidates": {
                c.batch_size: {"s": c.s, "epochs": round(c.epochs, 2), "seconds": c.seconds}
                for c in self.candidates
            },
            "newton_candidate": None
            if newton is None
            else {"epochs": round(newton.epochs, 2), "seconds": newton.seconds},
            "curvature_rows": self.curvature_rows,
        }


def predict_epochs(
    batch_size: int,
    n_samples: int,
    smoothness_ratio: float,
    family: Family | None = None,
    rare_columns: bool = False,
) -> float:
    """SVRG's predicted epochs to ``tol`` with batches of ``batch_size`` rows.

    ``smoothness_ratio`` is ``L_max / L`` (at least 1); a log-link
    ``family`` takes :data:`EPOCHS_LOG_LINK` times more; sparse rows of
    ``rare_columns`` (kept as they are, not preconditioned) count
    :data:`EPOCHS_STEPS_RARE_COLUMNS` steps.
    """
    ratio = max(smoothness_ratio, 1.0)
    b = min(batch_size, n_samples)
    steps = EPOCHS_STEPS_RARE_COLUMNS if rare_columns else EPOCHS_STEPS
    epochs = EPOCHS_FLOOR + EPOCHS_VARIANCE * ratio / (ratio + b) + steps * b / max(n_samples, 1)
    return epochs * EPOCHS_LOG_LINK if _log_link(family) else epochs


def _log_link(family: Family | None) -> bool:
    """Poisson, gamma, Tweedie: unbounded curvature that is not constant."""
    return family is not None and family.curvature is None and not family.constant_hessian


def batch_candidates(n_samples: int) -> list[int]:
    """Powers of two from :data:`SMALLEST_BATCH` (or n) that leave an epoch enough steps.

    At least :data:`MIN_STEPS_PER_EPOCH` steps, except the smallest size.
    """
    largest = min(n_samples // MIN_STEPS_PER_EPOCH, LARGEST_BATCH)
    sizes = [max(1, min(SMALLEST_BATCH, n_samples))]
    while sizes[-1] * 2 <= largest:
        sizes.append(sizes[-1] * 2)
    return sizes


def s_candidates(n_samples: int, batch_size: int) -> list[int]:
    """The s weighed at this batch size: an outer iteration takes at most 1/64 of the rows."""
    return [s for s in CANDIDATES if s == 1 or s * batch_size <= n_samples * MAX_OUTER_SHARE]


def newton_epochs(
    family: Family | None, n_outputs: int, width: float, curvature_rows: int | None = None
) -> float:
    """The Newton epochs a fit of ``family`` is predicted to take (None: labels').

    ``curvature_rows``: the curvature is formed from that many rows (None: all).
    """
    if family is not None and family.constant_hessian:
        epochs = 1.0
    else:
        epochs = NEWTON_EPOCHS if _log_link(family) else NEWTON_EPOCHS_BOUNDED_CURVATURE
    if curvature_rows is None:
        return epochs
    growth = SAMPLED_CURVATURE_EPOCHS_LOG_LINK if _log_link(family) else SAMPLED_CURVATURE_EPOCHS
    unknowns = _system_unknowns(n_outputs, width)
    return epochs * (1.0 + growth * math.sqrt(unknowns / curvature_rows))


def _system_unknowns(n_outputs: int, width: float) -> float:
    """Unknowns of the system a Newton epoch solves: every class's coefficients."""
    return (width + 1) * n_outputs


def curvature_sample(
    n_samples: int, n_outputs: int, width: float, family: Family | None = None
) -> int | None:
    """The rows of the sampled curvature weighed for Newton epochs (None: none weighed).

    None where the rows are too few, or the Hessian is constant (formed
    once a fit, where a sample's steps would take several epochs).
    """
    if family is not None and family.constant_hessian:
        return None
    unknowns = _system_unknowns(n_outputs, width)
    rows = max(CURVATURE_MIN_ROWS, math.ceil(CURVATURE_ROWS_PER_UNKNOWN * unknowns))
    return rows if 2 * rows <= n_samples else None


def _newton_candidate(
    profile: DeviceProfile,
    n_samples: int,
    width: float,
    n_features: float,
    n_outputs: int,
    family: Family | None,
    curvature_rows: int | None,
    ranks: int = 1,
) -> Candidate:
    """Newton epochs as weighed: each a full pass, and a curvature formed (once, if constant).

    The pass reads a rank's ``width`` columns; each of ``ranks`` sums its
    share of the curvature of all ``n_features`` (``.curvature``).
    """
    epochs = newton_epochs(family, n_outputs, n_features, curvature_rows)
    rows = curvature_rows or n_samples
    formation = profile.newton_seconds(rows, n_features, n_outputs, ranks)
    formations = 1.0 if family is not None and family.constant_hessian else epochs
    epoch_seconds = (
        profile.pass_seconds(n_samples, width, n_outputs) + formation * formations / epochs
    )
    return Candidate(n_samples, 1, epochs, epoch_seconds)


def _sparse_newton_candidate(
    profile: DeviceProfile, n_samples: int, width: float, n_outputs: int, family: Family | None
) -> Candidate:
    """Newton epochs on sparse rows as weighed: a pass, the diagonal, the products.

    ``width`` is the stored values per row. Each epoch reads the rows for
    its pass and for the curvature's diagonal, then twice per product
    (:data:`SPARSE_NEWTON_PRODUCTS`); a constant Hessian still takes them,
    the solve being inexact.
    """
    epochs = NEWTON_EPOCHS if _log_link(family) else NEWTON_EPOCHS_BOUNDED_CURVATURE
    reads = 2.0 + 2.0 * SPARSE_NEWTON_PRODUCTS
    epoch_seconds = reads * profile.sparse_pass_seconds(n_samples, width, n_outputs)
    return Candidate(n_samples, 1, epochs, epoch_seconds)


def _takes_newton(newton: Candidate, minibatch: Candidate) -> bool:
    """Whether the fit takes Newton epochs over the minibatch steps (:data:`NEWTON`)."""
    return newton.seconds < minibatch.seconds if NEWTON is None else NEWTON


def _newton_plan(
    batch_size: int,
    newton: Candidate,
    minibatch: tuple[Candidate, ...],
    smoothness_ratio: float | None,
    curvature_rows: int | None,
) -> ExecutionPlan:
    """The plan of Newton epochs, weighed faster than the ``minibatch`` candidates."""
    return ExecutionPlan(
        batch_size,
        1,
        "Newton epochs (full-batch steps preconditioned by the curvature): the "
        "shortest predicted time to the optimum",
        newton,
        minibatch,
        None,
        smoothness_ratio,
        newton=True,
        newton_candidate=newton,
        curvature_rows=curvature_rows,
    )


def plan_execution(
    *,
    n_samples: int,
    width: float,
    n_outputs: int,
    smoothness_ratio: float | None,
    batch_size: int | str,
    s: int | str,
    solver: str,
    device_type: str,
    world_size: int,
    sparse: bool,
    epoch_kernel: bool = False,
    newton_allowed: bool = False,
    family: Family | None = None,
    n_features: float | None = None,
    proximal: bool = False,
    rare_columns: bool = False,
) -> ExecutionPlan:
    """Choose the batch size and s of a fit; the user's values are kept.

    ``width`` is the columns of the widest rank's block (stored values per
    row for a sparse X); ``smoothness_ratio`` is ``L_max / L`` (None where
    it was not measured: then ``batch_size`` is not "auto", or the solver
    is plain SGD). Sparse rows take s = 1 on one rank; on several the
    ranks time s themselves (their s > 1 steps run from a Gram of sparse
    rows, which the profile does not price). ``newton_allowed``:
    the fit may run Newton epochs (dense rows, SVRG with every
    step setting at its default); they are taken where predicted faster,
    in as many epochs as :func:`newton_epochs` says for ``family``, on
    the system of all ``n_features`` columns (None: ``width``, one rank's).
    ``epoch_kernel``: sparse rows whose steps run in the epoch kernel
    (:data:`SPARSE_KERNEL_REASON`). ``proximal``: the penalty has an L1
    part, whose proximal step follows every step, so s is 1 whatever was
    asked (:data:`PROXIMAL_S_REASON`; in exact arithmetic s changes no
    iterate, so only the time differs). ``rare_columns``: sparse rows kept
    as they are (:func:`predict_epochs`).
    """
    profile = PROFILES.get(device_type, PROFILES["cuda"])
    fixed_s = None if s == "auto" else int(s)
    if proximal:
        fixed_s = 1
    # s="auto": the profile does not price the sparse Gram. One rank takes s=1
    # (s > 1 only adds the Gram there); several time their outer iterations
    # (.fit._time_sparse_s).
    if sparse and fixed_s is None and world_size == 1:
        fixed_s = 1
    ranks_choose_s = fixed_s is None and world_size > 1

    def best_s(b: int) -> tuple[int, dict[int, float]]:
        local = profile.local_costs(b, width, n_outputs, sparse)
        every_s = frozenset(CANDIDATES)
        shape = FitShape(n_samples, b, math.ceil(width), n_outputs, row_step_s=every_s)
        options = [fixed_s] if fixed_s is not None else s_candidates(n_samples, b)
        predictions = {c: predict_epoch_seconds(c, shape, local, None) for c in options}
        return min(predictions, key=lambda c: (predictions[c], c)), predictions

    pass_seconds = profile.pass_seconds(n_samples, width, n_outputs)

    def candidate(b: int) -> tuple[Candidate, dict[int, float]]:
        chosen_s, predictions = best_s(b)
        epochs = predict_epochs(b, n_samples, smoothness_ratio or 1.0, family, rare_columns)
        return Candidate(b, chosen_s, epochs, predictions[chosen_s] + pass_seconds), predictions

    if batch_size != "auto":
        b = max(1, min(int(batch_size), n_samples))
        if fixed_s is not None or ranks_choose_s:
            given = "batch_size as given" + PROXIMAL_S_REASON if proximal else None
            return ExecutionPlan(b, fixed_s, given or "batch_size and s as given")
        chosen, predictions = candidate(b)
        reason = "batch_size as given; s with the shortest predicted epoch"
        return ExecutionPlan(b, chosen.s, reason, chosen, (chosen,), predictions)
    if solver != "svrg":
        b = min(SGD_BATCH, n_samples)
        chosen_s = fixed_s if fixed_s is not None or ranks_choose_s else best_s(b)[0]
        reason = f"plain SGD: batch_size {SGD_BATCH}, as the paper's"
        return ExecutionPlan(b, chosen_s, reason + (PROXIMAL_S_REASON if proximal else ""))
    sparse_newton = None
    if sparse and newton_allowed and world_size == 1:
        sparse_newton = _sparse_newton_candidate(profile, n_samples, width, n_outputs, family)
    if sparse and epoch_kernel:
        b = min(SMALLEST_BATCH, n_samples)
        chosen_s = fixed_s if fixed_s is not None or ranks_choose_s else 1
        kernel = Candidate(
            b,
            1,
            predict_epochs(b, n_samples, smoothness_ratio or 1.0, family, rare_columns),
            profile.sparse_kernel_seconds(n_samples, width, n_outputs)
            + profile.sparse_pass_seconds(n_samples, width, n_outputs),
        )
        if sparse_newton is not None and _takes_newton(sparse_newton, kernel):
            return _newton_plan(b, sparse_newton, (kernel,), smoothness_ratio, None)
        return ExecutionPlan(
            b,
            chosen_s,
            SPARSE_KERNEL_REASON,
            kernel,
            (kernel,),
            smoothness_ratio=smoothness_ratio,
            newton_candidate=sparse_newton,
        )
    weighed = [candidate(b) for b in batch_candidates(n_samples)]
    chosen, predictions = min(weighed, key=lambda pair: (pair[0].seconds, pair[0].batch_size))
    reason = "the batch size and s with the shortest predicted time to the optimum"
    if proximal:
        reason = "the batch size with the shortest predicted time to the optimum"
        reason += PROXIMAL_S_REASON
    newton = curvature_rows = None
    n_features = width if n_features is None else n_features
    if sparse_newton is not None and _takes_newton(sparse_newton, chosen):
        return _newton_plan(
            chosen.batch_size, sparse_newton, tuple(c for c, _ in weighed), smoothness_ratio, None
        )
    if newton_allowed and not sparse and n_features < MAX_NEWTON_WIDTH:
        sample = curvature_sample(n_samples, n_outputs, n_features, family)
        weighed_newton = {
            rows: _newton_candidate(
                profile, n_samples, width, n_features, n_outputs, family, rows, world_size
            )
            for rows in ([None] if sample is None else [None, sample])
        }
        curvature_rows = min(weighed_newton, key=lambda rows: weighed_newton[rows].seconds)
        newton = weighed_newton[curvature_rows]
        if _takes_newton(newton, chosen):
            return _newton_plan(
                chosen.batch_size,
                newton,
                tuple(c for c, _ in weighed),
                smoothness_ratio,
                curvature_rows,
            )
    if ranks_choose_s:
        reason += " (s left to the ranks, which time their collectives)"
    return ExecutionPlan(
        chosen.batch_size,
        None if ranks_choose_s else chosen.s,
        reason,
        chosen,
        tuple(c for c, _ in weighed),
        None if ranks_choose_s or fixed_s is not None else predictions,
        smoothness_ratio,
        newton_candidate=newton or sparse_newton,
        curvature_rows=curvature_rows,
    )
