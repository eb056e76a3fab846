"""The quickstart runs as the README says, and its output is a short table beside scikit-learn."""

import subprocess
import sys
from pathlib import Path

QUICKSTART = Path(__file__).parent.parent / "examples" / "quickstart.py"


def test_quickstart_prints_a_short_table_with_a_baseline():
    completed = subprocess.run(
        [sys.executable, str(QUICKSTART)], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.strip().splitlines()
    assert len(lines) < 40
    for baseline in ("LogisticRegression", "Ridge", "PoissonRegressor"):
        assert any(line.split()[1:2] == [baseline] for line in lines), baseline
