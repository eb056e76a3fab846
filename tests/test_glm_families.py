"""Gamma and Tweedie regression: scikit-learn's objective, reached; the family registry."""

import numpy as np
import pytest
import statsmodels.api as sm
from sklearn.datasets import load_diabetes
from sklearn.metrics import mean_tweedie_deviance
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import (
    CASGDGammaRegressor,
    CASGDPoissonRegressor,
    CASGDTweedieRegressor,
)
from sklearn_casgd._registry import FAMILIES
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective

ALPHA = 1e-3


def diabetes():
    X, y = load_diabetes(return_X_y=True)
    return StandardScaler().fit_transform(X), y  # disease progression, 25 to 346


def randhie():
    data = sm.datasets.randhie.load_pandas()  # outpatient visits: counts, 62 % zeros
    return StandardScaler().fit_transform(data.exog.to_numpy()), data.endog.to_numpy()


def synthetic(family):
    X, y, _ = make_glm_data(family, 3000, 6, random_state=0)
    return X, y


@pytest.mark.parametrize(
    "name, family, power, data, tolerance",
    [
        ("synthetic gamma", "gamma", None, lambda: synthetic("gamma"), 1e-6),
        ("synthetic tweedie", "tweedie", 1.5, lambda: synthetic("tweedie"), 1e-6),
        ("diabetes", "gamma", None, diabetes, 1e-5),
        ("diabetes", "tweedie", 1.5, diabetes, 1e-5),
        ("diabetes", "tweedie", 3.0, diabetes, 1e-4),
        ("randhie", "tweedie", 1.5, randhie, 1e-5),
    ],
)
def test_the_fit_reaches_scikit_learns_objective(name, family, power, data, tolerance):
    X, y = data()
    params = {} if power is None else {"power": power}
    entry = FAMILIES[family]
    fitted = entry.estimator(alpha=ALPHA, random_state=0, **params).fit(X, y)
    exact = entry.reference(ALPHA, len(y), **params).fit(X, y)
    objective = dict(power=1.5 if power is None else power)
    ours = glm_objective(family, X, y, fitted.coef_, fitted.intercept_, ALPHA, **objective)
    best = glm_objective(family, X, y, exact.coef_, exact.intercept_, ALPHA, **objective)
    assert fitted.fit_stats_["converged"]
    assert (ours - best) / abs(best) < tolerance
    assert abs(fitted.score(X, y) - exact.score(X, y)) < 1e-3


@pytest.mark.parametrize(
    "power, equivalent", [(1.0, CASGDPoissonRegressor), (2.0, CASGDGammaRegressor)]
)
def test_tweedie_at_power_one_and_two_is_poisson_and_gamma(power, equivalent):
    X, y, _ = make_glm_data("gamma", 400, 4, random_state=1)
    params = dict(alpha=ALPHA, max_iter=5, tol=None, random_state=0, precision="fp64")
    tweedie = CASGDTweedieRegressor(power=power, **params).fit(X, y)
    other = equivalent(**params).fit(X, y)
    np.testing.assert_allclose(tweedie.coef_, other.coef_, rtol=0, atol=1e-12)
    assert tweedie.intercept_ == pytest.approx(other.intercept_, abs=1e-12)


@pytest.mark.parametrize("family, power", [("gamma", 2.0), ("tweedie", 1.5), ("tweedie", 3.0)])
def test_the_objective_is_half_the_mean_deviance(family, power):
    X, y, coef = make_glm_data("gamma", 300, 4, random_state=2)
    mu = np.exp(X @ coef + 0.3)
    expected = 0.5 * mean_tweedie_deviance(y, mu, power=power)
    assert glm_objective(family, X, y, coef, 0.3, 0.0, power=power) == pytest.approx(expected)


def test_targets_outside_the_family_are_a_clear_error():
    X, y, _ = make_glm_data("gamma", 50, 3, random_state=0)
    y[0] = 0.0
    with pytest.raises(ValueError, match="not strictly positive"):
        CASGDGammaRegressor().fit(X, y)
    y[0] = -1.0
    with pytest.raises(ValueError, match="negative"):
        CASGDTweedieRegressor(power=1.5).fit(X, y)
    with pytest.raises(ValueError, match="power"):
        CASGDTweedieRegressor(power=0.5).fit(X, np.abs(y) + 1)


def test_every_registered_family_has_an_estimator_and_a_reference():
    assert set(FAMILIES) == {"logistic", "multinomial", "linear", "poisson", "gamma", "tweedie"}
    for entry in FAMILIES.values():
        assert entry.reference(ALPHA, 100).get_params()  # a scikit-learn estimator
        assert entry.estimator().get_params()


@pytest.mark.parametrize("power, positive_only", [(0.0, False), (-1.0, False), (1.5, True)])
def test_the_target_tag_follows_the_tweedie_power(power, positive_only):
    """power <= 0 takes any real y, and is tagged so as scikit-learn's
    TweedieRegressor(power=0, link="log") is; the log link's intercept-only start
    still needs a positive mean of y (a clear error otherwise)."""
    regressor = CASGDTweedieRegressor(power=power)
    assert regressor.__sklearn_tags__().target_tags.positive_only is positive_only
    if not positive_only:
        X, y, _ = make_glm_data("gamma", 200, 3, random_state=0)
        y = np.log(y)  # negative values among them
        assert (y < 0).any()
        fitted = regressor.set_params(max_iter=5, tol=None, random_state=0).fit(X, y)
        assert np.isfinite(fitted.coef_).all()
        with pytest.raises(ValueError, match="mean of y must be positive"):
            regressor.fit(X, y - y.mean() - 1.0)
