"""Checkpoints: a fit interrupted after a checkpoint and fitted again ends where it would have.

The reference is the same fit run without interruption (and without a
checkpoint directory): on the CPU every step is deterministic, so a
resumed fit must reproduce its coefficients, epochs and loss curve bit for
bit (the issue asks 1e-12 in float64; bf16 storage is held to the same).
An interruption is an exception raised from inside an epoch, or a rank
SIGKILLed (a worker of a pool, a rank of a torchrun job).
"""

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import run_torchrun
from sklearn.datasets import load_breast_cancer, load_wine
from sklearn.preprocessing import StandardScaler
from sklearn.utils._param_validation import InvalidParameterError

from sklearn_casgd import (
    CASGDLinearRegression,
    CASGDLogisticRegression,
    CASGDPoissonRegressor,
    WorkerPool,
)
from sklearn_casgd._distributed.failures import DistributedFitError
from sklearn_casgd._engine import checkpoint, solver
from sklearn_casgd.datasets import make_glm_data

HERE = Path(__file__).parent
FLOAT64 = dict(precision="fp64", device="cpu", random_state=0)


class Interrupted(Exception):
    """Stands for the fit's process dying mid-epoch."""


@pytest.fixture
def interrupt_at_epoch(monkeypatch):
    """``interrupt_at_epoch(n)``: the next fits raise ``Interrupted`` when epoch ``n`` starts.

    Epochs count from 1 over every fit that follows; ``interrupt_at_epoch(None)``
    lets them run.
    """
    original = solver._Run.epoch
    calls = {"count": 0, "at": None}

    def epoch(self, data):
        calls["count"] += 1
        if calls["at"] is not None and calls["count"] >= calls["at"]:
            raise Interrupted
        return original(self, data)

    monkeypatch.setattr(solver._Run, "epoch", epoch)

    def arm(at):
        calls["count"], calls["at"] = 0, at

    return arm


def _manifest_epoch(directory):
    return json.loads((Path(directory) / checkpoint.MANIFEST).read_text())["epoch"]


def _data(kind):
    if kind == "breast_cancer":
        X, y = load_breast_cancer(return_X_y=True)
        return StandardScaler().fit_transform(X), y
    if kind == "wine":  # unscaled
        return load_wine(return_X_y=True)
    X, y, _ = make_glm_data(kind, 1500, 8, random_state=0)
    return X, y


# (estimator, data, steps the planner is expected to take, epoch interrupted,
#  checkpoint_every)
CASES = {
    "logistic-minibatch": (
        CASGDLogisticRegression(batch_size=32, tol=1e-8, **FLOAT64),
        "logistic",
        "rows",
        6,
        2,
    ),
    "logistic-newton-real": (
        CASGDLogisticRegression(tol=1e-10, **FLOAT64),
        "breast_cancer",
        "newton",
        4,
        2,
    ),
    # Epoch 9's step is undone: the checkpoint after it holds a curvature and
    # a last step both taken at the weights kept.
    "wine-newton-undone": (
        CASGDLogisticRegression(tol=1e-10, alpha=1e-6, **FLOAT64),
        "wine",
        "newton",
        10,
        1,
    ),
    "multinomial-newton": (
        CASGDLogisticRegression(tol=1e-10, **FLOAT64),
        "multinomial",
        "newton",
        4,
        2,
    ),
    "poisson-newton": (CASGDPoissonRegressor(tol=1e-10, **FLOAT64), "poisson", "newton", 4, 2),
    # A constant Hessian: the curvature formed at the start serves every epoch.
    "linear-newton": (CASGDLinearRegression(tol=1e-12, **FLOAT64), "linear", "newton", 2, 1),
    "sgd": (
        CASGDLogisticRegression(solver="sgd", max_iter=12, **FLOAT64),
        "logistic",
        "rows",
        7,
        2,
    ),
    # The running sum of the iterates travels with the weights, its counts with the loop.
    "sgd-averaged": (
        CASGDLogisticRegression(solver="sgd", average=50, s=4, max_iter=12, **FLOAT64),
        "logistic",
        "rows",
        7,
        2,
    ),
    "bf16-minibatch": (
        CASGDLogisticRegression(batch_size=32, device="cpu", random_state=0),
        "logistic",
        "rows",
        5,
        2,
    ),
    "early-stopping": (
        CASGDLogisticRegression(
            batch_size=16, tol=1e-6, early_stopping=True, n_iter_no_change=2, **FLOAT64
        ),
        "multinomial",
        "rows",
        3,
        1,
    ),
}


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # plain SGD
@pytest.mark.parametrize("case", CASES)
def test_a_fit_interrupted_resumes_to_the_uninterrupted_fit(case, tmp_path, interrupt_at_epoch):
    estimator, data, steps, interrupted, every = CASES[case]
    X, y = _data(data)
    reference = estimator.fit(X, y)
    assert reference.fit_stats_["execution"]["steps"] == steps
    assert reference.n_iter_ >= interrupted  # the interruption falls inside the fit
    coef, intercept, curve = (
        reference.coef_.copy(),
        reference.intercept_.copy(),
        reference.loss_curve_,
    )

    estimator.set_params(checkpoint_dir=tmp_path, checkpoint_every=every)
    interrupt_at_epoch(interrupted)
    with pytest.raises(Interrupted):
        estimator.fit(X, y)
    saved = _manifest_epoch(tmp_path)
    assert saved == every * ((interrupted - 1) // every)
    interrupt_at_epoch(None)
    estimator.fit(X, y)

    np.testing.assert_array_equal(estimator.coef_, coef)
    np.testing.assert_array_equal(estimator.intercept_, intercept)
    np.testing.assert_array_equal(estimator.loss_curve_, curve)
    assert estimator.n_iter_ == reference.n_iter_
    # A resume, not a refit from scratch: only the epochs after the checkpoint ran.
    assert estimator.fit_stats_["epochs_run"] == reference.n_iter_ - saved


def test_a_sparse_fit_resumes_to_the_uninterrupted_fit(tmp_path, interrupt_at_epoch):
    X, y = _data("logistic")
    X = sp.csr_matrix(np.where(np.abs(X) < 0.7, 0.0, X))
    estimator = CASGDLogisticRegression(batch_size=16, s=4, max_iter=8, tol=None, **FLOAT64)
    coef = estimator.fit(X, y).coef_.copy()
    estimator.set_params(checkpoint_dir=tmp_path, checkpoint_every=3)
    interrupt_at_epoch(5)
    with pytest.raises(Interrupted):
        estimator.fit(X, y)
    assert _manifest_epoch(tmp_path) == 3
    interrupt_at_epoch(None)
    np.testing.assert_array_equal(estimator.fit(X, y).coef_, coef)
    assert estimator.fit_stats_["epochs_run"] == 8 - 3


def test_a_finished_fit_on_its_directory_runs_no_epoch(tmp_path, interrupt_at_epoch):
    X, y = _data("logistic")
    estimator = CASGDLogisticRegression(
        batch_size=32, tol=1e-6, checkpoint_dir=tmp_path, checkpoint_every=100, **FLOAT64
    ).fit(X, y)
    coef, n_iter = estimator.coef_.copy(), estimator.n_iter_
    assert _manifest_epoch(tmp_path) == n_iter  # the last epoch is checkpointed whatever k
    interrupt_at_epoch(1)  # any epoch run would raise
    estimator.fit(X, y)
    np.testing.assert_array_equal(estimator.coef_, coef)
    assert estimator.n_iter_ == n_iter and estimator.fit_stats_["converged"]
    assert estimator.fit_stats_["epochs_run"] == 0


def test_a_longer_max_iter_continues_a_shorter_fit(tmp_path):
    X, y = _data("logistic")
    params = dict(solver="sgd", tol=None, batch_size=32, **FLOAT64)
    longer = CASGDLogisticRegression(max_iter=9, **params).fit(X, y)
    shorter = CASGDLogisticRegression(max_iter=4, checkpoint_dir=tmp_path, **params).fit(X, y)
    assert shorter.n_iter_ == 4
    shorter.set_params(max_iter=9).fit(X, y)
    assert shorter.fit_stats_["epochs_run"] == 9 - 4
    np.testing.assert_array_equal(shorter.coef_, longer.coef_)
    np.testing.assert_array_equal(shorter.loss_curve_, longer.loss_curve_)


def test_each_checkpoint_leaves_one_file_per_rank_and_a_manifest(tmp_path):
    X, y = _data("logistic")
    CASGDLogisticRegression(
        solver="sgd", tol=None, max_iter=5, checkpoint_dir=tmp_path, checkpoint_every=2, **FLOAT64
    ).fit(X, y)
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "rank-0-epoch-5.pt"]


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(alpha=1e-3), "alpha ('0.001' there, '0.0001' here)"),
        (dict(fit_intercept=False), "fit_intercept"),
        (dict(precision="fp32"), "precision"),
        (dict(data="rows"), "data"),
        (dict(data="targets"), "data"),
        (dict(estimator=CASGDPoissonRegressor), "estimator"),
    ],
)
def test_a_checkpoint_of_another_fit_is_refused_naming_what_differs(tmp_path, change, named):
    X, y, _ = make_glm_data("poisson", 400, 5, random_state=0)
    params = {**FLOAT64, **change}
    estimator_class = params.pop("estimator", CASGDLinearRegression)
    data = params.pop("data", None)
    estimator_class(max_iter=3, tol=None, checkpoint_dir=tmp_path, **params).fit(X, y)
    if data == "rows":
        X = X[::-1].copy()
    elif data == "targets":
        y = y + 1.0
    with pytest.raises(ValueError, match="written by another fit") as error:
        CASGDLinearRegression(max_iter=3, tol=None, checkpoint_dir=tmp_path, **FLOAT64).fit(X, y)
    assert named in str(error.value)


def test_a_torn_checkpoint_resumes_the_last_complete_one(tmp_path, monkeypatch):
    """Killed after its own file of epoch 4 but before the manifest: epoch 2's is resumed."""
    X, y = _data("logistic")
    params = dict(solver="sgd", tol=None, max_iter=8, batch_size=32, **FLOAT64)
    coef = CASGDLogisticRegression(**params).fit(X, y).coef_.copy()
    atomic_write = checkpoint._atomic_write

    def write(path, contents):
        if path.name == checkpoint.MANIFEST and (tmp_path / "rank-0-epoch-4.pt").exists():
            (tmp_path / ".manifest.json.123.tmp").write_text("{")  # a write cut short
            raise Interrupted
        atomic_write(path, contents)

    monkeypatch.setattr(checkpoint, "_atomic_write", write)
    estimator = CASGDLogisticRegression(checkpoint_dir=tmp_path, checkpoint_every=2, **params)
    with pytest.raises(Interrupted):
        estimator.fit(X, y)
    assert (tmp_path / "rank-0-epoch-4.pt").exists() and _manifest_epoch(tmp_path) == 2
    monkeypatch.setattr(checkpoint, "_atomic_write", atomic_write)
    np.testing.assert_array_equal(estimator.fit(X, y).coef_, coef)
    assert sorted(os.listdir(tmp_path))[-2:] == ["manifest.json", "rank-0-epoch-8.pt"]


def test_a_missing_or_damaged_rank_file_is_named(tmp_path, interrupt_at_epoch):
    X, y = _data("logistic")
    estimator = CASGDLogisticRegression(
        solver="sgd", tol=None, max_iter=6, checkpoint_dir=tmp_path, checkpoint_every=2, **FLOAT64
    )
    interrupt_at_epoch(4)
    with pytest.raises(Interrupted):
        estimator.fit(X, y)
    interrupt_at_epoch(None)
    rank_file = tmp_path / "rank-0-epoch-2.pt"
    rank_file.write_bytes(b"not a checkpoint")
    with pytest.raises(
        ValueError, match=r"Rank 0 cannot resume .* rank-0-epoch-2\.pt is damaged: its SHA-256"
    ):
        estimator.fit(X, y)
    rank_file.unlink()
    with pytest.raises(ValueError, match=r"rank-0-epoch-2\.pt it is missing"):
        estimator.fit(X, y)
    (tmp_path / checkpoint.MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        estimator.fit(X, y)


def test_bad_checkpoint_settings_are_clear_errors(tmp_path):
    X, y = _data("logistic")
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        CASGDLogisticRegression(checkpoint_dir=a_file, max_iter=2).fit(X, y)
    with pytest.raises(ValueError, match="early_stopping with checkpoint_dir needs an int"):
        CASGDLogisticRegression(
            checkpoint_dir=tmp_path / "new", early_stopping=True, max_iter=2
        ).fit(X, y)
    with pytest.raises(InvalidParameterError, match="checkpoint_every"):
        CASGDLogisticRegression(checkpoint_dir=tmp_path, checkpoint_every=0).fit(X, y)
    with pytest.raises(InvalidParameterError, match="checkpoint_dir"):
        CASGDLogisticRegression(checkpoint_dir=3).fit(X, y)


def test_partial_fit_writes_no_checkpoint(tmp_path):
    X, y = _data("logistic")
    CASGDLogisticRegression(checkpoint_dir=tmp_path).partial_fit(X, y, classes=[0, 1])
    assert os.listdir(tmp_path) == []


def _kill_when_written(directory, epoch, pid):
    """SIGKILL ``pid`` once ``directory`` holds the checkpoint of ``epoch``; in a thread."""

    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if _manifest_epoch(directory) >= epoch:
                    os.kill(pid, signal.SIGKILL)
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.002)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.distributed
def test_a_pool_rank_killed_mid_fit_resumes_on_the_next_fit(tmp_path):
    X, y, _ = make_glm_data("logistic", 3000, 10, random_state=0)
    params = dict(
        solver="sgd", s=4, batch_size=16, max_iter=12, tol=None, n_devices=2, timeout=30, **FLOAT64
    )
    with WorkerPool(2) as pool:
        coef = CASGDLogisticRegression(**params).fit(X, y).coef_.copy()
        watcher = _kill_when_written(tmp_path, 2, pool.pids[1])
        estimator = CASGDLogisticRegression(checkpoint_dir=tmp_path, **params)
        with pytest.raises(DistributedFitError, match="SIGKILL"):
            estimator.fit(X, y)
        watcher.join()
    resumed_from = _manifest_epoch(tmp_path)
    assert 2 <= resumed_from < 12
    with WorkerPool(2):
        estimator.fit(X, y)
    np.testing.assert_array_equal(estimator.coef_, coef)
    assert estimator.n_iter_ == 12
    assert estimator.fit_stats_["epochs_run"] == 12 - resumed_from


@pytest.mark.distributed
def test_a_torchrun_job_restarted_after_a_rank_is_killed_resumes(tmp_path):
    """4 ranks, ``--max-restarts=1``: rank 1 dies after epoch 2's checkpoint; the job resumes."""
    checkpoint_dir = tmp_path / "checkpoints"
    run_torchrun(
        HERE / "checkpoint_world_script.py",
        tmp_path,
        checkpoint_dir,
        timeout=300,
        nproc=4,
        max_restarts=1,
    )
    out = np.load(tmp_path / "rank0.npz")
    assert int(out["attempt"]) == 1  # the job was restarted ...
    assert 2 <= int(out["resumed_from"]) < 12  # ... and resumed mid-fit
    np.testing.assert_array_equal(out["fitted"], out["uninterrupted"])
    assert int(out["n_iter"]) == 12
    assert int(out["epochs_run"]) == 12 - int(out["resumed_from"])


def _interrupted_checkpoint(tmp_path, interrupt_at_epoch, **params):
    """A logistic fit interrupted after its checkpoint of epoch 2, and the estimator."""
    X, y = _data("logistic")
    estimator = CASGDLogisticRegression(
        solver="sgd", tol=None, max_iter=6, checkpoint_dir=tmp_path, checkpoint_every=2,
        **FLOAT64, **params,
    )  # fmt: skip
    interrupt_at_epoch(3)
    with pytest.raises(Interrupted):
        estimator.fit(X, y)
    interrupt_at_epoch(None)
    return estimator, X, y


def _rewrite_manifest(directory, change):
    """Edit the manifest's fields with ``change`` and sign it again, as a forger would."""
    path = Path(directory) / checkpoint.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest["checksum"] = checkpoint._manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))


def test_one_flipped_byte_of_a_rank_file_is_caught_before_it_becomes_the_model(
    tmp_path, interrupt_at_epoch
):
    """torch's zip reader checks no checksum: the manifest's SHA-256 does."""
    estimator, X, y = _interrupted_checkpoint(tmp_path, interrupt_at_epoch)
    rank_file = tmp_path / "rank-0-epoch-2.pt"
    payload = bytearray(rank_file.read_bytes())
    payload[len(payload) // 2] ^= 0x40  # inside the tensors' data
    rank_file.write_bytes(bytes(payload))
    with pytest.raises(ValueError, match=r"rank-0-epoch-2\.pt is damaged: its SHA-256"):
        estimator.fit(X, y)
    assert not hasattr(estimator, "coef_")


def test_a_damaged_or_forged_manifest_is_refused_naming_the_field(tmp_path, interrupt_at_epoch):
    estimator, X, y = _interrupted_checkpoint(tmp_path, interrupt_at_epoch)
    path = tmp_path / checkpoint.MANIFEST
    intact = path.read_text()
    path.write_text(intact.replace('"s": 1', '"s": 3'))  # a changed byte, not signed again
    with pytest.raises(ValueError, match=r"manifest .* is damaged: its SHA-256"):
        estimator.fit(X, y)
    path.write_text(intact)
    _rewrite_manifest(tmp_path, lambda manifest: manifest["loop"].update(s=-3))
    with pytest.raises(ValueError, match=r"not one this library wrote: loop\.s=-3"):
        estimator.fit(X, y)
    path.write_text(intact)
    _rewrite_manifest(tmp_path, lambda manifest: manifest.update(epoch="2"))
    with pytest.raises(ValueError, match="epoch='2' is not a positive int"):
        estimator.fit(X, y)


def test_an_unpickling_checkpoint_is_refused_without_torchs_advice(tmp_path, interrupt_at_epoch):
    """A rank file that holds objects: refused, and never the advice to unpickle it."""
    import hashlib
    import pickle

    estimator, X, y = _interrupted_checkpoint(tmp_path, interrupt_at_epoch)
    rank_file = tmp_path / "rank-0-epoch-2.pt"
    payload = pickle.dumps({"coef": os.system})
    rank_file.write_bytes(payload)
    digest = hashlib.sha256(payload).hexdigest()
    _rewrite_manifest(tmp_path, lambda manifest: manifest["files"].update({rank_file.name: digest}))
    with pytest.raises(ValueError, match="holds objects other than tensors") as raised:
        estimator.fit(X, y)
    assert "weights_only=False" not in str(raised.value)


def test_checkpoints_are_private_and_dead_writers_temporaries_go(tmp_path, interrupt_at_epoch):
    directory = tmp_path / "checkpoints"
    estimator, X, y = _interrupted_checkpoint(directory, interrupt_at_epoch)
    assert directory.stat().st_mode & 0o777 == 0o700
    for name in os.listdir(directory):
        assert (directory / name).stat().st_mode & 0o777 == 0o600, name
    stray = directory / ".rank-0-epoch-4.pt.4242.tmp"
    stray.write_bytes(b"half a file")
    estimator.fit(X, y)
    assert not stray.exists()


def test_other_weights_do_not_resume_the_checkpoint(tmp_path, interrupt_at_epoch):
    """Permuted weights keep their sum: the fingerprint sees every weight."""
    X, y = _data("logistic")
    weights = np.where(np.arange(len(y)) % 2 == 0, 0.5, 1.5)
    estimator = CASGDLogisticRegression(
        solver="sgd", tol=None, max_iter=6, checkpoint_dir=tmp_path, checkpoint_every=2, **FLOAT64
    )
    interrupt_at_epoch(3)
    with pytest.raises(Interrupted):
        estimator.fit(X, y, sample_weight=weights)
    interrupt_at_epoch(None)
    with pytest.raises(ValueError, match="differs in: data"):
        estimator.fit(X, y, sample_weight=weights[::-1].copy())
