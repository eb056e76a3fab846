"""Averaged SGD: the running sum of the iterates, in s-step form.

scikit-learn's ``SGDClassifier(average=True)`` returns the mean of the
iterates (an int ``average`` starts it once that many samples were seen);
the iterates themselves go on unaveraged. Here an iterate is the weights
after a minibatch step, and it counts once the rows stepped on so far,
this step's included, reach ``start``.

In an outer iteration of s steps (``docs/design.md``, section 2), with
``C_j`` the decay products and ``U_k`` the scaled residuals of
:mod:`.recurrence`, the weights after step j are ``w_j = C_j (w_0 -
Y_{<j}^T U_{<j})`` (plain SGD has no control variate), so the counted
ones sum to

    sum_j w_j = A w_0 - Y^T (F U),    A = sum_j C_j,   F_k = sum_{j > k} C_j

over the counted j, with ``F`` repeated over the rows of batch k: one more
product of the rows already at hand, and no collective (each rank sums its
own columns). The intercept, which does not decay, sums likewise with
``C_j`` replaced by 1 in ``A`` and ``F``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .._data.storage import SparseRows, transpose_matmul


@dataclass
class RunningAverage:
    """The sum of the counted iterates of one rank's columns, float64.

    ``count`` iterates are summed; ``samples`` rows were stepped on so far
    (the fit's own and those of the fits it continues); iterates count from
    the step at which ``samples`` reaches ``start``.
    """

    coef_sum: torch.Tensor  # (d_local, k) float64
    intercept_sum: torch.Tensor  # (k,) float64
    start: int
    count: int = 0
    samples: int = 0

    @classmethod
    def starting(
        cls,
        coef: torch.Tensor,
        intercept: torch.Tensor,
        start: int,
        mean: tuple[np.ndarray, np.ndarray] | None = None,
        count: int = 0,
        samples: int = 0,
    ) -> RunningAverage:
        """An average of ``coef``'s shape; continuing ``count`` iterates of ``mean`` if given."""
        coef_sum = torch.zeros(coef.shape, dtype=torch.float64, device=coef.device)
        intercept_sum = torch.zeros(intercept.shape, dtype=torch.float64, device=coef.device)
        if mean is not None and count:
            coef_sum += torch.as_tensor(mean[0], dtype=torch.float64, device=coef.device) * count
            intercept_sum += (
                torch.as_tensor(mean[1], dtype=torch.float64, device=coef.device) * count
            )
        return cls(coef_sum, intercept_sum, start, count, samples)

    def counted(self, sizes: Sequence[int]) -> list[bool]:
        """Which of the next steps, on batches of ``sizes`` rows, count; advances ``samples``."""
        flags = []
        for size in sizes:
            self.samples += size
            flags.append(self.samples >= self.start)
        return flags

    def add(self, coef: torch.Tensor, intercept: torch.Tensor) -> None:
        """Count one iterate."""
        self.coef_sum += coef.to(torch.float64)
        self.intercept_sum += intercept.to(torch.float64)
        self.count += 1

    def add_outer(
        self,
        coef_before: torch.Tensor,
        intercept_before: torch.Tensor,
        rows: torch.Tensor | SparseRows,
        residuals: torch.Tensor,
        decays: Sequence[float],
        sizes: Sequence[int],
        counted: Sequence[bool],
        fit_intercept: bool,
    ) -> None:
        """Count the iterates of one outer iteration (see the module's docstring).

        ``coef_before``/``intercept_before`` are the weights it started from,
        ``rows`` the rows its update read, ``residuals`` its ``U`` and
        ``decays[j]`` its ``C_{j+1}`` (the decay after step j).
        """
        s = len(sizes)
        weight = [decays[j] if counted[j] else 0.0 for j in range(s)]
        ones = [1.0 if counted[j] else 0.0 for j in range(s)]
        # F_k: the counted C_j of the iterates after step k, and their count.
        later = np.cumsum(weight[::-1])[::-1]
        later_count = np.cumsum(ones[::-1])[::-1]
        dtype, device = residuals.dtype, residuals.device
        per_row = torch.tensor(np.repeat(later, sizes), dtype=dtype, device=device)[:, None]
        update = transpose_matmul(rows, residuals * per_row).to(torch.float64)
        self.coef_sum += float(sum(weight)) * coef_before.to(torch.float64) - update
        self.intercept_sum += float(sum(ones)) * intercept_before.to(torch.float64)
        if fit_intercept:
            # beta_j = beta_0 - sum_{k<j} C_{k+1} U_k, summed over the counted j.
            scale = np.repeat(later_count * np.asarray(decays), sizes)
            step_sum = (residuals * torch.tensor(scale, dtype=dtype, device=device)[:, None]).sum(0)
            self.intercept_sum -= step_sum.to(torch.float64)
        self.count += int(sum(ones))

    def mean(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The average of the counted iterates, or None before the first counts."""
        if not self.count:
            return None
        return self.coef_sum / self.count, self.intercept_sum / self.count
