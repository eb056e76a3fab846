"""The step plan: what a fit derives from its rows before the epochs, kept for ``partial_fit``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .stepsize import step_size


@dataclass(frozen=True)
class StepPlan:
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
    ) -> StepPlan:
        """The plan for these parameters: the steps' scalar decay and the initial step.

        Preconditioned (SVRG), the steps decay at ``alpha / min D^2``, the
        largest of the columns' rates (see :class:`~sklearn_casgd._engine.state.Preconditioner`).
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

    def with_params(self, alpha: float, eta0_param: float | str) -> StepPlan | None:
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
        return StepPlan.made(
            alpha,
            eta0_param,
            self.smoothness if eta0_param == "auto" else None,
            self.batch_size,
            self.column_center,
            self.column_scale,
            self.column_spread,
        )
