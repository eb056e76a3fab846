"""ColumnBlocks: a "world" fit where each rank reads only its own columns.

The reference is the same fit in one process on the whole X: 4 gloo ranks
of a torchrun job, each given only its block files (dense .npy, CSR .npz,
Parquet), must reach its coefficients to 1e-10 in float64, their planning
statistics (the step size) combined over the ranks must equal the whole
X's, and each rank's peak memory during the fit must stay within 1.5x its
block. Wrong blocks end in a clear ValueError on every rank.
"""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import run_torchrun

from sklearn_casgd import (
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
    ColumnBlocks,
)
from sklearn_casgd._engine.fit import column_blocks
from sklearn_casgd.datasets import make_glm_data

HERE = Path(__file__).parent
WORLD = 4
COMMON = dict(precision="fp64", device="cpu", random_state=0)
ESTIMATORS = {"logistic": CASGDLogisticRegression, "poisson": CASGDPoissonRegressor}


def _write_blocks(directory, X, suffix, widths=None):
    """X's column blocks as the engine splits them over WORLD ranks, one file each."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank, (start, stop) in enumerate(column_blocks(X.shape[1], WORLD)):
        block = X[:, start:stop]
        path = directory / f"block{rank}.{suffix}"
        if suffix == "npy":
            np.save(path, np.ascontiguousarray(block))
        elif suffix == "npz":
            sp.save_npz(path, sp.csr_matrix(block))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            columns = {
                f"x{start + j}": np.ascontiguousarray(block[:, j]) for j in range(stop - start)
            }
            pq.write_table(pa.table(columns), path)


# name: (estimator, family of make_glm_data, n, d, suffix, sparse, params)
CASES = {
    "logistic_newton_npy": ("logistic", "logistic", 3000, 14, "npy", False, dict(tol=1e-10)),
    "logistic_minibatch_npy": (
        "logistic",
        "logistic",
        3000,
        14,
        "npy",
        False,
        dict(batch_size=32, max_iter=4, tol=None),
    ),
    "multinomial_npz": (
        "logistic",
        "multinomial",
        2000,
        13,
        "npz",
        True,
        dict(batch_size=32, max_iter=4, tol=None),
    ),
    "poisson_parquet": ("poisson", "poisson", 3000, 10, "parquet", False, dict(tol=1e-10)),
    # Wide enough blocks (100 columns, 48 MB a rank) that the fit's O(n) and
    # O(d) arrays are small beside them.
    "memory_npy": (
        "logistic",
        "logistic",
        60000,
        400,
        "npy",
        False,
        dict(batch_size=256, max_iter=2, tol=None),
    ),
}


def _case_data(family, n, d, sparse):
    X, y, _ = make_glm_data(family, n, d, random_state=0)
    if sparse:
        X = np.where(np.abs(X) < 0.8, 0.0, X)
    return X, y


@pytest.mark.distributed
def test_four_ranks_on_their_own_block_files_fit_the_one_process_model(tmp_path):
    pytest.importorskip("pyarrow")
    data, out = tmp_path / "data", tmp_path / "out"
    out.mkdir()
    written = {}
    for name, (estimator, family, n, d, suffix, sparse, params) in CASES.items():
        X, y = _case_data(family, n, d, sparse)
        _write_blocks(data / name, X, suffix)
        np.save(data / name / "y.npy", y)
        if name != "memory_npy":
            np.save(data / name / "X.npy", X)
        written[name] = dict(estimator=estimator, suffix=suffix, params=params)
    (data / "cases.json").write_text(json.dumps(written))
    run_torchrun(HERE / "column_blocks_script.py", data, out, "fit", timeout=400, nproc=WORLD)
    ranks = [np.load(out / f"rank{r}.npz") for r in range(WORLD)]

    for name, (estimator, family, n, d, _, sparse, params) in CASES.items():
        X, y = _case_data(family, n, d, sparse)
        for result in ranks:  # every rank ends with the whole model
            np.testing.assert_array_equal(result[f"{name}_coef"], ranks[0][f"{name}_coef"])
            assert int(result[f"{name}_n_features_in"]) == d
        if name == "memory_npy":
            continue
        local = ESTIMATORS[estimator](**COMMON, **params).fit(sp.csr_matrix(X) if sparse else X, y)
        world = ranks[0]
        # The same plan: Newton epochs or minibatch steps (the ranks run them
        # as a Gram exchange where one process runs rows).
        newton = local.fit_stats_["execution"]["steps"] == "newton"
        assert (str(world[f"{name}_steps"]) == "newton") == newton
        # The step size comes from the ranks' combined statistics (row norms,
        # column moments, the Lanczos products).
        np.testing.assert_allclose(
            float(world[f"{name}_eta0"]), local.fit_stats_["eta0"], rtol=1e-10
        )
        np.testing.assert_allclose(world[f"{name}_coef"], local.coef_, rtol=0, atol=1e-10)
        np.testing.assert_allclose(world[f"{name}_intercept"], local.intercept_, rtol=0, atol=1e-10)
        assert float(world[f"{name}_score"]) == pytest.approx(local.score(X, y))

    for result in ranks:
        for attempt in ("written", "resumed"):
            np.testing.assert_array_equal(
                result[f"checkpoint_{attempt}_coef"], ranks[0]["logistic_minibatch_npy_coef"]
            )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "manifest.json",
        *(f"rank-{r}-epoch-4.pt" for r in range(WORLD)),
    ]

    block_bytes = 60000 * (400 // WORLD) * 8
    for rank, result in enumerate(ranks):
        peak = int(result["memory_npy_peak_kib"]) * 1024
        assert peak < 1.5 * block_bytes, f"rank {rank} added {peak / 2**20:.1f} MiB during the fit"


BAD = {
    # name: (what each rank is given, flip y / weights on a rank, what every rank must read)
    "missing_file": (
        "paths",
        {2: "good/nothere.npy"},
        r"rank 2 \(file '.*nothere\.npy'\): it cannot be read",
    ),
    "overlap": (
        "paths",
        {1: "bad/overlap1.npy"},
        r"rank 1 \(file '.*overlap1\.npy'\) has 5 columns where 4 are expected",
    ),
    "missing_columns": (
        "paths",
        {3: "bad/short3.npy"},
        r"rank 3 \(file '.*short3\.npy'\) has 2 columns where 3 are expected",
    ),
    "wrong_rows": (
        "paths",
        {0: "bad/rows0.npy"},
        r"rank 0 \(file '.*rows0\.npy'\): it has another number of rows than y",
    ),
    "nan": (
        "paths",
        {1: "bad/nan1.npy"},
        r"rank 1 \(file '.*nan1\.npy'\): it holds NaN or infinity",
    ),
    "float32_on_one": (
        "paths",
        {0: "bad/float32_0.npy"},
        r"differ in dtype .*rank 0 float32 dense, rank 1 float64 dense",
    ),
    "three_files": (
        "three",
        {},
        r"3 column blocks were given for a job of 4 ranks|it was given for a job of another size",
    ),
    "mismatched_y": ("flip_y_on_rank", 2, r"need every rank to pass the same y"),
    "mismatched_weights": ("weight_on_rank", 3, r"the ranks differ in: .*sum\(sample_weight\)"),
    "empty_file": ("paths", {1: "bad/empty1.npy"}, r"rank 1 \(file '.*empty1\.npy'\): it cannot"),
    "truncated_file": (
        "paths",
        {2: "bad/truncated2.npy"},
        r"rank 2 \(file '.*truncated2\.npy'\): it is not a 2-D array of numbers",
    ),
    "complex_values": (
        "paths",
        {3: "bad/complex3.npy"},
        r"rank 3 \(file '.*complex3\.npy'\): it is not a 2-D array of numbers",
    ),
    "good": ("paths", {}, None),
}


@pytest.mark.distributed
def test_wrong_blocks_end_in_a_clear_error_on_every_rank(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    out.mkdir()
    X, y = _case_data("logistic", 400, 14, False)
    _write_blocks(data / "good", X, "npy")
    np.save(data / "good" / "y.npy", y)
    (data / "bad").mkdir()
    np.save(data / "bad" / "overlap1.npy", X[:, 4:9])  # rank 1 holds 4:8
    np.save(data / "bad" / "short3.npy", X[:, 11:13])  # rank 3 holds 11:14
    np.save(data / "bad" / "rows0.npy", X[:-1, 0:4])
    with_nan = X[:, 4:8].copy()
    with_nan[7, 2] = np.nan
    np.save(data / "bad" / "nan1.npy", with_nan)
    np.save(data / "bad" / "float32_0.npy", X[:, 0:4].astype(np.float32))
    (data / "bad" / "empty1.npy").write_bytes(b"")
    np.save(data / "bad" / "truncated2.npy", X[:, 8:11])
    truncated = data / "bad" / "truncated2.npy"
    truncated.write_bytes(truncated.read_bytes()[:-64])
    np.save(data / "bad" / "complex3.npy", X[:, 11:14].astype(np.complex128))
    good = [f"good/block{r}.npy" for r in range(WORLD)]
    cases = {}
    for name, (kind, value, _) in BAD.items():
        case = {"paths": list(good)}
        if kind == "paths":
            for rank, path in value.items():
                case["paths"][rank] = path
        elif kind == "three":
            case["paths"] = good[:3]
        else:
            case[kind] = value
        cases[name] = case
    (data / "bad.json").write_text(json.dumps(cases))
    run_torchrun(HERE / "column_blocks_script.py", data, out, "bad", timeout=400, nproc=WORLD)
    outcomes = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for name, (_, _, expected) in BAD.items():
        for rank, outcome in enumerate(outcomes):
            message, seconds = outcome[name]
            assert seconds < 30, (name, rank, seconds)
            if expected is None:
                assert message == "no error", (name, rank, message)
            else:
                assert message.startswith("ValueError"), (name, rank, message)
                assert re.search(expected, message), (name, rank, message)


def test_column_blocks_need_a_world_fit_and_fit_only(tmp_path):
    X, y = _case_data("linear", 50, 4, False)
    blocks = ColumnBlocks(lambda rank, world_size: X)
    with pytest.raises(ValueError, match="use n_devices='world'"):
        CASGDLinearRegression(n_devices=1).fit(blocks, y)


def test_a_block_is_checked_where_it_is_loaded(tmp_path):
    with pytest.raises(TypeError, match="one per rank, not one path"):
        ColumnBlocks.from_files(str(tmp_path / "a.npy"))
    with pytest.raises(ValueError, match="suffix must be one of"):
        ColumnBlocks.from_files([tmp_path / "a.csv"])
    with pytest.raises(TypeError, match="load must be a callable"):
        ColumnBlocks([1, 2])
    blocks = ColumnBlocks.from_files([tmp_path / "a.npy", tmp_path / "b.npy"])
    with pytest.raises(
        ValueError, match=r"rank 1's column block \(file '.*b\.npy'\): no such file"
    ):
        blocks.load(1, 2)
    with pytest.raises(ValueError, match="2 column blocks were given for a job of 3 ranks"):
        blocks.load(0, 3)
    cases = {
        "must be 2-D": np.ones(3),
        "must hold numbers": np.array([["a", "b"]]),
        "holds NaN or infinity": np.array([[1.0, np.inf]]),
    }
    for message, block in cases.items():
        with pytest.raises(ValueError, match=message):
            ColumnBlocks(lambda rank, world_size, block=block: block).load(0, 1)
    # Numbers of other dtypes become float64; float32 and CSR stay as they are.
    assert ColumnBlocks(lambda r, p: np.ones((2, 2), dtype=int)).load(0, 1).dtype == np.float64
    assert ColumnBlocks(lambda r, p: np.ones((2, 2), np.float32)).load(0, 1).dtype == np.float32
    loaded = ColumnBlocks(lambda r, p: sp.coo_matrix(np.eye(2))).load(0, 1)
    assert sp.isspmatrix_csr(loaded)


def test_a_memory_mapped_block_is_read_in_place(tmp_path):
    X = np.arange(12.0).reshape(4, 3)
    np.save(tmp_path / "b.npy", X)
    loaded = ColumnBlocks.from_files([tmp_path / "b.npy"]).load(0, 1)
    assert isinstance(loaded, np.memmap)
    np.testing.assert_array_equal(loaded, X)


def test_a_block_files_header_is_checked_before_anything_is_allocated(tmp_path):
    """A few KB that declare terabytes, or other rows than y: refused from the header alone."""
    bomb = tmp_path / "bomb.npz"
    sp.save_npz(bomb, sp.csr_matrix((100, 10**12)))
    with pytest.raises(ValueError, match=r"bomb\.npz'\) declares 100 x 1000000000000 values"):
        ColumnBlocks.from_files([bomb]).load(0, 1, n_rows=100)
    rows = tmp_path / "rows.npz"
    sp.save_npz(rows, sp.csr_matrix((50, 3)))
    with pytest.raises(ValueError, match="declares 50 rows where y has 100"):
        ColumnBlocks.from_files([rows]).load(0, 1, n_rows=100)
    np.save(tmp_path / "words.npy", np.array([["a", "b"]]))
    with pytest.raises(ValueError, match="declares dtype <U1: a block holds real numbers"):
        ColumnBlocks.from_files([tmp_path / "words.npy"]).load(0, 1)
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    table = pyarrow.table({"a": np.zeros(5_000_000), "b": np.zeros(5_000_000)})
    parquet.write_table(table, tmp_path / "long.parquet")
    before = _peak_rss()
    with pytest.raises(ValueError, match="declares 5000000 rows where y has 100"):
        ColumnBlocks.from_files([tmp_path / "long.parquet"]).load(0, 1, n_rows=100)
    assert _peak_rss() - before < 40 * 2**20  # the 80 MB block was never allocated


def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
