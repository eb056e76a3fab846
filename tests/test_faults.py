"""Faults that must end in a clear error, never a crash: each run in a child process.

A child process, so that a regression (a kernel reading outside its arrays)
fails this test instead of killing the test run. The table of faults, what
each must do and where it is tested is ``docs/reliability.md``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_child(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter run in ``cwd`` (never this checkout: it would shadow)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


DAMAGES = {
    "column too large": ("X.indices[5] = 7", "column 7, outside its 6 columns"),
    "negative column": ("X.indices[5] = -3", "column -3, outside its 6 columns"),
    "decreasing pointers": ("X.indptr[10] = X.indptr[11] + 2", "decrease at row"),
    "pointer past the end": ("X.indptr[-1] = X.indptr[-1] + 50", "at most the"),
}
CALLS = {
    "fit": "CASGDLogisticRegression(max_iter=2).fit(X, y)",
    "predict": "CASGDLogisticRegression(max_iter=2).fit(sp.csr_matrix(X.shape), y).predict(X)",
    "minibatch fit": "CASGDLogisticRegression(batch_size=8, max_iter=2).fit(X, y)",
}
BAD_CSR = """
import json, sys
import numpy as np, scipy.sparse as sp
from sklearn_casgd import CASGDLogisticRegression
outcomes = {}
for damage_name, damage in json.loads(sys.argv[1]).items():
    for call_name, call in json.loads(sys.argv[2]).items():
        X = sp.random(200, 6, density=0.4, format="csr", random_state=0)
        y = np.arange(200) % 2
        exec(damage)
        try:
            exec(call)
            outcomes[damage_name + "/" + call_name] = "no error"
        except ValueError as error:
            outcomes[damage_name + "/" + call_name] = f"ValueError: {error}"
print(json.dumps(outcomes))
"""


@pytest.fixture(scope="module")
def csr_outcomes(tmp_path_factory):
    """Every damage x call, in one child process (a crash fails every case)."""
    damages = {name: damage for name, (damage, _) in DAMAGES.items()}
    child = subprocess.run(
        [sys.executable, "-c", BAD_CSR, json.dumps(damages), json.dumps(CALLS)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path_factory.mktemp("csr"),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]  # a crash returns a signal's code
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("call", list(CALLS))
def test_a_malformed_csr_is_a_clear_error_not_a_crash(csr_outcomes, damage, call):
    outcome = csr_outcomes[f"{damage}/{call}"]
    assert outcome.startswith("ValueError:") and DAMAGES[damage][1] in outcome, outcome


def test_a_read_only_install_fits_and_writes_nothing_into_the_package(tmp_path):
    """``pip install --target`` then ``chmod -R a-w``: a sparse fit (numba's kernel) runs."""
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if install.returncode != 0:
        pytest.skip(f"pip cannot build the package here: {install.stderr[-500:]}")
    package = target / "sklearn_casgd"
    files = {path: path.stat().st_mtime_ns for path in package.rglob("*")}
    for path in [package, *package.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        child = run_child(
            """
            import numpy as np, scipy.sparse as sp
            import sklearn_casgd
            from sklearn_casgd import CASGDLogisticRegression
            X = sp.random(300, 20, density=0.2, format="csr", random_state=0)
            y = np.arange(300) % 2
            model = CASGDLogisticRegression(batch_size=8, max_iter=3, tol=None).fit(X, y)
            print(sklearn_casgd.__file__, model.fit_stats_["execution"]["epoch_kernel"])
            """,
            tmp_path,
            env={"PYTHONPATH": str(target), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                 "PYTHONDONTWRITEBYTECODE": "1"},
        )  # fmt: skip
    finally:
        for path in [package, *package.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    assert child.returncode == 0, child.stderr[-2000:]
    assert str(target) in child.stdout
    assert {path: path.stat().st_mtime_ns for path in package.rglob("*")} == files
