"""``sparsify`` and ``densify``: coef_ as a scipy sparse matrix, as in scikit-learn."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from sklearn.base import is_regressor
from sklearn.utils.validation import check_is_fitted


class SparseCoefMixin:
    """Convert ``coef_`` between a dense array and a scipy CSR matrix.

    Predictions read either form; a later ``fit``, ``partial_fit`` or warm
    start reads the dense values and leaves ``coef_`` dense again.
    """

    def sparsify(self):
        """Convert ``coef_`` to a scipy CSR matrix.

        Worth it where most coefficients are exactly zero (an L1 penalty's
        fits): the matrix then takes less memory, and predicting on a
        sparse X takes fewer operations. A regressor's 1-D ``coef_``
        becomes a ``(1, n_features)`` matrix, as in scikit-learn.

        Returns
        -------
        self : object
            Fitted estimator.
        """
        check_is_fitted(self)
        self.coef_ = sp.csr_matrix(np.atleast_2d(self.coef_))
        return self

    def densify(self):
        """Convert ``coef_`` back to a numpy array (the default form after ``fit``).

        Returns
        -------
        self : object
            Fitted estimator.
        """
        check_is_fitted(self)
        self.coef_ = dense_coef(self)
        return self


def dense_coef(estimator) -> np.ndarray:
    """The estimator's ``coef_`` as a numpy array of its dense shape (1-D for a regressor)."""
    coef = estimator.coef_
    if not sp.issparse(coef):
        return coef
    coef = coef.toarray()
    return coef.ravel() if is_regressor(estimator) else coef
