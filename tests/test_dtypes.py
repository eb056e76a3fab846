"""float32 models: float32 X gives float32 coefficients and predictions.

As scikit-learn's linear models that preserve the dtype (Ridge,
LogisticRegression): a fit on float32 X keeps ``coef_`` and ``intercept_``
in float32, and predicting on float32 X computes in float32; float64
anywhere (X or the model) gives float64.
"""

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn import datasets

from sklearn_casgd import (
    CASGDGammaRegressor,
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)

CASES = {
    "binary": (CASGDLogisticRegression, lambda: datasets.load_breast_cancer(return_X_y=True)),
    "multinomial": (CASGDLogisticRegression, lambda: datasets.load_iris(return_X_y=True)),
    "linear": (CASGDLinearRegression, lambda: datasets.load_diabetes(return_X_y=True)),
    "poisson": (CASGDPoissonRegressor, lambda: datasets.load_diabetes(return_X_y=True)),
    "gamma": (CASGDGammaRegressor, lambda: datasets.load_diabetes(return_X_y=True)),
    "tweedie": (CASGDTweedieRegressor, lambda: datasets.load_diabetes(return_X_y=True)),
}
METHODS = ("predict", "decision_function", "predict_proba", "predict_log_proba")


def _outputs(estimator, X):
    """Every floating output of the prediction methods the estimator has."""
    outputs = {}
    for name in METHODS:
        if hasattr(estimator, name):
            result = getattr(estimator, name)(X)
            if np.issubdtype(result.dtype, np.floating):
                outputs[name] = result
    return outputs


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("case", list(CASES))
def test_float32_in_float32_out(case, sparse):
    estimator, load = CASES[case]
    X, y = load()
    X = X / np.abs(X).max(axis=0)
    X32 = X.astype(np.float32)
    if sparse:
        X, X32 = sp.csr_matrix(X), sp.csr_matrix(X32)
    model32 = estimator(random_state=0).fit(X32, y)
    model64 = estimator(random_state=0).fit(X, y)
    assert model32.coef_.dtype == np.float32 and model32.intercept_.dtype == np.float32
    assert model64.coef_.dtype == np.float64 and model64.intercept_.dtype == np.float64
    outputs32, outputs64 = _outputs(model32, X32), _outputs(model64, X)
    assert outputs32, "no floating output to check"
    for name, values in outputs32.items():
        assert values.dtype == np.float32, name
        assert outputs64[name].dtype == np.float64, name
        # The same model within float32's rounding of the fit and the products.
        expected = getattr(model32, name)(X)  # float64 X: the float32 model in float64
        assert expected.dtype == np.float64
        np.testing.assert_allclose(values, expected, rtol=1e-4, atol=1e-5)
