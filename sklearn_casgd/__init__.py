"""scikit-learn estimators for GLMs fitted by mixed-precision communication-avoiding SGD."""

from ._accel.compile_cache import UnsafeCompileCacheError
from ._data.blocks import ColumnBlocks
from ._distributed.failures import DistributedFitError
from ._distributed.launch import WorkerPool, close_worker_pools
from ._estimators._logistic import CASGDLogisticRegression
from ._estimators._regressors import (
    CASGDGammaRegressor,
    CASGDLinearRegression,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)
from ._version import PickleVersionWarning
from ._version import __version__ as __version__

__all__ = [
    "CASGDGammaRegressor",
    "CASGDLinearRegression",
    "CASGDLogisticRegression",
    "CASGDPoissonRegressor",
    "CASGDTweedieRegressor",
    "ColumnBlocks",
    "DistributedFitError",
    "PickleVersionWarning",
    "UnsafeCompileCacheError",
    "WorkerPool",
    "close_worker_pools",
]
