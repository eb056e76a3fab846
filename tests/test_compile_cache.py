"""Nothing compiles while torch.compile's default cache folder is open to other users.

Inductor loads compiled code back from ``<tempdir>/torchinductor_<user>``
by content hash; these tests plant that folder the ways another local
user could (writable by all, a link, someone else's) and check that a fit
refuses to compile, with ``compile=True``, or runs eager with a warning,
with ``compile="auto"``, and writes nothing into it.
"""

import os
import stat
import tempfile

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer
from sklearn.preprocessing import StandardScaler

from sklearn_casgd import CASGDLogisticRegression, UnsafeCompileCacheError
from sklearn_casgd._accel.compile_cache import (
    check_compile_caches,
    default_cache_folders,
    unsafe_folder_reason,
)
from sklearn_casgd._engine import execution

posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")


@posix_only
def test_a_missing_folder_is_created_private(tmp_path):
    folder = tmp_path / "torchinductor_me"
    assert unsafe_folder_reason(folder) is None
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert unsafe_folder_reason(folder) is None  # and accepted once it exists


@posix_only
@pytest.mark.parametrize("mode", [0o777, 0o757, 0o703])
def test_a_folder_others_can_write_is_refused(tmp_path, mode):
    folder = tmp_path / "torchinductor_me"
    folder.mkdir()
    folder.chmod(mode)
    assert "other users can write into it" in unsafe_folder_reason(folder)
    folder.chmod(0o755)  # readable by others is no threat to what is loaded
    assert unsafe_folder_reason(folder) is None


@posix_only
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs chown")
def test_a_folder_its_group_can_write_is_refused_unless_the_group_is_the_users(tmp_path):
    import grp
    import pwd

    folder = tmp_path / "torchinductor_me"
    folder.mkdir(mode=0o700)
    folder.chmod(0o770)
    os.chown(folder, -1, 65534)  # a group of other users
    assert "other users can write into it" in unsafe_folder_reason(folder)
    own = grp.getgrgid(os.getegid())
    if own.gr_name == pwd.getpwuid(os.geteuid()).pw_name and not set(own.gr_mem) - {own.gr_name}:
        os.chown(folder, -1, os.getegid())  # what umask 002 with user private groups makes
        assert unsafe_folder_reason(folder) is None


@posix_only
def test_a_link_or_a_file_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "torchinductor_me"
    link.symlink_to(target)
    assert unsafe_folder_reason(link) == "it is a symbolic link"
    link.unlink()
    link.write_text("")
    assert unsafe_folder_reason(link) == "it is not a folder"


@posix_only
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs chown")
def test_a_folder_of_another_user_is_refused(tmp_path):
    folder = tmp_path / "torchinductor_me"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)
    assert "belongs to user id 65534" in unsafe_folder_reason(folder)


@posix_only
def test_a_shared_parent_must_be_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # others could rename the folder and put theirs in its place
    assert "writable by other users and not sticky" in unsafe_folder_reason(shared / "t")
    shared.chmod(0o1777)  # as /tmp is
    assert unsafe_folder_reason(shared / "t") is None


@pytest.fixture
def planted_cache(tmp_path, monkeypatch):
    """torch's default cache folder, made writable by everyone before the fit."""
    default_cache_folders()  # imports inductor (which creates its folder) before the patch
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = default_cache_folders()[0]
    assert folder.parent == tmp_path
    folder.mkdir(exist_ok=True)  # naming the folders makes it (0700) where missing
    folder.chmod(0o777)
    return folder


def breast_cancer():
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), y


@posix_only
def test_compile_true_refuses_a_planted_cache_folder(planted_cache):
    X, y = breast_cancer()
    with pytest.raises(UnsafeCompileCacheError, match="other users can write into it"):
        check_compile_caches()
    model = CASGDLogisticRegression(compile=True, s=4, batch_size=32, max_iter=2, tol=None)
    with pytest.raises(UnsafeCompileCacheError, match=str(planted_cache)):
        model.fit(X, y)
    assert list(planted_cache.iterdir()) == []


@posix_only
def test_compile_auto_runs_eager_beside_a_planted_cache_folder(planted_cache, monkeypatch):
    monkeypatch.setitem(execution.AUTO_COMPILE_MIN_OUTER, "cpu", 1)
    X, y = breast_cancer()
    params = dict(s=4, batch_size=32, max_iter=2, tol=None, random_state=0)
    with pytest.warns(RuntimeWarning, match="compile='auto'.*not safe to load compiled code"):
        model = CASGDLogisticRegression(compile="auto", **params).fit(X, y)
    assert model.fit_stats_["compiled"] is False
    eager = CASGDLogisticRegression(compile=False, **params).fit(X, y)
    np.testing.assert_array_equal(model.coef_, eager.coef_)
    assert list(planted_cache.iterdir()) == []


@posix_only
def test_workers_of_a_distributed_fit_refuse_a_planted_cache_folder(tmp_path, monkeypatch):
    """Each worker compiles its own steps, so each checks its own temporary folder."""
    from sklearn_casgd import DistributedFitError, WorkerPool

    planted = tmp_path / default_cache_folders()[0].name  # torchinductor_<user>
    planted.mkdir()
    planted.chmod(0o777)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the workers' temporary folder
    X, y = breast_cancer()
    model = CASGDLogisticRegression(
        n_devices=2, compile=True, s=4, batch_size=32, max_iter=2, tol=None, device="cpu"
    )
    with WorkerPool(2), pytest.raises(DistributedFitError, match="not safe to load compiled code"):
        model.fit(X, y)
    assert list(planted.iterdir()) == []


@posix_only
def test_the_default_folder_is_made_private_before_inductor_creates_it(tmp_path, monkeypatch):
    """Importing inductor makes its folder 0755: it is made 0700 first, where missing."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = default_cache_folders()[0]
    assert folder.parent == tmp_path
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
