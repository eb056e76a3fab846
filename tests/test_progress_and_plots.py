"""verbose progress and the loss-curve display."""

import matplotlib
import numpy as np
import pytest

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.plotting import LossCurveDisplay

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def fitted():
    X, y, _ = make_glm_data("logistic", 400, 5, random_state=0)
    return CASGDLogisticRegression(s=4, random_state=0).fit(X, y)


def test_verbose_shows_progress_with_loss(capsys):
    X, y, _ = make_glm_data("linear", 200, 3, random_state=0)
    CASGDLinearRegression(verbose=1, max_iter=3, tol=None).fit(X, y)
    out = capsys.readouterr().out
    assert "CA-SGD" in out and "3/3" in out and "loss=" in out


def test_the_bar_ends_at_the_epochs_run_and_shows_the_stopping_test(capsys):
    """A fit the stopping test ends early: the bar reads n/n (not n/max_iter, whose
    total promised hours) and shows the gradient against the bound it must meet."""
    pytest.importorskip("tqdm")
    X, y, _ = make_glm_data("logistic", 3000, 10, random_state=0)
    clf = CASGDLogisticRegression(verbose=1, batch_size=64, random_state=0).fit(X, y)
    assert clf.n_iter_ < clf.max_iter
    last = capsys.readouterr().out.replace("\r", "\n").strip().splitlines()[-1]
    assert f"{clf.n_iter_}/{clf.n_iter_}" in last and "gradient=" in last
    assert f"/{clf.max_iter}" not in last


def test_verbose_zero_is_silent(capsys):
    X, y, _ = make_glm_data("linear", 200, 3, random_state=0)
    CASGDLinearRegression(verbose=0, max_iter=3, tol=None).fit(X, y)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_epoch_seconds_recorded(fitted):
    seconds = np.asarray(fitted.fit_stats_["epoch_seconds"])
    assert seconds.shape == fitted.loss_curve_.shape
    assert np.all(np.diff(seconds) > 0)
    assert seconds[-1] <= fitted.fit_stats_["train_seconds"]


@pytest.mark.parametrize("x", ["epoch", "time"])
def test_loss_curve_display(fitted, x):
    import matplotlib.pyplot as plt

    display = LossCurveDisplay.from_estimator(fitted, x=x)
    xdata, ydata = display.line_.get_data()
    np.testing.assert_array_equal(ydata, fitted.loss_curve_)
    if x == "epoch":
        np.testing.assert_array_equal(xdata, np.arange(1, fitted.n_iter_ + 1))
    else:
        np.testing.assert_array_equal(xdata, fitted.fit_stats_["epoch_seconds"])
    assert "s=4" in display.ax_.get_legend().get_texts()[0].get_text()
    plt.close(display.figure_)


def test_display_on_given_axes_and_errors(fitted):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    display = LossCurveDisplay.from_estimator(fitted, ax=ax, name="mine")
    assert display.ax_ is ax and display.figure_ is fig
    with pytest.raises(ValueError, match="x must be one of"):
        display.plot(x="batch")
    with pytest.raises(ValueError, match="epoch_seconds"):
        LossCurveDisplay(loss_curve=[1.0, 0.5]).plot(x="time")
    plt.close(fig)
    with pytest.raises(Exception, match="not fitted"):
        LossCurveDisplay.from_estimator(CASGDLinearRegression())
