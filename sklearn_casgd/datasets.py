"""Synthetic GLM problems with known coefficients."""

from __future__ import annotations

import numpy as np
from sklearn.utils import check_random_state

from ._registry import FAMILIES


def make_glm_data(
    family,
    n_samples=1000,
    n_features=20,
    *,
    n_classes=3,
    noise=1.0,
    signal=1.0,
    dtype=np.float64,
    random_state=None,
    power=1.5,
):
    """Draw a GLM problem with standard normal features and known coefficients.

    Parameters
    ----------
    family : {"logistic", "multinomial", "linear", "poisson", "gamma", "tweedie"}
        Which GLM generates the targets (gamma with shape 2; Tweedie as a
        compound Poisson-gamma with dispersion 1, ``1 < power < 2``).
    n_samples : int, default=1000
        Number of samples.
    n_features : int, default=20
        Number of features.
    n_classes : int, default=3
        Number of classes of the multinomial family.
    noise : float, default=1.0
        Standard deviation of the Gaussian noise of the linear family.
    signal : float, default=1.0
        Norm of the true coefficient vector (per class), which sets how
        separable (logistic) or how spread (Poisson) the targets are.
    dtype : numpy dtype, default=np.float64
        Dtype of X.
    random_state : int, RandomState instance or None, default=None
        Seed of the draw.
    power : float, default=1.5
        Tweedie power, ``family="tweedie"`` only; in (1, 2).

    Returns
    -------
    X : ndarray of shape (n_samples, n_features)
        Features, independent standard normal.
    y : ndarray of shape (n_samples,)
        Targets: 0/1 labels, class indices, real values or counts.
    coef : ndarray of shape (n_features,) or (n_classes, n_features)
        True coefficients of the linear predictor (the intercept is 0.5
        for the linear, Poisson, gamma and Tweedie families and 0 otherwise).

    Examples
    --------
    >>> from sklearn_casgd.datasets import make_glm_data
    >>> X, y, coef = make_glm_data("poisson", n_samples=100, n_features=4, random_state=0)
    >>> X.shape, y.shape, coef.shape
    ((100, 4), (100,), (4,))
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {family!r}.")
    if family == "tweedie" and not 1 < power < 2:
        raise ValueError(f"make_glm_data draws Tweedie targets for 1 < power < 2, got {power}.")
    rng = check_random_state(random_state)
    X = rng.standard_normal((n_samples, n_features))

    def unit_coef(rows):
        coef = rng.standard_normal((rows, n_features))
        return signal * coef / np.linalg.norm(coef, axis=1, keepdims=True)

    entry = FAMILIES[family]
    if entry.classes:
        coef = unit_coef(n_classes)
        raw = X @ coef.T
    else:
        coef = unit_coef(1)[0]
        raw = X @ coef
    y = entry.sample(rng, raw, noise, power)
    return X.astype(dtype, copy=False), y, coef
