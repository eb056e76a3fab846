"""Penalties on the coefficients (never on the intercept).

The engine meets a penalty in three places: the steps decay the weights at
its quadratic strength :attr:`L2Penalty.l2` (the s-step recurrence needs
that decay to be a scalar rate), the full pass adds its gradient and its
curvature, and the objective adds its value. The value is a function of a
few sums over the coefficients (:meth:`L2Penalty.norms`) that each rank
forms over its own columns, so one all-reduce of them gives every rank the
value of the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class L2Penalty:
    """``alpha / 2 * ||w||^2``: scikit-learn's ``penalty="l2"`` on the mean loss.

    Parameters
    ----------
    alpha : float
        Its strength (non-negative).
    """

    alpha: float

    @property
    def l2(self) -> float:
        """The strength of the quadratic part: the steps' decay, ``l2 * w`` in the gradient."""
        return self.alpha

    def norms(self, coef: torch.Tensor) -> torch.Tensor:
        """The sums over ``coef``'s entries the value needs, float64 ``(1,)``: ``||w||^2``."""
        return coef.to(torch.float64).square().sum().reshape(1)

    def value(self, norms: torch.Tensor | np.ndarray) -> float:
        """The penalty from :meth:`norms` summed over every rank's columns."""
        return 0.5 * self.alpha * float(norms[0])
