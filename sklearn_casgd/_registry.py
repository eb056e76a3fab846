"""The GLM families by name: the estimator, scikit-learn's exact solver, numpy loss, sampler.

One table that the metrics, the synthetic datasets, the tests and the
benchmarks read, so a family added here is known everywhere. The numpy
losses are written apart from the engine's torch code (``._glm.families``),
so that they can judge its fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp, xlogy
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
    """A family's estimator, scikit-learn's estimator of the same objective, its numpy side.

    ``reference(alpha, n_samples, **params)`` builds scikit-learn's exact
    solver for the objective ``mean weighted loss + alpha / 2 ||coef||^2``
    (``params``: the estimator's own, e.g. Tweedie's ``power``).
    ``loss(raw, y, power)`` is each row's loss, float64, from the raw
    predictions ``(n, k)``, with the constants that make it half the
    deviance; ``sample(rng, raw, noise, power)`` draws targets of mean
    given by ``raw`` (``(n,)``, or ``(n, k)`` with ``classes``).
    """

    name: str
    estimator: type[_BaseCASGD]
    reference: Callable[..., BaseEstimator]
    loss: Callable[[np.ndarray, np.ndarray, float], np.ndarray]
    sample: Callable[..., np.ndarray]
    classes: bool = False  # one raw column per class (the multinomial)


def _tweedie_loss(raw: np.ndarray, y: np.ndarray, power: float) -> np.ndarray:
    """Half the Tweedie deviance, mu = exp(raw); Poisson and gamma at powers 1 and 2."""
    if power == 1:
        return np.exp(raw[:, 0]) - y * raw[:, 0] + xlogy(y, y) - y
    if power == 2:
        return raw[:, 0] + y * np.exp(-raw[:, 0]) - np.log(y) - 1.0
    mu = np.exp(raw[:, 0])
    return (
        np.power(y, 2 - power) / ((1 - power) * (2 - power))
        - y * np.power(mu, 1 - power) / (1 - power)
        + np.power(mu, 2 - power) / (2 - power)
    )


def _multinomial_sample(rng, raw: np.ndarray, noise: float, power: float) -> np.ndarray:
    """Class indices drawn from the softmax of ``raw`` ``(n, k)``."""
    proba = np.exp(raw - raw.max(axis=1, keepdims=True))
    proba /= proba.sum(axis=1, keepdims=True)
    cumulative = proba.cumsum(axis=1)
    y = (rng.uniform(size=(raw.shape[0], 1)) > cumulative).sum(axis=1)
    return np.minimum(y, raw.shape[1] - 1)


def _tweedie_sample(rng, raw: np.ndarray, noise: float, power: float) -> np.ndarray:
    """Compound Poisson-gamma targets (1 < power < 2): a Poisson number of gamma jumps."""
    mean = np.exp(raw + 0.5)
    jumps = rng.poisson(mean ** (2 - power) / (2 - power))
    shape = (2 - power) / (power - 1)
    return np.where(
        jumps > 0,
        rng.gamma(np.maximum(jumps, 1) * shape, (power - 1) * mean ** (power - 1)),
        0.0,
    )


def _logistic(alpha: float, n_samples: int, **params) -> BaseEstimator:
    # LogisticRegression sums the losses: C = 1 / (alpha n) is the same objective.
    return LogisticRegression(C=1.0 / (alpha * n_samples), tol=REFERENCE_TOL, max_iter=10_000)


FAMILIES: dict[str, FamilyEntry] = {
    entry.name: entry
    for entry in [
        FamilyEntry(
            "logistic",
            CASGDLogisticRegression,
            _logistic,
            loss=lambda raw, y, power: np.logaddexp(0, raw[:, 0]) - y * raw[:, 0],
            sample=lambda rng, raw, noise, power: (
                rng.uniform(size=raw.shape[0]) < 1.0 / (1.0 + np.exp(-raw))
            ).astype(np.float64),
        ),
        FamilyEntry(
            "multinomial",
            CASGDLogisticRegression,
            _logistic,
            loss=lambda raw, y, power: (
                logsumexp(raw, axis=1) - raw[np.arange(len(y)), y.astype(int)]
            ),
            sample=_multinomial_sample,
            classes=True,
        ),
        FamilyEntry(
            "linear",
            CASGDLinearRegression,
            # Ridge sums half the squared errors: its alpha is ours times n.
            lambda alpha, n_samples, **params: Ridge(alpha=alpha * n_samples),
            loss=lambda raw, y, power: 0.5 * (raw[:, 0] - y) ** 2,
            sample=lambda rng, raw, noise, power: (
                raw + 0.5 + noise * rng.standard_normal(raw.shape[0])
            ),
        ),
        FamilyEntry(
            "poisson",
            CASGDPoissonRegressor,
            lambda alpha, n_samples, **params: PoissonRegressor(
                alpha=alpha, tol=REFERENCE_TOL, max_iter=10_000
            ),
            loss=lambda raw, y, power: _tweedie_loss(raw, y, 1),
            sample=lambda rng, raw, noise, power: rng.poisson(np.exp(raw + 0.5)).astype(np.float64),
        ),
        FamilyEntry(
            "gamma",
            CASGDGammaRegressor,
            lambda alpha, n_samples, **params: GammaRegressor(
                alpha=alpha, tol=REFERENCE_TOL, max_iter=10_000
            ),
            loss=lambda raw, y, power: _tweedie_loss(raw, y, 2),
            # Shape 2, mean exp(raw + 0.5).
            sample=lambda rng, raw, noise, power: rng.gamma(
                shape=2.0, scale=np.exp(raw + 0.5) / 2.0
            ),
        ),
        FamilyEntry(
            "tweedie",
            CASGDTweedieRegressor,
            lambda alpha, n_samples, power=1.5, **params: TweedieRegressor(
                power=power, link="log", alpha=alpha, tol=REFERENCE_TOL, max_iter=10_000
            ),
            loss=_tweedie_loss,
            sample=_tweedie_sample,
        ),
    ]
}
