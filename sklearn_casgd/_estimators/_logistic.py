"""CASGDLogisticRegression: binary and multinomial logistic regression."""

from __future__ import annotations

import numpy as np
from scipy.special import expit, log_expit, log_softmax, softmax
from sklearn.base import ClassifierMixin
from sklearn.utils.class_weight import compute_class_weight
from sklearn.utils.multiclass import check_classification_targets, unique_labels

from .._glm.families import BinomialFamily, MultinomialFamily
from .._sklearn_compat import StrOptions, _fit_context
from ._base import _BaseCASGD
from ._docstrings import PARTIAL_FIT_DOC, fill_docstring
from ._validation import check_sample_weight


class CASGDLogisticRegression(ClassifierMixin, _BaseCASGD):
    """Logistic regression fitted by communication-avoiding (s-step) SGD.

    Binary targets fit one logistic model; three or more classes fit a
    multinomial (softmax) model whose classes share one Gram matrix. The
    objective, with unit sample weights, is the mean log loss plus
    ``alpha / 2 * ||coef||^2`` (the intercept is not penalized), so
    ``alpha`` corresponds to :class:`~sklearn.linear_model.LogisticRegression`'s
    ``C = 1 / (n_samples * alpha)``; with ``penalty="l1"`` or
    ``"elasticnet"`` the same ``C`` and ``l1_ratio`` as its saga solver.

    Parameters
    ----------
    {common_parameters}
    class_weight : dict, "balanced" or None, default=None
        Weights of the classes, multiplied into the sample weights.

    Attributes
    ----------
    classes_ : ndarray of shape (n_classes,)
        Class labels.
    coef_ : ndarray of shape (1, n_features) or (n_classes, n_features)
        Coefficients; one row for binary problems.
    intercept_ : ndarray of shape (1,) or (n_classes,)
        Intercepts.
    {common_attributes}

    See Also
    --------
    sklearn.linear_model.LogisticRegression : Exact (lbfgs) solver.
    sklearn.linear_model.SGDClassifier : Plain SGD with sample size one.

    Examples
    --------
    >>> from sklearn_casgd import CASGDLogisticRegression
    >>> from sklearn_casgd.datasets import make_glm_data
    >>> X, y, _ = make_glm_data("logistic", n_samples=500, n_features=5, random_state=0)
    >>> clf = CASGDLogisticRegression(random_state=0).fit(X, y)
    >>> clf.predict(X[:3]).shape
    (3,)
    """

    _parameter_constraints: dict = {
        **_BaseCASGD._parameter_constraints,
        "class_weight": [dict, StrOptions({"balanced"}), None],
    }

    def __init__(
        self,
        *,
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
        class_weight=None,
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
        self.class_weight = class_weight

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
            Class labels.
        sample_weight : array-like of shape (n_samples,), default=None
            Non-negative weights multiplying each sample's loss.

        Returns
        -------
        self : object
            Fitted estimator.
        """
        X, y = self._validate_X_y(X, y)
        check_classification_targets(y)
        classes, y_index = np.unique(y, return_inverse=True)
        target, weights, user_weights = self._encode(X, y, y_index, classes, sample_weight)
        self.classes_ = classes
        self.coef_, self.intercept_ = self._fit_engine(
            X,
            target,
            weights,
            self._family(classes),
            stratify=y_index,
            score_weight=user_weights if self.class_weight is not None else None,
        )
        return self

    @_fit_context(prefer_skip_nested_validation=True)
    def partial_fit(self, X, y, classes=None, sample_weight=None):
        first_call = not hasattr(self, "coef_")
        if classes is not None:
            classes = unique_labels(classes)
        if first_call and classes is None:
            raise ValueError("classes must be passed on the first call to partial_fit.")
        if not first_call:
            if classes is not None and not np.array_equal(classes, self.classes_):
                raise ValueError(
                    f"classes={classes!r} is not the same as on the previous fit: "
                    f"{self.classes_!r}."
                )
            classes = self.classes_
        if isinstance(self.class_weight, str):
            raise ValueError(
                f"class_weight={self.class_weight!r} is not supported by partial_fit: the "
                "class frequencies of one chunk are not those of the data. Pass a dict, e.g. "
                "from sklearn.utils.class_weight.compute_class_weight on all the labels."
            )
        X, y = self._validate_X_y(X, y, reset=first_call)
        check_classification_targets(y)
        unknown = np.setdiff1d(y, classes)
        if unknown.size:
            raise ValueError(f"y contains labels that are not in classes={classes!r}: {unknown!r}.")
        y_index = np.searchsorted(classes, y)
        target, weights, _ = self._encode(X, y, y_index, classes, sample_weight)
        self.classes_ = classes
        self.coef_, self.intercept_ = self._fit_engine(
            X, target, weights, self._family(classes), incremental=True
        )
        return self

    partial_fit.__doc__ = PARTIAL_FIT_DOC.format(
        targets="""\
        y : array-like of shape (n_samples,)
            Class labels, all of them in ``classes``.
        classes : array-like of shape (n_classes,), default=None
            Every class of the problem; required on the first call, and if
            given later, the same."""
    )

    @staticmethod
    def _family(classes):
        return BinomialFamily() if classes.shape[0] == 2 else MultinomialFamily()

    def _encode(self, X, y, y_index, classes, sample_weight):
        """The encoded target, the weights with class weights applied, and the user's weights.

        A method of its own so that the class indices are freed before the fit.
        """
        if classes.shape[0] < 2:
            raise ValueError(
                "This solver needs samples of at least 2 classes in the data, but "
                f"the data contains only one class: {classes[0]!r}."
            )
        user_weights = check_sample_weight(sample_weight, X)
        weights = user_weights
        if self.class_weight is not None:
            class_weights = compute_class_weight(self.class_weight, classes=classes, y=y)
            if not np.all(np.isfinite(class_weights) & (class_weights >= 0)):
                raise ValueError(
                    "class_weight must be finite and non-negative, as sample weights are; "
                    f"got {dict(zip(classes.tolist(), class_weights.tolist(), strict=True))}."
                )
            weights = weights * class_weights[y_index]
            if not np.any(weights > 0):
                raise ValueError("sample_weight x class_weight is zero for every sample.")
        target = self._family(classes).encode_target(y_index, classes.shape[0])
        return target, weights, user_weights

    def decision_function(self, X):
        """Raw linear predictions.

        Parameters
        ----------
        X : {array-like, sparse matrix} of shape (n_samples, n_features)
            Samples.

        Returns
        -------
        scores : ndarray of shape (n_samples,) or (n_samples, n_classes)
            Log-odds of the positive class (binary) or per-class scores.
        """
        raw = self._linear_predictor(X)
        return raw[:, 0] if raw.shape[1] == 1 else raw

    def predict(self, X):
        """Predict class labels.

        Parameters
        ----------
        X : {array-like, sparse matrix} of shape (n_samples, n_features)
            Samples.

        Returns
        -------
        y_pred : ndarray of shape (n_samples,)
            Predicted labels.
        """
        scores = self.decision_function(X)
        index = (scores > 0).astype(int) if scores.ndim == 1 else scores.argmax(axis=1)
        return self.classes_[index]

    def predict_proba(self, X):
        """Class probabilities.

        Parameters
        ----------
        X : {array-like, sparse matrix} of shape (n_samples, n_features)
            Samples.

        Returns
        -------
        proba : ndarray of shape (n_samples, n_classes)
            Probability of each class, in the order of ``classes_``.
        """
        scores = self.decision_function(X)
        if scores.ndim == 1:
            positive = expit(scores)
            return np.column_stack([1.0 - positive, positive])
        return softmax(scores, axis=1)

    def predict_log_proba(self, X):
        """Logarithm of the class probabilities.

        Parameters
        ----------
        X : {array-like, sparse matrix} of shape (n_samples, n_features)
            Samples.

        Returns
        -------
        log_proba : ndarray of shape (n_samples, n_classes)
            Log-probability of each class, in the order of ``classes_``.
        """
        scores = self.decision_function(X)
        if scores.ndim == 1:
            return np.column_stack([log_expit(-scores), log_expit(scores)])
        return log_softmax(scores, axis=1)


CASGDLogisticRegression.__doc__ = fill_docstring(
    CASGDLogisticRegression.__doc__, curvature="1/4 binary, 1/2 multinomial"
)
