"""Does the test suite notice? Deliberate bugs applied to a copy of the library, one at a time.

Each mutation replaces one line of the library (in a copy of the working
tree under a temporary folder; the tree itself is never touched) and runs
the tests that should catch it. A mutation is caught when those tests fail.
The mutations are the kinds of bug the tests once missed (issue 55's audit)
and a few they always caught, kept as a control:

* ``unfinished checkpoint ignored``: a fit never resumes (a deterministic
  refit from scratch ends where the resumed fit would);
* ``ragged batch dropped``: an epoch's last, short batch skipped on every
  side (one rank and two alike);
* ``weights misaligned``: the engine reads the sample weights reversed;
* ``gradient 1 % off``, ``averaging all-reduce``: controls.

    python benchmarks/mutation_audit.py [--mutations NAME,...] [--csv audit.csv]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _table import print_table, write_csv

ROOT = Path(__file__).resolve().parent.parent

# name: (file, the line's text as it stands, its replacement, the tests that must notice)
MUTATIONS = {
    "unfinished checkpoint ignored": (
        "sklearn_casgd/_estimators/_base.py",
        "directory, int(self.checkpoint_every), identity, resumable(directory, identity)",
        "directory, int(self.checkpoint_every), identity, None",
        ["tests/test_checkpoint.py"],
    ),
    "ragged batch dropped": (
        "sklearn_casgd/_engine/epochs.py",
        "return [batch_size] * full + ([tail] if tail else [])",
        "return [batch_size] * full or [tail]",
        [
            "tests/test_equivalence.py",
            "tests/test_distributed.py::test_two_ranks_equal_one_rank_in_float64",
        ],
    ),
    "weights misaligned": (
        "sklearn_casgd/_engine/fit.py",
        "sample_weight=torch.tensor(sample_weight, dtype=rec, device=device),",
        "sample_weight=torch.tensor(sample_weight[::-1].copy(), dtype=rec, device=device),",
        ["tests/test_sparse_newton.py", "tests/test_weights.py"],
    ),
    "gradient 1 % off": (
        "sklearn_casgd/_engine/snapshot.py",
        "    mean_gradient /= n_samples\n",
        "    mean_gradient /= 0.99 * n_samples\n",
        ["tests/test_equivalence.py"],
    ),
    "averaging all-reduce": (
        "sklearn_casgd/_engine/comm.py",
        "        self._start_all_reduce(buffer, yield_after=True).wait()",
        "        self._start_all_reduce(buffer, yield_after=True).wait()\n        buffer /= 2",
        ["tests/test_distributed.py::test_two_ranks_equal_one_rank_in_float64"],
    ),
}


def mutate(tree: Path, file: str, old: str, new: str) -> None:
    """Replace the one occurrence of ``old`` in ``tree / file`` with ``new``."""
    path = tree / file
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{file}: the mutation's line is found {text.count(old)} times, not once")
    path.write_text(text.replace(old, new))


def run_tests(tree: Path, tests: list[str], timeout: float) -> tuple[bool, str]:
    """Run ``tests`` on the mutated copy; whether they failed, and pytest's last line."""
    present = [test for test in tests if (tree / test.split("::")[0]).exists()]
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *present]
    env_path = str(tree)
    completed = subprocess.run(
        command,
        cwd=tree,
        env={**_environment(), "PYTHONPATH": env_path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in completed.stdout.splitlines() if line.strip()]
    return completed.returncode != 0, lines[-1] if lines else completed.stderr[-200:]


def _environment() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutations", default=",".join(MUTATIONS))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--csv")
    args = parser.parse_args()
    header = ["mutation", "tests", "caught", "seconds", "pytest"]
    rows = []
    for name in args.mutations.split(","):
        file, old, new, tests = MUTATIONS[name]
        with tempfile.TemporaryDirectory() as folder:
            tree = Path(folder) / "tree"
            shutil.copytree(
                ROOT,
                tree,
                ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "_build"),
            )
            mutate(tree, file, old, new)
            started = time.perf_counter()
            caught, last = run_tests(tree, tests, args.timeout)
        rows.append([name, " ".join(tests), caught, f"{time.perf_counter() - started:.0f}", last])
        print("  ".join(str(v) for v in rows[-1]), flush=True)
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)
    if not all(row[2] for row in rows):
        raise SystemExit("some mutations were not caught")


if __name__ == "__main__":
    main()
