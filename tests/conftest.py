import numpy as np
import pytest
from scipy.special import logsumexp, xlogy


@pytest.fixture(params=[0, 1], ids=lambda seed: f"seed{seed}")
def global_random_seed(request):
    """Seeds a test runs with; tests must pass for each of them."""
    return request.param


def objective(family, X, y, coef, intercept, alpha, sample_weight=None):
    """Exact float64 objective: mean weighted per-sample loss + alpha/2 ||coef||^2."""
    coef = np.atleast_2d(coef)
    raw = X @ coef.T + np.atleast_1d(intercept)
    if family == "logistic":
        loss = np.logaddexp(0, raw[:, 0]) - y * raw[:, 0]
    elif family == "multinomial":
        loss = logsumexp(raw, axis=1) - raw[np.arange(len(y)), y.astype(int)]
    elif family == "linear":
        loss = 0.5 * (raw[:, 0] - y) ** 2
    elif family == "poisson":
        loss = np.exp(raw[:, 0]) - y * raw[:, 0] + xlogy(y, y) - y
    else:
        raise ValueError(family)
    weights = np.ones_like(y, dtype=float) if sample_weight is None else sample_weight
    return float(np.mean(weights * loss) + 0.5 * alpha * np.sum(coef**2))
