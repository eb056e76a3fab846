"""A scipy.sparse X: the same fit as its dense copy, in float64, with O(nnz) memory.

On one rank and on two (spawned workers, each with its CSR column block).

The reference is the dense path on ``X.toarray()``: sparse rows are
gathered, multiplied and preconditioned (implicitly centered) by other
code, so agreement to 1e-10 in float64 checks all of it.
"""

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from sklearn.datasets import load_breast_cancer

from sklearn_casgd import CASGDLinearRegression, CASGDLogisticRegression
from sklearn_casgd._data import storage
from sklearn_casgd._engine.fit import SPARSE_S_CANDIDATES
from sklearn_casgd._engine.fit_plan import RARE_COLUMN_DENSITY, median_column_density
from sklearn_casgd._engine.reduction import WholeX
from sklearn_casgd._registry import FAMILIES
from sklearn_casgd.datasets import make_glm_data
from sklearn_casgd.metrics import glm_objective

# An explicit batch: the planner gives sparse rows in the epoch kernel a batch of their own.
EXACT = dict(precision="fp64", device="cpu", random_state=0, compile=False, batch_size=16)


def sparse_problem(name, n_samples=300, n_features=12, density=0.3, seed=0):
    """A GLM problem whose X keeps ``density`` of its entries (uncentered columns)."""
    X, y, _ = make_glm_data(name, n_samples, n_features, random_state=seed)
    X[np.random.default_rng(seed).random(X.shape) >= density] = 0.0
    return X, y


@pytest.mark.parametrize("kernel", [True, False], ids=["epoch kernel", "torch steps"])
@pytest.mark.parametrize("s", [1, 2])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_sparse_fit_equals_dense_fit(name, s, kernel, force_plan, precondition_sparse):
    if kernel:
        pytest.importorskip("numba")
    force_plan(epoch_kernel=kernel)  # the dense fits' Triton kernel is off on the CPU anyway
    X, y = sparse_problem(name)
    for solver in ("svrg", "sgd"):  # preconditioned (implicit centering) and plain rows
        params = dict(EXACT, solver=solver, s=s, max_iter=5, tol=None)
        dense = FAMILIES[name].estimator(**params).fit(X, y)
        sparse = FAMILIES[name].estimator(**params).fit(sp.csr_matrix(X), y)
        np.testing.assert_allclose(sparse.coef_, dense.coef_, rtol=0, atol=1e-10)
        np.testing.assert_allclose(sparse.intercept_, dense.intercept_, rtol=0, atol=1e-10)
        np.testing.assert_allclose(sparse.loss_curve_, dense.loss_curve_, rtol=1e-12)
        assert sparse.fit_stats_["eta0"] == pytest.approx(dense.fit_stats_["eta0"], rel=1e-9)
        np.testing.assert_allclose(
            sparse.predict(sp.csr_matrix(X[:20])), dense.predict(X[:20]), rtol=1e-10, atol=1e-12
        )


@pytest.mark.parametrize(
    "name",
    [
        "logistic",
        "multinomial",
        "poisson",
        *(pytest.param(name, marks=pytest.mark.slow) for name in ("linear", "gamma", "tweedie")),
    ],
)
def test_sparse_on_two_ranks_equals_dense_on_one(name, monkeypatch, tmp_path, precondition_sparse):
    """Each rank gets its CSR column block (.npy files in the private run directory,
    read without unpickling); the centering's corrections add up over the ranks."""
    from sklearn_casgd._distributed import rundir

    monkeypatch.setattr(rundir, "SHARED_MEMORY_DIR", str(tmp_path))
    X, y = sparse_problem(name)
    for solver in ("svrg", "sgd"):
        params = dict(EXACT, solver=solver, s=2, max_iter=4, tol=None)
        dense = FAMILIES[name].estimator(**params).fit(X, y)
        sparse = FAMILIES[name].estimator(n_devices=2, **params).fit(sp.csr_matrix(X), y)
        np.testing.assert_allclose(sparse.coef_, dense.coef_, rtol=0, atol=1e-10)
        np.testing.assert_allclose(sparse.intercept_, dense.intercept_, rtol=0, atol=1e-10)
        assert sparse.fit_stats_["world_size"] == 2
    assert not list(tmp_path.iterdir())  # the run directory is gone


def test_sparse_s_auto_on_two_ranks_is_timed_and_changes_nothing_else():
    """s="auto" on several ranks times each candidate's outer iterations on the
    ranks' own sparse blocks (at step size 0, on copies of the weights): the fit
    is then the fit with that s given, to 1e-10 in float64."""
    X, y = sparse_problem("logistic", n_samples=600, n_features=40, density=0.2)
    X = sp.csr_matrix(X)
    params = dict(EXACT, solver="svrg", max_iter=3, tol=None)
    auto = CASGDLogisticRegression(n_devices=2, s="auto", **params).fit(X, y)
    timed = auto.fit_stats_["s_predictions"]
    assert set(timed) == set(SPARSE_S_CANDIDATES)  # 16 batches of 16 rows fit in 600
    assert all(seconds > 0 for seconds in timed.values())
    chosen = auto.fit_stats_["s"]
    assert chosen == min(timed, key=timed.get)
    given = CASGDLogisticRegression(n_devices=2, s=chosen, **params).fit(X, y)
    np.testing.assert_allclose(auto.coef_, given.coef_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(auto.intercept_, given.intercept_, rtol=0, atol=1e-10)
    one = CASGDLogisticRegression(s="auto", **params).fit(X, y)
    assert one.fit_stats_["s"] == 1  # one rank: nothing for s > 1 to save


def test_full_pass_in_many_chunks_equals_one(monkeypatch):
    """The full pass and the score walk a sparse X in chunks of stored values."""
    X, y = sparse_problem("logistic", density=0.5)
    params = dict(EXACT, max_iter=3, tol=None, early_stopping=True, n_iter_no_change=10)
    whole = CASGDLogisticRegression(**params).fit(sp.csr_matrix(X), y)
    monkeypatch.setattr(storage, "_CHUNK_NNZ", 7)
    chunked = CASGDLogisticRegression(**params).fit(sp.csr_matrix(X), y)
    np.testing.assert_allclose(chunked.coef_, whole.coef_, rtol=0, atol=1e-12)
    np.testing.assert_allclose(chunked.validation_scores_, whole.validation_scores_)


def test_any_sparse_format_and_the_users_matrix_unchanged(precondition_sparse):
    X, y = sparse_problem("linear")
    # Duplicate entries (summed, as scipy does) and unsorted indices.
    rows, cols = np.nonzero(X)
    values = X[rows, cols]
    coo = sp.coo_matrix(
        (np.concatenate([values / 2, values / 2]), (np.tile(rows, 2), np.tile(cols, 2))),
        shape=X.shape,
    )
    before = coo.copy()
    # A fixed batch: dense rows at batch_size="auto" may run Newton epochs, sparse ones not.
    params = dict(EXACT, max_iter=3, tol=None, batch_size=16)
    dense = CASGDLinearRegression(**params).fit(X, y)
    for matrix in (coo, coo.tocsc(), coo.tocsr(), sp.csr_array(X)):
        fitted = CASGDLinearRegression(**params).fit(matrix, y)
        np.testing.assert_allclose(fitted.coef_, dense.coef_, rtol=0, atol=1e-10)
    assert (coo != before).nnz == 0 and coo.nnz == before.nnz


def test_float32_sparse_gives_float32_coefficients():
    X, y = sparse_problem("logistic")
    fitted = CASGDLogisticRegression(device="cpu", random_state=0).fit(
        sp.csr_matrix(X, dtype=np.float32), y
    )
    assert fitted.coef_.dtype == np.float32
    dense = CASGDLogisticRegression(**EXACT).fit(X, y)
    np.testing.assert_allclose(fitted.coef_, dense.coef_, rtol=0, atol=1e-3)


def test_partial_fit_and_early_stopping_on_sparse_equal_dense(precondition_sparse):
    X, y = sparse_problem("multinomial")
    params = dict(EXACT, solver="sgd", s=2)
    dense, sparse = (CASGDLogisticRegression(**params) for _ in range(2))
    for lo in range(0, 300, 100):
        dense.partial_fit(X[lo : lo + 100], y[lo : lo + 100], classes=[0, 1, 2])
        sparse.partial_fit(sp.csr_matrix(X[lo : lo + 100]), y[lo : lo + 100], classes=[0, 1, 2])
    np.testing.assert_allclose(sparse.coef_, dense.coef_, rtol=0, atol=1e-10)
    params = dict(EXACT, early_stopping=True, n_iter_no_change=2, tol=1e-3, batch_size=16)
    dense = CASGDLogisticRegression(**params).fit(X, y)
    sparse = CASGDLogisticRegression(**params).fit(sp.csr_matrix(X), y)
    assert sparse.n_iter_ == dense.n_iter_
    np.testing.assert_allclose(sparse.validation_scores_, dense.validation_scores_)


def test_wide_sparse_fits_without_a_dense_copy():
    """200k columns x 20k rows: the dense copy would be 32 GB, more than the machine has."""
    rng = np.random.default_rng(0)
    n, d, per_row = 20_000, 200_000, 10
    X = sp.csr_matrix(
        (
            rng.standard_normal(n * per_row),
            rng.integers(0, d, n * per_row),
            np.arange(0, n * per_row + 1, per_row),
        ),
        shape=(n, d),
    )
    y = (X @ rng.standard_normal(d) + 0.1 * rng.standard_normal(n) > 0).astype(int)
    fitted = CASGDLogisticRegression(
        device="cpu", random_state=0, max_iter=2, tol=None, precision="fp32"
    ).fit(X, y)
    assert fitted.coef_.shape == (1, d)
    assert np.isfinite(fitted.coef_).all()
    assert fitted.fit_stats_["s"] == 1  # s="auto" on one device with a sparse X


def test_sparse_bad_input_and_unsupported_settings_are_clear_errors():
    X, y = sparse_problem("logistic")
    with_nan = sp.csr_matrix(X)
    with_nan.data[0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        CASGDLogisticRegression().fit(with_nan, y)
    with pytest.raises(ValueError, match="compile=True"):
        CASGDLogisticRegression(compile=True).fit(sp.csr_matrix(X), y)
    with pytest.raises(ValueError, match="features"):
        CASGDLogisticRegression(**EXACT).fit(X, y).predict(sp.csr_matrix(X[:, :5]))


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # bf16 Poisson
@pytest.mark.parametrize("name", ["logistic", "poisson"])
def test_bf16_sparse_reaches_the_dense_fits_objective(name):
    """bf16 values, float32 Gram and updates: the rounding differs from the dense rows'
    (centering is applied after it, not before), the objective does not."""
    X, y = sparse_problem(name, n_samples=600)
    params = dict(device="cpu", random_state=0, precision="bf16", s=8, max_iter=200)
    dense = FAMILIES[name].estimator(**params).fit(X, y)
    sparse = FAMILIES[name].estimator(**params).fit(sp.csr_matrix(X), y)
    target = y if name == "poisson" else y.astype(int)
    reached = [
        glm_objective(name, X, target, fitted.coef_, fitted.intercept_, 1e-4)
        for fitted in (dense, sparse)
    ]
    # Measured: 2e-8 (logistic) and 2e-7 (Poisson) relative.
    assert reached[1] == pytest.approx(reached[0], rel=1e-5)


def test_sparse_gram_does_not_leak_memory():
    """torch 2.13's CSR x CSR product leaked ~0.6 MB per call at 47k columns (290 MB in 500
    Grams): a long fit grew without bound. The Gram now goes through scipy on the CPU."""
    rng = np.random.default_rng(0)
    n, d, per_row = 5_000, 47_236, 75
    # Columns as popular as words in text (Zipf-like): the Gram of a batch is dense.
    popularity = 1.0 / (np.arange(d) + 10.0) ** 1.1
    X = sp.csr_matrix(
        (
            rng.random(n * per_row).astype(np.float32),
            rng.choice(d, n * per_row, p=popularity / popularity.sum()),
            np.arange(0, n * per_row + 1, per_row),
        ),
        shape=(n, d),
    )
    X.sum_duplicates()
    matrix = storage.CSRMatrix.from_scipy(X, torch.device("cpu"), torch.float32)

    def resident_mib():
        with open("/proc/self/status") as status:
            return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024

    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, n, (256,), generator=generator)
    expected = (X[rows.numpy()] @ X[rows.numpy()].T).toarray()
    np.testing.assert_allclose(
        matrix.gather(rows, torch.float32, None).gram(torch.float32, torch.float32).numpy(),
        expected,
        rtol=1e-6,
    )
    before = resident_mib()
    for _ in range(300):
        rows = torch.randint(0, n, (256,), generator=generator)
        matrix.gather(rows, torch.float32, None).gram(torch.float32, torch.float32)
    assert resident_mib() - before < 50


def test_sparse_x_is_preconditioned_unless_its_columns_are_rare():
    """SVRG scales the columns of a sparse X stored in most rows (a dense table in a
    sparse container: unscaled breast_cancer converged only so) but keeps text-like
    rows of rare columns as they are (the scale would measure their rarity)."""
    X, y = load_breast_cancer(return_X_y=True)
    table = CASGDLogisticRegression(random_state=0).fit(sp.csr_matrix(X), y)
    assert table._step_plan.column_scale is not None
    assert table.fit_stats_["converged"]
    rng = np.random.default_rng(0)
    text = sp.random(3000, 4000, density=0.003, format="csr", random_state=0)
    labels = (text @ rng.normal(size=4000) > 0).astype(int)
    assert median_column_density(text, WholeX(4000)) < RARE_COLUMN_DENSITY
    rare = CASGDLogisticRegression(max_iter=3, tol=None, random_state=0).fit(text, labels)
    assert rare._step_plan.column_scale is None
