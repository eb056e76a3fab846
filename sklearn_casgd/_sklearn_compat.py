"""scikit-learn names the estimators use that are not public API.

Kept in one place so a scikit-learn release that moves them needs one edit.
"""

from sklearn.base import _fit_context
from sklearn.utils._param_validation import Interval, StrOptions

__all__ = ["Interval", "StrOptions", "_fit_context"]
