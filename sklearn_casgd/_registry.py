"""The GLM families by name: the engine's family, the estimator, scikit-learn's exact solver.

One table that the metrics, the synthetic datasets, the tests and the
benchmarks read, so a family added here is known everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sklearn.base import BaseEstimator
from sklearn.linear_model import (
    GammaRegressor,
    LogisticRegression,
    PoissonRegressor,
    Ridge,
    TweedieRegressor,
)

from ._estimators._base import _BaseCASGD
from ._estimators._logistic import CASGDLogisticRegression
from ._estimators._regressors import (
    CASGDGammaRegressor,
    CASGDLinearRegression,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)

# Exact solvers are run to this tolerance when they judge a fit.
REFERENCE_TOL = 1e-10


@dataclass(frozen=True)
class FamilyEntry:
    """A family's estimator and the scikit-learn estimator of the same objective.

    ``reference(alpha, n_samples, **params)`` builds scikit-learn's exact
    solver for the objective ``mean weighted loss + alpha / 2 ||coef||^2``
    (``params``: the estimator's own, e.g. Tweedie's ``power``).
    """

    name: str
    estimator: type[_BaseCASGD]
    reference: Callable[..., BaseEstimator]


def _logistic(alpha: float, n_samples: int, **params) -> BaseEstimator:
    # LogisticRegression sums the losses: C = 1 / (alpha n) is the same objective.
    return LogisticRegression(C=1.0 / (alpha * n_samples), tol=REFERENCE_TOL, max_iter=10_000)


FAMILIES: dict[str, FamilyEntry] = {
    entry.name: entry
    for entry in [
        FamilyEntry("logistic", CASGDLogisticRegression, _logistic),
        FamilyEntry("multinomial", CASGDLogisticRegression, _logistic),
        FamilyEntry(
            "linear",
            CASGDLinearRegression,
            # Ridge sums half the squared errors: its alpha is ours times n.
            lambda alpha, n_samples, **params: Ridge(alpha=alpha * n_samples),
        ),
        FamilyEntry(
            "poisson",
            CASGDPoissonRegressor,
            lambda alpha, n_samples, **params: PoissonRegressor(
                alpha=alpha, tol=REFERENCE_TOL, max_iter=10_000
            ),
        ),
        FamilyEntry(
            "gamma",
            CASGDGammaRegressor,
            lambda alpha, n_samples, **params: GammaRegressor(
                alpha=alpha, tol=REFERENCE_TOL, max_iter=10_000
            ),
        ),
        FamilyEntry(
            "tweedie",
            CASGDTweedieRegressor,
            lambda alpha, n_samples, power=1.5, **params: TweedieRegressor(
                power=power, link="log", alpha=alpha, tol=REFERENCE_TOL, max_iter=10_000
            ),
        ),
    ]
}
