"""The library's version, and the warning for an estimator pickled by another one."""

__version__ = "0.1.0"


class PickleVersionWarning(UserWarning):
    """An estimator was unpickled from another version of sklearn_casgd.

    Its coefficients predict as they did; parameters the other version did
    not have take their defaults, and its solver state may not continue
    (``partial_fit`` then says so).
    """
