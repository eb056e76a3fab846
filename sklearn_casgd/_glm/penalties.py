"""The penalty on the coefficients (never on the intercept): L2, L1 or elastic net.

The engine meets a penalty in four places: the steps decay the weights at
its quadratic strength :attr:`Penalty.l2` (the s-step recurrence needs
that decay to be a scalar rate), an L1 part is the proximal step after
every step (:meth:`Penalty.soft_threshold_`), the full pass adds the
gradient and curvature of the smooth part and measures optimality with
the L1 part's subgradient (:meth:`Penalty.optimality_residual`), and the
objective adds its value. The value is a function of a few sums over the
coefficients (:meth:`Penalty.norms`) that each rank forms over its own
columns, so one all-reduce of them gives every rank the value of the
whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Penalty:
    """``alpha * (l1_ratio ||w||_1 + (1 - l1_ratio) / 2 ||w||^2)`` on the mean loss.

    scikit-learn's SGD estimators' and ElasticNet's convention:
    ``l1_ratio=0`` is ``penalty="l2"``, 1 is ``"l1"``.

    Parameters
    ----------
    alpha : float
        Its strength (non-negative).
    l1_ratio : float, default=0.0
        The L1 part's share of ``alpha``, in ``[0, 1]``.
    """

    alpha: float
    l1_ratio: float = 0.0

    @property
    def l2(self) -> float:
        """The strength of the quadratic part: the steps' decay, ``l2 * w`` in the gradient."""
        return self.alpha * (1.0 - self.l1_ratio)

    @property
    def l1(self) -> float:
        """The strength of the L1 part: the proximal step's threshold per unit step."""
        return self.alpha * self.l1_ratio

    @property
    def proximal(self) -> bool:
        """Whether there is an L1 part, whose proximal step follows every step."""
        return self.l1 > 0.0

    def norms(self, coef: torch.Tensor) -> torch.Tensor:
        """The sums over ``coef``'s entries the value needs, float64: ``[||w||^2, ||w||_1]``."""
        coef64 = coef.to(torch.float64)
        return torch.stack([coef64.square().sum(), coef64.abs().sum()])

    def value(self, norms: torch.Tensor | np.ndarray) -> float:
        """The penalty from :meth:`norms` summed over every rank's columns."""
        return 0.5 * self.l2 * float(norms[0]) + self.l1 * float(norms[1])

    @staticmethod
    def soft_threshold_(weights: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
        """``sign(w) max(|w| - threshold, 0)`` in place: the L1 part's proximal step.

        ``threshold`` is the step size times :attr:`l1`, a scalar or one per
        row of ``weights`` (per column of X, preconditioned). Entries it
        reaches become exact zeros (positive: ``-0.0 + 0.0`` is ``+0.0``).
        """
        shrunk = (weights.abs() - threshold).clamp_(min=0.0)
        return weights.copy_(shrunk.mul_(weights.sign()).add_(0.0))

    def optimality_residual(self, gradient: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """The smallest gradient of the objective at ``coef``: zero exactly at the optimum.

        ``gradient`` is the smooth part's (loss and L2). With an L1 part,
        a nonzero coefficient adds ``l1 sign(w)``; at zero the subgradient
        ``[-l1, l1]`` absorbs up to ``l1`` of the gradient, and what is left
        is the residual (the proximal-gradient map's fixed-point test).
        """
        if not self.proximal:
            return gradient
        at_zero = gradient.sign() * (gradient.abs() - self.l1).clamp(min=0.0)
        return torch.where(coef != 0, gradient + self.l1 * coef.sign(), at_zero)


# The estimators' ``penalty`` options: each names its L1 share, None where
# ``l1_ratio`` gives it (scikit-learn's SGD estimators' convention).
PENALTIES = {"l2": 0.0, "l1": 1.0, "elasticnet": None}


def l1_share(penalty: str, l1_ratio: float) -> float:
    """The L1 part's share of ``alpha`` for the estimators' ``penalty`` and ``l1_ratio``."""
    share = PENALTIES[penalty]
    return float(l1_ratio) if share is None else share
