"""ONNX export of fitted estimators, through skl2onnx (the ``onnx`` extra).

The estimators predict as scikit-learn's linear models do: a logistic or
softmax of ``X @ coef_.T + intercept_``, the raw prediction itself (least
squares), or its exponential (the log-link regressors). Each converter
therefore hands skl2onnx a fitted scikit-learn model with the same
coefficients (``LogisticRegression``, ``LinearRegression``,
``PoissonRegressor``) and lets skl2onnx's own converter write the graph;
they are registered through skl2onnx's public
``update_registered_converter`` when this module is imported.

>>> from sklearn_casgd.onnx import to_onnx  # doctest: +SKIP
>>> model = to_onnx(fitted_estimator, X[:1].astype("float32"))  # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
from sklearn.linear_model import LinearRegression, LogisticRegression, PoissonRegressor

from ._estimators._logistic import CASGDLogisticRegression
from ._estimators._regressors import (
    CASGDGammaRegressor,
    CASGDLinearRegression,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)
from ._estimators._sparse_coef import dense_coef

try:
    import skl2onnx
    from skl2onnx.algebra.onnx_operator import OnnxSubEstimator
    from skl2onnx.algebra.onnx_ops import OnnxIdentity
    from skl2onnx.common.shape_calculator import (
        calculate_linear_classifier_output_shapes,
        calculate_linear_regressor_output_shapes,
    )
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "ONNX export needs skl2onnx (and onnxruntime to run the model): "
        "pip install sklearn_casgd[onnx]"
    ) from error

_LOG_LINK = (CASGDPoissonRegressor, CASGDGammaRegressor, CASGDTweedieRegressor)


def equivalent_estimator(estimator):
    """A fitted scikit-learn linear model that predicts as ``estimator`` does.

    Parameters
    ----------
    estimator : CASGDLogisticRegression, CASGDLinearRegression or a log-link regressor
        A fitted estimator of this package.

    Returns
    -------
    model : LogisticRegression, LinearRegression or PoissonRegressor
        The same coefficients, intercepts (and classes) in scikit-learn's
        model of the same prediction formula (a log-link regressor's
        ``exp(X @ coef_ + intercept_)`` is ``PoissonRegressor``'s).
    """
    if isinstance(estimator, CASGDLogisticRegression):
        model = LogisticRegression()
        model.classes_ = estimator.classes_
    elif isinstance(estimator, CASGDLinearRegression):
        model = LinearRegression()
    elif isinstance(estimator, _LOG_LINK):
        model = PoissonRegressor()
    else:
        raise TypeError(f"No ONNX converter for {type(estimator).__name__}.")
    model.coef_ = np.asarray(dense_coef(estimator), dtype=np.float64).copy()
    intercept = np.asarray(estimator.intercept_, dtype=np.float64)
    model.intercept_ = intercept.copy() if intercept.ndim else float(intercept)
    model.n_features_in_ = estimator.n_features_in_
    return model


def _convert_classifier(scope, operator, container):
    opv = container.target_opset
    outputs = operator.outputs
    model = equivalent_estimator(operator.raw_operator)
    # Label and probabilities as arrays here; the parser adds a ZipMap when asked.
    converted = OnnxSubEstimator(
        model, operator.inputs[0], op_version=opv, options={"zipmap": False}
    )
    OnnxIdentity(converted[0], op_version=opv, output_names=outputs[:1]).add_to(scope, container)
    OnnxIdentity(converted[1], op_version=opv, output_names=outputs[1:]).add_to(scope, container)


def _convert_regressor(scope, operator, container):
    opv = container.target_opset
    model = equivalent_estimator(operator.raw_operator)
    converted = OnnxSubEstimator(
        model, operator.inputs[0], op_version=opv, output_names=operator.outputs
    )
    converted.add_to(scope, container)


def register_converters() -> None:
    """Register every estimator's converter with skl2onnx (idempotent).

    Importing this module does it; call it again after skl2onnx's
    registrations were reset.
    """
    skl2onnx.update_registered_converter(
        CASGDLogisticRegression,
        "SklearnCASGDLogisticRegression",
        calculate_linear_classifier_output_shapes,
        _convert_classifier,
        options={"zipmap": [True, False, "columns"], "nocl": [False, True]},
    )
    for estimator in (CASGDLinearRegression, *_LOG_LINK):
        skl2onnx.update_registered_converter(
            estimator,
            f"Sklearn{estimator.__name__}",
            calculate_linear_regressor_output_shapes,
            _convert_regressor,
        )


def to_onnx(estimator, X, **kwargs):
    """Convert a fitted estimator to an ONNX model (:func:`skl2onnx.to_onnx`).

    Parameters
    ----------
    estimator : estimator of this package
        Fitted.
    X : array-like of shape (n_samples, n_features)
        A sample of the inputs: their dtype (float32 or float64) and width
        type the model's input.
    **kwargs
        Passed to :func:`skl2onnx.to_onnx` (``options``, ``target_opset``, ...).

    Returns
    -------
    onx : onnx.ModelProto
        The model; run it with onnxruntime's ``InferenceSession``.
    """
    return skl2onnx.to_onnx(estimator, X, **kwargs)


register_converters()
