"""``sparsify`` and ``densify``, as scikit-learn's linear models offer them."""

import pickle

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.datasets import load_diabetes, load_iris

from sklearn_casgd import (
    CASGDGammaRegressor,
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)

PARAMS = dict(random_state=0, max_iter=20, tol=None, solver="sgd", batch_size=16)


def _problem(estimator):
    if isinstance(estimator, CASGDLogisticRegression):
        return load_iris(return_X_y=True)
    X, y = load_diabetes(return_X_y=True)
    return X * 10.0, y / 100.0


@pytest.mark.parametrize(
    "make",
    [
        CASGDLogisticRegression,
        CASGDLinearRegression,
        CASGDPoissonRegressor,
        CASGDGammaRegressor,
        CASGDTweedieRegressor,
    ],
)
def test_sparsify_keeps_predictions_and_densify_restores_coef(make):
    estimator = make(**PARAMS)
    X, y = _problem(estimator)
    estimator.fit(X, y)
    coef = estimator.coef_.copy()
    coef[..., 0] = 0.0  # an exact zero, as an L1 fit leaves them
    estimator.coef_ = coef.copy()
    predicted = estimator.predict(X)
    assert estimator.sparsify() is estimator
    assert sp.issparse(estimator.coef_) and estimator.coef_.shape == np.atleast_2d(coef).shape
    assert estimator.coef_.nnz == np.count_nonzero(coef)
    np.testing.assert_allclose(estimator.predict(X), predicted, rtol=1e-12)
    np.testing.assert_allclose(estimator.predict(sp.csr_matrix(X)), predicted, rtol=1e-12)
    loaded = pickle.loads(pickle.dumps(estimator))
    np.testing.assert_allclose(loaded.predict(X), predicted, rtol=1e-12)
    assert estimator.densify() is estimator
    assert isinstance(estimator.coef_, np.ndarray)
    np.testing.assert_array_equal(estimator.coef_, coef)


def test_fitting_again_after_sparsify_reads_the_dense_values():
    X, y = load_iris(return_X_y=True)
    warm = CASGDLogisticRegression(warm_start=True, **PARAMS).fit(X, y)
    dense = CASGDLogisticRegression(warm_start=True, **PARAMS).fit(X, y)
    warm.sparsify().fit(X, y)
    dense.fit(X, y)
    assert isinstance(warm.coef_, np.ndarray)
    np.testing.assert_allclose(warm.coef_, dense.coef_, rtol=0, atol=1e-12)
    streamed = CASGDLogisticRegression(**PARAMS).partial_fit(X, y, classes=[0, 1, 2])
    streamed.sparsify().partial_fit(X, y)
    assert isinstance(streamed.coef_, np.ndarray)


def test_sparsify_needs_a_fitted_estimator():
    from sklearn.exceptions import NotFittedError

    for method in ("sparsify", "densify"):
        with pytest.raises(NotFittedError):
            getattr(CASGDLinearRegression(), method)()
