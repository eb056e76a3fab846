"""Plots of a fitted estimator's history."""

from __future__ import annotations

import numpy as np

_X_AXES = {"epoch": "Epoch", "time": "Training time (s)"}


class LossCurveDisplay:
    """Training objective of a fit against epochs or training time.

    It is recommended to use :meth:`from_estimator` to create one. All
    parameters are stored as attributes.

    Parameters
    ----------
    loss_curve : array-like of shape (n_epochs,)
        Training objective at the end of each epoch (``loss_curve_``).
    epoch_seconds : array-like of shape (n_epochs,), default=None
        Training time at the end of each epoch
        (``fit_stats_["epoch_seconds"]``); needed for ``x="time"``.
    estimator_name : str, default=None
        Legend label.

    Attributes
    ----------
    line_ : matplotlib Line2D
        The plotted curve.
    ax_ : matplotlib Axes
        Axes with the curve.
    figure_ : matplotlib Figure
        Figure containing the curve.

    See Also
    --------
    sklearn.model_selection.LearningCurveDisplay : Scores against training size.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> from sklearn_casgd import CASGDLogisticRegression
    >>> from sklearn_casgd.datasets import make_glm_data
    >>> from sklearn_casgd.plotting import LossCurveDisplay
    >>> X, y, _ = make_glm_data("logistic", n_samples=300, n_features=4, random_state=0)
    >>> clf = CASGDLogisticRegression(random_state=0).fit(X, y)
    >>> display = LossCurveDisplay.from_estimator(clf, x="time")
    >>> display.ax_.get_xlabel()
    'Training time (s)'
    """

    def __init__(self, *, loss_curve, epoch_seconds=None, estimator_name=None):
        self.loss_curve = loss_curve
        self.epoch_seconds = epoch_seconds
        self.estimator_name = estimator_name

    def plot(self, *, x="epoch", ax=None, name=None, **kwargs):
        """Draw the curve.

        Parameters
        ----------
        x : {"epoch", "time"}, default="epoch"
            What the horizontal axis shows.
        ax : matplotlib Axes, default=None
            Axes to draw on; a new figure when None.
        name : str, default=None
            Legend label; defaults to ``estimator_name``.
        **kwargs : dict
            Passed to ``ax.plot``.

        Returns
        -------
        display : LossCurveDisplay
            This object, with ``line_``, ``ax_`` and ``figure_`` set.
        """
        if x not in _X_AXES:
            raise ValueError(f"x must be one of {sorted(_X_AXES)}, got {x!r}.")
        loss = np.asarray(self.loss_curve, dtype=float)
        if x == "time":
            if self.epoch_seconds is None:
                raise ValueError("x='time' needs epoch_seconds.")
            positions = np.asarray(self.epoch_seconds, dtype=float)
        else:
            positions = np.arange(1, loss.shape[0] + 1)
        if ax is None:
            try:
                import matplotlib.pyplot as plt
            except ImportError as error:
                raise ImportError(
                    "LossCurveDisplay needs matplotlib: pip install matplotlib"
                ) from error
            _, ax = plt.subplots()
        name = self.estimator_name if name is None else name
        (self.line_,) = ax.plot(positions, loss, label=name, **kwargs)
        ax.set_xlabel(_X_AXES[x])
        ax.set_ylabel("Training objective")
        if name is not None:
            ax.legend()
        self.ax_ = ax
        self.figure_ = ax.figure
        return self

    @classmethod
    def from_estimator(cls, estimator, *, x="epoch", ax=None, name=None, **kwargs):
        """Plot the history of a fitted CA-SGD estimator.

        Parameters
        ----------
        estimator : fitted CA-SGD estimator
            Any estimator of this package after ``fit``.
        x : {"epoch", "time"}, default="epoch"
            What the horizontal axis shows.
        ax : matplotlib Axes, default=None
            Axes to draw on; a new figure when None.
        name : str, default=None
            Legend label; defaults to the estimator's class name with its
            ``s`` and precision.
        **kwargs : dict
            Passed to ``ax.plot``.

        Returns
        -------
        display : LossCurveDisplay
            The display, drawn.
        """
        from sklearn.utils.validation import check_is_fitted

        check_is_fitted(estimator, "loss_curve_")
        stats = estimator.fit_stats_
        if name is None:
            name = f"{type(estimator).__name__} (s={stats['s']}, {stats['precision']})"
        display = cls(
            loss_curve=estimator.loss_curve_,
            epoch_seconds=stats.get("epoch_seconds"),
            estimator_name=name,
        )
        return display.plot(x=x, ax=ax, **kwargs)
