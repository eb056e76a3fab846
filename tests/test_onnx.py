"""ONNX export: every estimator converts with skl2onnx, and onnxruntime predicts as it does.

On float32 inputs, binary and multinomial classification (labels and
probabilities, with and without skl2onnx's ZipMap) and every regressor,
on scikit-learn's real datasets.
"""

import numpy as np
import pytest
from sklearn.datasets import load_diabetes, load_iris, load_wine
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import (
    CASGDGammaRegressor,
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)

pytest.importorskip("skl2onnx")
rt = pytest.importorskip("onnxruntime")
from sklearn_casgd.onnx import equivalent_estimator, to_onnx  # noqa: E402

PARAMS = dict(random_state=0, max_iter=50)


def _session(model):
    return rt.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run(estimator, X, **options):
    session = _session(to_onnx(estimator, X[:1], **options))
    return session.run(None, {session.get_inputs()[0].name: X})


@pytest.mark.parametrize("n_classes", [2, 3])
def test_classifiers_labels_and_probabilities(n_classes):
    X, y = load_wine(return_X_y=True)
    keep = y < n_classes
    X = StandardScaler().fit_transform(X[keep]).astype(np.float32)
    labels = np.array(["low", "mid", "high"])[y[keep]]  # string classes map through
    clf = CASGDLogisticRegression(**PARAMS).fit(X, labels)
    label, probability = _run(clf, X, options={id(clf): {"zipmap": False}})
    np.testing.assert_array_equal(label, clf.predict(X))
    np.testing.assert_allclose(probability, clf.predict_proba(X), rtol=0, atol=1e-6)
    zipped = _run(clf, X)[1]  # skl2onnx's default: a dict of class -> probability a row
    np.testing.assert_allclose(
        [row[clf.classes_[0]] for row in zipped], clf.predict_proba(X)[:, 0], atol=1e-6
    )


def test_iris_multinomial_in_float64_with_sparse_coefficients():
    X, y = load_iris(return_X_y=True)
    clf = CASGDLogisticRegression(**PARAMS).fit(X, y).sparsify()
    label, probability = _run(clf, X, options={id(clf): {"zipmap": False}})
    np.testing.assert_array_equal(label, clf.predict(X))
    np.testing.assert_allclose(probability, clf.predict_proba(X), rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "estimator",
    [
        CASGDLinearRegression(**PARAMS),
        CASGDPoissonRegressor(**PARAMS),
        CASGDGammaRegressor(**PARAMS),
        CASGDTweedieRegressor(power=1.5, **PARAMS),
    ],
    ids=lambda estimator: type(estimator).__name__,
)
def test_regressors_predictions(estimator):
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X).astype(np.float32)
    y = y / 100.0  # positive, of order one: the log-link regressors' targets too
    estimator.fit(X, y)
    predicted = _run(estimator, X)[0].ravel()
    np.testing.assert_allclose(predicted, estimator.predict(X), rtol=1e-6, atol=1e-6)


def test_only_this_packages_estimators_have_an_equivalent():
    with pytest.raises(TypeError, match="No ONNX converter"):
        equivalent_estimator(StandardScaler())
