"""scikit-learn estimators for GLMs fitted by mixed-precision communication-avoiding SGD."""

from ._estimators._logistic import CASGDLogisticRegression
from ._estimators._regressors import CASGDLinearRegression, CASGDPoissonRegressor
from ._launch import DistributedFitError

__all__ = [
    "CASGDLinearRegression",
    "CASGDLogisticRegression",
    "CASGDPoissonRegressor",
    "DistributedFitError",
]
__version__ = "0.1.0"
