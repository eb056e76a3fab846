import pytest

from sklearn_casgd.metrics import glm_objective


@pytest.fixture(params=[0, 1], ids=lambda seed: f"seed{seed}")
def global_random_seed(request):
    """Seeds a test runs with; tests must pass for each of them."""
    return request.param


def objective(family, X, y, coef, intercept, alpha, sample_weight=None):
    """The exact float64 objective (numpy, independent of the torch engine)."""
    return glm_objective(family, X, y, coef, intercept, alpha, sample_weight)
