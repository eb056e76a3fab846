"""A certificate of optimality: an upper bound on the objective's gap, from one full pass.

The objective ``F(w, b) = L(X w + b) + l1 ||w||_1 + l2 / 2 ||w||^2`` (``L``
the mean weighted loss) is ``l2``-strongly convex in ``w`` wherever
``l2 > 0``, but not in the unpenalized intercept ``b``. With
``h(w) = min_b F(w, b)`` (the intercept profiled out, still ``l2``-strongly
convex in ``w``) the gap splits in two:

    F(w, b) - F* = [F(w, b) - h(w)] + [h(w) - h*],
    h(w) - h* <= ||g_h||^2 / (2 l2),   g_h any subgradient of h at w,

the second the strong-convexity bound, which for L2 is exactly the duality
gap at the dual point the residuals give. ``g_h`` is the subgradient in
``w`` at the intercept ``b + delta*`` that minimizes ``F(w, .)``; one pass
only measures the point ``b``, so ``delta*`` and the change of the
gradient are bounded from the pass's sums:

* the loss's curvature stays within ``exp(+-c t)`` of its value along a
  move of length ``t`` of the raw predictions (``Family.self_concordance``),
  so the intercepts' curvature ``H`` (on the classes' differences, for
  the multinomial, whose softmax ignores a common shift) keeps
  ``|delta*| <= T = -log(1 - c |g_b| / mu) / c`` (``mu`` its smallest
  eigenvalue, ``g_b`` the intercepts' gradient), and
  ``F(w, b) - h(w) <= |g_b| T`` (convexity);
* the residuals move by at most ``lambda_i (exp(c T) - 1) / c`` a row
  (``lambda_i`` the trace of its curvature), so the gradient in ``w``
  moves by at most ``||X - m||_F sqrt(sum_i omega_i^2 lambda_i^2) (exp(c T)
  - 1) / (c n)`` (Cauchy-Schwarz; ``m`` the columns' center the intercept
  absorbs).

The bound is relative: ``gap / (F - gap)``, at least ``(F - F*) / F*``.
There is none without an L2 part (``l2 = 0``: no strong convexity) nor
for a loss that is not convex in the raw prediction; the stopping test
then reads the gradient alone (:mod:`.solver`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# How the bound was obtained (fit_stats_["gap_bound_method"]).
METHOD = "strong convexity of the L2 part, the intercept profiled out"
NO_L2 = "none: the penalty has no L2 part (alpha * (1 - l1_ratio) = 0); the gradient test"
NOT_CONVEX = "none: the loss is not convex in the raw prediction; the gradient test"
NO_TOL = "none: tol=None (no stopping test)"


def method(tol: float | None, l2: float, self_concordance: float | None) -> str:
    """How a fit's gap bound is obtained, or why it has none (``fit_stats_``)."""
    if tol is None:
        return NO_TOL
    if not l2 > 0.0:
        return NO_L2
    if self_concordance is None:
        return NOT_CONVEX
    return METHOD


@dataclass(frozen=True)
class GapCertificate:
    """The constants of a fit's gap bound (one per fit; every rank the same).

    ``frobenius_squared`` is ``||X - m||_F^2`` over the training rows and
    every column, ``m`` the center the engine's intercept absorbs (zero
    where the rows are not centered); it bounds how the gradient moves
    with the intercept, so it is only needed with one.
    """

    l2: float
    self_concordance: float
    fit_intercept: bool
    class_shift: bool  # the multinomial: the intercepts' common shift changes nothing
    frobenius_squared: float

    def bound(
        self,
        objective: float,
        gradient_squared: float,
        intercept_gradient: torch.Tensor,
        intercept_hessian: torch.Tensor,
        squared_traces: float,
        n_samples: int,
    ) -> tuple[float, float]:
        """``(absolute, relative)`` upper bounds on the gap at the measured point.

        ``gradient_squared`` is ``||g_w||^2`` of the smallest subgradient in
        ``w`` (every rank's columns, in the user's units), the intercept's
        terms are the pass's: its gradient ``(k,)``, the weighted sum of
        the rows' curvature ``(k, k)`` and ``sum_i omega_i^2 lambda_i^2``
        (not divided by ``n``). Either bound is inf where nothing bounds
        the intercept's move (its curvature too small for its gradient).
        """
        n = max(n_samples, 1)
        intercept_gap = drift = 0.0
        if self.fit_intercept:
            gradient = intercept_gradient.detach().to("cpu", torch.float64)
            hessian = intercept_hessian.detach().to("cpu", torch.float64) / n
            if self.class_shift and gradient.numel() > 1:
                gradient = gradient - gradient.mean()
                curvature = _smallest_eigenvalue_off_shift(hessian)
            else:
                curvature = float(torch.linalg.eigvalsh(hessian).min())
            norm = float(torch.linalg.vector_norm(gradient))
            move = _intercept_move(norm, curvature, self.self_concordance)
            if not math.isfinite(move):
                return math.inf, math.inf
            intercept_gap = norm * move
            c = self.self_concordance
            growth = math.expm1(c * move) / c if c > 0.0 else move
            drift = math.sqrt(self.frobenius_squared * squared_traces) / n * growth
        subgradient = math.sqrt(gradient_squared) + drift
        absolute = intercept_gap + subgradient**2 / (2.0 * self.l2)
        if not (math.isfinite(absolute) and objective > absolute):
            return absolute, math.inf
        return absolute, absolute / (objective - absolute)


def _intercept_move(gradient_norm: float, curvature: float, c: float) -> float:
    """The longest the intercepts' optimum can lie from them: ``T`` (inf: unbounded)."""
    if gradient_norm == 0.0:
        return 0.0
    if not curvature > 0.0:
        return math.inf
    ratio = gradient_norm / curvature
    if c == 0.0:
        return ratio
    if c * ratio >= 1.0:
        return math.inf
    return -math.log1p(-c * ratio) / c


def _smallest_eigenvalue_off_shift(hessian: torch.Tensor) -> float:
    """The intercepts' curvature's smallest eigenvalue on the classes' differences."""
    k = hessian.shape[0]
    # An orthonormal basis of the vectors whose entries sum to zero.
    basis, _ = torch.linalg.qr(torch.eye(k, dtype=hessian.dtype) - 1.0 / k)
    basis = basis[:, : k - 1]
    return float(torch.linalg.eigvalsh(basis.T @ hessian @ basis).min())
