"""The regressors: linear, and Poisson, gamma and Tweedie with a log link."""

from __future__ import annotations

from numbers import Real

import numpy as np
from sklearn.base import RegressorMixin
from sklearn.metrics import d2_tweedie_score

from .._glm.families import Family, GammaFamily, PoissonFamily, SquaredErrorFamily, TweedieFamily
from .._sklearn_compat import Interval, _fit_context
from ._base import _BaseCASGD
from ._docstrings import PARTIAL_FIT_DOC, fill_docstring
from ._validation import check_sample_weight


class _BaseCASGDRegressor(RegressorMixin, _BaseCASGD):
    """Fit and predict of the single-output regressors; subclasses pick the family."""

    def _make_family(self) -> Family:
        """The GLM family of this estimator (built per fit, from its parameters)."""
        raise NotImplementedError

    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y, sample_weight=None):
        """Fit the model by CA-SGD.

        Parameters
        ----------
        X : {array-like, sparse matrix} of shape (n_samples, n_features) or ColumnBlocks
            Training data; float32 input is kept as float32 (and gives
            float32 ``coef_`` and ``intercept_``). With ``n_devices="world"``,
            :class:`~sklearn_casgd.ColumnBlocks`: each rank reads only its
            own columns.
        y : array-like of shape (n_samples,)
            Target values.
        sample_weight : array-like of shape (n_samples,), default=None
            Non-negative weights multiplying each sample's loss.

        Returns
        -------
        self : object
            Fitted estimator.
        """
        X, target, weights, family = self._prepare(X, y, sample_weight, reset=True)
        self._set_coef(*self._fit_engine(X, target, weights, family))
        return self

    @_fit_context(prefer_skip_nested_validation=True)
    def partial_fit(self, X, y, sample_weight=None):
        first_call = not hasattr(self, "coef_")
        X, target, weights, family = self._prepare(X, y, sample_weight, reset=first_call)
        self._set_coef(*self._fit_engine(X, target, weights, family, incremental=True))
        return self

    partial_fit.__doc__ = PARTIAL_FIT_DOC.format(
        targets="""\
        y : array-like of shape (n_samples,)
            Target values."""
    )

    def _prepare(self, X, y, sample_weight, reset):
        """Validated X, the encoded target, the weights and the family."""
        X, y = self._validate_X_y(X, y, y_numeric=True, reset=reset)
        y = np.asarray(y, dtype=np.float64)
        weights = check_sample_weight(sample_weight, X)
        family = self._make_family()
        family.check_target(y, weights)
        return X, family.encode_target(y, None), weights, family

    def _set_coef(self, coef, intercept):
        self.coef_ = coef[0]
        self.intercept_ = intercept[0]

    def _raw_prediction(self, X) -> np.ndarray:
        return self._linear_predictor(X)[:, 0]


class CASGDLinearRegression(_BaseCASGDRegressor):
    """Penalized linear least squares, fitted by communication-avoiding SGD.

    The objective, with unit sample weights, is half the mean squared error
    plus ``alpha / 2 * ||coef||^2`` (the intercept is not penalized), so
    ``alpha`` corresponds to :class:`~sklearn.linear_model.Ridge`'s
    ``alpha * n_samples``; with ``penalty="l1"`` or ``"elasticnet"`` it is
    :class:`~sklearn.linear_model.Lasso`'s and
    :class:`~sklearn.linear_model.ElasticNet`'s objective, ``alpha`` and
    ``l1_ratio``.

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

    def _make_family(self) -> Family:
        return SquaredErrorFamily()

    def predict(self, X):
        """Predict targets.

        Parameters
        ----------
        X : {array-like, sparse matrix} of shape (n_samples, n_features)
            Samples.

        Returns
        -------
        y_pred : ndarray of shape (n_samples,)
            Predictions.
        """
        return self._raw_prediction(X)


class _BaseLogLinkRegressor(_BaseCASGDRegressor):
    """Regressors with a log link: predictions ``exp(raw)``, scored by the D^2 of their deviance."""

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.positive_only = True
        return tags

    def predict(self, X):
        """Predict expected values ``exp(X @ coef_ + intercept_)``.

        Parameters
        ----------
        X : {array-like, sparse matrix} of shape (n_samples, n_features)
            Samples.

        Returns
        -------
        y_pred : ndarray of shape (n_samples,)
            Predicted means.
        """
        return np.exp(self._raw_prediction(X))

    def score(self, X, y, sample_weight=None):
        """D^2, the fraction of the family's deviance explained.

        Parameters
        ----------
        X : {array-like, sparse matrix} of shape (n_samples, n_features)
            Samples.
        y : array-like of shape (n_samples,)
            Targets in the family's range.
        sample_weight : array-like of shape (n_samples,), default=None
            Sample weights.

        Returns
        -------
        score : float
            ``1 - deviance(y, predict(X)) / deviance(y, weighted mean of y)``.
        """
        power = self._make_family().power
        return d2_tweedie_score(y, self.predict(X), sample_weight=sample_weight, power=power)


class CASGDPoissonRegressor(_BaseLogLinkRegressor):
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

    def _make_family(self) -> Family:
        return PoissonFamily()


class CASGDGammaRegressor(_BaseLogLinkRegressor):
    """Gamma regression (log link) fitted by communication-avoiding SGD.

    The objective, with unit sample weights, is half the mean gamma
    deviance plus ``alpha / 2 * ||coef||^2`` (the intercept is not
    penalized): the same objective and ``alpha`` as
    :class:`~sklearn.linear_model.GammaRegressor`. Targets must be > 0.

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
    sklearn.linear_model.GammaRegressor : Exact (lbfgs) solver.
    CASGDTweedieRegressor : Other powers of the Tweedie family.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_casgd import CASGDGammaRegressor
    >>> rng = np.random.default_rng(0)
    >>> X = rng.standard_normal((500, 3))
    >>> y = rng.gamma(shape=2.0, scale=np.exp(0.3 * X[:, 0]) / 2.0)
    >>> reg = CASGDGammaRegressor(random_state=0).fit(X, y)
    >>> bool((reg.predict(X[:3]) > 0).all())
    True
    """

    def _make_family(self) -> Family:
        return GammaFamily()


class CASGDTweedieRegressor(_BaseLogLinkRegressor):
    """Tweedie regression (log link) fitted by communication-avoiding SGD.

    The objective, with unit sample weights, is half the mean Tweedie
    deviance of the given ``power`` plus ``alpha / 2 * ||coef||^2`` (the
    intercept is not penalized): the objective and ``alpha`` of
    :class:`~sklearn.linear_model.TweedieRegressor` with ``link="log"``.

    Parameters
    ----------
    power : float, default=1.5
        Tweedie power: 0 normal, 1 Poisson, (1, 2) compound Poisson-gamma,
        2 gamma, 3 inverse Gaussian; values in (0, 1) are not allowed. (The
        default differs from TweedieRegressor's 0, whose default link is the
        identity: with the log link, powers from 1 up are the usual case.)
        Targets must be >= 0 for powers in [1, 2) and > 0 from 2 on; the
        weighted mean target must be > 0.
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
    sklearn.linear_model.TweedieRegressor : Exact (lbfgs) solver.

    Examples
    --------
    >>> from sklearn_casgd import CASGDTweedieRegressor
    >>> from sklearn_casgd.datasets import make_glm_data
    >>> X, y, _ = make_glm_data("poisson", n_samples=500, n_features=5, random_state=0)
    >>> reg = CASGDTweedieRegressor(power=1.5, random_state=0).fit(X, y)
    >>> reg.predict(X[:3]).shape
    (3,)
    """

    _parameter_constraints: dict = {
        **_BaseCASGDRegressor._parameter_constraints,
        "power": [
            Interval(Real, None, 0, closed="right"),
            Interval(Real, 1, None, closed="left"),
        ],
    }

    def __init__(
        self,
        *,
        power=1.5,
        alpha=1e-4,
        penalty="l2",
        l1_ratio=0.15,
        fit_intercept=True,
        s="auto",
        batch_size="auto",
        solver="svrg",
        average=False,
        learning_rate="adaptive",
        eta0="auto",
        power_t=0.5,
        max_iter=1000,
        tol=1e-5,
        n_iter_no_change=5,
        shuffle=True,
        random_state=None,
        precision="auto",
        device="auto",
        n_devices=1,
        verbose=0,
        warm_start=False,
        timeout=300.0,
        compile="auto",
        early_stopping=False,
        validation_fraction=0.1,
        checkpoint_dir=None,
        checkpoint_every=1,
    ):
        super().__init__(
            alpha=alpha,
            penalty=penalty,
            l1_ratio=l1_ratio,
            fit_intercept=fit_intercept,
            s=s,
            batch_size=batch_size,
            solver=solver,
            average=average,
            learning_rate=learning_rate,
            eta0=eta0,
            power_t=power_t,
            max_iter=max_iter,
            tol=tol,
            n_iter_no_change=n_iter_no_change,
            shuffle=shuffle,
            random_state=random_state,
            precision=precision,
            device=device,
            n_devices=n_devices,
            verbose=verbose,
            warm_start=warm_start,
            timeout=timeout,
            compile=compile,
            early_stopping=early_stopping,
            validation_fraction=validation_fraction,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
        )
        self.power = power

    def _make_family(self) -> Family:
        return TweedieFamily(self.power)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        # Powers <= 0 (normal-like) take any real target, as TweedieFamily checks.
        tags.target_tags.positive_only = not (isinstance(self.power, Real) and self.power <= 0)
        return tags


CASGDLinearRegression.__doc__ = fill_docstring(
    CASGDLinearRegression.__doc__, curvature="1 for squared error"
)
CASGDPoissonRegressor.__doc__ = fill_docstring(
    CASGDPoissonRegressor.__doc__, curvature="the weighted mean target for Poisson"
)
CASGDGammaRegressor.__doc__ = fill_docstring(
    CASGDGammaRegressor.__doc__, curvature="1 for gamma (the curvature's mean at the start)"
)
CASGDTweedieRegressor.__doc__ = fill_docstring(
    CASGDTweedieRegressor.__doc__,
    curvature="the weighted mean target to the power 2 - power for Tweedie",
)
