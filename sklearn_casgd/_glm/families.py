"""GLM families on the linear predictor (the "raw prediction").

Each family knows its per-sample loss, the derivative of that loss with
respect to the raw prediction, its curvature bound (for the default step
size), its valid target range and the intercept that fits an
intercept-only model. Losses and derivatives are torch functions so that
the engine can run them on any device; everything that touches the user's
targets before the fit is numpy.

Raw predictions always have shape ``(n, n_outputs)``; encoded targets have
the same shape (one-hot rows for the multinomial family, one column
otherwise), so the engine never switches on the family.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch
from scipy.special import logit, xlogy
from torch.nn import functional as F

# Raw predictions of the softplus are linear above this: exp(-50) is far
# below float64 resolution relative to 50.
_SOFTPLUS_THRESHOLD = 50.0
# The Triton kernels' codes of the losses they compute (Family.kernel_code).
KERNEL_BINOMIAL, KERNEL_SQUARED, KERNEL_TWEEDIE, KERNEL_MULTINOMIAL = 0, 1, 2, 3
# Probabilities are kept in [eps, 1 - eps] when an intercept start would
# otherwise be infinite (a class with zero total weight).
_PROBA_EPS = 1e-10


def _metrics():
    """scikit-learn's metrics, imported by the first score.

    A pool's workers import scikit-learn for nothing else: it is about 1 s
    of a worker's start.
    """
    import sklearn.metrics

    return sklearn.metrics


def _weighted_mean(target: np.ndarray, sample_weight: np.ndarray) -> np.ndarray:
    """Weighted mean of each target column, ``(n_outputs,)``, without an (n, k) temporary."""
    return (sample_weight @ target) / sample_weight.sum()


class Family(ABC):
    """A GLM family: loss on the raw prediction and what the solver needs."""

    #: Upper bound on the second derivative of the loss in the raw
    #: prediction, or ``None`` when it is unbounded.
    curvature: float | None
    #: Whether the loss depends on ``raw - target`` only: the targets less a
    #: constant, with the intercept started that much lower, are then the
    #: same problem (the estimator fits y less the intercept's start).
    shift_invariant: bool = False
    #: Whether the loss carries y's units: y * c scales its derivative by a
    #: power of c (least squares, Poisson; not labels, nor the gamma deviance,
    #: a function of y / mu). The stopping test is then relative to the cold
    #: start's gradient at any size, so that y's units do not change the fit.
    target_has_units: bool = False
    #: Whether one value added to every output's raw prediction leaves the
    #: loss unchanged (the multinomial's softmax): the Hessian is then
    #: singular along that shift (:mod:`.._engine.curvature` solves around it).
    class_shift_invariant: bool = False
    #: Whether the loss's second derivative is the same at every raw
    #: prediction (least squares): the curvature is then formed once a fit.
    constant_hessian: bool = False
    #: The Triton kernels' code for this loss (``FAMILY`` in
    #: :mod:`.._accel.triton_kernel`), or None where no kernel covers it.
    kernel_code: int | None = None
    #: The Tweedie power the kernels take with the code (0 elsewhere).
    kernel_power: float = 0.0
    #: Whether the targets are class labels (the classifiers' families).
    labels: bool = False
    #: ``c`` with ``|D^3 loss[u, u, u]| <= c ||u|| D^2 loss[u, u]`` in the raw
    #: prediction: the curvature along a move of length t stays within
    #: ``exp(+-c t)`` of where it started, which the gap certificate needs
    #: (:mod:`.._engine.certificate`). None where the loss is not convex in
    #: the raw prediction (no certificate).
    self_concordance: float | None = None

    def __eq__(self, other: object) -> bool:
        # Equal families share compiled kernels: equal means same class and parameters.
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def n_outputs(self, n_classes: int | None) -> int:
        """Number of columns of the raw prediction."""
        return 1

    def encode_target(self, y: np.ndarray, n_classes: int | None) -> np.ndarray:
        """Targets as the float ``(n, n_outputs)`` array the loss expects."""
        return np.asarray(y, dtype=np.float64).reshape(-1, 1)

    def check_target(self, y: np.ndarray, sample_weight: np.ndarray) -> None:  # noqa: B027
        """Raise ``ValueError`` when ``y`` is outside the family's range (none by default)."""

    @abstractmethod
    def loss(self, raw: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-sample loss ``(n,)``, up to the constant :meth:`loss_offset`."""

    @abstractmethod
    def gradient(self, raw: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Derivative of the loss in the raw prediction, ``(n, k)``."""

    @abstractmethod
    def hessian_diagonal(self, raw: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Second derivative of the loss in each raw column, ``(n, k)``, never negative.

        The diagonal of each row's ``k x k`` Hessian (the multinomial's
        off-diagonal ``-p_i p_j`` left out): the classes' own blocks of the
        curvature (:mod:`.._engine.curvature`), which precondition the coupled solve.
        """

    def hessian_product(
        self, raw: torch.Tensor, target: torch.Tensor
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``z -> H_i z`` row by row, ``H_i`` the ``k x k`` Hessian of row i's loss in ``raw``.

        For directions ``z`` of the raw predictions, ``(n, k)``; diagonal
        (:meth:`hessian_diagonal`) unless the outputs are coupled.
        """
        diagonal = self.hessian_diagonal(raw, target)
        return lambda direction: diagonal * direction

    def hessian_sums(
        self,
        raw: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor,
        gradient: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``sum_i omega_i H_i`` ``(k, k)`` and each row's ``omega_i trace(H_i)`` ``(n,)``.

        ``H_i`` is row i's ``k x k`` Hessian in its raw prediction: their
        weighted sum is the intercepts' curvature, the traces bound each
        row's largest eigenvalue. Diagonal unless the outputs are coupled.
        ``gradient`` (:meth:`gradient` at ``raw``, where the caller has it)
        spares recomputing what the curvature shares with it.
        """
        diagonal = self._curvature_from(raw, target, gradient)
        weighted = diagonal.mul_(weight[:, None])
        return torch.diag(weighted.sum(dim=0, dtype=torch.float64)), weighted.sum(dim=1)

    def _curvature_from(
        self, raw: torch.Tensor, target: torch.Tensor, gradient: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`hessian_diagonal` (a new tensor), from ``gradient`` where that is cheaper."""
        return self.hessian_diagonal(raw, target)

    def separated(self, raw: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Whether each row's raw prediction puts its label strictly ahead, ``(n,)``.

        Labels only (:attr:`labels`). Where every weighted row is separated,
        the classes are linearly separable: without a penalty the loss falls
        toward 0 as the coefficients grow, and no finite optimum exists.
        """
        raise NotImplementedError(f"{type(self).__name__}'s targets are not labels.")

    def loss_offset(self, target: np.ndarray, sample_weight: np.ndarray) -> float:
        """Weighted sum of the per-sample constants that :meth:`loss` leaves out.

        The inner steps skip terms that depend on the target only (they do
        not move the gradient); they are added back once per epoch.
        """
        return 0.0

    @abstractmethod
    def intercept_start(self, target: np.ndarray, sample_weight: np.ndarray) -> np.ndarray:
        """Intercept of the best intercept-only model, shape ``(n_outputs,)``."""

    def step_curvature(self, target: np.ndarray, sample_weight: np.ndarray) -> float:
        """Curvature scale used by the default step size."""
        assert self.curvature is not None
        return self.curvature

    @abstractmethod
    def score(self, raw: np.ndarray, target: np.ndarray, sample_weight: np.ndarray) -> float:
        """The estimator's ``score`` from raw predictions (early stopping's held-out score)."""


class BinomialFamily(Family):
    """Binary logistic regression, targets in {0, 1}; loss is the log loss."""

    curvature = 0.25
    kernel_code = KERNEL_BINOMIAL
    labels = True
    # p (1 - p) (1 - 2 p) is at most p (1 - p) in absolute value.
    self_concordance = 1.0

    def loss(self, raw, target):
        return (F.softplus(raw, threshold=_SOFTPLUS_THRESHOLD) - target * raw)[:, 0]

    def gradient(self, raw, target):
        return torch.sigmoid(raw) - target

    def hessian_diagonal(self, raw, target):
        p = torch.sigmoid(raw)
        return p * (1 - p)

    def _curvature_from(self, raw, target, gradient):
        if gradient is None:
            return self.hessian_diagonal(raw, target)
        p = gradient + target
        return p.mul_(1 - p)

    def separated(self, raw, target):
        z = raw[:, 0]
        return torch.where(target[:, 0] > 0.5, z > 0, z < 0)

    def intercept_start(self, target, sample_weight):
        p = _weighted_mean(target, sample_weight)
        return logit(np.clip(p, _PROBA_EPS, 1 - _PROBA_EPS))

    def score(self, raw, target, sample_weight):
        return float(
            _metrics().accuracy_score(target[:, 0], raw[:, 0] > 0, sample_weight=sample_weight)
        )


class MultinomialFamily(Family):
    """Multinomial logistic regression with one raw column per class."""

    curvature = 0.5
    class_shift_invariant = True
    kernel_code = KERNEL_MULTINOMIAL
    labels = True
    # A move u of the raw predictions changes each p_k by at most exp(+-range(u)),
    # and range(u) <= sqrt(2) ||u||.
    self_concordance = math.sqrt(2.0)

    def n_outputs(self, n_classes):
        return int(n_classes)

    def encode_target(self, y, n_classes):
        onehot = np.zeros((y.shape[0], n_classes))
        onehot[np.arange(y.shape[0]), np.asarray(y, dtype=np.intp)] = 1.0
        return onehot

    def loss(self, raw, target):
        return torch.logsumexp(raw, dim=1) - (raw * target).sum(dim=1)

    def gradient(self, raw, target):
        return torch.softmax(raw, dim=1) - target

    def hessian_diagonal(self, raw, target):
        p = torch.softmax(raw, dim=1)
        return p * (1 - p)

    def hessian_sums(self, raw, target, weight, gradient=None):
        p = torch.softmax(raw, dim=1) if gradient is None else gradient + target
        weighted = p * weight[:, None]
        sums = torch.diag(weighted.sum(dim=0, dtype=torch.float64))
        sums -= (weighted.T @ p).to(torch.float64)
        return sums, (1.0 - p.square().sum(dim=1)).mul_(weight)

    def hessian_product(self, raw, target):
        # (diag(p) - p p^T) z, without the k x k matrices.
        p = torch.softmax(raw, dim=1)
        return lambda direction: p * (direction - (p * direction).sum(dim=1, keepdim=True))

    def separated(self, raw, target):
        labelled = (raw * target).sum(dim=1)
        others = raw.masked_fill(target > 0.5, -math.inf).amax(dim=1)
        return labelled > others

    def intercept_start(self, target, sample_weight):
        p = np.clip(_weighted_mean(target, sample_weight), _PROBA_EPS, 1)
        log_p = np.log(p)
        return log_p - log_p.mean()

    def score(self, raw, target, sample_weight):
        return float(
            _metrics().accuracy_score(
                target.argmax(axis=1), raw.argmax(axis=1), sample_weight=sample_weight
            )
        )


class SquaredErrorFamily(Family):
    """Least squares; the per-sample loss is half the squared error."""

    curvature = 1.0
    constant_hessian = True
    shift_invariant = True
    target_has_units = True
    kernel_code = KERNEL_SQUARED
    self_concordance = 0.0

    def loss(self, raw, target):
        return 0.5 * (raw - target)[:, 0].square()

    def gradient(self, raw, target):
        return raw - target

    def hessian_diagonal(self, raw, target):
        return torch.ones_like(raw)

    def intercept_start(self, target, sample_weight):
        return _weighted_mean(target, sample_weight)

    def score(self, raw, target, sample_weight):
        return float(_metrics().r2_score(target[:, 0], raw[:, 0], sample_weight=sample_weight))


class TweedieFamily(Family):
    """Tweedie deviance with log link; the loss is half the deviance (scikit-learn's).

    ``power`` 0 is the normal distribution (with a log link), 1 Poisson, in
    (1, 2) compound Poisson-gamma, 2 gamma, 3 inverse Gaussian; powers in
    (0, 1) have no distribution. With ``mu = exp(raw)`` the half deviance is

        y^(2-p) / ((1-p)(2-p)) - y mu^(1-p) / (1-p) + mu^(2-p) / (2-p)

    (limits at p = 1 and 2), of which :meth:`loss` keeps the terms in
    ``raw``; its derivative is ``mu^(2-p) - y mu^(1-p)``. The curvature
    ``(2-p) mu^(2-p) - (1-p) y mu^(1-p)`` is unbounded; the default step
    size uses its mean at the intercept-only start, ``ybar^(2-p)`` (the
    weighted mean target for Poisson, 1 for gamma).
    """

    curvature = None
    kernel_code = KERNEL_TWEEDIE

    @property
    def kernel_power(self) -> float:
        return self.power

    def __init__(self, power: float) -> None:
        power = float(power)
        if 0 < power < 1:
            raise ValueError(f"Tweedie power must be <= 0 or >= 1, got {power}.")
        self.power = power

    @property
    def self_concordance(self) -> float | None:
        # For 1 <= p <= 2 the curvature (2-p) mu^(2-p) + (p-1) y mu^(1-p) is a
        # sum of exp((2-p) z) and exp((1-p) z) with non-negative weights; other
        # powers' loss is not convex in the raw prediction.
        if 1.0 <= self.power <= 2.0:
            return max(2.0 - self.power, self.power - 1.0)
        return None

    @property
    def target_has_units(self) -> bool:
        # The derivative scales by c^(2 - power): gamma's alone is unitless.
        return self.power != 2

    def check_target(self, y, sample_weight):
        power = self.power
        if power >= 2 and np.any(y <= 0):
            raise ValueError(
                f"Some value(s) of y are not strictly positive, which is not allowed for "
                f"Tweedie power={power:g} (gamma-like: y > 0)."
            )
        if 1 <= power < 2 and np.any(y < 0):
            raise ValueError(
                f"Some value(s) of y are negative, which is not allowed for Tweedie "
                f"power={power:g} (Poisson-like: y >= 0)."
            )
        if not (sample_weight @ y) > 0:
            raise ValueError(
                "The weighted mean of y must be positive for a log link: its log is "
                "the intercept-only start."
            )

    def loss(self, raw, target):
        raw, y = raw[:, 0], target[:, 0]
        power = self.power
        if power == 1:
            return torch.exp(raw) - y * raw
        if power == 2:
            return raw + y * torch.exp(-raw)
        return torch.exp((2 - power) * raw) / (2 - power) - y * torch.exp((1 - power) * raw) / (
            1 - power
        )

    def gradient(self, raw, target):
        power = self.power
        if power == 1:
            return torch.exp(raw) - target
        if power == 2:
            return 1 - target * torch.exp(-raw)
        return torch.exp((2 - power) * raw) - target * torch.exp((1 - power) * raw)

    def _curvature_from(self, raw, target, gradient):
        # exp(raw) = gradient + y for Poisson, y exp(-raw) = 1 - gradient for gamma
        # (to the rounding of the larger term; never below 0).
        if gradient is not None and self.power == 1:
            return (gradient + target).clamp_(min=0.0)
        if gradient is not None and self.power == 2:
            return (1 - gradient).clamp_(min=0.0)
        return self.hessian_diagonal(raw, target)

    def hessian_diagonal(self, raw, target):
        power = self.power
        if power == 1:
            return torch.exp(raw)
        if power == 2:
            return target * torch.exp(-raw)
        # Negative where y is far above mu for power > 2 (and below it for
        # power < 1): the curvature bound of the preconditioner stays >= 0.
        curvature = (2 - power) * torch.exp((2 - power) * raw) - (1 - power) * target * torch.exp(
            (1 - power) * raw
        )
        return curvature.clamp_(min=0.0)

    def loss_offset(self, target, sample_weight):
        y = target[:, 0]
        power = self.power
        if power == 1:
            constant = xlogy(y, y) - y
        elif power == 2:
            constant = -np.log(y) - 1.0
        else:
            constant = np.power(y, 2 - power) / ((1 - power) * (2 - power))
        return float(constant @ sample_weight)

    def intercept_start(self, target, sample_weight):
        return np.log(_weighted_mean(target, sample_weight))

    def step_curvature(self, target, sample_weight):
        return float(_weighted_mean(target, sample_weight)[0] ** (2 - self.power))

    def score(self, raw, target, sample_weight):
        return float(
            _metrics().d2_tweedie_score(
                target[:, 0], np.exp(raw[:, 0]), sample_weight=sample_weight, power=self.power
            )
        )


class PoissonFamily(TweedieFamily):
    """Poisson regression with log link: Tweedie power 1, the loss half the Poisson deviance.

    The default step size uses the weighted mean target as its curvature
    scale: that is the curvature of the intercept-only start and, at the
    optimum, the mean curvature over the data. (The largest target is safe
    but converged up to 18 % short of the exact solver in max_iter epochs
    on counts with a heavy tail.)
    """

    def __init__(self) -> None:
        super().__init__(power=1.0)

    def check_target(self, y, sample_weight):
        if np.any(y < 0):
            raise ValueError(
                "Some value(s) of y are negative, which is not allowed for "
                "Poisson regression (counts must be >= 0)."
            )
        if not np.any(sample_weight * y > 0):
            raise ValueError(
                "The weighted sum of y is zero; Poisson regression needs "
                "sum(sample_weight * y) > 0."
            )


class GammaFamily(TweedieFamily):
    """Gamma regression with log link: Tweedie power 2, the loss half the gamma deviance."""

    def __init__(self) -> None:
        super().__init__(power=2.0)
