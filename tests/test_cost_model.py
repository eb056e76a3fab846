"""s="auto": the cost model's predictions, choice and caching."""

import math
import time

import numpy as np
import pytest
import torch
from conftest import busy_process

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression
from sklearn_casgd._distributed import threads
from sklearn_casgd._engine.cost import (
    CANDIDATES,
    PROFILES,
    S_TIE_MARGIN,
    CommCosts,
    FitShape,
    LocalCosts,
    choose_s,
    predict_epoch_seconds,
    quiet_seconds,
)
from sklearn_casgd.datasets import make_glm_data

DISPATCH_BOUND = LocalCosts(sgd_step=1e-4, outer_fixed=2e-4, inner_step=3e-5, gemm_rate=1e10)


def test_prediction_matches_the_formula():
    comm = CommCosts(latency=5e-4, seconds_per_byte=1e-8)
    n, b, width, k = 6400, 32, 128, 1
    n_batches = n // b
    plain = n_batches * (1e-4 + 5e-4 + 4 * b * k * 1e-8)
    shape = FitShape(n, b, width, k)
    assert predict_epoch_seconds(1, shape, DISPATCH_BOUND, comm) == pytest.approx(plain)
    gram_values = b * b * 8 * 7 / 2
    communicate = 5e-4 + 4 * (gram_values + 8 * b * k) * 1e-8
    assert gram_values * width / 1e10 < communicate  # the Gram hides behind the all-reduce
    outer = 2e-4 + 8 * 3e-5 + communicate
    expected = math.ceil(n_batches / 8) * outer
    assert predict_epoch_seconds(8, shape, DISPATCH_BOUND, comm) == pytest.approx(expected)
    # fp64 communicates 8-byte values: only the communication term changes.
    wide = FitShape(n, b, width, k, element_bytes=8)
    extra = math.ceil(n_batches / 8) * 4 * (gram_values + 8 * b * k) * 1e-8
    assert predict_epoch_seconds(8, wide, DISPATCH_BOUND, comm) == pytest.approx(expected + extra)


def test_a_gram_slower_than_the_all_reduce_sets_the_pace():
    comm = CommCosts(latency=5e-4, seconds_per_byte=0.0)
    slow_gemm = LocalCosts(sgd_step=1e-4, outer_fixed=2e-4, inner_step=3e-5, gemm_rate=1e8)
    n, b, width = 6400, 32, 128
    gram_seconds = b * b * 8 * 7 / 2 * width / 1e8
    assert gram_seconds > 5e-4
    expected = math.ceil(n / b / 8) * (2e-4 + 8 * 3e-5 + gram_seconds)
    prediction = predict_epoch_seconds(8, FitShape(n, b, width, 1), slow_gemm, comm)
    assert prediction == pytest.approx(expected)


def test_latency_bound_ranks_prefer_s_above_one_and_one_rank_without_gain_keeps_one():
    slow_network = CommCosts(latency=1e-3, seconds_per_byte=1e-9)
    s, predictions = choose_s(FitShape(65536, 32, 128, 1), DISPATCH_BOUND, slow_network)
    assert s > 1 and predictions[s] <= min(predictions.values()) * (1 + S_TIE_MARGIN)
    gram_bound = LocalCosts(sgd_step=1e-4, outer_fixed=1e-3, inner_step=1e-4, gemm_rate=1e8)
    s, _ = choose_s(FitShape(65536, 32, 128, 1), gram_bound, None)
    assert s == 1


def test_a_near_tie_takes_the_larger_s():
    """Where the model's curve is flat, the largest s within the margin, not the noise's pick.

    Wide blocks of a 2-rank fit (the Gram grows with s, the latency falls):
    s=2 and 4 are predicted within a few percent of each other.
    """
    comm = CommCosts(latency=1e-4, seconds_per_byte=1e-10)
    local = LocalCosts(sgd_step=1e-4, outer_fixed=1e-4, inner_step=3e-5, gemm_rate=4e10)
    s, predictions = choose_s(FitShape(32768, 32, 2048, 1), local, comm)
    fastest = min(predictions, key=predictions.get)
    near = [c for c in predictions if predictions[c] <= predictions[fastest] * (1 + S_TIE_MARGIN)]
    assert len(near) > 1 and s == max(near) and s > fastest, predictions
    # Beyond the margin the fastest prediction is taken.
    free = CommCosts(latency=0.0, seconds_per_byte=0.0)
    slow_gram = LocalCosts(sgd_step=1e-4, outer_fixed=1e-4, inner_step=3e-5, gemm_rate=1e9)
    s, predictions = choose_s(FitShape(32768, 32, 2048, 1), slow_gram, free)
    assert s == 1 and predictions[2] > predictions[1] * (1 + S_TIE_MARGIN), predictions


def test_timings_read_the_quiet_calls_not_the_bursts():
    """A call that lost the core to another process counts no more than a slow outlier."""
    calls = iter(range(1000))

    def run():  # two calls in three lose a 5 ms slice to another process
        if next(calls) % 3:
            time.sleep(5e-3)

    seconds = quiet_seconds(run, torch.device("cpu"), repeats=15)
    assert seconds < 2e-3  # the median would be 5 ms


def test_an_outer_iteration_takes_at_most_a_64th_of_the_rows():
    _, predictions = choose_s(FitShape(6400, 32, 8, 1), DISPATCH_BOUND, CommCosts(1.0, 0.0))
    assert set(predictions) == {1, 2}  # 6400 / 64 = 100 rows: s b <= 100
    _, predictions = choose_s(FitShape(200_000, 256, 100, 1), DISPATCH_BOUND, None)
    assert set(predictions) == {1, 2, 4, 8}  # 2048 of 200000 rows
    _, predictions = choose_s(FitShape(65536, 32, 256, 1), DISPATCH_BOUND, None)
    assert set(predictions) == set(CANDIDATES)


def test_auto_reports_its_choice_and_refits_choose_the_same():
    X, y, _ = make_glm_data("logistic", 3000, 16, random_state=0)
    # A fixed batch keeps the minibatch plan (this small problem would get Newton
    # epochs at batch_size="auto"), so s is the choice under test.
    params = dict(batch_size=64, max_iter=2, tol=None, random_state=0)
    first = CASGDLogisticRegression(**params).fit(X, y)
    stats = first.fit_stats_
    assert stats["s"] in CANDIDATES
    assert stats["s"] == min(stats["s_predictions"], key=stats["s_predictions"].get)
    # One device: priced from the device type's profile, nothing timed, so a
    # refit (in this process or another) makes the same plan.
    again = CASGDLogisticRegression(**params).fit(X, y)
    assert again.fit_stats_["s"] == stats["s"]
    assert again.fit_stats_["s_predictions"] == stats["s_predictions"]
    assert again.fit_stats_["plan"] == stats["plan"]
    np.testing.assert_array_equal(again.coef_, first.coef_)


@pytest.mark.parametrize("batch_size", ["auto", 64])
def test_one_process_plans_the_same_beside_a_busy_process(monkeypatch, batch_size):
    """The plan (batch size, s, Newton or not) is priced, not timed: load does not move it.

    The fit sizes its threads to the free cores, as a user's does.
    """
    monkeypatch.setattr(threads, "SIZE_TO_FREE_CORES", True)
    X, y, _ = make_glm_data("logistic", 20000, 50, random_state=0)
    params = dict(batch_size=batch_size, max_iter=2, tol=None, random_state=0)
    quiet = CASGDLogisticRegression(**params).fit(X, y).fit_stats_
    with busy_process():
        time.sleep(0.5)  # the spinner started
        busy = CASGDLogisticRegression(**params).fit(X, y).fit_stats_
    assert (busy["s"], busy["batch_size"], busy["plan"]) == (
        quiet["s"],
        quiet["batch_size"],
        quiet["plan"],
    )
    assert quiet["plan"]["candidates"]  # chosen by the model, not given


def test_fixed_s_is_not_modelled():
    X, y, _ = make_glm_data("linear", 300, 4, random_state=0)
    reg = CASGDLinearRegression(s=4, max_iter=2, tol=None).fit(X, y)
    assert reg.fit_stats_["s"] == 4 and reg.fit_stats_["s_predictions"] is None


def test_row_steps_are_priced_without_a_gram():
    """One rank, or ranks that all-gather the rows: no Gram term, the gathered bytes.

    The all-gather is in flight an outer iteration ahead: its latency is not priced.
    """
    rows = LocalCosts(sgd_step=1e-4, outer_fixed=1e-4, inner_step=2e-5, gemm_rate=1.0)
    n, b, width = 6400, 32, 128
    outer_count = math.ceil(n / b / 8)
    one_rank = FitShape(n, b, width, 1, row_step_s=frozenset({8}))
    # A Gram at 1 multiply-add per second would take days: none is priced.
    assert predict_epoch_seconds(8, one_rank, rows, None) == pytest.approx(
        outer_count * (1e-4 + 8 * 2e-5)
    )
    comm = CommCosts(latency=5e-4, seconds_per_byte=1e-8)
    gathered = FitShape(n, b, width, 1, row_step_s=frozenset({8}), gather_bytes_per_row=256.0)
    expected = outer_count * (1e-4 + 8 * 2e-5 + 8 * b * 256.0 * 1e-8)
    assert predict_epoch_seconds(8, gathered, DISPATCH_BOUND, comm, rows) == pytest.approx(expected)
    # Another s of the same fit reduces the Gram: DISPATCH_BOUND's formula.
    reduced = predict_epoch_seconds(4, gathered, DISPATCH_BOUND, comm, rows)
    assert reduced == predict_epoch_seconds(4, FitShape(n, b, width, 1), DISPATCH_BOUND, comm)


def test_ranks_share_the_curvatures_sums_in_the_newton_price():
    """Each rank sums its share of the rows' products; the factor stays whole on every rank."""
    profile = PROFILES["cpu"]
    n, width = 3000, 100
    one = profile.newton_seconds(n, width, 1)
    two = profile.newton_seconds(n, width, 1, ranks=2)
    shared = n * (width + 1) ** 2 * profile.curvature_value
    assert two == pytest.approx(one - shared / 2, rel=1e-12)
