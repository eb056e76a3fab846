"""CASGDLinearRegression and CASGDPoissonRegressor."""

from __future__ import annotations

import numpy as np
from sklearn.base import RegressorMixin
from sklearn.metrics import d2_tweedie_score

from .._families import Family, PoissonFamily, SquaredErrorFamily
from .._sklearn_compat import _fit_context
from ._base import _BaseCASGD, fill_docstring
from ._validation import check_sample_weight


class _BaseCASGDRegressor(RegressorMixin, _BaseCASGD):
    """Fit and predict of the single-output regressors; subclasses pick the family."""

    _family: Family

    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y, sample_weight=None):
        """Fit the model by CA-SGD.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Training data; float32 input is kept as float32.
        y : array-like of shape (n_samples,)
            Target values.
        sample_weight : array-like of shape (n_samples,), default=None
            Non-negative weights multiplying each sample's loss.

        Returns
        -------
        self : object
            Fitted estimator.
        """
        X, y = self._validate_X_y(X, y, y_numeric=True)
        y = np.asarray(y, dtype=np.float64)
        weights = check_sample_weight(sample_weight, X)
        self._family.check_target(y, weights)
        target = self._family.encode_target(y, None)
        coef, intercept = self._fit_engine(X, target, weights, self._family)
        self.coef_ = coef[0]
        self.intercept_ = float(intercept[0])
        return self

    def _raw_prediction(self, X) -> np.ndarray:
        return self._linear_predictor(X)[:, 0]


class CASGDLinearRegression(_BaseCASGDRegressor):
    """Linear least squares with L2 penalty, fitted by communication-avoiding SGD.

    The objective, with unit sample weights, is half the mean squared error
    plus ``alpha / 2 * ||coef||^2`` (the intercept is not penalized), so
    ``alpha`` corresponds to :class:`~sklearn.linear_model.Ridge`'s
    ``alpha * n_samples``.

    Parameters
    ----------
    {common_parameters}

    Attributes
    ----------
    coef_ : ndarray of shape (n_features,)
        Coefficients.
    intercept_ : float
        Intercept.
    {common_attributes}

    See Also
    --------
    sklearn.linear_model.Ridge : Exact solver of the same objective.
    sklearn.linear_model.SGDRegressor : Plain SGD with sample size one.

    Examples
    --------
    >>> from sklearn_casgd import CASGDLinearRegression
    >>> from sklearn_casgd.datasets import make_glm_data
    >>> X, y, _ = make_glm_data("linear", n_samples=500, n_features=5, random_state=0)
    >>> reg = CASGDLinearRegression(random_state=0).fit(X, y)
    >>> reg.predict(X[:3]).shape
    (3,)
    """

    _family = SquaredErrorFamily()

    def predict(self, X):
        """Predict targets.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Samples.

        Returns
        -------
        y_pred : ndarray of shape (n_samples,)
            Predictions.
        """
        return self._raw_prediction(X)


class CASGDPoissonRegressor(_BaseCASGDRegressor):
    """Poisson regression (log link) fitted by communication-avoiding SGD.

    The objective, with unit sample weights, is half the mean Poisson
    deviance plus ``alpha / 2 * ||coef||^2`` (the intercept is not
    penalized): the same objective and ``alpha`` as
    :class:`~sklearn.linear_model.PoissonRegressor`.

    Parameters
    ----------
    {common_parameters}

    Attributes
    ----------
    coef_ : ndarray of shape (n_features,)
        Coefficients of the linear predictor.
    intercept_ : float
        Intercept of the linear predictor.
    {common_attributes}

    See Also
    --------
    sklearn.linear_model.PoissonRegressor : Exact (lbfgs) solver.

    Examples
    --------
    >>> from sklearn_casgd import CASGDPoissonRegressor
    >>> from sklearn_casgd.datasets import make_glm_data
    >>> X, y, _ = make_glm_data("poisson", n_samples=500, n_features=5, random_state=0)
    >>> reg = CASGDPoissonRegressor(random_state=0).fit(X, y)
    >>> bool((reg.predict(X[:3]) > 0).all())
    True
    """

    _family = PoissonFamily()

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.positive_only = True
        return tags

    def predict(self, X):
        """Predict expected counts ``exp(X @ coef_ + intercept_)``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Samples.

        Returns
        -------
        y_pred : ndarray of shape (n_samples,)
            Predicted means.
        """
        return np.exp(self._raw_prediction(X))

    def score(self, X, y, sample_weight=None):
        """D^2, the fraction of Poisson deviance explained.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Samples.
        y : array-like of shape (n_samples,)
            Non-negative targets.
        sample_weight : array-like of shape (n_samples,), default=None
            Sample weights.

        Returns
        -------
        score : float
            ``1 - deviance(y, predict(X)) / deviance(y, weighted mean of y)``.
        """
        return d2_tweedie_score(y, self.predict(X), sample_weight=sample_weight, power=1)


CASGDLinearRegression.__doc__ = fill_docstring(
    CASGDLinearRegression.__doc__, curvature="1 for squared error"
)
CASGDPoissonRegressor.__doc__ = fill_docstring(
    CASGDPoissonRegressor.__doc__, curvature="the weighted mean target for Poisson"
)
