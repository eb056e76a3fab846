"""early_stopping: the held-out score is the estimator's own; it stops by SGDClassifier's rule."""

import warnings

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer, load_diabetes
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import ShuffleSplit, StratifiedShuffleSplit
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import (
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
)

EXACT = dict(precision="fp64", device="cpu", compile=False)


def _held_out_rows(X, y, fraction, random_state, stratify):
    splitter = (StratifiedShuffleSplit if stratify else ShuffleSplit)(
        test_size=fraction, random_state=random_state
    )
    _, held_out = next(splitter.split(X, y if stratify else None))
    return held_out


def _stop_epoch(scores, tol, patience):
    """The epoch (1-based) at which scikit-learn's rule stops, or None: the reference."""
    best, since = -np.inf, 0
    for epoch, score in enumerate(scores, start=1):
        since = since + 1 if score < best + tol else 0
        best = max(best, score)
        if since >= patience:
            return epoch
    return None


def _breast_cancer():
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), y


@pytest.mark.parametrize("solver", ["svrg", "sgd"])
def test_classifier_stops_by_the_rule_on_its_own_held_out_score(solver):
    X, y = _breast_cancer()
    sample_weight = np.random.default_rng(0).uniform(0.5, 2.0, size=y.shape[0])
    estimator = CASGDLogisticRegression(
        early_stopping=True,
        validation_fraction=0.2,
        n_iter_no_change=3,
        tol=1e-3,
        solver=solver,
        learning_rate="constant",
        class_weight={0: 2.0, 1: 1.0},
        random_state=0,
        **EXACT,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        estimator.fit(X, y, sample_weight=sample_weight)
    held_out = _held_out_rows(X, y, 0.2, 0, stratify=True)
    # Scored with the user's weights (not the class weights), as SGDClassifier does.
    score = estimator.score(X[held_out], y[held_out], sample_weight=sample_weight[held_out])
    assert estimator.validation_scores_[-1] == pytest.approx(score, abs=1e-12)
    assert len(estimator.validation_scores_) == estimator.n_iter_
    assert estimator.n_iter_ == _stop_epoch(estimator.validation_scores_, 1e-3, 3)
    assert estimator.n_iter_ < estimator.max_iter
    assert estimator.fit_stats_["stopped_early"]
    assert estimator.best_validation_score_ == max(estimator.validation_scores_)
    # Stratified: the held-out rows have the classes' proportions.
    assert abs(y[held_out].mean() - y.mean()) < 0.01


@pytest.mark.parametrize("estimator_class", [CASGDLinearRegression, CASGDPoissonRegressor])
def test_regressor_held_out_score_is_its_score(estimator_class):
    """R^2 and D^2 on diabetes (unscaled y in the hundreds): both stop within 10 epochs.

    A fixed batch: at batch_size="auto" this small problem gets Newton epochs, which
    reach the optimum before the held-out score can plateau.
    """
    X, y = load_diabetes(return_X_y=True)
    estimator = estimator_class(
        early_stopping=True, n_iter_no_change=2, tol=1e-4, batch_size=32, random_state=3, **EXACT
    ).fit(X, y)
    held_out = _held_out_rows(X, y, 0.1, 3, stratify=False)
    assert estimator.validation_scores_[-1] == pytest.approx(
        estimator.score(X[held_out], y[held_out]), abs=1e-12
    )
    assert estimator.n_iter_ == _stop_epoch(estimator.validation_scores_, 1e-4, 2) < 10
    assert estimator.fit_stats_["stopped_early"]
    # Trained on the other 90 % only: the steps of one epoch say so.
    n_train = X.shape[0] - held_out.shape[0]
    assert estimator.t_ == estimator.n_iter_ * -(-n_train // estimator.fit_stats_["batch_size"])


def test_adaptive_sgd_divides_the_step_before_it_stops():
    X, y = _breast_cancer()
    estimator = CASGDLogisticRegression(
        early_stopping=True, solver="sgd", n_iter_no_change=2, tol=1e-2, random_state=0, **EXACT
    ).fit(X, y)
    # Each plateau divides eta by 5 until it is below 1e-4 eta0: at least 6 plateaus.
    assert estimator.fit_stats_["eta"] < 1e-4 * estimator.fit_stats_["eta0"]
    assert estimator.n_iter_ >= 12
    assert estimator.fit_stats_["stopped_early"]


def test_without_early_stopping_there_are_no_scores():
    X, y = _breast_cancer()
    estimator = CASGDLogisticRegression(max_iter=3, tol=None, random_state=0, **EXACT).fit(X, y)
    assert estimator.validation_scores_ is None
    assert estimator.best_validation_score_ is None
    assert not estimator.fit_stats_["stopped_early"]
    # partial_fit trains on every row, early_stopping or not.
    chunked = CASGDLogisticRegression(early_stopping=True, random_state=0, **EXACT)
    chunked.partial_fit(X, y, classes=[0, 1])
    assert chunked.t_ == -(-X.shape[0] // 32)


def test_bad_split_is_a_clear_error():
    X = np.arange(8.0).reshape(4, 2)
    with pytest.raises(ValueError, match="least populated class"):
        CASGDLogisticRegression(early_stopping=True).fit(X, [0, 0, 0, 1])
    with pytest.raises(ValueError, match="validation_fraction"):
        CASGDLinearRegression(early_stopping=True, validation_fraction=1.5).fit(X, [0, 1, 2, 3])


def test_early_stopping_on_two_ranks_equals_one():
    """The held-out rows travel to the spawned ranks with the others (fp64, gloo)."""
    X, y = _breast_cancer()
    params = dict(early_stopping=True, n_iter_no_change=2, tol=1e-3, random_state=0, s=2, **EXACT)
    one = CASGDLogisticRegression(**params).fit(X, y)
    two = CASGDLogisticRegression(n_devices=2, **params).fit(X, y)
    np.testing.assert_allclose(two.validation_scores_, one.validation_scores_, atol=1e-12)
    np.testing.assert_allclose(two.coef_, one.coef_, rtol=0, atol=1e-10)


@pytest.mark.parametrize("side", ["held-out", "training"])
@pytest.mark.parametrize("classifier", [False, True])
def test_a_split_side_without_weight_is_refused_by_name(side, classifier):
    """Sample weights that are 0 on every held-out (or every training) row.

    The held-out score with weights all 0 is undefined: both estimators
    ended in scikit-learn's "Sample weights must contain at least one
    non-zero number" from inside the scoring, mid-fit (inside a worker on
    several ranks), naming neither early stopping nor the split; with the
    training rows weightless the intercept's start divided 0 by 0.
    scikit-learn's SGD refuses the first up front; the estimators now
    refuse both, naming the side.
    """
    X, y = (load_breast_cancer if classifier else load_diabetes)(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    held_out = _held_out_rows(X, y, 0.1, 0, stratify=classifier)
    weight = np.zeros(X.shape[0])
    if side == "held-out":
        weight[np.setdiff1d(np.arange(X.shape[0]), held_out)] = 1.0
    else:
        weight[held_out] = 1.0
    estimator = (CASGDLogisticRegression if classifier else CASGDLinearRegression)(
        early_stopping=True, random_state=0
    )
    with pytest.raises(ValueError, match=f"every sample weight of the \\d+ {side} rows"):
        estimator.fit(X, y, sample_weight=weight)


def test_without_shuffle_the_training_rows_keep_their_order():
    """As SGDClassifier's mask: early stopping's training rows are visited in the
    order given (shuffle=False), so the fit is the one on those rows alone."""
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    params = dict(
        solver="sgd", shuffle=False, max_iter=3, tol=None, precision="fp64", random_state=0,
        batch_size=16, eta0=0.05, learning_rate="constant",
    )  # fmt: skip
    held_out = CASGDLogisticRegression(early_stopping=True, validation_fraction=0.2, **params)
    held_out.fit(X, y)
    splitter = StratifiedShuffleSplit(test_size=0.2, random_state=0)
    train = np.sort(next(splitter.split(np.zeros((len(y), 1)), y))[0])
    alone = CASGDLogisticRegression(**params).fit(X[train], y[train])
    np.testing.assert_allclose(held_out.coef_, alone.coef_, rtol=0, atol=1e-12)
    np.testing.assert_allclose(held_out.intercept_, alone.intercept_, rtol=0, atol=1e-12)
